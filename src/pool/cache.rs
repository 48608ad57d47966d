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
//! [`CacheLock`], biased to the owning thread: while no other
//! thread has taken it lately, the owner takes it with plain loads and stores, no atomic
//! read-modify-write.
//!
//! This module knows nothing of the pool: it holds any [`CacheItem`], so the loom models
//! in `tests/loom_cache.rs` check this very code with loom's primitives in place of
//! `std::sync` (through the parent module's `sync` shim; there the cache's lock is loom's
//! mutex, since loom cannot model the biased lock's `membarrier` handshake).

use super::sync::{Arc, AtomicU64, CacheLock, Mutex, MutexGuard};
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

/// The requested length a bin key names.
fn key_len(key: u64) -> u64 {
    key >> 9
}

#[derive(Debug)]
pub(crate) struct Bins<T> {
    /// The shape of each bin, as [`bin_key`] names it; `0` for a bin never used. No two
    /// used bins share a key. Kept apart from the items so that a lookup scans one line.
    keys: [u64; MAX_BINS],
    /// `items[i]`: free items of the class and shape `keys[i]` names (none when it is 0).
    items: [Vec<T>; MAX_BINS],
    /// Sum of `bytes()` over every held item; never above the cache's limit.
    bytes: u64,
    /// `held[c]`: (number, sum of `bytes()`) of the held items of class `c`. Their requested
    /// bytes follow from the bins' shapes, and the hits from `puts - drained - held`: so a
    /// take writes three words and a put four, rather than a class's five counters.
    held: [(u64, u64); CLASSES],
    /// Items of each class ever put.
    puts: [u64; CLASSES],
    /// Items of each class drained (given back without serving an allocation).
    drained: [u64; CLASSES],
    /// Bit `i` of `class_bins[c]` is set iff bin `i` is used for class `c`: a flush of one
    /// class visits only its bins.
    class_bins: [u16; CLASSES],
    /// `sharing[b]`: used bins whose key has bit `1 << b` as its [`KeyHash::present`] (at
    /// most `MAX_BINS`, so a byte holds it).
    sharing: [u8; 64],
}

impl<T> Bins<T> {
    /// The bins used for `class`, in bin order.
    fn of_class(&self, class: usize) -> impl Iterator<Item = usize> {
        let mut bins = self.class_bins[class];
        std::iter::from_fn(move || {
            let i = bins.trailing_zeros() as usize;
            bins &= bins.wrapping_sub(1);
            (i < MAX_BINS).then_some(i)
        })
    }

    /// The figures of `class`.
    fn counters(&self, class: usize) -> ClassCounters {
        let (items, bytes) = self.held[class];
        let requested = self
            .of_class(class)
            .map(|i| self.items[i].len() as u64 * key_len(self.keys[i]))
            .sum();
        ClassCounters {
            items,
            bytes,
            requested,
            hits: self.puts[class] - self.drained[class] - items,
            puts: self.puts[class],
        }
    }
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
    /// Bit [`KeyHash::present`] of a key is set iff a bin in `shapes` has a key with that
    /// bit (`Bins::sharing` counts them): a shape whose bit is clear has no bin, known
    /// without a scan (most shapes of a varied workload). Written by the owner, under the
    /// lock, when it assigns a bin.
    present: AtomicU64,
    /// Where a shape was last found: 16 bin numbers of 4 bits, the one at
    /// [`KeyHash::hint`] for shapes whose key hashes there. A hint only, checked against
    /// `shapes` before use (a wrong one costs the scan it saves); written by the owner.
    hints: AtomicU64,
    bins: CacheLock<Bins<T>>,
}

// Bin numbers fit the 4-bit hints and the 16-bit `class_bins`.
static_assertions::const_assert!(MAX_BINS <= 16);

/// Invariants [`ThreadCache::drift_for_test`] can break.
#[cfg(test)]
pub(super) const DRIFTS: usize = 10;

/// Where a bin key falls in [`ThreadCache::present`] and [`ThreadCache::hints`].
#[derive(Clone, Copy)]
struct KeyHash {
    /// Its bit in `present`.
    present: u64,
    /// The offset of its 4-bit hint in `hints`.
    hint: u32,
}

impl KeyHash {
    #[inline]
    fn of(key: u64) -> Self {
        // The top bits of a multiplicative hash: every bit of the key moves them.
        let h = key.wrapping_mul(0x9E37_79B9_7F4A_7C15);
        Self {
            present: 1 << (h >> 58),
            hint: ((h >> 54 & 0xF) * 4) as u32,
        }
    }
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
            present: AtomicU64::new(0),
            hints: AtomicU64::new(0),
            bins: CacheLock::new_owned(Bins {
                keys: [0; MAX_BINS],
                items: std::array::from_fn(|_| Vec::new()),
                bytes: 0,
                held: [(0, 0); CLASSES],
                puts: [0; CLASSES],
                drained: [0; CLASSES],
                class_bins: [0; CLASSES],
                sharing: [0; 64],
            }),
        }
    }

    /// Takes a held item of `class` and `shape` occupying at least `min_bytes`, if any.
    /// (Two requests of one shape may need different footprints: a device kind's
    /// policies differ in padding.)
    ///
    /// Only the thread that owns the cache takes and puts (others drain, count and check).
    #[inline]
    pub(crate) fn take(&self, class: usize, shape: (u64, u64), min_bytes: u64) -> Option<T> {
        let key = bin_key(class, shape)?;
        let at = self.bin_of(key)?;
        self.bins.with(move |b| {
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
            let held = &mut b.held[class];
            held.0 -= 1;
            held.1 -= bytes;
            Some(item)
        })
    }

    /// Keeps `item` if there is room: a bin of its shape, or one it may take over (never
    /// used, or empty). Gives it back when not (for the caller to free, or to flush the
    /// cache and try again). Only the owning thread puts.
    #[cfg(test)]
    pub(crate) fn put(&self, item: T) -> Result<(), T> {
        let (class, shape, bytes) = (item.class(), item.shape(), item.bytes());
        self.put_with(class, shape, bytes, item, |item| item)
    }

    /// [`put_open`](Self::put_open) that is always open.
    #[cfg(test)]
    pub(crate) fn put_with<P>(
        &self,
        class: usize,
        shape: (u64, u64),
        bytes: u64,
        parts: P,
        make: impl FnOnce(P) -> T,
    ) -> Result<(), P> {
        self.put_open(class, shape, bytes, parts, |_| true, make)
    }

    /// Keeps the item `make(parts)` would build, of `class`, `shape` and `bytes`, if there
    /// is room (a bin of its shape, or one it may take over: never used, or empty) and
    /// `open(&parts)` holds when asked under the
    /// cache's lock (so a flush that takes the lock after setting what `open` reads is
    /// ordered before the question). The item is built only once it has a place, and
    /// straight into its bin. Gives `parts` back otherwise. Only the owning thread puts.
    ///
    /// The free path builds its item here rather than on its own stack: a 48-byte item
    /// written in 8-byte fields and read back in 16-byte words cannot be forwarded from the
    /// store buffer, and a lone put waited for its stores to reach the cache.
    #[inline]
    pub(crate) fn put_open<P>(
        &self,
        class: usize,
        shape: (u64, u64),
        bytes: u64,
        parts: P,
        open: impl FnOnce(&P) -> bool,
        make: impl FnOnce(P) -> T,
    ) -> Result<(), P> {
        let Some(key) = bin_key(class, shape) else {
            return Err(parts);
        };
        // `move`: the closure holds its values, not pointers to them to load first.
        self.bins.with(move |b| {
            if b.bytes + bytes > self.limit || !open(&parts) {
                return Err(parts);
            }
            let Some(at) = self.bin_of(key).or_else(|| self.assign_bin(b, key)) else {
                return Err(parts);
            };
            let items = &mut b.items[at];
            items.reserve(1);
            let len = items.len();
            items.spare_capacity_mut()[0].write(make(parts));
            // SAFETY: the slot at `len` is within the capacity reserved above and was just
            // written, so the first `len + 1` items are initialized.
            unsafe { items.set_len(len + 1) };
            b.bytes += bytes;
            let held = &mut b.held[class];
            held.0 += 1;
            held.1 += bytes;
            b.puts[class] += 1;
            Ok(())
        })
    }

    /// A bin for a shape no bin names yet, `key`: the first empty one, if any.
    #[cold]
    fn assign_bin(&self, b: &mut Bins<T>, key: u64) -> Option<usize> {
        let i = (0..MAX_BINS).find(|&i| b.items[i].is_empty())?;
        let mut present = self.present.load(Ordering::Relaxed);
        let old = b.keys[i];
        if old != 0 {
            b.class_bins[key_class(old)] &= !(1 << i);
            let bit = KeyHash::of(old).present;
            let n = &mut b.sharing[bit.trailing_zeros() as usize];
            *n -= 1;
            if *n == 0 {
                present &= !bit;
            }
        }
        b.class_bins[key_class(key)] |= 1 << i;
        let h = KeyHash::of(key);
        b.sharing[h.present.trailing_zeros() as usize] += 1;
        self.present.store(present | h.present, Ordering::Relaxed);
        b.keys[i] = key;
        self.shapes[i].store(key, Ordering::Relaxed);
        self.set_hint(h, i);
        Some(i)
    }

    /// The bin whose shape `key` names, if any: where its hint points, else none when its
    /// bit in `present` is clear, else by a scan. Only the owning thread calls it (it
    /// writes the hint).
    #[inline]
    fn bin_of(&self, key: u64) -> Option<usize> {
        let h = KeyHash::of(key);
        let hinted = (self.hints.load(Ordering::Relaxed) >> h.hint & 0xF) as usize;
        if self.shapes[hinted].load(Ordering::Relaxed) == key {
            return Some(hinted);
        }
        if self.present.load(Ordering::Relaxed) & h.present == 0 {
            return None;
        }
        let at = self
            .shapes
            .iter()
            .position(|s| s.load(Ordering::Relaxed) == key)?;
        self.set_hint(h, at);
        Some(at)
    }

    /// Points the hint at `h` to bin `at`. Only the owner writes hints: a load and a store.
    fn set_hint(&self, h: KeyHash, at: usize) {
        let hints = self.hints.load(Ordering::Relaxed) & !(0xF << h.hint);
        self.hints
            .store(hints | (at as u64) << h.hint, Ordering::Relaxed);
    }

    /// Removes and returns every held item of `class` (for a flush).
    pub(crate) fn drain_class(&self, class: usize) -> Vec<T> {
        let mut out = Vec::new();
        self.drain_class_into(class, &mut out);
        out
    }

    /// Moves every held item of `class` to the end of `out`, bin by bin in bin order (a
    /// flush frees them in this order). One buffer serves every class of a flush.
    pub(crate) fn drain_class_into(&self, class: usize, out: &mut Vec<T>) {
        self.bins.with(|b| {
            let (items, bytes) = std::mem::take(&mut b.held[class]);
            out.reserve(items as usize);
            let mut bins = b.class_bins[class];
            while bins != 0 {
                let i = bins.trailing_zeros() as usize;
                bins &= bins - 1;
                out.append(&mut b.items[i]);
            }
            b.bytes -= bytes;
            b.drained[class] += items;
        })
    }

    /// The figures of `class`.
    pub(crate) fn counters(&self, class: usize) -> ClassCounters {
        self.bins.with(|b| b.counters(class))
    }

    /// Items held now, per class.
    pub(crate) fn items_held(&self) -> [u64; CLASSES] {
        self.bins.with(|b| std::array::from_fn(|c| b.held[c].0))
    }

    /// Calls `f` on every held item of `class`, in bins the caller holds locked.
    pub(crate) fn for_each_held_locked(b: &Bins<T>, class: usize, mut f: impl FnMut(&T)) {
        for (key, items) in b.keys.iter().zip(b.items.iter()) {
            if *key != 0 && key_class(*key) == class {
                items.iter().for_each(&mut f);
            }
        }
    }

    /// [`check_bins`](Self::check_bins), taking the lock.
    #[cfg(test)]
    pub(crate) fn check(&self) -> Result<(), String> {
        self.bins.with(|b| self.check_bins(b))
    }

    /// Breaks one invariant [`check`](Self::check) guards, `case` below [`DRIFTS`], in a
    /// cache holding items in one bin and naming a shape in another: for tests of `check`.
    #[cfg(test)]
    pub(super) fn drift_for_test(&self, case: usize) {
        self.bins.with(|b| {
            let full = (0..MAX_BINS).find(|&i| !b.items[i].is_empty());
            let full = full.expect("a bin holds items");
            let other = (0..MAX_BINS).find(|&i| i != full && b.keys[i] != 0);
            let other = other.expect("a second bin names a shape");
            let key = b.keys[full];
            let class = key_class(key);
            match case {
                0 => b.keys[full] = 0,
                1 => self.shapes[full].store(key ^ 1 << 9, Ordering::Relaxed),
                2 => {
                    b.keys[other] = key;
                    self.shapes[other].store(key, Ordering::Relaxed);
                }
                3 => {
                    let item = b.items[full].pop().expect("held");
                    b.items[other].push(item);
                }
                4 => b.bytes += 64,
                5 => b.class_bins[class] ^= 1 << full,
                6 => {
                    let present = self.present.load(Ordering::Relaxed);
                    let bit = KeyHash::of(key).present;
                    self.present.store(present ^ bit, Ordering::Relaxed);
                }
                7 => b.sharing[KeyHash::of(key).present.trailing_zeros() as usize] += 1,
                8 => b.held[class].1 += 64,
                _ => b.puts[class] = 0,
            }
        })
    }

    /// Checks the invariants written on [`Bins`]' fields, and the copy in `shapes`, on bins
    /// the caller holds locked.
    pub(crate) fn check_bins(&self, b: &Bins<T>) -> Result<(), String> {
        let mut held = [(0u64, 0u64); CLASSES];
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
                let h = &mut held[item.class()];
                h.0 += 1;
                h.1 += item.bytes();
                total += item.bytes();
            }
        }
        if total != b.bytes || total > self.limit {
            return Err(format!(
                "bins holding {total} bytes, counter {} limit {}",
                b.bytes, self.limit
            ));
        }
        let mut sharing = [0u8; 64];
        let mut class_bins = [0u16; CLASSES];
        for (i, &key) in b.keys.iter().enumerate().filter(|(_, &k)| k != 0) {
            sharing[KeyHash::of(key).present.trailing_zeros() as usize] += 1;
            class_bins[key_class(key)] |= 1 << i;
        }
        if class_bins != b.class_bins {
            return Err("the bins of a class are miscounted".into());
        }
        let present = (0..64)
            .filter(|&i| sharing[i] > 0)
            .fold(0u64, |p, i| p | 1 << i);
        if sharing != b.sharing || present != self.present.load(Ordering::Relaxed) {
            return Err("the shape filter disagrees with the bins".into());
        }
        for (c, &h) in held.iter().enumerate() {
            if h != b.held[c] {
                return Err(format!("class {c} counters drifted from the held items"));
            }
            if b.drained[c]
                .checked_add(h.0)
                .is_none_or(|out| out > b.puts[c])
            {
                return Err(format!(
                    "class {c}: {} held and {} drained, but only {} put",
                    h.0, b.drained[c], b.puts[c]
                ));
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

    /// A new empty cache, registered, owned by the calling thread (its lock is biased to it).
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
            cache.drain_class_into(c, &mut left);
            r.absorb_totals(&cache.counters(c));
        }
        left
    }

    /// Calls `f` on each of `caches` with its bins, every cache's lock held at once: a
    /// segment that moves from one thread's cache to another's meanwhile (taken by one
    /// thread, freed by the other) is seen in exactly one. The caller holds the registry
    /// lock: only such walks take more than one cache lock, so they cannot deadlock.
    fn walk_locked(caches: &[Arc<ThreadCache<T>>], mut f: impl FnMut(&ThreadCache<T>, &Bins<T>)) {
        let held: Vec<_> = caches.iter().map(|c| c.bins.lock()).collect();
        for (c, b) in caches.iter().zip(&held) {
            f(c, b);
        }
    }

    /// Calls `f` on every registered cache with its bins, holding the registry lock (no
    /// cache joins or leaves) and every cache's lock at once (see [`Self::walk_locked`]).
    pub(crate) fn for_each_locked(&self, f: impl FnMut(&ThreadCache<T>, &Bins<T>)) {
        let g = lock(&self.caches);
        Self::walk_locked(&g.0, f);
    }

    /// Sum of `class` figures over every registered cache and the retired totals.
    #[cfg(test)]
    pub(crate) fn totals(&self, class: usize) -> ClassCounters {
        self.totals_with(class, |_| {})
    }

    /// [`totals`](Self::totals), calling `held` on every item of `class` they count, in the
    /// same walk: the figures and the items agree while threads take and put.
    pub(crate) fn totals_with(&self, class: usize, mut held: impl FnMut(&T)) -> ClassCounters {
        let g = lock(&self.caches);
        let mut t = lock(&self.retired)[class];
        Self::walk_locked(&g.0, |_, b| {
            ThreadCache::for_each_held_locked(b, class, &mut held);
            let k = b.counters(class);
            t.items += k.items;
            t.bytes += k.bytes;
            t.requested += k.requested;
            t.absorb_totals(&k);
        });
        t
    }

    /// Drains `class` from every registered cache.
    pub(crate) fn drain_all(&self, class: usize) -> Vec<T> {
        let g = lock(&self.caches);
        let mut out = Vec::new();
        for c in &g.0 {
            c.drain_class_into(class, &mut out);
        }
        out
    }
}
