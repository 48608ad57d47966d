//! Shape slots: per memory kind, a few free segments of large recurring shapes (video
//! frames, model outputs, KV-cache blocks), each taken and given back without the kind lock.
//!
//! A thread cache keeps small segments for its own thread; a large one freed there would be
//! held out of its engine until the same shape came again, and the engine would place
//! everything else around it (caching frames that way cut video utilization to 0.79-0.83,
//! `docs/benchmarks.md`). A shape slot holds its segment only until its chunk's engine is
//! next asked to carve: the kind *drains* the slots holding segments of a chunk into that
//! chunk's engine before it asks the engine for anything (or skips the chunk on a refusal
//! hint that the free would have reset), and drains them all before it grows, trims or
//! frees under its lock. An engine therefore sees each free before any allocation that could
//! search or merge there, as if the free had gone straight to it, while a free followed by
//! an allocation of the same shape (the common case for frames) takes no kind lock at all.
//!
//! One exception, for shapes that have shown they recur: a slot whose shape an allocation
//! has taken back before is *proven*, and a small request (one the thread caches could hold)
//! carving in its chunk leaves it held instead of draining it. The engine then places that
//! request as if the frame were still in use. That is what lets DVPP and host frames, whose
//! chunks also take the packets decoded between two frames, come back from their slots.
//! Placement may then differ from the engine's own, within two bounds: the release budget
//! below still limits what slots hold, and a request that fits nowhere else empties every
//! slot and carves again before the kind grows, so a held frame never costs a block-source
//! call. On the three shared traces peak reserved bytes and block-source calls stayed the
//! same to the byte (`docs/benchmarks.md`, session 37).
//!
//! Slots also hold memory back from the source: a chunk whose last segment waits in a slot is
//! not empty, and would not go back past the release threshold. So a free enters a slot only
//! while the kind's free bytes, counting every slot's segment as free, stay within a budget
//! the caller gives (the release threshold less the kind's free bytes): then no chunk could
//! have gone back had the free gone to the engine.
//!
//! Each slot is one atomic word, `key << 34 | tag << 26 | proven << 25 | units << 2 | state`
//! (the four words share a line, so the tests before a carve and the budget read one line),
//! and an item. A thread that moves the word from `FULL` or `EMPTY` to `BUSY` owns the item
//! and the slot's counters until it stores the word back; nobody blocks while holding
//! `BUSY`, so a drain that finds it waits a few instructions at most (a walk for the
//! figures holds every slot at once, for as long as it reads them). The key is a hash of
//! the shape; a free takes an empty slot if there is one (frames are freed a few at a time,
//! and each comes back), and an allocation takes any slot whose key matches, a hash
//! collision being caught by checking the item itself. `tag` is 8 bits of the item's chunk
//! (its engine id), `units` its footprint in 4 KiB units, rounded up.
//!
//! The words, cells and spin come from the parent's `sync` shim, so `tests/loom_shapes.rs`
//! can compile this very file with loom's and check the protocol over its interleavings.

use super::sync::{fence, spin_wait, AtomicU64, SlotCell};
use std::mem::MaybeUninit;
use std::sync::atomic::Ordering;

/// Slot states, in the low bits of the word.
const EMPTY: u64 = 0;
const FULL: u64 = 1;
const BUSY: u64 = 2;
/// Set by [`ShapeSlots::close`] for good: a put is declined, so nothing can be left in a slot
/// after the pool's last drain.
const CLOSED: u64 = 3;
const STATE: u64 = 3;

/// Whether a slot in `state` holds an item or is about to.
#[inline(always)]
fn in_use(state: u64) -> bool {
    state == FULL || state == BUSY
}
/// Where the key starts in a word.
const KEY_SHIFT: u32 = 34;
/// Where the item's chunk tag starts in a word.
const TAG_SHIFT: u32 = 26;
/// Bits of a word's footprint units, between the state and the proven bit.
const UNIT_BITS: u32 = 23;
/// Set while an allocation has taken the slot's shape back from it at least once; kept
/// while the slot's key stays the same.
const PROVEN: u64 = 1 << 25;
/// Bytes per unit of a word's footprint.
pub(crate) const UNIT: u64 = 4096;
/// Largest footprint a slot takes: its units, rounded up, must fit their bits (one more
/// unit would spill into the proven bit).
pub(crate) const MAX_FOOTPRINT: u64 = ((1 << UNIT_BITS) - 1) * UNIT;
// The largest footprint's units fit, and one byte more would not.
static_assertions::const_assert!(MAX_FOOTPRINT.div_ceil(UNIT) < 1 << UNIT_BITS);
static_assertions::const_assert_eq!((MAX_FOOTPRINT + 1).div_ceil(UNIT), 1 << UNIT_BITS);

/// A word naming `key`, the item's chunk `tag`, its `units` and `state`.
#[inline(always)]
fn word_of(key: u64, tag: u8, units: u64, state: u64) -> u64 {
    key << KEY_SHIFT | u64::from(tag) << TAG_SHIFT | units << 2 | state
}

/// The units of a word.
#[inline(always)]
fn units_of(w: u64) -> u64 {
    (w >> 2) & ((1 << UNIT_BITS) - 1)
}

/// The chunk tag of a word.
#[inline(always)]
fn tag_of(w: u64) -> u8 {
    (w >> TAG_SHIFT) as u8
}

/// Slots per kind (a power of two). Video-1080p-16ch recurs in two large shapes per kind.
pub(crate) const SLOTS: usize = 4;

/// One slot's item and counters, on cache lines of their own; its word is in
/// [`ShapeSlots::words`]. One cell holds all three: whoever holds the slot `BUSY` owns
/// them together.
#[repr(C, align(128))]
struct Slot<T> {
    /// Written and read only by the thread holding the slot `BUSY`.
    body: SlotCell<Body<T>>,
}

/// What a slot's cell holds.
#[repr(C)]
struct Body<T> {
    /// Initialised iff the slot's state is `FULL`, or was `FULL` when the thread holding
    /// `BUSY` took it.
    item: MaybeUninit<T>,
    /// Items taken out by allocations, and put in by frees (displacing or not).
    hits: u64,
    puts: u64,
}

/// What a slot did with a freed item that it could not simply keep.
#[derive(Debug)]
pub(crate) enum Put<T> {
    /// Kept, in an empty slot.
    Kept,
    /// Kept in place of this older item, which the kind must take back (its free was
    /// counted when it came in).
    Displaced(T),
    /// Not kept (the slot was busy): the caller frees it the usual way.
    Declined(T),
}

/// The chunk tags of some slots, a byte per slot: the walk over a kind's chunks tests each
/// chunk against all four at once, rather than one `Option` at a time (about 25 instructions
/// more per walk on random-mix, `docs/benchmarks.md` session 37).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Tags {
    /// Slot `i`'s tag in byte `i`; 0 in the bytes of slots out of the set.
    bytes: u32,
    /// `0xFF` in byte `i` iff slot `i` is in the set.
    held: u32,
}

// One byte per slot in a `u32`.
static_assertions::const_assert_eq!(SLOTS, 4);

impl Tags {
    /// Whether a slot in the set holds an item from a chunk tagged `tag`.
    #[inline(always)]
    pub(crate) fn contains(self, tag: u8) -> bool {
        // A zero byte exactly where a slot in the set has this tag; slots out of the set
        // read 0xFF there. The classic test for a zero byte: exact as to whether there is one.
        let x = (self.bytes ^ (u32::from(tag) * 0x0101_0101)) | !self.held;
        (x.wrapping_sub(0x0101_0101) & !x & 0x8080_8080) != 0
    }

    /// A set of slots' tags: slot `i`'s tag in byte `i` of `bytes`, `0xFF` in byte `i` of
    /// `held` iff slot `i` is in the set.
    #[cfg(test)]
    pub(crate) fn from_bytes(bytes: u32, held: u32) -> Self {
        Self { bytes, held }
    }

    /// Slot `i`'s tag, if the slot is in the set.
    #[cfg(test)]
    pub(crate) fn slot(self, i: usize) -> Option<u8> {
        (self.held >> (8 * i) & 0xFF != 0).then(|| (self.bytes >> (8 * i)) as u8)
    }

    /// Every slot's tag, if in the set.
    #[cfg(test)]
    pub(crate) fn list(self) -> [Option<u8>; SLOTS] {
        std::array::from_fn(|i| self.slot(i))
    }
}

/// Figures of one kind's slots.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct SlotTotals {
    /// Allocations served from a slot.
    pub(crate) hits: u64,
    /// Frees kept in a slot.
    pub(crate) puts: u64,
}

/// The slots of one kind.
pub(crate) struct ShapeSlots<T> {
    /// Each slot's word (see the module docs), all on one line: the test before every
    /// carve, [`any`](Self::any), reads one line, not one per slot.
    words: Words,
    slots: [Slot<T>; SLOTS],
}

/// The slots' words, alone on their line.
#[repr(align(64))]
struct Words([AtomicU64; SLOTS]);

// SAFETY: an item and the counters are only touched by the one thread that holds its slot
// `BUSY` (acquired by a compare-exchange with `Acquire`, released by a `Release` store), so
// sharing the slots shares no unsynchronised access; items move between threads, so `T`
// must be `Send`.
unsafe impl<T: Send> Sync for ShapeSlots<T> {}
// SAFETY: the slots own their items, which are `Send`.
unsafe impl<T: Send> Send for ShapeSlots<T> {}

impl<T> std::fmt::Debug for ShapeSlots<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let states: Vec<u64> = self
            .words
            .0
            .iter()
            .map(|w| w.load(Ordering::Relaxed) & STATE)
            .collect();
        f.debug_struct("ShapeSlots")
            .field("states", &states)
            .finish()
    }
}

/// Key of a shape: a 30-bit hash of length and alignment, never 0 (so a fresh slot's word,
/// 0, names no shape).
#[inline(always)]
pub(crate) fn shape_key(len: u64, align: u64) -> u64 {
    ((len ^ align.rotate_left(48)).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> KEY_SHIFT) | 1 << 29
}

impl<T> Default for ShapeSlots<T> {
    fn default() -> Self {
        Self {
            words: Words(std::array::from_fn(|_| AtomicU64::new(EMPTY))),
            slots: std::array::from_fn(|_| Slot {
                body: SlotCell::new(Body {
                    item: MaybeUninit::uninit(),
                    hits: 0,
                    puts: 0,
                }),
            }),
        }
    }
}

impl<T> ShapeSlots<T> {
    /// The item kept for `key`, if `ok` accepts it (it checks the shape itself: keys can
    /// collide).
    #[inline(always)]
    pub(crate) fn take(&self, key: u64, ok: impl FnOnce(&T) -> bool) -> Option<T> {
        // Plain loads first (one line): a miss costs no read-modify-write.
        let (i, full) = (0..SLOTS)
            .map(|i| (i, self.words.0[i].load(Ordering::Relaxed)))
            .find(|&(_, w)| w >> KEY_SHIFT == key && w & STATE == FULL)?;
        let (word, s) = (&self.words.0[i], &self.slots[i]);
        if word
            .compare_exchange(
                full,
                full ^ FULL ^ BUSY,
                Ordering::Acquire,
                Ordering::Relaxed,
            )
            .is_err()
        {
            return None;
        }
        let item = s.body.with_mut(|p| {
            // SAFETY: this thread holds the slot BUSY: nobody else reads or writes the body
            // until the store below.
            let b = unsafe { &mut *p };
            // SAFETY: the word was FULL, so the item is initialised.
            let item = unsafe { b.item.assume_init_read() };
            if ok(&item) {
                b.hits += 1;
                Some(item)
            } else {
                // The item goes back as it was.
                b.item.write(item);
                None
            }
        });
        let after = match item {
            Some(_) => word_of(key, 0, 0, EMPTY) | PROVEN,
            None => full,
        };
        word.store(after, Ordering::Release);
        item
    }

    /// Keeps `item` (of the shape `key` names, from the chunk `tag` names, `units` of
    /// footprint) in a slot, if the items the slots hold (any it displaces included) and
    /// this one come to at most `budget` units, counted again once the slot is claimed (of
    /// two puts at once into two slots, at least one sees the other's claim, and is declined
    /// if both would not fit). Declines it otherwise, or when the slot it picks is busy or
    /// closed. The slot is an empty one (frames are often freed a few at a time, and each
    /// comes back), else one holding this shape (whose older item it displaces), else the
    /// shape's own by hash (displacing another shape). A slot that keeps its key keeps its
    /// proven bit.
    #[inline(always)]
    pub(crate) fn put(&self, key: u64, tag: u8, units: u64, budget: u64, item: T) -> Put<T> {
        debug_assert!(units < 1 << UNIT_BITS);
        // The slots' units in use, and an empty slot last used by this shape (the common
        // case: a frame comes back to the slot it was taken from), in one short pass; the
        // lowest index first, as `pick` ranks them.
        let mut held = units;
        let mut home = SLOTS;
        for (i, w) in self.words.0.iter().enumerate().rev() {
            let v = w.load(Ordering::Relaxed);
            if in_use(v & STATE) {
                held += units_of(v);
            } else if v & STATE == EMPTY && v >> KEY_SHIFT == key {
                home = i;
            }
        }
        let i = if home < SLOTS { home } else { self.pick(key) };
        let (word, s) = (&self.words.0[i], &self.slots[i]);
        let w = word.load(Ordering::Relaxed);
        let state = w & STATE;
        let proven = if w >> KEY_SHIFT == key { w & PROVEN } else { 0 };
        if held > budget
            || state == BUSY
            || state == CLOSED
            || word
                .compare_exchange(
                    w,
                    word_of(key, tag, units, BUSY) | proven,
                    Ordering::Acquire,
                    Ordering::Relaxed,
                )
                .is_err()
        {
            return Put::Declined(item);
        }
        // Counted again with the slot claimed: two puts that read the words before either
        // claimed its slot both passed the count above. The fences order each claim before
        // its put's second count, so of two claims at once at least one count sees the
        // other's (its units are in the word from the claim on).
        fence(Ordering::SeqCst);
        let mut again = units + if state == FULL { units_of(w) } else { 0 };
        for (j, other) in self.words.0.iter().enumerate() {
            let v = other.load(Ordering::Relaxed);
            if j != i && in_use(v & STATE) {
                again += units_of(v);
            }
        }
        if again > budget {
            // The body is untouched: the word goes back as it was.
            word.store(w, Ordering::Release);
            return Put::Declined(item);
        }
        let old = s.body.with_mut(|p| {
            // SAFETY: this thread holds the slot BUSY: nobody else reads or writes the body
            // until the store below.
            let b = unsafe { &mut *p };
            // SAFETY: the item is initialised iff the word was FULL.
            let old = (state == FULL).then(|| unsafe { b.item.assume_init_read() });
            // The old item, if any, was read out just now.
            b.item.write(item);
            b.puts += 1;
            old
        });
        // The last touch of `self`: the item may hold the pool's last handle, and a take
        // may drop it (and these slots with it) as soon as the word reads FULL.
        word.store(word_of(key, tag, units, FULL) | proven, Ordering::Release);
        match old {
            Some(old) => Put::Displaced(old),
            None => Put::Kept,
        }
    }

    /// The slot a put of shape `key` takes, by rank: an empty one last used by that shape,
    /// an empty one whose shape never came back, another empty one, one holding this
    /// shape (whose older item it displaces), else the shape's own by hash (displacing
    /// another shape). [`put`](Self::put) finds the first rank itself.
    #[inline(never)]
    fn pick(&self, key: u64) -> usize {
        let (mut same, mut empty, mut rank) = (None, None, 3);
        for (i, w) in self.words.0.iter().enumerate() {
            let v = w.load(Ordering::Relaxed);
            if in_use(v & STATE) {
                if v >> KEY_SHIFT == key {
                    same = same.or(Some(i));
                }
            } else if v & STATE == EMPTY {
                let r = if v >> KEY_SHIFT == key {
                    0
                } else if v & PROVEN == 0 {
                    1
                } else {
                    2
                };
                if r < rank {
                    (empty, rank) = (Some(i), r);
                }
            }
        }
        empty.or(same).unwrap_or((key >> 20) as usize & (SLOTS - 1))
    }

    /// Whether any slot may hold an item (a hint: a put may land right after).
    #[inline(always)]
    pub(crate) fn any(&self) -> bool {
        self.words
            .0
            .iter()
            .any(|w| in_use(w.load(Ordering::Relaxed) & STATE))
    }

    /// Holds slot `s` BUSY and calls `f` with its body and state, then stores the word back
    /// in the state `f` returns (`FULL` iff the item is initialised then).
    fn with_slot<R>(
        word: &AtomicU64,
        s: &Slot<T>,
        f: impl FnOnce(&mut Body<T>, u64) -> (u64, R),
    ) -> R {
        let w = Self::hold(word);
        // SAFETY: this thread holds the slot BUSY until the store below.
        let (state, r) = s.body.with_mut(|p| f(unsafe { &mut *p }, w & STATE));
        word.store((w & !STATE) | state, Ordering::Release);
        r
    }

    /// Moves `word` to `BUSY`, waiting while another thread holds it so; returns the word
    /// as it was. The caller owns the slot's body until it stores a word back.
    fn hold(word: &AtomicU64) -> u64 {
        loop {
            let w = word.load(Ordering::Relaxed);
            if w & STATE == BUSY {
                spin_wait();
                continue;
            }
            if word
                .compare_exchange(w, (w & !STATE) | BUSY, Ordering::Acquire, Ordering::Relaxed)
                .is_ok()
            {
                return w;
            }
        }
    }

    /// Whether a slot may hold an item from the chunk `tag` names (or from another chunk
    /// whose tag is the same).
    #[cfg(test)]
    pub(crate) fn holds_tag(&self, tag: u8) -> bool {
        self.tags(false).contains(tag)
    }

    /// The chunk tags of the slots holding an item (or about to), leaving out proven slots
    /// if `skip_proven`.
    #[inline(always)]
    pub(crate) fn tags(&self, skip_proven: bool) -> Tags {
        let mut t = Tags { bytes: 0, held: 0 };
        for (i, w) in self.words.0.iter().enumerate() {
            let v = w.load(Ordering::Relaxed);
            if in_use(v & STATE) && !(skip_proven && v & PROVEN != 0) {
                t.bytes |= u32::from(tag_of(v)) << (8 * i);
                t.held |= 0xFF << (8 * i);
            }
        }
        t
    }

    /// Empties into `f` every slot holding an item from a chunk whose tag is `tag` (or from
    /// another chunk whose tag is the same).
    pub(crate) fn drain_tag(&self, tag: u8, f: impl FnMut(T)) {
        self.empty_into(|w| in_use(w & STATE) && tag_of(w) == tag, false, f);
    }

    /// Empties every slot into `f`.
    pub(crate) fn drain(&self, f: impl FnMut(T)) {
        self.empty_into(|w| in_use(w & STATE), false, f);
    }

    /// Empties every slot into `f` and closes it: no put is kept from then on. The pool
    /// closes its slots when its handle drops, after which a free that raced with the drop
    /// finds them closed and goes to its engine, instead of keeping a segment (and the pool
    /// with it, through the segment's handle) in a slot nobody would drain again.
    pub(crate) fn close(&self, f: impl FnMut(T)) {
        self.empty_into(|_| true, true, f);
    }

    /// Empties into `f` the slots whose word `pick` accepts, closing them if `close` (a
    /// closed slot stays closed). `pick` reads the word before the slot is held: a slot it
    /// picks may have changed since, which at worst empties it early.
    fn empty_into(&self, pick: impl Fn(u64) -> bool, close: bool, mut f: impl FnMut(T)) {
        for (word, s) in self.words.0.iter().zip(&self.slots) {
            if !pick(word.load(Ordering::Relaxed)) {
                continue;
            }
            let item = Self::with_slot(word, s, |b, state| {
                let after = if close || state == CLOSED {
                    CLOSED
                } else {
                    EMPTY
                };
                // SAFETY: the item is initialised iff the slot was FULL.
                (
                    after,
                    (state == FULL).then(|| unsafe { b.item.assume_init_read() }),
                )
            });
            if let Some(item) = item {
                f(item);
            }
        }
    }

    /// Calls `f` on every item held, and returns the counters, all of one moment: every
    /// slot is held `BUSY` at once (taken in slot order, as the drains take them one at a
    /// time, so two walks cannot wait on each other), so an item taken from a slot and put
    /// in another meanwhile is seen in exactly one, and the counters are those of the items
    /// seen. Walked one slot at a time, such an item was met twice or not at all, and its
    /// put was counted without its take. A take or put that finds a slot busy meanwhile
    /// misses or is declined, as it would for a drain. Each slot is stored back as it was
    /// even if `f` panics.
    pub(crate) fn for_each_held(&self, mut f: impl FnMut(&T)) -> SlotTotals {
        let held = HeldAll {
            words: &self.words.0,
            was: std::array::from_fn(|i| Self::hold(&self.words.0[i])),
        };
        let mut t = SlotTotals::default();
        for (s, &w) in self.slots.iter().zip(&held.was) {
            s.body.with_mut(|p| {
                // SAFETY: this thread holds every slot BUSY until `held` drops.
                let b = unsafe { &*p };
                if w & STATE == FULL {
                    // SAFETY: the slot was FULL, so the item is initialised.
                    f(unsafe { b.item.assume_init_ref() });
                }
                t.hits += b.hits;
                t.puts += b.puts;
            });
        }
        drop(held);
        t
    }
}

/// Every slot's word, held `BUSY` by a walk ([`ShapeSlots::for_each_held`]); dropping it
/// stores each word back as it was, also when the walk's callback panics (left `BUSY`,
/// the slots would refuse every take and put, and a drain would spin on them for good).
struct HeldAll<'a> {
    /// The slots' words, each `BUSY` (held by this walk) until the drop.
    words: &'a [AtomicU64; SLOTS],
    /// Each word as the walk found it: nothing else changes a word held `BUSY`.
    was: [u64; SLOTS],
}

impl Drop for HeldAll<'_> {
    fn drop(&mut self) {
        for (word, &w) in self.words.iter().zip(&self.was) {
            word.store(w, Ordering::Release);
        }
    }
}

impl<T> Drop for ShapeSlots<T> {
    fn drop(&mut self) {
        for (word, s) in self.words.0.iter().zip(&self.slots) {
            if word.load(Ordering::Relaxed) & STATE == FULL {
                // SAFETY: FULL means initialised, and `&mut self` means no one else holds it.
                s.body.with_mut(|p| unsafe { (*p).item.assume_init_drop() });
            }
        }
    }
}
