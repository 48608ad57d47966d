//! Lazily mapped host memory standing in for device memory, and the raw byte moves on it;
//! the address-space calls behind the simulated virtual memory (reservations, shareable
//! memory objects mapped into them).
//!
//! This file, the stream worker's calls into it and the descriptor passing of `share.rs`
//! are the simulator's only `unsafe` code.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::ptr::NonNull;

/// One mapping of host memory: an anonymous private mapping unmapped when dropped, or a
/// view of a virtual-memory mapping that the VMM code maps and unmaps itself.
///
/// Invariants: `addr..addr + len` is a live mapping with `PROT_READ | PROT_WRITE`; when
/// `owned`, it was created by [`Mapping::new`] and nothing else unmaps it; when not, the
/// VMM code keeps it mapped while any `Arc` of the view but its own is alive; `len > 0`.
#[derive(Debug)]
pub(crate) struct Mapping {
    addr: NonNull<u8>,
    len: usize,
    owned: bool,
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
        // Miri maps only plain private anonymous memory (and commits it at once); the
        // simulator's blocks and their accesses are the same without `MAP_NORESERVE`.
        let lazily = if cfg!(miri) { 0 } else { libc::MAP_NORESERVE };
        // SAFETY: an anonymous mapping at an address of the kernel's choice touches no
        // existing memory; every argument is valid for `mmap` and the result is checked.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | lazily,
                -1,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return None;
        }
        let addr = NonNull::new(ptr.cast::<u8>())?;
        Some(Self {
            addr,
            len,
            owned: true,
        })
    }

    /// A view of `len` bytes at `addr` that someone else maps and unmaps.
    pub(crate) fn view(addr: usize, len: usize) -> Option<Self> {
        if len == 0 {
            return None;
        }
        Some(Self {
            addr: NonNull::new(addr as *mut u8)?,
            len,
            owned: false,
        })
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
        if !self.owned {
            return;
        }
        // SAFETY: by the type invariant `addr..addr + len` is a mapping we own and that no
        // one else unmaps; every user of its bytes holds an `Arc` to it, so none is left.
        let rc = unsafe { libc::munmap(self.addr.as_ptr().cast(), self.len) };
        debug_assert_eq!(rc, 0, "munmap of a simulator block failed");
    }
}

/// The host page size.
pub(super) fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    let size = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(size).unwrap_or(4096)
}

/// Reserves `len` bytes of address space aligned to `align` (a power of two, at least the
/// page size): inaccessible (`PROT_NONE`), backed by nothing. At `hint` when it is free.
pub(super) fn reserve(len: usize, align: usize, hint: usize) -> Option<usize> {
    let flags = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE;
    if hint != 0 && hint % align == 0 {
        // SAFETY: MAP_FIXED_NOREPLACE never replaces an existing mapping; the result is checked.
        let p = unsafe {
            libc::mmap(
                hint as *mut libc::c_void,
                len,
                libc::PROT_NONE,
                flags | libc::MAP_FIXED_NOREPLACE,
                -1,
                0,
            )
        };
        if p != libc::MAP_FAILED {
            if p as usize == hint {
                return Some(hint);
            }
            // An old kernel that ignores the flag placed it elsewhere: give it back.
            // SAFETY: `p..p + len` is the mapping just made, used by no one.
            unsafe { libc::munmap(p, len) };
        }
    }
    let total = len.checked_add(align)?;
    // SAFETY: a fresh anonymous reservation at an address of the kernel's choice.
    let p = unsafe { libc::mmap(std::ptr::null_mut(), total, libc::PROT_NONE, flags, -1, 0) };
    if p == libc::MAP_FAILED {
        return None;
    }
    let start = p as usize;
    let aligned = start.next_multiple_of(align);
    let (head, tail) = (aligned - start, total - (aligned - start) - len);
    // SAFETY: both trimmed pieces lie in the reservation just made and are used by no one.
    unsafe {
        if head > 0 {
            libc::munmap(p, head);
        }
        if tail > 0 {
            libc::munmap((aligned + len) as *mut libc::c_void, tail);
        }
    }
    Some(aligned)
}

/// Gives a reservation made by [`reserve`] back to the system.
///
/// # Safety
/// `addr..addr + len` must be a whole reservation nothing uses any more.
pub(super) unsafe fn release(addr: usize, len: usize) -> bool {
    // SAFETY: by the caller's contract.
    unsafe { libc::munmap(addr as *mut libc::c_void, len) == 0 }
}

/// A shareable memory object of `len` bytes (a memfd): pages cost memory once touched.
pub(super) fn memory_object(len: u64) -> Option<OwnedFd> {
    let name = c"ascend-pool-sim-physical";
    // SAFETY: a valid NUL-terminated name; the result is checked.
    let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return None;
    }
    // SAFETY: `fd` is a descriptor just opened and owned by no one else.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let len = libc::off_t::try_from(len).ok()?;
    // SAFETY: `fd` is a live memfd.
    (unsafe { libc::ftruncate(fd.as_raw_fd(), len) } == 0).then_some(fd)
}

/// Maps `len` bytes of the memory object `fd` from `offset` at `addr`, in place of the
/// reservation there.
///
/// # Safety
/// `addr..addr + len` must lie in a reservation of ours with nothing mapped there.
pub(super) unsafe fn map_object(addr: usize, len: usize, fd: &OwnedFd, offset: u64) -> bool {
    let Ok(offset) = libc::off_t::try_from(offset) else {
        return false;
    };
    // SAFETY: MAP_FIXED replaces only the caller's own reserved pages.
    let p = unsafe {
        libc::mmap(
            addr as *mut libc::c_void,
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED | libc::MAP_FIXED,
            fd.as_raw_fd(),
            offset,
        )
    };
    p as usize == addr
}

/// Puts the reservation back over a mapping made by [`map_object`]: the range stays ours,
/// so no other mapping can land in it, and any access faults.
///
/// # Safety
/// `addr..addr + len` must be a mapping of ours that nothing reads or writes any more.
pub(super) unsafe fn unmap_object(addr: usize, len: usize) -> bool {
    // SAFETY: MAP_FIXED replaces only the caller's own mapping.
    let p = unsafe {
        libc::mmap(
            addr as *mut libc::c_void,
            len,
            libc::PROT_NONE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE | libc::MAP_FIXED,
            -1,
            0,
        )
    };
    p as usize == addr
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
