//! A binary buddy allocator over an offset range that does not round requests up to a power of two.
//!
//! A request for `size` bytes takes the lowest-addressed free block of order
//! `k = ceil(log2(size))` or above, keeps `[start, start + size)` and gives the unused
//! tail `[start + size, start + 2^k)` straight back as smaller buddy blocks. Freeing
//! coalesces every block with its free buddy. The waste per allocation is therefore below
//! one minimum block, instead of up to half the block in a plain buddy.
//!
//! # Free runs stand for the free blocks
//!
//! With every block coalesced as far as it goes, the free blocks are a function of the free
//! bytes alone: they are the maximal aligned blocks inside a maximal free run `[a, b)`,
//! which is what cutting the run greedily from `a` (at each step the largest aligned block
//! that fits) gives. In that cut the orders rise to a largest one, `top_order(a, b)`, and
//! fall again, so the lowest block of order `o` or above in the run starts at
//! `align_up(a, 2^o)`, and exists iff `o <= top_order(a, b)`. The lowest-addressed free
//! block of order `o` or above is therefore `align_up(a, 2^o)` in the lowest run whose top
//! order is at least `o`.
//!
//! So this module stores runs, not blocks: one entry per free run, however many blocks it
//! holds. Taking `[s, s + size)` out of a block of run `[a, b)` leaves the runs `[a, s)` and
//! `[s + size, b)`; freeing a segment merges it with the runs that end where it starts and
//! start where it ends. The blocks, and so every placement, are exactly those of a buddy
//! that splits and merges block by block; `tests/buddy_placement.rs` replays random
//! operations through both and compares.
//!
//! All metadata is out of band: both ends of each run in one hash map, and the run starts in
//! one ordered set per top order, with the lowest start of every order cached, so an
//! allocation compares at most 63 numbers to find its run and then touches one set or two.
//! These sets are small (mostly under 64 runs on the shared traces) and spread over the
//! whole range, which suits a B-tree: a 64-ary bitmap trie over block indices was tried
//! and took about twice as long per operation on `random-mix`: one cache miss per level.
//! Live allocations are hashed by offset.

use super::{EngineError, RangeStats};
use std::collections::hash_map::{Entry, HashMap};
use std::collections::BTreeSet;
use std::hash::{BuildHasherDefault, Hasher};

/// Largest order (log2 bytes) a range may have.
const MAX_ORDER: u32 = 62;
/// Orders `0..=MAX_ORDER`.
const ORDERS: usize = MAX_ORDER as usize + 1;

/// Hashes offsets: one multiply, folded so the low bits (always zero in an offset, and
/// what the table indexes by) depend on every bit of the key.
#[derive(Debug, Default, Clone, Copy)]
struct OffsetHasher(u64);

impl Hasher for OffsetHasher {
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(u64::from(b));
        }
    }
    #[inline]
    fn write_u64(&mut self, n: u64) {
        let h = (self.0 ^ n).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        self.0 = h ^ (h >> 32);
    }
    #[inline]
    fn finish(&self) -> u64 {
        self.0
    }
}

/// A hash map keyed by offset.
type OffsetMap<V> = HashMap<u64, V, BuildHasherDefault<OffsetHasher>>;

/// Order of the largest aligned block inside `[a, b)` (a non-empty range), at most
/// [`MAX_ORDER`]: the peak of the orders when the range is cut greedily from `a`.
#[inline]
fn top_order(a: u64, b: u64) -> u32 {
    // A block of 2^(l-1) always fits in 2^l bytes or more; one of 2^l fits iff the first
    // 2^l-aligned start leaves room for it.
    let l = 63 - (b - a).leading_zeros();
    if l > MAX_ORDER {
        return MAX_ORDER;
    }
    let fits = a
        .checked_next_multiple_of(1 << l)
        .and_then(|s| s.checked_add(1 << l))
        .is_some_and(|e| e <= b);
    if fits {
        l
    } else {
        l - 1
    }
}

/// Number of buddy blocks a free run `[a, b)` holds (the pieces of its greedy cut).
fn blocks_in_run(mut a: u64, b: u64) -> u64 {
    let mut n = 0;
    while a < b {
        let align = if a == 0 {
            MAX_ORDER
        } else {
            a.trailing_zeros()
        };
        let fit = 63 - (b - a).leading_zeros();
        a += 1 << align.min(fit).min(MAX_ORDER);
        n += 1;
    }
    n
}

/// A buddy allocator over `[0, capacity)`, kept as free runs (see the module docs).
///
/// Invariants (checked by [`BuddyRange::validate`]):
/// - `bounds` maps both ends of every free run `[a, b)` to each other (`a -> b`, `b -> a`),
///   and holds nothing else; each run is non-empty, inside the range, and has both ends
///   multiples of the minimum block;
/// - free runs and live allocations never overlap and together cover the range exactly, and
///   no two runs touch (each is maximal: the buddy blocks in it are coalesced), so no offset
///   is the end of one run and the start of another;
/// - `by_order[k]` holds exactly the starts of the runs whose `top_order` is `k`;
/// - bit `k` of `nonempty` is set iff `by_order[k]` is non-empty;
/// - `lowest[k]` is the lowest start (bytes) in `by_order[k]`, `u64::MAX` when it is empty;
/// - `free_bytes` is the total length of the runs.
#[derive(Debug)]
pub struct BuddyRange {
    /// log2 of the smallest block; every offset and length is a multiple of it.
    min_order: u32,
    capacity: u64,
    /// Both ends of each free run, each mapped to the other: a key is a run's start iff its
    /// value is above it.
    bounds: OffsetMap<u64>,
    /// `by_order[k]`: starts of the runs whose largest block has order `k`.
    by_order: Vec<BTreeSet<u64>>,
    /// `lowest[k]`: start (bytes) of the lowest run in `by_order[k]` (`u64::MAX` when none).
    lowest: Box<[u64; ORDERS]>,
    /// Bit `k` set iff `by_order[k]` is non-empty.
    nonempty: u64,
    /// Live allocations: start -> (length in bytes, a multiple of the minimum block; tag).
    live: OffsetMap<(u64, u64)>,
    /// Total length of the free runs.
    free_bytes: u64,
    high_water: u64,
}

impl BuddyRange {
    /// A range of `capacity` bytes with minimum blocks of `min_block` bytes (a power of two).
    pub fn new(capacity: u64, min_block: u64) -> Result<Self, EngineError> {
        if !min_block.is_power_of_two() || capacity < min_block || capacity % min_block != 0 {
            return Err(EngineError::BadCapacity {
                capacity,
                unit: min_block,
            });
        }
        let mut b = Self {
            min_order: min_block.trailing_zeros(),
            capacity,
            bounds: OffsetMap::default(),
            by_order: vec![BTreeSet::new(); ORDERS],
            lowest: Box::new([u64::MAX; ORDERS]),
            nonempty: 0,
            live: OffsetMap::default(),
            free_bytes: 0,
            high_water: 0,
        };
        b.release(0, capacity);
        Ok(b)
    }

    /// Allocates `size` bytes aligned to `align` (both multiples of the minimum block);
    /// `tag` must be given back to [`BuddyRange::free`]. `None` when nothing fits, or when
    /// `size` is 0 or off the minimum block or `align` not a power of two (nothing changes).
    pub fn alloc(&mut self, size: u64, align: u64, tag: u64) -> Option<u64> {
        // A size off the block would leave a run not a multiple of it.
        if size == 0 || size % (1 << self.min_order) != 0 || !align.is_power_of_two() {
            return None;
        }
        let order = Self::order_of(size.max(align)).max(self.min_order);
        if order > MAX_ORDER {
            return None;
        }
        // The lowest run holding a block of this order or above: its first such block is
        // the lowest-addressed one, which keeps the high-water mark low.
        let mut orders = self.nonempty & (!0u64 << order);
        if orders == 0 {
            return None;
        }
        let mut a = u64::MAX;
        while orders != 0 {
            a = a.min(self.lowest[orders.trailing_zeros() as usize]);
            orders &= orders - 1;
        }
        // The block starts at the first `2^order` boundary; its head is taken, and the run's
        // bytes on either side stay free (as the block's tail and the smaller blocks below).
        let start = a.next_multiple_of(1 << order);
        let end = start + size;
        let bound = self
            .bounds
            .get_mut(&a)
            .expect("the lowest run is in the bounds");
        let b = *bound;
        debug_assert!(start + (1u64 << order) <= b);
        let k = top_order(a, b);
        if a < start {
            *bound = start;
            self.bounds.insert(start, a);
            self.reindex(a, k, top_order(a, start));
        } else {
            self.bounds.remove(&a);
            self.unindex(a, k);
        }
        if end < b {
            self.bounds.insert(end, b);
            self.bounds.insert(b, end);
            self.index(end, top_order(end, b));
        } else {
            self.bounds.remove(&b);
        }
        // The block came out of free runs, which `free_bytes` sums (debug check only).
        debug_assert!(self.free_bytes >= size, "free bytes drifted");
        self.free_bytes -= size;
        self.live.insert(start, (size, tag));
        self.high_water = self.high_water.max(end);
        Some(start)
    }

    /// Frees the allocation of `size` bytes at `offset` that was made with `tag`.
    pub fn free(&mut self, offset: u64, size: u64, tag: u64) -> Result<(), EngineError> {
        match self.live.entry(offset) {
            // The size too: a caller whose tags wrap may hold a stale handle naming an
            // allocation of another size at the same offset with its tag.
            Entry::Occupied(e) if *e.get() == (size, tag) => e.remove(),
            _ => return Err(EngineError::AlreadyFreed { offset }),
        };
        self.release(offset, offset + size);
        Ok(())
    }

    /// Highest offset (bytes) ever in use.
    pub fn high_water(&self) -> u64 {
        self.high_water
    }

    /// Bytes the range spans.
    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// Extends the range by `additional` bytes (a multiple of the minimum block) at its end.
    /// The new space joins the free run at the old end, if any, so its blocks coalesce with
    /// free buddies below the old end that had none before.
    pub fn grow(&mut self, additional: u64) -> Result<(), EngineError> {
        let min_block = 1u64 << self.min_order;
        if additional == 0 || additional % min_block != 0 {
            return Err(EngineError::BadCapacity {
                capacity: additional,
                unit: min_block,
            });
        }
        // Any end a u64 holds, as `new` takes: past 2^MAX_ORDER the runs are cut into
        // blocks of that order.
        let Some(c) = self.capacity.checked_add(additional) else {
            return Err(EngineError::CapacityTooLarge {
                capacity: self.capacity.saturating_add(additional),
                max: u64::MAX - (min_block - 1),
            });
        };
        let old = self.capacity;
        self.capacity = c;
        self.release(old, c);
        Ok(())
    }

    /// Bytes of free space at the end of the range: everything above the highest live end
    /// (the free run ending at the capacity, if any), in O(1).
    pub fn free_tail(&self) -> u64 {
        // No run starts at the capacity, so a value there is the start of the run ending there.
        self.bounds
            .get(&self.capacity)
            .map_or(0, |&start| self.capacity - start)
    }

    /// Cuts `bytes` (a multiple of the minimum block, at most [`BuddyRange::free_tail`]) off
    /// the end: the free run at the end is shortened, or removed when it is all cut. More
    /// than the free tail cuts the free tail, and a part minimum block is not cut.
    pub fn shrink(&mut self, bytes: u64) {
        // Never cut into live space, even if the caller asks for more (nor a part of the
        // minimum block): a public call, so in debug builds too.
        let bytes = bytes.min(self.free_tail()) >> self.min_order << self.min_order;
        if bytes == 0 {
            return;
        }
        let old = self.capacity;
        let a = self
            .bounds
            .remove(&old)
            .expect("a free run ends at the capacity");
        let k = top_order(a, old);
        self.capacity -= bytes;
        self.free_bytes -= bytes;
        let end = self.capacity;
        if a < end {
            self.bounds.insert(a, end);
            self.bounds.insert(end, a);
            self.reindex(a, k, top_order(a, end));
        } else {
            self.bounds.remove(&a);
            self.unindex(a, k);
        }
    }

    /// Whether nothing is allocated.
    pub fn is_empty(&self) -> bool {
        self.live.is_empty()
    }

    /// Used bytes.
    pub fn used_bytes(&self) -> u64 {
        self.capacity - self.free_bytes
    }

    /// Blocks handed out and not given back.
    pub fn live_count(&self) -> u64 {
        self.live.len() as u64
    }

    /// Bytes of the largest free block (the highest order with a free block), in O(1).
    pub fn largest_free(&self) -> u64 {
        if self.nonempty == 0 {
            0
        } else {
            1u64 << (63 - self.nonempty.leading_zeros())
        }
    }

    /// Free and fragmentation figures; `free_fragments` counts buddy blocks (a walk over the
    /// free runs), the rest is O(1).
    pub fn stats(&self) -> RangeStats {
        RangeStats {
            capacity: self.capacity,
            free_bytes: self.free_bytes,
            largest_free: self.largest_free(),
            free_fragments: self.runs().map(|(a, b)| blocks_in_run(a, b)).sum(),
            high_water: self.high_water,
            top: self.capacity - self.free_tail(),
        }
    }

    /// Test helper: a stale order bit, a drift only this tier's `validate` sees.
    #[cfg(test)]
    pub(super) fn drift_for_test(&mut self) {
        self.nonempty ^= 1 << 20;
    }

    /// Whether a block of `bytes` bytes made with `tag` is in use at `offset`: the engine
    /// checks its slab pages' records against it.
    pub(crate) fn holds(&self, offset: u64, bytes: u64, tag: u64) -> bool {
        self.live.get(&offset) == Some(&(bytes, tag))
    }

    /// Test helper: [`free`](Self::free) with the size of the allocation at `offset`, for
    /// tests of anything but the size check.
    #[cfg(test)]
    fn free_held(&mut self, offset: u64, tag: u64) -> Result<(), EngineError> {
        let size = self.live.get(&offset).map_or(0, |&(size, _)| size);
        self.free(offset, size, tag)
    }

    /// Checks every invariant listed on the type.
    pub fn validate(&self) -> Result<(), EngineError> {
        let fail = |m: String| Err(EngineError::Corrupt(format!("buddy: {m}")));
        let unit = 1u64 << self.min_order;
        let mut free_bytes = 0;
        let mut runs = 0;
        for (a, b) in self.runs() {
            if b > self.capacity || a % unit != 0 || b % unit != 0 {
                return fail(format!("free run [{a}, {b}) is misplaced"));
            }
            if self.bounds.get(&b) != Some(&a) {
                return fail(format!("free run [{a}, {b}) is missing by its end"));
            }
            if !self.by_order[top_order(a, b) as usize].contains(&a) {
                return fail(format!("free run [{a}, {b}) is missing from its order"));
            }
            free_bytes += b - a;
            runs += 1;
        }
        // Every start names its end and back, so equal counts leave no stray end.
        if 2 * runs != self.bounds.len() as u64 {
            return fail(format!("{runs} runs but {} bounds", self.bounds.len()));
        }
        let mut indexed = 0;
        for (k, set) in self.by_order.iter().enumerate() {
            if (self.nonempty >> k & 1 == 1) == set.is_empty() {
                return fail(format!("nonempty bit {k} is stale"));
            }
            let lowest = set.first().copied().unwrap_or(u64::MAX);
            if self.lowest[k] != lowest {
                return fail(format!(
                    "lowest run of order {k} is cached as {}, is {lowest}",
                    self.lowest[k]
                ));
            }
            indexed += set.len() as u64;
        }
        // Every run is in its own order's set (above), so equal counts leave no stray entry.
        if indexed != runs {
            return fail(format!("{indexed} runs indexed by order, {runs} exist"));
        }
        // Live blocks are whole minimum blocks, ending within what a u64 holds: checked
        // before the tiling, which adds their lengths (a wrapped end is a drift to report,
        // not an overflow to panic on), and sees only where they end.
        for (&start, &(len, _)) in self.live.iter() {
            if len == 0 || len % unit != 0 || start.checked_add(len).is_none() {
                return fail(format!("live block at {start} of {len} bytes"));
            }
        }
        let mut spans: Vec<(u64, u64, bool)> = self.runs().map(|(a, b)| (a, b, true)).collect();
        spans.extend(self.live.iter().map(|(&s, &(l, _))| (s, s + l, false)));
        spans.sort_unstable();
        let mut cursor = 0;
        let mut after_free = false;
        for &(s, e, free) in &spans {
            if s != cursor {
                return fail(format!("gap or overlap at {cursor} (next span at {s})"));
            }
            if free && after_free {
                return fail(format!("free runs touch at {s}"));
            }
            cursor = e;
            after_free = free;
        }
        // The end of the highest block in use never passes the highest ever in use.
        if cursor == self.capacity && self.capacity - self.free_tail() > self.high_water {
            return fail(format!(
                "blocks in use up to {}, high water {}",
                self.capacity - self.free_tail(),
                self.high_water
            ));
        }
        if cursor != self.capacity || free_bytes != self.free_bytes {
            return fail(format!(
                "spans cover {cursor} of {} bytes; free counter {} vs {free_bytes}",
                self.capacity, self.free_bytes
            ));
        }
        Ok(())
    }

    fn order_of(size: u64) -> u32 {
        64 - (size - 1).leading_zeros()
    }

    /// Every free run `[a, b)`, in no particular order.
    fn runs(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.bounds
            .iter()
            .filter(|(&a, &b)| a < b)
            .map(|(&a, &b)| (a, b))
    }

    /// Frees `[start, end)`, merging it with the free runs on either side.
    fn release(&mut self, start: u64, end: u64) {
        self.free_bytes += end - start;
        // `start` begins no run and `end` ends none (they bound space that was not free), so
        // a bound found there is the far end of a neighbouring run, and it goes.
        let below = self.bounds.remove(&start);
        let above = self.bounds.remove(&end);
        let (a, b) = (below.unwrap_or(start), above.unwrap_or(end));
        if let Some(a) = below {
            self.bounds.insert(a, b);
            self.reindex(a, top_order(a, start), top_order(a, b));
        } else {
            self.bounds.insert(start, b);
            self.index(start, top_order(start, b));
        }
        if let Some(b) = above {
            self.bounds.insert(b, a);
            self.unindex(end, top_order(end, b));
        } else {
            self.bounds.insert(end, a);
        }
    }

    /// Files the run starting at `a` under order `k`.
    #[inline]
    fn index(&mut self, a: u64, k: u32) {
        self.by_order[k as usize].insert(a);
        self.nonempty |= 1 << k;
        let lowest = &mut self.lowest[k as usize];
        *lowest = (*lowest).min(a);
    }

    /// Takes the run starting at `a` out of order `k`.
    #[inline]
    fn unindex(&mut self, a: u64, k: u32) {
        let set = &mut self.by_order[k as usize];
        let removed = set.remove(&a);
        debug_assert!(removed, "free run at {a} is missing from order {k}");
        if self.lowest[k as usize] == a {
            self.lowest[k as usize] = set.first().copied().unwrap_or(u64::MAX);
            if set.is_empty() {
                self.nonempty &= !(1 << k);
            }
        }
    }

    /// Moves the run starting at `a` from order `old` to order `new`, if they differ.
    #[inline]
    fn reindex(&mut self, a: u64, old: u32, new: u32) {
        if old != new {
            self.unindex(a, old);
            self.index(a, new);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Arguments `alloc` does not take are refused in release builds too, and change
    /// nothing (a size off the minimum block left runs that were not multiples of it).
    #[test]
    fn bad_arguments_change_nothing() {
        let mut b = BuddyRange::new(1 << 20, 64).unwrap();
        for (size, align) in [(0, 64), (100, 64), (64, 96), (64, 0)] {
            assert_eq!(b.alloc(size, align, 1), None, "{size} {align}");
            b.validate().unwrap();
            assert_eq!(b.largest_free(), 1 << 20);
        }
        assert_eq!(b.alloc(64, 64, 1), Some(0));
    }

    #[test]
    fn a_free_of_another_size_is_refused() {
        // Once tags wrap, a stale handle may name an allocation of another size with its tag.
        let mut b = BuddyRange::new(1 << 20, 64).unwrap();
        assert_eq!(b.alloc(256, 64, 7), Some(0));
        for size in [0, 64, 192, 320, 512] {
            assert_eq!(
                b.free(0, size, 7),
                Err(EngineError::AlreadyFreed { offset: 0 }),
                "{size}"
            );
        }
        b.validate().unwrap();
        b.free(0, 256, 7).unwrap();
        b.validate().unwrap();
        assert!(b.is_empty());
    }

    #[test]
    fn top_order_and_block_count_match_the_greedy_cut() {
        for a in 0..70u64 {
            for b in a + 1..200 {
                let (mut p, mut top, mut n) = (a, 0, 0);
                while p < b {
                    let k = (if p == 0 { 63 } else { p.trailing_zeros() })
                        .min(63 - (b - p).leading_zeros());
                    top = top.max(k);
                    p += 1 << k;
                    n += 1;
                }
                assert_eq!(top_order(a, b), top, "[{a}, {b})");
                assert_eq!(blocks_in_run(a, b), n, "[{a}, {b})");
            }
        }
        assert_eq!(top_order(0, u64::MAX), MAX_ORDER);
        assert_eq!(top_order(u64::MAX - 64, u64::MAX), 5);
    }

    #[test]
    fn tail_is_given_back() {
        let mut b = BuddyRange::new(1 << 20, 64).unwrap();
        // 192 bytes take an order-8 block (256) and give 64 back.
        let a = b.alloc(192, 64, 1).unwrap();
        assert_eq!(a, 0);
        let c = b.alloc(64, 64, 2).unwrap();
        assert_eq!(
            c, 192,
            "the tail of the first block serves the next request"
        );
        b.validate().unwrap();
        b.free_held(a, 1).unwrap();
        b.free_held(c, 2).unwrap();
        b.validate().unwrap();
        assert!(b.is_empty());
        assert_eq!(b.stats().largest_free, 1 << 20);
        assert!(b.free_held(a, 1).is_err());
    }

    #[test]
    fn non_power_of_two_capacity() {
        let mut b = BuddyRange::new(3 * 4096 + 64, 64).unwrap();
        b.validate().unwrap();
        let x = b.alloc(8192, 64, 7).unwrap();
        let y = b.alloc(4096, 64, 7).unwrap();
        let z = b.alloc(64, 64, 7).unwrap();
        assert!(b.alloc(64, 64, 7).is_none());
        b.validate().unwrap();
        for o in [y, x, z] {
            b.free_held(o, 7).unwrap();
            b.validate().unwrap();
        }
        assert_eq!(b.stats().free_bytes, 3 * 4096 + 64);
    }

    #[test]
    fn alignment_is_respected() {
        let mut b = BuddyRange::new(1 << 24, 64).unwrap();
        let _ = b.alloc(64, 64, 1).unwrap();
        let a = b.alloc(64, 1 << 21, 2).unwrap();
        assert_eq!(a % (1 << 21), 0);
        b.validate().unwrap();
    }

    #[test]
    fn grow_coalesces_with_the_old_tail() {
        let mut b = BuddyRange::new(3 * 1024, 64).unwrap();
        let a = b.alloc(1024, 64, 1).unwrap();
        assert!(b.grow(0).is_err() && b.grow(96).is_err() && b.grow(u64::MAX - 63).is_err());
        b.grow(1024).unwrap();
        b.validate().unwrap();
        // [1024, 2048) and [2048, 3072) were free; with [3072, 4096) they form one 2 KiB block
        // and a 1 KiB one.
        assert_eq!(b.stats().largest_free, 2048);
        b.free_held(a, 1).unwrap();
        b.validate().unwrap();
        assert_eq!(b.stats().largest_free, 4096);
        assert_eq!(b.stats().free_fragments, 1);
    }

    #[test]
    fn shrink_cuts_blocks_that_cross_the_new_end() {
        let mut b = BuddyRange::new(1 << 16, 64).unwrap();
        let a = b.alloc(100 * 64, 64, 1).unwrap();
        assert_eq!(b.free_tail(), (1 << 16) - 100 * 64);
        // The new end (40 KiB) cuts the free 32 KiB block [32 KiB, 64 KiB) in two.
        b.shrink(24 << 10);
        assert_eq!(b.capacity(), 40 << 10);
        b.validate().unwrap();
        assert_eq!(b.free_tail(), (40 << 10) - 100 * 64);
        assert!(b.alloc(40 << 10, 64, 2).is_none());
        // More than the free tail cuts the free tail; a part block is not cut (debug builds
        // too: a public call).
        b.shrink(u64::MAX);
        assert_eq!(b.capacity(), 100 * 64);
        b.validate().unwrap();
        b.grow((40 << 10) - 100 * 64).unwrap();
        b.shrink(63);
        assert_eq!(b.capacity(), 40 << 10);
        b.validate().unwrap();
        b.free_held(a, 1).unwrap();
        b.validate().unwrap();
        assert_eq!(b.stats().free_bytes, 40 << 10);
        b.shrink(40 << 10);
        assert_eq!(b.capacity(), 0);
        b.validate().unwrap();
        b.grow(1 << 12).unwrap();
        assert_eq!(b.alloc(1 << 12, 64, 3), Some(0));
        b.validate().unwrap();
    }

    #[test]
    fn a_range_of_the_largest_order_is_one_block() {
        // Offsets only: a 4 EiB range costs no memory.
        let mut b = BuddyRange::new(1 << MAX_ORDER, 64).unwrap();
        b.validate().unwrap();
        assert_eq!(b.largest_free(), 1 << MAX_ORDER);
        assert_eq!(b.alloc(1 << MAX_ORDER, 64, 7), Some(0));
        assert_eq!(b.largest_free(), 0);
        b.free_held(0, 7).unwrap();
        b.validate().unwrap();
        assert_eq!(b.largest_free(), 1 << MAX_ORDER);
        // It grows to any end a u64 holds, and no further.
        b.grow(1 << MAX_ORDER).unwrap();
        assert_eq!(b.capacity(), 1 << (MAX_ORDER + 1));
        assert_eq!(
            b.grow(1 << (MAX_ORDER + 1)),
            Err(EngineError::CapacityTooLarge {
                capacity: u64::MAX,
                max: u64::MAX - 63,
            })
        );
        b.grow((1 << (MAX_ORDER + 1)) - 64).unwrap();
        assert_eq!(b.capacity(), u64::MAX - 63);
        b.validate().unwrap();
    }

    #[test]
    fn an_unaligned_run_of_the_largest_orders_length_holds_only_the_order_below() {
        // After 64 bytes at 0, the run [64, 2^62 + 64) is 2^62 bytes long, but no 2^62-aligned
        // block fits in it: its largest block is 2^61, at 2^61.
        let mut b = BuddyRange::new((1 << MAX_ORDER) + 64, 64).unwrap();
        assert_eq!(b.alloc(64, 64, 1), Some(0));
        b.validate().unwrap();
        assert_eq!(b.largest_free(), 1 << (MAX_ORDER - 1));
        assert_eq!(b.alloc(1 << MAX_ORDER, 64, 2), None);
        assert_eq!(
            b.alloc(1 << (MAX_ORDER - 1), 64, 3),
            Some(1 << (MAX_ORDER - 1))
        );
        b.validate().unwrap();
    }

    #[test]
    fn a_range_as_large_as_a_u64_holds_allocates_and_frees() {
        let mut b = BuddyRange::new(u64::MAX - 63, 64).unwrap();
        let mut live = Vec::new();
        let mut x = 0x2545_F491_4F6C_DD1Du64;
        for tag in 0..600u64 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            if tag % 3 == 2 && !live.is_empty() {
                let (o, t) = live.swap_remove(x as usize % live.len());
                b.free_held(o, t).unwrap();
            } else {
                // Sizes from 64 bytes to 2^61, so the top orders are cut and merged too.
                let size = (x % (1 << (x % 62)) / 64 + 1) * 64;
                if let Some(o) = b.alloc(size, 64, tag) {
                    assert!(o.checked_add(size).is_some_and(|e| e <= b.capacity()));
                    live.push((o, tag));
                }
            }
            b.validate().unwrap();
        }
        for (o, t) in live {
            b.free_held(o, t).unwrap();
        }
        b.validate().unwrap();
        assert_eq!(b.largest_free(), 1 << MAX_ORDER);
    }

    #[test]
    fn offsets_spread_over_the_hash_tables_low_bits() {
        // Offsets of 2 MiB blocks have 21 zero low bits; the table indexes by the hash's
        // low bits, which must still take most values.
        let buckets: std::collections::HashSet<u64> = (0..256u64)
            .map(|k| {
                let mut h = OffsetHasher::default();
                h.write_u64(k << 21);
                h.finish() & 255
            })
            .collect();
        assert!(buckets.len() > 128, "{} of 256 buckets", buckets.len());
    }

    #[test]
    fn validate_catches_each_kind_of_drift() {
        // Free runs [64, 128) and [192, capacity), live blocks at 0 and 128.
        let build = || {
            let mut b = BuddyRange::new(1 << 20, 64).unwrap();
            let offsets: Vec<u64> = (1..=3).map(|t| b.alloc(64, 64, t).unwrap()).collect();
            assert_eq!(offsets, [0, 64, 128]);
            b.free_held(64, 2).unwrap();
            b.validate().unwrap();
            b
        };
        let corruptions: [crate::engine::Drift<BuddyRange>; 11] = [
            ("free counter", |b| b.free_bytes += 64),
            ("lowest cache", |b| b.lowest[0] = 4096),
            ("nonempty bit", BuddyRange::drift_for_test),
            ("run end forgotten", |b| {
                b.bounds.remove(&128);
            }),
            ("run moved out of its order", |b| {
                b.by_order[6].remove(&64);
                b.by_order[7].insert(64);
            }),
            ("live block overlapping a run", |b| {
                b.live.insert(64, (64, 9));
            }),
            ("live block forgotten", |b| {
                b.live.remove(&128);
            }),
            ("run past the capacity", |b| b.capacity -= 4096),
            // Fits the tiling (it ends where it starts), yet no block is empty.
            ("live block of no bytes", |b| {
                b.live.insert(192, (0, 9));
            }),
            ("high water below the blocks in use", |b| b.high_water = 64),
            // Its end wraps past u64::MAX: the tiling's sum panicked instead of reporting.
            ("live block past the last offset", |b| {
                b.live.insert(u64::MAX - 63, (128, 9));
            }),
        ];
        crate::engine::assert_each_drift_reported(build, &corruptions, BuddyRange::validate);
    }
}
