//! A random driver for one [`ThreadCache`] against a plain model of what it must do: the
//! same answers to every take and put, the same items drained in the same order (a flush
//! frees them in that order, so the order decides placement), and figures that add up.
//!
//! (Not in `cache.rs` itself: the loom models compile that file with loom's primitives,
//! which work only inside a model.)

use super::cache::{CacheItem, CacheRegistry, ClassCounters, CLASSES, DRIFTS};

/// A stand-in segment: a unique id, its class, shape and footprint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Item {
    id: u64,
    class: usize,
    len: u64,
    align: u64,
    bytes: u64,
}

impl CacheItem for Item {
    fn class(&self) -> usize {
        self.class
    }
    fn shape(&self) -> (u64, u64) {
        (self.len, self.align)
    }
    fn bytes(&self) -> u64 {
        self.bytes
    }
}

/// (class, length, alignment).
type Shape = (usize, u64, u64);

/// The model: 16 bins found by linear scans, a new shape taking the first empty bin.
struct Model {
    limit: u64,
    bins: Vec<(Option<Shape>, Vec<Item>)>,
    puts: [u64; CLASSES],
    hits: [u64; CLASSES],
}

impl Model {
    fn shape_of(i: &Item) -> Shape {
        (i.class, i.len, i.align)
    }

    fn bytes(&self) -> u64 {
        self.bins.iter().flat_map(|b| &b.1).map(|i| i.bytes).sum()
    }

    fn put(&mut self, item: Item) -> bool {
        if self.bytes() + item.bytes > self.limit {
            return false;
        }
        let shape = Some(Self::shape_of(&item));
        let at = match self.bins.iter().position(|b| b.0 == shape) {
            Some(i) => i,
            None => match self.bins.iter().position(|b| b.1.is_empty()) {
                Some(i) => {
                    self.bins[i].0 = shape;
                    i
                }
                None => return false,
            },
        };
        self.bins[at].1.push(item);
        self.puts[item.class] += 1;
        true
    }

    fn take(&mut self, shape: Shape, min_bytes: u64) -> Option<Item> {
        let bin = self.bins.iter_mut().find(|b| b.0 == Some(shape))?;
        if bin.1.last()?.bytes < min_bytes {
            return None;
        }
        self.hits[shape.0] += 1;
        bin.1.pop()
    }

    fn drain(&mut self, class: usize) -> Vec<Item> {
        let mut out = Vec::new();
        for b in &mut self.bins {
            if b.0.is_some_and(|s| s.0 == class) {
                out.append(&mut b.1);
            }
        }
        out
    }

    fn counters(&self, class: usize) -> ClassCounters {
        let held: Vec<&Item> = self
            .bins
            .iter()
            .flat_map(|b| &b.1)
            .filter(|i| i.class == class)
            .collect();
        ClassCounters {
            items: held.len() as u64,
            bytes: held.iter().map(|i| i.bytes).sum(),
            requested: held.iter().map(|i| i.len).sum(),
            hits: self.hits[class],
            puts: self.puts[class],
        }
    }
}

/// A small deterministic generator (xorshift).
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }
}

/// Runs `steps` random operations over `shapes` distinct shapes (more than the 16 bins
/// when above 16, so bins are taken over and keys share filter bits).
fn drive(seed: u64, shapes: u64, steps: usize) {
    // Miri runs this some thousand times slower: the first seeds and a tenth of the steps.
    if cfg!(miri) && seed > 2 {
        return;
    }
    let steps = if cfg!(miri) { steps / 10 } else { steps };
    let limit = 64 << 10;
    let reg = CacheRegistry::<Item>::new(limit);
    let cache = reg.register();
    let mut model = Model {
        limit,
        bins: vec![(None, Vec::new()); 16],
        puts: [0; CLASSES],
        hits: [0; CLASSES],
    };
    let mut rng = Rng(seed);
    let mut next_id = 0;
    let shape = |s: u64| {
        let class = (s % CLASSES as u64) as usize;
        let len = 1 + s * 97;
        let align = if s % 3 == 0 { 128 } else { 64 };
        (class, len, align)
    };
    for step in 0..steps {
        let (class, len, align) = shape(rng.below(shapes));
        // Two footprints per shape, as two padding policies give.
        let bytes = len.div_ceil(32) * 32 + 32 * (1 + rng.below(2));
        match rng.below(10) {
            0..=4 => {
                let item = Item {
                    id: next_id,
                    class,
                    len,
                    align,
                    bytes,
                };
                next_id += 1;
                // Half the puts build their item only once it has a place, as a free does.
                let kept = if step % 2 == 0 {
                    let back = cache.put(item);
                    if let Err(back) = back {
                        assert_eq!(back, item, "step {step}: a refused item came back changed");
                    }
                    back.is_ok()
                } else {
                    let mut built = false;
                    let back = cache.put_with(class, (len, align), bytes, item.id, |id| {
                        built = true;
                        Item { id, ..item }
                    });
                    assert_eq!(built, back.is_ok(), "step {step}: built iff kept");
                    if let Err(id) = back {
                        assert_eq!(id, item.id, "step {step}: the parts came back changed");
                    }
                    back.is_ok()
                };
                assert_eq!(kept, model.put(item), "step {step}: put of {item:?}");
            }
            5..=8 => {
                let got = cache.take(class, (len, align), bytes);
                let want = model.take((class, len, align), bytes);
                assert_eq!(got, want, "step {step}: take of {:?}", (class, len, align));
            }
            _ => {
                let c = rng.below(CLASSES as u64) as usize;
                assert_eq!(cache.drain_class(c), model.drain(c), "step {step}: drain");
            }
        }
        // Under Miri the comparison, not the operations, took most of the time: the
        // operations (the unsafe code Miri is for) run every step, the full check every
        // eighth step and the last.
        if cfg!(miri) && step % 8 != 7 && step + 1 != steps {
            continue;
        }
        cache.check().unwrap_or_else(|e| panic!("step {step}: {e}"));
        for c in 0..CLASSES {
            assert_eq!(
                cache.counters(c),
                model.counters(c),
                "step {step}: class {c}"
            );
        }
        assert_eq!(
            cache.items_held(),
            std::array::from_fn(|c| model.counters(c).items)
        );
    }
}

#[test]
fn few_shapes_match_the_model() {
    for seed in 1..20 {
        drive(seed, 6, 2_000);
    }
}

#[test]
fn more_shapes_than_bins_match_the_model() {
    for seed in 1..20 {
        drive(seed, 40, 3_000);
    }
}

#[test]
fn many_shapes_match_the_model() {
    for seed in 1..10 {
        drive(seed, 1_000, 3_000);
    }
}

/// Shapes no bin key can name (a class past the last, a zero length, a length past 2^55,
/// an alignment that is not a power of two) are never kept: a put gives the item back, a
/// take finds nothing, and the figures do not move.
#[test]
fn shapes_no_key_can_name_are_never_kept() {
    let reg = CacheRegistry::<Item>::new(1 << 20);
    let cache = reg.register();
    let ok = Item {
        id: 0,
        class: 1,
        len: 100,
        align: 64,
        bytes: 192,
    };
    for (n, bad) in [
        Item {
            class: CLASSES,
            ..ok
        },
        Item { len: 0, ..ok },
        Item { len: 1 << 55, ..ok },
        Item { align: 96, ..ok },
    ]
    .into_iter()
    .enumerate()
    {
        let bad = Item {
            id: n as u64 + 1,
            ..bad
        };
        assert_eq!(cache.put(bad), Err(bad), "{bad:?}");
        assert_eq!(
            cache.put_with(bad.class, (bad.len, bad.align), bad.bytes, bad.id, |id| {
                Item { id, ..bad }
            }),
            Err(bad.id),
            "{bad:?}"
        );
        assert_eq!(cache.take(bad.class, (bad.len, bad.align), 0), None);
        cache.check().unwrap();
    }
    assert_eq!(cache.items_held(), [0; CLASSES]);
    // The last length a key names is kept and found.
    let longest = Item {
        len: (1 << 55) - 1,
        ..ok
    };
    assert_eq!(cache.put(longest), Ok(()));
    assert_eq!(cache.take(1, (longest.len, 64), 0), Some(longest));
    cache.check().unwrap();
}

/// A cache `check` passes, then fails once any one of its invariants is broken.
#[test]
fn check_reports_each_kind_of_drift() {
    for case in 0..DRIFTS {
        let reg = CacheRegistry::<Item>::new(1 << 20);
        let cache = reg.register();
        let item = |id, class, len| Item {
            id,
            class,
            len,
            align: 64,
            bytes: len.div_ceil(32) * 32 + 32,
        };
        cache.put(item(1, 2, 1000)).unwrap();
        cache.put(item(2, 2, 1000)).unwrap();
        cache.put(item(3, 4, 500)).unwrap();
        assert_eq!(cache.take(4, (500, 64), 0), Some(item(3, 4, 500)));
        cache.check().unwrap();
        cache.drift_for_test(case);
        assert!(cache.check().is_err(), "drift {case} went unreported");
    }
}

/// A cache unregistered with items still in it gives them back, and its totals stay in the
/// registry's.
#[test]
fn unregistering_gives_back_what_the_cache_still_holds() {
    let reg = CacheRegistry::<Item>::new(1 << 20);
    let cache = reg.register();
    let items: Vec<Item> = (0..5)
        .map(|id| Item {
            id,
            class: (id % 2) as usize,
            len: 64 * (1 + id % 3),
            align: 64,
            bytes: 128 * (1 + id % 3),
        })
        .collect();
    for &i in &items {
        cache.put(i).unwrap();
    }
    assert_eq!(cache.take(0, (64, 64), 0), Some(items[0]));
    let mut left = reg.unregister(&cache);
    left.sort_by_key(|i| i.id);
    assert_eq!(left, items[1..]);
    assert_eq!(cache.items_held(), [0; CLASSES]);
    assert_eq!(
        (reg.totals(0).puts, reg.totals(0).hits, reg.totals(0).items),
        (3, 1, 0)
    );
    assert_eq!((reg.totals(1).puts, reg.totals(1).hits), (2, 0));
}
