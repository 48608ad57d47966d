//! Arbitrary bytes as a trace, replayed through the backends `ascend-pool replay --compare`
//! runs: the tool must read any input to its end, count what is wrong in it, and never panic.
//! (offset-allocator is left out: each of its ranges zeroes node tables for two million
//! allocations, about 40 MB, which would cut the fuzzer to a few inputs a second.)
//!
//! The first byte picks the device size (small, so "too large for the device" and
//! "out of memory" come up often) and the replay options; the rest is the trace, raw bytes,
//! so invalid UTF-8, broken JSON and invalid events all occur.
//!
//! What is wrong in the trace is the trace's, not the backend's: every backend counts each
//! category but out-of-memory as a reader of its own counts it, replays as many events and
//! ends with as many left live. Each pool ends holding no region, having served every
//! allocation it did not refuse.
#![no_main]

use ascend_pool::align::CarveRule;
use ascend_pool::engine::{EngineConfig, RangeTier};
use ascend_pool::kind::MemKind;
use ascend_pool::peers::{BuddyFactory, RlsfFactory};
use ascend_pool::pool::PoolConfig;
use ascend_pool::trace::{
    replay, EngineFactory, EngineReplayer, ErrorCounts, PoolFactory, RangeReplayer, RejectKind,
    ReplayReport, ReplaySource, ReplayerFactory, TraceConfig, TraceItem, TraceReader,
};
use libfuzzer_sys::fuzz_target;

fn run<F: ReplayerFactory>(factory: &F, trace: &[u8], config: TraceConfig) -> ReplayReport {
    let report = replay(trace, config, factory, |_| {})
        .expect("an in-memory trace can always be read to its end");
    assert!(
        report.invariant_errors.is_empty(),
        "{}: {:?}",
        report.backend,
        report.invariant_errors
    );
    // Reserved bytes hold every live footprint: utilization never passes 1 (unless the
    // backend refused some allocations, which the trace still counts as live).
    assert!(
        report.peak_reserved_bytes >= report.peak_required_bytes
            || report.errors.get(RejectKind::OutOfMemory) > 0,
        "{}: reserved {} < required {}",
        report.backend,
        report.peak_reserved_bytes,
        report.peak_required_bytes
    );
    assert!(report.peak_required_bytes >= report.peak_requested_bytes);
    assert!(report.lines >= report.ops);
    if let Some(snap) = &report.snapshot {
        ascend_pool::svg::pool_state(snap, "fuzz");
    }
    if !report.timeline.is_empty() {
        ascend_pool::svg::timeline(&report.timeline, "fuzz");
    }
    report
}

/// A range of our engine that must serve, while it holds nothing, any footprint up to its
/// capacity (offset 0 is aligned to anything): a refusal then is the engine's fault, which
/// the report would count as out of memory and let pass.
struct MustFit(EngineFactory);

struct MustFitRange {
    inner: EngineReplayer,
    capacity: u64,
    live: u64,
}

impl RangeReplayer for MustFitRange {
    type Token = <EngineReplayer as RangeReplayer>::Token;

    fn alloc(&mut self, len: u64, rule: CarveRule) -> Option<(u64, Self::Token)> {
        let got = self.inner.alloc(len, rule);
        if got.is_none() && self.live == 0 {
            let footprint = rule
                .footprint(len)
                .expect("the reader checked the footprint");
            assert!(
                footprint > self.capacity,
                "an empty range of {} bytes refused {footprint} bytes ({len} at {})",
                self.capacity,
                rule.align()
            );
        }
        self.live += u64::from(got.is_some());
        got
    }

    fn free(&mut self, token: Self::Token) {
        self.live -= 1;
        self.inner.free(token);
    }

    fn high_water(&self) -> u64 {
        self.inner.high_water()
    }

    fn validate(&self) -> Result<(), String> {
        self.inner.validate()
    }
}

impl ReplayerFactory for MustFit {
    type Replayer = MustFitRange;

    fn name(&self) -> &str {
        self.0.name()
    }

    fn new_range(&self, kind: MemKind, capacity: u64) -> Result<MustFitRange, String> {
        let inner = self.0.new_range(kind, capacity)?;
        Ok(MustFitRange {
            capacity: inner.engine().capacity(),
            inner,
            live: 0,
        })
    }
}

/// What a reader alone finds in the trace: rejected lines by category, valid events, and
/// allocations left live at the end.
fn read_alone(trace: &[u8], config: TraceConfig) -> (ErrorCounts, u64, u64) {
    let mut reader = TraceReader::new(trace, config);
    let mut ops = 0;
    while let Some(item) = reader.next_item() {
        if let TraceItem::Op(_) = item.expect("an in-memory trace reads") {
            ops += 1;
        }
    }
    (*reader.errors(), ops, reader.live_count() as u64)
}

/// The pool a replay ran on: nothing live or pending once the replay gave back what the
/// trace left live, every allocation it did not refuse served, and valid.
fn pool_ends_empty(factory: &PoolFactory, report: &ReplayReport) {
    let snap = factory.snapshot().expect("a pool has a snapshot");
    let mut served = 0;
    for k in &snap.kinds {
        let s = &k.stats;
        assert_eq!(
            (
                s.live_regions,
                s.allocated_bytes,
                s.requested_bytes,
                s.pending_frees
            ),
            (0, 0, 0, 0),
            "{} {:?} after the replay: {s:?}",
            factory.source().name(),
            s.kind
        );
        assert_eq!(s.allocations, s.frees, "{:?}: {s:?}", s.kind);
        served += s.allocations;
    }
    let valid_allocs: u64 = report.per_kind.iter().map(|k| k.allocs).sum();
    assert_eq!(
        served + report.errors.get(RejectKind::OutOfMemory),
        valid_allocs,
        "{}: allocations served plus refused",
        factory.source().name()
    );
}

fuzz_target!(|data: &[u8]| {
    let Some((&options, trace)) = data.split_first() else {
        return;
    };
    let config = TraceConfig {
        // 1 MiB to 128 MiB.
        device_size: 1 << (20 + u32::from(options % 8)),
        check_placement: options & 0x08 != 0,
        timeline: options & 0x10 != 0,
        snapshot_at: (options & 0x20 != 0).then_some(u64::from(options >> 6) + 1),
    };
    let ours = run(&MustFit(EngineFactory::default()), trace, config);
    let buddy_tier = MustFit(EngineFactory {
        config: EngineConfig {
            range: RangeTier::Buddy,
            ..EngineConfig::default()
        },
    });
    let vmm_pool = PoolFactory::new(PoolConfig::default(), config.device_size).unwrap();
    let sim_pool = PoolFactory::new(PoolConfig::default(), config.device_size)
        .unwrap()
        .with_source(ReplaySource::Sim);
    let vmm_report = run(&vmm_pool, trace, config);
    pool_ends_empty(&vmm_pool, &vmm_report);
    let sim_report = run(&sim_pool, trace, config);
    pool_ends_empty(&sim_pool, &sim_report);
    let reports = [
        run(&buddy_tier, trace, config),
        vmm_report,
        sim_report,
        run(&RlsfFactory::default(), trace, config),
        run(&BuddyFactory, trace, config),
    ];
    let (errors, ops, live) = read_alone(trace, config);
    // What the trace asks for does not depend on who serves it.
    for r in std::iter::once(&ours).chain(&reports) {
        assert_eq!(r.lines, ours.lines, "{}", r.backend);
        assert_eq!(
            r.peak_requested_bytes, ours.peak_requested_bytes,
            "{}",
            r.backend
        );
        assert_eq!(
            r.peak_required_bytes, ours.peak_required_bytes,
            "{}",
            r.backend
        );
        // Bad events are the trace's: each backend rejects the same ones, for the same
        // reasons, and only out-of-memory is its own.
        for kind in RejectKind::ALL {
            if kind != RejectKind::OutOfMemory {
                assert_eq!(
                    r.errors.get(kind),
                    errors.get(kind),
                    "{}: {kind}",
                    r.backend
                );
            }
        }
        assert_eq!((r.ops, r.live_at_end), (ops, live), "{}", r.backend);
    }
});
