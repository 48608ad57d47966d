//! Lazily mapped host memory standing in for device memory, and the raw byte moves on it.
//!
//! This file and the stream worker's calls into it are the simulator's only `unsafe` code.

use std::ptr::NonNull;

/// One anonymous private mapping, unmapped when dropped.
///
/// Invariants: `addr..addr + len` is a live mapping created by `mmap` with
/// `PROT_READ | PROT_WRITE` that nothing else unmaps; `len > 0`.
#[derive(Debug)]
pub(crate) struct Mapping {
    addr: NonNull<u8>,
    len: usize,
}

// SAFETY: a `Mapping` is an owned region of process memory with no thread affinity; it is
// only read or written through raw pointers whose use the callers synchronise.
unsafe impl Send for Mapping {}
// SAFETY: `&Mapping` only exposes the address and the length, both immutable.
unsafe impl Sync for Mapping {}

impl Mapping {
    /// Maps `len` bytes lazily (`MAP_NORESERVE`): pages cost host memory only once touched.
    ///
    /// Returns `None` when `len` is 0 or the kernel refuses the mapping.
    pub(crate) fn new(len: usize) -> Option<Self> {
        if len == 0 {
            return None;
        }
        // SAFETY: an anonymous mapping at an address of the kernel's choice touches no
        // existing memory; every argument is valid for `mmap` and the result is checked.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return None;
        }
        let addr = NonNull::new(ptr.cast::<u8>())?;
        Some(Self { addr, len })
    }

    /// Start address (page-aligned, so 64- and 128-aligned too).
    pub(crate) fn addr(&self) -> usize {
        self.addr.as_ptr() as usize
    }

    /// Mapped length in bytes.
    pub(crate) fn len(&self) -> usize {
        self.len
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: by the type invariant `addr..addr + len` is a mapping we own and that no
        // one else unmaps; every user of its bytes holds an `Arc` to it, so none is left.
        let rc = unsafe { libc::munmap(self.addr.as_ptr().cast(), self.len) };
        debug_assert_eq!(rc, 0, "munmap of a simulator block failed");
    }
}

/// Copies `count` bytes from `src` to `dst`; the ranges may overlap.
///
/// # Safety
/// `src..src + count` must be readable and `dst..dst + count` writable for the whole call,
/// and no one else may write either range meanwhile.
pub(super) unsafe fn copy_bytes(dst: usize, src: usize, count: usize) {
    if count == 0 {
        return;
    }
    // SAFETY: the caller guarantees both ranges are valid; `copy` handles overlap.
    unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, count) }
}

/// Fills `count` bytes at `dst` with `value`.
///
/// # Safety
/// `dst..dst + count` must be writable for the whole call and not accessed by anyone else.
pub(super) unsafe fn fill_bytes(dst: usize, value: u8, count: usize) {
    if count == 0 {
        return;
    }
    // SAFETY: the caller guarantees the range is valid and exclusively ours.
    unsafe { std::ptr::write_bytes(dst as *mut u8, value, count) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn maps_and_unmaps() {
        let m = Mapping::new(100).unwrap();
        assert_eq!(m.addr() % 4096, 0);
        assert_eq!(m.len(), 100);
        // SAFETY: the 100 bytes are mapped read/write and only this test uses them.
        unsafe {
            fill_bytes(m.addr(), 7, 100);
            copy_bytes(m.addr() + 50, m.addr(), 10);
            assert_eq!(*((m.addr() + 55) as *const u8), 7);
        }
        assert!(Mapping::new(0).is_none());
    }
}
