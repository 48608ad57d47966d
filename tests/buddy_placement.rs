//! The buddy range tier against a block-by-block reference buddy, on seeded random operations.
//!
//! `BuddyRange` keeps free runs and derives the buddy blocks from them; `Reference` below
//! keeps the blocks themselves (one ordered set per order, split and merged one block at a
//! time). Both must give the same offset for every allocation, the same answer to every
//! free (including refusals), and the same figures (`stats`, `free_tail`, `largest_free`,
//! `used_bytes`, `high_water`, `capacity`) after every step, with `validate()` passing.

use ascend_pool::engine::buddy::BuddyRange;
use ascend_pool::engine::{EngineError, RangeStats};
use std::collections::{BTreeSet, HashMap};

const MAX_ORDER: u32 = 62;

/// A plain buddy that gives each block's unused tail back: free blocks per order in ordered
/// sets, live allocations in a map. Slow and obviously faithful to the definition.
struct Reference {
    min_order: u32,
    capacity: u64,
    free: Vec<BTreeSet<u64>>,
    live: HashMap<u64, (u64, u64)>,
    free_bytes: u64,
    high_water: u64,
}

impl Reference {
    fn new(capacity: u64, min_block: u64) -> Self {
        let mut r = Self {
            min_order: min_block.trailing_zeros(),
            capacity,
            free: (0..=MAX_ORDER).map(|_| BTreeSet::new()).collect(),
            live: HashMap::new(),
            free_bytes: 0,
            high_water: 0,
        };
        r.free_range(0, capacity);
        r
    }

    /// The lowest-addressed free block among all orders that hold the request.
    fn alloc(&mut self, size: u64, align: u64, tag: u64) -> Option<u64> {
        let order = (64 - (size.max(align) - 1).leading_zeros()).max(self.min_order);
        if order > MAX_ORDER {
            return None;
        }
        let (start, k) = (order..=MAX_ORDER)
            .filter_map(|k| self.free[k as usize].first().map(|&s| (s, k)))
            .min()?;
        self.free[k as usize].remove(&start);
        self.free_bytes -= 1 << k;
        self.free_range(start + size, start + (1 << k));
        self.live.insert(start, (size, tag));
        self.high_water = self.high_water.max(start + size);
        Some(start)
    }

    fn free(&mut self, offset: u64, size: u64, tag: u64) -> Result<(), EngineError> {
        match self.live.get(&offset) {
            Some(&held) if held == (size, tag) => {
                self.live.remove(&offset);
                self.free_range(offset, offset + size);
                Ok(())
            }
            _ => Err(EngineError::AlreadyFreed { offset }),
        }
    }

    fn grow(&mut self, additional: u64) -> bool {
        let c = self.capacity + additional;
        if additional == 0 || additional % (1 << self.min_order) != 0 {
            return false;
        }
        let old = self.capacity;
        self.capacity = c;
        self.free_range(old, c);
        true
    }

    fn free_tail(&self) -> u64 {
        let top = self.live.iter().map(|(s, (l, _))| s + l).max();
        self.capacity - top.unwrap_or(0)
    }

    /// Takes out every free block reaching past the new end and frees their part below it.
    fn shrink(&mut self, bytes: u64) {
        let end = self.capacity - bytes;
        let mut low = end;
        for k in 0..=MAX_ORDER {
            let size = 1u64 << k;
            let cut: Vec<u64> = self.free[k as usize]
                .range(end.saturating_sub(size - 1)..)
                .copied()
                .collect();
            for s in cut {
                self.free[k as usize].remove(&s);
                self.free_bytes -= size;
                low = low.min(s);
            }
        }
        self.capacity = end;
        self.free_range(low, end);
    }

    fn largest_free(&self) -> u64 {
        (0..=MAX_ORDER)
            .rev()
            .find(|&k| !self.free[k as usize].is_empty())
            .map_or(0, |k| 1 << k)
    }

    fn stats(&self) -> RangeStats {
        RangeStats {
            capacity: self.capacity,
            free_bytes: self.free_bytes,
            largest_free: self.largest_free(),
            free_fragments: self.free.iter().map(|s| s.len() as u64).sum(),
            high_water: self.high_water,
            top: self.capacity - self.free_tail(),
        }
    }

    /// Frees `[start, end)` as maximal aligned blocks, each merged with its free buddies.
    fn free_range(&mut self, mut start: u64, end: u64) {
        while start < end {
            let align = if start == 0 {
                MAX_ORDER
            } else {
                start.trailing_zeros()
            };
            let fit = 63 - (end - start).leading_zeros();
            let mut k = align.min(fit).min(MAX_ORDER);
            let mut block = start;
            start += 1 << k;
            self.free_bytes += 1 << k;
            while k < MAX_ORDER {
                let buddy = block ^ (1 << k);
                if buddy + (1 << k) > self.capacity || !self.free[k as usize].remove(&buddy) {
                    break;
                }
                block = block.min(buddy);
                k += 1;
            }
            self.free[k as usize].insert(block);
        }
    }
}

/// A small seeded generator, so every run checks the same sequences.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

fn same_figures(b: &BuddyRange, r: &Reference, step: usize) {
    assert_eq!(b.stats(), r.stats(), "stats after step {step}");
    assert_eq!(b.free_tail(), r.free_tail(), "free tail after step {step}");
    assert_eq!(
        b.largest_free(),
        r.largest_free(),
        "largest free after step {step}"
    );
    assert_eq!(
        b.used_bytes(),
        r.capacity - r.free_bytes,
        "used after step {step}"
    );
    assert_eq!(
        b.is_empty(),
        r.live.is_empty(),
        "emptiness after step {step}"
    );
    b.validate().unwrap_or_else(|e| panic!("step {step}: {e}"));
}

/// Runs `steps` random operations on a range of `capacity` bytes with `min_block` blocks.
fn run(seed: u64, capacity: u64, min_block: u64, steps: usize) {
    let mut b = BuddyRange::new(capacity, min_block).unwrap();
    let mut r = Reference::new(capacity, min_block);
    let mut rng = Rng(seed);
    let mut live: Vec<(u64, u64, u64)> = Vec::new();
    let mut tag = 0u64;
    same_figures(&b, &r, 0);
    for step in 1..=steps {
        match rng.below(20) {
            // Mostly small requests, some large, a few with big alignments.
            0..=9 => {
                let units = match rng.below(8) {
                    0..=4 => 1 + rng.below(8),
                    5 | 6 => 1 + rng.below(200),
                    _ => 1 + rng.below(capacity / min_block),
                };
                let align = min_block << [0, 0, 0, 1, 2, 5][rng.below(6) as usize];
                tag += 1;
                let got = b.alloc(units * min_block, align, tag);
                assert_eq!(got, r.alloc(units * min_block, align, tag), "step {step}");
                if let Some(o) = got {
                    live.push((o, units * min_block, tag));
                }
            }
            10..=15 if !live.is_empty() => {
                let (o, s, t) = live.swap_remove(rng.below(live.len() as u64) as usize);
                assert_eq!(b.free(o, s, t), r.free(o, s, t), "step {step}");
            }
            // Refused frees: a wrong tag or size, a freed or never-allocated offset.
            16 => {
                let (o, s, t) = match live.len() {
                    0 => (rng.below(capacity / min_block) * min_block, min_block, 1),
                    n => {
                        let (o, s, t) = live[rng.below(n as u64) as usize];
                        (
                            o + min_block * rng.below(2),
                            s + min_block * rng.below(2),
                            t + 1 - rng.below(2),
                        )
                    }
                };
                if !live.contains(&(o, s, t)) {
                    let refused = Err(EngineError::AlreadyFreed { offset: o });
                    assert_eq!(b.free(o, s, t), refused);
                    assert_eq!(r.free(o, s, t), refused);
                }
            }
            17 => {
                let additional = [0, 1, min_block, 3 * min_block, 64 * min_block, capacity]
                    [rng.below(6) as usize];
                let ok = b.grow(additional).is_ok();
                assert_eq!(ok, r.grow(additional), "grow {additional} at step {step}");
            }
            18 | 19 => {
                let tail = b.free_tail() / min_block;
                let bytes = rng.below(tail + 1) * min_block;
                b.shrink(bytes);
                r.shrink(bytes);
            }
            _ => {}
        }
        assert_eq!(b.capacity(), r.capacity, "capacity after step {step}");
        assert_eq!(b.high_water(), r.high_water, "high water after step {step}");
        same_figures(&b, &r, step);
    }
}

#[test]
fn power_of_two_ranges_place_like_the_reference() {
    for seed in 1..=6 {
        run(seed, 1 << 20, 64, 2_000);
    }
}

#[test]
fn odd_ranges_and_other_block_sizes_place_like_the_reference() {
    run(11, 3 * 4096 + 64, 64, 2_000);
    run(12, 1000 * 64, 64, 2_000);
    run(13, 7 << 12, 4096, 2_000);
    run(14, 12345 * 8, 8, 2_000);
    run(15, 5, 1, 2_000);
}

#[test]
fn a_large_sparse_range_places_like_the_reference() {
    // 64 GiB of 64-byte blocks: five trie levels, nodes made only where runs start.
    run(21, 64 << 30, 64, 1_000);
}
