//! loom models of the per-thread caches: `src/pool/cache.rs` itself, compiled here with
//! loom's `Arc` and `Mutex` in place of `std::sync`'s, so every interleaving loom explores
//! runs the pool's own code.
//!
//! A "backing" mutex stands for a kind pool: items leave it when allocated and come back
//! when a cache is flushed, taken in the same lock order as the pool (backing → registry →
//! cache). The models check, over all interleavings (up to `LOOM_MAX_PREEMPTIONS`, 3 when
//! unset; 3 is the least that finds a `totals` that reads the registry and the retired
//! totals in two critical sections — checked by making that mutation):
//! - no item is lost or duplicated, whatever mix of allocate, free into a cache, flush of
//!   every cache and thread retirement runs at once;
//! - statistics read under the locks always add up: items carved out of the backing minus
//!   items held in caches is exactly what users hold, never negative;
//! - the running totals never go backwards while a thread's cache is retired.

use loom::thread;

/// The shim `cache.rs` takes its primitives from (`super::sync`).
mod sync {
    pub(crate) use loom::sync::atomic::AtomicU64;
    pub(crate) use loom::sync::{Arc, Mutex, MutexGuard};

    /// The cache's lock, as loom's mutex: loom cannot model the `membarrier` handshake of the
    /// pool's biased lock. (That lock has its own tests, `pool::biased::tests`.)
    #[derive(Debug)]
    pub(crate) struct CacheLock<T>(Mutex<T>);

    impl<T> CacheLock<T> {
        pub(crate) fn new_owned(value: T) -> Self {
            Self(Mutex::new(value))
        }

        pub(crate) fn with<R>(&self, f: impl FnOnce(&mut T) -> R) -> R {
            f(&mut self.lock())
        }

        pub(crate) fn lock(&self) -> MutexGuard<'_, T> {
            self.0.lock().unwrap()
        }
    }
}

#[path = "../src/pool/cache.rs"]
#[allow(dead_code)]
mod cache;

use cache::{CacheItem, CacheRegistry, ThreadCache};
use sync::{Arc, Mutex};

/// A stand-in segment: an id to spot duplicates, one class, one shape.
#[derive(Debug, PartialEq, Eq)]
struct Item(u32);

const LEN: u64 = 100;
const CLASS: usize = 1;

impl CacheItem for Item {
    fn class(&self) -> usize {
        CLASS
    }
    fn shape(&self) -> (u64, u64) {
        (LEN, 64)
    }
    fn bytes(&self) -> u64 {
        LEN + 28
    }
}

/// The kind pool stand-in: free items, and how many exist.
struct Backing {
    free: Vec<Item>,
    total: usize,
}

fn model(f: impl Fn() + Sync + Send + 'static) {
    let mut b = loom::model::Builder::new();
    if b.preemption_bound.is_none() {
        b.preemption_bound = Some(3);
    }
    b.check(f);
}

/// What one user thread does, the way the pool does it: allocate (cache first), free into
/// the cache (flushing it whole when full), twice; then retire its cache.
fn user(backing: &Mutex<Backing>, reg: &CacheRegistry<Item>) {
    let cache = reg.register();
    for _ in 0..2 {
        let item = match cache.take(CLASS, (LEN, 64), 0) {
            Some(i) => i,
            None => match backing.lock().unwrap().free.pop() {
                Some(i) => i,
                None => continue, // exhausted: the pool would flush and retry or fail
            },
        };
        if let Err(item) = cache.put(item) {
            let mut b = backing.lock().unwrap();
            b.free.extend(cache.drain_class(CLASS));
            b.free.push(item);
        }
    }
    retire(backing, reg, &cache);
}

fn retire(backing: &Mutex<Backing>, reg: &CacheRegistry<Item>, cache: &ThreadCache<Item>) {
    let mut b = backing.lock().unwrap();
    b.free.extend(cache.drain_class(CLASS));
    drop(b);
    let left = reg.unregister(cache);
    backing.lock().unwrap().free.extend(left);
}

/// Checks the figures under the backing lock, as `Pool::stats` does under the kind lock.
fn check_figures(backing: &Mutex<Backing>, reg: &CacheRegistry<Item>) {
    let b = backing.lock().unwrap();
    let carved = b.total - b.free.len();
    let t = reg.totals(CLASS);
    assert!(
        t.items as usize <= carved,
        "{} cached of {carved} carved",
        t.items
    );
    assert_eq!(t.bytes, t.items * (LEN + 28));
    assert_eq!(t.requested, t.items * LEN);
    // Every allocation served from a cache was put there first.
    assert!(t.hits <= t.puts);
}

fn all_back(backing: &Mutex<Backing>) {
    let b = backing.lock().unwrap();
    assert_eq!(b.free.len(), b.total, "an item was lost");
    let mut ids: Vec<u32> = b.free.iter().map(|i| i.0).collect();
    ids.sort_unstable();
    ids.dedup();
    assert_eq!(ids.len(), b.total, "an item was duplicated");
}

/// A model's shared state and its user threads, as [`start`] leaves them.
type Started = (
    Arc<Mutex<Backing>>,
    Arc<CacheRegistry<Item>>,
    Vec<thread::JoinHandle<()>>,
);

/// A backing store of `items` free items and a registry whose caches hold `room` of them,
/// with `users` threads running [`user`] on them.
fn start(items: u32, room: u64, users: usize) -> Started {
    let backing = Arc::new(Mutex::new(Backing {
        free: (0..items).map(Item).collect(),
        total: items as usize,
    }));
    let reg = Arc::new(CacheRegistry::new(room * (LEN + 28)));
    let handles = (0..users)
        .map(|_| {
            let (backing, reg) = (backing.clone(), reg.clone());
            thread::spawn(move || user(&backing, &reg))
        })
        .collect();
    (backing, reg, handles)
}

#[test]
fn two_users_and_a_flush_lose_nothing() {
    model(|| {
        // Room for one item: the second free into a cache overflows and flushes it.
        let (backing, reg, users) = start(3, 1, 2);
        // Meanwhile: flush every cache (Pool::flush_thread_caches), then read the figures.
        {
            let mut b = backing.lock().unwrap();
            b.free.extend(reg.drain_all(CLASS));
        }
        check_figures(&backing, &reg);
        for u in users {
            u.join().unwrap();
        }
        check_figures(&backing, &reg);
        all_back(&backing);
        let t = reg.totals(CLASS);
        assert_eq!((t.items, t.bytes), (0, 0));
        let mut reg_empty = true;
        reg.for_each_locked(|_, _| reg_empty = false);
        assert!(reg_empty, "every cache unregistered");
    });
}

#[test]
fn totals_never_go_backwards_while_a_cache_retires() {
    model(|| {
        let (backing, reg, users) = start(2, 4, 1);
        let first = reg.totals(CLASS);
        let second = reg.totals(CLASS);
        assert!(second.puts >= first.puts && second.hits >= first.hits);
        for u in users {
            u.join().unwrap();
        }
        let last = reg.totals(CLASS);
        assert!(last.puts >= second.puts && last.hits >= second.hits);
        // The user freed twice and served its second allocation from its cache.
        assert_eq!((last.puts, last.hits), (2, 1));
        all_back(&backing);
    });
}

#[test]
fn validate_sees_consistent_bins_while_users_work() {
    model(|| {
        let (backing, reg, users) = start(2, 2, 1);
        // What Pool::validate does: check every cache's invariants and its items.
        {
            let _b = backing.lock().unwrap();
            reg.for_each_locked(|c, b| {
                c.check_bins(b).unwrap();
                ThreadCache::for_each_held_locked(b, CLASS, |i| assert!(i.0 < 2));
            });
        }
        for u in users {
            u.join().unwrap();
        }
        all_back(&backing);
    });
}
