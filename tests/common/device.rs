//! Reading and writing device memory through a block source's own `aclrtMemcpy`.

use ascend_pool::source::{BlockSource, MemcpyKind};

/// Copies `data` to device memory at `addr`.
#[allow(dead_code)] // not every binary writes
pub fn write(src: &dyn BlockSource, addr: usize, data: &[u8]) {
    // SAFETY: callers pass ranges of live device memory that nothing else uses meanwhile;
    // the source checks the device side.
    unsafe {
        src.memcpy(
            addr,
            data.len() as u64,
            data.as_ptr() as usize,
            data.len() as u64,
            MemcpyKind::HostToDevice,
        )
        .unwrap()
    }
}

/// `len` bytes of device memory at `addr`.
pub fn read(src: &dyn BlockSource, addr: usize, len: usize) -> Vec<u8> {
    let mut out = vec![0u8; len];
    // SAFETY: as in `write`; `out` is `len` writable bytes.
    unsafe {
        src.memcpy(
            out.as_mut_ptr() as usize,
            len as u64,
            addr,
            len as u64,
            MemcpyKind::DeviceToHost,
        )
        .unwrap()
    }
    out
}
