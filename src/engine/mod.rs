//! Carving engines: where each segment goes inside a big block.
//!
//! Engines manage offsets only. They never touch memory and contain no `unsafe`, so
//! they are property-tested, fuzzed and benchmarked on their own.
//!
//! - [`tlsf::TlsfRange`]: two-level segregated fit with a wilderness, O(1) (the default range tier);
//! - [`buddy::BuddyRange`]: a buddy allocator that gives each block's unused tail back;
//! - [`slab::SlabAllocator`]: O(1) slabs for small footprints, pages carved from the range tier;
//! - [`CarveEngine`]: the carve rule in front, slabs for small segments, a range tier for the rest.
//!
//! ```
//! use ascend_pool::engine::{CarveEngine, EngineConfig};
//! use ascend_pool::CarveRule;
//!
//! let mut engine = CarveEngine::new(64 << 20, EngineConfig::default()).unwrap();
//! let frame = engine.alloc(1920 * 1080 * 3 / 2, CarveRule::model_input()).unwrap();
//! assert_eq!(frame.footprint(), 3_110_528);
//! assert_eq!(frame.offset() % 128, 0);
//! engine.free(frame).unwrap();
//! assert!(engine.free(frame).is_err()); // a second free is a typed error
//! engine.validate().unwrap();
//! ```

pub mod buddy;
pub mod slab;
pub mod tlsf;

use crate::align::{CarveRule, CarveRuleError};
use std::sync::atomic::{AtomicU32, Ordering};

/// "No node" in index links.
pub(crate) const NIL: u32 = u32::MAX;

/// Why an engine refused an operation. The engine is unchanged after any of them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EngineError {
    /// The carve rule refused the length (zero, overflow) or the alignment.
    Carve(CarveRuleError),
    /// No free range can hold the footprint.
    OutOfSpace {
        /// Bytes the segment needs.
        footprint: u64,
        /// Largest free range at the time.
        largest_free: u64,
    },
    /// [`CarveEngine::alloc_in_pages`]: no slab page of the segment's class has a free
    /// object and no free range holds a new page (the segment alone may still fit).
    NoRoomForPage {
        /// Bytes the segment needs.
        footprint: u64,
        /// Bytes a page of its class takes.
        page: u64,
    },
    /// The handle came from another engine.
    ForeignAllocation,
    /// The handle's allocation was already freed.
    AlreadyFreed {
        /// Offset the handle names.
        offset: u64,
    },
    /// A capacity past what the TLSF tier can address (2^32 - 1 units of 64 bytes).
    CapacityTooLarge {
        /// Capacity asked for (bytes).
        capacity: u64,
        /// The largest capacity the engine takes (bytes).
        max: u64,
    },
    /// A capacity that is zero or not a multiple of the engine's unit.
    BadCapacity {
        /// Capacity asked for.
        capacity: u64,
        /// The unit it must be a multiple of.
        unit: u64,
    },
    /// A slab limit past the largest footprint a slab page holds.
    SlabMaxTooLarge {
        /// The `slab_max` asked for.
        slab_max: u64,
        /// The largest the slabs take ([`slab::MAX_SLAB_FOOTPRINT`]).
        max: u64,
    },
    /// An invariant does not hold; the message says which.
    Corrupt(String),
}

impl std::fmt::Display for EngineError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Carve(e) => write!(f, "{e}"),
            Self::OutOfSpace {
                footprint,
                largest_free,
            } => write!(
                f,
                "no free range holds {footprint} bytes (largest free range {largest_free})"
            ),
            Self::NoRoomForPage { footprint, page } => write!(
                f,
                "no free range holds a {page}-byte slab page for {footprint} bytes"
            ),
            Self::ForeignAllocation => write!(f, "allocation belongs to another engine"),
            Self::AlreadyFreed { offset } => {
                write!(f, "allocation at offset {offset} was already freed")
            }
            Self::CapacityTooLarge { capacity, max } => {
                write!(f, "capacity {capacity} is past the engine's largest, {max}")
            }
            Self::BadCapacity { capacity, unit } => {
                write!(
                    f,
                    "capacity {capacity} is not a non-zero multiple of {unit}"
                )
            }
            Self::SlabMaxTooLarge { slab_max, max } => {
                write!(
                    f,
                    "slab_max {slab_max} is past the largest slab footprint, {max}"
                )
            }
            Self::Corrupt(m) => write!(f, "engine invariant violated: {m}"),
        }
    }
}

impl std::error::Error for EngineError {}

impl From<CarveRuleError> for EngineError {
    fn from(e: CarveRuleError) -> Self {
        Self::Carve(e)
    }
}

/// Which range tier serves segments too large for slabs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum RangeTier {
    /// Two-level segregated fit (default): O(1), lowest high-water mark on the shared traces.
    #[default]
    Tlsf,
    /// Buddy with tail give-back.
    Buddy,
}

impl RangeTier {
    /// The largest capacity an engine with this tier takes ([`CarveEngine::new`]): with
    /// TLSF `(2^32 - 1) * 64` bytes, just under 256 GiB; the buddy tier has no bound of its own
    /// but the capacity's: the largest multiple of 64 a `u64` holds.
    ///
    /// ```
    /// use ascend_pool::engine::RangeTier;
    ///
    /// assert_eq!(RangeTier::Tlsf.max_capacity(), u64::from(u32::MAX) * 64);
    /// assert_eq!(RangeTier::Buddy.max_capacity(), u64::MAX - 63);
    /// ```
    pub const fn max_capacity(self) -> u64 {
        match self {
            Self::Tlsf => tlsf::MAX_UNITS * crate::align::DEFAULT_ALIGN,
            Self::Buddy => u64::MAX - (crate::align::DEFAULT_ALIGN - 1),
        }
    }
}

/// Engine settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EngineConfig {
    /// The range tier.
    pub range: RangeTier,
    /// Largest footprint served by slabs (a multiple of 64, rounded down if not; 0 turns
    /// slabs off; at most [`slab::MAX_SLAB_FOOTPRINT`]). 176 KiB by default: bitstream
    /// packets, activations and other sizes that vary take an O(1) slab object and leave
    /// the range tier to frames and blocks that recur (see [`slab`] for the classes). Past
    /// 176 KiB a class's four-object page costs more than it saves (random-mix utilization
    /// 0.880 at 176 KiB, 0.877 at 128, 0.875 at 192, 0.865 at 256; `docs/benchmarks.md`,
    /// session 80).
    pub slab_max: u64,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            range: RangeTier::Tlsf,
            slab_max: 176 << 10,
        }
    }
}

/// Free-space figures of a range tier.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct RangeStats {
    /// Bytes the range spans.
    pub capacity: u64,
    /// Free bytes (holes and untouched space).
    pub free_bytes: u64,
    /// Largest free range; for the buddy tier, its largest free block (two free buddies of
    /// different parents side by side are two blocks, though one range).
    pub largest_free: u64,
    /// Number of free ranges; for the buddy tier, of free blocks.
    pub free_fragments: u64,
    /// Highest offset ever in use.
    pub high_water: u64,
    /// End of the highest range in use now.
    pub top: u64,
}

/// Cheap counters, always kept.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct EngineCounters {
    /// Live allocations.
    pub live: u64,
    /// Allocations served so far.
    pub allocs: u64,
    /// Frees so far.
    pub frees: u64,
    /// Allocations refused (bad input or no space).
    pub failed: u64,
    /// Sum of requested lengths of live allocations.
    pub requested_bytes: u64,
    /// Sum of footprints of live allocations.
    pub footprint_bytes: u64,
    /// Peak of `footprint_bytes`.
    pub peak_footprint_bytes: u64,
    /// Peak of `requested_bytes`.
    pub peak_requested_bytes: u64,
}

/// Detailed statistics, computed on request.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct EngineStats {
    /// The cheap counters.
    pub counters: EngineCounters,
    /// The range tier's free-space figures.
    pub range: RangeStats,
    /// Slab pages held.
    pub slab_pages: u64,
    /// Bytes in slab pages.
    pub slab_bytes: u64,
    /// Bytes taken from the range tier that no live footprint covers
    /// (free slab objects, cached slab pages, slab objects' rounding to their class).
    pub internal_waste: u64,
}

/// Bit of [`Allocation`]'s `place` that marks a slab object.
const SLAB_PLACE: u32 = 1 << 31;

/// A segment handed out by a [`CarveEngine`]: offset, footprint and requested length.
///
/// Only an engine creates these, so a handle names a segment of the engine whose id it carries.
/// It is 32 bytes, and so is an `Option` of it: callers keep one per live segment.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Allocation {
    offset: u64,
    footprint: u64,
    /// `footprint - len`; fits since padding is at most 1 MiB and alignment at most 1 GiB.
    slack: u32,
    /// Range tier: the tier's key (bit 31 clear). Slab: `SLAB_PLACE | page << SLOT_BITS | slot`.
    place: u32,
    /// The tag the engine gave the segment, so a stale handle is caught. Tags wrap after
    /// 2^32 - 2 allocations; a stale handle whose tag came round again is still refused
    /// when its footprint differs from the live segment's at its offset (for a slab
    /// object, when it is of another class). One of the same footprint (the same class),
    /// offset and tag is an ABA no check tells apart: its free frees the live segment (and
    /// the counters take the stale handle's length).
    tag: u32,
    engine: std::num::NonZeroU32,
}

static_assertions::const_assert!(std::mem::size_of::<Option<Allocation>>() == 32);
static_assertions::const_assert!(
    crate::align::MAX_ALIGN + (1 << 20) + crate::align::LEN_GRANULE <= u32::MAX as u64
);

impl Allocation {
    /// Offset of the segment's start in the engine's range (aligned as its rule asked).
    pub fn offset(&self) -> u64 {
        self.offset
    }
    /// Bytes the segment takes out of the range under the carve rule.
    pub fn footprint(&self) -> u64 {
        self.footprint
    }
    /// Bytes the caller asked for.
    pub fn len(&self) -> u64 {
        self.footprint - u64::from(self.slack)
    }
    /// Never true: zero-length segments are refused.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Id of the engine that handed it out.
    pub fn engine_id(&self) -> u32 {
        self.engine.get()
    }
    /// The tag the engine gave the segment: with the engine and offset, it tells this
    /// allocation from a later one in the same place.
    pub(crate) fn tag(&self) -> u32 {
        self.tag
    }
    /// Whether the segment came from a slab.
    pub fn is_slab(&self) -> bool {
        self.place & SLAB_PLACE != 0
    }
}

/// The tag after `tag`: counts up and wraps before [`tlsf::PARKED`], skipping 0 (both
/// mean "not live").
#[inline(always)]
fn tag_after(tag: u32) -> u32 {
    if tag >= tlsf::PARKED - 1 {
        1
    } else {
        tag + 1
    }
}

#[derive(Debug)]
enum Range {
    // Boxed: the TLSF range's parked table is about 1 KiB, the buddy's sets a few words.
    Tlsf(Box<tlsf::TlsfRange>),
    Buddy(buddy::BuddyRange),
}

impl Range {
    /// `thorough`: a refusal means no free block holds the request (the buddy's always
    /// does); else the TLSF tier's good-fit search only.
    #[inline(always)]
    fn alloc(&mut self, size: u64, align: u64, tag: u32, thorough: bool) -> Option<(u64, u32)> {
        match self {
            Self::Tlsf(t) if thorough => t.alloc(size, align, tag),
            Self::Tlsf(t) => t.alloc_good_fit(size, align, tag),
            // The buddy finds blocks by offset: no key.
            Self::Buddy(b) => b.alloc(size, align, u64::from(tag)).map(|o| (o, 0)),
        }
    }
    #[inline(always)]
    fn alloc_parked(&mut self, size: u64, align: u64, tag: u32) -> Option<(u64, u32)> {
        match self {
            Self::Tlsf(t) => t.alloc_parked(size, align, tag),
            Self::Buddy(_) => None,
        }
    }
    /// Frees the block `key` (TLSF) or `offset` (buddy) names, if it is in use, `bytes`
    /// long, with `tag`.
    #[inline(always)]
    fn free(&mut self, key: u32, offset: u64, bytes: u64, tag: u32) -> Result<(), EngineError> {
        match self {
            Self::Tlsf(t) => t.free(key, offset, bytes, tag),
            Self::Buddy(b) => b.free(offset, bytes, u64::from(tag)),
        }
    }
    fn stats(&self) -> RangeStats {
        match self {
            Self::Tlsf(t) => t.stats(),
            Self::Buddy(b) => b.stats(),
        }
    }
    fn validate(&self) -> Result<(), EngineError> {
        match self {
            Self::Tlsf(t) => t.validate(),
            Self::Buddy(b) => b.validate(),
        }
    }
    /// Whether the block `key` (TLSF) or `offset` (buddy) names is in use, `bytes` long,
    /// at `offset`, with `tag`.
    fn holds(&self, key: u32, offset: u64, bytes: u64, tag: u32) -> bool {
        match self {
            Self::Tlsf(t) => t.holds(key, offset, bytes, tag),
            Self::Buddy(b) => b.holds(offset, bytes, u64::from(tag)),
        }
    }
    fn largest_free(&self) -> u64 {
        match self {
            Self::Tlsf(t) => t.largest_free(),
            Self::Buddy(b) => b.largest_free(),
        }
    }
    fn high_water(&self) -> u64 {
        match self {
            Self::Tlsf(t) => t.high_water(),
            Self::Buddy(b) => b.high_water(),
        }
    }
    fn used_bytes(&self) -> u64 {
        match self {
            Self::Tlsf(t) => t.used_bytes(),
            Self::Buddy(b) => b.used_bytes(),
        }
    }
    fn live_count(&self) -> u64 {
        match self {
            Self::Tlsf(t) => t.live_count(),
            Self::Buddy(b) => b.live_count(),
        }
    }
    fn capacity(&self) -> u64 {
        match self {
            Self::Tlsf(t) => t.capacity(),
            Self::Buddy(b) => b.capacity(),
        }
    }
    fn grow(&mut self, additional: u64) -> Result<(), EngineError> {
        match self {
            Self::Tlsf(t) => t.grow(additional),
            Self::Buddy(b) => b.grow(additional),
        }
    }
    /// Free space at the end, blocks the TLSF tier parked there included: with nothing
    /// parked (after [`unpark`](Self::unpark)), what [`shrink`](Self::shrink) may cut.
    fn free_tail(&self) -> u64 {
        match self {
            Self::Tlsf(t) => t.free_tail_merged(),
            Self::Buddy(b) => b.free_tail(),
        }
    }
    fn unpark(&mut self) {
        match self {
            Self::Tlsf(t) => t.unpark_all(),
            Self::Buddy(_) => {}
        }
    }
    fn shrink(&mut self, bytes: u64) {
        match self {
            Self::Tlsf(t) => t.shrink(bytes),
            Self::Buddy(b) => b.shrink(bytes),
        }
    }
}

static NEXT_ENGINE_ID: AtomicU32 = AtomicU32::new(1);

/// The carving engine: the carve rule in front, slabs for small segments, a range tier behind.
///
/// Invariants (checked by [`CarveEngine::validate`]):
/// - the range tier and the slab layer are each valid;
/// - the bytes the range tier has in use equal the slab pages plus the footprints of
///   live range allocations (nothing is lost between the tiers);
/// - the counters equal the sums over live allocations: the live count is the slab objects
///   in use plus the range tier's blocks that are no slab page, and the footprints sum to
///   the range blocks' bytes plus, for the slab objects, between 64 bytes and their class's
///   size each (a slab object keeps its class, not its footprint).
#[derive(Debug)]
pub struct CarveEngine {
    /// Unique per engine, so handles from another engine are refused.
    id: std::num::NonZeroU32,
    capacity: u64,
    range: Range,
    slabs: slab::SlabAllocator,
    counters: EngineCounters,
    /// Footprints of live allocations served by the range tier.
    range_live_bytes: u64,
    /// Bumped per allocation (wrapping, never 0 nor `tlsf::PARKED`); tags handles so stale
    /// ones are caught.
    next_tag: u32,
}

impl CarveEngine {
    /// An engine over `[0, capacity)`; `capacity` must be a non-zero multiple of 64, and
    /// with the TLSF tier at most `(2^32 - 1) * 64` bytes (just under 256 GiB, more than any
    /// Ascend device holds): [`EngineError::CapacityTooLarge`] past that. A `slab_max` past
    /// [`slab::MAX_SLAB_FOOTPRINT`] is [`EngineError::SlabMaxTooLarge`].
    pub fn new(capacity: u64, config: EngineConfig) -> Result<Self, EngineError> {
        const UNIT: u64 = crate::align::DEFAULT_ALIGN;
        if config.slab_max > slab::MAX_SLAB_FOOTPRINT {
            // Past it a slab page holds no object (and the size classes alone would take
            // 1/64 of `slab_max` in memory).
            return Err(EngineError::SlabMaxTooLarge {
                slab_max: config.slab_max,
                max: slab::MAX_SLAB_FOOTPRINT,
            });
        }
        let range = match config.range {
            RangeTier::Tlsf => Range::Tlsf(Box::new(tlsf::TlsfRange::new(capacity, UNIT)?)),
            RangeTier::Buddy => Range::Buddy(buddy::BuddyRange::new(capacity, UNIT)?),
        };
        Ok(Self {
            // Ids start at 1; after 4 billion engines they wrap (0 skipped).
            id: std::num::NonZeroU32::new(NEXT_ENGINE_ID.fetch_add(1, Ordering::Relaxed))
                .unwrap_or(std::num::NonZeroU32::MIN),
            capacity,
            range,
            slabs: slab::SlabAllocator::new(config.slab_max),
            counters: EngineCounters::default(),
            range_live_bytes: 0,
            next_tag: 1,
        })
    }

    /// Carves a segment of `len` bytes under `rule`. A footprint the slabs serve goes in a
    /// slab page of its class; when no page fits, it is carved from the range alone.
    #[inline]
    pub fn alloc(&mut self, len: u64, rule: CarveRule) -> Result<Allocation, EngineError> {
        self.carve(len, rule, true, true)
    }

    /// As [`alloc`](Self::alloc), except that a footprint the slabs serve is carved only in
    /// a slab page: with no room for one, [`EngineError::NoRoomForPage`]. The pool asks its
    /// chunks this way first, so that small segments fill pages in chunks with room for
    /// them rather than scatter over the last bytes of a nearly full one (random-mix
    /// utilization 0.8744, against 0.8698 with every chunk taking them alone), and asks
    /// with `alloc` before it reports the kind out of memory.
    #[inline]
    pub fn alloc_in_pages(&mut self, len: u64, rule: CarveRule) -> Result<Allocation, EngineError> {
        self.carve(len, rule, false, true)
    }

    /// As [`alloc_in_pages`](Self::alloc_in_pages), with the range tier's good-fit search
    /// only: a refusal ([`EngineError::OutOfSpace`]) may leave a free block that holds the
    /// segment unused, past the few entries of its size class the search looks at. The
    /// pool asks each chunk this way, where many refuse (the full look cost 4% of the pool's
    /// instructions on random-mix), and each with `alloc_in_pages` before it grows.
    #[inline]
    pub fn alloc_in_pages_good_fit(
        &mut self,
        len: u64,
        rule: CarveRule,
    ) -> Result<Allocation, EngineError> {
        self.carve(len, rule, false, false)
    }

    /// [`alloc`](Self::alloc) (`alone`: a slab-sized segment with no room for its page may
    /// take the range alone) or [`alloc_in_pages`](Self::alloc_in_pages); `thorough` but
    /// for [`alloc_in_pages_good_fit`](Self::alloc_in_pages_good_fit).
    #[inline(always)]
    fn carve(
        &mut self,
        len: u64,
        rule: CarveRule,
        alone: bool,
        thorough: bool,
    ) -> Result<Allocation, EngineError> {
        let footprint = match rule.footprint(len) {
            Ok(f) => f,
            Err(e) => {
                self.counters.failed += 1;
                return Err(e.into());
            }
        };
        let align = rule.align();
        let tag = self.next_tag;
        self.next_tag = tag_after(tag);
        let place;
        let offset;
        if self.slabs.serves(footprint, align) {
            let stag = tag;
            // The rule's footprint: a non-zero multiple of its alignment, 64 or more.
            let got = match self.slabs.take(footprint, stag) {
                Some(x) => Some(x),
                // The slabs serve this footprint (above): it has a class, so a page shape,
                // and the page is taken.
                None => slab::SlabAllocator::page_shape(footprint).and_then(|shape| {
                    let (base, key) = self.range.alloc(shape.bytes, shape.align, tag, thorough)?;
                    let added = self.slabs.add_page(footprint, base, key, tag);
                    debug_assert!(added, "a footprint the slabs serve has a class");
                    self.slabs.take(footprint, stag)
                }),
            };
            match got {
                Some((off, slab_place)) => {
                    offset = off;
                    place = SLAB_PLACE | slab_place;
                }
                // No room for a page (up to 64 KiB for an exact class, a megabyte for a
                // mid-sized one): the segment alone may still fit, in a range that is
                // small or nearly full, and `OutOfSpace` would claim no free range holds it.
                None if alone => {
                    (offset, place) = self.alloc_in_range(footprint, align, tag, true, thorough)?
                }
                None => {
                    self.counters.failed += 1;
                    return Err(EngineError::NoRoomForPage {
                        footprint,
                        page: slab::SlabAllocator::page_shape(footprint).map_or(0, |s| s.bytes),
                    });
                }
            }
        } else {
            (offset, place) = self.alloc_in_range(footprint, align, tag, alone, thorough)?;
        }
        Ok(self.allocated(len, footprint, offset, place, tag))
    }

    /// Counts a new allocation and makes its handle.
    #[inline(always)]
    fn allocated(
        &mut self,
        len: u64,
        footprint: u64,
        offset: u64,
        place: u32,
        tag: u32,
    ) -> Allocation {
        let c = &mut self.counters;
        c.live += 1;
        c.allocs += 1;
        c.requested_bytes += len;
        c.footprint_bytes += footprint;
        c.peak_footprint_bytes = c.peak_footprint_bytes.max(c.footprint_bytes);
        c.peak_requested_bytes = c.peak_requested_bytes.max(c.requested_bytes);
        Allocation {
            offset,
            footprint,
            // The carve rule adds at most 31 + padding + align - 1 bytes (asserted above).
            slack: (footprint - len) as u32,
            place,
            tag,
            engine: self.id,
        }
    }

    /// Carves `len` under `rule` only from a block the range tier holds parked at exactly
    /// its footprint: no bin search and no merge, and `Ok(None)` (nothing counted as failed)
    /// when there is none. A length the rule refuses is refused and counted as `alloc`
    /// counts it. Sizes the slab tier serves are never parked. The pool asks the
    /// one chunk where a large segment of this footprint was last freed, before it walks
    /// its chunks in order.
    ///
    /// ```
    /// use ascend_pool::engine::{CarveEngine, EngineConfig};
    /// use ascend_pool::CarveRule;
    ///
    /// let mut e = CarveEngine::new(64 << 20, EngineConfig::default()).unwrap();
    /// let rule = CarveRule::default();
    /// let frame = e.alloc(3_110_400, rule).unwrap();
    /// assert!(e.alloc_parked(3_110_400, rule).unwrap().is_none());
    /// e.free(frame).unwrap();
    /// let again = e.alloc_parked(3_110_400, rule).unwrap().unwrap();
    /// assert_eq!(again.offset(), frame.offset());
    /// assert!(e.alloc_parked(0, rule).is_err());
    /// assert_eq!(e.counters().failed, 1);
    /// e.validate().unwrap();
    /// ```
    #[inline]
    pub fn alloc_parked(
        &mut self,
        len: u64,
        rule: CarveRule,
    ) -> Result<Option<Allocation>, EngineError> {
        // Bad input is a refused allocation here too: `failed` said 0 after this refusal.
        let footprint = rule
            .footprint(len)
            .inspect_err(|_| self.counters.failed += 1)?;
        let align = rule.align();
        if self.slabs.serves(footprint, align) {
            return Ok(None);
        }
        let tag = self.next_tag;
        let Some((offset, key)) = self.range.alloc_parked(footprint, align, tag) else {
            return Ok(None);
        };
        self.next_tag = tag_after(tag);
        self.range_live_bytes += footprint;
        Ok(Some(self.allocated(len, footprint, offset, key, tag)))
    }

    /// A segment straight from the range tier: its offset and key (the handle's place).
    /// With `last_word` (a bare [`alloc`](Self::alloc)), a refusal first gives the cached
    /// empty slab pages back and asks again.
    #[inline(always)]
    fn alloc_in_range(
        &mut self,
        footprint: u64,
        align: u64,
        tag: u32,
        last_word: bool,
        thorough: bool,
    ) -> Result<(u64, u32), EngineError> {
        let got = match self.range.alloc(footprint, align, tag, thorough) {
            Some(x) => Some(x),
            // Cached empty slab pages are free space kept for reuse: they may cost placement,
            // never room (an engine with nothing live refused most of its range). They go
            // back and the range is asked again, as the TLSF tier merges what it parked.
            // Not for `alloc_in_pages`: the pool asks each chunk so, and a chunk that keeps
            // its pages through another's turn places better (random-mix 0.8744 against
            // 0.8698 when every refusing chunk gave them back); it trims its chunks before
            // it grows or refuses.
            None if last_word && self.release_cached_pages() => {
                self.range.alloc(footprint, align, tag, thorough)
            }
            None => None,
        };
        let Some((offset, key)) = got else {
            return Err(self.out_of_space(footprint));
        };
        debug_assert!(key & SLAB_PLACE == 0, "range keys stay below 2^31");
        self.range_live_bytes += footprint;
        Ok((offset, key))
    }

    /// Gives a segment back. A handle from another engine, or one already freed, is refused.
    #[inline]
    pub fn free(&mut self, a: Allocation) -> Result<(), EngineError> {
        if a.engine != self.id {
            return Err(EngineError::ForeignAllocation);
        }
        if a.place & SLAB_PLACE != 0 {
            let place = a.place & !SLAB_PLACE;
            if let Some(rel) = self.slabs.free(a.offset, a.footprint, place, a.tag)? {
                self.range
                    .free(rel.range_key, rel.base, rel.bytes, rel.range_tag)
                    .expect("slab pages are live range allocations");
            }
        } else {
            self.range.free(a.place, a.offset, a.footprint, a.tag)?;
            debug_assert!(self.range_live_bytes >= a.footprint, "range bytes drifted");
            self.range_live_bytes -= a.footprint;
        }
        // The tier took the handle as live, so the sums hold its bytes: less means they
        // drifted. Checked in debug builds only, off the free path; a release build's wrap
        // is a drift `validate` reports (the sums no longer match the tiers).
        let c = &mut self.counters;
        debug_assert!(
            c.live > 0 && c.requested_bytes >= a.len() && c.footprint_bytes >= a.footprint,
            "counters below a live segment: {c:?}"
        );
        c.live -= 1;
        c.frees += 1;
        c.requested_bytes -= a.len();
        c.footprint_bytes -= a.footprint;
        Ok(())
    }

    /// Gives cached empty slab pages back to the range tier and merges the blocks the range
    /// tier keeps parked for reuse, so the free space is whole again.
    pub fn trim(&mut self) {
        self.release_cached_pages();
        self.range.unpark();
    }

    /// Gives cached empty slab pages back to the range tier; whether there were any.
    fn release_cached_pages(&mut self) -> bool {
        let released = self.slabs.trim();
        for rel in &released {
            self.range
                .free(rel.range_key, rel.base, rel.bytes, rel.range_tag)
                .expect("slab pages are live range allocations");
        }
        !released.is_empty()
    }

    /// This engine's id, carried by its handles.
    pub fn id(&self) -> u32 {
        self.id.get()
    }

    /// Bytes the engine spans now (changed by [`grow`](Self::grow) and
    /// [`shrink_free_tail`](Self::shrink_free_tail)).
    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// Extends the range by `additional` bytes at its end, for a block that grew in place
    /// (virtual memory mapped behind the old end). The new space merges with any free tail.
    ///
    /// `additional` must be a non-zero multiple of 64 ([`EngineError::BadCapacity`]) and
    /// the new capacity within what [`new`](Self::new) takes
    /// ([`EngineError::CapacityTooLarge`], also for a capacity that would pass `u64::MAX`);
    /// after any error nothing has changed. Both range tiers support it.
    ///
    /// ```
    /// use ascend_pool::engine::{CarveEngine, EngineConfig};
    /// use ascend_pool::CarveRule;
    ///
    /// let mut engine = CarveEngine::new(1 << 20, EngineConfig::default()).unwrap();
    /// let a = engine.alloc(1 << 19, CarveRule::default()).unwrap(); // [0, 512 KiB + 64)
    /// assert!(engine.alloc(1 << 19, CarveRule::default()).is_err());
    /// engine.grow(1 << 20).unwrap();
    /// let b = engine.alloc(1 << 19, CarveRule::default()).unwrap();
    /// assert_eq!(b.offset(), a.footprint()); // straight after `a`, across the old end
    /// assert!(engine.grow(100).is_err()); // not a multiple of 64
    /// engine.validate().unwrap();
    /// ```
    pub fn grow(&mut self, additional: u64) -> Result<(), EngineError> {
        self.range.grow(additional)?;
        self.capacity = self.range.capacity();
        Ok(())
    }

    /// Gives back the largest multiple of `granule` bytes of free space at the end of the
    /// range; returns the bytes removed (0 when none), by which the capacity shrank.
    ///
    /// Cached empty slab pages are given back to the range tier first, so they do not pin
    /// the tail. `granule` must be a non-zero multiple of 64 (the engine's unit); any other
    /// value removes nothing and returns 0. The high-water mark keeps its historical peak.
    ///
    /// ```
    /// use ascend_pool::engine::{CarveEngine, EngineConfig};
    /// use ascend_pool::CarveRule;
    ///
    /// let mut engine = CarveEngine::new(8 << 20, EngineConfig::default()).unwrap();
    /// let a = engine.alloc(3 << 20, CarveRule::default()).unwrap(); // [0, 3 MiB + 64)
    /// assert_eq!(engine.shrink_free_tail(2 << 20), 4 << 20); // two 2 MiB granules fit
    /// assert_eq!(engine.capacity(), 4 << 20);
    /// engine.free(a).unwrap();
    /// assert_eq!(engine.shrink_free_tail(2 << 20), 4 << 20);
    /// assert_eq!(engine.capacity(), 0);
    /// engine.validate().unwrap();
    /// ```
    pub fn shrink_free_tail(&mut self, granule: u64) -> u64 {
        if granule == 0 || granule % crate::align::DEFAULT_ALIGN != 0 {
            return 0;
        }
        self.trim();
        let removed = self.range.free_tail() / granule * granule;
        if removed > 0 {
            self.range.shrink(removed);
            self.capacity = self.range.capacity();
        }
        removed
    }

    /// Bytes of free space at the end of the range (not counting cached empty slab pages
    /// there; counting segments freed there that the TLSF tier keeps parked, which any
    /// search merges first): what a request no free range fits can reuse when the range
    /// grows in place.
    pub fn free_tail(&self) -> u64 {
        self.range.free_tail()
    }

    /// Bytes of the largest free range: the figure [`EngineError::OutOfSpace`] carries, without
    /// the walk over the free lists that [`stats`](Self::stats) makes. Blocks the TLSF tier
    /// parked since its last search count one by one (the search that refuses a request
    /// merges them first, so the figure an error carries is merged).
    pub fn largest_free(&self) -> u64 {
        self.range.largest_free()
    }

    /// Highest offset ever in use: what a block under this engine must have reserved.
    pub fn high_water(&self) -> u64 {
        self.range.high_water()
    }

    /// Whether no segment is live.
    pub fn is_empty(&self) -> bool {
        self.counters.live == 0
    }

    /// The cheap counters.
    pub fn counters(&self) -> EngineCounters {
        self.counters
    }

    /// Detailed statistics (walks the free structures).
    pub fn stats(&self) -> EngineStats {
        let slab_bytes = self.slabs.page_bytes();
        let used = self.range.used_bytes();
        EngineStats {
            counters: self.counters,
            range: self.range.stats(),
            slab_pages: self.slabs.page_count() as u64,
            slab_bytes,
            internal_waste: used.saturating_sub(self.counters.footprint_bytes),
        }
    }

    /// Checks every invariant of the engine and its tiers.
    pub fn validate(&self) -> Result<(), EngineError> {
        self.range.validate()?;
        self.slabs.validate()?;
        let used = self.range.used_bytes();
        // Checked: a wrapped count is a drift to report, not an overflow to panic on.
        let expected = self.slabs.page_bytes().checked_add(self.range_live_bytes);
        if expected != Some(used) {
            return Err(EngineError::Corrupt(format!(
                "range tier has {used} bytes in use, slabs and live segments account for {expected:?}"
            )));
        }
        if self.capacity != self.range.capacity() {
            return Err(EngineError::Corrupt(format!(
                "engine capacity {} differs from the range tier's {}",
                self.capacity,
                self.range.capacity()
            )));
        }
        if self.counters.allocs.checked_sub(self.counters.frees) != Some(self.counters.live) {
            return Err(EngineError::Corrupt("live counter drifted".into()));
        }
        // Each slab page is a block the range tier holds for it: a page record naming a
        // block freed (or another one) would hand out objects over free or foreign space.
        for (base, bytes, key, tag) in self.slabs.held_pages() {
            if !self.range.holds(key, base, bytes, tag) {
                return Err(EngineError::Corrupt(format!(
                    "slab page at {base} ({bytes} bytes) is no live range block"
                )));
            }
        }
        let c = &self.counters;
        if c.peak_footprint_bytes < c.footprint_bytes || c.peak_requested_bytes < c.requested_bytes
        {
            return Err(EngineError::Corrupt(format!(
                "peaks {} and {} below the live sums {} and {}",
                c.peak_footprint_bytes,
                c.peak_requested_bytes,
                c.footprint_bytes,
                c.requested_bytes
            )));
        }
        // Tags 0 and `PARKED` mean "not live" to the range tier.
        if self.next_tag == 0 || self.next_tag == tlsf::PARKED {
            return Err(EngineError::Corrupt(format!("next tag {}", self.next_tag)));
        }
        // The live segments are the slab objects in use and the range tier's blocks that
        // are no slab page. A slab object's footprint is not kept, only its class: at least
        // 64 bytes and at most the class's size.
        let (objects, object_bytes) = self.slabs.live_objects();
        let in_range = self
            .range
            .live_count()
            .checked_sub(self.slabs.page_count() as u64);
        let c = &self.counters;
        let slab_footprints = c.footprint_bytes.checked_sub(self.range_live_bytes);
        if in_range.is_none_or(|r| c.live != objects + r)
            || c.requested_bytes > c.footprint_bytes
            || slab_footprints.is_none_or(|f| f < objects * 64 || f > object_bytes)
        {
            return Err(EngineError::Corrupt(format!(
                "counters say {} live segments of {} bytes ({} asked), the tiers {objects} slab \
                 objects of at most {object_bytes} bytes and {in_range:?} range blocks of {}",
                c.live, c.footprint_bytes, c.requested_bytes, self.range_live_bytes
            )));
        }
        Ok(())
    }

    /// Test helper: the tag the next allocation takes, as if so many allocations had been
    /// made that the tags came round to it.
    #[cfg(test)]
    pub(crate) fn set_next_tag_for_test(&mut self, tag: u32) {
        debug_assert!(
            tag != 0 && tag != tlsf::PARKED,
            "no live segment carries {tag}"
        );
        self.next_tag = tag;
    }

    fn out_of_space(&mut self, footprint: u64) -> EngineError {
        self.counters.failed += 1;
        EngineError::OutOfSpace {
            footprint,
            largest_free: self.largest_free(),
        }
    }
}

/// One way to corrupt a `T`, named for the failure message.
#[cfg(test)]
pub(crate) type Drift<T> = (&'static str, fn(&mut T));

/// Test helper: for each drift, builds a fresh state, corrupts it, and checks that
/// `validate` reports [`EngineError::Corrupt`] (not `Ok`, not a panic).
#[cfg(test)]
pub(crate) fn assert_each_drift_reported<T>(
    build: impl Fn() -> T,
    drifts: &[Drift<T>],
    validate: impl Fn(&T) -> Result<(), EngineError>,
) {
    for (what, corrupt) in drifts {
        let mut state = build();
        corrupt(&mut state);
        assert!(
            matches!(validate(&state), Err(EngineError::Corrupt(_))),
            "{what} went unnoticed"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_say_what_was_refused() {
        let cases = [
            (EngineError::Carve(CarveRuleError::ZeroLength), "0 bytes"),
            (
                EngineError::OutOfSpace {
                    footprint: 4096,
                    largest_free: 1024,
                },
                "holds 4096 bytes (largest free range 1024)",
            ),
            (EngineError::ForeignAllocation, "another engine"),
            (EngineError::AlreadyFreed { offset: 640 }, "offset 640"),
            (
                EngineError::CapacityTooLarge {
                    capacity: 1 << 40,
                    max: 1 << 38,
                },
                "capacity 1099511627776",
            ),
            (
                EngineError::BadCapacity {
                    capacity: 100,
                    unit: 64,
                },
                "capacity 100 is not a non-zero multiple of 64",
            ),
            (
                EngineError::SlabMaxTooLarge {
                    slab_max: 1 << 30,
                    max: 1 << 17,
                },
                "slab_max 1073741824",
            ),
            (EngineError::Corrupt("bin 3".into()), "bin 3"),
        ];
        for (e, said) in cases {
            assert!(e.to_string().contains(said), "{e:?} printed {e}");
        }
    }

    fn both_tiers() -> [EngineConfig; 2] {
        [RangeTier::Tlsf, RangeTier::Buddy].map(|range| EngineConfig {
            range,
            ..EngineConfig::default()
        })
    }

    #[test]
    fn grow_then_shrink_round_trips() {
        for cfg in both_tiers() {
            let mut e = CarveEngine::new(1 << 20, cfg).unwrap();
            let big = e.alloc(900 << 10, CarveRule::default()).unwrap();
            let small = e.alloc(100, CarveRule::default()).unwrap(); // a slab page
            assert!(e.alloc(900 << 10, CarveRule::default()).is_err());
            assert!(matches!(
                e.grow(0),
                Err(EngineError::BadCapacity { capacity: 0, .. })
            ));
            assert!(matches!(
                e.grow(32),
                Err(EngineError::BadCapacity { capacity: 32, .. })
            ));
            // Past what the tier takes, or past u64::MAX, as the doc says: CapacityTooLarge.
            assert!(matches!(
                e.grow(u64::MAX - 63),
                Err(EngineError::CapacityTooLarge { max, .. }) if max == cfg.range.max_capacity()
            ));
            assert_eq!(e.capacity(), 1 << 20);
            e.grow(3 << 20).unwrap();
            assert_eq!(e.capacity(), 4 << 20);
            let more = e.alloc(900 << 10, CarveRule::default()).unwrap();
            assert!(more.offset() + more.footprint() <= 2 << 20);
            e.validate().unwrap();
            assert_eq!(e.shrink_free_tail(0), 0);
            assert_eq!(e.shrink_free_tail(100), 0);
            // Everything past `more` goes.
            let free_tail = e.free_tail();
            let tail = e.shrink_free_tail(64);
            assert_eq!((tail, e.free_tail()), (free_tail, 0), "{cfg:?}");
            assert_eq!(e.capacity(), more.offset() + more.footprint());
            assert_eq!(e.capacity(), (4 << 20) - tail);
            e.validate().unwrap();
            e.free(more).unwrap();
            e.free(small).unwrap(); // its page stays cached until the shrink trims it
            let removed = e.shrink_free_tail(512 << 10);
            assert!(removed >= 512 << 10, "{cfg:?}: removed {removed}");
            assert_eq!(removed % (512 << 10), 0);
            assert_eq!(e.capacity() + removed + tail, 4 << 20);
            e.validate().unwrap();
            e.free(big).unwrap();
            let rest = e.shrink_free_tail(64);
            assert_eq!(rest + removed + tail, 4 << 20);
            assert_eq!(e.capacity(), 0);
            assert!(matches!(
                e.alloc(1, CarveRule::default()),
                Err(EngineError::OutOfSpace { .. })
            ));
            e.grow(4096).unwrap();
            e.alloc(4000, CarveRule::default()).unwrap();
            e.validate().unwrap();
        }
    }

    #[test]
    fn the_free_tail_counts_a_freed_top_segment_still_parked() {
        // The TLSF tier parks the top segment when it is freed: the free tail, which the
        // pool grows a chunk by, read as if it were still in use until a search merged it.
        let rule = CarveRule::default();
        for cfg in both_tiers() {
            let mut e = CarveEngine::new(4 << 20, cfg).unwrap();
            // Range-tier segments (past the slabs) of under 1 MiB: one buddy block each.
            let [a, b, c] = [0; 3].map(|_| e.alloc(900 << 10, rule).unwrap());
            e.free(b).unwrap();
            e.free(c).unwrap();
            let end = a.offset() + a.footprint();
            assert_eq!(e.free_tail(), (4 << 20) - end, "{cfg:?}");
            assert_eq!(e.stats().range.top, end, "{cfg:?}");
            e.validate().unwrap();
            if cfg.range == RangeTier::Tlsf {
                // What it promised is what a request reaching past the end may use.
                e.grow(1 << 20).unwrap();
                let d = e.alloc((5 << 20) - end - 64, rule).unwrap();
                assert_eq!(d.offset(), end);
                assert_eq!(e.free_tail(), 0);
                e.validate().unwrap();
            }
        }
    }

    /// A 1 MiB engine holding nothing but the cached page of one freed slab-sized segment.
    fn with_a_cached_page(cfg: EngineConfig) -> CarveEngine {
        let mut e = CarveEngine::new(1 << 20, cfg).unwrap();
        let small = e.alloc(67_944, CarveRule::model_input()).unwrap();
        assert!(small.is_slab());
        e.free(small).unwrap();
        e
    }

    #[test]
    fn an_empty_engine_serves_its_whole_range_past_a_cached_slab_page() {
        // A slab-sized segment's page stays cached after its last free; found by
        // trace_replay: a 1 MiB range then refused 614,528 bytes with nothing live.
        for cfg in both_tiers() {
            let mut e = with_a_cached_page(cfg);
            let whole = e.alloc((1 << 20) - 64, CarveRule::default());
            assert_eq!(whole.map(|a| a.offset()), Ok(0), "{cfg:?}");
            e.validate().unwrap();
        }
    }

    #[test]
    fn a_refusal_in_pages_keeps_the_cached_pages() {
        // The pool asks each chunk with `alloc_in_pages`: a chunk that refuses keeps its
        // cached pages for the small segments to come (the pool's placement on random-mix
        // depends on it); only a bare `alloc` gives them back to try again.
        for cfg in both_tiers() {
            let mut e = with_a_cached_page(cfg);
            let pages = e.slabs.page_count();
            assert!(pages > 0);
            let whole = e.alloc_in_pages((1 << 20) - 64, CarveRule::default());
            assert!(
                matches!(whole, Err(EngineError::OutOfSpace { .. })),
                "{whole:?}"
            );
            assert_eq!(e.slabs.page_count(), pages, "{cfg:?}");
            e.validate().unwrap();
        }
    }

    #[test]
    fn out_of_space_names_the_largest_free_range() {
        let rule = CarveRule::default();
        let quarter = 256 << 10; // past the slabs: a range-tier segment of 262,208 bytes
        for cfg in both_tiers() {
            let mut e = CarveEngine::new(1 << 20, cfg).unwrap();
            let a = e.alloc(quarter, rule).unwrap();
            let b = e.alloc(quarter, rule).unwrap();
            e.free(a).unwrap();
            // The whole range, refused while `b` lives: the error names what is left.
            let err = e.alloc((1 << 20) - 64, rule).unwrap_err();
            let EngineError::OutOfSpace {
                footprint,
                largest_free,
            } = err
            else {
                panic!("{cfg:?}: {err:?}");
            };
            assert_eq!(footprint, 1 << 20);
            assert_eq!(largest_free, e.largest_free(), "{cfg:?}");
            assert_eq!(largest_free, e.stats().range.largest_free, "{cfg:?}");
            assert!(
                largest_free >= b.footprint() && largest_free < 1 << 20,
                "{cfg:?}"
            );
            if cfg.range == RangeTier::Tlsf {
                // The tail past `b` (the hole `a` left is one footprint).
                assert_eq!(largest_free, (1 << 20) - 2 * b.footprint());
            }
            assert_eq!(e.counters().failed, 1);
            e.validate().unwrap();
            e.free(b).unwrap();
            // Blocks freed since the last search may still count apart (parked); the
            // next search merges them, so the whole range is one request's again.
            let all = e.alloc((1 << 20) - 64, rule).unwrap();
            assert_eq!((all.offset(), all.footprint()), (0, 1 << 20), "{cfg:?}");
            e.free(all).unwrap();
            e.validate().unwrap();
        }
    }

    #[test]
    fn validate_catches_drifted_engine_accounting() {
        for cfg in both_tiers() {
            let build = || {
                let mut e = CarveEngine::new(1 << 20, cfg).unwrap();
                e.alloc(200 << 10, CarveRule::default()).unwrap();
                e.alloc(100, CarveRule::default()).unwrap();
                e.validate().unwrap();
                e
            };
            // The last two reach the tiers' own checks through the engine's.
            let drifts: [Drift<CarveEngine>; 19] = [
                ("range-tier live bytes", |e| e.range_live_bytes += 64),
                ("capacity", |e| e.capacity += 64),
                ("live counter", |e| e.counters.live += 1),
                ("live and alloc counters together", |e| {
                    e.counters.live += 1;
                    e.counters.allocs += 1;
                }),
                ("footprint counter", |e| e.counters.footprint_bytes += 4096),
                ("requested counter", |e| e.counters.requested_bytes += 4096),
                ("the range tier's own state", |e| match &mut e.range {
                    Range::Tlsf(t) => t.drift_for_test(),
                    Range::Buddy(b) => b.drift_for_test(),
                }),
                ("the slab tier's own state", |e| e.slabs.drift_for_test()),
                ("a slab page naming no live range block", |e| {
                    e.slabs.page_record_drift_for_test()
                }),
                ("a peak below the live sum", |e| {
                    e.counters.peak_footprint_bytes = e.counters.footprint_bytes - 64
                }),
                ("a requested peak below the live sum", |e| {
                    e.counters.peak_requested_bytes = 0
                }),
                ("the next tag 0", |e| e.next_tag = 0),
                ("the next tag the parked marker", |e| {
                    e.next_tag = tlsf::PARKED
                }),
                // Counters wrapped below 0 by a subtraction in a release build (validate's
                // sum of the range bytes used to overflow: a panic, not a report).
                ("range-tier live bytes wrapped", |e| {
                    e.range_live_bytes = e.range_live_bytes.wrapping_sub(e.range_live_bytes + 64)
                }),
                ("footprint counter wrapped", |e| {
                    e.counters.footprint_bytes = e.counters.footprint_bytes.wrapping_sub(1 << 20)
                }),
                ("requested counter wrapped", |e| {
                    e.counters.requested_bytes = e.counters.requested_bytes.wrapping_sub(1 << 20)
                }),
                ("live counter wrapped", |e| {
                    e.counters.live = e.counters.live.wrapping_sub(3)
                }),
                // Used to panic on the subtraction (debug) instead of reporting.
                ("more frees than allocations", |e| {
                    e.counters.frees = e.counters.allocs + 1
                }),
                // The slab object's 192 bytes gone from both sums: every other check holds.
                ("slab footprints below 64 bytes an object", |e| {
                    e.counters.footprint_bytes -= 192;
                    e.counters.requested_bytes -= 100;
                }),
            ];
            assert_each_drift_reported(build, &drifts, CarveEngine::validate);
        }
    }

    #[test]
    fn slabs_take_small_footprints_and_the_range_tier_the_rest() {
        let rule = CarveRule::default();
        for cfg in both_tiers() {
            let mut e = CarveEngine::new(8 << 20, cfg).unwrap();
            let pages = |e: &CarveEngine| e.stats().slab_pages;
            // A footprint of `slab_max` + 64: the range tier's.
            let over = e.alloc(cfg.slab_max, rule).unwrap();
            assert_eq!(pages(&e), 0, "{cfg:?}");
            // A footprint of exactly `slab_max`: a slab page's.
            let at = e.alloc(cfg.slab_max - 32, rule).unwrap();
            assert_eq!((at.footprint(), pages(&e)), (cfg.slab_max, 1), "{cfg:?}");
            // Starts aligned past 128 bytes: the range tier's, however small.
            let wide = e.alloc(100, rule.with_align(256).unwrap()).unwrap();
            assert_eq!((wide.offset() % 256, pages(&e)), (0, 1), "{cfg:?}");
            let small = e.alloc(100, rule).unwrap();
            assert_eq!(pages(&e), 2, "{cfg:?}");
            let slab = [&over, &at, &wide, &small].map(Allocation::is_slab);
            assert_eq!(slab, [false, true, false, true], "{cfg:?}");
            e.validate().unwrap();
            for a in [over, at, wide, small] {
                e.free(a).unwrap();
            }
            e.validate().unwrap();
            assert!(e.is_empty());
        }
    }

    #[test]
    fn a_small_segment_with_no_room_for_a_slab_page_takes_the_range_tier() {
        // 100 bytes: a footprint of 192, whose slab page holds 32 objects (6 KiB).
        let rule = CarveRule::default();
        for cfg in both_tiers() {
            // A range smaller than the page: empty, yet it refused the segment.
            let mut e = CarveEngine::new(4096, cfg).unwrap();
            let a = e.alloc(100, rule).unwrap();
            assert_eq!(
                (a.offset(), a.footprint(), a.is_slab()),
                (0, 192, false),
                "{cfg:?}"
            );
            e.validate().unwrap();
            e.free(a).unwrap();
            e.validate().unwrap();
            // A range with 16 KiB free at its end: a 960-byte footprint (a 30 KiB page)
            // still fits there.
            let mut e = CarveEngine::new(1 << 20, cfg).unwrap();
            let big = e.alloc((1 << 20) - (16 << 10) - 32, rule).unwrap();
            assert_eq!(e.largest_free(), 16 << 10, "{cfg:?}");
            let small = e.alloc(900, rule).unwrap();
            assert_eq!(small.offset(), big.footprint(), "{cfg:?}");
            e.validate().unwrap();
            for a in [small, big] {
                e.free(a).unwrap();
            }
            e.validate().unwrap();
            assert!(e.is_empty());
        }
    }

    #[test]
    fn alloc_in_pages_refuses_what_only_fits_alone_and_leaves_the_engine_as_it_was() {
        let rule = CarveRule::default();
        for cfg in both_tiers() {
            // Slabs up to 1 KiB, as the pool's.
            let cfg = EngineConfig {
                slab_max: 1024,
                ..cfg
            };
            let mut e = CarveEngine::new(1 << 20, cfg).unwrap();
            let big = e.alloc((1 << 20) - (16 << 10) - 32, rule).unwrap();
            let (free, failed) = (e.largest_free(), e.counters().failed);
            // A 960-byte footprint's page takes 30 KiB; 16 KiB are left.
            assert_eq!(
                e.alloc_in_pages(900, rule),
                Err(EngineError::NoRoomForPage {
                    footprint: 960,
                    page: 30 << 10
                }),
                "{cfg:?}"
            );
            assert_eq!((e.largest_free(), e.counters().failed), (free, failed + 1));
            e.validate().unwrap();
            // A footprint past the slabs, or a page that fits, is carved as `alloc` would.
            let alone = e.alloc_in_pages(8 << 10, rule).unwrap();
            assert!(!alone.is_slab(), "{cfg:?}");
            let paged = e.alloc_in_pages(64, rule).unwrap();
            assert!(paged.is_slab(), "{cfg:?}");
            for a in [paged, alone, big] {
                e.free(a).unwrap();
            }
            e.validate().unwrap();
            assert!(e.is_empty());
        }
    }

    #[test]
    fn a_stale_handle_whose_tag_came_round_is_refused_by_its_footprint() {
        // Tags wrap after 2^32 - 2 allocations: a freed handle whose offset, place and tag
        // match a live segment of another footprint was taken as that segment's, and the
        // counters drifted by the difference until `validate` ran.
        let rule = CarveRule::default();
        // Range tier (300 and 400 KiB); slab tier, exact classes (64 and 128 bytes) and
        // the two mid-sized classes either side of 2048 bytes.
        let pairs = [(300 << 10, 400 << 10), (32, 96), (2016, 2080)];
        for cfg in both_tiers() {
            for (first, second) in pairs {
                let mut e = CarveEngine::new(4 << 20, cfg).unwrap();
                let stale = e.alloc(first, rule).unwrap();
                e.free(stale).unwrap();
                // A slab page goes back, so its record and bytes may take another class.
                e.trim();
                e.set_next_tag_for_test(stale.tag());
                let live = e.alloc(second, rule).unwrap();
                let same = |a: &Allocation| (a.offset(), a.place, a.tag(), a.is_slab());
                assert_eq!(same(&live), same(&stale), "{cfg:?} {first} {second}");
                assert_ne!(live.footprint(), stale.footprint());
                assert_eq!(
                    e.free(stale),
                    Err(EngineError::AlreadyFreed {
                        offset: stale.offset()
                    }),
                    "{cfg:?} {first} {second}"
                );
                e.validate().unwrap();
                e.free(live).unwrap();
                e.validate().unwrap();
                assert!(e.is_empty());
            }
        }
    }

    #[test]
    fn tags_wrap_to_1_before_the_parked_marker() {
        // `PARKED` marks a free block and 0 a vacant slot: no live segment may carry either.
        for cfg in both_tiers() {
            let mut e = CarveEngine::new(1 << 20, cfg).unwrap();
            e.next_tag = tlsf::PARKED - 2;
            let held: Vec<_> = [100, 4096, 300 << 10, 64]
                .map(|len| e.alloc(len, CarveRule::default()).unwrap())
                .into();
            let tags: Vec<u32> = held.iter().map(Allocation::tag).collect();
            assert_eq!(tags, [tlsf::PARKED - 2, tlsf::PARKED - 1, 1, 2], "{cfg:?}");
            for a in held {
                e.free(a).unwrap();
            }
            e.validate().unwrap();
            assert!(e.is_empty());
        }
    }

    #[test]
    fn stats_take_each_figure_from_its_own_source() {
        // A slab object and a range segment side by side: with only one of them, the
        // slab bytes equal the range tier's bytes in use, and the requested peak the live sum.
        let rule = CarveRule::default();
        for cfg in both_tiers() {
            let mut e = CarveEngine::new(8 << 20, cfg).unwrap();
            let small = e.alloc(100, rule).unwrap(); // a footprint of 192, in a page of 32
            let big = e.alloc(300 << 10, rule).unwrap(); // past the slabs
            assert_eq!((small.is_slab(), big.is_slab()), (true, false), "{cfg:?}");
            let page = slab::SlabAllocator::page_shape(192).unwrap().bytes;
            let s = e.stats();
            assert_eq!((s.slab_pages, s.slab_bytes), (1, page), "{cfg:?}");
            // The page's free objects, not the page: the range segment is no waste.
            assert_eq!(s.internal_waste, page - 192, "{cfg:?}");
            let asked = 100 + (300 << 10);
            let c = s.counters;
            assert_eq!((c.requested_bytes, c.peak_requested_bytes), (asked, asked));
            assert_eq!(c.peak_footprint_bytes, 192 + big.footprint(), "{cfg:?}");
            e.free(big).unwrap();
            // The peaks stay where they were; the live sums fall.
            let c = e.counters();
            assert_eq!((c.requested_bytes, c.peak_requested_bytes), (100, asked));
            assert_eq!(c.footprint_bytes, 192);
            e.free(small).unwrap();
            e.validate().unwrap();
        }
    }

    #[test]
    fn a_slab_sized_segment_alone_takes_the_room_of_a_cached_page() {
        // 4,128 bytes: a footprint of 4,160, whose class's page (about 128 KiB) no 8 KiB
        // range holds. Alone it needs more than the 4 KiB the cached page of a 64-byte
        // footprint leaves: the page goes back first, as for a segment past the slabs.
        let rule = CarveRule::default();
        for cfg in both_tiers() {
            let mut e = CarveEngine::new(8 << 10, cfg).unwrap();
            let tiny = e.alloc(1, rule).unwrap();
            assert!(tiny.is_slab());
            e.free(tiny).unwrap();
            assert_eq!(e.stats().slab_pages, 1, "{cfg:?}: the page stays cached");
            let a = e.alloc(4128, rule);
            assert_eq!(
                a.map(|a| (a.offset(), a.footprint(), a.is_slab())),
                Ok((0, 4160, false)),
                "{cfg:?}"
            );
            e.validate().unwrap();
        }
    }

    #[test]
    fn the_free_tail_counts_a_free_block_below_a_parked_top_segment() {
        // `b` merged into the bins by `trim`, then `c` above it parked at the top: both are
        // the free tail, as a search would merge them into the wilderness.
        let rule = CarveRule::default();
        for cfg in both_tiers() {
            let mut e = CarveEngine::new(4 << 20, cfg).unwrap();
            let [a, b, c] = [0; 3].map(|_| e.alloc(900 << 10, rule).unwrap());
            e.free(b).unwrap();
            e.trim();
            e.free(c).unwrap();
            let end = a.offset() + a.footprint();
            assert_eq!(e.free_tail(), (4 << 20) - end, "{cfg:?}");
            assert_eq!(e.shrink_free_tail(64), (4 << 20) - end, "{cfg:?}");
            e.validate().unwrap();
        }
    }

    #[test]
    fn slab_max_may_be_the_largest_slab_footprint() {
        // The documented bound is inclusive: a page of four 256 KiB objects.
        let cfg = EngineConfig {
            slab_max: slab::MAX_SLAB_FOOTPRINT,
            ..EngineConfig::default()
        };
        let mut e = CarveEngine::new(8 << 20, cfg).unwrap();
        let a = e
            .alloc(slab::MAX_SLAB_FOOTPRINT - 32, CarveRule::default())
            .unwrap();
        assert_eq!(
            (a.footprint(), a.is_slab()),
            (slab::MAX_SLAB_FOOTPRINT, true)
        );
        e.free(a).unwrap();
        e.validate().unwrap();
        let past = EngineConfig {
            slab_max: slab::MAX_SLAB_FOOTPRINT + 64,
            ..cfg
        };
        assert!(matches!(
            CarveEngine::new(8 << 20, past),
            Err(EngineError::SlabMaxTooLarge { .. })
        ));
    }
}
