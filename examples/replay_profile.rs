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
//! `floor` (see [`Floor`]), `offset-allocator`, `rlsf`, `buddy`. `ASCEND_POOL_CONF`
//! configures the pool. The optional last argument is the device size in GiB (64 by
//! default, as for `replay`): valgrind refuses the pool's 64 GiB address reservation, and 8
//! holds every shared trace.
//!
//! With `--cycles` first (x86-64 only), each call is timed on its own between two
//! `lfence; rdtsc; lfence` reads, and the readings are reported by class: memory kind,
//! allocation or free, and whether the footprint is above the thread cache's default
//! 256 KiB limit ("big"). A class's figure is the mean of its fastest 80% of readings,
//! which leaves out the calls the shared machine interrupted; an empty window is printed
//! too, since every reading includes it.
//!
//! ```text
//! target/release/examples/replay_profile --cycles pool ../shared/traces/video-1080p-16ch.jsonl
//! ```

use ascend_pool::engine::Allocation;
use ascend_pool::peers::{BuddyFactory, OffsetAllocatorFactory, RlsfFactory};
use ascend_pool::pool::PoolConfig;
use ascend_pool::trace::{
    EngineFactory, EngineReplayer, LockedEngineFactory, PoolFactory, RangeReplayer,
    ReplayerFactory, TraceConfig, TraceItem, TraceOp, TraceReader, KIND_COUNT,
};
use ascend_pool::{CarveRule, MemKind};
use std::collections::{BTreeMap, HashMap};
use std::io::BufReader;
use std::process::ExitCode;
use std::sync::atomic::{compiler_fence, AtomicBool, AtomicU64, Ordering};

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

/// Footprints above this are "big" in `--cycles` classes: the thread cache's default limit.
const BIG: u64 = 256 << 10;

/// The time-stamp counter between two `lfence`s, so the call between two reads neither
/// starts before the first nor is still running at the second.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn stamp() -> u64 {
    use core::arch::x86_64::{_mm_lfence, _rdtsc};
    // SAFETY: `lfence` and `rdtsc` are part of x86-64 (SSE2 is its baseline); they read the
    // counter and order instructions, and touch no memory.
    unsafe {
        _mm_lfence();
        let t = _rdtsc();
        _mm_lfence();
        t
    }
}

/// `--cycles`: every reading, and each class's.
#[derive(Default)]
struct Cycles {
    all: Vec<u64>,
    classes: BTreeMap<String, Vec<u64>>,
}

impl Cycles {
    /// Times `call` and files the reading under (`op`, `kind`, big or not).
    #[inline(always)]
    fn time<T>(&mut self, op: &str, kind: MemKind, big: bool, call: impl FnOnce() -> T) -> T {
        #[cfg(target_arch = "x86_64")]
        {
            let t = stamp();
            let out = call();
            let c = stamp() - t;
            self.all.push(c);
            let size = if big { "big" } else { "small" };
            self.classes
                .entry(format!("{op} {kind:?} {size}"))
                .or_default()
                .push(c);
            out
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            let _ = (op, kind, big);
            call()
        }
    }

    /// One line: count, mean of the fastest 80%, quartiles.
    fn line(label: &str, v: &mut [u64]) -> String {
        v.sort_unstable();
        let fast = &v[..(v.len() * 8 / 10).max(1)];
        let mean = fast.iter().sum::<u64>() as f64 / fast.len() as f64;
        format!(
            "{label:32} n {:7}  fastest 80% {mean:7.1}  p25 {:5} p50 {:5} p75 {:5}",
            v.len(),
            v[v.len() / 4],
            v[v.len() / 2],
            v[v.len() * 3 / 4]
        )
    }

    fn print(&mut self) {
        let mut empty: Vec<u64> = (0..100_000).map(|_| Self::window()).collect();
        println!("{}", Self::line("empty window", &mut empty));
        if !self.all.is_empty() {
            println!("{}", Self::line("every call", &mut self.all));
        }
        for (label, v) in &mut self.classes {
            println!("{}", Self::line(label, v));
        }
    }

    /// One reading around nothing.
    fn window() -> u64 {
        #[cfg(target_arch = "x86_64")]
        {
            let t = stamp();
            stamp() - t
        }
        #[cfg(not(target_arch = "x86_64"))]
        0
    }
}

thread_local! {
    /// The calling thread's id for [`Floor`], as the pool's biased lock keeps one.
    static THREAD: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// A per-thread id, as the pool's biased lock assigns them (never 0).
fn thread_id() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    THREAD.with(|t| {
        if t.get() == 0 {
            t.set(NEXT.fetch_add(1, Ordering::Relaxed));
        }
        t.get()
    })
}

/// The work a thread-safe pool over our engine cannot skip, and nothing else: the engine
/// (one per kind, as `engine`), entered as the pool's biased kind lock lets its owning
/// thread in (the thread's id compared, a flag stored, a compiler fence, a flag loaded, the
/// flag cleared on leaving), a registry entry per live segment that each free is checked
/// against (a freed or foreign handle is refused, not carved twice), and the pool's always-on
/// counters. No reference count, no thread cache, no chunks.
///
/// Not a pool: only the thread that made it may call it (another thread panics). It prices
/// the pool's necessary layers, so that `--cycles` can show what the rest costs.
struct Floor {
    /// The only thread that may call in.
    owner: u64,
    busy: AtomicBool,
    biased: AtomicBool,
    engine: EngineReplayer,
    /// (offset, requested length) of each live segment, keyed as its token says.
    live: slab::Slab<(u64, u64)>,
    counters: Counters,
    /// Frees whose token matched no live segment.
    refused_frees: u64,
}

/// The counters the pool updates on every kind-path call: a copy on purpose, of the
/// `KindStats` fields `PoolInner::allocate_from_kind` and `settle` touch, so that the floor
/// pays the same stores (the pool's type has no public constructor to reuse).
#[derive(Default)]
struct Counters {
    allocated_bytes: u64,
    requested_bytes: u64,
    peak_allocated_bytes: u64,
    peak_requested_bytes: u64,
    live_regions: u64,
    allocations: u64,
}

impl Floor {
    /// The biased lock's fast path for its owner.
    #[inline(always)]
    fn enter(&self) {
        assert_eq!(
            thread_id(),
            self.owner,
            "a floor is called by its own thread"
        );
        self.busy.store(true, Ordering::Relaxed);
        compiler_fence(Ordering::SeqCst);
        assert!(self.biased.load(Ordering::Relaxed));
    }

    #[inline(always)]
    fn leave(&self) {
        self.busy.store(false, Ordering::Release);
    }
}

impl RangeReplayer for Floor {
    type Token = (Allocation, usize);

    fn alloc(&mut self, len: u64, rule: CarveRule) -> Option<(u64, Self::Token)> {
        self.enter();
        let got = self.engine.alloc(len, rule).map(|(offset, a)| {
            let key = self.live.insert((offset, len));
            let c = &mut self.counters;
            c.allocated_bytes += a.footprint();
            c.requested_bytes += len;
            c.peak_allocated_bytes = c.peak_allocated_bytes.max(c.allocated_bytes);
            c.peak_requested_bytes = c.peak_requested_bytes.max(c.requested_bytes);
            c.live_regions += 1;
            c.allocations += 1;
            (offset, (a, key))
        });
        self.leave();
        got
    }

    fn free(&mut self, (a, key): Self::Token) {
        self.enter();
        if self.live.get(key) == Some(&(a.offset(), a.len())) {
            self.live.remove(key);
            let c = &mut self.counters;
            c.allocated_bytes -= a.footprint();
            c.requested_bytes -= a.len();
            c.live_regions -= 1;
            self.engine.free(a);
        } else {
            self.refused_frees += 1;
        }
        self.leave();
    }

    fn high_water(&self) -> u64 {
        self.engine.high_water()
    }

    fn validate(&self) -> Result<(), String> {
        if self.refused_frees > 0 {
            return Err(format!("{} frees were refused", self.refused_frees));
        }
        if self.counters.live_regions != self.live.len() as u64 {
            return Err("the live count and the registry disagree".into());
        }
        self.engine.validate()
    }
}

/// Builds [`Floor`]s, each owned by the calling thread.
struct FloorFactory;

impl ReplayerFactory for FloorFactory {
    type Replayer = Floor;

    fn name(&self) -> &str {
        "floor"
    }

    fn new_range(&self, kind: MemKind, capacity: u64) -> Result<Floor, String> {
        Ok(Floor {
            owner: thread_id(),
            busy: AtomicBool::new(false),
            biased: AtomicBool::new(true),
            engine: EngineFactory::default().new_range(kind, capacity)?,
            live: slab::Slab::new(),
            counters: Counters::default(),
            refused_frees: 0,
        })
    }
}

/// Replays `events` once; returns (allocator calls made, allocations refused). With
/// `cycles`, times each call.
fn run<F: ReplayerFactory>(
    factory: &F,
    events: &[Event],
    config: TraceConfig,
    mut cycles: Option<&mut Cycles>,
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
                let big = rule.footprint(len).is_ok_and(|f| f > BIG);
                let got = match cycles.as_deref_mut() {
                    Some(c) => c.time("alloc", kind, big, || profile_alloc(range, len, rule)),
                    None => profile_alloc(range, len, rule),
                };
                match got {
                    Some((_, token)) => {
                        tokens.insert(id, (token, big, kind));
                    }
                    None => refused += 1,
                }
            }
            Event::Free { id, kind } => {
                if let (Some((token, big, _)), Some(range)) =
                    (tokens.remove(&id), ranges[kind.index()].as_mut())
                {
                    calls += 1;
                    match cycles.as_deref_mut() {
                        Some(c) => c.time("free", kind, big, || profile_free(range, token)),
                        None => profile_free(range, token),
                    }
                }
            }
        }
    }
    for range in ranges.iter().flatten() {
        range.validate()?;
    }
    // Segments the trace never freed go back now, uncounted, as `replay` gives them back:
    // the pool would otherwise report them as its leaks when it drops.
    for (_, (token, _, kind)) in tokens.drain() {
        if let Some(range) = ranges[kind.index()].as_mut() {
            range.free(token);
        }
    }
    Ok((calls, refused))
}

fn main() -> ExitCode {
    let mut args: Vec<String> = std::env::args().collect();
    let timed = args.get(1).is_some_and(|a| a == "--cycles");
    if timed {
        if !cfg!(target_arch = "x86_64") {
            eprintln!("--cycles reads the x86-64 time-stamp counter");
            return ExitCode::from(2);
        }
        args.remove(1);
    }
    let (backend, path, gib) = match args.as_slice() {
        [_, b, p] => (b, p, None),
        [_, b, p, g] => (b, p, Some(g)),
        _ => {
            eprintln!("usage: replay_profile [--cycles] BACKEND TRACE [DEVICE_GIB]");
            return ExitCode::from(2);
        }
    };
    let mut cycles = timed.then(Cycles::default);
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
            .and_then(|f| run(&f, &events, config, cycles.as_mut())),
        "engine" => run(&EngineFactory::default(), &events, config, cycles.as_mut()),
        "locked" => run(
            &LockedEngineFactory(EngineFactory::default()),
            &events,
            config,
            cycles.as_mut(),
        ),
        "floor" => run(&FloorFactory, &events, config, cycles.as_mut()),
        "offset-allocator" => run(&OffsetAllocatorFactory, &events, config, cycles.as_mut()),
        "rlsf" => run(&RlsfFactory::default(), &events, config, cycles.as_mut()),
        "buddy" => run(&BuddyFactory, &events, config, cycles.as_mut()),
        other => {
            eprintln!(
                "unknown backend {other:?}: pool, engine, locked, floor, offset-allocator, \
                 rlsf or buddy"
            );
            return ExitCode::from(2);
        }
    };
    match result {
        Ok((calls, refused)) => {
            println!("{backend} {path}: calls {calls}, refused {refused}");
            if let Some(c) = &mut cycles {
                c.print();
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("{backend}: {e}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A trace that leaves an allocation live ends with the pool empty: the driver gave it
    /// back, so dropping the pool reports no leak of the driver's making.
    #[test]
    fn what_the_trace_never_frees_goes_back_to_the_pool() {
        let factory = PoolFactory::new(PoolConfig::default(), 8 << 30).unwrap();
        let kind = MemKind::DEVICE;
        let events = [Event::Alloc {
            id: 1,
            len: 100,
            kind,
            rule: kind.carve_rule(),
        }];
        assert_eq!(
            run(&factory, &events, TraceConfig::default(), None),
            Ok((1, 0))
        );
        let snapshot = factory.snapshot().unwrap();
        let live: u64 = snapshot.kinds.iter().map(|k| k.stats.live_regions).sum();
        assert_eq!(live, 0);
    }
}
