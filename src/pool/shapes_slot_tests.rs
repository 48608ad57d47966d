//! The shape slots on their own: what a put keeps, declines or displaces, what a take finds,
//! and what drains and a close give up. (Not in `shapes.rs` itself: the loom models compile
//! that file with loom's primitives, under which these tests could not run.)

use super::shapes::*;
use smallvec::SmallVec;
use std::sync::Arc;

fn key(len: u64) -> u64 {
    shape_key(len, 64)
}

#[test]
fn a_put_is_taken_back_by_its_shape_only() {
    let s = ShapeSlots::<(u64, Arc<()>)>::default();
    let token = Arc::new(());
    assert!(matches!(
        s.put(key(100), 0, 2, 2, (100, token.clone())),
        Put::Kept
    ));
    assert!(s.any());
    assert!(s.take(key(200), |_| true).is_none());
    // A colliding key is caught by the check of the item.
    assert!(s.take(key(100), |i| i.0 == 101).is_none());
    assert_eq!(s.take(key(100), |i| i.0 == 100).map(|i| i.0), Some(100));
    assert!(s.take(key(100), |_| true).is_none());
    assert!(!s.any());
    let t = s.for_each_held(|_| panic!("nothing held"));
    assert_eq!(t, SlotTotals { hits: 1, puts: 1 });
    assert_eq!(
        Arc::strong_count(&token),
        1,
        "the taken item was dropped once"
    );
}

#[test]
fn puts_of_one_shape_fill_the_empty_slots_then_displace_and_drain_empties_all() {
    let s = ShapeSlots::<u64>::default();
    for i in 0..SLOTS as u64 {
        assert!(matches!(s.put(key(7), 0, 1, 9, i), Put::Kept));
    }
    match s.put(key(7), 0, 1, 9, 8) {
        Put::Displaced(old) => assert!(old < SLOTS as u64),
        other => panic!("expected a displacement, got {other:?}"),
    }
    let mut seen = Vec::new();
    s.for_each_held(|&i| seen.push(i));
    assert_eq!(seen.len(), SLOTS);
    assert!(seen.contains(&8));
    let mut drained = Vec::new();
    s.drain(|i| drained.push(i));
    drained.sort_unstable();
    seen.sort_unstable();
    assert_eq!(drained, seen);
    assert!(!s.any());
    assert!(s.take(key(7), |_| true).is_none());
}

#[test]
fn a_taken_shape_is_proven_until_another_shape_takes_its_slot() {
    let s = ShapeSlots::<u64>::default();
    let (a, b) = (key(1), key(2));
    assert!(matches!(s.put(a, 7, 1, 9, 1), Put::Kept));
    assert_eq!(s.tags(true).slot(0), Some(7), "never taken: not proven");
    assert_eq!(s.take(a, |_| true), Some(1));
    // Back into the slot its shape left (the proven bit with it), not another empty one.
    assert!(matches!(s.put(a, 7, 1, 9, 2), Put::Kept));
    assert_eq!(s.tags(false).slot(0), Some(7));
    assert_eq!(s.tags(true).list(), [None; SLOTS], "proven: skipped");
    // A drain keeps the bit; another shape prefers a never-proven empty slot.
    s.drain(|_| {});
    assert!(matches!(s.put(b, 8, 1, 9, 3), Put::Kept));
    assert_eq!(s.tags(true).slot(1), Some(8));
    assert!(matches!(s.put(a, 7, 1, 9, 4), Put::Kept));
    assert_eq!(s.tags(true).list(), [None, Some(8), None, None]);
    // Once every other slot is full, a third shape takes the proven slot's place and
    // the bit goes.
    assert_eq!(s.take(a, |_| true), Some(4));
    for (i, k) in [key(3), key(4)].into_iter().enumerate() {
        assert!(matches!(s.put(k, 9, 1, 9, 5 + i as u64), Put::Kept));
    }
    assert!(matches!(s.put(key(5), 6, 1, 9, 7), Put::Kept));
    assert_eq!(s.tags(true).slot(0), Some(6));
}

#[test]
fn a_free_goes_back_to_the_lowest_slot_its_shape_left() {
    let s = ShapeSlots::<u64>::default();
    let (a, b) = (key(1), key(2));
    // Slots 0 and 1 for `a`, 2 for `b`; all three taken back, so all three proven.
    for (k, tag) in [(a, 7), (a, 7), (b, 8)] {
        assert!(matches!(s.put(k, tag, 1, 9, 0), Put::Kept));
    }
    for k in [a, a, b] {
        assert_eq!(s.take(k, |_| true), Some(0));
    }
    // `b` goes home to slot 2, past two lower empty slots.
    assert!(matches!(s.put(b, 8, 1, 9, 1), Put::Kept));
    assert_eq!(s.tags(false).list(), [None, None, Some(8), None]);
    // `a` has two: the lower.
    assert!(matches!(s.put(a, 7, 1, 9, 2), Put::Kept));
    assert_eq!(s.tags(false).list(), [Some(7), None, Some(8), None]);
    // A third shape has no slot of its own: the never-used one, not a proven one.
    assert!(matches!(s.put(key(3), 9, 1, 9, 3), Put::Kept));
    assert_eq!(s.tags(false).list(), [Some(7), None, Some(8), Some(9)]);
}

#[test]
fn a_put_past_the_budget_is_declined() {
    let s = ShapeSlots::<u64>::default();
    // Two shapes: each takes a slot of its own.
    let (a, b) = (key(1), key(2));
    assert!(matches!(s.put(a, 0, 10, 10, 1), Put::Kept));
    // Another slot: its 5 units and the 10 held pass 12.
    assert!(matches!(s.put(b, 0, 5, 12, 2), Put::Declined(2)));
    assert!(matches!(s.put(b, 0, 2, 12, 2), Put::Kept));
    // With no empty slot left, the item a put would displace counts too (its free comes
    // with it).
    assert!(matches!(s.put(key(3), 0, 0, 12, 3), Put::Kept));
    assert!(matches!(s.put(key(4), 0, 0, 12, 4), Put::Kept));
    assert!(matches!(s.put(a, 0, 1, 12, 5), Put::Declined(5)));
    assert!(matches!(s.put(a, 0, 1, 13, 5), Put::Displaced(1)));
}

#[test]
fn shapes_that_hash_to_one_slot_are_kept_side_by_side() {
    let s = ShapeSlots::<u64>::default();
    let a = key(1);
    let b = (2..)
        .map(key)
        .find(|&k| (k >> 20) & 3 == (a >> 20) & 3)
        .unwrap();
    assert!(matches!(s.put(a, 0, 1, 9, 1), Put::Kept));
    assert!(matches!(s.put(b, 0, 1, 9, 2), Put::Kept));
    assert_eq!(s.take(a, |_| true), Some(1));
    assert_eq!(s.take(b, |_| true), Some(2));
}

#[test]
fn a_tag_set_answers_as_a_list_of_tags_would() {
    for held in 0..1u32 << SLOTS {
        let mask = (0..SLOTS).fold(0u32, |m, i| {
            if held >> i & 1 != 0 {
                m | 0xFF << (8 * i)
            } else {
                m
            }
        });
        for bytes in [
            0,
            0x0100_FF07,
            u32::MAX,
            0x0807_0605,
            0x8080_0001,
            0x7F80_FE01,
        ] {
            let t = Tags::from_bytes(bytes & mask, mask);
            for tag in 0..=u8::MAX {
                assert_eq!(
                    t.contains(tag),
                    t.list().contains(&Some(tag)),
                    "{t:?}, tag {tag}"
                );
            }
        }
    }
}

#[test]
fn a_tagged_drain_takes_only_its_chunks_items() {
    let s = ShapeSlots::<u64>::default();
    // Two shapes: each takes a slot of its own.
    let (a, b) = (key(1), key(2));
    assert!(matches!(s.put(a, 7, 1, 9, 1), Put::Kept));
    assert!(matches!(s.put(b, 8, 1, 9, 2), Put::Kept));
    assert!(s.holds_tag(7) && s.holds_tag(8) && !s.holds_tag(9));
    let mut out = Vec::new();
    s.drain_tag(8, |i| out.push(i));
    assert_eq!(out, [2]);
    assert!(!s.holds_tag(8) && s.holds_tag(7));
    assert_eq!(s.take(a, |_| true), Some(1));
}

#[test]
fn closed_slots_give_their_items_up_and_keep_nothing_more() {
    let s = ShapeSlots::<u64>::default();
    assert!(matches!(s.put(key(3), 0, 1, 9, 3), Put::Kept));
    let mut out = Vec::new();
    s.close(|i| out.push(i));
    assert_eq!(out, [3]);
    assert!(!s.any());
    assert!(matches!(s.put(key(3), 0, 1, 9, 4), Put::Declined(4)));
    assert!(s.take(key(3), |_| true).is_none());
    s.drain(|_| panic!("nothing held"));
    assert_eq!(s.for_each_held(|_| {}), SlotTotals { hits: 0, puts: 1 });
}

#[test]
fn items_left_in_slots_are_dropped_with_them() {
    let token = Arc::new(());
    {
        let s = ShapeSlots::<Arc<()>>::default();
        assert!(matches!(s.put(key(1), 0, 1, 1, token.clone()), Put::Kept));
        assert_eq!(Arc::strong_count(&token), 2);
    }
    assert_eq!(Arc::strong_count(&token), 1);
}

#[test]
fn threads_racing_on_one_slot_lose_and_duplicate_nothing() {
    let s = Arc::new(ShapeSlots::<u64>::default());
    let threads: Vec<_> = (0..4u64)
        .map(|t| {
            let s = Arc::clone(&s);
            std::thread::spawn(move || {
                // Each thread owns its items: whatever it cannot keep comes back to it.
                let mut mine: Vec<u64> = (0..8).map(|i| t * 100 + i).collect();
                let mut back = Vec::new();
                // Miri runs this some thousand times slower.
                let rounds = if cfg!(miri) { 400 } else { 20_000u64 };
                for round in 0..rounds {
                    if round % 2 == 0 {
                        if let Some(i) = mine.pop() {
                            match s.put(key(5), 0, 1, 2, i) {
                                Put::Kept => {}
                                Put::Displaced(o) | Put::Declined(o) => back.push(o),
                            }
                        }
                    } else if let Some(i) = s.take(key(5), |_| true) {
                        back.push(i);
                    }
                    if mine.is_empty() {
                        mine.append(&mut back);
                    }
                    if round % 1000 == 0 {
                        s.for_each_held(|_| {});
                    }
                }
                mine.append(&mut back);
                mine
            })
        })
        .collect();
    let mut all: Vec<u64> = threads
        .into_iter()
        .flat_map(|t| t.join().unwrap())
        .collect();
    s.drain(|i| all.push(i));
    all.sort_unstable();
    let want: Vec<u64> = (0..4u64)
        .flat_map(|t| (0..8).map(move |i| t * 100 + i))
        .collect();
    assert_eq!(all, want, "every item is somewhere exactly once");
    let t = s.for_each_held(|_| {});
    assert!(t.puts >= t.hits);
}

#[test]
fn a_full_set_displaces_by_hash_and_a_displacing_put_proves_nothing() {
    let s = ShapeSlots::<u64>::default();
    // Four shapes, one per slot (tags 1 to 4), none taken back: none proven.
    let keys: Vec<u64> = (1..=4).map(key).collect();
    for (i, &k) in keys.iter().enumerate() {
        assert!(matches!(s.put(k, i as u8 + 1, 1, 99, i as u64), Put::Kept));
    }
    assert_eq!(s.tags(true).list(), [Some(1), Some(2), Some(3), Some(4)]);
    // A put of a held shape displaces that shape's older item, and the slot stays unproven.
    assert!(matches!(s.put(keys[2], 3, 1, 99, 10), Put::Displaced(2)));
    assert_eq!(s.tags(true).list(), [Some(1), Some(2), Some(3), Some(4)]);
    // A fifth shape takes the slot its key hashes to, whichever that is.
    for (home, &own) in keys.iter().enumerate() {
        let k = (100..)
            .map(key)
            .find(|&k| (k >> 20) as usize & (SLOTS - 1) == home)
            .unwrap();
        match s.put(k, 9, 1, 99, 20 + home as u64) {
            Put::Displaced(_) => {}
            other => panic!("expected a displacement, got {other:?}"),
        }
        assert_eq!(s.tags(false).slot(home), Some(9), "slot {home}");
        assert!(s.take(k, |_| true).is_some());
        assert!(matches!(
            s.put(own, home as u8 + 1, 1, 99, home as u64),
            Put::Kept
        ));
    }
}

#[test]
fn debug_shows_each_slots_state() {
    let s = ShapeSlots::<u64>::default();
    assert_eq!(format!("{s:?}"), "ShapeSlots { states: [0, 0, 0, 0] }");
    assert!(matches!(s.put(key(1), 0, 1, 9, 1), Put::Kept));
    assert!(matches!(s.put(key(2), 0, 1, 9, 2), Put::Kept));
    assert_eq!(format!("{s:?}"), "ShapeSlots { states: [1, 1, 0, 0] }");
    s.close(|_| {});
    assert_eq!(format!("{s:?}"), "ShapeSlots { states: [3, 3, 3, 3] }");
}

/// `Pool::stats` and `validate` walk the slots while threads take and put without the kind
/// lock: a frame taken from a slot the walk has passed, and put back in a later one while
/// another frame fills the first, would be met twice by a walk that held one slot at a
/// time. The walk holds them all and meets each frame once.
#[test]
fn a_frame_moving_to_a_later_slot_is_met_once_by_the_walk() {
    use std::sync::atomic::{AtomicBool, Ordering};
    let s = Arc::new(ShapeSlots::<u64>::default());
    assert!(matches!(s.put(key(9), 0, 1, 9, 0), Put::Kept));
    let stop = Arc::new(AtomicBool::new(false));
    // Two frames of one shape, each taken and freed again and again.
    let movers: Vec<_> = (0..2u64)
        .map(|n| {
            let (s, stop) = (Arc::clone(&s), Arc::clone(&stop));
            std::thread::spawn(move || {
                let mut mine = (n == 1).then_some(1u64);
                while !stop.load(Ordering::Relaxed) {
                    match mine.take() {
                        Some(i) => match s.put(key(9), 0, 1, 9, i) {
                            Put::Kept => {}
                            Put::Displaced(o) | Put::Declined(o) => mine = Some(o),
                        },
                        None => mine = s.take(key(9), |_| true),
                    }
                }
                mine
            })
        })
        .collect();
    let rounds = if cfg!(miri) { 200 } else { 2_000_000 };
    let mut twice = None;
    for _ in 0..rounds {
        let mut seen = SmallVec::<[u64; 8]>::new();
        s.for_each_held(|&i| seen.push(i));
        if seen.len() > 1 && seen[0] == seen[1] || seen.len() > 2 {
            twice = Some(seen);
            break;
        }
    }
    stop.store(true, Ordering::Relaxed);
    let mut all: Vec<u64> = movers
        .into_iter()
        .filter_map(|m| m.join().unwrap())
        .collect();
    s.drain(|i| all.push(i));
    all.sort_unstable();
    assert_eq!(all, [0, 1], "every frame is somewhere exactly once");
    assert_eq!(twice, None, "a frame was met twice");
}

/// `Pool::stats` and `validate` walk the slots while threads take and put without the kind
/// lock, and read the figures of one moment: a frame taken from a slot the walk has passed
/// and put back in a later one is seen either before the take or after the put, never with
/// the put counted and the take not (the pool then showed a frame its user had freed as
/// live, and `allocations - frees` short of `live_regions`).
#[test]
fn a_walk_sees_the_slots_at_one_moment() {
    let s = ShapeSlots::<u64>::default();
    // Frames 0 and 2 of one shape in slots 0 and 2, frame 1 of another in slot 1.
    assert!(matches!(s.put(key(9), 0, 1, 9, 0), Put::Kept));
    assert!(matches!(s.put(key(8), 0, 1, 9, 1), Put::Kept));
    assert!(matches!(s.put(key(9), 0, 1, 9, 2), Put::Kept));
    let mut seen = Vec::new();
    let t = s.for_each_held(|&i| {
        seen.push(i);
        if i == 1 {
            // Between the walk's look at slot 0 and at slot 2, another thread takes both
            // frames and frees them again: each goes to the other's slot.
            let taken: Vec<u64> = std::iter::from_fn(|| s.take(key(9), |_| true)).collect();
            for f in taken.into_iter().rev() {
                assert!(matches!(s.put(key(9), 0, 1, 9, f), Put::Kept));
            }
        }
    });
    seen.sort_unstable();
    assert_eq!(seen, [0, 1, 2], "each frame seen once");
    assert_eq!(t.puts - t.hits, 3, "the figures of the frames seen: {t:?}");
}

/// A walk's callback runs while every slot is held `BUSY`: one that panics must still store
/// each slot back as it was. Left `BUSY`, the slots would decline every put and miss every
/// take from then on, the next drain under the kind lock would spin forever (the pool's
/// lock serves on after a panic), and the slots' drop would leak the items they held.
#[test]
fn a_walk_whose_callback_panics_stores_every_slot_back() {
    use std::panic::{catch_unwind, AssertUnwindSafe};
    let s = ShapeSlots::<(u64, Arc<()>)>::default();
    let token = Arc::new(());
    assert!(matches!(
        s.put(key(9), 3, 1, 9, (0, token.clone())),
        Put::Kept
    ));
    assert!(matches!(
        s.put(key(8), 3, 1, 9, (1, token.clone())),
        Put::Kept
    ));
    let walked = catch_unwind(AssertUnwindSafe(|| {
        s.for_each_held(|_| panic!("a callback that fails"))
    }));
    assert!(walked.is_err());
    assert!(s.holds_tag(3), "the slots still hold their items");
    let taken = s.take(key(9), |_| true).map(|i| i.0);
    assert_eq!(taken, Some(0), "the first slot is FULL again: {s:?}");
    assert!(
        matches!(s.put(key(7), 3, 1, 9, (2, token.clone())), Put::Kept),
        "an empty slot takes a put again: {s:?}"
    );
    let mut drained = Vec::new();
    s.drain(|i| drained.push(i.0));
    drained.sort_unstable();
    assert_eq!(drained, [1, 2]);
    assert_eq!(Arc::strong_count(&token), 1, "nothing leaked");
}
