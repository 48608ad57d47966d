//! Allocate/free speed of the carving engine against offset-allocator, rlsf and
//! buddy_system_allocator, on identical operation sequences in the same run.
//!
//! Sequences: a synthetic random-size mix, and the shared traces (`../shared/traces`, or
//! `$ASCEND_POOL_TRACES`) pre-parsed so only allocator calls are timed. Each allocator
//! manages one range per memory kind with the same carve rule; ranges are made outside
//! the timed region. Throughput is reported in operations (allocs + frees) per second.

use ascend_pool::engine::{EngineConfig, RangeTier};
use ascend_pool::peers::{BuddyFactory, OffsetAllocatorFactory, RlsfFactory};
use ascend_pool::trace::{
    BumpFactory, EngineFactory, RangeReplayer, ReplayerFactory, TraceConfig, TraceItem, TraceOp,
    TraceReader, KIND_COUNT,
};
use ascend_pool::{CarveRule, MemKind};
use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use std::hint::black_box;
use std::path::PathBuf;

/// Capacity of every range: the trace reader's default device size.
const CAPACITY: u64 = 64 << 30;

#[derive(Clone, Copy)]
enum Op {
    Alloc {
        slot: u32,
        kind: u8,
        len: u64,
        rule: CarveRule,
    },
    Free {
        slot: u32,
        kind: u8,
    },
}

struct Sequence {
    name: String,
    ops: Vec<Op>,
    slots: usize,
}

/// Dense slots for trace ids (ids are unique only while live).
#[derive(Default)]
struct Slots {
    map: std::collections::HashMap<u64, u32>,
    free: Vec<u32>,
    next: u32,
}

impl Slots {
    fn take(&mut self, id: u64) -> u32 {
        let s = self.free.pop().unwrap_or_else(|| {
            self.next += 1;
            self.next - 1
        });
        self.map.insert(id, s);
        s
    }
    fn give(&mut self, id: u64) -> u32 {
        let s = self
            .map
            .remove(&id)
            .expect("trace reader validated the free");
        self.free.push(s);
        s
    }
}

fn load_trace(path: &PathBuf) -> Option<Sequence> {
    let file = std::fs::File::open(path).ok()?;
    let mut reader = TraceReader::new(std::io::BufReader::new(file), TraceConfig::default());
    let mut slots = Slots::default();
    let mut ops = Vec::new();
    while let Some(item) = reader.next_item() {
        match item.ok()? {
            TraceItem::Op(TraceOp::Alloc {
                id,
                len,
                kind,
                rule,
                ..
            }) => ops.push(Op::Alloc {
                slot: slots.take(id),
                kind: kind.index() as u8,
                len,
                rule,
            }),
            TraceItem::Op(TraceOp::Free { id, kind, .. }) => ops.push(Op::Free {
                slot: slots.give(id),
                kind: kind.index() as u8,
            }),
            TraceItem::Rejected(_) => {}
        }
    }
    Some(Sequence {
        name: path.file_stem()?.to_string_lossy().into_owned(),
        ops,
        slots: slots.next as usize,
    })
}

/// Random sizes, log-uniform from 1 B to 1 MiB, about 2,000 live, device and DVPP rules.
fn random_sizes() -> Sequence {
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    let mut rand = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    // (id, slot, kind) of each live segment: a free gives its slot back, so the token
    // table stays about as large as the live set, as an application's handle table would.
    let mut live: Vec<(u64, u32, u8)> = Vec::new();
    let mut slots = Slots::default();
    let mut ops = Vec::new();
    for id in 0..200_000u64 {
        if live.len() < 2000 || rand() % 2 == 0 {
            let len = 1 + (rand() % (1 << (rand() % 20 + 1)));
            let dvpp = rand() % 4 == 0;
            let (kind, rule) = if dvpp {
                (MemKind::Dvpp, CarveRule::model_input())
            } else {
                (MemKind::DEVICE, CarveRule::default())
            };
            let slot = slots.take(id);
            let kind = kind.index() as u8;
            live.push((id, slot, kind));
            ops.push(Op::Alloc {
                slot,
                kind,
                len,
                rule,
            });
        } else {
            let (id, slot, kind) = live.swap_remove((rand() % live.len() as u64) as usize);
            assert_eq!(
                slots.give(id),
                slot,
                "the slot table agrees with the live list"
            );
            ops.push(Op::Free { slot, kind });
        }
    }
    for (_, slot, kind) in live {
        ops.push(Op::Free { slot, kind });
    }
    Sequence {
        name: "random-sizes".into(),
        ops,
        slots: slots.next as usize,
    }
}

fn replay<R: RangeReplayer>(ranges: &mut [R], seq: &Sequence, tokens: &mut [Option<R::Token>]) {
    for op in &seq.ops {
        match *op {
            Op::Alloc {
                slot,
                kind,
                len,
                rule,
            } => {
                let (offset, t) = ranges[kind as usize]
                    .alloc(len, rule)
                    .expect("a 64 GiB range holds every shared trace");
                black_box(offset);
                tokens[slot as usize] = Some(t);
            }
            Op::Free { slot, kind } => {
                let t = tokens[slot as usize].take().expect("freed once");
                ranges[kind as usize].free(t);
            }
        }
    }
}

fn bench_with<F: ReplayerFactory>(
    group: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>,
    factory: &F,
    seq: &Sequence,
) {
    // One untimed replay first: every free went through (a refused free is cheap and would
    // make the timed replays look fast) and the ranges' own checks pass.
    let mut ranges: Vec<F::Replayer> = MemKind::ALL
        .iter()
        .map(|&k| factory.new_range(k, CAPACITY).expect("range"))
        .collect();
    replay(&mut ranges, seq, &mut no_tokens(seq.slots));
    for r in &ranges {
        r.validate()
            .unwrap_or_else(|e| panic!("{} on {}: {e}", factory.name(), seq.name));
    }
    drop(ranges);
    group.bench_function(factory.name().to_string(), |b| {
        b.iter_batched_ref(
            || {
                let ranges: Vec<F::Replayer> = MemKind::ALL
                    .iter()
                    .map(|&k| factory.new_range(k, CAPACITY).expect("range"))
                    .collect();
                (ranges, no_tokens(seq.slots))
            },
            |(ranges, tokens)| replay(ranges, seq, tokens),
            BatchSize::LargeInput,
        )
    });
}

/// A token slot per live allocation of a sequence, all empty (tokens need not be `Clone`).
fn no_tokens<T>(slots: usize) -> Vec<Option<T>> {
    std::iter::repeat_with(|| None).take(slots).collect()
}

fn sequences() -> Vec<Sequence> {
    let dir = std::env::var_os("ASCEND_POOL_TRACES")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../shared/traces"));
    let mut seqs = vec![random_sizes()];
    for name in ["video-1080p-16ch", "llm-serving", "random-mix"] {
        match load_trace(&dir.join(format!("{name}.jsonl"))) {
            Some(s) => seqs.push(s),
            None => eprintln!(
                "engines bench: {name} not found under {}, skipped",
                dir.display()
            ),
        }
    }
    seqs
}

fn engines(c: &mut Criterion) {
    assert_eq!(KIND_COUNT, MemKind::ALL.len());
    for seq in sequences() {
        let mut group = c.benchmark_group(format!("engines/{}", seq.name));
        group.throughput(Throughput::Elements(seq.ops.len() as u64));
        group.sample_size(10);
        bench_with(&mut group, &EngineFactory::default(), &seq);
        bench_with(&mut group, &OffsetAllocatorFactory, &seq);
        bench_with(&mut group, &RlsfFactory::default(), &seq);
        bench_with(&mut group, &BuddyFactory, &seq);
        // The loop's own cost: a bump pointer that never reuses memory does the least any
        // allocator can, so no allocator's time goes below this line.
        bench_with(&mut group, &BumpFactory, &seq);
        if std::env::var_os("ASCEND_POOL_BENCH_BUDDY_TIER").is_some() {
            let buddy = EngineFactory {
                config: EngineConfig {
                    range: RangeTier::Buddy,
                    ..EngineConfig::default()
                },
            };
            bench_with(&mut group, &buddy, &seq);
        }
        group.finish();
    }
}

criterion_group!(benches, engines);
criterion_main!(benches);
