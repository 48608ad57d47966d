//! Arbitrary operation sequences against every engine configuration, `validate()` after each.
#![no_main]

use arbitrary::Arbitrary;
use ascend_pool::engine::{Allocation, CarveEngine, EngineConfig, EngineError, RangeTier};
use ascend_pool::CarveRule;
use libfuzzer_sys::fuzz_target;

#[derive(Arbitrary, Debug)]
enum Op {
    Alloc {
        len: u64,
        align_log: u8,
        padding: u8,
    },
    AllocSmall {
        len: u16,
    },
    /// The pool's first look in each chunk: the good-fit search only, in slab pages.
    AllocGoodFit {
        len: u32,
    },
    Free {
        index: u16,
    },
    FreeAgain {
        index: u16,
    },
    FreeForeign,
    Trim,
    Grow {
        additional: u32,
    },
    ShrinkTail {
        granule_log: u8,
        odd: bool,
    },
}

#[derive(Arbitrary, Debug)]
struct Input {
    buddy: bool,
    slab_max: u16,
    capacity_log: u8,
    ops: Vec<Op>,
}

/// Allocates `len` under `rule`: a segment of exactly the rule's footprint, aligned as it
/// asks, or the refusal the rule or a full range gives. The overlap check below trusts
/// `footprint()`, so it is held to the rule here.
fn carved(engine: &mut CarveEngine, len: u64, rule: CarveRule) -> Option<Allocation> {
    let res = engine.alloc(len, rule);
    match (rule.footprint(len), res) {
        (Ok(f), Ok(a)) => {
            assert_eq!((a.footprint(), a.len()), (f, len), "{rule:?}");
            assert_eq!(a.offset() % rule.align(), 0);
            Some(a)
        }
        (Ok(f), Err(EngineError::OutOfSpace { footprint, .. })) => {
            assert_eq!(footprint, f);
            None
        }
        (Err(want), Err(EngineError::Carve(got))) => {
            assert_eq!(got, want);
            None
        }
        (want, got) => panic!("alloc({len}, {rule:?}): footprint {want:?}, gave {got:?}"),
    }
}

/// Whether some stretch of `[0, capacity)` no live segment covers holds `footprint` bytes
/// at an `align`-aligned start.
fn room_for(live: &[Allocation], capacity: u64, footprint: u64, align: u64) -> bool {
    let mut spans: Vec<(u64, u64)> = live.iter().map(|a| (a.offset(), a.footprint())).collect();
    spans.sort_unstable();
    let mut from = 0u64;
    for (start, len) in spans.into_iter().chain([(capacity, 0)]) {
        let aligned = from.next_multiple_of(align);
        if aligned
            .checked_add(footprint)
            .is_some_and(|end| end <= start)
        {
            return true;
        }
        from = from.max(start + len);
    }
    false
}

fuzz_target!(|input: Input| {
    let mut capacity = 1u64 << (12 + input.capacity_log % 16);
    let config = EngineConfig {
        range: if input.buddy {
            RangeTier::Buddy
        } else {
            RangeTier::Tlsf
        },
        // Up to 256 KiB in steps of 4 bytes: exact classes, eighth-of-a-doubling ones above.
        slab_max: u64::from(input.slab_max) * 4,
    };
    let mut engine = CarveEngine::new(capacity, config).unwrap();
    let mut other = CarveEngine::new(1 << 16, config).unwrap();
    let foreign = other.alloc(1, CarveRule::default()).unwrap();
    let mut live: Vec<Allocation> = Vec::new();
    let mut freed: Vec<Allocation> = Vec::new();
    for op in input.ops.into_iter().take(2000) {
        match op {
            Op::Alloc {
                len,
                align_log,
                padding,
            } => {
                let Ok(rule) =
                    CarveRule::new(u64::from(padding % 4) * 32, 1 << (6 + align_log % 16))
                else {
                    continue;
                };
                match carved(&mut engine, len, rule) {
                    Some(a) => {
                        assert!(a.offset() + a.footprint() <= capacity);
                        live.push(a);
                    }
                    // Without slabs the free space is exactly what no live segment covers:
                    // a refusal from the TLSF tier means none of it holds the request.
                    None if !input.buddy && config.slab_max == 0 => {
                        if let Ok(f) = rule.footprint(len) {
                            assert!(
                                !room_for(&live, capacity, f, rule.align()),
                                "refused {f} bytes at {} with room for them",
                                rule.align()
                            );
                        }
                    }
                    None => {}
                }
            }
            Op::AllocGoodFit { len } => {
                let rule = CarveRule::default();
                match engine.alloc_in_pages_good_fit(u64::from(len), rule) {
                    Ok(a) => {
                        assert_eq!(rule.footprint(u64::from(len)), Ok(a.footprint()));
                        assert_eq!(a.offset() % rule.align(), 0);
                        live.push(a);
                    }
                    Err(
                        EngineError::OutOfSpace { .. }
                        | EngineError::NoRoomForPage { .. }
                        | EngineError::Carve(_),
                    ) => {}
                    Err(e) => panic!("alloc_in_pages_good_fit({len}): {e:?}"),
                }
            }
            Op::AllocSmall { len } => {
                if let Some(a) = carved(&mut engine, u64::from(len), CarveRule::default()) {
                    live.push(a);
                }
            }
            Op::Free { index } if !live.is_empty() => {
                let a = live.swap_remove(usize::from(index) % live.len());
                engine.free(a).unwrap();
                freed.push(a);
            }
            Op::FreeAgain { index } if !freed.is_empty() => {
                let a = freed[usize::from(index) % freed.len()];
                assert!(matches!(
                    engine.free(a),
                    Err(EngineError::AlreadyFreed { .. })
                ));
            }
            Op::FreeForeign => {
                assert_eq!(engine.free(foreign), Err(EngineError::ForeignAllocation))
            }
            Op::Trim => engine.trim(),
            Op::Grow { additional } => {
                let additional = u64::from(additional);
                let ok = additional > 0 && additional % 64 == 0;
                assert_eq!(engine.grow(additional).is_ok(), ok);
                if ok {
                    capacity += additional;
                }
            }
            Op::ShrinkTail { granule_log, odd } => {
                let granule = (1u64 << (granule_log % 24)) + u64::from(odd) * 64;
                let removed = engine.shrink_free_tail(granule);
                if granule % 64 != 0 {
                    assert_eq!(removed, 0);
                } else {
                    assert_eq!(removed % granule, 0);
                    assert!(capacity - removed - engine.stats().range.top < granule);
                }
                capacity -= removed;
            }
            _ => {}
        }
        engine.validate().unwrap();
        assert_eq!(engine.capacity(), capacity);
        for a in &live {
            assert!(a.offset() + a.footprint() <= capacity);
        }
        // No two live segments overlap.
        let mut spans: Vec<(u64, u64)> = live.iter().map(|a| (a.offset(), a.footprint())).collect();
        spans.sort_unstable();
        for w in spans.windows(2) {
            assert!(w[0].0 + w[0].1 <= w[1].0);
        }
    }
    for a in live {
        engine.free(a).unwrap();
    }
    engine.trim();
    engine.validate().unwrap();
    assert!(engine.is_empty());
});
