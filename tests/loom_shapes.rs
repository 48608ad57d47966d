//! loom models of the shape slots: `src/pool/shapes.rs` itself, compiled here with loom's
//! atomics and cells in place of `std`'s (through the parent module's `sync` shim), so every
//! interleaving loom explores runs the pool's own code.
//!
//! A slot's item and counters are plain memory, owned by whichever thread holds the slot's
//! word `BUSY`; loom's cell reports any two accesses to them that no acquire/release pair
//! orders. On top of that, over every interleaving (up to `LOOM_MAX_PREEMPTIONS`, 3 when
//! unset), the models check:
//! - no item is lost or duplicated, whatever mix of puts (keeping, displacing or declining),
//!   takes, drains and a close runs at once: each comes back exactly once, to the thread
//!   that was told it was declined or displaced, to a take, or to a drain;
//! - a put that happened before a take of its shape is found by that take;
//! - after a close nothing is held, and every later put is declined;
//! - two puts at once keep no more than their budget between them;
//! - the counters read while slots are in use never show more hits than puts, and the
//!   items that walk sees are exactly those the counters leave held.
//!
//! Each was checked to fail on a mutation of `shapes.rs`: a take's compare-exchange with
//! `Relaxed` instead of `Acquire`, a put's final store with `Relaxed` instead of
//! `Release`, a put that ignores `CLOSED`, and a wait that does not wait for `BUSY`.

use loom::sync::atomic::AtomicBool;
use loom::sync::Arc;
use loom::thread;
use std::sync::atomic::Ordering;

/// The shim `shapes.rs` takes its primitives from (`super::sync`).
mod sync {
    pub(crate) use loom::sync::atomic::{fence, AtomicU64};

    /// The slot cell as loom's: it tracks every access and fails on unordered ones.
    pub(crate) struct SlotCell<T>(loom::cell::UnsafeCell<T>);

    impl<T> SlotCell<T> {
        pub(crate) fn new(value: T) -> Self {
            Self(loom::cell::UnsafeCell::new(value))
        }

        pub(crate) fn with_mut<R>(&self, f: impl FnOnce(*mut T) -> R) -> R {
            self.0.with_mut(f)
        }
    }

    /// A wait for a busy slot yields to loom, which otherwise would spin for ever.
    pub(crate) fn spin_wait() {
        loom::thread::yield_now();
    }
}

#[path = "../src/pool/shapes.rs"]
#[allow(dead_code)]
mod shapes;

use shapes::{shape_key, Put, ShapeSlots, SLOTS};

/// A stand-in segment: an id to spot duplicates and losses.
#[derive(Debug, PartialEq, Eq)]
struct Item(u32);

/// The frame shape every model uses, and a budget no model reaches.
fn frame() -> u64 {
    shape_key(3_110_400, 64)
}
const BUDGET: u64 = 1 << 20;

fn model(f: impl Fn() + Sync + Send + 'static) {
    let mut b = loom::model::Builder::new();
    if b.preemption_bound.is_none() {
        b.preemption_bound = Some(3);
    }
    b.check(f);
}

/// A free of `item` into the slots, as the pool makes it: what the slots do not keep comes
/// back to the caller, which would free it into its engine.
fn put(slots: &ShapeSlots<Item>, item: Item) -> Option<Item> {
    match slots.put(frame(), 1, 760, BUDGET, item) {
        Put::Kept => None,
        Put::Displaced(old) => Some(old),
        Put::Declined(back) => Some(back),
    }
}

/// An allocation of the frame shape from the slots.
fn take(slots: &ShapeSlots<Item>) -> Option<Item> {
    slots.take(frame(), |_| true)
}

/// Checks that `items` are exactly the ids `0..n`, each once.
fn each_once(mut items: Vec<Item>, n: u32) {
    items.sort_unstable_by_key(|i| i.0);
    let ids: Vec<u32> = items.iter().map(|i| i.0).collect();
    assert_eq!(
        ids,
        (0..n).collect::<Vec<_>>(),
        "an item was lost or duplicated"
    );
}

/// What one thread of a model does on the slots: it returns the items it holds at the end.
type User = Box<dyn FnOnce(&ShapeSlots<Item>) -> Vec<Item> + Send>;

/// Runs `threads` on shared slots (each returns the items it got back or took), then drains
/// what is left; the whole lot must be the ids `0..n`, each once. `main` runs on the model's
/// own thread meanwhile, and returns items too.
fn race(
    slots: Arc<ShapeSlots<Item>>,
    n: u32,
    threads: Vec<User>,
    main: impl FnOnce(&ShapeSlots<Item>) -> Vec<Item>,
) {
    let handles: Vec<_> = threads
        .into_iter()
        .map(|f| {
            let slots = slots.clone();
            thread::spawn(move || f(&slots))
        })
        .collect();
    let mut all = main(&slots);
    for h in handles {
        all.extend(h.join().unwrap());
    }
    slots.drain(|i| all.push(i));
    each_once(all, n);
}

#[test]
fn a_put_and_a_take_of_its_shape_race_without_losing_it() {
    model(|| {
        race(
            Arc::new(ShapeSlots::default()),
            1,
            vec![Box::new(|s| put(s, Item(0)).into_iter().collect())],
            |s| take(s).into_iter().collect(),
        );
    });
}

#[test]
fn two_puts_a_take_and_a_drain_lose_and_duplicate_nothing() {
    model(|| {
        race(
            Arc::new(ShapeSlots::default()),
            2,
            vec![
                Box::new(|s| put(s, Item(0)).into_iter().collect()),
                Box::new(|s| {
                    let mut got: Vec<Item> = put(s, Item(1)).into_iter().collect();
                    got.extend(take(s));
                    got
                }),
            ],
            // The kind drains every slot before it carves or grows.
            |s| {
                let mut out = Vec::new();
                s.drain(|i| out.push(i));
                out
            },
        );
    });
}

#[test]
fn a_put_displacing_an_item_races_a_take_of_the_same_shape() {
    model(|| {
        // Every slot full of frames: the next frame's free displaces one of them.
        let slots = Arc::new(ShapeSlots::default());
        for i in 0..SLOTS as u32 {
            assert!(put(&slots, Item(i)).is_none());
        }
        let n = SLOTS as u32 + 1;
        race(
            slots,
            n,
            vec![Box::new(move |s| put(s, Item(n - 1)).into_iter().collect())],
            |s| take(s).into_iter().collect(),
        );
    });
}

#[test]
fn a_put_that_happened_before_a_take_is_found_by_it() {
    model(|| {
        let slots = Arc::new(ShapeSlots::default());
        let done = Arc::new(AtomicBool::new(false));
        let (s2, d2) = (slots.clone(), done.clone());
        let freer = thread::spawn(move || {
            let back = put(&s2, Item(0));
            d2.store(true, Ordering::Release);
            back
        });
        let mut all = Vec::new();
        if done.load(Ordering::Acquire) {
            let got = take(&slots);
            assert!(
                got.is_some(),
                "a frame freed before the allocation was missed"
            );
            all.extend(got);
        }
        all.extend(freer.join().unwrap());
        slots.drain(|i| all.push(i));
        each_once(all, 1);
    });
}

/// The pool's handle drops while `user` runs: the slots close, giving up what they hold.
/// Whatever raced the close, nothing is left for a drain nobody would run, and a later put
/// is declined.
fn close_racing(user: impl FnOnce(&ShapeSlots<Item>) -> Vec<Item> + Send + 'static) {
    let slots = Arc::new(ShapeSlots::default());
    assert!(put(&slots, Item(0)).is_none());
    let s = slots.clone();
    let h = thread::spawn(move || user(&s));
    let mut all = Vec::new();
    slots.close(|i| all.push(i));
    all.extend(h.join().unwrap());
    assert!(!slots.any(), "a slot holds an item after the close");
    slots.for_each_held(|i| panic!("{i:?} held after the close"));
    assert!(
        matches!(put(&slots, Item(9)), Some(Item(9))),
        "a put was kept after the close"
    );
    each_once(all, 2);
}

#[test]
fn a_close_racing_a_put_leaves_nothing_held() {
    model(|| close_racing(|s| put(s, Item(1)).into_iter().collect()));
}

#[test]
fn a_close_racing_a_take_leaves_nothing_held() {
    model(|| {
        close_racing(|s| {
            // The other item of the count: a free the close never saw, as the pool's
            // drop would leave with its user.
            let mut got = vec![Item(1)];
            got.extend(take(s));
            got
        })
    });
}

#[test]
fn counters_read_while_slots_are_in_use_add_up() {
    model(|| {
        let slots = Arc::new(ShapeSlots::default());
        let s = slots.clone();
        let user = thread::spawn(move || {
            let mut got: Vec<Item> = put(&s, Item(0)).into_iter().collect();
            got.extend(take(&s));
            got
        });
        // `Pool::stats` reads the slots' figures while frees and allocations go on.
        let mut seen = 0;
        let t = slots.for_each_held(|_| seen += 1);
        assert!(t.hits <= t.puts, "{t:?}");
        // Of one moment: the items seen are those the counters leave held.
        assert_eq!(seen as u64, t.puts - t.hits, "{seen} held, {t:?}");
        let mut all = user.join().unwrap();
        let t = slots.for_each_held(|_| {});
        slots.drain(|i| all.push(i));
        // The put was kept or declined; a take after a kept put may still have found the
        // slot busy (a hint, not a wait), so the hit is not certain.
        assert!(t.puts <= 1 && t.hits <= t.puts, "{t:?}");
        each_once(all, 1);
    });
}

/// Two frees of two recurring shapes at once, each coming back to the empty slot its shape
/// left, under a budget with room for one of them: whichever way they interleave, the slots
/// keep at most one (the other goes to its engine). Each put checked the budget against the
/// words it read before claiming its slot, so two that read before either claimed both
/// kept theirs, holding twice the budget: memory the release threshold would have sent
/// back to the source.
#[test]
fn two_puts_at_once_keep_within_the_budget() {
    const UNITS: u64 = 760;
    model(|| {
        let slots = Arc::new(ShapeSlots::default());
        let (a, b) = (shape_key(3_110_400, 64), shape_key(4_284_000, 64));
        // Each shape has been taken back from a slot of its own, now empty.
        for (key, id) in [(a, 10), (b, 11)] {
            assert!(matches!(
                slots.put(key, 1, UNITS, 4 * UNITS, Item(id)),
                Put::Kept
            ));
            assert_eq!(slots.take(key, |_| true), Some(Item(id)));
        }
        let s = slots.clone();
        let other = thread::spawn(move || match s.put(b, 2, UNITS, UNITS + 1, Item(1)) {
            Put::Kept => None,
            Put::Displaced(i) | Put::Declined(i) => Some(i),
        });
        let mut back: Vec<Item> = match slots.put(a, 1, UNITS, UNITS + 1, Item(0)) {
            Put::Kept => vec![],
            Put::Displaced(i) | Put::Declined(i) => vec![i],
        };
        back.extend(other.join().unwrap());
        let mut held = 0;
        slots.drain(|i| {
            held += 1;
            back.push(i)
        });
        assert!(
            held <= 1,
            "the slots kept {held} items of {UNITS} units under a budget of {}",
            UNITS + 1
        );
        each_once(back, 2);
    });
}
