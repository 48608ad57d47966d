//! Per-thread caches of free segments, in front of the kind pools.
//!
//! A thread that frees a small or medium segment keeps it in its own [`ThreadCache`]; its
//! next allocation of the same length and alignment takes it back without touching the
//! kind pool's lock, the carving engine or the live-segment registry. Two threads that
//! allocate and free at once so work on two different locks that nobody else takes, and
//! scale with the cores.
//!
//! A cached segment stays live in its kind pool (carved, registered); the cache only knows
//! that its user has let it go. So the pool's statistics are "kind pool figures minus what
//! the caches hold", and the caches' counters live under the same lock as their items:
//! read together under the locks below, the figures are exact.
//!
//! Lock order (every path that takes more than one): kind pool → [`CacheRegistry`] →
//! [`ThreadCache`]. The hot path takes only its own thread's cache lock, which no other
//! thread takes except to flush, read statistics or validate. That lock is a
//! [`SpinLock`](super::sync::SpinLock): uncontended, one atomic swap to take it and a plain
//! store to give it back, where a `Mutex` costs two atomic read-modify-writes.
//!
//! This module knows nothing of the pool: it holds any [`CacheItem`], so the loom models
//! in `tests/loom_cache.rs` check this very code with loom's primitives in place of
//! `std::sync` (through the parent module's `sync` shim; there the cache's lock is loom's
//! mutex, since loom cannot bound a spin loop).

use super::sync::{Arc, AtomicU64, Mutex, MutexGuard, SpinLock};
use std::sync::atomic::Ordering;

/// Classes a cache keeps counters for (one per memory kind).
pub(crate) const CLASSES: usize = 5;
/// Distinct shapes one cache holds at once; a new shape beyond them reuses an empty bin.
const MAX_BINS: usize = 16;

/// What a cache holds: a free segment of one class, reusable for one exact shape.
pub(crate) trait CacheItem {
    /// Class index, below [`CLASSES`] (the memory kind).
    fn class(&self) -> usize;
    /// Requested length and alignment: an allocation takes the item only on an exact match,
    /// so the kind pool's record of the segment stays true while it is reused.
    fn shape(&self) -> (u64, u64);
    /// Bytes the item occupies in its chunk (its footprint).
    fn bytes(&self) -> u64;
}

/// One class's figures in one cache.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ClassCounters {
    /// Free items held now.
    pub(crate) items: u64,
    /// Their footprint bytes.
    pub(crate) bytes: u64,
    /// Their requested bytes.
    pub(crate) requested: u64,
    /// Allocations served from the cache so far.
    pub(crate) hits: u64,
    /// Frees kept in the cache so far.
    pub(crate) puts: u64,
}

impl ClassCounters {
    /// Adds the running totals (`hits`, `puts`) of `other`; the held figures are not summed.
    fn absorb_totals(&mut self, other: &ClassCounters) {
        self.hits += other.hits;
        self.puts += other.puts;
    }
}

/// The key a bin is found by: class in the low 3 bits, log2 of the alignment in the next
/// 6, the length above. `None` for a shape no key can name (a length past 2^55, an
/// alignment that is not a power of two): such items are never cached.
fn bin_key(class: usize, (len, align): (u64, u64)) -> Option<u64> {
    if class >= CLASSES || len == 0 || len >> 55 != 0 || !align.is_power_of_two() {
        return None;
    }
    Some(len << 9 | u64::from(align.trailing_zeros()) << 3 | class as u64)
}

/// The class a bin key names.
fn key_class(key: u64) -> usize {
    (key & 7) as usize
}

#[derive(Debug)]
struct Bins<T> {
    /// The shape of each bin, as [`bin_key`] names it; `0` for a bin never used. No two
    /// used bins share a key. Kept apart from the items so that a lookup scans one line.
    keys: [u64; MAX_BINS],
    /// `items[i]`: free items of the class and shape `keys[i]` names (none when it is 0).
    items: [Vec<T>; MAX_BINS],
    /// Sum of `bytes()` over every held item; never above the cache's limit.
    bytes: u64,
    /// `counters[c].items`, `.bytes`, `.requested` are the sums over held items of class `c`.
    counters: [ClassCounters; CLASSES],
}

impl<T> Bins<T> {
    /// The bin of `key`, if one is assigned to it.
    fn find(&self, key: u64) -> Option<usize> {
        self.keys.iter().position(|&k| k == key)
    }
}

/// Whether [`ThreadCache::put`] kept the item.
#[derive(Debug)]
pub(crate) enum Put<T> {
    /// The cache holds it now.
    Kept,
    /// No room: the caller frees it (or flushes the cache and tries again).
    Full(T),
}

/// One thread's cache for one pool. Aligned so that two threads' caches never share a
/// cache line.
#[derive(Debug)]
#[repr(align(128))]
pub(crate) struct ThreadCache<T> {
    /// Registry key.
    id: u64,
    /// Most bytes held at once.
    limit: u64,
    /// A copy of `bins.keys`, readable without the lock: only the owning thread assigns a
    /// bin's key (in [`put`](Self::put)), so the owner reads its own writes here and a
    /// [`take`](Self::take) of a shape no bin names returns without the lock.
    shapes: [AtomicU64; MAX_BINS],
    bins: SpinLock<Bins<T>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // The registry's state is updated only after every fallible step, so a panic elsewhere
    // leaves it whole: keep serving rather than poisoning the pool.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl<T: CacheItem> ThreadCache<T> {
    fn new(id: u64, limit: u64) -> Self {
        Self {
            id,
            limit,
            shapes: std::array::from_fn(|_| AtomicU64::new(0)),
            bins: SpinLock::new(Bins {
                keys: [0; MAX_BINS],
                items: std::array::from_fn(|_| Vec::new()),
                bytes: 0,
                counters: [ClassCounters::default(); CLASSES],
            }),
        }
    }

    /// Takes a held item of `class` and `shape` occupying at least `min_bytes`, if any.
    /// (Two requests of one shape may need different footprints: a device kind's
    /// policies differ in padding.)
    ///
    /// Only the thread that owns the cache takes and puts (others drain, count and check).
    pub(crate) fn take(&self, class: usize, shape: (u64, u64), min_bytes: u64) -> Option<T> {
        let key = bin_key(class, shape)?;
        let at = self
            .shapes
            .iter()
            .position(|s| s.load(Ordering::Relaxed) == key)?;
        self.bins.with(|b| {
            if b.keys[at] != key {
                return None;
            }
            let items = &mut b.items[at];
            let bytes = items.last()?.bytes();
            if bytes < min_bytes {
                return None;
            }
            let item = items.pop()?;
            b.bytes -= bytes;
            let c = &mut b.counters[class];
            c.items -= 1;
            c.bytes -= bytes;
            c.requested -= shape.0;
            c.hits += 1;
            Some(item)
        })
    }

    /// Keeps `item` if there is room: a bin of its shape, or one it may take over (never
    /// used, or empty). Only the owning thread puts.
    pub(crate) fn put(&self, item: T) -> Put<T> {
        let (class, shape, bytes) = (item.class(), item.shape(), item.bytes());
        let Some(key) = bin_key(class, shape) else {
            return Put::Full(item);
        };
        self.bins.with(|b| {
            if b.bytes + bytes > self.limit {
                return Put::Full(item);
            }
            let at = match b.find(key) {
                Some(i) => i,
                None => match (0..MAX_BINS).find(|&i| b.items[i].is_empty()) {
                    Some(i) => {
                        b.keys[i] = key;
                        self.shapes[i].store(key, Ordering::Relaxed);
                        i
                    }
                    None => return Put::Full(item),
                },
            };
            b.items[at].push(item);
            b.bytes += bytes;
            let c = &mut b.counters[class];
            c.items += 1;
            c.bytes += bytes;
            c.requested += shape.0;
            c.puts += 1;
            Put::Kept
        })
    }

    /// Removes and returns every held item of `class` (for a flush).
    pub(crate) fn drain_class(&self, class: usize) -> Vec<T> {
        self.bins.with(|b| {
            let mut out = Vec::with_capacity(b.counters[class].items as usize);
            for (key, items) in b.keys.iter().zip(b.items.iter_mut()) {
                if *key != 0 && key_class(*key) == class {
                    out.append(items);
                }
            }
            let held = b.counters[class].bytes;
            b.bytes -= held;
            let c = &mut b.counters[class];
            c.items = 0;
            c.bytes = 0;
            c.requested = 0;
            out
        })
    }

    /// The figures of `class`.
    pub(crate) fn counters(&self, class: usize) -> ClassCounters {
        self.bins.with(|b| b.counters[class])
    }

    /// Classes that hold items now.
    pub(crate) fn classes_held(&self) -> [bool; CLASSES] {
        self.bins
            .with(|b| std::array::from_fn(|c| b.counters[c].items > 0))
    }

    /// Calls `f` on every held item of `class`.
    pub(crate) fn for_each_held(&self, class: usize, mut f: impl FnMut(&T)) {
        self.bins.with(|b| {
            for (key, items) in b.keys.iter().zip(b.items.iter()) {
                if *key != 0 && key_class(*key) == class {
                    items.iter().for_each(&mut f);
                }
            }
        })
    }

    /// Checks the invariants written on [`Bins`]' fields, and the copy in `shapes`.
    pub(crate) fn check(&self) -> Result<(), String> {
        self.bins.with(|b| self.check_bins(b))
    }

    fn check_bins(&self, b: &Bins<T>) -> Result<(), String> {
        let mut sums = [ClassCounters::default(); CLASSES];
        let mut total = 0;
        for (i, (&key, items)) in b.keys.iter().zip(b.items.iter()).enumerate() {
            if key == 0 {
                if !items.is_empty() {
                    return Err(format!("bin {i} holds items but names no shape"));
                }
                continue;
            }
            if self.shapes[i].load(Ordering::Relaxed) != key {
                return Err(format!("bin {i}'s shape copy is stale"));
            }
            if b.keys[..i].contains(&key) {
                return Err(format!("two bins for key {key:#x}"));
            }
            for item in items {
                if bin_key(item.class(), item.shape()) != Some(key) {
                    return Err("an item sits in the wrong bin".into());
                }
                let s = &mut sums[item.class()];
                s.items += 1;
                s.bytes += item.bytes();
                s.requested += item.shape().0;
                total += item.bytes();
            }
        }
        if total != b.bytes || total > self.limit {
            return Err(format!(
                "bins holding {total} bytes, counter {} limit {}",
                b.bytes, self.limit
            ));
        }
        for (c, s) in sums.iter().enumerate() {
            let k = &b.counters[c];
            if (s.items, s.bytes, s.requested) != (k.items, k.bytes, k.requested) {
                return Err(format!("class {c} counters drifted from the held items"));
            }
        }
        Ok(())
    }
}

/// Every live thread cache of one pool, and the running totals of caches whose threads
/// have exited.
#[derive(Debug)]
pub(crate) struct CacheRegistry<T> {
    limit: u64,
    /// Registered caches and the id the next one gets.
    caches: Mutex<(Vec<Arc<ThreadCache<T>>>, u64)>,
    /// `hits` and `puts` of unregistered caches (they held nothing when they left).
    retired: Mutex<[ClassCounters; CLASSES]>,
}

impl<T: CacheItem> CacheRegistry<T> {
    /// A registry whose caches hold at most `limit` bytes each.
    pub(crate) fn new(limit: u64) -> Self {
        Self {
            limit,
            caches: Mutex::new((Vec::new(), 0)),
            retired: Mutex::new([ClassCounters::default(); CLASSES]),
        }
    }

    /// A new empty cache, registered.
    pub(crate) fn register(&self) -> Arc<ThreadCache<T>> {
        let mut g = lock(&self.caches);
        let cache = Arc::new(ThreadCache::new(g.1, self.limit));
        g.1 += 1;
        g.0.push(Arc::clone(&cache));
        cache
    }

    /// Forgets `cache`, keeping its running totals. Its items must have been drained;
    /// any left are returned for the caller to free.
    pub(crate) fn unregister(&self, cache: &ThreadCache<T>) -> Vec<T> {
        let mut g = lock(&self.caches);
        g.0.retain(|c| c.id != cache.id);
        let mut left = Vec::new();
        let mut retired = lock(&self.retired);
        for (c, r) in retired.iter_mut().enumerate() {
            left.append(&mut cache.drain_class(c));
            r.absorb_totals(&cache.counters(c));
        }
        left
    }

    /// Calls `f` on every registered cache, holding the registry lock (so no cache joins
    /// or leaves meanwhile).
    pub(crate) fn for_each(&self, mut f: impl FnMut(&ThreadCache<T>)) {
        let g = lock(&self.caches);
        for c in &g.0 {
            f(c);
        }
    }

    /// Sum of `class` figures over every registered cache and the retired totals.
    pub(crate) fn totals(&self, class: usize) -> ClassCounters {
        let g = lock(&self.caches);
        let mut t = lock(&self.retired)[class];
        for c in &g.0 {
            let k = c.counters(class);
            t.items += k.items;
            t.bytes += k.bytes;
            t.requested += k.requested;
            t.absorb_totals(&k);
        }
        t
    }

    /// Drains `class` from every registered cache.
    pub(crate) fn drain_all(&self, class: usize) -> Vec<T> {
        let mut out = Vec::new();
        self.for_each(|c| out.append(&mut c.drain_class(class)));
        out
    }
}
