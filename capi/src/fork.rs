//! Processes made by `fork`.
//!
//! A child gets a copy of its parent's memory, handle tables included, but only the thread
//! that forked: a call another thread was in the middle of never finishes there, and the
//! locks and announcements it held stay held. On hardware the child does not have the
//! parent's device context either, so the parent's device memory is not the child's to use
//! or free. Hence:
//!
//! - **Handles the parent made are refused in the child** with `AP_ERR_FORKED`: each pool and
//!   each opened mapping or buffer records the fork [`generation`] it was made in (the
//!   library's count, [`ascend_pool::fork`]). Destroying such a pool (or closing such a
//!   mapping or buffer) only forgets the handle: it frees nothing, and does not wait for
//!   calls that cannot finish.
//! - **The process-wide tables are consistent in the child.** Just before a fork, the forking
//!   thread takes their locks (no call holds one of them while it waits for another, so this
//!   cannot deadlock), and lets them go in both processes after it. A child can make pools of
//!   its own at once.
//!
//! The handlers are registered when the library is loaded.

use crate::lookup;
use std::any::Any;
use std::cell::RefCell;

pub(crate) use ascend_pool::fork::{generation, ours};

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
        // The library's own handlers first (they count the generation), so that theirs
        // prepare last: every lock here is taken before the library's.
        ascend_pool::fork::watch();
        // SAFETY: three `extern "C"` functions that take nothing, and live as long as the
        // library (glibc drops a library's handlers when it is unloaded).
        let rc = unsafe { libc::pthread_atfork(Some(prepare), Some(parent), Some(child)) };
        // Only ENOMEM can fail it; then a child may inherit a held lock, as before.
        debug_assert_eq!(rc, 0);
    }
    register
};
