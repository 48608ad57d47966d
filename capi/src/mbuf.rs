//! Shared buffers (mbuf) from C, in the manner of `acltdtAllocBuf`: a header with the valid
//! data length and 96 bytes of user data, then the data, all in device or DVPP memory.
//! [`ap_mbuf_copy_ref`] gives another handle on the same buffer, and the buffer goes back to
//! the pool when the last handle is freed. A buffer of a pool over virtual memory is
//! published like a region ([`ap_mbuf_publish`]); another process opens it read-only
//! ([`ap_shared_mbuf_open`]).

use super::share::{runtime, Opened, Runtime};
use super::*;
use ascend_pool::mbuf::{Mbuf, MbufKind, SharedMbuf};
use std::ffi::c_void;

/// `ap_mbuf_kind`: device memory with 128-byte starts (`ACL_TDT_NORMAL_MEM`).
pub const MBUF_NORMAL: c_int = 0;
/// `ap_mbuf_kind`: DVPP memory (`ACL_TDT_DVPP_MEM`), which cannot be shared between processes.
pub const MBUF_DVPP: c_int = 1;

/// `ap_mbuf_info`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MbufInfo {
    /// Device address of the data area (`acltdtGetBufData`).
    pub data: u64,
    /// Bytes of data.
    pub size: u64,
    /// The valid data length.
    pub data_len: u64,
    /// An `ap_mbuf_kind`.
    pub kind: u32,
    /// Handles on the buffer.
    pub refs: u32,
}

/// `ap_shared_mbuf_info`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SharedMbufInfo {
    /// Bytes of data.
    pub size: u64,
    /// The valid data length the publishing process set.
    pub data_len: u64,
}

const_assert_eq!(std::mem::size_of::<MbufInfo>(), 32);
const_assert_eq!(std::mem::size_of::<SharedMbufInfo>(), 16);

/// A buffer another process published, opened here.
#[derive(Debug)]
enum AnyShared {
    Sim(SharedMbuf<SimSource>),
    Acl(SharedMbuf<AclSource>),
}

macro_rules! with_shared {
    ($m:expr, $x:ident => $body:expr) => {
        match $m {
            AnyShared::Sim($x) => $body,
            AnyShared::Acl($x) => $body,
        }
    };
}

/// Opened buffers.
static SHARED: Opened<AnyShared> = Opened::new(Failure::BadBuffer);

/// The guard of the opened buffers' table, for `crate::fork`.
pub(crate) fn fork_guard() -> Box<dyn std::any::Any> {
    SHARED.fork_guard()
}

impl Entry {
    /// Another handle on the buffer `handle` names in this pool.
    fn mbuf(&self, handle: u64) -> Result<Mbuf, Failure> {
        let found = lock(&self.mbufs).get(&handle).cloned();
        found.ok_or_else(|| self.gone(Failure::BadBuffer(handle)))
    }
}

/// Runs one call on the buffer `mbuf` of `pool` names.
fn on_mbuf(pool: u64, mbuf: u64, f: impl FnOnce(&Mbuf) -> Result<(), Failure>) -> Status {
    run(|| f(&entry(pool)?.mbuf(mbuf)?))
}

/// Files `m` under a new handle of `e` and writes the handle to `out`.
fn file_mbuf(e: &Entry, m: Mbuf, out: NonNull<u64>) -> Result<(), Failure> {
    let handle = e.file(&e.mbufs, next_handle(), m)?;
    // SAFETY: the callers checked `out`, a writable u64 of the caller's.
    unsafe { out.as_ptr().write(handle) };
    Ok(())
}

/// Allocates a buffer of `size` data bytes of `kind` (an `ap_mbuf_kind`) from the pool
/// (`acltdtAllocBuf`): its header is written, its valid data length 0.
///
/// # Safety
/// `out` is NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn ap_mbuf_alloc(pool: u64, size: u64, kind: c_int, out: *mut u64) -> Status {
    run(|| {
        let out = non_null(out, "out")?;
        let kind = match kind {
            MBUF_NORMAL => MbufKind::Normal,
            MBUF_DVPP => MbufKind::Dvpp,
            other => return Err(Failure::Invalid(format!("{other} is not an ap_mbuf_kind"))),
        };
        let e = entry(pool)?;
        let m = Mbuf::alloc(&e.pool, size, kind)?;
        file_mbuf(&e, m, out)
    })
}

/// Another handle on the same buffer (`acltdtCopyBufRef`); each is freed on its own.
///
/// # Safety
/// `out` is NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn ap_mbuf_copy_ref(pool: u64, mbuf: u64, out: *mut u64) -> Status {
    run(|| {
        let out = non_null(out, "out")?;
        let e = entry(pool)?;
        let m = e.mbuf(mbuf)?;
        file_mbuf(&e, m, out)
    })
}

/// Frees a handle (`acltdtFreeBuf`); the buffer goes back to the pool with its last handle.
/// In debug mode, an overwritten padding is reported by that last free as
/// [`Status::Corruption`], as [`ap_free`] reports one (the buffer is freed all the same).
#[no_mangle]
pub extern "C" fn ap_mbuf_free(pool: u64, mbuf: u64) -> Status {
    run(|| {
        let e = entry(pool)?;
        let found = lock(&e.mbufs).remove(&mbuf);
        let m = found.ok_or_else(|| e.gone(Failure::BadBuffer(mbuf)))?;
        // Another thread's call still holding the buffer frees it when done (its drop
        // reports an overrun to the pool's corruption list instead).
        Ok(m.free()?)
    })
}

/// Where a buffer's data lies, its size, valid length, kind and number of handles. A valid
/// length past the size, which another process wrote into the header through a mapping of
/// it, gets [`Status::OutOfBounds`], and nothing is written.
///
/// # Safety
/// `out` is NULL or valid for a write of an [`MbufInfo`].
#[no_mangle]
pub unsafe extern "C" fn ap_mbuf_get_info(pool: u64, mbuf: u64, out: *mut MbufInfo) -> Status {
    run(|| {
        let out = non_null(out, "out")?;
        let e = entry(pool)?;
        let m = e.mbuf(mbuf)?;
        let (data, size) = m.data();
        // The handles filed for this buffer: other calls in flight hold clones of it too,
        // which `Mbuf::refs` would count. Compared without locking them: a buffer whose
        // copy waits for its stream would hold this call, and the table, up.
        let refs = lock(&e.mbufs)
            .values()
            .filter(|h| h.same_buffer(&m))
            .count();
        let info = MbufInfo {
            data: data as u64,
            size,
            data_len: m.data_len()?,
            kind: match m.kind() {
                MbufKind::Normal => MBUF_NORMAL as u32,
                MbufKind::Dvpp => MBUF_DVPP as u32,
            },
            refs: u32::try_from(refs).unwrap_or(u32::MAX),
        };
        // SAFETY: non-null, and the caller gives a writable ap_mbuf_info.
        unsafe { out.as_ptr().write(info) };
        Ok(())
    })
}

/// Copies `len` bytes from host memory at `src` into the data at `offset`.
///
/// # Safety
/// `src` is valid for reads of `len` bytes (NULL only if `len` is 0), which nothing writes
/// during the call: the bytes the call writes may not overlap them.
#[no_mangle]
pub unsafe extern "C" fn ap_mbuf_write(
    pool: u64,
    mbuf: u64,
    offset: u64,
    src: *const c_void,
    len: u64,
) -> Status {
    on_mbuf(pool, mbuf, |m| {
        // SAFETY: as this function's contract.
        Ok(m.write(offset, unsafe { host_bytes(src, offset, len)? })?)
    })
}

/// Copies `len` bytes of the data from `offset` into host memory at `dst`.
///
/// # Safety
/// `dst` is valid for writes of `len` bytes (NULL only if `len` is 0), which nothing else
/// uses during the call: the bytes the call reads may not overlap them.
#[no_mangle]
pub unsafe extern "C" fn ap_mbuf_read(
    pool: u64,
    mbuf: u64,
    offset: u64,
    dst: *mut c_void,
    len: u64,
) -> Status {
    on_mbuf(pool, mbuf, |m| {
        // SAFETY: as this function's contract.
        Ok(m.read(offset, unsafe { host_bytes_mut(dst, offset, len)? })?)
    })
}

/// Marks a buffer as used by work the caller queued on `stream` on its data: the buffer goes
/// back to the pool, with its last handle, only once that work has run.
#[no_mangle]
pub extern "C" fn ap_mbuf_record_stream(pool: u64, mbuf: u64, stream: u64) -> Status {
    run(|| {
        let e = entry(pool)?;
        let m = e.mbuf(mbuf)?;
        let s = e.stream(stream)?;
        Ok(m.record_stream(&s)?)
    })
}

/// Sets the valid data length, at most the size (`acltdtSetBufDataLen`).
#[no_mangle]
pub extern "C" fn ap_mbuf_set_data_len(pool: u64, mbuf: u64, len: u64) -> Status {
    on_mbuf(pool, mbuf, |m| Ok(m.set_data_len(len)?))
}

/// Writes `len` bytes of user data at `offset` of the 96 (`acltdtSetBufUserData`).
///
/// # Safety
/// `src` is valid for reads of `len` bytes (NULL only if `len` is 0), which nothing writes
/// during the call: the bytes the call writes may not overlap them.
#[no_mangle]
pub unsafe extern "C" fn ap_mbuf_set_user_data(
    pool: u64,
    mbuf: u64,
    offset: u64,
    src: *const c_void,
    len: u64,
) -> Status {
    on_mbuf(pool, mbuf, |m| {
        // SAFETY: as this function's contract.
        Ok(m.set_user_data(unsafe { host_bytes(src, offset, len)? }, offset)?)
    })
}

/// Reads `len` bytes of user data from `offset` of the 96 (`acltdtGetBufUserData`).
///
/// # Safety
/// `dst` is valid for writes of `len` bytes (NULL only if `len` is 0), which nothing else
/// uses during the call: the bytes the call reads may not overlap them.
#[no_mangle]
pub unsafe extern "C" fn ap_mbuf_get_user_data(
    pool: u64,
    mbuf: u64,
    offset: u64,
    dst: *mut c_void,
    len: u64,
) -> Status {
    on_mbuf(pool, mbuf, |m| {
        // SAFETY: as this function's contract.
        Ok(m.user_data(unsafe { host_bytes_mut(dst, offset, len)? }, offset)?)
    })
}

/// Lets other processes open a device buffer of a pool over virtual memory, read-only, as
/// [`ap_share_publish`] does for a region (the same `pids` and buffer rules). DVPP buffers get
/// [`Status::WrongKind`]. Read-only is what `ap_shared_mbuf_*` offer, not a protection of the
/// memory: the same descriptor opened with `ap_share_open` is a mapping that can be written.
///
/// # Safety
/// As [`ap_share_publish`].
#[no_mangle]
pub unsafe extern "C" fn ap_mbuf_publish(
    pool: u64,
    mbuf: u64,
    pids: *const i32,
    npids: usize,
    buf: *mut c_char,
    cap: usize,
    needed: *mut usize,
) -> Status {
    // SAFETY: as this function's contract.
    unsafe {
        share::publish_with(pool, pids, npids, buf, cap, needed, |e, p, access| {
            Ok(p.publish_mbuf(&e.mbuf(mbuf)?, access)?)
        })
    }
}

/// Opens a buffer another process published, read-only, through the runtime behind `source`
/// on `device`; what is not a buffer gets [`Status::InvalidArgument`], and the rest is refused as
/// [`ap_share_open`] refuses.
///
/// # Safety
/// As [`ap_share_open`].
#[no_mangle]
pub unsafe extern "C" fn ap_shared_mbuf_open(
    source: c_int,
    device: i32,
    descriptor: *const c_char,
    out: *mut u64,
) -> Status {
    run(|| {
        let out = non_null(out, "out")?;
        // SAFETY: as this function's contract.
        let desc = unsafe { share::descriptor(descriptor)? };
        // The library says ForeignHandle for memory without a buffer's header.
        let not_buffer = |e: Error| match e {
            Error::ForeignHandle => {
                Failure::Invalid("the published memory is not a buffer (no buffer header)".into())
            }
            e => Failure::Lib(e),
        };
        let m = match runtime(source)? {
            Runtime::Sim(r) => {
                AnyShared::Sim(SharedMbuf::open(r, device, &desc).map_err(not_buffer)?)
            }
            Runtime::Acl(r) => {
                AnyShared::Acl(SharedMbuf::open(r, device, &desc).map_err(not_buffer)?)
            }
        };
        SHARED.file(m, out)
    })
}

/// An opened buffer's size and the valid data length its publisher set. A length past the
/// size (the header is writable by any process holding the descriptor) gets
/// [`Status::OutOfBounds`], and nothing is written.
///
/// # Safety
/// `out` is NULL or valid for a write of a [`SharedMbufInfo`].
#[no_mangle]
pub unsafe extern "C" fn ap_shared_mbuf_get_info(buf: u64, out: *mut SharedMbufInfo) -> Status {
    run(|| {
        let out = non_null(out, "out")?;
        let info = SHARED.with(buf, |m| {
            Ok(with_shared!(m, x => SharedMbufInfo {
                size: x.size(),
                data_len: x.data_len()?,
            }))
        })?;
        // SAFETY: non-null, and the caller gives a writable ap_shared_mbuf_info.
        unsafe { out.as_ptr().write(info) };
        Ok(())
    })
}

/// Copies `len` bytes of an opened buffer's data from `offset` into host memory at `dst`.
///
/// # Safety
/// `dst` is valid for writes of `len` bytes (NULL only if `len` is 0), which nothing else
/// uses during the call: the bytes the call reads may not overlap them.
#[no_mangle]
pub unsafe extern "C" fn ap_shared_mbuf_read(
    buf: u64,
    offset: u64,
    dst: *mut c_void,
    len: u64,
) -> Status {
    run(|| {
        SHARED.with(buf, |m| {
            // SAFETY: as this function's contract.
            let out = unsafe { host_bytes_mut(dst, offset, len)? };
            Ok(with_shared!(m, x => x.read(offset, out))?)
        })
    })
}

/// Copies `len` bytes of an opened buffer's user data from `offset` into `dst`.
///
/// # Safety
/// `dst` is valid for writes of `len` bytes (NULL only if `len` is 0), which nothing else
/// uses during the call: the bytes the call reads may not overlap them.
#[no_mangle]
pub unsafe extern "C" fn ap_shared_mbuf_get_user_data(
    buf: u64,
    offset: u64,
    dst: *mut c_void,
    len: u64,
) -> Status {
    run(|| {
        SHARED.with(buf, |m| {
            // SAFETY: as this function's contract.
            let out = unsafe { host_bytes_mut(dst, offset, len)? };
            Ok(with_shared!(m, x => x.user_data(out, offset))?)
        })
    })
}

/// Unmaps an opened buffer and frees what was imported; the handle is gone even when the
/// runtime refuses a step, as [`ap_mapping_close`] says.
#[no_mangle]
pub extern "C" fn ap_shared_mbuf_close(buf: u64) -> Status {
    run(|| SHARED.close(buf, |m| Ok(with_shared!(m, x => x.try_close())?)))
}
