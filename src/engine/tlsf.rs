//! Two-level segregated fit over an offset range, with metadata out of band.
//!
//! Every byte of `[0, top)` belongs to exactly one node (free or used); the nodes form a
//! doubly linked list in address order, so freeing merges with both neighbours in O(1).
//! Free nodes also sit in one of `FL x SL` size bins, found through two bitmaps. Above `top`
//! lies the untouched rest of the range (the "wilderness"): it is taken only when no bin
//! can serve a request, which keeps the range's high-water mark low.

use super::{EngineError, RangeStats, NIL};
use slab::Slab;

/// log2 of the number of second-level bins per first level.
const SL_SHIFT: u32 = 5;
const SL_COUNT: usize = 1 << SL_SHIFT;
/// First levels: enough for ranges up to 2^60 units.
const FL_COUNT: usize = 61;
/// How many entries of the exact bin are tried before moving to a larger bin.
const EXACT_BIN_PROBES: usize = 8;

/// One block of the range: free or used.
#[derive(Debug, Clone)]
struct Node {
    /// Start, in units.
    start: u64,
    /// Length, in units; never 0.
    len: u64,
    /// Neighbour below in address order (`NIL` at offset 0).
    prev_phys: u32,
    /// Neighbour above in address order (`NIL` when the node ends at `top`).
    next_phys: u32,
    /// Free-list links; meaningful only while `free`.
    prev_free: u32,
    next_free: u32,
    /// Whether the node is in a bin.
    free: bool,
    /// Allocation sequence number while used, so a stale handle to a reused slot is caught.
    tag: u64,
}

/// A TLSF range engine. Lengths and offsets are in bytes at the API, in units of `unit` inside.
///
/// Invariants (checked by [`TlsfRange::validate`]):
/// - the nodes tile `[0, top)` in address order through `next_phys`/`prev_phys`;
/// - no two free nodes are adjacent (free neighbours are always merged, and a free node
///   never ends at `top`: it is folded into the wilderness instead);
/// - bit `fl` of `fl_bitmap` is set iff `sl_bitmap[fl] != 0`, and bit `sl` of
///   `sl_bitmap[fl]` is set iff `heads[fl][sl] != NIL`;
/// - each free node is linked in exactly the bin `mapping_insert(len)` names.
#[derive(Debug)]
pub struct TlsfRange {
    /// Bytes per unit: every offset and length is a multiple of it.
    unit: u64,
    /// Range size in units.
    capacity: u64,
    /// First unit of the wilderness; all of `[top, capacity)` is free.
    top: u64,
    /// Highest `top` ever reached (units).
    high_water: u64,
    /// Last node below `top` (`NIL` when `top == 0`).
    last: u32,
    nodes: Slab<Node>,
    fl_bitmap: u64,
    sl_bitmap: [u32; FL_COUNT],
    heads: [[u32; SL_COUNT]; FL_COUNT],
    /// Units in bins (not counting the wilderness).
    binned_units: u64,
    /// Number of free nodes in bins.
    free_nodes: u64,
    next_tag: u64,
}

/// Bin of a free block of `len` units.
#[inline]
fn mapping_insert(len: u64) -> (usize, usize) {
    if len < SL_COUNT as u64 {
        (0, len as usize)
    } else {
        let log = 63 - len.leading_zeros();
        let fl = (log - SL_SHIFT + 1) as usize;
        let sl = ((len >> (log - SL_SHIFT)) as usize) & (SL_COUNT - 1);
        (fl, sl)
    }
}

/// Smallest bin whose every block holds at least `len` units.
#[inline]
fn mapping_search(len: u64) -> (usize, usize) {
    if len < SL_COUNT as u64 {
        (0, len as usize)
    } else {
        let log = 63 - len.leading_zeros();
        let round = (1u64 << (log - SL_SHIFT)) - 1;
        mapping_insert(len.saturating_add(round))
    }
}

impl TlsfRange {
    /// A range of `capacity` bytes carved in multiples of `unit` bytes (a power of two).
    pub fn new(capacity: u64, unit: u64) -> Result<Self, EngineError> {
        if !unit.is_power_of_two() || capacity < unit || capacity % unit != 0 {
            return Err(EngineError::BadCapacity { capacity, unit });
        }
        Ok(Self {
            unit,
            capacity: capacity / unit,
            top: 0,
            high_water: 0,
            last: NIL,
            nodes: Slab::new(),
            fl_bitmap: 0,
            sl_bitmap: [0; FL_COUNT],
            heads: [[NIL; SL_COUNT]; FL_COUNT],
            binned_units: 0,
            free_nodes: 0,
            next_tag: 1,
        })
    }

    /// Allocates `size` bytes (a multiple of the unit) at an `align`-aligned offset.
    /// Returns the offset and the key [`TlsfRange::free`] needs.
    pub fn alloc(&mut self, size: u64, align: u64) -> Option<(u64, u32, u64)> {
        debug_assert!(size % self.unit == 0 && size > 0);
        let len = size / self.unit;
        let align_units = (align / self.unit).max(1);
        // Worst-case slack needed in a free block to reach an aligned start.
        let slack = align_units - 1;
        let node = self
            .find_free(len, slack, align_units)
            .or_else(|| self.take_wilderness(len, align_units))?;
        let tag = self.next_tag;
        self.next_tag += 1;
        let idx = self.carve(node, len, align_units, tag);
        Some((self.nodes[idx as usize].start * self.unit, idx, tag))
    }

    /// Frees the block `key` names, checking it is the live block at `offset` with `tag`.
    pub fn free(&mut self, key: u32, offset: u64, tag: u64) -> Result<(), EngineError> {
        match self.nodes.get(key as usize) {
            Some(n) if !n.free && n.tag == tag && n.start * self.unit == offset => {}
            _ => return Err(EngineError::AlreadyFreed { offset }),
        }
        self.release(key);
        Ok(())
    }

    /// Highest offset (bytes) ever in use.
    pub fn high_water(&self) -> u64 {
        self.high_water * self.unit
    }

    /// Bytes the range spans.
    pub fn capacity(&self) -> u64 {
        self.capacity * self.unit
    }

    /// Extends the range by `additional` bytes (a multiple of the unit) at its end. The new
    /// space joins the wilderness, so it merges with the free tail at once.
    pub fn grow(&mut self, additional: u64) -> Result<(), EngineError> {
        let bad = EngineError::BadCapacity {
            capacity: additional,
            unit: self.unit,
        };
        if additional == 0 || additional % self.unit != 0 {
            return Err(bad);
        }
        match self.capacity.checked_add(additional / self.unit) {
            // Offsets in bytes must stay representable.
            Some(c) if c.checked_mul(self.unit).is_some() => self.capacity = c,
            _ => return Err(bad),
        }
        Ok(())
    }

    /// Bytes of free space at the end of the range: the wilderness (a free node never
    /// touches it, so nothing below `top` is part of the free tail).
    pub fn free_tail(&self) -> u64 {
        (self.capacity - self.top) * self.unit
    }

    /// Cuts `bytes` (a multiple of the unit, at most [`TlsfRange::free_tail`]) off the end.
    pub fn shrink(&mut self, bytes: u64) {
        debug_assert!(bytes % self.unit == 0 && bytes <= self.free_tail());
        self.capacity -= bytes / self.unit;
    }

    /// Free and fragmentation figures.
    pub fn stats(&self) -> RangeStats {
        let mut largest = (self.capacity - self.top) * self.unit;
        for (_, n) in self.nodes.iter() {
            if n.free {
                largest = largest.max(n.len * self.unit);
            }
        }
        RangeStats {
            capacity: self.capacity * self.unit,
            free_bytes: (self.binned_units + self.capacity - self.top) * self.unit,
            largest_free: largest,
            free_fragments: self.free_nodes + u64::from(self.top < self.capacity),
            high_water: self.high_water(),
            top: self.top * self.unit,
        }
    }

    /// Checks every invariant listed on the type.
    pub fn validate(&self) -> Result<(), EngineError> {
        let fail = |m: String| Err(EngineError::Corrupt(format!("tlsf: {m}")));
        let mut cursor = 0u64;
        let mut prev = NIL;
        let mut idx = if self.top == 0 {
            NIL
        } else {
            self.first_node()
        };
        let mut seen = 0usize;
        let mut binned = 0u64;
        let mut free_nodes = 0u64;
        while idx != NIL {
            let Some(n) = self.nodes.get(idx as usize) else {
                return fail(format!("dangling node {idx}"));
            };
            if n.start != cursor || n.len == 0 || n.prev_phys != prev {
                return fail(format!("node {idx} breaks the tiling at unit {cursor}"));
            }
            if n.free {
                binned += n.len;
                free_nodes += 1;
                if prev != NIL && self.nodes[prev as usize].free {
                    return fail(format!("free nodes {prev} and {idx} are adjacent"));
                }
                let (fl, sl) = mapping_insert(n.len);
                if !self.bin_contains(fl, sl, idx) {
                    return fail(format!("free node {idx} is not in bin ({fl},{sl})"));
                }
            }
            cursor += n.len;
            prev = idx;
            idx = n.next_phys;
            seen += 1;
        }
        if cursor != self.top || prev != self.last {
            return fail(format!("tiling ends at {cursor}, top is {}", self.top));
        }
        if self.last != NIL && self.nodes[self.last as usize].free {
            return fail("a free node touches the wilderness".into());
        }
        if seen != self.nodes.len() {
            return fail(format!(
                "{} nodes allocated, {seen} reachable",
                self.nodes.len()
            ));
        }
        if binned != self.binned_units || free_nodes != self.free_nodes {
            return fail("free counters disagree with the nodes".into());
        }
        for fl in 0..FL_COUNT {
            if (self.fl_bitmap >> fl & 1 == 1) != (self.sl_bitmap[fl] != 0) {
                return fail(format!("fl bitmap bit {fl} is stale"));
            }
            for sl in 0..SL_COUNT {
                let head = self.heads[fl][sl];
                if (self.sl_bitmap[fl] >> sl & 1 == 1) != (head != NIL) {
                    return fail(format!("sl bitmap bit ({fl},{sl}) is stale"));
                }
                let mut p = NIL;
                let mut i = head;
                while i != NIL {
                    let n = &self.nodes[i as usize];
                    if !n.free || n.prev_free != p || mapping_insert(n.len) != (fl, sl) {
                        return fail(format!("bin ({fl},{sl}) holds a wrong node {i}"));
                    }
                    p = i;
                    i = n.next_free;
                }
            }
        }
        if self.top > self.capacity || self.high_water < self.top {
            return fail("top beyond capacity or high water".into());
        }
        Ok(())
    }

    /// Whether nothing is allocated.
    pub fn is_empty(&self) -> bool {
        self.top == 0
    }

    /// Used bytes, padding gaps included.
    pub fn used_bytes(&self) -> u64 {
        (self.top - self.binned_units) * self.unit
    }

    fn first_node(&self) -> u32 {
        let mut i = self.last;
        while i != NIL && self.nodes[i as usize].prev_phys != NIL {
            i = self.nodes[i as usize].prev_phys;
        }
        i
    }

    fn bin_contains(&self, fl: usize, sl: usize, idx: u32) -> bool {
        let mut i = self.heads[fl][sl];
        while i != NIL {
            if i == idx {
                return true;
            }
            i = self.nodes[i as usize].next_free;
        }
        false
    }

    /// Offset within `n` where an aligned allocation of `len` would start, if it fits.
    #[inline]
    fn fit(n: &Node, len: u64, align_units: u64) -> Option<u64> {
        let start = n.start.next_multiple_of(align_units);
        (start + len <= n.start + n.len).then_some(start)
    }

    fn find_free(&mut self, len: u64, slack: u64, align_units: u64) -> Option<u32> {
        // A few blocks of the request's own bin may fit: the lowest-addressed of them wins.
        let (fl, sl) = mapping_insert(len);
        let mut best = self.lowest_fitting(self.heads[fl][sl], len, align_units);
        if best.is_some() {
            return best;
        }
        // Then the smallest bin that surely fits, again preferring low addresses.
        let (mut fl, sl) = mapping_search(len + slack);
        if fl >= FL_COUNT {
            return None;
        }
        let mut sl_map = self.sl_bitmap[fl] & (!0u32).checked_shl(sl as u32).unwrap_or(0);
        if sl_map == 0 {
            let fl_map = self.fl_bitmap & (!0u64).checked_shl(fl as u32 + 1).unwrap_or(0);
            if fl_map == 0 {
                return None;
            }
            fl = fl_map.trailing_zeros() as usize;
            sl_map = self.sl_bitmap[fl];
        }
        let sl = sl_map.trailing_zeros() as usize;
        best = self.lowest_fitting(self.heads[fl][sl], len, align_units);
        debug_assert!(best.is_some(), "a block of a searched bin always fits");
        best
    }

    /// The lowest-addressed block that fits among the first few of a bin's list.
    #[inline]
    fn lowest_fitting(&self, head: u32, len: u64, align_units: u64) -> Option<u32> {
        let mut best: Option<(u64, u32)> = None;
        let mut i = head;
        let mut probes = 0;
        while i != NIL && probes < EXACT_BIN_PROBES {
            let n = &self.nodes[i as usize];
            if Self::fit(n, len, align_units).is_some() && best.is_none_or(|(s, _)| n.start < s) {
                best = Some((n.start, i));
            }
            i = n.next_free;
            probes += 1;
        }
        best.map(|(_, i)| i)
    }

    /// Extends `[0, top)` with a free node big enough for an aligned `len`, if capacity allows.
    fn take_wilderness(&mut self, len: u64, align_units: u64) -> Option<u32> {
        let start = self.top.next_multiple_of(align_units);
        let end = start.checked_add(len)?;
        if end > self.capacity {
            return None;
        }
        let node = self.nodes.insert(Node {
            start: self.top,
            len: end - self.top,
            prev_phys: self.last,
            next_phys: NIL,
            prev_free: NIL,
            next_free: NIL,
            free: false,
            tag: 0,
        }) as u32;
        if self.last != NIL {
            self.nodes[self.last as usize].next_phys = node;
        }
        self.last = node;
        self.top = end;
        self.high_water = self.high_water.max(end);
        // Hand it to carve as if it were binned.
        self.nodes[node as usize].free = true;
        self.link(node);
        Some(node)
    }

    /// Takes `len` aligned units out of free node `idx`; returns the used node.
    fn carve(&mut self, idx: u32, len: u64, align_units: u64, tag: u64) -> u32 {
        self.unlink(idx);
        let n = &self.nodes[idx as usize];
        let start = Self::fit(n, len, align_units).expect("find_free returned a fitting block");
        let (n_start, n_end) = (n.start, n.start + n.len);
        let mut used = idx;
        if start > n_start {
            // Leading alignment gap stays free in `idx`; the allocation gets a new node.
            self.nodes[idx as usize].len = start - n_start;
            used = self.split_after(idx, start, n_end - start);
            self.nodes[idx as usize].free = true;
            self.link(idx);
        }
        let end = start + len;
        if end < n_end {
            self.nodes[used as usize].len = len;
            let rest = self.split_after(used, end, n_end - end);
            self.nodes[rest as usize].free = true;
            self.link(rest);
        }
        let u = &mut self.nodes[used as usize];
        u.free = false;
        u.tag = tag;
        used
    }

    /// Inserts a node `[start, start+len)` right after `idx` in address order.
    fn split_after(&mut self, idx: u32, start: u64, len: u64) -> u32 {
        let next = self.nodes[idx as usize].next_phys;
        let new = self.nodes.insert(Node {
            start,
            len,
            prev_phys: idx,
            next_phys: next,
            prev_free: NIL,
            next_free: NIL,
            free: false,
            tag: 0,
        }) as u32;
        self.nodes[idx as usize].next_phys = new;
        if next != NIL {
            self.nodes[next as usize].prev_phys = new;
        } else {
            self.last = new;
        }
        new
    }

    fn release(&mut self, mut idx: u32) {
        self.nodes[idx as usize].free = true;
        self.nodes[idx as usize].tag = 0;
        // Merge with the free neighbour above.
        let next = self.nodes[idx as usize].next_phys;
        if next != NIL && self.nodes[next as usize].free {
            self.unlink(next);
            self.absorb_next(idx);
        }
        // Merge into the free neighbour below.
        let prev = self.nodes[idx as usize].prev_phys;
        if prev != NIL && self.nodes[prev as usize].free {
            self.unlink(prev);
            self.absorb_next(prev);
            idx = prev;
        }
        if self.nodes[idx as usize].next_phys == NIL {
            // Touches the wilderness: fold it back in.
            let n = self.nodes.remove(idx as usize);
            self.top = n.start;
            self.last = n.prev_phys;
            if self.last != NIL {
                self.nodes[self.last as usize].next_phys = NIL;
            }
        } else {
            self.link(idx);
        }
    }

    /// Node `idx` swallows its physical successor.
    fn absorb_next(&mut self, idx: u32) {
        let next = self.nodes[idx as usize].next_phys;
        let gone = self.nodes.remove(next as usize);
        let n = &mut self.nodes[idx as usize];
        n.len += gone.len;
        n.next_phys = gone.next_phys;
        if gone.next_phys != NIL {
            self.nodes[gone.next_phys as usize].prev_phys = idx;
        } else {
            self.last = idx;
        }
    }

    fn link(&mut self, idx: u32) {
        let len = self.nodes[idx as usize].len;
        let (fl, sl) = mapping_insert(len);
        let head = self.heads[fl][sl];
        {
            let n = &mut self.nodes[idx as usize];
            n.prev_free = NIL;
            n.next_free = head;
        }
        if head != NIL {
            self.nodes[head as usize].prev_free = idx;
        }
        self.heads[fl][sl] = idx;
        self.sl_bitmap[fl] |= 1 << sl;
        self.fl_bitmap |= 1 << fl;
        self.binned_units += len;
        self.free_nodes += 1;
    }

    fn unlink(&mut self, idx: u32) {
        let n = &self.nodes[idx as usize];
        let (prev, next, len) = (n.prev_free, n.next_free, n.len);
        let (fl, sl) = mapping_insert(len);
        if prev != NIL {
            self.nodes[prev as usize].next_free = next;
        } else {
            self.heads[fl][sl] = next;
            if next == NIL {
                self.sl_bitmap[fl] &= !(1 << sl);
                if self.sl_bitmap[fl] == 0 {
                    self.fl_bitmap &= !(1 << fl);
                }
            }
        }
        if next != NIL {
            self.nodes[next as usize].prev_free = prev;
        }
        self.binned_units -= len;
        self.free_nodes -= 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mapping_is_monotone_and_search_rounds_up() {
        let mut last = (0, 0);
        for len in 1..100_000u64 {
            let b = mapping_insert(len);
            assert!(b >= last);
            last = b;
            // Every block in the searched bin is at least `len` long.
            let (fl, sl) = mapping_search(len);
            let min_len = if fl == 0 {
                sl as u64
            } else {
                let log = fl as u32 + SL_SHIFT - 1;
                (1u64 << log) + ((sl as u64) << (log - SL_SHIFT))
            };
            assert!(min_len >= len, "len {len} -> ({fl},{sl}) holds {min_len}");
        }
    }

    #[test]
    fn allocates_low_and_merges_back() {
        let mut t = TlsfRange::new(1 << 20, 64).unwrap();
        let (a, ka, ta) = t.alloc(128, 64).unwrap();
        let (b, kb, tb) = t.alloc(64, 64).unwrap();
        let (c, kc, tc) = t.alloc(4096, 64).unwrap();
        assert_eq!((a, b, c), (0, 128, 192));
        t.validate().unwrap();
        t.free(kb, b, tb).unwrap();
        t.validate().unwrap();
        // The hole is reused before the wilderness.
        let (d, kd, td) = t.alloc(64, 64).unwrap();
        assert_eq!(d, 128);
        t.free(ka, a, ta).unwrap();
        t.free(kd, d, td).unwrap();
        t.free(kc, c, tc).unwrap();
        t.validate().unwrap();
        assert!(t.is_empty());
        assert_eq!(t.high_water(), 192 + 4096);
    }

    #[test]
    fn honours_alignment_and_capacity() {
        let mut t = TlsfRange::new(1 << 16, 64).unwrap();
        let (_, _, _) = t.alloc(64, 64).unwrap();
        let (b, kb, tb) = t.alloc(256, 4096).unwrap();
        assert_eq!(b % 4096, 0);
        t.validate().unwrap();
        assert!(t.alloc(1 << 16, 64).is_none());
        t.free(kb, b, tb).unwrap();
        assert!(t.free(kb, b, tb).is_err());
        t.validate().unwrap();
    }

    #[test]
    fn grow_extends_the_wilderness_and_shrink_cuts_it() {
        let mut t = TlsfRange::new(4096, 64).unwrap();
        let (a, ka, ta) = t.alloc(2048, 64).unwrap();
        let (b, kb, tb) = t.alloc(1024, 64).unwrap();
        t.free(kb, b, tb).unwrap();
        // The freed node folded into the wilderness: the tail is all of [2048, 4096).
        assert_eq!(t.free_tail(), 2048);
        assert!(t.alloc(4096, 64).is_none());
        assert!(t.grow(0).is_err() && t.grow(100).is_err() && t.grow(u64::MAX - 63).is_err());
        t.grow(4096).unwrap();
        assert_eq!(t.capacity(), 8192);
        let (c, kc, tc) = t.alloc(6144, 64).unwrap();
        assert_eq!(c, 2048, "the grown space continues the old free tail");
        t.validate().unwrap();
        assert_eq!(t.free_tail(), 0);
        t.free(kc, c, tc).unwrap();
        t.shrink(4096);
        assert_eq!((t.capacity(), t.free_tail()), (4096, 2048));
        t.validate().unwrap();
        assert!(t.alloc(4096, 64).is_none());
        t.free(ka, a, ta).unwrap();
        t.shrink(4096);
        assert_eq!(t.capacity(), 0);
        assert!(t.alloc(64, 64).is_none());
        t.validate().unwrap();
    }
}
