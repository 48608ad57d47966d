//! Peer allocators behind [`RangeReplayer`], for `ascend-pool replay --compare`.
//!
//! Each adapter manages one address range per memory kind, starting at offset 0,
//! and carves every segment with the same rule as our own engine: it asks its
//! allocator for `rule.footprint(len)` bytes at a start aligned to
//! `rule.align()`. The reserved bytes of a range are its high water: the
//! highest segment end (`offset + footprint`) it ever handed out.
//!
//! - [`OffsetAllocatorFactory`]: the `offset-allocator` crate (two-level bins over
//!   `u32` units). Its unit is the kind's default alignment (64 bytes, 128 for DVPP);
//!   an event asking for more alignment than the unit gets `align - unit` extra
//!   bytes and its offset rounded up.
//! - [`RlsfFactory`]: the `rlsf` crate (TLSF with in-band headers). It manages real
//!   memory, so each range is an `mmap(MAP_NORESERVE)` region; offsets are measured
//!   from its base. Only the pages holding rlsf's headers are ever touched.
//! - [`BuddyFactory`]: `buddy_system_allocator::FrameAllocator` with 64-byte frames
//!   (power-of-two blocks, naturally aligned).

use std::alloc::Layout;
use std::cell::RefCell;
use std::collections::HashMap;
use std::ptr::NonNull;
use std::rc::Rc;

use crate::align::CarveRule;
use crate::kind::MemKind;
use crate::trace::{RangeReplayer, ReplayerFactory};

// ---------------------------------------------------------------------------
// offset-allocator

/// One range of the `offset-allocator` crate.
pub struct OffsetAllocatorRange {
    inner: offset_allocator::Allocator,
    /// Bytes per allocator unit (a power of two >= 64).
    unit: u64,
    high_water: u64,
}

impl std::fmt::Debug for OffsetAllocatorRange {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OffsetAllocatorRange")
            .field("unit", &self.unit)
            .field("high_water", &self.high_water)
            .finish_non_exhaustive()
    }
}

impl OffsetAllocatorRange {
    /// A range of `capacity` bytes counted in units of `unit` bytes (a power of two);
    /// capped at `u32::MAX - 1` units.
    pub fn new(capacity: u64, unit: u64) -> Self {
        assert!(unit.is_power_of_two());
        let units = (capacity / unit).min(u64::from(u32::MAX - 1)) as u32;
        Self {
            // The default node budget (128 Ki) is too small for the largest traces.
            inner: offset_allocator::Allocator::with_max_allocs(units, 1 << 21),
            unit,
            high_water: 0,
        }
    }
}

impl RangeReplayer for OffsetAllocatorRange {
    type Token = offset_allocator::Allocation;

    #[inline]
    fn alloc(&mut self, len: u64, rule: CarveRule) -> Option<(u64, Self::Token)> {
        let footprint = rule.footprint(len).ok()?;
        let align = rule.align();
        // Units cover the footprint plus the worst-case gap to reach `align`.
        let extra = align.saturating_sub(self.unit);
        let units = footprint.checked_add(extra)?.div_ceil(self.unit);
        let a = self.inner.allocate(u32::try_from(units).ok()?)?;
        let offset = crate::align::align_up(u64::from(a.offset) * self.unit, align)?;
        self.high_water = self.high_water.max(offset + footprint);
        Some((offset, a))
    }

    #[inline]
    fn free(&mut self, token: Self::Token) {
        self.inner.free(token);
    }

    fn high_water(&self) -> u64 {
        self.high_water
    }
}

/// Builds [`OffsetAllocatorRange`]s, unit = the kind's default alignment.
#[derive(Debug, Clone, Copy, Default)]
pub struct OffsetAllocatorFactory;

impl ReplayerFactory for OffsetAllocatorFactory {
    type Replayer = OffsetAllocatorRange;

    fn name(&self) -> &str {
        "offset-allocator"
    }

    fn new_range(&self, kind: MemKind, capacity: u64) -> Result<OffsetAllocatorRange, String> {
        Ok(OffsetAllocatorRange::new(capacity, kind.default_align()))
    }
}

// ---------------------------------------------------------------------------
// rlsf

/// A private anonymous mapping that reserves address space but no memory: the
/// simulator's lazy mapping, reused.
#[derive(Debug)]
struct Reservation {
    /// `MAX_ALIGN`-aligned, so that an offset from it is as aligned as its address: rlsf
    /// aligns addresses, the replay checks offsets (a page-aligned base put 1 GiB-aligned
    /// requests at offsets that were not).
    base: NonNull<u8>,
    len: usize,
    _mapping: crate::source::sim::mapping::Mapping,
}

impl Reservation {
    fn new(len: usize) -> Result<Self, String> {
        const MAX_ALIGN: usize = crate::align::MAX_ALIGN as usize;
        let mapped = len
            .checked_add(MAX_ALIGN)
            .ok_or_else(|| format!("a reservation of {len} bytes passes the address space"))?;
        let mapping = crate::source::sim::mapping::Mapping::new(mapped).ok_or_else(|| {
            format!(
                "mmap of {mapped} bytes failed: {}",
                std::io::Error::last_os_error()
            )
        })?;
        let skip = mapping.addr().next_multiple_of(MAX_ALIGN) - mapping.addr();
        // SAFETY: `skip` < MAX_ALIGN, so the base and the `len` bytes after it lie inside
        // the mapping.
        let base = unsafe { (mapping.addr() as *mut u8).add(skip) };
        let base = NonNull::new(base).ok_or("mmap returned null")?;
        Ok(Self {
            base,
            len,
            _mapping: mapping,
        })
    }
}

/// The TLSF configuration: 32 first-level classes of 32 bytes << fl (blocks up to
/// 128 GiB), 32 second-level classes each.
type RlsfTlsf = rlsf::Tlsf<'static, u32, u32, 32, 32>;

/// A segment of an [`RlsfRange`]: where it is, and which range carved it.
///
/// Fields are private and the token is neither `Clone` nor `Copy`, so it comes only from
/// [`RlsfRange`]'s `alloc` and is freed at most once; a token of another range is refused
/// (see [`RlsfRange`]).
#[derive(Debug, PartialEq, Eq)]
pub struct RlsfToken {
    offset: u64,
    align: usize,
    /// [`RlsfRange::id`] of the range that carved it.
    range: u64,
}

/// Ids of [`RlsfRange`]s: every range, even one over a region an earlier range used, gets
/// a new one, so a token outliving its range is refused by the next.
static NEXT_RLSF_RANGE: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// One range of the `rlsf` crate over an `mmap(MAP_NORESERVE)` region.
///
/// rlsf keeps its headers in the memory it manages, so a free it was not given by this
/// range would corrupt it. A token is moved into `free`, so no segment is freed twice
/// through one, and a token of another range is refused by the range id it carries;
/// refused frees fail [`validate`](RangeReplayer::validate). The check is one compare per
/// free: a replay times rlsf's own work, as it does offset-allocator's.
pub struct RlsfRange {
    // Field order matters: `tlsf` points into `region` and is dropped first.
    tlsf: RlsfTlsf,
    region: Rc<Reservation>,
    high_water: u64,
    /// Unique among the process's ranges (from `NEXT_RLSF_RANGE`); every token this range
    /// hands out carries it.
    id: u64,
    /// Frees refused because their token came from another range.
    refused_frees: u64,
}

impl std::fmt::Debug for RlsfRange {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RlsfRange")
            .field("region", &self.region)
            .field("high_water", &self.high_water)
            .finish_non_exhaustive()
    }
}

impl RlsfRange {
    /// A range of `capacity` bytes of reserved (not committed) address space.
    pub fn new(capacity: u64) -> Result<Self, String> {
        let len = usize::try_from(capacity).map_err(|e| e.to_string())?;
        Self::over(Rc::new(Reservation::new(len)?))
    }

    /// A fresh TLSF over `region`, which no other live range may use.
    fn over(region: Rc<Reservation>) -> Result<Self, String> {
        let mut tlsf = RlsfTlsf::new();
        let block = NonNull::slice_from_raw_parts(region.base, region.len);
        // SAFETY: the region is mapped read/write and, while this range lives, used by
        // nothing else (the factory hands a region to one live range at a time, see
        // `RlsfFactory::new_range`); it outlives `tlsf` because this range holds an `Rc` to
        // it and drops `tlsf` first (field order). The `'static` lifetime never leaves this
        // struct.
        unsafe { tlsf.insert_free_block_ptr(block) }.ok_or("region too small for rlsf")?;
        Ok(Self {
            tlsf,
            region,
            high_water: 0,
            id: NEXT_RLSF_RANGE.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            refused_frees: 0,
        })
    }
}

impl RangeReplayer for RlsfRange {
    type Token = RlsfToken;

    #[inline]
    fn alloc(&mut self, len: u64, rule: CarveRule) -> Option<(u64, Self::Token)> {
        let footprint = usize::try_from(rule.footprint(len).ok()?).ok()?;
        let align = usize::try_from(rule.align()).ok()?;
        let layout = Layout::from_size_align(footprint, align).ok()?;
        let p = self.tlsf.allocate(layout)?;
        let offset = (p.as_ptr() as usize - self.region.base.as_ptr() as usize) as u64;
        self.high_water = self.high_water.max(offset + footprint as u64);
        Some((
            offset,
            RlsfToken {
                offset,
                align,
                range: self.id,
            },
        ))
    }

    #[inline]
    fn free(&mut self, token: RlsfToken) {
        if token.range != self.id {
            self.refused_frees += 1;
            return;
        }
        // SAFETY: the token came from this range's `alloc` (its id is unique to this range)
        // and was moved in, so it is freed once: base + offset is inside the region and is
        // a pointer `tlsf.allocate` returned for alignment `align`, not deallocated since.
        unsafe {
            let p = NonNull::new_unchecked(self.region.base.as_ptr().add(token.offset as usize));
            self.tlsf.deallocate(p, token.align);
        }
    }

    fn high_water(&self) -> u64 {
        self.high_water
    }

    fn validate(&self) -> Result<(), String> {
        if self.refused_frees > 0 {
            return Err(format!("{} frees were refused", self.refused_frees));
        }
        Ok(())
    }
}

/// Builds [`RlsfRange`]s.
///
/// The factory keeps each kind's region mapped after its range is dropped and gives it
/// to the next range of that kind, so a second replay of a trace (the warm-up policy of
/// the CLI) touches pages that are already faulted in, like the other backends' heap
/// metadata.
#[derive(Debug, Default)]
pub struct RlsfFactory {
    regions: RefCell<HashMap<(usize, u64), Rc<Reservation>>>,
}

impl ReplayerFactory for RlsfFactory {
    type Replayer = RlsfRange;

    fn name(&self) -> &str {
        "rlsf"
    }

    fn new_range(&self, kind: MemKind, capacity: u64) -> Result<RlsfRange, String> {
        let key = (kind.index(), capacity);
        let mut regions = self.regions.borrow_mut();
        if let Some(r) = regions.get(&key) {
            // Only reuse a region no live range holds (the factory's own count is 1).
            if Rc::strong_count(r) == 1 {
                return RlsfRange::over(Rc::clone(r));
            }
        }
        let range = RlsfRange::new(capacity)?;
        regions.insert(key, Rc::clone(&range.region));
        Ok(range)
    }
}

// ---------------------------------------------------------------------------
// buddy_system_allocator

/// Bytes per buddy frame.
pub const BUDDY_FRAME: u64 = 64;

/// One range of `buddy_system_allocator::FrameAllocator`, 64-byte frames.
pub struct BuddyRange {
    inner: buddy_system_allocator::FrameAllocator<33>,
    high_water: u64,
}

impl std::fmt::Debug for BuddyRange {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BuddyRange")
            .field("high_water", &self.high_water)
            .finish_non_exhaustive()
    }
}

impl BuddyRange {
    /// A range of `capacity` bytes.
    pub fn new(capacity: u64) -> Self {
        let mut inner = buddy_system_allocator::FrameAllocator::new();
        inner.add_frame(0, (capacity / BUDDY_FRAME) as usize);
        Self {
            inner,
            high_water: 0,
        }
    }
}

impl RangeReplayer for BuddyRange {
    /// First frame and the layout (in frames) used.
    type Token = (usize, Layout);

    #[inline]
    fn alloc(&mut self, len: u64, rule: CarveRule) -> Option<(u64, Self::Token)> {
        let footprint = rule.footprint(len).ok()?;
        let frames = usize::try_from(footprint.div_ceil(BUDDY_FRAME)).ok()?;
        let align = usize::try_from(rule.align() / BUDDY_FRAME).ok()?;
        let layout = Layout::from_size_align(frames, align).ok()?;
        let first = self.inner.alloc_aligned(layout)?;
        let offset = first as u64 * BUDDY_FRAME;
        self.high_water = self.high_water.max(offset + footprint);
        Some((offset, (first, layout)))
    }

    #[inline]
    fn free(&mut self, (first, layout): Self::Token) {
        self.inner.dealloc_aligned(first, layout);
    }

    fn high_water(&self) -> u64 {
        self.high_water
    }
}

/// Builds [`BuddyRange`]s.
#[derive(Debug, Clone, Copy, Default)]
pub struct BuddyFactory;

impl ReplayerFactory for BuddyFactory {
    type Replayer = BuddyRange;

    fn name(&self) -> &str {
        "buddy_system_allocator"
    }

    fn new_range(&self, _kind: MemKind, capacity: u64) -> Result<BuddyRange, String> {
        Ok(BuddyRange::new(capacity))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    /// Random alloc/free against a shadow map of live ranges: no overlap, alignment kept,
    /// high water equals the largest end seen.
    fn conformance<R: RangeReplayer>(mut r: R) {
        let rules = [
            CarveRule::default(),
            CarveRule::model_input(),
            CarveRule::default().with_align(4096).unwrap(),
        ];
        let mut live: BTreeMap<u64, (u64, R::Token)> = BTreeMap::new();
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        let mut next = || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        let mut max_end = 0;
        for _ in 0..3000 {
            if live.is_empty() || next() % 3 != 0 {
                let rule = rules[(next() % 3) as usize];
                let len = 1 + next() % 100_000;
                let f = rule.footprint(len).unwrap();
                let (off, tok) = r.alloc(len, rule).expect("range large enough");
                assert_eq!(off % rule.align(), 0);
                if let Some((&s, &(e, _))) = live.range(..=off).next_back() {
                    assert!(e <= off, "overlaps {s}..{e}");
                }
                if let Some((&s, _)) = live.range(off..).next() {
                    assert!(off + f <= s);
                }
                live.insert(off, (off + f, tok));
                max_end = max_end.max(off + f);
            } else {
                let k = *live.keys().nth((next() as usize) % live.len()).unwrap();
                let (_, tok) = live.remove(&k).unwrap();
                r.free(tok);
            }
            assert_eq!(r.high_water(), max_end);
        }
    }

    /// Offsets keep the request's alignment up to the largest a rule takes: rlsf aligns
    /// addresses, so its range starts on a `MAX_ALIGN` boundary.
    #[test]
    fn large_alignments_hold_in_offsets() {
        // rlsf searches for a free block of the footprint plus the alignment.
        let mut r = RlsfRange::new(8 << 30).unwrap();
        for align in [2 << 20, 1 << 30, 4096] {
            let rule = CarveRule::default().with_align(align).unwrap();
            for _ in 0..2 {
                let (off, _) = r
                    .alloc(100, rule)
                    .unwrap_or_else(|| panic!("no room at {align}"));
                assert_eq!(off % align, 0, "{align}");
            }
        }
        assert!(r.high_water() <= 8 << 30);
    }

    #[test]
    fn offset_allocator_conforms() {
        conformance(OffsetAllocatorRange::new(1 << 30, 64));
        conformance(OffsetAllocatorRange::new(1 << 30, 128));
    }

    #[test]
    fn rlsf_conforms() {
        conformance(RlsfRange::new(1 << 30).unwrap());
    }

    #[test]
    fn buddy_conforms() {
        conformance(BuddyRange::new(1 << 30));
    }

    #[test]
    fn rlsf_factory_reuses_idle_regions_only() {
        let f = RlsfFactory::default();
        let a = f.new_range(MemKind::Host, 1 << 30).unwrap();
        let b = f.new_range(MemKind::Host, 1 << 30).unwrap();
        assert_ne!(a.region.base, b.region.base);
        let base = b.region.base;
        drop(b);
        let c = f.new_range(MemKind::Host, 1 << 30).unwrap();
        assert_eq!(c.region.base, base);
        conformance(c);
    }

    /// A range of `capacity` bytes gives each freed third back: a free that kept its
    /// segment would leave no room within a few rounds (a buddy range rounds a third up to
    /// a half).
    fn frees_make_room_again<R: RangeReplayer>(name: &str, mut r: R, capacity: u64) {
        let rule = CarveRule::default();
        for round in 0..8 {
            let (_, token) = r.alloc(capacity / 3, rule).unwrap_or_else(|| {
                panic!("{name}, round {round}: the last free gave nothing back")
            });
            r.free(token);
        }
    }

    #[test]
    fn every_peer_reuses_what_it_frees() {
        let c = 1 << 20;
        frees_make_room_again("offset-allocator", OffsetAllocatorRange::new(c, 64), c);
        frees_make_room_again("rlsf", RlsfRange::new(c).unwrap(), c);
        frees_make_room_again("buddy", BuddyRange::new(c), c);
    }

    #[test]
    fn debug_shows_the_high_water() {
        let rule = CarveRule::default();
        let mut oa = OffsetAllocatorRange::new(1 << 20, 64);
        oa.alloc(100, rule).unwrap();
        let mut rlsf = RlsfRange::new(1 << 20).unwrap();
        rlsf.alloc(100, rule).unwrap();
        let mut buddy = BuddyRange::new(1 << 20);
        buddy.alloc(100, rule).unwrap();
        for (shown, name, high_water) in [
            (format!("{oa:?}"), "OffsetAllocatorRange", oa.high_water()),
            (format!("{rlsf:?}"), "RlsfRange", rlsf.high_water()),
            (format!("{buddy:?}"), "BuddyRange", buddy.high_water()),
        ] {
            assert!(high_water >= rule.footprint(100).unwrap());
            assert!(shown.starts_with(name), "{shown}");
            assert!(
                shown.contains(&format!("high_water: {high_water}")),
                "{shown}"
            );
        }
    }

    #[test]
    fn full_range_refuses() {
        let rule = CarveRule::default();
        assert!(OffsetAllocatorRange::new(4096, 64)
            .alloc(8192, rule)
            .is_none());
        assert!(RlsfRange::new(1 << 16)
            .unwrap()
            .alloc(1 << 17, rule)
            .is_none());
        assert!(BuddyRange::new(4096).alloc(8192, rule).is_none());
    }
}
