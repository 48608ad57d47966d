//! Slabs for small footprints: O(1) allocate and free, one size class per footprint.
//!
//! Footprints under the carve rule are multiples of 64, so every footprint up to
//! the slab limit gets its own class and a slab object wastes nothing beyond the
//! rule itself. Pages come from the range engine and go back to it when empty
//! (one empty page per class is kept to avoid thrashing on alloc/free pairs).

use super::{EngineError, NIL};
use slab::Slab;
use smallvec::SmallVec;

/// The granule of footprints: classes are `64, 128, 192, ...`.
pub const CLASS_GRANULE: u64 = 64;
/// Bits of an object's slot in a handle: a page holds at most 64 objects (see `page_shape`).
pub const SLOT_BITS: u32 = 6;
/// Pages the layer may hold at once, so a page index and a slot fit in 31 bits.
pub const MAX_PAGES: usize = 1 << (31 - SLOT_BITS);

/// One page of objects of a single footprint.
#[derive(Debug)]
struct SlabPage {
    /// Offset of the page in the range (aligned to 128 when the footprint is a multiple of 128).
    base: u64,
    /// Bytes taken from the range.
    bytes: u64,
    /// Range-engine key and tag, to give the page back.
    range_key: u32,
    range_tag: u32,
    /// Class index.
    class: u32,
    /// Objects in use; `0 ..= objects`.
    used: u32,
    /// Object count.
    objects: u32,
    /// Bit `i` set iff object `i` is free; bits past `objects` are clear.
    free_bits: SmallVec<[u64; 2]>,
    /// Allocation tag of each object while in use (0 when free), to catch stale handles.
    tags: Vec<u32>,
    /// Position in its class's `partial` list, or `NIL` when full (or cached empty).
    partial_pos: u32,
}

#[derive(Debug, Default)]
struct SizeClass {
    /// Pages with at least one free object; the last one serves next.
    partial: Vec<u32>,
    /// A wholly free page kept back from the range engine.
    cached_empty: Option<u32>,
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
}

/// Slabs for footprints up to `max_footprint`.
///
/// Invariants (checked by [`SlabAllocator::validate`]):
/// - a page is in its class's `partial` list iff `0 < used < objects`, or `used == 0`
///   and it is not the class's cached empty page, which never happens outside a call
///   (empty pages are released or cached at once);
/// - `used` equals the number of clear bits below `objects` in `free_bits`;
/// - `tags[i] != 0` iff object `i` is in use.
#[derive(Debug)]
pub struct SlabAllocator {
    max_footprint: u64,
    classes: Vec<SizeClass>,
    pages: Slab<SlabPage>,
    /// Bytes of all pages held (in use and cached).
    page_bytes: u64,
}

impl SlabAllocator {
    /// Slabs for footprints up to `max_footprint` (a multiple of 64; 0 turns slabs off).
    pub fn new(max_footprint: u64) -> Self {
        let max_footprint = max_footprint / CLASS_GRANULE * CLASS_GRANULE;
        Self {
            max_footprint,
            classes: (0..max_footprint / CLASS_GRANULE)
                .map(|_| SizeClass::default())
                .collect(),
            pages: Slab::new(),
            page_bytes: 0,
        }
    }

    /// Whether a footprint at this start alignment is served by slabs (never once
    /// [`MAX_PAGES`] pages are held, so page indices stay below it).
    #[inline]
    pub fn serves(&self, footprint: u64, align: u64) -> bool {
        // `align` is a power of two: a mask, not a division, on the hot path.
        footprint <= self.max_footprint
            && align <= 128
            && footprint & (align - 1) == 0
            && self.pages.len() < MAX_PAGES
    }

    /// Page geometry for a footprint: (bytes, objects, alignment). At most 64 objects:
    /// 4 KiB of 64-byte objects, else 32 objects up to 64 KiB.
    pub fn page_shape(footprint: u64) -> (u64, u32, u64) {
        let objects = (footprint * 32).clamp(4096, 65536) / footprint;
        debug_assert!(objects <= 1 << SLOT_BITS);
        let align = if footprint % 128 == 0 { 128 } else { 64 };
        (objects * footprint, objects as u32, align)
    }

    /// Takes an object of `footprint` bytes if a page has room: (offset, page, slot).
    #[inline]
    pub fn alloc(&mut self, footprint: u64, tag: u32) -> Option<(u64, u32, u32)> {
        let class = (footprint / CLASS_GRANULE - 1) as usize;
        let c = &mut self.classes[class];
        let page_idx = match c.partial.last() {
            Some(&p) => p,
            None => {
                let p = c.cached_empty.take()?;
                self.pages[p as usize].partial_pos = c.partial.len() as u32;
                c.partial.push(p);
                p
            }
        };
        let page = &mut self.pages[page_idx as usize];
        let (w, word) = page
            .free_bits
            .iter()
            .enumerate()
            .find(|(_, w)| **w != 0)
            .map(|(i, w)| (i, *w))
            .expect("a partial page has a free object");
        let bit = word.trailing_zeros();
        page.free_bits[w] &= !(1 << bit);
        let slot = (w as u32) * 64 + bit;
        page.tags[slot as usize] = tag;
        page.used += 1;
        let offset = page.base + u64::from(slot) * footprint;
        if page.used == page.objects {
            // Full: out of the partial list (it is the last entry).
            page.partial_pos = NIL;
            self.classes[class].partial.pop();
        }
        Some((offset, page_idx, slot))
    }

    /// Adds a fresh page for `footprint` at `base` taken from the range engine.
    pub fn add_page(&mut self, footprint: u64, base: u64, range_key: u32, range_tag: u32) {
        let class = (footprint / CLASS_GRANULE - 1) as usize;
        let (bytes, objects, _) = Self::page_shape(footprint);
        let words = (objects as usize).div_ceil(64);
        let mut free_bits: SmallVec<[u64; 2]> = SmallVec::from_elem(!0u64, words);
        if objects % 64 != 0 {
            free_bits[words - 1] = (1u64 << (objects % 64)) - 1;
        }
        let c = &mut self.classes[class];
        let idx = self.pages.insert(SlabPage {
            base,
            bytes,
            range_key,
            range_tag,
            class: class as u32,
            used: 0,
            objects,
            free_bits,
            tags: vec![0; objects as usize],
            partial_pos: c.partial.len() as u32,
        }) as u32;
        c.partial.push(idx);
        self.page_bytes += bytes;
    }

    /// Frees object `slot` of `page`; returns a page to hand back to the range engine, if any.
    pub fn free(
        &mut self,
        offset: u64,
        page_idx: u32,
        slot: u32,
        tag: u32,
    ) -> Result<Option<PageRelease>, EngineError> {
        let Some(page) = self.pages.get_mut(page_idx as usize) else {
            return Err(EngineError::AlreadyFreed { offset });
        };
        let footprint = (u64::from(page.class) + 1) * CLASS_GRANULE;
        if slot >= page.objects
            || page.base + u64::from(slot) * footprint != offset
            || page.tags[slot as usize] != tag
        {
            return Err(EngineError::AlreadyFreed { offset });
        }
        page.tags[slot as usize] = 0;
        page.free_bits[(slot / 64) as usize] |= 1 << (slot % 64);
        let was_full = page.used == page.objects;
        page.used -= 1;
        let class = page.class as usize;
        if was_full {
            let c = &mut self.classes[class];
            page.partial_pos = c.partial.len() as u32;
            c.partial.push(page_idx);
        }
        if page.used > 0 {
            return Ok(None);
        }
        // Empty: out of the partial list; cache it or give it back.
        self.unlist(page_idx);
        let c = &mut self.classes[class];
        let older = c.cached_empty.replace(page_idx);
        Ok(older.map(|p| self.remove_page(p)))
    }

    /// Gives back every cached empty page.
    pub fn trim(&mut self) -> Vec<PageRelease> {
        let cached: Vec<u32> = self
            .classes
            .iter_mut()
            .filter_map(|c| c.cached_empty.take())
            .collect();
        cached.into_iter().map(|p| self.remove_page(p)).collect()
    }

    /// Bytes of pages held (in use and cached).
    pub fn page_bytes(&self) -> u64 {
        self.page_bytes
    }

    /// Number of pages held.
    pub fn page_count(&self) -> usize {
        self.pages.len()
    }

    /// Checks every invariant listed on the type.
    pub fn validate(&self) -> Result<(), EngineError> {
        let fail = |m: String| Err(EngineError::Corrupt(format!("slab: {m}")));
        let mut bytes = 0;
        for (i, p) in self.pages.iter() {
            bytes += p.bytes;
            let free: u32 = p.free_bits.iter().map(|w| w.count_ones()).sum();
            if free + p.used != p.objects {
                return fail(format!("page {i}: {free} free + {} used", p.used));
            }
            let tagged = p.tags.iter().filter(|t| **t != 0).count() as u32;
            if tagged != p.used {
                return fail(format!("page {i}: {tagged} tags for {} used", p.used));
            }
            let c = &self.classes[p.class as usize];
            let listed = c.partial.get(p.partial_pos as usize) == Some(&(i as u32));
            let cached = c.cached_empty == Some(i as u32);
            let should_list = p.used < p.objects && !cached;
            if listed != should_list || (cached && p.used != 0) {
                return fail(format!("page {i} is misfiled (used {})", p.used));
            }
        }
        let listed: usize = self.classes.iter().map(|c| c.partial.len()).sum();
        let cached = self
            .classes
            .iter()
            .filter(|c| c.cached_empty.is_some())
            .count();
        if listed + cached > self.pages.len() || bytes != self.page_bytes {
            return fail("class lists name more pages than exist".into());
        }
        Ok(())
    }

    fn unlist(&mut self, page_idx: u32) {
        let page = &mut self.pages[page_idx as usize];
        let pos = page.partial_pos;
        if pos == NIL {
            return;
        }
        page.partial_pos = NIL;
        let c = &mut self.classes[page.class as usize];
        c.partial.swap_remove(pos as usize);
        if let Some(&moved) = c.partial.get(pos as usize) {
            self.pages[moved as usize].partial_pos = pos;
        }
    }

    fn remove_page(&mut self, page_idx: u32) -> PageRelease {
        let p = self.pages.remove(page_idx as usize);
        self.page_bytes -= p.bytes;
        PageRelease {
            base: p.base,
            range_key: p.range_key,
            range_tag: p.range_tag,
        }
    }
}
