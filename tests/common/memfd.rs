//! For tests that count the simulator's physical memory objects: a lock to run them one at
//! a time within a test binary, and the count itself.

use std::sync::{Mutex, MutexGuard};

/// Holds other memory-counting tests of this binary off while the guard lives.
pub fn serial() -> MutexGuard<'static, ()> {
    static SERIAL: Mutex<()> = Mutex::new(());
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

/// The name the simulator gives its memory objects.
const OBJECT_NAME: &str = "ascend-pool-sim-physical";

/// Memory objects (memfds) of the simulator open in this process.
pub fn memory_objects() -> usize {
    std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .filter(|t| t.to_string_lossy().contains(OBJECT_NAME))
        .count()
}

/// Mappings of the simulator's memory objects in this process's address space.
#[allow(dead_code)] // not every binary that counts objects counts mappings
pub fn mapped_objects() -> usize {
    std::fs::read_to_string("/proc/self/maps")
        .unwrap()
        .lines()
        .filter(|l| l.contains(OBJECT_NAME))
        .count()
}
