//! One-sided writes from C: `ap_stream_native` hands a stream to the communicator, and
//! `ap_write_remote` queues HCOMM's `HcommWriteOnThread` through the pool's checks
//! ([`Pool::write_remote`](ascend_pool::Pool::write_remote)).

use ascend_pool::comm::{CommThread, RemoteWindow};
use ascend_pool::source::{ChannelHandle, CommThreadHandle};

use super::{entry, hold, non_null, run, AnyRegion, Failure, Status};

/// The runtime's own handle of `stream` (an `aclrtStream` over `libascendcl.so`), for a
/// library that queues work on the same stream: HCCL's `HcclThreadAcquireWithStream`, say.
///
/// # Safety
/// `out` must be NULL or valid for writing a `u64`.
#[no_mangle]
pub unsafe extern "C" fn ap_stream_native(pool: u64, stream: u64, out: *mut u64) -> Status {
    run(|| {
        let out = non_null(out, "out")?;
        let s = entry(pool)?.stream(stream)?;
        // SAFETY: non-null, and the caller gives a writable u64.
        unsafe { out.as_ptr().write(s.handle().0 as u64) };
        Ok(())
    })
}

/// Queues a one-sided write of `len` bytes of `src` from `src_offset` into the far end's
/// window (`window_addr`, `window_len`) at `dst_offset`, on the communicator's `thread`, whose
/// work runs on `stream`. `src` is recorded on the stream, so it may be freed at once.
///
/// # Safety
/// `thread` must be a live thread of the communicator acquired on `stream`'s native handle
/// (see [`ap_stream_native`]), and `window_addr..window_addr + window_len` memory the rank at
/// the far end of `channel` registered for one-sided writes (HCCL tells where), as
/// [`CommThread::from_raw`] and [`RemoteWindow::from_raw`] require.
#[no_mangle]
#[allow(clippy::too_many_arguments)] // one call of HCOMM's, with the pool's handles around it
pub unsafe extern "C" fn ap_write_remote(
    pool: u64,
    thread: u64,
    stream: u64,
    channel: u64,
    window_addr: u64,
    window_len: u64,
    dst_offset: u64,
    src: u64,
    src_offset: u64,
    len: u64,
) -> Status {
    run(|| {
        let e = entry(pool)?;
        let s = e.stream(stream)?;
        let r = e.region(src)?;
        let r = hold(&r);
        let addr = usize::try_from(window_addr)
            .map_err(|_| Failure::Invalid(format!("window address {window_addr:#x}")))?;
        // SAFETY: the caller's contract is `from_raw`'s (above).
        let (thread, window) = unsafe {
            (
                CommThread::from_raw(CommThreadHandle(thread), &s),
                RemoteWindow::from_raw(ChannelHandle(channel), addr, window_len),
            )
        };
        Ok(with_region!(&*r, x =>
            e.pool.write_remote(&thread, &window, dst_offset, x, src_offset, len))?)
    })
}
