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
//! All metadata is out of band: runs are hashed by start and by end, and indexed by top
//! order in a [`StartSet`] per order (a 64-ary trie of bitmaps, made on first use, whose
//! membership, insertion, removal and lowest member each take one walk of at most 11
//! levels, 5 for 64-byte blocks in 64 GiB). The lowest run of every order is cached, so
//! an allocation compares at most 63 numbers to find its block. Live allocations are
//! hashed by offset.

use super::{EngineError, RangeStats, NIL};
use std::collections::hash_map::{Entry, HashMap};
use std::hash::{BuildHasherDefault, Hasher};

/// Largest order (log2 bytes) a range may have.
const MAX_ORDER: u32 = 62;
/// Orders `0..=MAX_ORDER`.
const ORDERS: usize = MAX_ORDER as usize + 1;
/// Bits of an index each trie level resolves (64 children per node).
const DIGIT_BITS: u32 = 6;
/// Children per trie node, allocated together as one group.
const FANOUT: usize = 1 << DIGIT_BITS;
/// Most levels a trie needs: 11 digits of 6 bits cover any 64-bit index.
const MAX_HEIGHT: usize = 64usize.div_ceil(DIGIT_BITS as usize);

/// The trie digit of index `i` at `level` (0 = the leaves).
#[inline(always)]
fn digit(i: u64, level: u32) -> u64 {
    (i >> (DIGIT_BITS * level)) & (FANOUT as u64 - 1)
}

/// A node of a [`StartSet`] above the leaves.
#[derive(Debug, Clone, Copy)]
struct Inner {
    /// Bit `d` set iff child `d` holds a member (its bits are non-zero).
    bits: u64,
    /// The group of this node's 64 children: nodes `64 * children ..` of the level below
    /// (`StartSet::leaves` for a node just above the leaves, `StartSet::inner` otherwise);
    /// [`NIL`] until a member is first inserted below.
    children: u32,
}

const EMPTY_INNER: Inner = Inner {
    bits: 0,
    children: NIL,
};

/// A set of indices (run starts, in minimum blocks): a 64-ary trie of bitmaps whose nodes
/// are made on first use and kept (emptied, never freed) afterwards.
///
/// Invariants (checked by [`StartSet::check`]):
/// - nodes come in groups of 64 siblings; the root is the first of its group and the other
///   63 are empty, so a new root can adopt the old one's group as its children;
/// - every node is reachable from the root, exactly once;
/// - bit `d` of an inner node is set iff it has children and child `d`'s bits are non-zero,
///   so a subtree under a clear bit is empty all the way down;
/// - `len` is the number of set leaf bits, and every member is below `64^height`.
#[derive(Debug, Clone, Default)]
struct StartSet {
    /// Levels of the trie, leaves included; 0 until the first insertion.
    height: u32,
    /// Index of the root: in `leaves` when `height == 1`, in `inner` above that.
    root: u32,
    /// Nodes above the leaves, of every level.
    inner: Vec<Inner>,
    /// Leaf `n`, bit `b`: the member whose index ends in digit `b` under leaf `n`'s path.
    leaves: Vec<u64>,
    /// Number of members.
    len: u64,
}

impl StartSet {
    /// Whether index `i` is inside the trie's current span (`64^height` indices).
    #[inline(always)]
    fn covers(&self, i: u64) -> bool {
        self.height != 0 && i.checked_shr(DIGIT_BITS * self.height).unwrap_or(0) == 0
    }

    /// Appends an empty group of 64 nodes to the leaves or the inner nodes; returns its number.
    fn new_group(&mut self, leaves: bool) -> u32 {
        let nodes = if leaves {
            self.leaves.resize(self.leaves.len() + FANOUT, 0);
            self.leaves.len()
        } else {
            self.inner.resize(self.inner.len() + FANOUT, EMPTY_INNER);
            self.inner.len()
        };
        // A group holds 64 nodes of at least 8 bytes: 2^32 groups would take 2 TiB.
        u32::try_from(nodes / FANOUT - 1).expect("trie node groups fit in u32")
    }

    /// Adds a level on top: the new root's child 0 is the old root.
    fn add_level(&mut self) {
        if self.height == 0 {
            self.root = self.new_group(true) * FANOUT as u32;
        } else {
            let below = self.root / FANOUT as u32;
            let root = self.new_group(false) * FANOUT as u32;
            self.inner[root as usize] = Inner {
                bits: u64::from(self.len != 0),
                children: below,
            };
            self.root = root;
        }
        self.height += 1;
    }

    /// Whether `i` is a member.
    #[inline]
    fn contains(&self, i: u64) -> bool {
        if !self.covers(i) {
            return false;
        }
        let mut node = self.root as usize;
        for level in (1..self.height).rev() {
            let n = self.inner[node];
            let d = digit(i, level);
            if n.bits >> d & 1 == 0 {
                return false;
            }
            node = n.children as usize * FANOUT + d as usize;
        }
        self.leaves[node] >> digit(i, 0) & 1 == 1
    }

    /// Adds `i`, which must not be a member.
    #[inline]
    fn insert(&mut self, i: u64) {
        while !self.covers(i) {
            self.add_level();
        }
        let mut node = self.root as usize;
        for level in (1..self.height).rev() {
            let d = digit(i, level);
            let mut children = self.inner[node].children;
            if children == NIL {
                children = self.new_group(level == 1);
                self.inner[node].children = children;
            }
            self.inner[node].bits |= 1 << d;
            node = children as usize * FANOUT + d as usize;
        }
        let bit = 1u64 << digit(i, 0);
        debug_assert!(self.leaves[node] & bit == 0, "index {i} inserted twice");
        self.leaves[node] |= bit;
        self.len += 1;
    }

    /// Removes `i`; false (and nothing changed) when it was not a member.
    #[inline]
    fn remove(&mut self, i: u64) -> bool {
        if !self.covers(i) {
            return false;
        }
        // The inner node met at each level, to clear emptied children's bits on the way up.
        let mut path = [0u32; MAX_HEIGHT];
        let mut node = self.root as usize;
        for level in (1..self.height).rev() {
            let n = self.inner[node];
            let d = digit(i, level);
            if n.bits >> d & 1 == 0 {
                return false;
            }
            path[level as usize] = node as u32;
            node = n.children as usize * FANOUT + d as usize;
        }
        let bit = 1u64 << digit(i, 0);
        if self.leaves[node] & bit == 0 {
            return false;
        }
        self.leaves[node] &= !bit;
        self.len -= 1;
        if self.leaves[node] == 0 {
            for level in 1..self.height {
                let n = &mut self.inner[path[level as usize] as usize];
                n.bits &= !(1 << digit(i, level));
                if n.bits != 0 {
                    break;
                }
            }
        }
        true
    }

    /// The lowest member of the non-empty subtree under `node` at `level`, whose members
    /// all start with the digits of `base`.
    #[inline]
    fn lowest_under(&self, mut level: u32, mut node: usize, mut base: u64) -> u64 {
        while level > 0 {
            let n = self.inner[node];
            let d = u64::from(n.bits.trailing_zeros());
            base |= d << (DIGIT_BITS * level);
            node = n.children as usize * FANOUT + d as usize;
            level -= 1;
        }
        base | u64::from(self.leaves[node].trailing_zeros())
    }

    /// The lowest member, if any.
    #[inline]
    fn first(&self) -> Option<u64> {
        (self.len != 0).then(|| self.lowest_under(self.height - 1, self.root as usize, 0))
    }

    /// Checks the invariants listed on the type.
    fn check(&self) -> Result<(), String> {
        if self.height == 0 {
            return if self.len == 0 && self.inner.is_empty() && self.leaves.is_empty() {
                Ok(())
            } else {
                Err("nodes without a root".into())
            };
        }
        let group = self.root as usize / FANOUT * FANOUT;
        if self.root as usize != group {
            return Err(format!("root {} is not first in its group", self.root));
        }
        let siblings_empty = if self.height == 1 {
            self.leaves[group + 1..group + FANOUT]
                .iter()
                .all(|&b| b == 0)
        } else {
            self.inner[group + 1..group + FANOUT]
                .iter()
                .all(|n| n.bits == 0 && n.children == NIL)
        };
        if !siblings_empty {
            return Err("a sibling of the root is in use".into());
        }
        let mut seen = (0usize, 0usize); // (inner, leaf) groups reached
        let members = self.check_under(self.height - 1, group / FANOUT, &mut seen)?;
        if (seen.0 * FANOUT, seen.1 * FANOUT) != (self.inner.len(), self.leaves.len()) {
            return Err(format!(
                "{} inner and {} leaf nodes, {} and {} reachable",
                self.inner.len(),
                self.leaves.len(),
                seen.0 * FANOUT,
                seen.1 * FANOUT
            ));
        }
        let root_bits = if self.height == 1 {
            self.leaves[self.root as usize]
        } else {
            self.inner[self.root as usize].bits
        };
        if members != self.len || (root_bits != 0) != (self.len != 0) {
            return Err(format!("{members} members found, {} counted", self.len));
        }
        Ok(())
    }

    /// Checks the group `group` of nodes at `level` and everything under it; returns its
    /// member count and adds the groups reached to `seen`.
    fn check_under(
        &self,
        level: u32,
        group: usize,
        seen: &mut (usize, usize),
    ) -> Result<u64, String> {
        if level == 0 {
            seen.1 += 1;
            let leaves = self.leaves.get(group * FANOUT..(group + 1) * FANOUT);
            let leaves = leaves.ok_or_else(|| format!("leaf group {group} is missing"))?;
            return Ok(leaves.iter().map(|b| u64::from(b.count_ones())).sum());
        }
        seen.0 += 1;
        let nodes = self.inner.get(group * FANOUT..(group + 1) * FANOUT);
        let nodes = nodes.ok_or_else(|| format!("inner group {group} is missing"))?;
        let mut members = 0;
        for (at, n) in nodes.iter().enumerate() {
            if n.children == NIL {
                if n.bits != 0 {
                    return Err(format!(
                        "node {} has bits but no children",
                        group * FANOUT + at
                    ));
                }
                continue;
            }
            let child_bits = |d: usize| -> u64 {
                let c = n.children as usize * FANOUT + d;
                if level == 1 {
                    self.leaves.get(c).copied().unwrap_or(0)
                } else {
                    self.inner.get(c).map_or(0, |c| c.bits)
                }
            };
            let expected = (0..FANOUT).fold(0u64, |b, d| b | u64::from(child_bits(d) != 0) << d);
            if n.bits != expected {
                return Err(format!(
                    "node {} at level {level} has bits {:#x}, its children {expected:#x}",
                    group * FANOUT + at,
                    n.bits
                ));
            }
            members += self.check_under(level - 1, n.children as usize, seen)?;
        }
        Ok(members)
    }
}

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
/// - `by_order[k]` holds exactly the starts (in minimum blocks) of the runs whose
///   [`top_order`] is `k`, and keeps its own trie invariants;
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
    /// `by_order[k]`: starts, in minimum blocks, of the runs whose largest block has order `k`.
    by_order: Vec<StartSet>,
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
            by_order: vec![StartSet::default(); ORDERS],
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
    /// `tag` must be given back to [`BuddyRange::free`].
    pub fn alloc(&mut self, size: u64, align: u64, tag: u64) -> Option<u64> {
        debug_assert!(size > 0 && size % (1 << self.min_order) == 0);
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
        self.free_bytes -= size;
        self.live.insert(start, (size, tag));
        self.high_water = self.high_water.max(end);
        Some(start)
    }

    /// Frees the allocation at `offset` that was made with `tag`.
    pub fn free(&mut self, offset: u64, tag: u64) -> Result<u64, EngineError> {
        let size = match self.live.entry(offset) {
            Entry::Occupied(e) if e.get().1 == tag => e.remove().0,
            _ => return Err(EngineError::AlreadyFreed { offset }),
        };
        self.release(offset, offset + size);
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
    /// The new space joins the free run at the old end, if any, so its blocks coalesce with
    /// free buddies below the old end that had none before.
    pub fn grow(&mut self, additional: u64) -> Result<(), EngineError> {
        let min_block = 1u64 << self.min_order;
        let new_capacity = self.capacity.checked_add(additional);
        match new_capacity {
            Some(c) if additional != 0 && additional % min_block == 0 && c < 1 << MAX_ORDER => {
                let old = self.capacity;
                self.capacity = c;
                self.release(old, c);
                Ok(())
            }
            _ => Err(EngineError::BadCapacity {
                capacity: additional,
                unit: min_block,
            }),
        }
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
    /// the end: the free run at the end is shortened, or removed when it is all cut.
    pub fn shrink(&mut self, bytes: u64) {
        debug_assert!(bytes % (1 << self.min_order) == 0 && bytes <= self.free_tail());
        // Never cut into live space, even if the caller asks for more.
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
            if !self.by_order[top_order(a, b) as usize].contains(a >> self.min_order) {
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
            if let Err(m) = set.check() {
                return fail(format!("runs of order {k}: {m}"));
            }
            if (self.nonempty >> k & 1 == 1) == (set.len == 0) {
                return fail(format!("nonempty bit {k} is stale"));
            }
            let lowest = set.first().map_or(u64::MAX, |i| i << self.min_order);
            if self.lowest[k] != lowest {
                return fail(format!(
                    "lowest run of order {k} is cached as {}, is {lowest}",
                    self.lowest[k]
                ));
            }
            indexed += set.len;
        }
        // Every run is in its own order's set (above), so equal counts leave no stray entry.
        if indexed != runs {
            return fail(format!("{indexed} runs indexed by order, {runs} exist"));
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
        self.by_order[k as usize].insert(a >> self.min_order);
        self.nonempty |= 1 << k;
        let lowest = &mut self.lowest[k as usize];
        *lowest = (*lowest).min(a);
    }

    /// Takes the run starting at `a` out of order `k`.
    #[inline]
    fn unindex(&mut self, a: u64, k: u32) {
        let set = &mut self.by_order[k as usize];
        let removed = set.remove(a >> self.min_order);
        debug_assert!(removed, "free run at {a} is missing from order {k}");
        if self.lowest[k as usize] == a {
            self.lowest[k as usize] = set.first().map_or(u64::MAX, |i| i << self.min_order);
            if set.len == 0 {
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
    use std::collections::BTreeSet;

    #[test]
    fn start_set_lowest_survives_removals_across_node_boundaries() {
        let mut set = StartSet::default();
        assert_eq!(set.first(), None);
        assert!(!set.contains(0) && !set.remove(0));
        // Members on both sides of leaf (64) and inner-node (4096, 2^18) boundaries; the
        // later, larger ones add levels above the first root.
        let members = [
            63,
            64,
            4095,
            4096,
            1 << 18,
            (1 << 18) - 1,
            1 << 30,
            1 << 40,
            u64::MAX,
        ];
        for &i in &members {
            set.insert(i);
            set.check().unwrap();
        }
        assert_eq!(set.height, 11);
        assert_eq!(set.len, members.len() as u64);
        let mut sorted = members.to_vec();
        sorted.sort_unstable();
        for (n, &i) in sorted.iter().enumerate() {
            assert_eq!(set.first(), Some(i));
            assert!(set.contains(i));
            for j in [i.wrapping_sub(1), i.wrapping_add(1), i ^ 64, i ^ 4096] {
                assert_eq!(set.contains(j), sorted[n..].contains(&j), "{j} next to {i}");
            }
            assert!(set.remove(i));
            assert!(!set.remove(i), "a second removal finds nothing");
            set.check().unwrap();
            assert_eq!(set.len, (sorted.len() - n - 1) as u64);
        }
        assert_eq!(set.first(), None);
        // Emptied nodes are reused.
        let nodes = (set.inner.len(), set.leaves.len());
        set.insert(4096);
        assert_eq!((set.inner.len(), set.leaves.len()), nodes);
        assert_eq!(set.first(), Some(4096));
        set.check().unwrap();
    }

    #[test]
    fn start_set_matches_an_ordered_set() {
        let mut set = StartSet::default();
        let mut shadow = BTreeSet::new();
        let mut x = 0x2545_F491_4F6C_DD1Du64;
        for step in 0..20_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            // Clustered indices, so leaves fill and empty, plus a few far ones.
            let i = if x % 16 == 0 { x >> 20 } else { x % 5000 };
            if x >> 62 == 0 {
                assert_eq!(set.remove(i), shadow.remove(&i), "step {step}");
            } else if shadow.insert(i) {
                set.insert(i);
            }
            assert_eq!(set.first(), shadow.first().copied(), "step {step}");
            assert_eq!(set.contains(i), shadow.contains(&i));
        }
        assert_eq!(set.len, shadow.len() as u64);
        set.check().unwrap();
    }

    #[test]
    fn start_set_check_catches_a_stale_summary_bit() {
        let mut set = StartSet::default();
        set.insert(5000);
        set.insert(70);
        set.check().unwrap();
        // Clear the leaf under 5000 behind the trie's back: its parent's bit is now stale.
        let leaf = set
            .leaves
            .iter()
            .position(|&b| b == 1 << (5000 % 64))
            .unwrap();
        set.leaves[leaf] = 0;
        assert!(set.check().is_err());
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
