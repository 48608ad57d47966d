//! Property tests: random allocate/free sequences against a shadow model, after every step.
//!
//! Invariants checked:
//! - every live segment lies inside the range, starts at its rule's alignment and has
//!   exactly the rule's footprint;
//! - no two live segments overlap (the shadow keeps them ordered by offset);
//! - freeing a handle twice, or a handle from another engine, is a typed error and
//!   changes nothing;
//! - `validate()` passes and the counters equal the shadow's sums after every step.

use ascend_pool::engine::{Allocation, CarveEngine, EngineConfig, EngineError, RangeTier};
use ascend_pool::CarveRule;
use proptest::prelude::*;
use std::collections::BTreeMap;

#[path = "common/cases.rs"]
mod cases;
use cases::cases;

#[derive(Debug, Clone)]
enum Op {
    Alloc {
        len: u64,
        align: u64,
        padding: u64,
        /// `alloc_in_pages` rather than `alloc`.
        in_pages: bool,
    },
    /// `alloc_parked` of a freed segment's length under the default rule.
    Parked(usize),
    Free(usize),
    DoubleFree(usize),
    Foreign,
    Trim,
    Grow(u64),
    ShrinkTail(u64),
}

fn op() -> impl Strategy<Value = Op> {
    let len = prop_oneof![
        4 => 1u64..256,
        4 => 256u64..8192,
        2 => 8192u64..(1 << 20),
        1 => Just(3_110_400u64),
        1 => (0u64..4).prop_map(|k| u64::MAX - k * 1000), // overflow
        1 => Just(0u64),
    ];
    let align =
        prop_oneof![6 => Just(64u64), 3 => Just(128u64), 1 => Just(4096u64), 1 => Just(2u64 << 20)];
    prop_oneof![
        6 => (len, align, prop_oneof![Just(32u64), Just(0u64), Just(64u64)], any::<bool>())
            .prop_map(|(len, align, padding, in_pages)| Op::Alloc { len, align, padding, in_pages }),
        4 => any::<usize>().prop_map(Op::Free),
        2 => any::<usize>().prop_map(Op::Parked),
        1 => any::<usize>().prop_map(Op::DoubleFree),
        1 => Just(Op::Foreign),
        1 => Just(Op::Trim),
        1 => prop_oneof![Just(0u64), Just(100u64), (1u64..64).prop_map(|k| k * 64), Just(4u64 << 20)]
            .prop_map(Op::Grow),
        1 => prop_oneof![Just(0u64), Just(96u64), Just(64u64), Just(4096u64), Just(2u64 << 20)]
            .prop_map(Op::ShrinkTail),
    ]
}

struct Shadow {
    /// offset -> (footprint, len)
    live: BTreeMap<u64, (u64, u64)>,
    handles: Vec<Allocation>,
    freed: Vec<Allocation>,
}

impl Shadow {
    /// A free range between live segments (or past the last, up to `capacity`) that holds
    /// `footprint` bytes at an `align`-aligned start.
    fn gap_holding(&self, footprint: u64, align: u64, capacity: u64) -> Option<(u64, u64)> {
        self.gaps(capacity).into_iter().find(|&(start, end)| {
            let aligned = start.div_ceil(align) * align;
            aligned.checked_add(footprint).is_some_and(|e| e <= end)
        })
    }

    /// The free ranges between live segments and up to `capacity`, as (start, end).
    fn gaps(&self, capacity: u64) -> Vec<(u64, u64)> {
        let mut start = 0u64;
        let mut gaps = Vec::new();
        let ends = self
            .live
            .iter()
            .map(|(&off, &(fp, _))| (off, off + fp))
            .chain([(capacity, capacity)]);
        for (off, end) in ends {
            if off > start {
                gaps.push((start, off));
            }
            start = end;
        }
        gaps
    }

    /// `exact`: the range tier holds nothing but the shadow's segments (TLSF, no slabs), so
    /// its free figures are the shadow's gaps, parked blocks merged with their neighbours.
    fn check(&self, e: &CarveEngine, exact: bool) {
        let capacity = e.capacity();
        e.validate().unwrap();
        let mut end = 0;
        for (&off, &(fp, _)) in &self.live {
            assert!(off >= end, "segments overlap at {off}");
            end = off + fp;
        }
        assert!(end <= capacity);
        let c = e.counters();
        assert_eq!(c.live as usize, self.live.len());
        assert_eq!(
            c.footprint_bytes,
            self.live.values().map(|v| v.0).sum::<u64>()
        );
        assert_eq!(
            c.requested_bytes,
            self.live.values().map(|v| v.1).sum::<u64>()
        );
        assert!(e.high_water() >= end);
        if exact {
            let gaps = self.gaps(capacity);
            let r = e.stats().range;
            let free: u64 = gaps.iter().map(|(a, b)| b - a).sum();
            let largest = gaps.iter().map(|(a, b)| b - a).max().unwrap_or(0);
            assert_eq!(
                (r.free_fragments, r.largest_free, r.free_bytes),
                (gaps.len() as u64, largest, free),
                "free ranges {gaps:?}"
            );
        }
    }
}

fn run(ops: Vec<Op>, tier: RangeTier, slab_max: u64) {
    let mut capacity = 64 << 20;
    let cfg = EngineConfig {
        range: tier,
        slab_max,
    };
    let mut e = CarveEngine::new(capacity, cfg).unwrap();
    let mut other = CarveEngine::new(1 << 20, cfg).unwrap();
    let foreign = other.alloc(100, CarveRule::default()).unwrap();
    let mut s = Shadow {
        live: BTreeMap::new(),
        handles: vec![],
        freed: vec![],
    };
    for op in ops {
        match op {
            Op::Alloc {
                len,
                align,
                padding,
                in_pages,
            } => {
                let rule = CarveRule::new(padding, align).unwrap();
                let before = e.largest_free();
                let got = if in_pages {
                    e.alloc_in_pages(len, rule)
                } else {
                    e.alloc(len, rule)
                };
                match got {
                    Ok(a) => {
                        assert_eq!(a.len(), len);
                        assert_eq!(Ok(a.footprint()), rule.footprint(len));
                        assert_eq!(a.offset() % align, 0, "misaligned start");
                        assert!(a.offset() + a.footprint() <= capacity);
                        assert!(s.live.insert(a.offset(), (a.footprint(), len)).is_none());
                        s.handles.push(a);
                    }
                    Err(EngineError::Carve(_)) => assert!(len == 0 || len > 1 << 40),
                    Err(EngineError::OutOfSpace { footprint, .. }) => {
                        assert_eq!(Ok(footprint), rule.footprint(len));
                        // Without slabs the range tier's blocks are the shadow's segments,
                        // so its free ranges are the gaps between them: TLSF refuses only
                        // when none holds the footprint at the rule's alignment (the buddy
                        // tier places by block size, not in any gap).
                        if tier == RangeTier::Tlsf && slab_max == 0 {
                            if let Some((start, end)) = s.gap_holding(footprint, align, capacity) {
                                panic!("{footprint} bytes at {align} refused, [{start}, {end}) is free");
                            }
                        }
                    }
                    // Only a slab-sized segment, whose page no free range holds.
                    Err(EngineError::NoRoomForPage { footprint, page }) => {
                        assert!(in_pages);
                        assert_eq!(Ok(footprint), rule.footprint(len));
                        assert!(footprint <= cfg.slab_max && page > footprint);
                        // A refusal merges parked blocks, and takes nothing.
                        assert!(e.largest_free() >= before, "a refusal took free space");
                    }
                    Err(other) => panic!("unexpected {other:?}"),
                }
            }
            Op::Parked(i) if !s.freed.is_empty() => {
                let len = s.freed[i % s.freed.len()].len();
                let rule = CarveRule::default();
                let before = e.counters();
                match e.alloc_parked(len, rule).unwrap() {
                    Some(a) => {
                        assert!(!a.is_slab(), "slab sizes are never parked");
                        assert_eq!(a.len(), len);
                        assert_eq!(Ok(a.footprint()), rule.footprint(len));
                        assert_eq!(a.offset() % rule.align(), 0, "misaligned start");
                        assert!(a.offset() + a.footprint() <= capacity);
                        assert!(s.live.insert(a.offset(), (a.footprint(), len)).is_none());
                        s.handles.push(a);
                    }
                    None => assert_eq!(e.counters(), before, "a miss changes nothing"),
                }
            }
            Op::Free(i) if !s.handles.is_empty() => {
                let a = s.handles.swap_remove(i % s.handles.len());
                e.free(a).unwrap();
                s.live.remove(&a.offset()).unwrap();
                s.freed.push(a);
            }
            Op::DoubleFree(i) if !s.freed.is_empty() => {
                let a = s.freed[i % s.freed.len()];
                assert!(matches!(e.free(a), Err(EngineError::AlreadyFreed { .. })));
            }
            Op::Foreign => assert_eq!(e.free(foreign), Err(EngineError::ForeignAllocation)),
            Op::Trim => e.trim(),
            Op::Grow(additional) => {
                let ok = additional > 0 && additional % 64 == 0;
                assert_eq!(e.grow(additional).is_ok(), ok, "grow by {additional}");
                if ok {
                    capacity += additional;
                }
                assert_eq!(e.capacity(), capacity);
            }
            Op::ShrinkTail(granule) => {
                let removed = e.shrink_free_tail(granule);
                if granule == 0 || granule % 64 != 0 {
                    assert_eq!(removed, 0);
                } else {
                    assert_eq!(removed % granule, 0);
                    // The largest multiple went: less than a granule of free tail is left.
                    let top = e.stats().range.top;
                    assert!(capacity - removed - top < granule, "free tail left behind");
                }
                capacity -= removed;
                assert_eq!(e.capacity(), capacity);
            }
            _ => {}
        }
        s.check(&e, tier == RangeTier::Tlsf && slab_max == 0);
    }
    for a in s.handles.drain(..) {
        e.free(a).unwrap();
    }
    e.trim();
    e.validate().unwrap();
    assert!(e.is_empty());
    assert_eq!(e.stats().range.free_bytes, capacity, "everything came back");
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(96), ..ProptestConfig::default() })]

    #[test]
    fn tlsf_with_slabs_matches_shadow(ops in prop::collection::vec(op(), 1..400)) {
        run(ops, RangeTier::Tlsf, 1024);
    }

    #[test]
    fn tlsf_with_mid_sized_slabs_matches_shadow(ops in prop::collection::vec(op(), 1..400)) {
        run(ops, RangeTier::Tlsf, 128 << 10);
    }

    #[test]
    fn tlsf_without_slabs_matches_shadow(ops in prop::collection::vec(op(), 1..300)) {
        run(ops, RangeTier::Tlsf, 0);
    }

    #[test]
    fn buddy_with_slabs_matches_shadow(ops in prop::collection::vec(op(), 1..300)) {
        run(ops, RangeTier::Buddy, 2048);
    }
}

#[test]
fn exhaustion_is_typed_and_recoverable() {
    let mut e = CarveEngine::new(1 << 20, EngineConfig::default()).unwrap();
    let mut held = vec![];
    loop {
        match e.alloc(100_000, CarveRule::default()) {
            Ok(a) => held.push(a),
            Err(EngineError::OutOfSpace {
                footprint,
                largest_free,
            }) => {
                assert_eq!(footprint, 100_032);
                assert!(largest_free < footprint);
                break;
            }
            Err(other) => panic!("{other:?}"),
        }
    }
    e.validate().unwrap();
    let a = held.pop().unwrap();
    e.free(a).unwrap();
    assert!(e.alloc(100_000, CarveRule::default()).is_ok());
    e.validate().unwrap();
}

#[test]
fn zero_and_huge_lengths_are_typed() {
    let mut e = CarveEngine::new(1 << 20, EngineConfig::default()).unwrap();
    assert!(matches!(
        e.alloc(0, CarveRule::default()),
        Err(EngineError::Carve(_))
    ));
    assert!(matches!(
        e.alloc(u64::MAX, CarveRule::default()),
        Err(EngineError::Carve(_))
    ));
    assert!(matches!(
        e.alloc(u64::MAX - 100, CarveRule::default()),
        Err(EngineError::OutOfSpace { .. })
    ));
    assert!(matches!(
        e.alloc(1 << 40, CarveRule::default()),
        Err(EngineError::OutOfSpace { .. })
    ));
    e.validate().unwrap();
    assert_eq!(e.counters().failed, 4);
    assert!(CarveEngine::new(0, EngineConfig::default()).is_err());
    assert!(CarveEngine::new(100, EngineConfig::default()).is_err());
}
