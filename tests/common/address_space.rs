//! The process's mapped address space, for tests that check the simulator gives back
//! exactly what it maps.

/// Bytes of address space this process has mapped (`VmSize` in `/proc/self/status`).
pub fn mapped_bytes() -> i64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let kib: i64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmSize:"))
        .and_then(|v| v.trim().strip_suffix("kB"))
        .and_then(|v| v.trim().parse().ok())
        .expect("VmSize in /proc/self/status");
    kib * 1024
}

/// Whether `exact` holds in one of a few tries.
///
/// The other tests of a binary run on other threads and map memory too. A step that maps
/// exactly what it should shows it in some try where nothing else moved meanwhile; a step
/// that maps a different amount never does.
pub fn in_some_try(mut exact: impl FnMut() -> bool) -> bool {
    (0..50).any(|_| exact())
}
