//! Two-level segregated fit over an offset range, with metadata out of band.
//!
//! Every byte of `[0, top)` belongs to exactly one node (free or used); the nodes form a
//! doubly linked list in address order, so freeing merges with both neighbours in O(1).
//! Free nodes also sit in one of `FL x SL` size bins, found through two bitmaps. Above `top`
//! lies the untouched rest of the range (the "wilderness"): it is taken only when no bin
//! can serve a request, which keeps the range's high-water mark low.
//!
//! Nodes live in one flat `Vec` addressed by `u32` index, 32 bytes each so that none
//! straddles two cache lines; the slots of merged-away nodes form an intrusive chain
//! through `next_phys` and are reused first. Units are a power of two, so every byte/unit
//! conversion is a shift, and a range spans at most 2^32 units (256 GiB at 64 bytes).
//!
//! Recurring sizes (video frames, KV-cache blocks, slab pages) take a shortcut: a freed
//! block is *parked* unmerged in a small table of exact-length lists, and the next request
//! of that length takes it back in a few instructions. Parked blocks are merged (unparked)
//! before a request would otherwise go to the wilderness, so the high-water mark never
//! rises while merging could have served the request from below `top`.

use super::{EngineError, RangeStats, NIL};

/// log2 of the number of second-level bins per first level.
const SL_SHIFT: u32 = 5;
const SL_COUNT: usize = 1 << SL_SHIFT;
/// First levels: enough for every length up to [`MAX_UNITS`].
const FL_COUNT: usize = 32 - SL_SHIFT as usize + 1;
/// Most units a range spans, so node starts and lengths fit 32 bits (256 GiB at 64 bytes).
pub(crate) const MAX_UNITS: u64 = u32::MAX as u64;
/// How many entries of a bin are tried, lowest address winning, before settling.
const BIN_PROBES: usize = 8;
/// Slots of the parked-block table (direct-mapped by exact length).
const PARK_SLOTS: usize = 64;
/// Slot 0 of the node table is no block: a free-list update whose neighbour is missing
/// writes there instead of branching on it (whether a block is first or last in its bin is
/// as likely as not, so such branches mispredict). Only its free links are ever written;
/// its length 0 and tag 0 keep it out of every walk and refuse it as a key.
const SINK: u32 = 0;

/// Where a free-list write aimed at `idx` goes: `idx`, or the sink when there is none.
#[inline(always)]
fn or_sink(idx: u32) -> u32 {
    if idx == NIL {
        SINK
    } else {
        idx
    }
}
/// Tag of a parked node; never an allocation's tag.
pub const PARKED: u32 = u32::MAX;

/// Slot of the parked-block table for blocks of `len` units.
#[inline]
fn park_slot(len: u64) -> usize {
    (len.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> (64 - PARK_SLOTS.trailing_zeros())) as usize
}

/// Freed blocks of one exact length, not merged yet; linked through `next_free`.
///
/// 8 bytes, no count: the 64 lists fill 8 cache lines instead of 16, so the line a free
/// reads is more often still cached (random-mix's range tier: 3.25 -> 3.01 L1 read misses
/// per operation, same offsets).
#[derive(Debug, Clone, Copy)]
struct ParkedList {
    /// Length of every block in the list, in units; meaningless while `head == NIL`.
    len: u32,
    /// First block (`NIL` when empty).
    head: u32,
}

impl ParkedList {
    /// A list with no block.
    const EMPTY: Self = Self { len: 0, head: NIL };
}

/// One block of the range (free or used), or a vacant slot of the node table.
///
/// 32 bytes and aligned to them, so a node never straddles two cache lines.
#[derive(Debug, Clone, Copy)]
#[repr(C, align(32))]
struct Node {
    /// Start, in units.
    start: u32,
    /// Length, in units; 0 only while the slot is vacant.
    len: u32,
    /// Neighbour below in address order (`NIL` at offset 0).
    prev_phys: u32,
    /// Neighbour above in address order (`NIL` when the node ends at `top`); while the
    /// slot is vacant, the next vacant slot.
    next_phys: u32,
    /// Free-list links; meaningful only while free.
    prev_free: u32,
    next_free: u32,
    /// The allocation's tag while used (never 0 nor [`PARKED`]); [`PARKED`] while parked;
    /// 0 while free or vacant. A stale handle to a reused slot is caught by it.
    tag: u32,
}

static_assertions::const_assert_eq!(std::mem::size_of::<Node>(), 32);
static_assertions::const_assert_eq!(std::mem::size_of::<ParkedList>(), 8);

impl Node {
    #[inline]
    fn is_free(&self) -> bool {
        self.tag == 0
    }
    /// Start, in units.
    #[inline]
    fn start(&self) -> u64 {
        u64::from(self.start)
    }
    /// Length, in units.
    #[inline]
    fn len(&self) -> u64 {
        u64::from(self.len)
    }
    /// One past the last unit.
    #[inline]
    fn end(&self) -> u64 {
        self.start() + self.len()
    }
}

/// A TLSF range engine. Lengths and offsets are in bytes at the API, in units of `unit` inside.
///
/// Invariants (checked by [`TlsfRange::validate`]):
/// - the nodes tile `[0, top)` in address order through `next_phys`/`prev_phys`;
/// - no two free (binned) nodes are adjacent (free neighbours are always merged, and a free
///   node never ends at `top`: it is folded into the wilderness instead); parked nodes
///   count as used here, they are merged when unparked;
/// - bit `fl` of `fl_bitmap` is set iff `sl_bitmap[fl] != 0`, and bit `sl` of
///   `sl_bitmap[fl]` is set iff `heads[fl][sl] != NIL`;
/// - each free node is linked in exactly the bin `mapping_insert(len)` names;
/// - every slot of `nodes` is either reachable from `last` or on the vacant chain;
/// - each parked node is in exactly the parked list `park_slot(len)` names, whose `len` is
///   its own; bit `s` of `parked_slots` is set iff list `s` is not empty;
/// - `used_units` is the sum of the lengths of used nodes (neither free nor parked).
#[derive(Debug)]
pub struct TlsfRange {
    /// log2 of the bytes per unit: every offset and length is a multiple of the unit.
    unit_shift: u32,
    /// Range size in units; at most [`MAX_UNITS`].
    capacity: u64,
    /// First unit of the wilderness; all of `[top, capacity)` is free.
    top: u64,
    /// Highest `top` ever reached (units).
    high_water: u64,
    /// Last node below `top` (`NIL` when `top == 0`).
    last: u32,
    nodes: Vec<Node>,
    /// First vacant slot of `nodes` (`NIL` when none); the chain runs through `next_phys`.
    vacant: u32,
    fl_bitmap: u64,
    sl_bitmap: [u32; FL_COUNT],
    heads: [[u32; SL_COUNT]; FL_COUNT],
    parked: [ParkedList; PARK_SLOTS],
    /// Bit `s` set iff parked list `s` is not empty.
    parked_slots: u64,
    /// Units of used nodes: changes only when a block is handed out or given back, so
    /// parking, merging and splitting keep no counters (the free figures are walked for
    /// [`TlsfRange::stats`]).
    used_units: u64,
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

/// `value` rounded up to a multiple of `align` (a power of two); no overflow for unit counts.
#[inline]
fn align_units_up(value: u64, align: u64) -> u64 {
    (value + (align - 1)) & !(align - 1)
}

impl TlsfRange {
    /// A range of `capacity` bytes carved in multiples of `unit` bytes (a power of two), at
    /// most `u32::MAX` units.
    pub fn new(capacity: u64, unit: u64) -> Result<Self, EngineError> {
        if !unit.is_power_of_two() || capacity < unit || capacity % unit != 0 {
            return Err(EngineError::BadCapacity { capacity, unit });
        }
        if capacity / unit > MAX_UNITS {
            return Err(EngineError::CapacityTooLarge {
                capacity,
                max: MAX_UNITS * unit,
            });
        }
        Ok(Self {
            unit_shift: unit.trailing_zeros(),
            capacity: capacity / unit,
            top: 0,
            high_water: 0,
            last: NIL,
            // Slot 0 is the sink (see `SINK`).
            nodes: vec![Node {
                start: 0,
                len: 0,
                prev_phys: NIL,
                next_phys: NIL,
                prev_free: NIL,
                next_free: NIL,
                tag: 0,
            }],
            vacant: NIL,
            fl_bitmap: 0,
            sl_bitmap: [0; FL_COUNT],
            heads: [[NIL; SL_COUNT]; FL_COUNT],
            parked: [ParkedList::EMPTY; PARK_SLOTS],
            parked_slots: 0,
            used_units: 0,
        })
    }

    #[inline]
    fn unit(&self) -> u64 {
        1 << self.unit_shift
    }

    /// Allocates `size` bytes (a non-zero multiple of the unit) at an `align`-aligned offset
    /// (`align` a power of two), marking it with `tag` (neither 0 nor [`PARKED`]). Returns the
    /// offset and the key [`TlsfRange::free`] needs; `None` when nothing fits, or for any
    /// other `size`, `align` or `tag` (the range is left as it was).
    #[inline(always)]
    pub fn alloc(&mut self, size: u64, align: u64, tag: u32) -> Option<(u64, u32)> {
        self.alloc_with(size, align, tag, true)
    }

    /// [`alloc`](Self::alloc) with the good-fit search only: `None` may leave a free block
    /// that holds the request unused (past the few entries of its own bin the search looks
    /// at, or one whose alignment slack happens to fit). Cheaper to refuse: the pool asks
    /// each of its chunks this way and many refuse; it asks with `alloc` before it grows.
    #[inline(always)]
    pub fn alloc_good_fit(&mut self, size: u64, align: u64, tag: u32) -> Option<(u64, u32)> {
        self.alloc_with(size, align, tag, false)
    }

    /// [`alloc`](Self::alloc) (`thorough`) or [`alloc_good_fit`](Self::alloc_good_fit).
    #[inline(always)]
    fn alloc_with(
        &mut self,
        size: u64,
        align: u64,
        tag: u32,
        thorough: bool,
    ) -> Option<(u64, u32)> {
        if !self.takes(size, align, tag) {
            return None;
        }
        if let Some(x) = self.take_parked(size, align, tag) {
            return Some(x);
        }
        let len = size >> self.unit_shift;
        let align_units = (align >> self.unit_shift).max(1);
        self.alloc_search(len, align_units, tag, thorough)
    }

    /// [`alloc`](Self::alloc) from a block parked at exactly `size` bytes only: no search,
    /// no merge. `None` when none is parked, the first parked is not aligned enough, or the
    /// arguments are not what `alloc` takes.
    #[inline(always)]
    pub fn alloc_parked(&mut self, size: u64, align: u64, tag: u32) -> Option<(u64, u32)> {
        if !self.takes(size, align, tag) {
            return None;
        }
        self.take_parked(size, align, tag)
    }

    /// Whether `alloc` takes these arguments. A bad tag would corrupt the node's state, a
    /// size off the unit would get a block shorter than asked, and an alignment that is
    /// not a power of two a block not aligned to it: checked on every call, a few
    /// instructions against the engine's own checks before them.
    #[inline(always)]
    fn takes(&self, size: u64, align: u64, tag: u32) -> bool {
        tag.wrapping_sub(1) < PARKED - 1
            && size != 0
            && size & (self.unit() - 1) == 0
            && align.is_power_of_two()
    }

    #[inline(always)]
    fn take_parked(&mut self, size: u64, align: u64, tag: u32) -> Option<(u64, u32)> {
        let len = size >> self.unit_shift;
        let align_units = (align >> self.unit_shift).max(1);
        // A parked block of exactly this length, if it is aligned enough.
        let list = &mut self.parked[park_slot(len)];
        if list.head != NIL && u64::from(list.len) == len {
            let idx = list.head;
            let n = &mut self.nodes[idx as usize];
            if n.start() & (align_units - 1) == 0 {
                list.head = n.next_free;
                if list.head == NIL {
                    self.parked_slots &= !(1 << park_slot(len));
                }
                n.tag = tag;
                self.used_units += len;
                return Some((n.start() << self.unit_shift, idx));
            }
        }
        None
    }

    /// The request found no parked block: search the bins, then the wilderness.
    #[inline(never)]
    fn alloc_search(
        &mut self,
        len: u64,
        align_units: u64,
        tag: u32,
        thorough: bool,
    ) -> Option<(u64, u32)> {
        // Any such request sees the free space exactly as eager merging would leave it
        // (even one that cannot fit: the pool's later placements depend on the merge).
        self.unpark_all();
        // Longer than the range: nothing can hold it (and node lengths stay in 32 bits).
        if len > self.capacity {
            return None;
        }
        let node = match self.find_free(len, align_units) {
            Some(node) => node,
            None => {
                if let Some((idx, start)) = self.carve_wilderness(len, align_units, tag) {
                    self.used_units += len;
                    return Some((start << self.unit_shift, idx));
                }
                // The good-fit search looks at a few entries of the request's own bin and
                // then only at bins whose every block surely fits: a block past the probes,
                // or one whose alignment slack happens to fit, is skipped. Before refusing,
                // look at every block, so a refusal means nothing fits. Only here: a
                // request the searches above serve is placed as before.
                if !thorough {
                    return None;
                }
                self.find_free_exhaustive(len, align_units)?
            }
        };
        // The one call of `carve`, so that it is inlined: with a second one for the block
        // the full look finds, it was not (7 million instructions more on a pool replay
        // of random-mix).
        let (idx, start) = self.carve(node, len, align_units, tag);
        self.used_units += len;
        Some((start << self.unit_shift, idx))
    }

    /// Frees the block `key` names, checking it is the live block at `offset` of `size`
    /// bytes with `tag`. The block is parked when its length's list has room, merged otherwise.
    #[inline(always)]
    pub fn free(&mut self, key: u32, offset: u64, size: u64, tag: u32) -> Result<(), EngineError> {
        let shift = self.unit_shift;
        let Some(n) = self.nodes.get_mut(key as usize) else {
            return Err(EngineError::AlreadyFreed { offset });
        };
        let len = n.len();
        // The length too: once tags wrap, a stale handle may name a block of another
        // length at the same start with its tag (the node's line is loaded already).
        if tag == 0
            || tag == PARKED
            || n.tag != tag
            || n.start() << shift != offset
            || len << shift != size
        {
            return Err(EngineError::AlreadyFreed { offset });
        }
        // A live node's length is in `used_units`: less means the count drifted. Checked in
        // debug builds only (the free path stays as it was); a release build's wrap is a
        // drift `validate` reports.
        debug_assert!(self.used_units >= len, "used units below a live block");
        self.used_units -= len;
        let list = &mut self.parked[park_slot(len)];
        if list.head == NIL || u64::from(list.len) == len {
            n.tag = PARKED;
            n.next_free = list.head;
            list.head = key;
            // Node lengths fit 32 bits.
            list.len = len as u32;
            self.parked_slots |= 1 << park_slot(len);
        } else {
            self.release(key);
        }
        Ok(())
    }

    /// Merges every parked block back into the bins (or the wilderness).
    #[inline]
    pub fn unpark_all(&mut self) {
        if self.parked_slots != 0 {
            self.unpark_slots();
        }
    }

    #[inline(never)]
    fn unpark_slots(&mut self) {
        while self.parked_slots != 0 {
            let slot = self.parked_slots.trailing_zeros() as usize;
            self.parked_slots &= self.parked_slots - 1;
            let mut i = self.parked[slot].head;
            self.parked[slot] = ParkedList::EMPTY;
            while i != NIL {
                let next = self.nodes[i as usize].next_free;
                self.release(i);
                i = next;
            }
        }
    }

    /// Highest offset (bytes) ever in use.
    pub fn high_water(&self) -> u64 {
        self.high_water << self.unit_shift
    }

    /// Bytes the range spans.
    pub fn capacity(&self) -> u64 {
        self.capacity << self.unit_shift
    }

    /// Extends the range by `additional` bytes (a multiple of the unit) at its end. The new
    /// space joins the wilderness, so it merges with the free tail at once. The range stays
    /// within `u32::MAX` units.
    pub fn grow(&mut self, additional: u64) -> Result<(), EngineError> {
        let bad = EngineError::BadCapacity {
            capacity: additional,
            unit: self.unit(),
        };
        if additional == 0 || additional % self.unit() != 0 {
            return Err(bad);
        }
        match self.capacity.checked_add(additional >> self.unit_shift) {
            Some(c) if c <= MAX_UNITS => self.capacity = c,
            _ => {
                return Err(EngineError::CapacityTooLarge {
                    capacity: self.capacity().saturating_add(additional),
                    max: MAX_UNITS << self.unit_shift,
                })
            }
        }
        Ok(())
    }

    /// Bytes of free space at the end of the range: the wilderness (a free node never
    /// touches it, so nothing below `top` is part of the free tail; a parked one may:
    /// [`TlsfRange::unpark_all`] first).
    pub fn free_tail(&self) -> u64 {
        (self.capacity - self.top) << self.unit_shift
    }

    /// Bytes of free space at the end of the range as its user sees it: the wilderness and
    /// the blocks parked below it that reach it, with the free ones between them (any
    /// search merges them into the wilderness first). [`TlsfRange::free_tail`] is the
    /// wilderness alone, what [`TlsfRange::shrink`] may cut.
    pub fn free_tail_merged(&self) -> u64 {
        let mut tail = self.capacity - self.top;
        let mut i = self.last;
        // At most one step per slot, so a corrupt list cannot hold the walk.
        let mut steps = 0;
        while let Some(n) = self
            .nodes
            .get(i as usize)
            .filter(|n| (n.is_free() || n.tag == PARKED) && steps < self.nodes.len())
        {
            tail += n.len();
            i = n.prev_phys;
            steps += 1;
        }
        tail << self.unit_shift
    }

    /// Cuts `bytes` (a multiple of the unit, at most [`TlsfRange::free_tail`]) off the end;
    /// more than the free tail cuts the free tail, and a part unit is not cut.
    pub fn shrink(&mut self, bytes: u64) {
        // Never into live space, even if the caller asks for more: a public call, so in
        // debug builds too.
        self.capacity -= bytes.min(self.free_tail()) >> self.unit_shift;
    }

    /// Bytes of the largest free range: the wilderness, a parked block (each counted on its
    /// own, not merged yet) or a block of the highest bin in use. Costs one bin's list and
    /// the parked table, not a walk over every node, so a refused request stays cheap.
    pub fn largest_free(&self) -> u64 {
        let mut largest = self.capacity - self.top;
        let mut slots = self.parked_slots;
        while slots != 0 {
            largest = largest.max(self.parked[slots.trailing_zeros() as usize].len.into());
            slots &= slots - 1;
        }
        if self.fl_bitmap != 0 {
            let fl = 63 - self.fl_bitmap.leading_zeros() as usize;
            let sl = 31 - self.sl_bitmap[fl].leading_zeros() as usize;
            for i in self.list_from(self.heads[fl][sl]) {
                largest = largest.max(self.nodes[i as usize].len());
            }
        }
        largest << self.unit_shift
    }

    /// The nodes of a bin's or a parked list, from `head` along `next_free`. The walk ends
    /// at `NIL`, and also at an index past the node table: `validate` walks corrupt lists
    /// with it and must report them, not panic.
    fn list_from(&self, head: u32) -> impl Iterator<Item = u32> + '_ {
        let in_table = |&i: &u32| (i as usize) < self.nodes.len();
        std::iter::successors(Some(head).filter(in_table), move |&i| {
            Some(self.nodes[i as usize].next_free).filter(in_table)
        })
    }

    /// Free and fragmentation figures as a user of the range sees them: a walk in address
    /// order where each run of touching free and parked blocks counts as one free range,
    /// and a run that reaches `top` joins the wilderness. Parking is a shortcut for reuse,
    /// not fragmentation: counted block by block, an emptied range whose frees were parked
    /// read 11 fragments instead of 1. [`TlsfRange::largest_free`] stays the cheap figure
    /// that counts parked blocks apart. For the same reason `top` is the end of the highest
    /// block in use, not the tier's `top`, which a parked block below it still holds up.
    pub fn stats(&self) -> RangeStats {
        let mut fragments = 0u64;
        let mut largest = 0u64;
        // Units of the free run being walked (0: the last node was used).
        let mut run = 0u64;
        // End of the last used node walked (units).
        let mut in_use = 0u64;
        let mut i = if self.top == 0 {
            NIL
        } else {
            self.first_node()
        };
        // At most one step per slot, so a corrupt list cannot hold the walk.
        let mut steps = 0;
        while let Some(n) = self
            .nodes
            .get(i as usize)
            .filter(|_| steps < self.nodes.len())
        {
            if n.is_free() || n.tag == PARKED {
                fragments += u64::from(run == 0);
                run += n.len();
            } else {
                largest = largest.max(run);
                run = 0;
                in_use = n.end();
            }
            i = n.next_phys;
            steps += 1;
        }
        let wilderness = self.capacity - self.top;
        // The wilderness continues a run that reaches `top`, or is a range of its own.
        fragments += u64::from(run == 0 && wilderness > 0);
        largest = largest.max(run + wilderness);
        RangeStats {
            capacity: self.capacity(),
            free_bytes: (self.capacity - self.used_units) << self.unit_shift,
            largest_free: largest << self.unit_shift,
            free_fragments: fragments,
            high_water: self.high_water(),
            top: in_use << self.unit_shift,
        }
    }

    /// Test helper: a stale first-level bit, a drift only this tier's `validate` sees.
    #[cfg(test)]
    pub(super) fn drift_for_test(&mut self) {
        self.fl_bitmap ^= 1 << (FL_COUNT - 1);
    }

    /// Checks every invariant listed on the type.
    pub fn validate(&self) -> Result<(), EngineError> {
        let fail = |m: String| Err(EngineError::Corrupt(format!("tlsf: {m}")));
        // First: the free figures below subtract `top` from the capacity.
        if self.top > self.capacity || self.high_water < self.top {
            return fail("top beyond capacity or high water".into());
        }
        // Node starts and lengths are 32-bit: a longer range would truncate them.
        if self.capacity > MAX_UNITS {
            return fail(format!("capacity of {} units", self.capacity));
        }
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
        let mut parked_units = 0u64;
        let mut parked_nodes = 0u64;
        while idx != NIL {
            let Some(n) = self.nodes.get(idx as usize) else {
                return fail(format!("dangling node {idx}"));
            };
            if n.start() != cursor || n.len == 0 || n.prev_phys != prev {
                return fail(format!("node {idx} breaks the tiling at unit {cursor}"));
            }
            if n.is_free() {
                binned += n.len();
                free_nodes += 1;
                if prev != NIL && self.nodes[prev as usize].is_free() {
                    return fail(format!("free nodes {prev} and {idx} are adjacent"));
                }
                let (fl, sl) = mapping_insert(n.len());
                if !self.bin_contains(fl, sl, idx) {
                    return fail(format!("free node {idx} is not in bin ({fl},{sl})"));
                }
            } else if n.tag == PARKED {
                parked_units += n.len();
                parked_nodes += 1;
                if !self.parked_contains(idx, n.len()) {
                    return fail(format!("parked node {idx} is not in its list"));
                }
            }
            cursor += n.len();
            prev = idx;
            idx = n.next_phys;
            seen += 1;
            if seen > self.nodes.len() {
                return fail("the address-order list has a cycle".into());
            }
        }
        if cursor != self.top || prev != self.last {
            return fail(format!("tiling ends at {cursor}, top is {}", self.top));
        }
        if self.last != NIL && self.nodes[self.last as usize].is_free() {
            return fail("a free node touches the wilderness".into());
        }
        let mut vacant = 0usize;
        let mut v = self.vacant;
        while v != NIL {
            match self.nodes.get(v as usize) {
                Some(n) if n.len == 0 && n.tag == 0 && vacant < self.nodes.len() => {
                    v = n.next_phys;
                    vacant += 1;
                }
                _ => return fail(format!("vacant chain holds a live or dangling slot {v}")),
            }
        }
        // The sink slot is neither reachable nor vacant, and stays empty.
        match self.nodes.get(SINK as usize) {
            Some(n) if n.len == 0 && n.tag == 0 && n.start == 0 => {}
            _ => return fail("the sink slot holds a block".into()),
        }
        if seen + vacant + 1 != self.nodes.len() {
            return fail(format!(
                "{} slots, {seen} reachable, {vacant} vacant, one sink",
                self.nodes.len()
            ));
        }
        // Checked: a wrapped `used_units` is a drift to report, not an overflow to panic on.
        let tiled = self.used_units.checked_add(binned + parked_units);
        if tiled != Some(self.top) {
            return fail(format!(
                "{} units used, {binned} binned and {parked_units} parked tile {} units",
                self.used_units, self.top
            ));
        }
        // Before `largest_free` reads the bitmaps: a first-level bit over an empty second
        // level would send it out of range.
        for fl in 0..FL_COUNT {
            if (self.fl_bitmap >> fl & 1 == 1) != (self.sl_bitmap[fl] != 0) {
                return fail(format!("fl bitmap bit {fl} is stale"));
            }
        }
        if self.fl_bitmap >> FL_COUNT != 0 {
            return fail("fl bitmap has bits past the last level".into());
        }
        let largest = self
            .nodes
            .iter()
            .filter(|n| n.is_free() || n.tag == PARKED)
            .map(Node::len)
            .fold(self.capacity - self.top, u64::max);
        if largest << self.unit_shift != self.largest_free() {
            return fail(format!(
                "largest free range is {largest} units, the bins say {}",
                self.largest_free() >> self.unit_shift
            ));
        }
        // Every listed node is parked with the list's length, so with the counts equal and
        // each parked node found in its list, the lists hold exactly the parked nodes.
        let mut listed = 0u64;
        for (slot, list) in self.parked.iter().enumerate() {
            let mut i = list.head;
            let mut count = 0u64;
            while i != NIL {
                match self.nodes.get(i as usize) {
                    Some(n)
                        if n.tag == PARKED
                            && n.len == list.len
                            && park_slot(n.len()) == slot
                            && count < parked_nodes =>
                    {
                        i = n.next_free;
                        count += 1;
                    }
                    _ => return fail(format!("parked list {slot} holds a wrong node {i}")),
                }
            }
            if (self.parked_slots >> slot & 1 == 1) != (count != 0) {
                return fail(format!("parked slot bit {slot} is stale"));
            }
            listed += count;
        }
        if listed != parked_nodes {
            return fail(format!("{listed} parked nodes listed of {parked_nodes}"));
        }
        let mut in_bins = 0u64;
        for fl in 0..FL_COUNT {
            for sl in 0..SL_COUNT {
                let head = self.heads[fl][sl];
                if (self.sl_bitmap[fl] >> sl & 1 == 1) != (head != NIL) {
                    return fail(format!("sl bitmap bit ({fl},{sl}) is stale"));
                }
                let mut p = NIL;
                let mut i = head;
                while i != NIL {
                    // A link past the table is corruption to report, not an index to panic on.
                    let Some(n) = self.nodes.get(i as usize) else {
                        return fail(format!("bin ({fl},{sl}) links to a missing node {i}"));
                    };
                    if !n.is_free()
                        || n.len == 0
                        || n.prev_free != p
                        || mapping_insert(n.len()) != (fl, sl)
                    {
                        return fail(format!("bin ({fl},{sl}) holds a wrong node {i}"));
                    }
                    p = i;
                    i = n.next_free;
                    in_bins += 1;
                    if in_bins > free_nodes {
                        return fail(format!("bins hold more than the {free_nodes} free nodes"));
                    }
                }
            }
        }
        if in_bins != free_nodes {
            return fail(format!("bins hold {in_bins} of {free_nodes} free nodes"));
        }
        Ok(())
    }

    /// Whether nothing is allocated.
    pub fn is_empty(&self) -> bool {
        self.used_units == 0
    }

    /// Used bytes (parked blocks and alignment gaps are free).
    pub fn used_bytes(&self) -> u64 {
        self.used_units << self.unit_shift
    }

    /// Blocks handed out and not given back (a walk over the node table, for `validate`).
    pub fn live_count(&self) -> u64 {
        self.nodes
            .iter()
            .filter(|n| n.len > 0 && !n.is_free() && n.tag != PARKED)
            .count() as u64
    }

    /// Whether `key` names a block in use at `offset` of `bytes` bytes, made with `tag`:
    /// the engine checks its slab pages' records against it.
    pub(crate) fn holds(&self, key: u32, offset: u64, bytes: u64, tag: u32) -> bool {
        self.nodes.get(key as usize).is_some_and(|n| {
            n.tag == tag
                && tag != 0
                && tag != PARKED
                && n.len > 0
                && n.start() << self.unit_shift == offset
                && n.len() << self.unit_shift == bytes
        })
    }

    /// Test helper: [`free`](Self::free) with the length of the block `key` names, for
    /// tests of anything but the length check.
    #[cfg(test)]
    fn free_held(&mut self, key: u32, offset: u64, tag: u32) -> Result<(), EngineError> {
        let size = self
            .nodes
            .get(key as usize)
            .map_or(0, |n| n.len() << self.unit_shift);
        self.free(key, offset, size, tag)
    }

    fn parked_contains(&self, idx: u32, len: u64) -> bool {
        let list = &self.parked[park_slot(len)];
        u64::from(list.len) == len && self.list_holds(list.head, idx)
    }

    /// The node the back links from `last` lead to; `validate` walks corrupt links with
    /// it, so an index past the table ends the walk (the tiling then reports it).
    fn first_node(&self) -> u32 {
        let mut i = self.last;
        let mut steps = 0;
        while let Some(n) = self.nodes.get(i as usize) {
            if n.prev_phys == NIL || steps > self.nodes.len() {
                break;
            }
            i = n.prev_phys;
            steps += 1;
        }
        i
    }

    fn bin_contains(&self, fl: usize, sl: usize, idx: u32) -> bool {
        self.list_holds(self.heads[fl][sl], idx)
    }

    /// Whether the list from `head` holds `idx`, looking no further than the node table's
    /// length (a corrupt list may cycle).
    fn list_holds(&self, head: u32, idx: u32) -> bool {
        self.list_from(head)
            .take(self.nodes.len() + 1)
            .any(|i| i == idx)
    }

    /// A slot for `node`: the first vacant one, else a new one.
    #[inline]
    fn new_node(&mut self, node: Node) -> u32 {
        if self.vacant != NIL {
            let idx = self.vacant;
            self.vacant = self.nodes[idx as usize].next_phys;
            self.nodes[idx as usize] = node;
            idx
        } else {
            let idx = self.nodes.len() as u32;
            // Four billion nodes would take 160 GB of metadata: memory runs out first.
            debug_assert!(idx != NIL);
            self.nodes.push(node);
            idx
        }
    }

    /// Puts slot `idx` on the vacant chain.
    #[inline]
    fn drop_node(&mut self, idx: u32) {
        let n = &mut self.nodes[idx as usize];
        n.len = 0;
        n.tag = 0;
        n.next_phys = self.vacant;
        self.vacant = idx;
    }

    /// A free node to carve `len` aligned units from, if a bin has one.
    #[inline]
    fn find_free(&self, len: u64, align_units: u64) -> Option<u32> {
        // A few blocks of the request's own bin may fit: the lowest-addressed of them wins.
        let (fl, sl) = mapping_insert(len);
        let head = self.heads[fl][sl];
        if head != NIL {
            let best = self.lowest_fitting(head, len, align_units);
            if best.is_some() {
                return best;
            }
        }
        // Then the smallest bin that surely fits (worst-case slack to reach an aligned
        // start included), again preferring low addresses.
        let (mut fl, sl) = mapping_search(len + (align_units - 1));
        if fl >= FL_COUNT {
            return None;
        }
        let mut sl_map = self.sl_bitmap[fl] & (!0u32 << sl);
        if sl_map == 0 {
            let fl_map = self.fl_bitmap & (!0u64).checked_shl(fl as u32 + 1).unwrap_or(0);
            if fl_map == 0 {
                return None;
            }
            fl = fl_map.trailing_zeros() as usize;
            sl_map = self.sl_bitmap[fl];
        }
        let sl = sl_map.trailing_zeros() as usize;
        let best = self.lowest_fitting(self.heads[fl][sl], len, align_units);
        debug_assert!(best.is_some(), "a block of a searched bin always fits");
        best
    }

    /// The lowest-addressed free node that holds `len` units at an `align_units`-aligned
    /// start, among the blocks [`find_free`](Self::find_free) did not look at: past the
    /// probes of the request's own bin, and in the bins between it and the first bin whose
    /// every block surely fits (that bin and those above are empty, or `find_free` would
    /// have taken one; blocks of lower bins are all shorter than `len`). Only for a request
    /// the good-fit search and the wilderness refused; walking every bin from the request's
    /// own up cost 2% of a pool replay of random-mix, where chunks refuse often.
    #[cold]
    #[inline(never)]
    fn find_free_exhaustive(&self, len: u64, align_units: u64) -> Option<u32> {
        let own = mapping_insert(len);
        let sure = mapping_search(len + (align_units - 1));
        let mut best = NIL;
        let mut best_start = u64::MAX;
        let mut fl_map = self.fl_bitmap & (!0u64 << own.0);
        while fl_map != 0 {
            let fl = fl_map.trailing_zeros() as usize;
            fl_map &= fl_map - 1;
            if fl > sure.0 {
                break;
            }
            let mut sl_map = self.sl_bitmap[fl];
            if fl == own.0 {
                sl_map &= !0u32 << own.1;
            }
            if fl == sure.0 {
                sl_map &= (1u32 << sure.1) - 1;
            }
            while sl_map != 0 {
                let sl = sl_map.trailing_zeros() as usize;
                sl_map &= sl_map - 1;
                // The probes saw the head of the request's own bin, and none fitted.
                let seen = if (fl, sl) == own { BIN_PROBES } else { 0 };
                for i in self.list_from(self.heads[fl][sl]).skip(seen) {
                    let n = &self.nodes[i as usize];
                    let start = align_units_up(n.start(), align_units);
                    if start + len <= n.end() && n.start() < best_start {
                        best = i;
                        best_start = n.start();
                    }
                }
            }
        }
        (best != NIL).then_some(best)
    }

    /// The lowest-addressed block that fits among the first few of a bin's list.
    #[inline]
    fn lowest_fitting(&self, head: u32, len: u64, align_units: u64) -> Option<u32> {
        let mut best = NIL;
        let mut best_start = u64::MAX;
        let mut i = head;
        let mut probes = 0;
        while i != NIL && probes < BIN_PROBES {
            let n = &self.nodes[i as usize];
            let start = align_units_up(n.start(), align_units);
            if start + len <= n.end() && n.start() < best_start {
                best = i;
                best_start = n.start();
            }
            i = n.next_free;
            probes += 1;
        }
        (best != NIL).then_some(best)
    }

    /// Takes `len` aligned units out of free node `idx`; returns the used node and its start.
    #[inline]
    fn carve(&mut self, idx: u32, len: u64, align_units: u64, tag: u32) -> (u32, u64) {
        self.unlink(idx);
        let n = self.nodes[idx as usize];
        let start = align_units_up(n.start(), align_units);
        let n_end = n.end();
        debug_assert!(start + len <= n_end, "find_free returned a fitting block");
        let mut used = idx;
        if start > n.start() {
            // Leading alignment gap stays free in `idx`; the allocation gets a new node.
            self.nodes[idx as usize].len = (start - n.start()) as u32;
            used = self.split_after(idx, start, n_end - start);
            self.link(idx);
        }
        let end = start + len;
        if end < n_end {
            self.nodes[used as usize].len = len as u32;
            let rest = self.split_after(used, end, n_end - end);
            self.link(rest);
        }
        self.nodes[used as usize].tag = tag;
        (used, start)
    }

    /// Extends `[0, top)` with a used node for an aligned `len` (and a free node for the
    /// alignment gap, if any), if capacity allows.
    #[inline]
    fn carve_wilderness(&mut self, len: u64, align_units: u64, tag: u32) -> Option<(u32, u64)> {
        let start = align_units_up(self.top, align_units);
        let end = start.checked_add(len)?;
        if end > self.capacity {
            return None;
        }
        if start > self.top {
            let gap = self.push_top(self.top, start - self.top, 0);
            self.link(gap);
        }
        let used = self.push_top(start, len, tag);
        self.top = end;
        self.high_water = self.high_water.max(end);
        Some((used, start))
    }

    /// Appends a node `[start, start + len)` after the last one.
    #[inline]
    fn push_top(&mut self, start: u64, len: u64, tag: u32) -> u32 {
        // Nodes lie below `capacity`, which fits 32 bits.
        let node = self.new_node(Node {
            start: start as u32,
            len: len as u32,
            prev_phys: self.last,
            next_phys: NIL,
            prev_free: NIL,
            next_free: NIL,
            tag,
        });
        if self.last != NIL {
            self.nodes[self.last as usize].next_phys = node;
        }
        self.last = node;
        node
    }

    /// Inserts a free node `[start, start+len)` right after `idx` in address order.
    #[inline]
    fn split_after(&mut self, idx: u32, start: u64, len: u64) -> u32 {
        let next = self.nodes[idx as usize].next_phys;
        let new = self.new_node(Node {
            start: start as u32,
            len: len as u32,
            prev_phys: idx,
            next_phys: next,
            prev_free: NIL,
            next_free: NIL,
            tag: 0,
        });
        self.nodes[idx as usize].next_phys = new;
        if next != NIL {
            self.nodes[next as usize].prev_phys = new;
        } else {
            self.last = new;
        }
        new
    }

    #[inline(always)]
    fn release(&mut self, idx: u32) {
        let n = &mut self.nodes[idx as usize];
        n.tag = 0;
        let (prev, next) = (n.prev_phys, n.next_phys);
        // Merge with the free neighbour above.
        if next != NIL && self.nodes[next as usize].is_free() {
            self.unlink(next);
            self.absorb_next(idx);
        }
        // Merge into the free neighbour below.
        let mut idx = idx;
        if prev != NIL && self.nodes[prev as usize].is_free() {
            self.unlink(prev);
            self.absorb_next(prev);
            idx = prev;
        }
        let n = &self.nodes[idx as usize];
        if n.next_phys == NIL {
            // Touches the wilderness: fold it back in.
            self.top = n.start();
            self.last = n.prev_phys;
            if self.last != NIL {
                self.nodes[self.last as usize].next_phys = NIL;
            }
            self.drop_node(idx);
        } else {
            self.link(idx);
        }
    }

    /// Node `idx` swallows its physical successor.
    #[inline]
    fn absorb_next(&mut self, idx: u32) {
        let next = self.nodes[idx as usize].next_phys;
        let gone = self.nodes[next as usize];
        self.drop_node(next);
        let n = &mut self.nodes[idx as usize];
        n.len += gone.len;
        n.next_phys = gone.next_phys;
        if gone.next_phys != NIL {
            self.nodes[gone.next_phys as usize].prev_phys = idx;
        } else {
            self.last = idx;
        }
    }

    #[inline]
    fn link(&mut self, idx: u32) {
        let len = self.nodes[idx as usize].len();
        let (fl, sl) = mapping_insert(len);
        let head = self.heads[fl][sl];
        {
            let n = &mut self.nodes[idx as usize];
            n.prev_free = NIL;
            n.next_free = head;
        }
        // The sink takes the write when the bin was empty.
        self.nodes[or_sink(head) as usize].prev_free = idx;
        self.heads[fl][sl] = idx;
        self.sl_bitmap[fl] |= 1 << sl;
        self.fl_bitmap |= 1 << fl;
    }

    #[inline]
    fn unlink(&mut self, idx: u32) {
        let n = &self.nodes[idx as usize];
        let (prev, next, len) = (n.prev_free, n.next_free, n.len());
        let (fl, sl) = mapping_insert(len);
        // No branch on where `idx` sits in its list: the sink takes the missing
        // neighbour's write, and the head moves only if it was `idx`.
        self.nodes[or_sink(prev) as usize].next_free = next;
        self.nodes[or_sink(next) as usize].prev_free = prev;
        let head = &mut self.heads[fl][sl];
        *head = if prev == NIL { next } else { *head };
        let empty = u32::from(*head == NIL);
        self.sl_bitmap[fl] &= !(empty << sl);
        let fl_empty = u64::from(self.sl_bitmap[fl] == 0);
        self.fl_bitmap &= !(fl_empty << fl);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU32, Ordering};

    /// `alloc` with a fresh tag, returned with the offset and key.
    fn alloc(t: &mut TlsfRange, size: u64, align: u64) -> Option<(u64, u32, u32)> {
        static NEXT: AtomicU32 = AtomicU32::new(1);
        let tag = NEXT.fetch_add(1, Ordering::Relaxed);
        t.alloc(size, align, tag).map(|(o, k)| (o, k, tag))
    }

    /// Arguments `alloc` does not take are refused in release builds too, and leave the
    /// range as it was: a bad tag used to mark a live node parked (or free), a size off the
    /// unit took a parked block shorter than asked, and a shrink past the free tail wrapped
    /// the capacity.
    #[test]
    fn bad_arguments_change_nothing() {
        let mut t = TlsfRange::new(1 << 20, 64).unwrap();
        let (o, k, tag) = alloc(&mut t, 64, 64).unwrap();
        t.free_held(k, o, tag).unwrap(); // parked at one unit
        for (size, align, tag) in [
            (64, 64, 0),
            (64, 64, PARKED),
            (0, 64, 7),
            (65, 64, 7),
            (100, 64, 7),
            (64, 96, 7),
            (64, 0, 7),
        ] {
            assert_eq!(t.alloc(size, align, tag), None, "{size} {align} {tag}");
            assert_eq!(
                t.alloc_parked(size, align, tag),
                None,
                "{size} {align} {tag}"
            );
            t.validate().unwrap();
        }
        // The parked block is still there for a good request.
        assert_eq!(t.alloc_parked(64, 64, 7).map(|(o, _)| o), Some(o));
        let before = t.capacity();
        t.unpark_all();
        t.shrink(u64::MAX - 63);
        assert_eq!(t.capacity(), 1 << 6, "only the free tail is cut");
        t.validate().unwrap();
        // A part unit is not cut.
        t.shrink(1);
        assert_eq!(t.capacity(), 1 << 6);
        assert!(before >= t.capacity());
    }

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
        let (a, ka, ta) = alloc(&mut t, 128, 64).unwrap();
        let (b, kb, tb) = alloc(&mut t, 64, 64).unwrap();
        let (c, kc, tc) = alloc(&mut t, 4096, 64).unwrap();
        assert_eq!((a, b, c), (0, 128, 192));
        t.validate().unwrap();
        assert!(!t.is_empty());
        t.free_held(kb, b, tb).unwrap();
        t.validate().unwrap();
        // The hole is reused before the wilderness.
        let (d, kd, td) = alloc(&mut t, 64, 64).unwrap();
        assert_eq!(d, 128);
        t.free_held(ka, a, ta).unwrap();
        t.free_held(kd, d, td).unwrap();
        t.free_held(kc, c, tc).unwrap();
        t.validate().unwrap();
        assert!(t.is_empty());
        assert_eq!(t.high_water(), 192 + 4096);
    }

    #[test]
    fn validate_catches_a_drifted_used_count_and_a_free_node_out_of_its_bin() {
        let (mut t, [(a, ka, _), _, _]) = two_parked_under_one_used();
        assert_eq!(t.used_bytes(), 64);
        t.used_units += 1;
        assert!(matches!(t.validate(), Err(EngineError::Corrupt(_))));
        t.used_units -= 1;
        t.unpark_all();
        t.validate().unwrap();
        assert_eq!(t.stats().free_bytes, (1 << 20) - 64);
        // `a` and `b` merged into one free node, `a`'s; take it out of its bin by hand.
        let free = ka;
        let n = t.nodes[free as usize];
        assert!(n.is_free() && n.start() << 6 == a && n.len() << 6 == 8192);
        t.unlink(free);
        assert!(matches!(t.validate(), Err(EngineError::Corrupt(_))));
        t.link(free);
        t.validate().unwrap();
    }

    #[test]
    fn the_sink_slot_is_no_handle_and_bins_empty_and_refill_through_it() {
        let mut t = TlsfRange::new(1 << 20, 64).unwrap();
        // Slot 0 is the sink: as a key it names nothing, whatever the offset and tag.
        for tag in [0, 1, 7, PARKED] {
            assert!(matches!(
                t.free_held(SINK, 0, tag),
                Err(EngineError::AlreadyFreed { .. })
            ));
        }
        // One block between used ones: its bin goes from empty to one entry and back, with
        // every link and bitmap update running through the sink. Then three in one bin (none
        // adjacent, so none merge): a bin lists its newest first and the lowest address is
        // taken, so freeing 3, 1, 5 takes them out from the middle, the tail, then alone,
        // and freeing 5, 3, 1 from the head twice, then alone.
        let mut a: Vec<_> = (0..7).map(|_| alloc(&mut t, 4096, 64).unwrap()).collect();
        t.free_held(a[1].1, a[1].0, a[1].2).unwrap();
        t.unpark_all();
        t.validate().unwrap();
        a[1] = alloc(&mut t, 4096, 64).unwrap();
        assert_eq!(a[1].0, 4096);
        t.validate().unwrap();
        for order in [[3, 1, 5], [5, 3, 1]] {
            for i in order {
                t.free_held(a[i].1, a[i].0, a[i].2).unwrap();
            }
            t.unpark_all();
            t.validate().unwrap();
            for i in [1, 3, 5] {
                a[i] = alloc(&mut t, 4096, 64).unwrap();
                assert_eq!(a[i].0, i as u64 * 4096, "lowest address first");
                t.validate().unwrap();
            }
            assert_eq!(t.fl_bitmap, 0, "every bin is empty again");
        }
        let sink = t.nodes[SINK as usize];
        assert!(sink.len == 0 && sink.tag == 0);
    }

    #[test]
    fn honours_alignment_and_capacity() {
        let mut t = TlsfRange::new(1 << 16, 64).unwrap();
        let (_, _, _) = alloc(&mut t, 64, 64).unwrap();
        let (b, kb, tb) = alloc(&mut t, 256, 4096).unwrap();
        assert_eq!(b % 4096, 0);
        t.validate().unwrap();
        assert!(alloc(&mut t, 1 << 16, 64).is_none());
        t.free_held(kb, b, tb).unwrap();
        assert!(t.free_held(kb, b, tb).is_err());
        t.validate().unwrap();
    }

    #[test]
    fn a_free_of_another_length_is_refused() {
        // Once tags wrap, a stale handle may name a block of another length with its tag.
        let mut t = TlsfRange::new(1 << 16, 64).unwrap();
        let (a, ka, ta) = alloc(&mut t, 256, 64).unwrap();
        for size in [0, 64, 192, 320, 1 << 20] {
            assert_eq!(
                t.free(ka, a, size, ta),
                Err(EngineError::AlreadyFreed { offset: a }),
                "{size}"
            );
        }
        assert_eq!(t.used_bytes(), 256);
        t.free(ka, a, 256, ta).unwrap();
        t.validate().unwrap();
        assert!(t.is_empty());
    }

    /// A 1 MiB range with two 4 KiB blocks parked (`b` first, then `a`) under a used 64-byte
    /// block `c`; returns `a`, `b` and `c`.
    fn two_parked_under_one_used() -> (TlsfRange, [(u64, u32, u32); 3]) {
        let mut t = TlsfRange::new(1 << 20, 64).unwrap();
        let a = alloc(&mut t, 4096, 64).unwrap();
        let b = alloc(&mut t, 4096, 64).unwrap();
        let c = alloc(&mut t, 64, 64).unwrap();
        t.free_held(b.1, b.0, b.2).unwrap();
        t.free_held(a.1, a.0, a.2).unwrap();
        t.validate().unwrap();
        (t, [a, b, c])
    }

    #[test]
    fn parked_blocks_are_reused_exactly_and_merged_before_other_requests() {
        let (mut t, [(a, ka, ta), (b, kb, tb), (c, kc, tc)]) = two_parked_under_one_used();
        // Both are parked, unmerged: free space, but not in use, and one free range.
        assert_eq!(t.used_bytes(), 64);
        assert_eq!(t.stats().free_fragments, 2);
        // A stale or repeated free of a parked block is refused.
        assert!(t.free_held(kb, b, tb).is_err());
        assert!(t.free_held(ka, a, PARKED).is_err());
        // The same length comes back at once, last freed first, with a fresh tag.
        let (d, kd, td) = alloc(&mut t, 4096, 64).unwrap();
        assert_eq!((d, kd), (a, ka));
        assert!(t.free_held(ka, a, ta).is_err());
        t.validate().unwrap();
        // An exact block that is not aligned enough (`b`, at 4096) is not taken.
        let (e, ke, te) = alloc(&mut t, 4096, 8192).unwrap();
        assert_eq!(e, 16384);
        // That request merged what was parked: `b` is in a bin and serves the next one.
        let (f, kf, tf) = alloc(&mut t, 128, 64).unwrap();
        assert_eq!(f, b);
        t.validate().unwrap();
        for (o, k, tag) in [(c, kc, tc), (d, kd, td), (e, ke, te), (f, kf, tf)] {
            t.free_held(k, o, tag).unwrap();
        }
        assert!(t.used_bytes() == 0 && t.is_empty());
        t.unpark_all();
        t.validate().unwrap();
        assert_eq!(t.stats().top, 0);
        assert_eq!(t.free_tail(), 1 << 20);
    }

    #[test]
    fn top_is_the_end_of_the_highest_block_in_use_with_the_one_above_parked() {
        // `b` is freed last and parked at the top: the stats counted it free (one run with
        // the wilderness) and in use (`top` at its end) at once.
        let mut t = TlsfRange::new(1 << 20, 64).unwrap();
        let (a, _, _) = alloc(&mut t, 4096, 64).unwrap();
        let (b, kb, tb) = alloc(&mut t, 8192, 64).unwrap();
        t.free_held(kb, b, tb).unwrap();
        assert!(t.parked_slots != 0, "the block stays parked");
        let st = t.stats();
        assert_eq!(st.top, a + 4096);
        assert_eq!((st.free_fragments, st.largest_free), (1, (1 << 20) - 4096));
        assert_eq!(st.largest_free, st.capacity - st.top);
        // The free tail the user sees reaches down to `a`; the wilderness, what a shrink may
        // cut, starts above `b` until a merge.
        assert_eq!(t.free_tail_merged(), st.capacity - st.top);
        assert_eq!(t.free_tail(), st.capacity - b - 8192);
        // Merged, it says the same.
        t.unpark_all();
        assert_eq!(t.stats(), st);
        assert_eq!(t.free_tail(), t.free_tail_merged());
        t.validate().unwrap();
    }

    #[test]
    fn blocks_of_different_lengths_park_side_by_side() {
        // 4096 and 8192 bytes are 64 and 128 units: two slots of the table.
        assert_ne!(park_slot(64), park_slot(128));
        let mut t = TlsfRange::new(1 << 20, 64).unwrap();
        let (a, ka, ta) = alloc(&mut t, 4096, 64).unwrap();
        let s1 = alloc(&mut t, 64, 64).unwrap();
        let (b, kb, tb) = alloc(&mut t, 8192, 64).unwrap();
        let s2 = alloc(&mut t, 64, 64).unwrap();
        t.free_held(ka, a, ta).unwrap();
        t.free_held(kb, b, tb).unwrap();
        // Each waits in its own slot: the second free did not push the first into a bin.
        assert!(t.parked_contains(ka, 64) && t.parked_contains(kb, 128));
        assert_eq!(t.parked_slots.count_ones(), 2);
        t.validate().unwrap();
        // Either length comes back without a search, which would have merged the other.
        let (c, kc, tc) = alloc(&mut t, 8192, 64).unwrap();
        assert_eq!((c, kc), (b, kb));
        assert!(t.parked_contains(ka, 64));
        for (o, k, tag) in [(c, kc, tc), s1, s2] {
            t.free_held(k, o, tag).unwrap();
        }
        t.unpark_all();
        t.validate().unwrap();
        assert!(t.is_empty());
    }

    /// Five 4 KiB blocks, the second and fourth freed: two free nodes in one bin, apart
    /// (they cannot merge), used nodes around them. Returns the range and the five blocks.
    fn two_free_nodes_in_one_bin() -> (TlsfRange, Vec<(u64, u32, u32)>) {
        let mut t = TlsfRange::new(1 << 20, 64).unwrap();
        let a: Vec<_> = (0..5).map(|_| alloc(&mut t, 4096, 64).unwrap()).collect();
        for i in [1, 3] {
            t.free_held(a[i].1, a[i].0, a[i].2).unwrap();
        }
        t.unpark_all();
        t.validate().unwrap();
        (t, a)
    }

    #[test]
    fn validate_reports_links_past_the_node_table_without_panicking() {
        let build = || two_free_nodes_in_one_bin().0;
        let drifts: [crate::engine::Drift<TlsfRange>; 4] = [
            ("the last node past the table", |t| {
                t.last = t.nodes.len() as u32 + 3
            }),
            ("a back link past the table", |t| {
                let last = t.last as usize;
                t.nodes[last].prev_phys = t.nodes.len() as u32;
            }),
            // Every free node is still found in its bin: only the walk of the bin sees it.
            ("a bin's tail linked past the table", |t| {
                let (fl, sl) = mapping_insert(4096 >> 6);
                let second = t.nodes[t.heads[fl][sl] as usize].next_free;
                t.nodes[second as usize].next_free = t.nodes.len() as u32;
            }),
            ("an empty bin's head past the table", |t| {
                let (fl, sl) = mapping_insert(7);
                t.heads[fl][sl] = t.nodes.len() as u32 + 9;
                t.sl_bitmap[fl] |= 1 << sl;
                t.fl_bitmap |= 1 << fl;
            }),
        ];
        crate::engine::assert_each_drift_reported(build, &drifts, TlsfRange::validate);
    }

    #[test]
    fn validate_reports_a_bin_list_that_leaves_the_node_table() {
        let (mut t, a) = two_free_nodes_in_one_bin();
        let (fl, sl) = mapping_insert(4096 >> 6);
        let head = t.heads[fl][sl];
        let second = t.nodes[head as usize].next_free;
        assert!([a[1].1, a[3].1].contains(&second) && second != head);
        // The head's link points past the table (just past, and further): the second block is
        // unreachable from its bin.
        for past in [0, 7] {
            t.nodes[head as usize].next_free = t.nodes.len() as u32 + past;
            assert!(matches!(t.validate(), Err(EngineError::Corrupt(_))));
        }
        t.nodes[head as usize].next_free = second;
        t.validate().unwrap();
    }

    #[test]
    fn validate_catches_a_parked_list_that_drops_or_mislabels_a_block() {
        let (mut t, [(_, ka, _), (_, kb, _), _]) = two_parked_under_one_used();
        let slot = park_slot(4096 >> 6);
        assert_eq!(t.parked[slot].head, ka);
        assert_eq!(t.nodes[ka as usize].next_free, kb);
        // Two parked blocks side by side are one free range, and the tail another.
        assert_eq!(t.stats().free_fragments, 2);
        // `b` cut off the list: still tagged parked, no longer listed.
        t.nodes[ka as usize].next_free = NIL;
        assert!(matches!(t.validate(), Err(EngineError::Corrupt(_))));
        t.nodes[ka as usize].next_free = kb;
        t.validate().unwrap();
        // The list says another length than its blocks have.
        t.parked[slot].len += 1;
        assert!(matches!(t.validate(), Err(EngineError::Corrupt(_))));
        t.parked[slot].len -= 1;
        // An emptied list whose bit stays set.
        let head = t.parked[slot].head;
        t.parked[slot].head = NIL;
        assert!(matches!(t.validate(), Err(EngineError::Corrupt(_))));
        t.parked[slot].head = head;
        t.validate().unwrap();
    }

    #[test]
    fn parking_never_raises_the_high_water_mark() {
        // Blocks of one length are parked; a request of another length that fits only
        // once they merge must not go to the wilderness.
        let mut t = TlsfRange::new(1 << 20, 64).unwrap();
        let blocks: Vec<_> = (0..4).map(|_| alloc(&mut t, 1024, 64).unwrap()).collect();
        let (g, kg, tg) = alloc(&mut t, 64, 64).unwrap();
        for &(o, k, tag) in &blocks {
            t.free_held(k, o, tag).unwrap();
        }
        let high = t.high_water();
        let (h, _, _) = alloc(&mut t, 4096, 64).unwrap();
        assert_eq!(h, 0);
        assert_eq!(t.high_water(), high);
        t.free_held(kg, g, tg).unwrap();
        t.validate().unwrap();
    }

    #[test]
    fn capacity_stays_within_32_bit_units() {
        // 2^32 units of 64 bytes is one unit too many; one less is the largest range.
        let max = u64::from(u32::MAX) * 64;
        assert!(matches!(
            TlsfRange::new(max + 64, 64),
            Err(EngineError::CapacityTooLarge { max: m, .. }) if m == max
        ));
        let mut t = TlsfRange::new(max - 64, 64).unwrap();
        assert_eq!(
            t.grow(128),
            Err(EngineError::CapacityTooLarge {
                capacity: max + 64,
                max
            })
        );
        assert_eq!(t.capacity(), max - 64, "a refused growth changes nothing");
        t.grow(64).unwrap();
        // A request past the range is refused, not truncated to 32 bits.
        assert!(alloc(&mut t, max + 64, 64).is_none());
        assert!(alloc(&mut t, (1u64 << 38) + 64, 64).is_none());
        let (a, ka, ta) = alloc(&mut t, max - 128, 64).unwrap();
        let (b, kb, tb) = alloc(&mut t, 128, 64).unwrap();
        assert_eq!((a, b), (0, max - 128));
        assert!(alloc(&mut t, 64, 64).is_none());
        t.validate().unwrap();
        t.free_held(kb, b, tb).unwrap();
        t.free_held(ka, a, ta).unwrap();
        t.unpark_all();
        assert!(t.is_empty());
        assert_eq!(t.free_tail(), max);
        t.validate().unwrap();
    }

    #[test]
    fn stats_count_each_free_fragment() {
        // 64 B | free 64 B | 64 B | free 8 KiB | 64 B | wilderness: the two holes bin in
        // different first levels.
        let mut t = TlsfRange::new(1 << 20, 64).unwrap();
        let held: Vec<_> = [64, 64, 64, 8192, 64]
            .map(|size| alloc(&mut t, size, 64).unwrap())
            .into();
        for &(o, k, tag) in [&held[1], &held[3]] {
            t.free_held(k, o, tag).unwrap();
        }
        let parked = t.stats();
        t.unpark_all();
        let binned = t.stats();
        assert_eq!(parked, binned, "parked and binned holes count alike");
        assert_eq!(binned.free_fragments, 3);
        assert_eq!(binned.free_bytes, (1 << 20) - 3 * 64);
        // With the wilderness taken, only the two holes are left.
        let tail = t.free_tail();
        assert_eq!(tail, (1 << 20) - 8192 - 4 * 64);
        alloc(&mut t, tail, 64).unwrap();
        let full = t.stats();
        assert_eq!((full.free_fragments, full.largest_free), (2, 8192));
        t.validate().unwrap();
    }

    #[test]
    fn an_emptied_range_is_one_free_range_whatever_is_parked() {
        // Ten blocks of a few lengths, freed in several orders without a search between:
        // most stay parked, side by side. As the user sees it the range is one free range
        // (the stats counted each parked block: 11 fragments).
        let sizes = [4096, 4096, 8192, 64, 4096, 1 << 16, 8192, 64, 4096, 3 << 20];
        let orders: [&[usize]; 4] = [
            &[0, 1, 2, 3, 4, 5, 6, 7, 8, 9],
            &[9, 8, 7, 6, 5, 4, 3, 2, 1, 0],
            &[1, 3, 5, 7, 9, 0, 2, 4, 6, 8],
            &[4, 0, 8, 2, 6, 9, 5, 1, 7, 3],
        ];
        for order in orders {
            let mut t = TlsfRange::new(8 << 20, 64).unwrap();
            let blocks: Vec<_> = sizes
                .iter()
                .map(|&s| alloc(&mut t, s, 64).unwrap())
                .collect();
            for &i in order {
                let (o, k, tag) = blocks[i];
                t.free_held(k, o, tag).unwrap();
                // Every free range is counted once and none is longer than the free bytes.
                let st = t.stats();
                assert!(st.largest_free <= st.free_bytes, "{order:?}");
            }
            assert!(t.parked_slots != 0, "{order:?}: some blocks stay parked");
            t.validate().unwrap();
            let st = t.stats();
            assert_eq!(
                (st.free_fragments, st.largest_free, st.free_bytes),
                (1, 8 << 20, 8 << 20),
                "{order:?}"
            );
            // Merging changes nothing the figures say: nothing is in use, parked or not.
            assert_eq!(st.top, 0, "{order:?}");
            t.unpark_all();
            assert_eq!(st, t.stats(), "{order:?}");
        }
    }

    #[test]
    fn a_refused_request_still_merges_parked_blocks() {
        // Every search sees the free space merged, a hopeless one too: the pool asks each
        // chunk in turn, and where later requests land depends on that merge.
        let (mut t, _) = two_parked_under_one_used();
        assert_eq!(
            t.largest_free(),
            (1 << 20) - 8192 - 64,
            "the tail, parked apart"
        );
        assert!(alloc(&mut t, 2 << 20, 64).is_none());
        assert_eq!(t.stats().free_fragments, 2, "merged into one free block");
        assert_eq!(t.nodes[t.first_node() as usize].len() << 6, 8192);
        assert_eq!(t.largest_free(), (1 << 20) - 8192 - 64);
        t.validate().unwrap();
    }

    #[test]
    fn grow_extends_the_wilderness_and_shrink_cuts_it() {
        let mut t = TlsfRange::new(4096, 64).unwrap();
        let (a, ka, ta) = alloc(&mut t, 2048, 64).unwrap();
        let (b, kb, tb) = alloc(&mut t, 1024, 64).unwrap();
        t.free_held(kb, b, tb).unwrap();
        t.unpark_all();
        // The freed node folded into the wilderness: the tail is all of [2048, 4096).
        assert_eq!(t.free_tail(), 2048);
        assert!(alloc(&mut t, 4096, 64).is_none());
        assert!(t.grow(0).is_err() && t.grow(100).is_err() && t.grow(u64::MAX - 63).is_err());
        t.grow(4096).unwrap();
        assert_eq!(t.capacity(), 8192);
        let (c, kc, tc) = alloc(&mut t, 6144, 64).unwrap();
        assert_eq!(c, 2048, "the grown space continues the old free tail");
        t.validate().unwrap();
        assert_eq!(t.free_tail(), 0);
        t.free_held(kc, c, tc).unwrap();
        t.unpark_all();
        t.shrink(4096);
        assert_eq!((t.capacity(), t.free_tail()), (4096, 2048));
        t.validate().unwrap();
        assert!(alloc(&mut t, 4096, 64).is_none());
        t.free_held(ka, a, ta).unwrap();
        t.unpark_all();
        t.shrink(4096);
        assert_eq!(t.capacity(), 0);
        assert!(alloc(&mut t, 64, 64).is_none());
        t.validate().unwrap();
    }

    #[test]
    fn a_request_tries_its_own_bin_then_the_smallest_that_surely_fits() {
        // Units of 64 bytes; from 64 units up, a bin spans 2 units. Free: `z`, 101 units at
        // unit 1 (bin [100, 102)), and `y`, 200 units higher up.
        let build = || {
            let mut t = TlsfRange::new(1 << 20, 64).unwrap();
            let sizes = [1, 101, 1, 200, 1];
            let b: Vec<_> = sizes
                .iter()
                .map(|&u| alloc(&mut t, u * 64, 64).unwrap())
                .collect();
            for i in [1, 3] {
                t.free_held(b[i].1, b[i].0, b[i].2).unwrap();
            }
            t.unpark_all();
            t.validate().unwrap();
            t
        };
        // 101 units: its own bin holds `z`, which fits, though the search for a bin whose
        // every block fits would round up past it to `y`'s.
        let mut t = build();
        assert_eq!(alloc(&mut t, 101 * 64, 64).unwrap().0, 64);
        // 99 units at 128-byte starts: its own bin [98, 100) is empty; `z`'s bin holds
        // 99 units plus the worst slack of one unit, so it is searched before `y`'s.
        let mut t = build();
        assert_eq!(alloc(&mut t, 99 * 64, 128).unwrap().0, 128);
        t.validate().unwrap();
    }

    /// Bin [128, 132) units: eight free blocks of 128 units, probed first, and one of 131
    /// units ninth, each between held units so none merge; the blocks as allocated.
    fn nine_in_one_bin() -> (TlsfRange, Vec<(u64, u32, u32)>) {
        let mut t = TlsfRange::new(1 << 20, 64).unwrap();
        let mut free = Vec::new();
        for units in [131, 128, 128, 128, 128, 128, 128, 128, 128] {
            free.push(alloc(&mut t, units << 6, 64).unwrap());
            alloc(&mut t, 64, 64).unwrap();
        }
        for (o, k, tag) in free.iter().copied() {
            // Linked one at a time at the head: the 131-unit block ends up last.
            t.free_held(k, o, tag).unwrap();
            t.unpark_all();
        }
        (t, free)
    }

    #[test]
    fn a_bin_search_settles_after_eight_entries() {
        // A request for 130 units looks at eight entries of its own bin, then past it (the
        // wilderness here).
        let (mut t, free) = nine_in_one_bin();
        let (fl, sl) = mapping_insert(130);
        let order: Vec<u32> = t.list_from(t.heads[fl][sl]).collect();
        assert_eq!((order.len(), order[BIN_PROBES]), (9, free[0].1));
        let top = t.top << 6;
        let (got, _, _) = alloc(&mut t, 130 << 6, 64).unwrap();
        assert_eq!(got, top, "the ninth entry is not probed");
        t.validate().unwrap();
    }

    /// Whether some free node, or the wilderness, holds `len` units at an `align`-unit start.
    fn something_fits(t: &TlsfRange, len: u64, align: u64) -> bool {
        let fits = |start: u64, end: u64| align_units_up(start, align) + len <= end;
        fits(t.top, t.capacity)
            || t.nodes
                .iter()
                .filter(|n| n.len > 0 && (n.is_free() || n.tag == PARKED))
                .any(|n| fits(n.start(), n.end()))
    }

    #[test]
    fn a_block_past_the_probes_serves_a_request_before_it_is_refused() {
        // As in `a_bin_search_settles_after_eight_entries`, with the wilderness taken: the
        // 131-unit block, ninth in the request's own bin, is the only one that holds 130
        // units. The good-fit search skips it; refusing then broke the promise of
        // `OutOfSpace` (footprint 8320 refused with a free range of 8384).
        let (mut t, free) = nine_in_one_bin();
        let tail = t.free_tail();
        alloc(&mut t, tail, 64).unwrap();
        assert_eq!(t.largest_free(), 131 << 6);
        assert!(something_fits(&t, 130, 1));
        // The good-fit search alone passes over it (the pool's first look in each chunk).
        assert!(t.alloc_good_fit(130 << 6, 64, 99).is_none());
        t.validate().unwrap();
        let (got, k, tag) = alloc(&mut t, 130 << 6, 64).expect("the 131-unit block fits");
        assert_eq!(got, free[0].0);
        t.validate().unwrap();
        // Truly full now: a refusal.
        assert!(alloc(&mut t, 130 << 6, 64).is_none());
        assert!(!something_fits(&t, 130, 1));
        t.free_held(k, got, tag).unwrap();
        t.validate().unwrap();
    }

    #[test]
    fn a_block_whose_alignment_slack_fits_serves_a_request_before_it_is_refused() {
        // 100 units at 4 KiB (64-unit) starts: the search for a bin whose every block fits
        // rounds 100 + 63 units up to bin [164, 168). A free block of 150 units at unit 0
        // (bin [148, 152), between the two) holds it with no slack at all.
        let mut t = TlsfRange::new(1 << 20, 64).unwrap();
        let (a, ka, ta) = alloc(&mut t, 150 << 6, 64).unwrap();
        alloc(&mut t, 64, 64).unwrap();
        let tail = t.free_tail();
        alloc(&mut t, tail, 64).unwrap();
        t.free_held(ka, a, ta).unwrap();
        t.unpark_all();
        assert_eq!((a, t.free_tail()), (0, 0));
        let (got, _, _) = alloc(&mut t, 100 << 6, 4096).expect("the 150-unit block fits");
        assert_eq!(got, 0);
        t.validate().unwrap();
    }

    #[test]
    fn a_refusal_means_no_free_range_holds_the_request() {
        // A deterministic random mix of lengths and alignments in a small range: whenever
        // `alloc` refuses, no free node (merged: the refusal unparks) nor the wilderness
        // holds the request at its alignment.
        let mut t = TlsfRange::new(256 << 10, 64).unwrap();
        let mut live: Vec<(u64, u32, u32)> = Vec::new();
        let mut x = 0x2545_F491_4F6C_DD1Du64;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let mut refused = 0;
        for _ in 0..20_000 {
            let r = next();
            if r % 3 == 0 && !live.is_empty() {
                let (o, k, tag) = live.swap_remove((r >> 8) as usize % live.len());
                t.free_held(k, o, tag).unwrap();
            } else {
                let units = 1 + (r >> 8) % if r & 0x30 == 0 { 600 } else { 40 };
                let align = 1u64 << ((r >> 40) % 8);
                match alloc(&mut t, units << 6, align << 6) {
                    Some(b) => live.push(b),
                    None => {
                        refused += 1;
                        assert!(
                            !something_fits(&t, units, align),
                            "{units} units at {align}"
                        );
                    }
                }
            }
        }
        t.validate().unwrap();
        assert!(
            refused > 100,
            "the mix reaches the range's end ({refused} refusals)"
        );
    }

    #[test]
    fn validate_catches_each_kind_of_drift() {
        // Two free nodes in one bin, a vacant slot (from their merge), one block parked
        // alone and two parked in one list, all between used separators.
        let build = || {
            let mut t = TlsfRange::new(1 << 20, 64).unwrap();
            let sizes = [4096, 64, 8192, 64, 8192, 64, 2048, 2048, 64, 4096, 64];
            let blocks: Vec<_> = sizes
                .iter()
                .map(|&s| alloc(&mut t, s, 64).unwrap())
                .collect();
            for &i in &[6, 7, 9] {
                let (o, k, tag) = blocks[i];
                t.free_held(k, o, tag).unwrap();
            }
            t.unpark_all();
            for &i in &[0, 2, 4] {
                let (o, k, tag) = blocks[i];
                t.free_held(k, o, tag).unwrap();
            }
            t.validate().unwrap();
            assert_eq!(t.stats().free_fragments, 2 + 3 + 1);
            assert!(t.vacant != NIL);
            t
        };
        // The bin holding the two free nodes of 64 units, and the list of two parked ones.
        fn bin() -> (usize, usize) {
            mapping_insert(64)
        }
        fn pair() -> usize {
            park_slot(128)
        }
        fn used(t: &TlsfRange) -> u32 {
            let i = t
                .nodes
                .iter()
                .position(|n| n.len > 0 && n.tag != 0 && n.tag != PARKED);
            i.unwrap() as u32
        }
        let corruptions: [crate::engine::Drift<TlsfRange>; 18] = [
            ("a block in the sink slot", |t| {
                t.nodes[SINK as usize].len = 1
            }),
            ("the vacant chain into a used node", |t| {
                let i = used(t);
                t.nodes[t.vacant as usize].next_phys = i;
            }),
            ("the vacant chain into a free node", |t| {
                let (fl, sl) = bin();
                t.vacant = t.heads[fl][sl];
            }),
            ("a cycle in the vacant chain", |t| {
                let v = t.vacant;
                t.nodes[v as usize].next_phys = v;
            }),
            ("a cycle in a parked list", |t| {
                let head = t.parked[pair()].head;
                let second = t.nodes[head as usize].next_free;
                t.nodes[second as usize].next_free = head;
            }),
            ("a parked list in another slot", |t| {
                let slot = pair();
                let other = (slot + 1) % PARK_SLOTS;
                assert_eq!(t.parked[other].head, NIL, "pick a free slot");
                t.parked[other] = t.parked[slot];
                t.parked_slots |= 1 << other;
                t.parked[slot] = ParkedList::EMPTY;
                t.parked_slots &= !(1 << slot);
            }),
            ("a stale parked-slot bit", |t| t.parked_slots ^= 1 << pair()),
            ("a stale second-level bit", |t| {
                let (fl, sl) = bin();
                t.sl_bitmap[fl] ^= 1 << (sl + 1);
            }),
            ("a stale first-level bit", TlsfRange::drift_for_test),
            ("a wrong back link in a bin", |t| {
                let (fl, sl) = bin();
                let second = t.nodes[t.heads[fl][sl] as usize].next_free;
                t.nodes[second as usize].prev_free = NIL;
            }),
            ("the high-water mark below the top", |t| {
                t.high_water = t.top - 1
            }),
            ("the top past the capacity", |t| t.capacity = t.top - 1),
            ("a node's start off the tiling", |t| {
                let i = used(t);
                t.nodes[i as usize].start += 1
            }),
            ("the last node misnamed", |t| t.last = used(t)),
            ("a back link that skips a node", |t| {
                let below = t.nodes[t.last as usize].prev_phys;
                t.nodes[t.last as usize].prev_phys = t.nodes[below as usize].prev_phys;
            }),
            ("a used node in a bin", |t| t.link(used(t))),
            ("a capacity past 32-bit units", |t| {
                t.capacity = MAX_UNITS + 1
            }),
            // Validate's own sum used to overflow (a panic) on a wrapped count.
            ("a used count wrapped below 0", |t| {
                t.used_units = t.used_units.wrapping_sub(t.used_units + 1)
            }),
        ];
        crate::engine::assert_each_drift_reported(build, &corruptions, TlsfRange::validate);
    }

    #[test]
    fn a_parked_block_is_taken_only_at_the_alignment_asked() {
        // A block of 64 units parked at unit 1: a request of its length at 4096 bytes
        // (64 units) must not take it, by `alloc` nor by `alloc_parked`.
        let mut t = TlsfRange::new(1 << 20, 64).unwrap();
        let _below = alloc(&mut t, 64, 64).unwrap();
        let (o, k, tag) = alloc(&mut t, 4096, 64).unwrap();
        let _above = alloc(&mut t, 64, 64).unwrap();
        assert_eq!(o, 64);
        t.free_held(k, o, tag).unwrap();
        assert_eq!(t.alloc_parked(4096, 4096, 7), None);
        t.validate().unwrap();
        let (at, _, _) = alloc(&mut t, 4096, 4096).unwrap();
        assert_eq!(at % 4096, 0);
        t.validate().unwrap();
        // At the alignment it has, the parked block serves.
        let (o2, k2, tag2) = alloc(&mut t, 4096, 64).unwrap();
        assert_eq!(o2, 64);
        t.free_held(k2, o2, tag2).unwrap();
        assert_eq!(t.alloc_parked(4096, 64, 7).map(|(o, _)| o), Some(64));
        t.validate().unwrap();
    }

    #[test]
    fn the_largest_range_is_taken_whole() {
        // 2^32 - 1 units is the largest, not one past it: taken by `new`, not only by `grow`.
        let max = u64::from(u32::MAX) * 64;
        let mut t = TlsfRange::new(max, 64).unwrap();
        assert_eq!((t.capacity(), t.free_tail()), (max, max));
        let (a, k, tag) = alloc(&mut t, max, 64).unwrap();
        assert_eq!(a, 0);
        t.free(k, a, max, tag).unwrap();
        t.validate().unwrap();
    }
}
