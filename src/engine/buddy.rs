//! A binary buddy allocator over an offset range that does not round requests up to a power of two.
//!
//! A request for `size` bytes takes the lowest-addressed free block of order
//! `k = ceil(log2(size))`, splitting a larger one if needed, keeps `[start, start + size)`
//! and gives the unused tail `[start + size, start + 2^k)` straight back as smaller buddy
//! blocks. Freeing decomposes `[start, start + size)` into maximal aligned blocks and
//! coalesces each with its buddy. The waste per allocation is therefore below one
//! minimum block, instead of up to half the block in a plain buddy.
//!
//! All metadata is out of band: one ordered set of free offsets per order and a map of
//! live allocations.

use super::{EngineError, RangeStats};
use std::collections::{BTreeSet, HashMap};

/// Largest order (log2 bytes) a range may have.
const MAX_ORDER: u32 = 62;

/// A buddy allocator over `[0, capacity)`.
///
/// Invariants (checked by [`BuddyRange::validate`]):
/// - every offset in `free[k]` is a multiple of `2^k` and the block lies inside the range;
/// - free blocks and live allocations never overlap, and together cover the range exactly;
/// - no block in `free[k]` has its buddy in `free[k]` (blocks are maximally coalesced);
/// - bit `k` of `nonempty` is set iff `free[k]` is non-empty.
#[derive(Debug)]
pub struct BuddyRange {
    /// log2 of the smallest block; every offset and length is a multiple of it.
    min_order: u32,
    capacity: u64,
    /// `free[k]`: starts of free blocks of `2^k` bytes, ordered so the lowest is found first.
    free: Vec<BTreeSet<u64>>,
    /// Bit `k` set iff `free[k]` is non-empty.
    nonempty: u64,
    /// Live allocations: start -> (length in bytes, a multiple of the minimum block; tag).
    live: HashMap<u64, (u64, u64)>,
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
            free: (0..=MAX_ORDER).map(|_| BTreeSet::new()).collect(),
            nonempty: 0,
            live: HashMap::new(),
            free_bytes: 0,
            high_water: 0,
        };
        b.free_range(0, capacity);
        Ok(b)
    }

    /// Allocates `size` bytes aligned to `align` (both multiples of the minimum block);
    /// `tag` must be given back to [`BuddyRange::free`].
    pub fn alloc(&mut self, size: u64, align: u64, tag: u64) -> Option<u64> {
        debug_assert!(size > 0 && size % (1 << self.min_order) == 0);
        let order = Self::order_of(size.max(align)).max(self.min_order);
        if order > MAX_ORDER {
            return None;
        }
        // Lowest-addressed block among the orders that fit: keeps the high-water mark low.
        let mut candidates = self.nonempty & (!0u64 << order);
        let mut best: Option<(u64, u32)> = None;
        while candidates != 0 {
            let k = candidates.trailing_zeros();
            candidates &= candidates - 1;
            let start = *self.free[k as usize].first().expect("nonempty bit set");
            if best.is_none_or(|(s, _)| start < s) {
                best = Some((start, k));
            }
        }
        let (start, k) = best?;
        self.remove_free(k, start);
        // Keep the head, give the tail back as buddy blocks.
        self.free_range(start + size, start + (1u64 << k));
        self.live.insert(start, (size, tag));
        self.high_water = self.high_water.max(start + size);
        Some(start)
    }

    /// Frees the allocation at `offset` that was made with `tag`.
    pub fn free(&mut self, offset: u64, tag: u64) -> Result<u64, EngineError> {
        let size = match self.live.get(&offset) {
            Some(&(size, t)) if t == tag => size,
            _ => return Err(EngineError::AlreadyFreed { offset }),
        };
        self.live.remove(&offset);
        self.free_range(offset, offset + size);
        Ok(size)
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
    /// The new space is freed as maximal aligned blocks, each coalescing with free buddies
    /// below the old end that had none before.
    pub fn grow(&mut self, additional: u64) -> Result<(), EngineError> {
        let min_block = 1u64 << self.min_order;
        let new_capacity = self.capacity.checked_add(additional);
        match new_capacity {
            Some(c) if additional != 0 && additional % min_block == 0 && c < 1 << MAX_ORDER => {
                let old = self.capacity;
                self.capacity = c;
                self.free_range(old, c);
                Ok(())
            }
            _ => Err(EngineError::BadCapacity {
                capacity: additional,
                unit: min_block,
            }),
        }
    }

    /// Bytes of free space at the end of the range: everything above the highest live end.
    pub fn free_tail(&self) -> u64 {
        let top = self.live.iter().map(|(s, (l, _))| s + l).max();
        self.capacity - top.unwrap_or(0)
    }

    /// Cuts `bytes` (a multiple of the minimum block, at most [`BuddyRange::free_tail`]) off
    /// the end: the free blocks reaching past the new end are taken out and their part below
    /// it is freed again under the new capacity.
    pub fn shrink(&mut self, bytes: u64) {
        debug_assert!(bytes % (1 << self.min_order) == 0 && bytes <= self.free_tail());
        let end = self.capacity - bytes;
        let mut low = end;
        for k in 0..=MAX_ORDER {
            let size = 1u64 << k;
            // Blocks of order k that end past `end` start at or after `end - size`.
            let cut: Vec<u64> = self.free[k as usize]
                .range(end.saturating_sub(size - 1)..)
                .copied()
                .collect();
            for s in cut {
                self.remove_free(k, s);
                low = low.min(s);
            }
        }
        self.capacity = end;
        self.free_range(low, end);
    }

    /// Whether nothing is allocated.
    pub fn is_empty(&self) -> bool {
        self.live.is_empty()
    }

    /// Used bytes.
    pub fn used_bytes(&self) -> u64 {
        self.capacity - self.free_bytes
    }

    /// Bytes of the largest free block (the highest order with a free block), in O(1).
    pub fn largest_free(&self) -> u64 {
        if self.nonempty == 0 {
            0
        } else {
            1u64 << (63 - self.nonempty.leading_zeros())
        }
    }

    /// Free and fragmentation figures.
    pub fn stats(&self) -> RangeStats {
        let largest = self.largest_free();
        let top = self
            .live
            .iter()
            .map(|(s, (l, _))| s + l)
            .max()
            .unwrap_or_default();
        RangeStats {
            capacity: self.capacity,
            free_bytes: self.free_bytes,
            largest_free: largest,
            free_fragments: self.free.iter().map(|s| s.len() as u64).sum(),
            high_water: self.high_water,
            top,
        }
    }

    /// Checks every invariant listed on the type.
    pub fn validate(&self) -> Result<(), EngineError> {
        let fail = |m: String| Err(EngineError::Corrupt(format!("buddy: {m}")));
        let mut spans: Vec<(u64, u64, bool)> = Vec::new();
        let mut free_bytes = 0;
        for (k, set) in self.free.iter().enumerate() {
            if (self.nonempty >> k & 1 == 1) == set.is_empty() {
                return fail(format!("nonempty bit {k} is stale"));
            }
            let size = 1u64 << k;
            for &s in set {
                if s % size != 0 || s + size > self.capacity || (k as u32) < self.min_order {
                    return fail(format!("free block {s} of order {k} is misplaced"));
                }
                let buddy = s ^ size;
                if k < MAX_ORDER as usize && set.contains(&buddy) && buddy + size <= self.capacity {
                    return fail(format!("free block {s} of order {k} is not coalesced"));
                }
                spans.push((s, size, true));
                free_bytes += size;
            }
        }
        for (&s, &(l, _)) in &self.live {
            spans.push((s, l, false));
        }
        spans.sort_unstable();
        let mut cursor = 0;
        for (s, l, _) in &spans {
            if *s != cursor {
                return fail(format!("gap or overlap at {cursor} (next span at {s})"));
            }
            cursor = s + l;
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

    /// Frees `[start, end)` as maximal aligned blocks, each coalesced with its buddies.
    fn free_range(&mut self, mut start: u64, end: u64) {
        while start < end {
            let align_order = if start == 0 {
                MAX_ORDER
            } else {
                start.trailing_zeros()
            };
            let fit_order = 63 - (end - start).leading_zeros();
            let k = align_order.min(fit_order).min(MAX_ORDER);
            self.free_block(start, k);
            start += 1 << k;
        }
    }

    fn free_block(&mut self, mut start: u64, mut k: u32) {
        self.free_bytes += 1 << k;
        while k < MAX_ORDER {
            let buddy = start ^ (1u64 << k);
            if buddy + (1u64 << k) > self.capacity || !self.free[k as usize].contains(&buddy) {
                break;
            }
            self.remove_free_raw(k, buddy);
            start = start.min(buddy);
            k += 1;
        }
        self.free[k as usize].insert(start);
        self.nonempty |= 1 << k;
    }

    fn remove_free(&mut self, k: u32, start: u64) {
        self.remove_free_raw(k, start);
        self.free_bytes -= 1 << k;
    }

    fn remove_free_raw(&mut self, k: u32, start: u64) {
        let set = &mut self.free[k as usize];
        set.remove(&start);
        if set.is_empty() {
            self.nonempty &= !(1 << k);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
        b.free(a, 1).unwrap();
        b.free(c, 2).unwrap();
        b.validate().unwrap();
        assert!(b.is_empty());
        assert_eq!(b.stats().largest_free, 1 << 20);
        assert!(b.free(a, 1).is_err());
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
            b.free(o, 7).unwrap();
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
        b.free(a, 1).unwrap();
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
        b.free(a, 1).unwrap();
        b.validate().unwrap();
        assert_eq!(b.stats().free_bytes, 40 << 10);
        b.shrink(40 << 10);
        assert_eq!(b.capacity(), 0);
        b.validate().unwrap();
        b.grow(1 << 12).unwrap();
        assert_eq!(b.alloc(1 << 12, 64, 3), Some(0));
        b.validate().unwrap();
    }
}
