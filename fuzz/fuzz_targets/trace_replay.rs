//! Arbitrary bytes as a trace, replayed through the backends `ascend-pool replay --compare`
//! runs: the tool must read any input to its end, count what is wrong in it, and never panic.
//! (offset-allocator is left out: each of its ranges zeroes node tables for two million
//! allocations, about 40 MB, which would cut the fuzzer to a few inputs a second.)
//!
//! The first byte picks the device size (small, so "too large for the device" and
//! "out of memory" come up often) and the replay options; the rest is the trace, raw bytes,
//! so invalid UTF-8, broken JSON and invalid events all occur.
#![no_main]

use ascend_pool::engine::{EngineConfig, RangeTier};
use ascend_pool::peers::{BuddyFactory, RlsfFactory};
use ascend_pool::pool::PoolConfig;
use ascend_pool::trace::{
    replay, EngineFactory, PoolFactory, RejectKind, ReplayReport, ReplaySource, ReplayerFactory,
    TraceConfig,
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
    let ours = run(&EngineFactory::default(), trace, config);
    let buddy_tier = EngineFactory {
        config: EngineConfig {
            range: RangeTier::Buddy,
            ..EngineConfig::default()
        },
    };
    let reports = [
        run(&buddy_tier, trace, config),
        run(
            &PoolFactory::new(PoolConfig::default(), config.device_size).unwrap(),
            trace,
            config,
        ),
        run(
            &PoolFactory::new(PoolConfig::default(), config.device_size)
                .unwrap()
                .with_source(ReplaySource::Sim),
            trace,
            config,
        ),
        run(&RlsfFactory::default(), trace, config),
        run(&BuddyFactory, trace, config),
    ];
    // What the trace asks for does not depend on who serves it.
    for r in &reports {
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
    }
});
