//! How a call finds its pool and how handles are made, without a write to any cache line that
//! other threads' calls write too.
//!
//! Threads that share one pool used to meet on its entry's reference count at every call
//! (one compare-exchange to take a reference, one subtraction to drop it) and on the handle
//! counter at every allocation. On two threads that cost more than the pool itself
//! (`docs/benchmarks.md`, session 65). Now:
//!
//! - **Handles** come from one process-wide counter a block of [`HANDLE_BLOCK`] at a time;
//!   a thread hands out its block one by one. A block's regions share one region table, so
//!   two threads allocating at once mostly lock different tables.
//! - **A call announces the pool it works on** in a slot of its thread's own (one cache line
//!   each) and reads the pool from the thread's last lookup, checked against a count of pool
//!   destructions: no reference is taken. `ap_pool_destroy` takes the pool out of the table,
//!   counts the destruction, and waits until no slot announces the pool before it frees
//!   anything. Either a call's check sees the new count and looks the pool up again (and does
//!   not find it), or the destroy's scan sees the call's announcement and waits for it; both
//!   sides use sequentially consistent operations, so never both miss.
//! - A thread whose thread-locals are already gone (a call from a thread-local destructor)
//!   has no slot; its call takes a counted reference from the table as before, and the
//!   entry's `alive` flag covers it (see [`Entry`]).

use super::{Entry, Failure, POOLS};
use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// Handles a thread takes from [`NEXT_HANDLE`] at a time.
pub(crate) const HANDLE_BLOCK: u64 = 1024;

/// The first handle of the next block: never 0, never handed out twice.
static NEXT_HANDLE: AtomicU64 = AtomicU64::new(1);

thread_local! {
    /// This thread's next handle and the end of its block (equal: the block is used up).
    /// No destructor, so it is there for calls from other thread-locals' destructors too.
    static HANDLES: Cell<(u64, u64)> = const { Cell::new((0, 0)) };
}

/// A handle no one has had: the next of this thread's block.
pub(crate) fn next_handle() -> u64 {
    HANDLES.with(|h| {
        let (mut next, mut end) = h.get();
        if next == end {
            next = NEXT_HANDLE.fetch_add(HANDLE_BLOCK, Ordering::Relaxed);
            end = next + HANDLE_BLOCK;
        }
        h.set((next + 1, end));
        next
    })
}

/// One thread's announcement: the pool its current call works on, 0 between calls.
/// A cache line of its own, so that announcing writes no line another thread writes.
#[derive(Debug)]
#[repr(align(128))]
struct Slot {
    pool: AtomicU64,
}

/// Every slot made; a slot lives for the process, and goes back to [`FREE_SLOTS`] when its
/// thread exits. `ap_pool_destroy` scans them all.
static SLOTS: Mutex<Vec<&'static Slot>> = Mutex::new(Vec::new());
/// Slots of exited threads, for new threads to take.
static FREE_SLOTS: Mutex<Vec<&'static Slot>> = Mutex::new(Vec::new());
/// Pools destroyed so far: a pool found before the count last moved may be gone.
static DESTROYED: AtomicU64 = AtomicU64::new(0);

/// A thread's slot and its last lookup.
struct Caller {
    slot: &'static Slot,
    /// The pool handle this thread last looked up, its entry, and [`DESTROYED`] as it read
    /// it before that lookup. The entry is valid while no pool has been destroyed since:
    /// the table still holds it.
    last: Cell<Option<(u64, *const Entry, u64)>>,
}

impl Caller {
    fn new() -> Self {
        let free = super::lock(&FREE_SLOTS).pop();
        let slot = free.unwrap_or_else(|| {
            let slot: &'static Slot = Box::leak(Box::new(Slot {
                pool: AtomicU64::new(0),
            }));
            super::lock(&SLOTS).push(slot);
            slot
        });
        Caller {
            slot,
            last: Cell::new(None),
        }
    }
}

impl Drop for Caller {
    fn drop(&mut self) {
        // No call of this thread is running: its thread-locals are being destroyed.
        super::lock(&FREE_SLOTS).push(self.slot);
    }
}

thread_local! {
    static CALLER: Caller = Caller::new();
}

/// A call's hold on its pool's entry: an announcement, or (without a slot) a reference.
pub(crate) struct EntryRef(Held);

enum Held {
    /// `entry` stays valid until `slot` is cleared (which dropping this does).
    Announced {
        slot: &'static Slot,
        entry: *const Entry,
    },
    Counted(Arc<Entry>),
}

impl std::ops::Deref for EntryRef {
    type Target = Entry;

    fn deref(&self) -> &Entry {
        match &self.0 {
            // SAFETY: after this thread announced the pool, it read `DESTROYED` and found the
            // entry either in `POOLS` or in its last lookup with the count unchanged since:
            // either way the pool's destroy counts itself after that read, so its scan meets
            // the announcement and frees nothing until it is cleared (see the module's
            // documentation); this slot keeps announcing it until `self` drops.
            Held::Announced { entry, .. } => unsafe { &**entry },
            Held::Counted(e) => e,
        }
    }
}

impl Drop for EntryRef {
    fn drop(&mut self) {
        if let Held::Announced { slot, .. } = &self.0 {
            // Release: everything this call did with the entry comes before the destroy
            // that reads the slot empty.
            slot.pool.store(0, Ordering::Release);
        }
    }
}

/// The entry of live pool `pool`, held for one call. A call looks up one pool once.
pub(crate) fn entry(pool: u64) -> Result<EntryRef, Failure> {
    let held = CALLER.try_with(|c| {
        let slot = c.slot;
        debug_assert_eq!(slot.pool.load(Ordering::Relaxed), 0, "one pool per call");
        slot.pool.store(pool, Ordering::SeqCst);
        let destroyed = DESTROYED.load(Ordering::SeqCst);
        let found = match c.last.get() {
            Some((id, e, seen)) if id == pool && seen == destroyed => Some(e),
            _ => {
                let e = lookup(pool, Arc::as_ptr);
                if let Some(e) = e {
                    c.last.set(Some((pool, e, destroyed)));
                }
                e
            }
        };
        match found {
            Some(entry) => Some(EntryRef(Held::Announced { slot, entry })),
            None => {
                slot.pool.store(0, Ordering::Release);
                None
            }
        }
    });
    let held = match held {
        Ok(held) => held,
        // This thread's slot is gone (a call from a thread-local destructor).
        Err(_) => lookup(pool, |e| EntryRef(Held::Counted(Arc::clone(e)))),
    };
    let e = held.ok_or(Failure::BadPool(pool))?;
    if !e.alive.load(Ordering::Acquire) {
        return Err(Failure::BadPool(pool));
    }
    // A pool of the process this one was forked from (see `crate::fork`).
    if !crate::fork::ours(e.forks) {
        return Err(Failure::Forked(pool));
    }
    Ok(e)
}

/// `found` of `pool`'s entry in the table, under its read lock; `None` when it is not there.
fn lookup<T>(pool: u64, found: impl FnOnce(&Arc<Entry>) -> T) -> Option<T> {
    #[cfg(test)]
    tests::LOOKUPS.with(|n| n.set(n.get() + 1));
    POOLS
        .read()
        .unwrap_or_else(|p| p.into_inner())
        .get(&pool)
        .map(found)
}

/// The guards of the pool table's lock and the slots' (for `crate::fork`). Taken one at a
/// time: no call holds one of them while it waits for another.
pub(crate) fn fork_guards() -> Vec<Box<dyn std::any::Any>> {
    vec![
        Box::new(POOLS.write().unwrap_or_else(|p| p.into_inner())),
        Box::new(super::lock(&SLOTS)),
        Box::new(super::lock(&FREE_SLOTS)),
    ]
}

/// For `ap_pool_destroy` of a pool the parent process made, once it has taken it out of the
/// table: counts the destruction (so that no thread's last lookup finds it again), and waits
/// for nothing, since a call the fork cut short never finishes (see `crate::fork`).
pub(crate) fn forget() {
    DESTROYED.fetch_add(1, Ordering::SeqCst);
}

/// For `ap_pool_destroy`, once it has taken `pool` out of the table: counts the destruction
/// and waits for every call that may still be using the entry.
pub(crate) fn retire(pool: u64) {
    forget();
    // A thread that makes its slot after this snapshot looks the pool up after it left the
    // table, and does not find it.
    let slots = super::lock(&SLOTS).clone();
    for slot in slots {
        while slot.pool.load(Ordering::SeqCst) == pool {
            std::thread::yield_now();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{ap_pool_create, ap_pool_destroy, Status, SOURCE_SIM};
    use std::sync::atomic::AtomicBool;
    use std::time::Duration;

    thread_local! {
        /// This thread's lookups in the shared table.
        pub(super) static LOOKUPS: Cell<u64> = const { Cell::new(0) };
    }

    /// This thread's lookups in the shared table while `f` runs.
    fn lookups(f: impl FnOnce()) -> u64 {
        let before = LOOKUPS.with(Cell::get);
        f();
        LOOKUPS.with(Cell::get) - before
    }

    /// [`lookups`] of a run of `f` during which no pool was destroyed (the other tests of
    /// this binary destroy pools on their threads meanwhile). A run of `f` first brings this
    /// thread's last lookup up to date: a destroy just before the count is read would
    /// otherwise make the counted run look up again, quiet as it is.
    fn quiet_lookups(f: impl Fn()) -> u64 {
        loop {
            let destroyed = DESTROYED.load(Ordering::SeqCst);
            f();
            let n = lookups(&f);
            if DESTROYED.load(Ordering::SeqCst) == destroyed {
                return n;
            }
        }
    }

    fn new_pool() -> u64 {
        let mut pool = 0;
        // SAFETY: NULL configuration (the defaults) and a writable handle.
        assert_eq!(
            unsafe { ap_pool_create(SOURCE_SIM, std::ptr::null(), &mut pool) },
            Status::Ok
        );
        pool
    }

    /// `ap_pool_destroy` returns only once a call that holds the pool has let go of it.
    #[test]
    fn a_destroy_waits_for_the_calls_that_hold_the_pool() {
        let pool = new_pool();
        let let_go = AtomicBool::new(false);
        let (held, is_held) = std::sync::mpsc::channel();
        std::thread::scope(|s| {
            s.spawn(|| {
                let e = entry(pool).unwrap();
                held.send(()).unwrap();
                std::thread::sleep(Duration::from_millis(200));
                // The entry is still whole: the destroy has not emptied it.
                assert!(e.alive.load(Ordering::Acquire));
                let_go.store(true, Ordering::SeqCst);
                drop(e);
            });
            is_held.recv().unwrap();
            // SAFETY: no count asked for.
            assert_eq!(
                unsafe { ap_pool_destroy(pool, std::ptr::null_mut()) },
                Status::Ok
            );
            assert!(let_go.load(Ordering::SeqCst), "destroyed under a call");
        });
        assert!(matches!(entry(pool), Err(Failure::BadPool(p)) if p == pool));
    }

    /// A thread's calls with one pool look it up once; any destroy since, even of another
    /// pool, makes the next call look it up again (and find it, or not).
    #[test]
    fn a_lookup_is_reused_until_a_pool_is_destroyed() {
        let (a, b) = (new_pool(), new_pool());
        let at = |pool| std::ptr::from_ref::<Entry>(&entry(pool).unwrap());
        let mut first = std::ptr::null();
        assert_eq!(lookups(|| first = at(a)), 1);
        assert_eq!(quiet_lookups(|| assert_eq!(at(a), first)), 0);
        // SAFETY: no count asked for.
        assert_eq!(
            unsafe { ap_pool_destroy(b, std::ptr::null_mut()) },
            Status::Ok
        );
        assert_eq!(lookups(|| assert_eq!(at(a), first)), 1);
        assert_eq!(quiet_lookups(|| assert_eq!(at(a), first)), 0);
        assert!(entry(b).is_err());
        // SAFETY: as above.
        assert_eq!(
            unsafe { ap_pool_destroy(a, std::ptr::null_mut()) },
            Status::Ok
        );
        assert!(entry(a).is_err());
    }

    /// Exited threads give their slots back: threads one after another share a few.
    #[test]
    fn exited_threads_slots_are_taken_again() {
        let pool = new_pool();
        for _ in 0..64 {
            std::thread::spawn(move || drop(entry(pool).unwrap()))
                .join()
                .unwrap();
        }
        // The other tests of this binary run threads meanwhile, a few at a time.
        let made = crate::lock(&SLOTS).len();
        assert!(made < 32, "{made} slots for 64 threads in turn");
        // SAFETY: no count asked for.
        assert_eq!(
            unsafe { ap_pool_destroy(pool, std::ptr::null_mut()) },
            Status::Ok
        );
    }

    #[test]
    fn handles_are_unique_across_threads_and_blocks() {
        let mut all: Vec<u64> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..4)
                .map(|_| {
                    s.spawn(|| {
                        (0..3 * HANDLE_BLOCK)
                            .map(|_| next_handle())
                            .collect::<Vec<_>>()
                    })
                })
                .collect();
            hs.into_iter().flat_map(|h| h.join().unwrap()).collect()
        });
        let n = all.len();
        all.sort_unstable();
        all.dedup();
        assert_eq!(all.len(), n);
        assert!(all[0] > 0);
    }
}
