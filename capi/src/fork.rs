//! Processes made by `fork`.
//!
//! A child gets a copy of its parent's memory, handle tables included, but only the thread
//! that forked: a call another thread was in the middle of never finishes there, and the
//! locks and announcements it held stay held. On hardware the child does not have the
//! parent's device context either, so the parent's device memory is not the child's to use
//! or free. Hence:
//!
//! - **Handles the parent made are refused in the child** with `AP_ERR_FORKED`: each pool and
//!   each opened mapping or buffer records the fork [`generation`] it was made in. Destroying
//!   such a pool (or closing such a mapping or buffer) only forgets the handle: it frees
//!   nothing, and does not wait for calls that cannot finish.
//! - **The process-wide tables are consistent in the child.** Just before a fork, the forking
//!   thread takes their locks (no call holds one of them while it waits for another, so this
//!   cannot deadlock), and lets them go in both processes after it. A child can make pools of
//!   its own at once.
//!
//! The handlers are registered when the library is loaded.

use crate::lookup;
use std::any::Any;
use std::cell::RefCell;
use std::sync::atomic::{AtomicU64, Ordering};

/// Forks this process descends through: 0 in a process no call of this library forked
/// from, one more in each child. Written only by [`child`], while the child has one thread.
static FORKS: AtomicU64 = AtomicU64::new(0);

/// The fork generation this process is in; what a handle made now records.
pub(crate) fn generation() -> u64 {
    // Relaxed: the only write happens before the child has a second thread.
    FORKS.load(Ordering::Relaxed)
}

/// Whether something made in `generation` was made by this process (not by an ancestor it
/// was forked from).
pub(crate) fn ours(generation: u64) -> bool {
    generation == self::generation()
}

thread_local! {
    /// The guards of the process-wide locks [`prepare`] took, for [`parent`] or [`child`]
    /// (the same thread) to let go.
    static HELD: RefCell<Vec<Box<dyn Any>>> = const { RefCell::new(Vec::new()) };
}

extern "C" fn prepare() {
    let mut held = lookup::fork_guards();
    held.extend(crate::share::fork_guards());
    held.push(crate::mbuf::fork_guard());
    // A fork from a thread whose thread-locals are gone: the locks go back at once (its
    // child may then find one held by another thread).
    let _ = HELD.try_with(|h| *h.borrow_mut() = held);
}

extern "C" fn parent() {
    let _ = HELD.try_with(|h| h.take());
}

extern "C" fn child() {
    FORKS.fetch_add(1, Ordering::Relaxed);
    // The guards were this thread's before the fork: unlocking them here is unlocking memory
    // no other thread of the child can be waiting on.
    let _ = HELD.try_with(|h| h.take());
}

/// Registers the handlers when the library is loaded, before any thread can call it.
#[cfg(all(target_os = "linux", not(miri)))]
#[used]
#[link_section = ".init_array"]
static REGISTER: extern "C" fn() = {
    extern "C" fn register() {
        // SAFETY: three `extern "C"` functions that take nothing, and live as long as the
        // library (glibc drops a library's handlers when it is unloaded).
        let rc = unsafe { libc::pthread_atfork(Some(prepare), Some(parent), Some(child)) };
        // Only ENOMEM can fail it; then a child may inherit a held lock, as before.
        debug_assert_eq!(rc, 0);
    }
    register
};
