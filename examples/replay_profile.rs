//! Replays a trace through one backend with no timing at all, for profilers.
//!
//! `replay --compare` times every call with a clock read, and on a shared machine its
//! figures move by a third from run to run. Instruction counts do not: run this under
//! callgrind and count only what the allocator calls execute.
//!
//! ```text
//! cargo build --release --example replay_profile
//! valgrind --tool=callgrind --collect-atstart=no \
//!     --toggle-collect='replay_profile::profile_alloc*' \
//!     --toggle-collect='replay_profile::profile_free*' \
//!     target/release/examples/replay_profile pool ../shared/traces/random-mix.jsonl 8
//! ```
//!
//! The "Collected" count divided by the `calls` this prints is instructions per operation.
//! Backends: `pool`, `engine`, `locked` (the engine behind a mutex and a counted handle),
//! `offset-allocator`, `rlsf`, `buddy`. `ASCEND_POOL_CONF` configures the pool. The optional
//! last argument is the device size in GiB (64 by default, as for `replay`): valgrind refuses
//! the pool's 64 GiB address reservation, and 8 holds every shared trace.

use ascend_pool::peers::{BuddyFactory, OffsetAllocatorFactory, RlsfFactory};
use ascend_pool::pool::PoolConfig;
use ascend_pool::trace::{
    EngineFactory, LockedEngineFactory, PoolFactory, RangeReplayer, ReplayerFactory, TraceConfig,
    TraceItem, TraceOp, TraceReader, KIND_COUNT,
};
use ascend_pool::{CarveRule, MemKind};
use std::collections::HashMap;
use std::io::BufReader;
use std::process::ExitCode;

/// A valid event of the trace, decoded before the replay so that parsing stays out of it.
#[derive(Clone, Copy)]
enum Event {
    Alloc {
        id: u64,
        len: u64,
        kind: MemKind,
        rule: CarveRule,
    },
    Free {
        id: u64,
        kind: MemKind,
    },
}

/// The allocation call, out of line so that a profiler can count it alone.
#[inline(never)]
fn profile_alloc<R: RangeReplayer>(
    r: &mut R,
    len: u64,
    rule: CarveRule,
) -> Option<(u64, R::Token)> {
    r.alloc(len, rule)
}

/// The free call, out of line for the same reason.
#[inline(never)]
fn profile_free<R: RangeReplayer>(r: &mut R, token: R::Token) {
    r.free(token)
}

/// Replays `events` once; returns (allocator calls made, allocations refused).
fn run<F: ReplayerFactory>(
    factory: &F,
    events: &[Event],
    config: TraceConfig,
) -> Result<(u64, u64), String> {
    factory.start_replay();
    let mut ranges: [Option<F::Replayer>; KIND_COUNT] = Default::default();
    let mut tokens = HashMap::new();
    let (mut calls, mut refused) = (0u64, 0u64);
    for &event in events {
        match event {
            Event::Alloc {
                id,
                len,
                kind,
                rule,
            } => {
                let slot = &mut ranges[kind.index()];
                if slot.is_none() {
                    *slot = Some(factory.new_range(kind, config.device_size)?);
                }
                let Some(range) = slot.as_mut() else { continue };
                calls += 1;
                match profile_alloc(range, len, rule) {
                    Some((_, token)) => {
                        tokens.insert(id, token);
                    }
                    None => refused += 1,
                }
            }
            Event::Free { id, kind } => {
                if let (Some(token), Some(range)) =
                    (tokens.remove(&id), ranges[kind.index()].as_mut())
                {
                    calls += 1;
                    profile_free(range, token);
                }
            }
        }
    }
    for range in ranges.iter().flatten() {
        range.validate()?;
    }
    Ok((calls, refused))
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    let (backend, path, gib) = match args.as_slice() {
        [_, b, p] => (b, p, None),
        [_, b, p, g] => (b, p, Some(g)),
        _ => {
            eprintln!("usage: replay_profile BACKEND TRACE [DEVICE_GIB]");
            return ExitCode::from(2);
        }
    };
    let mut config = TraceConfig::default();
    if let Some(g) = gib {
        match g.parse::<u64>().ok().and_then(|g| g.checked_mul(1 << 30)) {
            Some(bytes) if bytes > 0 => config.device_size = bytes,
            _ => {
                eprintln!("device size {g:?}: a whole number of GiB, at least 1");
                return ExitCode::from(2);
            }
        }
    }
    let file = match std::fs::File::open(path) {
        Ok(f) => f,
        Err(e) => {
            eprintln!("{path}: {e}");
            return ExitCode::FAILURE;
        }
    };
    let mut reader = TraceReader::new(BufReader::new(file), config);
    let mut events = Vec::new();
    while let Some(item) = reader.next_item() {
        match item {
            Ok(TraceItem::Op(TraceOp::Alloc {
                id,
                len,
                kind,
                rule,
                ..
            })) => events.push(Event::Alloc {
                id,
                len,
                kind,
                rule,
            }),
            Ok(TraceItem::Op(TraceOp::Free { id, kind, .. })) => {
                events.push(Event::Free { id, kind })
            }
            Ok(_) => {}
            Err(e) => {
                eprintln!("{path}: {e}");
                return ExitCode::FAILURE;
            }
        }
    }
    let result = match backend.as_str() {
        "pool" => PoolConfig::from_env()
            .map_err(|e| e.to_string())
            .and_then(|c| PoolFactory::new(c, config.device_size).map_err(|e| e.to_string()))
            .and_then(|f| run(&f, &events, config)),
        "engine" => run(&EngineFactory::default(), &events, config),
        "locked" => run(
            &LockedEngineFactory(EngineFactory::default()),
            &events,
            config,
        ),
        "offset-allocator" => run(&OffsetAllocatorFactory, &events, config),
        "rlsf" => run(&RlsfFactory::default(), &events, config),
        "buddy" => run(&BuddyFactory, &events, config),
        other => {
            eprintln!(
                "unknown backend {other:?}: pool, engine, locked, offset-allocator, rlsf or buddy"
            );
            return ExitCode::from(2);
        }
    };
    match result {
        Ok((calls, refused)) => {
            println!("{backend} {path}: calls {calls}, refused {refused}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("{backend}: {e}");
            ExitCode::FAILURE
        }
    }
}
