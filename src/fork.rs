//! Processes made by `fork`.
//!
//! A child gets a copy of its parent's memory but only the thread that forked: work another
//! thread was doing never finishes there, locks it held stay held, and a simulated stream's
//! worker thread is gone. On hardware the child has none of its parent's device context
//! either (torch_npu refuses to initialize the NPU again in a forked subprocess), so the
//! parent's device memory, streams and events are not the child's to use or free. Hence:
//!
//! - **What the parent made is refused in the child.** Each pool and each simulator records
//!   the fork [`generation`] it was made in. In a child, its calls answer
//!   [`Error::Forked`](crate::Error::Forked), without taking a lock or calling the runtime,
//!   and dropping it (or a region of its pool) only forgets it: nothing is freed or waited
//!   for. What the child makes itself works as in any process.
//! - **The process-wide table of exported memory is consistent in the child**: the forking
//!   thread holds its lock across the fork, and the lock of the list of streams kept at
//!   their drop ([`retry_kept_streams`](crate::region::retry_kept_streams)) too; the child
//!   retries none of its parent's kept streams.
//!
//! The handlers are registered with `pthread_atfork` the first time anything records a
//! generation, so before anything a child could inherit exists.

use std::sync::atomic::{AtomicU64, Ordering};

/// Forks this process descends through since the handlers were registered: 0 in the process
/// that registered them, one more in each child. Written only by [`child`], while the child
/// has one thread.
static FORKS: AtomicU64 = AtomicU64::new(0);

/// The fork generation this process is in: what a pool or simulator made now records.
/// Registers the fork handlers on first use.
///
/// ```
/// let made_in = ascend_pool::fork::generation();
/// assert!(ascend_pool::fork::ours(made_in));
/// ```
pub fn generation() -> u64 {
    watch();
    // Relaxed: the only write happens before the child has a second thread.
    FORKS.load(Ordering::Relaxed)
}

/// Whether something made in `generation` was made by this process, not by an ancestor it
/// was forked from.
#[inline]
pub fn ours(generation: u64) -> bool {
    generation == FORKS.load(Ordering::Relaxed)
}

/// [`Error::Forked`](crate::Error::Forked) unless something made in `generation` was made by
/// this process: the check every pool and source makes before it takes a lock or calls the
/// runtime.
#[inline]
pub fn check(generation: u64) -> crate::Result<()> {
    if ours(generation) {
        Ok(())
    } else {
        Err(crate::Error::Forked)
    }
}

/// Registers the fork handlers, once per process (a child inherits the registration).
/// [`generation`] calls it; a library that takes locks of its own around a fork calls it
/// before registering its own handlers, so that its locks are taken before this module's.
pub fn watch() {
    #[cfg(all(unix, not(miri)))]
    {
        static REGISTERED: std::sync::Once = std::sync::Once::new();
        REGISTERED.call_once(|| {
            // SAFETY: three `extern "C"` functions that take nothing and live as long as
            // the process (this crate is linked in, never unloaded on its own).
            let rc = unsafe { libc::pthread_atfork(Some(prepare), Some(parent), Some(child)) };
            // Only ENOMEM can fail it; then forks go uncounted, as before this module.
            debug_assert_eq!(rc, 0);
        });
    }
}

// The handlers are built everywhere (what they call stays checked), registered on Unix
// outside Miri, which has no `fork`.
#[cfg_attr(any(not(unix), miri), allow(dead_code))]
extern "C" fn prepare() {
    // Independent of the others: nothing takes another lock while holding it.
    crate::region::hold_for_fork();
    crate::share::hold_for_fork();
    crate::source::sim::hold_for_fork();
}

#[cfg_attr(any(not(unix), miri), allow(dead_code))]
extern "C" fn parent() {
    crate::source::sim::release_after_fork(false);
    crate::share::release_after_fork();
    crate::region::release_after_fork(false);
}

#[cfg_attr(any(not(unix), miri), allow(dead_code))]
extern "C" fn child() {
    FORKS.fetch_add(1, Ordering::Relaxed);
    crate::source::sim::release_after_fork(true);
    crate::share::release_after_fork();
    crate::region::release_after_fork(true);
    // This thread's last-used thread cache is its parent pool's: forget it, so that the
    // next allocation or free looks again and meets the generation check.
    crate::pool::forget_last_cache();
}
