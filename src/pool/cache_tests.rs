//! A random driver for one [`ThreadCache`] against a plain model of what it must do: the
//! same answers to every take and put, the same items drained in the same order (a flush
//! frees them in that order, so the order decides placement), and figures that add up.
//!
//! (Not in `cache.rs` itself: the loom models compile that file with loom's primitives,
//! which work only inside a model.)

use super::cache::{CacheItem, CacheRegistry, ClassCounters, CLASSES};

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
