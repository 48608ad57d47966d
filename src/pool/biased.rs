//! A lock biased towards the one thread that takes it most: that thread enters and leaves
//! with plain loads and stores, no atomic read-modify-write, while the bias holds.
//!
//! A kind pool is usually worked by one thread at a time for long stretches (a decode loop,
//! a replay, a server's allocation thread), and on this kind of machine the two atomic
//! read-modify-writes of a `Mutex` cost more than a whole carve. So each kind's lock
//! remembers its owner (the first thread to take it) and, once the owner has taken it
//! [`REBIAS_AFTER`] times in a row, lets the owner in without the mutex.
//!
//! The handshake is the asymmetric form of Dekker's: the owner announces itself in `busy`
//! and then reads `biased`, with only a compiler fence between; another thread that wants
//! in clears `biased`, runs `membarrier(MEMBARRIER_CMD_PRIVATE_EXPEDITED)` (which puts a
//! full memory barrier into every running thread of the process, and context switches do
//! the same for the others), and only then reads `busy`. Either the owner sees `biased`
//! cleared and backs off to the mutex, or the other thread sees `busy` and waits for the
//! owner to leave; never both miss. From then on everyone takes the mutex until the owner
//! has again taken it [`REBIAS_AFTER`] times with no other thread in between.
//!
//! Where `membarrier` cannot be registered (an old kernel, a seccomp filter) no lock is
//! ever biased: each is a mutex and two relaxed loads.

use std::cell::{Cell, UnsafeCell};
use std::marker::PhantomData;
use std::sync::atomic::{compiler_fence, AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::{Mutex, MutexGuard};

/// Consecutive mutex entries by the owner, with no other thread between, after which the
/// lock is first biased to it. Small, since a revocation costs one system call; not 1, so
/// two threads that alternate keep the plain mutex rather than a system call per entry.
pub(crate) const REBIAS_AFTER: u32 = 64;
/// Each revocation doubles the entries the owner needs to win the bias back, up to this:
/// where other threads come by often (a second thread freeing into the same kind now and
/// then), system calls stay rare next to the entries the bias saves.
const REBIAS_AFTER_MAX: u32 = 1 << 20;

/// Turns a revoker spins (yielding) for the owner to leave before it sleeps between looks.
const SPIN_TURNS: u32 = 64;

/// Ids for [`thread_id`]; 0 means "no thread".
static NEXT_THREAD_ID: AtomicU64 = AtomicU64::new(1);

thread_local! {
    /// This thread's id, assigned on first use. Never reused: a lock biased to a thread
    /// that has exited stays unbiased for the others rather than pass to a stranger.
    static THREAD_ID: Cell<u64> = const { Cell::new(0) };
}

/// A process-unique id of the calling thread (never 0).
#[inline]
pub(crate) fn thread_id() -> u64 {
    THREAD_ID.with(|id| match id.get() {
        0 => {
            let new = NEXT_THREAD_ID.fetch_add(1, Ordering::Relaxed);
            id.set(new);
            new
        }
        v => v,
    })
}

/// Whether this process registered for private expedited `membarrier` (0 unknown, 1 yes,
/// 2 no).
static MEMBARRIER: AtomicU8 = AtomicU8::new(0);

/// Whether [`heavy_fence`] works here; registers on first call.
fn bias_supported() -> bool {
    match MEMBARRIER.load(Ordering::Acquire) {
        1 => true,
        2 => false,
        _ => {
            let ok = register_membarrier();
            MEMBARRIER.store(if ok { 1 } else { 2 }, Ordering::Release);
            ok
        }
    }
}

#[cfg(all(target_os = "linux", not(miri)))]
fn register_membarrier() -> bool {
    // Values from linux/membarrier.h.
    const QUERY: libc::c_long = 0;
    const PRIVATE_EXPEDITED: libc::c_long = 1 << 3;
    const REGISTER_PRIVATE_EXPEDITED: libc::c_long = 1 << 4;
    // SAFETY: membarrier takes (cmd, flags, cpu_id) by value and touches no memory of ours.
    let cmds = unsafe { libc::syscall(libc::SYS_membarrier, QUERY, 0, 0) };
    if cmds < 0 || cmds & PRIVATE_EXPEDITED == 0 {
        return false;
    }
    // SAFETY: as above.
    unsafe { libc::syscall(libc::SYS_membarrier, REGISTER_PRIVATE_EXPEDITED, 0, 0) == 0 }
}

/// No `membarrier` to register: elsewhere than Linux, and under Miri, which does not model
/// it (so Miri checks the pool on the unbiased path a kernel without it takes).
#[cfg(any(not(target_os = "linux"), miri))]
fn register_membarrier() -> bool {
    false
}

/// A full memory barrier in this thread and in every other running thread of the process.
/// Only called once [`bias_supported`] has returned true (a lock is never biased before).
#[cfg(all(target_os = "linux", not(miri)))]
fn heavy_fence() {
    use std::sync::atomic::fence;
    const PRIVATE_EXPEDITED: libc::c_long = 1 << 3;
    fence(Ordering::SeqCst);
    // SAFETY: as in `register_membarrier`.
    let call = || unsafe { libc::syscall(libc::SYS_membarrier, PRIVATE_EXPEDITED, 0, 0) };
    if call() != 0 {
        // A child made by `fork` does not inherit the registration: register again. The
        // process registered once, so the call is allowed here; without it, exclusion
        // cannot be promised, so stop rather than risk two threads inside.
        let again = register_membarrier() && call() == 0;
        assert!(again, "membarrier failed after registration");
    }
    fence(Ordering::SeqCst);
}

#[cfg(any(not(target_os = "linux"), miri))]
fn heavy_fence() {
    unreachable!("no lock is biased without membarrier")
}

/// What the mutex guards besides the handshake.
#[derive(Debug)]
struct Streak {
    /// Consecutive entries by the owner through the mutex.
    owner_entries: u32,
    /// `owner_entries` at which the lock is biased to the owner: [`REBIAS_AFTER`], doubled
    /// at each revocation up to `rebias_max`.
    rebias_after: u32,
    /// [`REBIAS_AFTER_MAX`] (less in tests, to make revocations frequent).
    rebias_max: u32,
}

/// A mutual-exclusion lock biased towards its owner (see the module documentation).
///
/// On 128 bytes of its own: its owner writes `busy` at every entry, and a neighbour's data on
/// the same line (another kind's lock, the pool's configuration) would then bounce between
/// the threads that use them (two threads on two kinds took twice as long per call).
#[repr(align(128))]
pub(crate) struct BiasedLock<T> {
    /// The owner's [`thread_id`]: set at creation ([`new_owned`](Self::new_owned)), or
    /// else 0 until the first thread takes the lock, under the mutex. Never changes after.
    owner: AtomicU64,
    /// Set only by the owner, holding the mutex; cleared only by another thread, holding
    /// the mutex, before its [`heavy_fence`]. While set, the owner enters without the mutex.
    biased: AtomicBool,
    /// Written only by the owner: set while it is inside without the mutex (and for the
    /// moment it takes to find `biased` cleared).
    busy: AtomicBool,
    /// Taken by everyone while `biased` is clear, and by other threads to clear it.
    mutex: Mutex<Streak>,
    value: UnsafeCell<T>,
}

// SAFETY: `value` is reached only through a `BiasedGuard`, and at most one guard exists at a
// time: the owner's biased guards exclude each other by program order (one thread), the
// mutex's guards exclude each other, and the two kinds exclude each other by the handshake
// in the module documentation (`lock` and `revoke`). Acquire/Release on `busy` and the
// mutex order the accesses, so sharing the lock moves `T` between threads: `T: Send`.
unsafe impl<T: Send> Sync for BiasedLock<T> {}

impl<T: std::fmt::Debug> std::fmt::Debug for BiasedLock<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BiasedLock")
            .field("owner", &self.owner.load(Ordering::Relaxed))
            .field("biased", &self.biased.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

/// Access to a [`BiasedLock`]'s value; leaving drops it.
pub(crate) struct BiasedGuard<'a, T> {
    lock: &'a BiasedLock<T>,
    /// `None` when entered through the bias; else the mutex, and whether to bias the lock
    /// to the owner on the way out.
    mutex: Option<(MutexGuard<'a, Streak>, bool)>,
    /// The guard lends `&T` through `&self`, so it is `Sync` only where `T` is (the fields
    /// above would make it `Sync` for any `T: Send`, and a shared guard would share `T`).
    _value: PhantomData<&'a mut T>,
}

impl<T> BiasedLock<T> {
    /// An unowned, unbiased lock.
    pub(crate) fn new(value: T) -> Self {
        Self::with_thresholds(value, REBIAS_AFTER, REBIAS_AFTER_MAX)
    }

    /// An unowned, unbiased lock that biases after `first` owner entries, and after at most
    /// `max` once revoked.
    fn with_thresholds(value: T, first: u32, max: u32) -> Self {
        Self {
            owner: AtomicU64::new(0),
            biased: AtomicBool::new(false),
            busy: AtomicBool::new(false),
            mutex: Mutex::new(Streak {
                owner_entries: 0,
                rebias_after: first,
                rebias_max: max,
            }),
            value: UnsafeCell::new(value),
        }
    }

    /// An unbiased lock owned by the calling thread: only this thread can win the bias,
    /// even if another thread takes the lock first (a cache's owner is known at creation).
    pub(crate) fn new_owned(value: T) -> Self {
        let lock = Self::new(value);
        lock.owner.store(thread_id(), Ordering::Relaxed);
        lock
    }

    /// The value, through the exclusive borrow (no locking).
    pub(crate) fn get_mut(&mut self) -> &mut T {
        self.value.get_mut()
    }

    /// Whether the lock is biased now (for tests).
    #[cfg(test)]
    pub(crate) fn is_biased(&self) -> bool {
        self.biased.load(Ordering::Relaxed)
    }

    /// Takes the lock. Not re-entrant (as a mutex: a thread that holds it must not take it
    /// again).
    #[inline]
    pub(crate) fn lock(&self) -> BiasedGuard<'_, T> {
        let me = thread_id();
        if self.biased.load(Ordering::Relaxed) && self.owner.load(Ordering::Relaxed) == me {
            self.busy.store(true, Ordering::Relaxed);
            // The other half of this fence is the revoker's `heavy_fence`: the compiler must
            // not move the store below the load, and the revoker's barrier runs on this CPU.
            compiler_fence(Ordering::SeqCst);
            if self.biased.load(Ordering::Relaxed) {
                return BiasedGuard {
                    lock: self,
                    mutex: None,
                    _value: PhantomData,
                };
            }
            self.busy.store(false, Ordering::Release);
        }
        self.lock_slow(me)
    }

    /// Runs `f` on the value, alone. `f` must not take this lock again.
    #[inline]
    pub(crate) fn with<R>(&self, f: impl FnOnce(&mut T) -> R) -> R {
        f(&mut self.lock())
    }

    #[cold]
    #[inline(never)]
    fn lock_slow(&self, me: u64) -> BiasedGuard<'_, T> {
        // A panic while holding the lock leaves no half-made handshake (the flags are set
        // only around the guard's life), so poisoning is ignored as the pool does.
        let mut streak = self.mutex.lock().unwrap_or_else(|p| p.into_inner());
        let mut owner = self.owner.load(Ordering::Relaxed);
        if owner == 0 {
            owner = me;
            self.owner.store(me, Ordering::Relaxed);
        }
        if owner != me {
            if self.biased.load(Ordering::Relaxed) {
                self.revoke();
                streak.rebias_after = streak.rebias_after.saturating_mul(2).min(streak.rebias_max);
            }
            streak.owner_entries = 0;
            return BiasedGuard {
                lock: self,
                mutex: Some((streak, false)),
                _value: PhantomData,
            };
        }
        streak.owner_entries = streak.owner_entries.saturating_add(1);
        let rebias = streak.owner_entries >= streak.rebias_after && bias_supported();
        BiasedGuard {
            lock: self,
            mutex: Some((streak, rebias)),
            _value: PhantomData,
        }
    }

    /// Clears the bias and waits until the owner is out. Holding the mutex.
    fn revoke(&self) {
        self.biased.store(false, Ordering::Relaxed);
        // Every thread now has a barrier between its `busy` store and its `biased` load
        // either before this point (so `busy` reads true here) or after (so it reads
        // `biased` false and backs off).
        heavy_fence();
        // The owner is usually out within a carve; but it may hold the lock across a runtime
        // call that blocks (a wait for a stream, a block from the source), so after a few
        // turns wait as a mutex's waiter would: asleep, in steps that double up to 1 ms.
        let mut turns = 0u32;
        while self.busy.load(Ordering::Acquire) {
            if turns < SPIN_TURNS {
                std::hint::spin_loop();
                std::thread::yield_now();
            } else {
                let step = (turns - SPIN_TURNS).min(10);
                std::thread::sleep(std::time::Duration::from_micros(1 << step));
            }
            turns = turns.saturating_add(1);
        }
    }
}

impl<T> std::ops::Deref for BiasedGuard<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        // SAFETY: this guard is the only one (see `Sync for BiasedLock`), so no `&mut T`
        // exists while it lives except through it.
        unsafe { &*self.lock.value.get() }
    }
}

impl<T> std::ops::DerefMut for BiasedGuard<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        // SAFETY: as in `deref`; the `&mut self` borrow makes this the only reference.
        unsafe { &mut *self.lock.value.get() }
    }
}

impl<T> Drop for BiasedGuard<'_, T> {
    fn drop(&mut self) {
        match self.mutex.take() {
            None => self.lock.busy.store(false, Ordering::Release),
            Some((streak, rebias)) => {
                if rebias {
                    // Only the owner sets it, holding the mutex: a thread that takes the
                    // mutex next sees it and revokes.
                    self.lock.biased.store(true, Ordering::Relaxed);
                }
                drop(streak);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    /// Owner and strangers work inside the lock while the bias is won and revoked again
    /// and again (it comes back after 4 owner entries here): two threads inside at once
    /// trip the `inside` flag, and a lost update shows in the total. (With the revoker's
    /// wait for `busy` taken out, this fails within a few runs.) The flag is relaxed so that
    /// it orders nothing: under ThreadSanitizer (`.ci/sanitize.sh thread`) the count is
    /// ordered by the lock alone, and a handover without a happens-before edge is reported
    /// as a race.
    #[test]
    fn owner_and_strangers_exclude_each_other() {
        let lock = Arc::new(BiasedLock::with_thresholds(0u64, 4, 4));
        let inside = Arc::new(AtomicBool::new(false));
        // Miri runs this some thousand times slower (and never biased: see
        // `register_membarrier`).
        let rounds = if cfg!(miri) { 200 } else { 20_000u64 };
        let bump = move |lock: &BiasedLock<u64>, inside: &AtomicBool| {
            let mut g = lock.lock();
            assert!(!inside.swap(true, Ordering::Relaxed), "two threads inside");
            let n = *g;
            // Long enough for a revocation to land while the owner is inside.
            for _ in 0..50 {
                std::hint::spin_loop();
            }
            *g = std::hint::black_box(n) + 1;
            inside.store(false, Ordering::Relaxed);
        };
        for _ in 0..5 {
            bump(&lock, &inside);
        }
        assert_eq!(lock.is_biased(), bias_supported());
        let strangers: Vec<_> = (0..2)
            .map(|_| {
                let (lock, inside) = (Arc::clone(&lock), Arc::clone(&inside));
                std::thread::spawn(move || {
                    for n in 0..rounds {
                        bump(&lock, &inside);
                        // Give the owner time to win the bias back.
                        if n % 8 == 0 {
                            std::thread::yield_now();
                        }
                    }
                })
            })
            .collect();
        for _ in 0..rounds * 4 {
            bump(&lock, &inside);
        }
        for t in strangers {
            t.join().unwrap();
        }
        assert_eq!(*lock.lock(), 5 + rounds * 4 + rounds * 2);
    }

    #[test]
    fn a_stranger_revokes_and_the_owner_wins_the_bias_back() {
        if !bias_supported() {
            return;
        }
        let lock = Arc::new(BiasedLock::new(0u32));
        for _ in 0..REBIAS_AFTER {
            *lock.lock() += 1;
        }
        assert!(
            lock.is_biased(),
            "biased after {REBIAS_AFTER} owner entries"
        );
        let other = Arc::clone(&lock);
        std::thread::spawn(move || *other.lock() += 1)
            .join()
            .unwrap();
        assert!(!lock.is_biased(), "a stranger's entry revokes the bias");
        assert_eq!(*lock.lock(), REBIAS_AFTER + 1);
        for _ in 1..REBIAS_AFTER {
            *lock.lock() += 1;
        }
        assert!(!lock.is_biased(), "a revocation doubles the entries needed");
        for _ in 0..REBIAS_AFTER {
            *lock.lock() += 1;
        }
        assert!(lock.is_biased(), "the owner wins it back");
    }

    /// Where the kernel offers private expedited `membarrier` (asked here directly, command
    /// and bit from linux/membarrier.h), the pool registers for it: without it every kind's
    /// lock would be a plain mutex, which no other test would notice (the bias tests below
    /// skip where registration failed, and check the bias where it succeeded).
    #[cfg(all(target_os = "linux", not(miri)))]
    #[test]
    fn the_pool_registers_wherever_the_kernel_offers_membarrier() {
        // SAFETY: a query (command 0) takes its arguments by value and touches no memory.
        let cmds = unsafe { libc::syscall(libc::SYS_membarrier, 0 as libc::c_long, 0, 0) };
        let offered = cmds >= 0 && cmds & (1 << 3) != 0;
        assert_eq!(bias_supported(), offered, "kernel's commands: {cmds:#x}");
    }

    /// A guard hands out `&T` through `&self`: sharing `&BiasedGuard` between threads
    /// shares `&T`, so the guard may be `Sync` only where `T` is (as a `MutexGuard`).
    /// Told apart at run time: the inherent `is_sync` exists only for `Sync` types, and a
    /// call falls back to the trait's otherwise.
    #[test]
    fn a_guard_is_sync_only_when_its_value_is() {
        struct Probe<T>(std::marker::PhantomData<T>);
        trait NotSync {
            fn is_sync(&self) -> bool {
                false
            }
        }
        impl<T> NotSync for Probe<T> {}
        impl<T: Sync> Probe<T> {
            fn is_sync(&self) -> bool {
                true
            }
        }
        let cell = Probe::<BiasedGuard<'static, Cell<u64>>>(std::marker::PhantomData);
        assert!(!cell.is_sync(), "a guard of a Cell must not be Sync");
        let plain = Probe::<BiasedGuard<'static, u64>>(std::marker::PhantomData);
        assert!(plain.is_sync());
    }

    /// The owner may hold its kind's lock across a runtime call that blocks for long (a
    /// wait for a stream's events, a block from the source): a stranger that revokes the
    /// bias meanwhile must wait for it as a mutex's waiter would, not burn a core.
    #[cfg(all(target_os = "linux", not(miri)))]
    #[test]
    fn a_stranger_waiting_for_a_blocked_owner_does_not_spin() {
        if !bias_supported() {
            return;
        }
        fn cpu_time() -> std::time::Duration {
            let mut ts = libc::timespec {
                tv_sec: 0,
                tv_nsec: 0,
            };
            // SAFETY: `ts` is a valid, writable timespec; the clock id is a constant.
            let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
            assert_eq!(rc, 0);
            std::time::Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
        }
        let lock = Arc::new(BiasedLock::new(0u32));
        for _ in 0..REBIAS_AFTER {
            *lock.lock() += 1;
        }
        assert!(lock.is_biased());
        let held = lock.lock();
        let other = Arc::clone(&lock);
        let stranger = std::thread::spawn(move || {
            let start = cpu_time();
            *other.lock() += 1;
            cpu_time() - start
        });
        // The owner, inside through the bias, blocks in the runtime for a while.
        std::thread::sleep(std::time::Duration::from_millis(400));
        drop(held);
        let spent = stranger.join().unwrap();
        assert!(
            spent < std::time::Duration::from_millis(100),
            "the stranger spent {spent:?} of CPU time waiting 400 ms for the owner"
        );
        assert_eq!(*lock.lock(), REBIAS_AFTER + 1);
    }

    #[test]
    fn debug_shows_the_owner_and_the_bias() {
        let lock = BiasedLock::new(7u8);
        *lock.lock() += 1;
        let shown = format!("{lock:?}");
        assert!(
            shown.starts_with("BiasedLock { owner: ") && shown.contains("biased: "),
            "{shown}"
        );
        assert!(
            !shown.contains("owner: 0"),
            "the first entry names the owner: {shown}"
        );
    }

    #[test]
    fn a_guard_dropped_by_a_panic_lets_go() {
        let lock = Arc::new(BiasedLock::new(0u32));
        for _ in 0..REBIAS_AFTER + 1 {
            *lock.lock() += 1;
        }
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let _g = lock.lock();
            panic!("inside");
        }));
        assert!(r.is_err());
        let other = Arc::clone(&lock);
        std::thread::spawn(move || *other.lock() += 1)
            .join()
            .unwrap();
        assert_eq!(*lock.lock(), REBIAS_AFTER + 2);
    }
}
