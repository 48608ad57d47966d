//! Slabs for small and mid-sized footprints: O(1) allocate and free.
//!
//! Footprints under the carve rule are multiples of 64. Up to [`EXACT_MAX`] every footprint
//! gets its own class, so a slab object wastes nothing beyond the rule itself. Above it a
//! class spans an eighth of a doubling (objects round up by less than 12.5%), so the many
//! sizes of bitstream packets or activations share a few well-filled pages instead of one
//! sparse page per footprint. Pages come from the range engine and go back to it when empty
//! (one empty page per class is kept to avoid thrashing on alloc/free pairs). A class whose
//! only page empties keeps that page listed, so a class that holds one object at a time (a
//! per-step activation, a workspace) pays no relisting per allocate/free pair.
//!
//! A page holds at most 64 objects, so one `u64` is its free map. Each page record holds
//! the tags of its objects too, after the fields an allocation or a free reads: the first
//! nine tags share that first cache line. So a page of at most nine objects (a class of
//! 13 KiB or more, with [`LARGE_PAGE`]) costs one line per allocation or free besides its
//! class, any other page two;
//! and the tag's place follows from the slot without a branch. (The records are a plain
//! `Vec` with a vacancy chain, not a `slab::Slab`, whose entry tag would shift a record
//! off its cache line.)

use super::{EngineError, NIL};

/// The granule of footprints: classes are `64, 128, 192, ...` up to [`EXACT_MAX`].
pub const CLASS_GRANULE: u64 = 64;
/// Footprints up to this each have their own class; above it a class spans an eighth of a
/// doubling (objects round up by less than 12.5%), so recurring and random sizes alike
/// share a few well-filled pages instead of one sparse page per footprint.
pub const EXACT_MAX: u64 = 1024;
/// log2 of the classes per doubling above [`EXACT_MAX`].
const STEP_SHIFT: u32 = 3;
/// Bytes a page above [`EXACT_MAX`] aims at (at least 4 objects, at most 64). 128 KiB, not
/// 256: a class's partly filled page strands half as much, and a page more per class costs
/// the range tier about nothing (engine utilization on random-mix 0.880 -> 0.889, video
/// 0.942 -> 0.959, llm-serving 0.997 -> 0.998; instructions within 1%, and 7% fewer L1
/// read misses on random-mix, 2% more on random sizes, under callgrind; 64 and 96 KiB place
/// worse on random-mix; `docs/benchmarks.md`, session 80).
pub const LARGE_PAGE: u64 = 128 << 10;

/// Class of a footprint (a non-zero multiple of 64) and the bytes of its objects.
///
/// One formula for both regimes, so random sizes cost no mispredicted branch: with
/// `2^k < footprint <= 2^(k+1)`, a class spans a step of `2^(k-3)` bytes, and the class's
/// objects are the footprint rounded up to a step. Holding `k` at 9 or more makes the step
/// the 64-byte granule below [`EXACT_MAX`] (asserted below), so there every class is exact.
#[inline]
pub fn class_of(footprint: u64) -> (usize, u64) {
    debug_assert!(footprint > 0 && footprint % CLASS_GRANULE == 0);
    let k = (63 - (footprint - 1).leading_zeros()).max(EXACT_SHIFT - 1);
    let step_shift = k - STEP_SHIFT;
    // Steps below the footprint: 8 per doubling past 2^k, plus those of 2^k itself.
    let steps = (footprint - 1) >> step_shift;
    let class = (((k - (EXACT_SHIFT - 1)) << STEP_SHIFT) as u64 + steps) as usize;
    (class, (steps + 1) << step_shift)
}
/// log2 of the bytes between the objects of `class` (of [`class_of`]) and those of the
/// class below: the class holds the footprints in `(size - 2^shift, size]`.
#[inline]
fn class_step_shift(class: usize) -> u8 {
    // `class_of` gives `2^k < footprint <= 2^(k+1)` (k at least EXACT_SHIFT - 1) the classes
    // `(k - EXACT_SHIFT + 1) << STEP_SHIFT` plus 8 to 15 (0 to 15 at the least k), so
    // `class >> STEP_SHIFT` is `k - EXACT_SHIFT + 2` (0 or 1 at the least k).
    let k = (class >> STEP_SHIFT).max(1) as u32 + EXACT_SHIFT - 2;
    (k - STEP_SHIFT) as u8
}
/// Whether `footprint` is one [`class_of`] takes: a non-zero multiple of the granule.
#[inline(always)]
fn classed(footprint: u64) -> bool {
    footprint != 0 && footprint % CLASS_GRANULE == 0
}
/// log2 of [`EXACT_MAX`].
const EXACT_SHIFT: u32 = EXACT_MAX.trailing_zeros();
// Below EXACT_MAX the formula's step must be the granule, so that those classes are exact.
static_assertions::const_assert_eq!(EXACT_MAX >> 1 >> STEP_SHIFT, CLASS_GRANULE);
static_assertions::const_assert!(EXACT_MAX.is_power_of_two());
/// Largest footprint slabs serve: past it a page of four objects passes a megabyte, and a
/// page mostly empty costs more memory than the O(1) path is worth (see
/// [`SlabAllocator::page_shape`]).
pub const MAX_SLAB_FOOTPRINT: u64 = 256 << 10;
/// Bits of an object's slot in a handle: a page holds at most 64 objects (see `page_shape`).
pub const SLOT_BITS: u32 = 6;
/// Pages the layer may hold at once, so a page index and a slot fit in 31 bits.
pub const MAX_PAGES: usize = 1 << (31 - SLOT_BITS);
static_assertions::const_assert!(MAX_PAGES << SLOT_BITS <= 1 << 31);
/// Most objects a page holds: the tags in each page record.
const SLOTS: usize = 1 << SLOT_BITS;

/// One page of objects of a single footprint, or a vacant record (`objects == 0`).
///
/// Aligned to a cache line, with the fields an allocation or a free reads first and the
/// first tags beside them (see the module docs).
#[derive(Debug, Clone, Copy)]
#[repr(C, align(64))]
struct SlabPage {
    /// Offset of the page in the range (aligned to 128 when the footprint is a multiple of 128).
    base: u64,
    /// Bit `i` set iff object `i` is free; bits at and past `objects` are clear.
    free_bits: u64,
    /// Bytes of one object (at most [`MAX_SLAB_FOOTPRINT`]).
    footprint: u32,
    /// Position in its class's list (from 1) while listed; `NIL` when cached empty, and
    /// stale once the page fills up (nothing reads it until the page is listed again). In
    /// a vacant record, the next vacant record (`NIL` ends the chain).
    partial_pos: u32,
    /// Class index (below 80: [`MAX_SLAB_FOOTPRINT`] is 2^18).
    class: u8,
    /// [`class_step_shift`] of `class`, so `free` tells a stale handle of another class
    /// without computing it.
    step_shift: u8,
    /// Objects in use; `0 ..= objects`.
    used: u8,
    /// Object count, `1 ..= 64`; 0 in a vacant record.
    objects: u8,
    /// Allocation tag of each object; 0 when free (and past `objects`).
    tags: [u32; SLOTS],
    /// Range-engine key and tag, to give the page back.
    range_key: u32,
    range_tag: u32,
}

// The hot fields and the first nine tags share the first line.
static_assertions::const_assert_eq!(std::mem::offset_of!(SlabPage, tags), 28);
static_assertions::const_assert_eq!(std::mem::size_of::<SlabPage>(), 320);

impl SlabPage {
    const VACANT: Self = Self {
        base: 0,
        free_bits: 0,
        footprint: 0,
        partial_pos: NIL,
        class: 0,
        step_shift: 0,
        used: 0,
        objects: 0,
        tags: [0; SLOTS],
        range_key: 0,
        range_tag: 0,
    };

    fn bytes(&self) -> u64 {
        u64::from(self.objects) * u64::from(self.footprint)
    }
}

/// The pages of one class that have room.
///
/// The list starts with a `NIL` sentinel, so its last entry is `NIL` exactly when no page
/// is listed, and a page that fills up leaves it by arithmetic rather than a branch: on
/// random sizes that branch is taken or not about as often as a coin flip.
#[derive(Debug)]
struct SizeClass {
    /// The list's last entry (`NIL` when no page is listed), kept here so that an
    /// allocation finds its page in this record and loads the page without waiting on the
    /// list's buffer (which it reads alongside, for the next `top`).
    top: u32,
    /// A wholly free page kept back from the range engine and set aside, off the list
    /// (`NIL` when none). The class keeps at most one empty page: this one, or an empty page
    /// listed first (see [`SlabAllocator::kept_listed`]).
    cached_empty: u32,
    /// `NIL`, then the pages with room (positions from 1); the last one serves next.
    list: Vec<u32>,
}

impl Default for SizeClass {
    fn default() -> Self {
        Self {
            top: NIL,
            cached_empty: NIL,
            list: vec![NIL],
        }
    }
}

impl SizeClass {
    /// The listed pages, in order.
    fn pages(&self) -> &[u32] {
        self.list.get(1..).unwrap_or_default()
    }

    /// Appends `page`; returns its position.
    #[inline]
    fn push(&mut self, page: u32) -> u32 {
        self.list.push(page);
        self.top = page;
        (self.list.len() - 1) as u32
    }

    /// Removes the last entry if `full` (a page that just filled up).
    #[inline(always)]
    fn pop_if(&mut self, full: bool) {
        // The sentinel keeps the length at 1 or more, so `len - 1` indexes an entry.
        let len = self.list.len() - usize::from(full);
        self.list.truncate(len);
        self.top = self.list[len - 1];
    }

    /// The list's first page, if there is one (the class's kept empty page when it holds
    /// no object: a page that empties while it is the only one listed stays there).
    #[inline]
    fn first(&self) -> Option<u32> {
        self.list.get(1).copied()
    }

    /// Removes the entry at `pos` (the last one moves there); returns the moved page, if any.
    #[inline]
    fn swap_remove(&mut self, pos: u32) -> Option<u32> {
        debug_assert!(pos >= 1 && (pos as usize) < self.list.len());
        self.list.swap_remove(pos as usize);
        self.top = self.list[self.list.len() - 1];
        self.list.get(pos as usize).copied()
    }
}

/// The page a slab class takes from the range engine ([`SlabAllocator::page_shape`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PageShape {
    /// Bytes of the page: `objects` objects of the class's size.
    pub bytes: u64,
    /// Objects the page holds, `1 ..= 64`.
    pub objects: u32,
    /// Alignment of the page's start: 128 when the class's size is a multiple of 128, else
    /// 64 (so each object starts as aligned as its footprint allows).
    pub align: u64,
}

/// What the slab layer hands back to the range engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PageRelease {
    /// Offset of the page.
    pub base: u64,
    /// Range-engine key.
    pub range_key: u32,
    /// Range-engine tag.
    pub range_tag: u32,
    /// Bytes of the page: the range block's length.
    pub bytes: u64,
}

/// Slabs for footprints up to `max_footprint`.
///
/// Invariants (checked by [`SlabAllocator::validate`]):
/// - a page is in its class's list iff `used < objects` and it is not the class's cached
///   empty page (set aside, off the list); a class's `top` is its list's last entry. (A
///   listed page that holds no object is the class's kept empty page, first in its list, or
///   a page just added for the allocation under way; not checked, as tests add pages ahead
///   of their allocations.)
/// - `used` equals the number of clear bits below `objects` in `free_bits`;
/// - the tag of object `i` of a held page is non-zero iff the object is in use; every
///   other tag (free objects, slots past `objects`, vacant records) is 0;
/// - the vacant records form one chain from `vacant` through `partial_pos`, and `held`
///   counts the others.
#[derive(Debug)]
pub struct SlabAllocator {
    max_footprint: u64,
    classes: Vec<SizeClass>,
    pages: Vec<SlabPage>,
    /// First vacant record of `pages` (`NIL` when none).
    vacant: u32,
    /// Records of `pages` that hold a page.
    held: usize,
    /// Bytes of all pages held (in use and cached).
    page_bytes: u64,
}

impl SlabAllocator {
    /// Slabs for footprints up to `max_footprint` (a multiple of 64; 0 turns slabs off),
    /// capped at [`MAX_SLAB_FOOTPRINT`].
    pub fn new(max_footprint: u64) -> Self {
        let max_footprint = max_footprint.min(MAX_SLAB_FOOTPRINT) / CLASS_GRANULE * CLASS_GRANULE;
        Self {
            max_footprint,
            classes: (0..if max_footprint == 0 {
                0
            } else {
                class_of(max_footprint).0 + 1
            })
                .map(|_| SizeClass::default())
                .collect(),
            pages: Vec::new(),
            vacant: NIL,
            held: 0,
            page_bytes: 0,
        }
    }

    /// Whether a footprint at this start alignment is served by slabs (never once
    /// [`MAX_PAGES`] pages are held, so page indices stay below it).
    #[inline]
    pub fn serves(&self, footprint: u64, align: u64) -> bool {
        // `align` is a power of two: a mask, not a division, on the hot path. Non-short-
        // circuit `&`: one branch for the caller to predict, not four.
        (footprint <= self.max_footprint)
            & (align <= 128)
            & (footprint & (align - 1) == 0)
            & (self.held < MAX_PAGES)
    }

    /// The page a footprint's class takes. At most 64 objects: 4 KiB of 64-byte objects,
    /// else 32 objects up to 64 KiB; above [`EXACT_MAX`], pages of about [`LARGE_PAGE`]
    /// bytes holding 4 to 64 objects of the class's size. `None` for a footprint no class
    /// holds: 0, no multiple of the 64-byte granule, or past [`MAX_SLAB_FOOTPRINT`] (an
    /// allocator made with a lower limit refuses those past its own too).
    ///
    /// ```
    /// use ascend_pool::engine::slab::{PageShape, SlabAllocator, MAX_SLAB_FOOTPRINT};
    ///
    /// let shape = SlabAllocator::page_shape(1024).unwrap();
    /// assert_eq!(shape, PageShape { bytes: 32 << 10, objects: 32, align: 128 });
    /// for footprint in [0, 100, MAX_SLAB_FOOTPRINT + 64] {
    ///     assert_eq!(SlabAllocator::page_shape(footprint), None);
    /// }
    /// ```
    pub fn page_shape(footprint: u64) -> Option<PageShape> {
        if !classed(footprint) || footprint > MAX_SLAB_FOOTPRINT {
            return None;
        }
        let footprint = class_of(footprint).1;
        let objects = if footprint <= EXACT_MAX {
            (footprint * 32).clamp(4096, 65536) / footprint
        } else {
            (LARGE_PAGE / footprint).clamp(4, 64)
        };
        debug_assert!(objects <= 1 << SLOT_BITS);
        Some(PageShape {
            bytes: objects * footprint,
            objects: objects as u32,
            align: if footprint % 128 == 0 { 128 } else { 64 },
        })
    }

    /// Takes an object of `footprint` bytes if a page has room: (offset, place), where
    /// place is `page << SLOT_BITS | slot`. `None` too for a footprint no class holds: past
    /// the slabs' largest, 0, or no multiple of the 64-byte granule.
    #[inline(always)]
    pub fn alloc(&mut self, footprint: u64, tag: u32) -> Option<(u64, u32)> {
        if !classed(footprint) {
            return None;
        }
        self.take(footprint, tag)
    }

    /// [`alloc`](Self::alloc) for a footprint known to be a non-zero multiple of the
    /// granule: the engine's (a carve rule's footprint), so its hot path pays for no check.
    #[inline(always)]
    pub(crate) fn take(&mut self, footprint: u64, tag: u32) -> Option<(u64, u32)> {
        debug_assert!(classed(footprint));
        let (class, footprint) = class_of(footprint);
        // The index's own bounds check, a refusal rather than a panic.
        let c = self.classes.get_mut(class)?;
        let page_idx = if c.top != NIL {
            c.top
        } else {
            let p = c.cached_empty;
            if p == NIL {
                return None;
            }
            c.cached_empty = NIL;
            self.pages[p as usize].partial_pos = c.push(p);
            p
        };
        let page = &mut self.pages[page_idx as usize];
        debug_assert!(page.free_bits != 0, "a partial page has a free object");
        let slot = page.free_bits.trailing_zeros();
        page.free_bits &= page.free_bits - 1;
        page.used += 1;
        let offset = page.base + u64::from(slot) * footprint;
        // Full: out of the list (it is the last entry), without a branch; its `partial_pos`
        // goes stale, which is harmless as nothing reads it before it is listed again.
        c.pop_if(page.free_bits == 0);
        page.tags[slot as usize] = tag;
        Some((offset, page_idx << SLOT_BITS | slot))
    }

    /// Adds a fresh page for `footprint` at `base` taken from the range engine.
    ///
    /// Only when [`alloc`](Self::alloc) refused that footprint: the class then lists no
    /// page and sets none aside, so the fresh page is its one empty page. Whether the page
    /// was taken: a footprint no class holds (as for `alloc`) has none, and its page is not.
    pub fn add_page(&mut self, footprint: u64, base: u64, range_key: u32, range_tag: u32) -> bool {
        let Some(PageShape { bytes, objects, .. }) = Self::page_shape(footprint) else {
            return false;
        };
        let (class, footprint) = class_of(footprint);
        if class >= self.classes.len() {
            return false;
        }
        debug_assert!(
            self.classes[class].top == NIL && self.classes[class].cached_empty == NIL,
            "a page is added only when the class has none with room"
        );
        let idx = if self.vacant != NIL {
            let idx = self.vacant;
            self.vacant = self.pages[idx as usize].partial_pos;
            idx
        } else {
            self.pages.push(SlabPage::VACANT);
            (self.pages.len() - 1) as u32
        };
        let c = &mut self.classes[class];
        self.pages[idx as usize] = SlabPage {
            base,
            free_bits: if objects == 64 {
                !0
            } else {
                (1 << objects) - 1
            },
            // All fit: a footprint is at most `MAX_SLAB_FOOTPRINT`, a class below 80, a page
            // at most 64 objects.
            footprint: footprint as u32,
            partial_pos: c.push(idx),
            class: class as u8,
            step_shift: class_step_shift(class),
            used: 0,
            objects: objects as u8,
            tags: [0; SLOTS],
            range_key,
            range_tag,
        };
        self.held += 1;
        self.page_bytes += bytes;
        true
    }

    /// Frees the object of `footprint` bytes (as allocated, before its class rounds it up)
    /// at `place` (`page << SLOT_BITS | slot`); returns a page to hand back to the range
    /// engine, if any.
    #[inline(always)]
    pub fn free(
        &mut self,
        offset: u64,
        footprint: u64,
        place: u32,
        tag: u32,
    ) -> Result<Option<PageRelease>, EngineError> {
        let page_idx = place >> SLOT_BITS;
        let slot = (place & (SLOTS as u32 - 1)) as usize;
        let Some(page) = self.pages.get_mut(page_idx as usize) else {
            return Err(EngineError::AlreadyFreed { offset });
        };
        // A tag is never 0: so a free slot, a slot past the page's objects or a vacant
        // record never matches. The class too: once tags wrap, a stale handle of another
        // class may name this slot's offset with its tag. The class holds the footprints
        // in `(size - 2^step_shift, size]`; one past `size` wraps and is refused with those
        // below.
        let stored = &mut page.tags[slot];
        let size = u64::from(page.footprint);
        if tag == 0
            || *stored != tag
            || page.base + slot as u64 * size != offset
            || size.wrapping_sub(footprint) >> page.step_shift != 0
        {
            return Err(EngineError::AlreadyFreed { offset });
        }
        *stored = 0;
        let was_full = page.free_bits == 0;
        page.free_bits |= 1 << slot;
        page.used -= 1;
        if was_full {
            page.partial_pos = self.classes[usize::from(page.class)].push(page_idx);
        }
        if page.used > 0 {
            return Ok(None);
        }
        // The class's only listed page emptied and no page is set aside: it stays listed as
        // the class's kept empty page, and the next allocation takes it as it would take a
        // page set aside. No call, no list change.
        let c = &self.classes[usize::from(page.class)];
        if c.cached_empty == NIL && c.list.len() == 2 {
            debug_assert_eq!(c.top, page_idx, "a page with room is listed");
            return Ok(None);
        }
        Ok(self.retire(page_idx))
    }

    /// A page just became empty with other pages listed or one set aside: out of the list
    /// and set aside; the class's older empty page (set aside, or kept listed first) goes back.
    #[inline(never)]
    fn retire(&mut self, page_idx: u32) -> Option<PageRelease> {
        let class = usize::from(self.pages[page_idx as usize].class);
        let kept = self.kept_listed(class).filter(|&p| p != page_idx);
        self.unlist(page_idx);
        let older = std::mem::replace(&mut self.classes[class].cached_empty, page_idx);
        if older != NIL {
            return Some(self.remove_page(older));
        }
        let kept = kept?;
        self.unlist_first(kept);
        Some(self.remove_page(kept))
    }

    /// The class's kept empty page, if it keeps one listed: its first page, when it holds
    /// no object.
    #[inline]
    fn kept_listed(&self, class: usize) -> Option<u32> {
        self.classes[class]
            .first()
            .filter(|&p| self.pages[p as usize].used == 0)
    }

    /// Takes the first page off its class's list keeping the order of the rest, so the
    /// page that serves next is the one it would be had the page been set aside.
    fn unlist_first(&mut self, page_idx: u32) {
        let page = &mut self.pages[page_idx as usize];
        debug_assert_eq!(page.partial_pos, 1, "the first page of its list");
        page.partial_pos = NIL;
        let c = &mut self.classes[usize::from(page.class)];
        c.list.remove(1);
        c.top = c.list[c.list.len() - 1];
        for (pos, &p) in c.list.iter().enumerate().skip(1) {
            self.pages[p as usize].partial_pos = pos as u32;
        }
    }

    /// Gives back every cached empty page (set aside or kept listed).
    pub fn trim(&mut self) -> Vec<PageRelease> {
        let mut released = Vec::new();
        for class in 0..self.classes.len() {
            let aside = std::mem::replace(&mut self.classes[class].cached_empty, NIL);
            if aside != NIL {
                released.push(self.remove_page(aside));
            }
            if let Some(kept) = self.kept_listed(class) {
                self.unlist_first(kept);
                released.push(self.remove_page(kept));
            }
        }
        released
    }

    /// Bytes of pages held (in use and cached).
    pub fn page_bytes(&self) -> u64 {
        self.page_bytes
    }

    /// Number of pages held.
    pub fn page_count(&self) -> usize {
        self.held
    }

    /// Objects in use and the bytes of their class (a walk over the pages, for `validate`).
    pub fn live_objects(&self) -> (u64, u64) {
        self.pages.iter().fold((0, 0), |(n, bytes), p| {
            (
                n + u64::from(p.used),
                bytes + u64::from(p.used) * u64::from(p.footprint),
            )
        })
    }

    /// Test helper: a held-page count one too high, a drift only this tier's `validate` sees.
    #[cfg(test)]
    pub(super) fn drift_for_test(&mut self) {
        self.held += 1;
    }

    /// Test helper: the first held page names another range block (its tag moved on), a
    /// drift only the engine's `validate` sees.
    #[cfg(test)]
    pub(super) fn page_record_drift_for_test(&mut self) {
        let p = self.pages.iter_mut().find(|p| p.objects != 0);
        p.expect("a held page").range_tag += 1;
    }

    /// Checks every invariant listed on the type.
    pub fn validate(&self) -> Result<(), EngineError> {
        let fail = |m: String| Err(EngineError::Corrupt(format!("slab: {m}")));
        let mut on_chain = vec![false; self.pages.len()];
        let mut v = self.vacant;
        while v != NIL {
            match on_chain.get_mut(v as usize) {
                Some(seen) if !*seen && self.pages[v as usize].objects == 0 => *seen = true,
                _ => return fail(format!("vacancy chain is broken at {v}")),
            }
            v = self.pages[v as usize].partial_pos;
        }
        let mut bytes = 0;
        let mut held = 0;
        for (i, p) in self.pages.iter().enumerate() {
            if p.objects == 0 {
                if !on_chain[i] || p.tags.iter().any(|&t| t != 0) || p.free_bits != 0 {
                    return fail(format!("vacant record {i} is off the chain or has tags"));
                }
                continue;
            }
            held += 1;
            bytes += p.bytes();
            if on_chain[i] {
                return fail(format!("held page {i} is on the vacancy chain"));
            }
            // A footprint `class_of` takes (it asserts a non-zero multiple of the granule),
            // of a class this layer has (its list is read below).
            let footprint = u64::from(p.footprint);
            if usize::from(p.objects) > SLOTS
                || p.free_bits >> (p.objects - 1) > 1
                || footprint == 0
                || footprint % CLASS_GRANULE != 0
                || footprint > MAX_SLAB_FOOTPRINT
                || usize::from(p.class) >= self.classes.len()
                || class_of(footprint) != (usize::from(p.class), footprint)
                || p.step_shift != class_step_shift(usize::from(p.class))
            {
                return fail(format!(
                    "page {i}: {} objects of {footprint} bytes (class {}, step 2^{}), free map {:#x}",
                    p.objects, p.class, p.step_shift, p.free_bits
                ));
            }
            // The page is the range block `page_shape` asked for, and a live one (a range
            // tag is never 0). The footprint was checked above: its class has a shape.
            let shape = Self::page_shape(footprint);
            if shape.is_none_or(|s| u32::from(p.objects) != s.objects || p.base % s.align != 0)
                || p.range_tag == 0
            {
                return fail(format!(
                    "page {i}: {} objects at {} (range tag {}), its shape is {shape:?}",
                    p.objects, p.base, p.range_tag
                ));
            }
            if p.free_bits.count_ones() + u32::from(p.used) != u32::from(p.objects) {
                return fail(format!(
                    "page {i}: {} free + {} used",
                    p.free_bits.count_ones(),
                    p.used
                ));
            }
            for (slot, &t) in p.tags.iter().enumerate() {
                let in_use = slot < usize::from(p.objects) && p.free_bits & (1 << slot) == 0;
                if (t != 0) != in_use {
                    return fail(format!("page {i} slot {slot}: tag {t}, in use {in_use}"));
                }
            }
            let c = &self.classes[usize::from(p.class)];
            let listed =
                p.partial_pos != 0 && c.list.get(p.partial_pos as usize) == Some(&(i as u32));
            let cached = c.cached_empty == i as u32;
            let should_list = p.used < p.objects && !cached;
            if listed != should_list || (cached && p.used != 0) {
                return fail(format!("page {i} is misfiled (used {})", p.used));
            }
            // One empty page per class: a second would be held until `trim`, which gives
            // back only the page set aside and an empty page listed first.
            if listed && p.used == 0 && (p.partial_pos != 1 || c.cached_empty != NIL) {
                return fail(format!(
                    "page {i} is a second empty page of class {}",
                    p.class
                ));
            }
        }
        if held != self.held {
            return fail(format!("{held} pages held, counter says {}", self.held));
        }
        for (n, c) in self.classes.iter().enumerate() {
            if c.list.first() != Some(&NIL) || c.list.last() != Some(&c.top) {
                return fail(format!("class {n}: list lost its sentinel or top"));
            }
            // Each held page's check above sees only its own class's cached page: one named
            // by another class, or a vacant record, would be taken by this class's next
            // allocation, and the counts below miss it while a full page is held.
            if c.cached_empty != NIL
                && self
                    .pages
                    .get(c.cached_empty as usize)
                    .is_none_or(|p| p.objects == 0 || usize::from(p.class) != n)
            {
                return fail(format!(
                    "class {n}: cached page {} is not one of its own",
                    c.cached_empty
                ));
            }
            // With each page's own check above, positions and entries match one to one.
            for (pos, &page) in c.pages().iter().enumerate() {
                match self.pages.get(page as usize) {
                    Some(p) if p.partial_pos as usize == pos + 1 && usize::from(p.class) == n => {}
                    _ => return fail(format!("class {n}: entry {} names page {page}", pos + 1)),
                }
            }
        }
        let listed: usize = self.classes.iter().map(|c| c.pages().len()).sum();
        let cached = self
            .classes
            .iter()
            .filter(|c| c.cached_empty != NIL)
            .count();
        if listed + cached > self.held || bytes != self.page_bytes {
            return fail("class lists name more pages than exist".into());
        }
        // No two pages share a byte: objects of one would be handed out twice.
        let mut spans: Vec<(u64, u64)> = self.held_pages().map(|(b, n, _, _)| (b, n)).collect();
        spans.sort_unstable();
        for w in spans.windows(2) {
            if w[0].0 + w[0].1 > w[1].0 {
                return fail(format!("pages at {} and {} overlap", w[0].0, w[1].0));
            }
        }
        Ok(())
    }

    /// Each held page as (base, bytes, range key, range tag): the range block it came from.
    pub(crate) fn held_pages(&self) -> impl Iterator<Item = (u64, u64, u32, u32)> + '_ {
        self.pages
            .iter()
            .filter(|p| p.objects != 0)
            .map(|p| (p.base, p.bytes(), p.range_key, p.range_tag))
    }

    /// Takes a page with room (whose position is current) off its class's list.
    fn unlist(&mut self, page_idx: u32) {
        let page = &mut self.pages[page_idx as usize];
        let pos = page.partial_pos;
        if pos == NIL {
            return;
        }
        page.partial_pos = NIL;
        let c = &mut self.classes[usize::from(page.class)];
        if let Some(moved) = c.swap_remove(pos) {
            self.pages[moved as usize].partial_pos = pos;
        }
    }

    fn remove_page(&mut self, page_idx: u32) -> PageRelease {
        let i = page_idx as usize;
        let p = std::mem::replace(&mut self.pages[i], SlabPage::VACANT);
        debug_assert!(p.used == 0, "only empty pages go back");
        self.pages[i].partial_pos = self.vacant;
        self.vacant = page_idx;
        // A held page is in both sums (debug check only; `validate` reports a drift).
        debug_assert!(
            self.held > 0 && self.page_bytes >= p.bytes(),
            "page sums drifted"
        );
        self.held -= 1;
        self.page_bytes -= p.bytes();
        PageRelease {
            base: p.base,
            range_key: p.range_key,
            range_tag: p.range_tag,
            bytes: p.bytes(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Allocates as the engine does: a fresh page only when no page of the class has room,
    /// the `pages + 1`-th, at `pages + 1` MiB with range key and tag `pages + 1`.
    fn alloc_adding(s: &mut SlabAllocator, f: u64, tag: u32, pages: &mut u32) -> (u64, u32) {
        if let Some(got) = s.alloc(f, tag) {
            return got;
        }
        *pages += 1;
        s.add_page(f, u64::from(*pages) << 20, *pages, *pages);
        s.alloc(f, tag).expect("a fresh page has room")
    }

    #[test]
    fn classes_round_up_by_less_than_an_eighth() {
        // Exact up to 1 KiB, then eight steps per doubling.
        assert_eq!(class_of(64), (0, 64));
        assert_eq!(class_of(1024), (15, 1024));
        assert_eq!(class_of(1088), (16, 1152));
        assert_eq!(class_of(2048), (23, 2048));
        assert_eq!(class_of(2112), (24, 2304));
        assert_eq!(class_of(100_032), (68, 106_496));
        assert_eq!(class_of(MAX_SLAB_FOOTPRINT), (79, MAX_SLAB_FOOTPRINT));
        let mut last = (0, 0);
        for f in (64..=MAX_SLAB_FOOTPRINT).step_by(64) {
            let (class, size) = class_of(f);
            assert!(size >= f && (size - f) * 8 < f, "{f} -> {size}");
            assert!(f <= EXACT_MAX || size % 128 == 0, "{f} -> {size}");
            // Up to EXACT_MAX every footprint is its own class.
            assert!(
                f > EXACT_MAX || (class, size) == ((f / 64 - 1) as usize, f),
                "{f}"
            );
            assert!(class == last.0 && size == last.1 || class == last.0 + 1 || f == 64);
            last = (class, size);
            let PageShape {
                bytes,
                objects,
                align,
            } = SlabAllocator::page_shape(f).unwrap();
            assert!((1..=64).contains(&objects) && bytes == u64::from(objects) * size);
            assert!(f <= EXACT_MAX || (objects >= 4 && align == 128));
            // Above EXACT_MAX a page holds what fits in LARGE_PAGE, 4 to 64 objects.
            let filled = bytes + size > LARGE_PAGE || objects == 64;
            assert!(
                f <= EXACT_MAX || (bytes <= LARGE_PAGE.max(4 * size) && filled),
                "{f}"
            );
        }
    }

    #[test]
    fn a_class_step_spans_exactly_the_footprints_of_its_class() {
        // `free` tells a stale handle of another class by the step alone.
        for f in (64..=MAX_SLAB_FOOTPRINT).step_by(64) {
            let (class, size) = class_of(f);
            let step = 1 << class_step_shift(class);
            assert!(size - f < step, "{f}: class {class} of {size}, step {step}");
            let below = size - step;
            assert!(below == 0 || class_of(below).0 + 1 == class, "{f}: {below}");
        }
    }

    #[test]
    fn pages_fill_release_and_refuse_stale_places() {
        // 1024-byte objects: 32 per 32 KiB page.
        let mut s = SlabAllocator::new(1024);
        let PageShape { bytes, objects, .. } = SlabAllocator::page_shape(1024).unwrap();
        assert_eq!((bytes, objects), (32 << 10, 32));
        assert!(s.alloc(1024, 1).is_none(), "no page yet");
        let mut pages = 0;
        let mut live = vec![];
        for tag in 1..=2 * objects {
            let (off, place) = alloc_adding(&mut s, 1024, tag, &mut pages);
            live.push((off, place, tag));
            s.validate().unwrap();
        }
        assert_eq!(pages, 2);
        assert!(s.alloc(1024, 99).is_none(), "both pages full");
        let offsets: std::collections::BTreeSet<u64> = live.iter().map(|l| l.0).collect();
        assert_eq!(offsets.len(), live.len());
        // Wrong tag, wrong offset, slot past the page's objects, page never held, a
        // footprint of another class (below, above, none).
        let (off, place, tag) = live[3];
        for (o, f, p, t) in [
            (off, 1024, place, tag + 1),
            (off + 1024, 1024, place, tag),
            (off, 1024, place | 40, tag),
            (off, 1024, 5 << SLOT_BITS, tag),
            (off, 1024, place, 0),
            (off, 960, place, tag),
            (off, 1088, place, tag),
            (off, 0, place, tag),
        ] {
            assert!(matches!(
                s.free(o, f, p, t),
                Err(EngineError::AlreadyFreed { .. })
            ));
        }
        s.validate().unwrap();
        // Emptying both pages caches the first and releases the second.
        let mut released = vec![];
        for &(o, p, t) in &live {
            released.extend(s.free(o, 1024, p, t).unwrap());
            s.validate().unwrap();
        }
        assert_eq!(released.len(), 1);
        assert!(s.free(off, 1024, place, tag).is_err(), "double free");
        assert_eq!(s.page_count(), 1);
        // The cached page serves again; the stale handle to the same slot stays refused.
        let (o2, p2) = s.alloc(1024, 500).unwrap();
        assert!(s.free(o2, 1024, p2, 1).is_err());
        s.free(o2, 1024, p2, 500).unwrap();
        assert_eq!(s.trim().len(), 1);
        assert_eq!((s.page_count(), s.page_bytes()), (0, 0));
        s.validate().unwrap();
    }

    #[test]
    fn a_footprint_past_the_largest_is_refused_not_a_panic() {
        // Both are public: `alloc` indexed the class list past its end, and `add_page`
        // after the refusal its doc asks for did the same.
        let mut s = SlabAllocator::new(1024);
        assert_eq!(s.alloc(2048, 1), None);
        assert!(!s.add_page(2048, 0, 1, 1));
        assert_eq!(
            (s.alloc(2048, 1), s.page_count(), s.page_bytes()),
            (None, 0, 0)
        );
        s.validate().unwrap();
        // The largest it serves still takes a page.
        assert!(s.add_page(1024, 0, 1, 1));
        assert_eq!(s.alloc(1024, 2), Some((0, 0)));
        s.validate().unwrap();
    }

    #[test]
    fn a_footprint_no_class_takes_is_refused_not_a_panic() {
        // `class_of` takes a non-zero multiple of the granule (it asserts so): `alloc` and
        // `add_page`, both public, passed 0 or 100 straight to it and panicked.
        let mut s = SlabAllocator::new(1024);
        for footprint in [0, 100, CLASS_GRANULE + 1] {
            assert_eq!(s.alloc(footprint, 1), None, "{footprint}");
            assert!(!s.add_page(footprint, 0, 1, 1), "{footprint}");
        }
        assert_eq!((s.page_count(), s.page_bytes()), (0, 0));
        s.validate().unwrap();
        // The smallest footprint it serves still takes a page.
        assert!(s.add_page(CLASS_GRANULE, 0, 1, 1));
        assert_eq!(s.alloc(CLASS_GRANULE, 2), Some((0, 0)));
        s.validate().unwrap();
    }

    #[test]
    fn page_shape_of_a_footprint_no_class_holds_is_none_not_a_panic() {
        // `class_of` takes a non-zero multiple of the granule: 0 and 100 panicked (its
        // assertion), and a footprint past the largest got a page of four objects (4 TiB
        // for 1 TiB), though no class holds it. What `alloc` refuses, with no allocator.
        for f in [0, 65, 100, MAX_SLAB_FOOTPRINT + 64, 1 << 40, u64::MAX] {
            assert_eq!(SlabAllocator::page_shape(f), None, "{f}");
        }
        let largest = SlabAllocator::page_shape(MAX_SLAB_FOOTPRINT).unwrap();
        assert_eq!((largest.objects, largest.align), (4, 128));
        assert_eq!(
            SlabAllocator::page_shape(64),
            Some(PageShape {
                bytes: 4096,
                objects: 64,
                align: 64
            })
        );
    }

    #[test]
    fn a_class_holding_one_object_at_a_time_keeps_its_page_listed() {
        // 64 KiB objects: 4 per page.
        let f = 64 << 10;
        let mut s = SlabAllocator::new(f);
        s.add_page(f, 0, 1, 1);
        let (o, p) = s.alloc(f, 1).unwrap();
        for tag in 2..10 {
            // The page empties and stays listed: the next object takes the same slot.
            assert_eq!(s.free(o, f, p, tag - 1).unwrap(), None);
            s.validate().unwrap();
            assert_eq!(s.classes[class_of(f).0].list.len(), 2);
            assert_eq!(s.alloc(f, tag).unwrap(), (o, p));
            s.validate().unwrap();
        }
        assert_eq!(s.free(o, f, p, 9).unwrap(), None);
        assert_eq!((s.page_count(), s.trim().len(), s.page_count()), (1, 1, 0));
        s.validate().unwrap();
    }

    #[test]
    fn a_kept_page_goes_back_when_another_empties_and_the_order_holds() {
        // 64 KiB objects: 4 per page.
        let f = 64 << 10;
        let class = class_of(f).0;
        let mut s = SlabAllocator::new(f);
        // Pages 0 to 3, each filled (so each leaves the list) before the next is added.
        let mut added = 0;
        let mut pages: Vec<Vec<_>> = (0..4u32)
            .map(|page| {
                let objs: Vec<_> = (0..4)
                    .map(|i| {
                        let t = 10 * page + i + 1;
                        (alloc_adding(&mut s, f, t, &mut added), t)
                    })
                    .collect();
                assert!(objs.iter().all(|((_, p), _)| p >> SLOT_BITS == page));
                objs
            })
            .collect();
        // Page 0 emptied alone in its list: kept listed first.
        for ((o, p), t) in pages.remove(0) {
            assert_eq!(s.free(o, f, p, t).unwrap(), None);
        }
        // One object of each other page freed: they come back above the kept page, 1 then
        // 2 then 3.
        for objs in &mut pages {
            let ((o, p), t) = objs.pop().unwrap();
            s.free(o, f, p, t).unwrap();
        }
        assert_eq!(s.classes[class].pages(), &[0, 1, 2, 3]);
        s.validate().unwrap();
        // Page 3 empties: it is set aside, page 0 goes back, and 1 and 2 keep their order
        // (page 2 serves next, as if page 0 had been set aside all along).
        let mut released = vec![];
        for ((o, p), t) in pages.pop().unwrap() {
            released.extend(s.free(o, f, p, t).unwrap());
            s.validate().unwrap();
        }
        assert_eq!(released.len(), 1);
        assert_eq!(released[0].base, 1 << 20);
        assert_eq!(s.classes[class].pages(), &[1, 2]);
        assert_eq!(
            (s.classes[class].top, s.classes[class].cached_empty),
            (2, 3)
        );
        // The rest: page 2 empties and page 3 goes back; page 1 empties last, alone in the
        // list but with page 2 set aside, so it is set aside and page 2 goes back.
        let mut released = vec![];
        for objs in pages.into_iter().rev() {
            for ((o, p), t) in objs {
                released.extend(s.free(o, f, p, t).unwrap());
                s.validate().unwrap();
            }
        }
        let bases: Vec<u64> = released.iter().map(|r| r.base).collect();
        assert_eq!(bases, [4 << 20, 3 << 20]);
        assert_eq!((s.page_count(), s.classes[class].cached_empty), (1, 1));
        assert_eq!(s.trim().len(), 1);
        assert_eq!(s.page_count(), 0);
        s.validate().unwrap();
    }

    #[test]
    fn released_page_records_are_reused_and_stale_handles_stay_refused() {
        // 64 KiB objects: 4 per page, every tag in the record's first line.
        let f = 64 << 10;
        let mut s = SlabAllocator::new(f);
        let mut pages = 0;
        let live: Vec<_> = (1..=12)
            .map(|t| (alloc_adding(&mut s, f, t, &mut pages), t))
            .collect();
        assert_eq!(pages, 3);
        // Empty the three pages: one is cached, two go back and their records fall vacant.
        let mut released = vec![];
        for &((o, p), t) in &live {
            released.extend(s.free(o, f, p, t).unwrap());
        }
        assert_eq!(released.len(), 2);
        s.validate().unwrap();
        // The cached page serves first, then new pages take the vacant records rather than
        // growing the table.
        let fresh: Vec<_> = (20..32)
            .map(|t| (alloc_adding(&mut s, f, t, &mut pages), t))
            .collect();
        assert_eq!((pages, s.pages.len()), (5, 3));
        s.validate().unwrap();
        // A handle from a released page names a reused record: refused all the same.
        for &((o, p), t) in &live {
            assert!(s.free(o, f, p, t).is_err());
        }
        let mut released = 0;
        for &((o, p), t) in &fresh {
            released += s.free(o, f, p, t).unwrap().into_iter().count();
            s.validate().unwrap();
        }
        assert_eq!((released, s.page_count()), (2, 1));
        assert_eq!(s.trim().len(), 1);
        assert_eq!((s.page_count(), s.page_bytes()), (0, 0));
        s.validate().unwrap();
    }

    #[test]
    fn validate_catches_a_cached_page_of_another_class_or_a_vacant_record() {
        // One full page of 64 KiB objects (neither listed nor cached) and one vacant record:
        // no count gives a stray cached page away, each must be checked on its own.
        let build = || {
            let f = 64 << 10;
            let mut s = SlabAllocator::new(f);
            let mut pages = 0;
            let objs: Vec<_> = (1..=8)
                .map(|t| (alloc_adding(&mut s, f, t, &mut pages), t))
                .collect();
            let mut released = 0;
            for &((o, p), t) in objs.iter().filter(|((_, p), _)| p >> SLOT_BITS == 0) {
                released += s.free(o, f, p, t).unwrap().into_iter().count();
            }
            assert_eq!((released, s.page_count(), s.vacant), (0, 2, NIL));
            // Page 0 emptied alone in its list: kept listed. Trim it to a vacant record.
            assert_eq!(s.trim().len(), 1);
            assert_eq!((s.page_count(), s.vacant), (1, 0));
            s.validate().unwrap();
            s
        };
        let drifts: [crate::engine::Drift<SlabAllocator>; 2] = [
            ("a class's cached page is a vacant record", |s| {
                s.classes[0].cached_empty = s.vacant
            }),
            ("a class's cached page is another class's full page", |s| {
                s.classes[0].cached_empty = 1
            }),
        ];
        // (Either one, let pass, sends the class's next allocation into a page with no free
        // object: a slot past the tags, a panic.)
        crate::engine::assert_each_drift_reported(build, &drifts, SlabAllocator::validate);
    }

    #[test]
    fn validate_catches_each_kind_of_drift() {
        // Three pages of 1024-byte objects: one partly used (listed), one emptied and cached,
        // one emptied and given back (a vacant record).
        let build = || {
            let mut s = SlabAllocator::new(1024);
            let mut added = 0;
            let mut by_page = std::collections::BTreeMap::<u32, Vec<_>>::new();
            for tag in 1..=96 {
                let (o, place) = alloc_adding(&mut s, 1024, tag, &mut added);
                by_page
                    .entry(place >> SLOT_BITS)
                    .or_default()
                    .push((o, place, tag));
            }
            let pages: Vec<_> = by_page.into_values().collect();
            let mut released = 0;
            for &(o, place, tag) in pages[0].iter().chain(&pages[1]).chain(&pages[2][..5]) {
                released += s.free(o, 1024, place, tag).unwrap().into_iter().count();
            }
            assert_eq!((released, s.page_count()), (1, 2));
            s.validate().unwrap();
            s
        };
        // The partly used page, and its class's cached empty page.
        fn partial(s: &SlabAllocator) -> usize {
            s.pages
                .iter()
                .position(|p| p.used > 0 && p.used < p.objects)
                .unwrap()
        }
        fn cached(s: &SlabAllocator) -> u32 {
            s.classes[usize::from(s.pages[partial(s)].class)].cached_empty
        }
        let corruptions: [crate::engine::Drift<SlabAllocator>; 21] = [
            ("held counter", SlabAllocator::drift_for_test),
            ("byte counter", |s| s.page_bytes += 1024),
            ("free bit of a used object", |s| {
                let i = partial(s);
                let used = !s.pages[i].free_bits & s.pages[i].free_bits.wrapping_add(1);
                s.pages[i].free_bits |= used;
            }),
            ("free bit past the objects", |s| {
                let i = partial(s);
                s.pages[i].free_bits |= 1 << s.pages[i].objects;
            }),
            ("used count", |s| {
                let i = partial(s);
                s.pages[i].used -= 1;
            }),
            ("tag of a used object cleared", |s| {
                let i = partial(s);
                let slot = (!s.pages[i].free_bits).trailing_zeros() as usize;
                s.pages[i].tags[slot] = 0;
            }),
            ("page in another class", |s| {
                let i = partial(s);
                s.pages[i].class += 1;
            }),
            ("step of another class", |s| {
                let i = partial(s);
                s.pages[i].step_shift += 1;
            }),
            ("tag in a vacant record", |s| {
                let v = s.vacant as usize;
                s.pages[v].tags[0] = 5;
            }),
            ("a cycle in the vacancy chain", |s| {
                let v = s.vacant;
                s.pages[v as usize].partial_pos = v;
            }),
            ("vacancy chain into a held page", |s| {
                s.vacant = partial(s) as u32
            }),
            ("listed page dropped from its class", |s| {
                let c = s.pages[partial(s)].class as usize;
                s.classes[c].list.pop();
                s.classes[c].top = NIL;
            }),
            ("cached page in use", |s| {
                let c = cached(s) as usize;
                s.pages[c].used = 1;
                s.pages[c].free_bits &= !1;
                s.pages[c].tags[0] = 5;
            }),
            ("cached page forgotten", |s| {
                let c = s.pages[partial(s)].class as usize;
                s.classes[c].cached_empty = NIL;
            }),
            // Every page filed where it belongs, but the class keeps two empty ones.
            ("cached page listed behind the partly used one", |s| {
                let (p, c) = (partial(s), cached(s));
                let class = &mut s.classes[s.pages[p].class as usize];
                class.cached_empty = NIL;
                s.pages[c as usize].partial_pos = class.push(c);
            }),
            ("two pages over the same bytes", |s| {
                let (p, c) = (partial(s), cached(s) as usize);
                s.pages[c].base = s.pages[p].base + 1024;
            }),
            ("a page off its alignment", |s| {
                let p = partial(s);
                s.pages[p].base += 64;
            }),
            ("a page with no range tag", |s| {
                let p = partial(s);
                s.pages[p].range_tag = 0;
            }),
            // `class_of` asserted on it: a panic in debug builds, not a report.
            ("a page of no footprint", |s| {
                let p = partial(s);
                s.pages[p].footprint = 0;
            }),
            // Filed in its own class, shaped as that class's pages are, but a class past
            // this layer's last: reading its list panicked.
            ("a page of a class past the slabs' largest", |s| {
                let c = cached(s) as usize;
                let (class, footprint) = class_of(2048);
                let PageShape { bytes, objects, .. } =
                    SlabAllocator::page_shape(footprint).unwrap();
                s.page_bytes = s.page_bytes - s.pages[c].bytes() + bytes;
                let page = &mut s.pages[c];
                page.footprint = footprint as u32;
                page.class = class as u8;
                page.objects = objects as u8;
                page.free_bits = !0 >> (64 - objects);
            }),
            // Counts, bits and bytes agree with each other, not with the page's shape.
            ("a page of another shape", |s| {
                let c = cached(s) as usize;
                s.pages[c].objects -= 1;
                s.pages[c].free_bits >>= 1;
                s.page_bytes -= 1024;
            }),
        ];
        crate::engine::assert_each_drift_reported(build, &corruptions, SlabAllocator::validate);
    }

    #[test]
    fn the_first_listed_page_emptying_beside_others_is_set_aside_not_given_back() {
        // 64 KiB objects: 4 per page. Pages 0 and 1 listed in that order, both partly used;
        // page 0 empties. It is no kept page (others are listed): it is set aside, and
        // nothing goes back: page 1 still holds objects.
        let f = 64 << 10;
        let class = class_of(f).0;
        let mut s = SlabAllocator::new(f);
        let mut added = 0;
        let mut live: Vec<_> = (1..=8)
            .map(|t| (alloc_adding(&mut s, f, t, &mut added), t))
            .collect();
        assert_eq!(added, 2);
        // One object of page 0, then of page 1: both back in the list, 0 first.
        for i in [3, 6] {
            let ((o, p), t) = live.remove(i);
            assert_eq!(s.free(o, f, p, t).unwrap(), None);
        }
        assert_eq!(s.classes[class].pages(), &[0, 1]);
        for ((o, p), t) in live.drain(..3) {
            assert_eq!(s.free(o, f, p, t).unwrap(), None);
            s.validate().unwrap();
        }
        assert_eq!(s.classes[class].pages(), &[1]);
        assert_eq!((s.classes[class].cached_empty, s.page_count()), (0, 2));
        // Page 1's objects are still its own.
        for ((o, p), t) in live {
            assert_eq!(p >> SLOT_BITS, 1);
            s.free(o, f, p, t).unwrap();
            s.validate().unwrap();
        }
    }
}
