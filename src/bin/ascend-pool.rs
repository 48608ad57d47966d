//! `ascend-pool`: command-line tools for the ascend-pool sub-allocator.
//!
//! `ascend-pool replay TRACE... [--compare] [--json] [--ranges] [--engine NAME] [--rounds N]` replays
//! allocation traces (JSON Lines, see `shared/traces/README.md`) and reports
//! peak requested / required / reserved bytes, utilization, block-source calls and time
//! per operation. The JSON schema is in `docs/replay-json.md`.
//!
//! By default the trace runs through the whole pool on the simulator (chunked growth,
//! dedicated chunks, release threshold; `--pool-conf` takes `ASCEND_POOL_CONF` syntax);
//! `--ranges` runs our carving engine over one range per kind instead, as the peers do.
//! `--svg-state` and `--svg-timeline` draw the pool at the trace's fullest moment and the
//! bytes over the replay.
//!
//! Each backend replays each trace twice, in its own passes: an untimed-in-effect
//! warm-up (page faults, allocator caches) and the reported pass (`--cold` reports a
//! single first pass instead). Both passes give the same memory figures. `--rounds N` replays
//! every backend N times, taking turns, and reports each one's median time over the rounds.
//!
//! Exit status: 0 when every trace was read to its end (bad events are counted,
//! not fatal) and every backend's invariants held, 1 when a trace could not be opened or
//! read, a backend broke an invariant (`validate()`, or a placement `--check` refuses) or a
//! picture could not be written, 2 on a usage error.

use std::fs::File;
use std::io::{BufReader, IsTerminal, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::{Parser, Subcommand, ValueEnum};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde_json::{json, Value};

use ascend_pool::engine::{EngineConfig, RangeTier};
use ascend_pool::peers::{BuddyFactory, OffsetAllocatorFactory, RlsfFactory};
use ascend_pool::pool::PoolConfig;
use ascend_pool::trace::{
    fullest_op, replay, EngineFactory, LockedEngineFactory, PoolFactory, ReplayReport,
    ReplaySource, ReplayerFactory, TraceConfig, DEFAULT_DEVICE_SIZE,
};

#[derive(Debug, Parser)]
#[command(
    name = "ascend-pool",
    version,
    about = "Tools for the ascend-pool sub-allocator"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Replay allocation traces and report peak memory, utilization, source calls and ns/op.
    Replay(ReplayArgs),
}

#[derive(Debug, clap::Args)]
struct ReplayArgs {
    /// Trace files (JSON Lines).
    #[arg(required = true)]
    traces: Vec<PathBuf>,
    /// Also replay through every peer allocator and print a comparison table.
    #[arg(long)]
    compare: bool,
    /// Print exactly one JSON object on stdout instead of the text report.
    #[arg(long)]
    json: bool,
    /// The allocator whose figures the report leads with [default: pool, or carve with --ranges].
    #[arg(long, value_enum)]
    engine: Option<Backend>,
    /// Replay our carving engine over one range per memory kind (reserved = highest offset)
    /// instead of the whole pool.
    #[arg(long)]
    ranges: bool,
    /// Pool configuration in `ASCEND_POOL_CONF` syntax (`chunk_size:64m,...`); the
    /// environment variable is not read, and `record` is ignored.
    #[arg(long, default_value = "")]
    pool_conf: String,
    /// Where the pool takes device memory from: `vmm` maps granules into one reserved range
    /// (chunks grow in place), `sim` allocates fixed chunks with `aclrtMalloc`.
    #[arg(long, value_enum, default_value_t = PoolSource::Vmm)]
    source: PoolSource,
    /// Write an SVG of the pool's chunks at the trace's fullest moment (one trace, pool only).
    #[arg(long, value_name = "FILE")]
    svg_state: Option<PathBuf>,
    /// Write an SVG timeline of live requested, required and reserved bytes (one trace).
    #[arg(long, value_name = "FILE")]
    svg_timeline: Option<PathBuf>,
    /// Check every placement against a shadow map (alignment, overlap, high water);
    /// problems are reported as invariant errors. Slows the replay.
    #[arg(long)]
    check: bool,
    /// Report the first pass: skip the untimed warm-up pass each backend otherwise runs first.
    #[arg(long)]
    cold: bool,
    /// Device size in bytes: larger allocations are rejected, and each range gets this capacity
    /// (our engine's TLSF ranges at most their span, just under 256 GiB). At most 16 TiB, the
    /// most the simulator's virtual memory reserves at once; the pool needs room for a chunk.
    #[arg(long, default_value_t = DEFAULT_DEVICE_SIZE,
          value_parser = clap::value_parser!(u64).range(1..=MAX_DEVICE_SIZE))]
    device_size: u64,
    /// Replay every backend this many times, taking turns (all backends once, then again), and
    /// report each backend's median over the rounds: on a shared machine a slow spell then
    /// falls on every backend alike instead of on whichever ran during it.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=1000))]
    rounds: u32,
    /// Most bytes of a piped trace (a pipe, `/dev/stdin`, a process substitution) copied to a
    /// temporary file to be read once per pass and backend; a longer one, or one that never
    /// ends, cannot be read (exit status 1). Regular files are read in place, at any length.
    #[arg(long, value_name = "BYTES", default_value_t = DEFAULT_SPOOL_MAX,
          value_parser = clap::value_parser!(u64).range(1..))]
    spool_max: u64,
}

/// The default `--spool-max`: 16 GiB, far above any recorded trace we know of (the shared
/// ones are under 100 MiB), far below a temporary directory's room on most machines.
const DEFAULT_SPOOL_MAX: u64 = 16 << 30;

/// The largest `--device-size`: the simulator's virtual-memory source reserves no more at
/// once, and peers that lay out their whole range up front (buddy_system_allocator) take
/// seconds and gigabytes of memory for sizes far beyond it.
const MAX_DEVICE_SIZE: u64 = 16 << 40;

/// `--source` values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum PoolSource {
    /// Virtual memory on the simulator.
    Vmm,
    /// Plain `aclrtMalloc*` blocks from the simulator.
    Sim,
}

impl From<PoolSource> for ReplaySource {
    fn from(s: PoolSource) -> Self {
        match s {
            PoolSource::Vmm => ReplaySource::Vmm,
            PoolSource::Sim => ReplaySource::Sim,
        }
    }
}

/// Every allocator the tool can replay through.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Backend {
    /// The whole pool on the simulator: chunks, dedicated chunks, release threshold.
    Pool,
    /// Our CarveEngine over one range per kind (TLSF range tier, slabs for small segments).
    Carve,
    /// Our CarveEngine with the buddy range tier.
    CarveBuddy,
    /// Our CarveEngine behind a mutex, each segment holding a counted handle on it: what a
    /// plain thread-safe wrapper over the engine pays per call (a reference for the pool's
    /// time, not a backend to run).
    CarveLocked,
    /// The offset-allocator crate.
    OffsetAllocator,
    /// The rlsf crate (TLSF).
    Rlsf,
    /// buddy_system_allocator's FrameAllocator.
    Buddy,
}

impl Backend {
    const ALL: [Backend; 7] = [
        Backend::Pool,
        Backend::Carve,
        Backend::CarveBuddy,
        Backend::CarveLocked,
        Backend::OffsetAllocator,
        Backend::Rlsf,
        Backend::Buddy,
    ];
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Replay(args) => run_replay(&args),
    }
}

/// Whether to draw the progress bar: only on a terminal, and never with `--json`
/// (the bar goes to stderr, so stderr must be the terminal).
fn progress_wanted(json: bool, stderr_is_terminal: bool) -> bool {
    !json && stderr_is_terminal
}

/// A usage error: message on stderr, exit status 2.
fn usage_error(msg: &str) -> ExitCode {
    eprintln!("ascend-pool: {msg}");
    ExitCode::from(2)
}

/// A trace as the replays read it, once per pass and backend. A regular file is opened
/// again each time; anything else (a pipe, `/dev/stdin`, a process substitution) gives its
/// bytes once, so it is first copied to an unnamed temporary file, read back each time.
#[derive(Debug)]
struct TraceInput {
    path: PathBuf,
    /// The copy of a trace that is not a regular file.
    spool: Option<File>,
}

impl TraceInput {
    /// Opens `path`; one that is not a regular file is copied, up to `spool_max` bytes.
    fn open(path: &Path, spool_max: u64) -> std::io::Result<Self> {
        let file = File::open(path)?;
        let spool = if file.metadata()?.is_file() {
            None
        } else {
            let mut spool = temporary_file()?;
            // One byte past the limit tells a trace that ends there from a longer one.
            let mut head = std::io::Read::take(file, spool_max.saturating_add(1));
            let copied = std::io::copy(&mut head, &mut spool)?;
            if copied > spool_max {
                return Err(std::io::Error::other(format!(
                    "a piped trace longer than --spool-max ({spool_max} bytes): save it to a \
                     file and replay that, or raise the limit"
                )));
            }
            Some(spool)
        };
        Ok(Self {
            path: path.to_owned(),
            spool,
        })
    }

    /// The trace from its start.
    fn reader(&self) -> std::io::Result<BufReader<File>> {
        let file = match &self.spool {
            None => File::open(&self.path)?,
            Some(spool) => {
                let mut f = spool.try_clone()?;
                f.seek(SeekFrom::Start(0))?;
                f
            }
        };
        Ok(BufReader::with_capacity(1 << 20, file))
    }

    /// Its length in bytes, for the progress bar.
    fn len(&self) -> u64 {
        let meta = match &self.spool {
            None => std::fs::metadata(&self.path),
            Some(spool) => spool.metadata(),
        };
        meta.map_or(0, |m| m.len())
    }
}

/// A new file in the temporary directory, already unlinked where the system allows, so
/// that nothing is left behind however the process ends.
fn temporary_file() -> std::io::Result<File> {
    use std::sync::atomic::{AtomicU32, Ordering};
    static NEXT: AtomicU32 = AtomicU32::new(0);
    loop {
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let path = std::env::temp_dir().join(format!(
            "ascend-pool-trace-{}-{n}.jsonl",
            std::process::id()
        ));
        match File::options()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&path)
        {
            Ok(file) => {
                // Elsewhere than Unix an open file may not be removable: it stays behind.
                let _ = std::fs::remove_file(&path);
                return Ok(file);
            }
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(e),
        }
    }
}

/// What the backends of one trace's replays are built from, kept over its rounds.
struct Backends<'a> {
    pool_config: &'a PoolConfig,
    pool_source: ReplaySource,
    /// rlsf's factory keeps each kind's region mapped, its header pages faulted in, for the
    /// next replay: one factory for every round, so that the rounds after the first (which
    /// have no warm-up pass) find them warm too, as the other backends find their heap.
    /// A factory per round gave rlsf fresh regions, and every later round a cold p99.
    rlsf: RlsfFactory,
}

/// Replays `input` through `backend` `passes` times with one factory (the last pass is
/// reported), advancing `bar` by bytes read.
fn replay_one(
    input: &TraceInput,
    backend: Backend,
    config: TraceConfig,
    passes: u32,
    bar: &ProgressBar,
    backends: &Backends<'_>,
) -> std::io::Result<ReplayReport> {
    fn go<F: ReplayerFactory>(
        input: &TraceInput,
        config: TraceConfig,
        factory: &F,
        passes: u32,
        bar: &ProgressBar,
    ) -> std::io::Result<ReplayReport> {
        let mut last = None;
        for pass in 1..=passes {
            let reader = input.reader()?;
            let start = bar.position();
            let what = if pass < passes { " (warm-up)" } else { "" };
            bar.set_message(format!(
                "{} via {}{what}",
                input.path.display(),
                factory.name()
            ));
            last = Some(replay(reader, config, factory, |bytes| {
                bar.set_position(start + bytes)
            })?);
        }
        last.ok_or_else(|| std::io::Error::other("no pass was run"))
    }
    let engine = |range| EngineFactory {
        config: EngineConfig {
            range,
            ..EngineConfig::default()
        },
    };
    match backend {
        Backend::Pool => {
            let factory = PoolFactory::new(backends.pool_config.clone(), config.device_size)
                .map_err(std::io::Error::other)?
                .with_source(backends.pool_source);
            go(input, config, &factory, passes, bar)
        }
        Backend::Carve => go(input, config, &engine(RangeTier::Tlsf), passes, bar),
        Backend::CarveBuddy => go(input, config, &engine(RangeTier::Buddy), passes, bar),
        Backend::CarveLocked => go(input, config, &LockedEngineFactory::default(), passes, bar),
        Backend::OffsetAllocator => go(input, config, &OffsetAllocatorFactory, passes, bar),
        Backend::Rlsf => go(input, config, &backends.rlsf, passes, bar),
        Backend::Buddy => go(input, config, &BuddyFactory, passes, bar),
    }
}

/// The result for one trace: the lead backend's report and, with `--compare`, every backend's.
struct TraceResult {
    path: PathBuf,
    /// The event after which the lead's snapshot was taken (`--svg-state`).
    snapshot_at: Option<u64>,
    outcome: std::io::Result<(ReplayReport, Vec<ReplayReport>)>,
    /// Per report of `outcome` (lead first), its p50 in each round, in round order.
    p50_by_round: Vec<Vec<u64>>,
}

/// Whether a backend broke an invariant on some trace (`validate()`, a placement `--check`
/// refused, rounds that disagree on memory): that fails the run, so the replay can gate a
/// change; the report still says what broke.
fn broke_an_invariant(results: &[TraceResult]) -> bool {
    results.iter().any(|r| {
        r.outcome
            .as_ref()
            .is_ok_and(|(_, all)| all.iter().any(|p| !p.invariant_errors.is_empty()))
    })
}

/// The lower median of `values` (the middle one of an odd count); 0 when empty.
fn median(values: &[u64]) -> u64 {
    let mut v = values.to_vec();
    v.sort_unstable();
    v.get(v.len().saturating_sub(1) / 2).copied().unwrap_or(0)
}

/// One backend's report over its rounds: the first round's report, with the median p50 and
/// p99 over the rounds. Memory figures do not depend on time, so a round whose figures differ
/// from the first one's is reported as a broken invariant. Also returns the p50 of each round.
fn combine_rounds(mut rounds: Vec<ReplayReport>) -> Option<(ReplayReport, Vec<u64>)> {
    if rounds.is_empty() {
        return None;
    }
    let p50s: Vec<u64> = rounds.iter().map(|r| r.ns_per_op_p50).collect();
    let p99s: Vec<u64> = rounds.iter().map(|r| r.ns_per_op_p99).collect();
    let figures = |r: &ReplayReport| {
        (
            r.ops,
            r.peak_reserved_bytes,
            r.peak_required_bytes,
            r.backend_alloc_calls,
            r.errors.total(),
        )
    };
    let mut first = rounds.remove(0);
    for (i, r) in rounds.into_iter().enumerate() {
        if figures(&r) != figures(&first) {
            first.invariant_errors.push(format!(
                "round {} gave other memory figures than round 1 (ops, reserved, required, \
                 source calls, errors): {:?} against {:?}",
                i + 2,
                figures(&r),
                figures(&first)
            ));
        }
        // A check that fails every round is said once.
        for e in r.invariant_errors {
            if !first.invariant_errors.contains(&e) {
                first.invariant_errors.push(e);
            }
        }
    }
    first.ns_per_op_p50 = median(&p50s);
    first.ns_per_op_p99 = median(&p99s);
    Some((first, p50s))
}

fn run_replay(args: &ReplayArgs) -> ExitCode {
    let lead = match (args.engine, args.ranges) {
        (Some(Backend::Pool), true) => {
            return usage_error("--ranges replays ranges, not the pool: drop --engine pool")
        }
        (Some(b), _) => b,
        (None, true) => Backend::Carve,
        (None, false) => Backend::Pool,
    };
    let pool_config = match PoolConfig::parse(&args.pool_conf) {
        Ok(c) => c,
        Err(e) => return usage_error(&format!("--pool-conf: {e}")),
    };
    let pictures = args.svg_state.is_some() || args.svg_timeline.is_some();
    if pictures && args.traces.len() != 1 {
        return usage_error("--svg-state and --svg-timeline take exactly one trace");
    }
    if args.svg_state.is_some() && lead != Backend::Pool {
        return usage_error("--svg-state draws the pool's chunks: it needs the pool as lead");
    }
    let config = TraceConfig {
        device_size: args.device_size,
        check_placement: args.check,
        ..TraceConfig::default()
    };
    let backends: Vec<Backend> = if args.compare {
        std::iter::once(lead)
            .chain(Backend::ALL.into_iter().filter(|&b| b != lead))
            .collect()
    } else {
        vec![lead]
    };
    // A configuration the pool refuses is a usage error whoever runs; whether the source
    // serves it is asked only when the pool runs: `--ranges` and the peers take any device
    // size, down to one the pool's first chunk does not fit.
    let pool_runs = backends.contains(&Backend::Pool);
    let factory = PoolFactory::new(pool_config.clone(), args.device_size)
        .map(|f| f.with_source(args.source.into()));
    if let Err(e) = factory.and_then(|f| if pool_runs { f.check() } else { Ok(()) }) {
        return usage_error(&format!("cannot build the pool: {e}"));
    }

    let passes = if args.cold { 1 } else { 2 };
    let show_bar = progress_wanted(args.json, std::io::stderr().is_terminal());
    let inputs: Vec<std::io::Result<TraceInput>> = args
        .traces
        .iter()
        .map(|p| TraceInput::open(p, args.spool_max))
        .collect();
    let total: u64 = inputs
        .iter()
        .flatten()
        .map(|i| i.len() * backends.len() as u64 * u64::from(passes + args.rounds - 1))
        .sum();
    let bar = if show_bar {
        let bar = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr());
        if let Ok(style) =
            ProgressStyle::with_template("{bar:30} {bytes}/{total_bytes} {elapsed} {wide_msg}")
        {
            bar.set_style(style);
        }
        bar
    } else {
        ProgressBar::hidden()
    };

    let mut results = Vec::new();
    for (path, input) in args.traces.iter().zip(inputs) {
        let input = match input {
            Ok(input) => input,
            Err(e) => {
                results.push(TraceResult {
                    path: path.clone(),
                    snapshot_at: None,
                    outcome: Err(e),
                    p50_by_round: Vec::new(),
                });
                continue;
            }
        };
        // The lead alone records the pictures' data, in its reported pass.
        let mut lead_config = config;
        lead_config.timeline = args.svg_timeline.is_some();
        if args.svg_state.is_some() {
            lead_config.snapshot_at = input
                .reader()
                .and_then(|r| fullest_op(r, config))
                .ok()
                .flatten();
        }
        // Round-robin: every backend once per round. Only the first round warms up (the
        // process is warm after it) and records the lead's pictures.
        let mut rounds: Vec<Vec<ReplayReport>> = vec![Vec::new(); backends.len()];
        let factories = Backends {
            pool_config: &pool_config,
            pool_source: args.source.into(),
            rlsf: RlsfFactory::default(),
        };
        let mut failure = None;
        'rounds: for round in 0..args.rounds {
            for (i, &b) in backends.iter().enumerate() {
                let (c, p) = match (round, b == lead) {
                    (0, true) => (lead_config, passes),
                    (0, false) => (config, passes),
                    _ => (config, 1),
                };
                match replay_one(&input, b, c, p, &bar, &factories) {
                    Ok(r) => rounds[i].push(r),
                    Err(e) => {
                        failure = Some(e);
                        break 'rounds;
                    }
                }
            }
        }
        let (reports, p50_by_round): (Vec<ReplayReport>, Vec<Vec<u64>>) = match failure {
            Some(_) => (Vec::new(), Vec::new()),
            None => rounds.into_iter().filter_map(combine_rounds).unzip(),
        };
        let outcome = match failure {
            Some(e) => Err(e),
            None => Ok((reports[0].clone(), reports)),
        };
        results.push(TraceResult {
            path: path.clone(),
            snapshot_at: lead_config.snapshot_at,
            outcome,
            p50_by_round,
        });
    }
    bar.finish_and_clear();

    let mut failed = broke_an_invariant(&results) || results.iter().any(|r| r.outcome.is_err());
    for r in &results {
        if let Err(e) = &r.outcome {
            eprintln!("ascend-pool: cannot read {}: {e}", r.path.display());
        }
    }
    if let Some(Ok((lead, _))) = results.first().map(|r| &r.outcome) {
        let name = results[0]
            .path
            .file_name()
            .map_or_else(String::new, |n| n.to_string_lossy().into_owned());
        if let Some(file) = &args.svg_timeline {
            let title = format!(
                "{name}: bytes over the replay ({}, {})",
                lead.backend, lead.mode
            );
            failed |= !write_picture(file, &ascend_pool::svg::timeline(&lead.timeline, &title));
        }
        if let Some(file) = &args.svg_state {
            let svg = match &lead.snapshot {
                Some(snap) => {
                    let at = results[0]
                        .snapshot_at
                        .map_or_else(String::new, |op| format!(" (after event {op})"));
                    let title = format!("{name}: pool chunks at its fullest moment{at}");
                    ascend_pool::svg::pool_state(snap, &title)
                }
                // A trace with no allocation has no fullest moment: the pool never took a
                // chunk, and the picture shows none.
                None => {
                    let empty = ascend_pool::pool::PoolSnapshot {
                        source: ReplaySource::from(args.source).name().to_owned(),
                        device: pool_config.device,
                        device_reserved_bytes: 0,
                        total_limit: Some(pool_config.total_limit).filter(|&l| l != 0),
                        kinds: Vec::new(),
                    };
                    let title = format!("{name}: no allocation in the trace, no pool chunk");
                    ascend_pool::svg::pool_state(&empty, &title)
                }
            };
            failed |= !write_picture(file, &svg);
        }
    }
    let mut out = std::io::stdout().lock();
    let written = if args.json {
        let source = ReplaySource::from(args.source).name();
        let objs: Vec<Value> = results
            .iter()
            .map(|r| json_for(r, args.compare, source))
            .collect();
        let doc = if objs.len() == 1 {
            objs.into_iter().next().unwrap_or(Value::Null)
        } else {
            json!({ "traces": objs })
        };
        writeln!(out, "{doc}")
    } else {
        results
            .iter()
            .try_for_each(|r| write_text(&mut out, r, args.compare))
    };
    if written.is_err() || failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}

/// Writes an SVG; false (with a message) when the file cannot be written.
fn write_picture(file: &Path, svg: &str) -> bool {
    match std::fs::write(file, svg) {
        Ok(()) => true,
        Err(e) => {
            eprintln!("ascend-pool: cannot write {}: {e}", file.display());
            false
        }
    }
}

/// The JSON report of one trace; `pool_source` names the pool's block source (`--source`).
fn json_for(r: &TraceResult, compare: bool, pool_source: &str) -> Value {
    let (lead, all) = match &r.outcome {
        Ok(x) => x,
        Err(e) => {
            return json!({ "trace": r.path.display().to_string(), "error": e.to_string() });
        }
    };
    let mut v = serde_json::to_value(lead).unwrap_or(Value::Null);
    if let Value::Object(m) = &mut v {
        m.insert("trace".into(), json!(r.path.display().to_string()));
        // Which simulator source the pool ran on: only a pool run has one.
        if all.iter().any(|p| p.mode == "pool") {
            m.insert("pool_source".into(), json!(pool_source));
        }
        let lead_by_round = &r.p50_by_round[0];
        m.insert("rounds".into(), json!(lead_by_round.len()));
        m.insert("ns_per_op_p50_by_round".into(), json!(lead_by_round));
        if compare {
            let peers: Vec<Value> = all
                .iter()
                .zip(&r.p50_by_round)
                .map(|(p, by_round)| {
                    json!({
                        "name": p.backend,
                        "mode": p.mode,
                        "peak_reserved_bytes": p.peak_reserved_bytes,
                        "utilization": p.utilization,
                        "backend_alloc_calls": p.backend_alloc_calls,
                        "ns_per_op_p50": p.ns_per_op_p50,
                        "ns_per_op_p99": p.ns_per_op_p99,
                        "ns_per_op_p50_by_round": by_round,
                        "out_of_memory": p.errors.get(ascend_pool::trace::RejectKind::OutOfMemory),
                        "per_kind": p.per_kind,
                        "invariant_errors": p.invariant_errors,
                    })
                })
                .collect();
            m.insert("peers".into(), Value::Array(peers));
        }
    }
    v
}

fn mib(bytes: u64) -> String {
    format!("{:.2} MiB", bytes as f64 / (1u64 << 20) as f64)
}

/// How a report names a backend in the comparison table.
fn label(p: &ReplayReport) -> String {
    format!("{} ({})", p.backend, p.mode)
}

fn write_text(out: &mut impl Write, r: &TraceResult, compare: bool) -> std::io::Result<()> {
    let (lead, all) = match &r.outcome {
        Ok(x) => x,
        Err(e) => return writeln!(out, "{}: cannot read: {e}\n", r.path.display()),
    };
    writeln!(out, "{}  [{}]", r.path.display(), label(lead))?;
    writeln!(
        out,
        "  lines {}, ops {}, errors {}, live at end {}",
        lead.lines,
        lead.ops,
        lead.errors.total(),
        lead.live_at_end,
    )?;
    for (k, n) in lead.errors.nonzero() {
        writeln!(out, "    {k:<16} {n}")?;
    }
    let c = &lead.source_calls;
    writeln!(
        out,
        "  block-source calls: {} alloc, {} free; warm half (events {}..): {} alloc calls for {} allocations ({:.2} per 10,000)",
        c.alloc, c.free, c.warm_from_op, c.warm_alloc_calls, c.warm_allocs, c.warm_alloc_calls_per_10k_allocs
    )?;
    writeln!(
        out,
        "  {:<15} {:>9} {:>16} {:>16} {:>16} {:>6} {:>7}",
        "mem", "allocs", "peak requested", "peak required", "peak reserved", "util", "calls"
    )?;
    for k in &lead.per_kind {
        writeln!(
            out,
            "  {:<15} {:>9} {:>16} {:>16} {:>16} {:>6.3} {:>7}",
            k.mem,
            k.allocs,
            mib(k.peak_requested_bytes),
            mib(k.peak_required_bytes),
            mib(k.peak_reserved_bytes),
            k.utilization,
            k.source_alloc_calls
        )?;
    }
    writeln!(
        out,
        "  {:<15} {:>9} {:>16} {:>16} {:>16} {:>6.3} {:>7}",
        "total",
        "",
        mib(lead.peak_requested_bytes),
        mib(lead.peak_required_bytes),
        mib(lead.peak_reserved_bytes),
        lead.utilization,
        lead.backend_alloc_calls
    )?;
    writeln!(
        out,
        "  ns/op p50 {}  p99 {}  (each call timed alone; includes ~{} ns of clock read)",
        lead.ns_per_op_p50, lead.ns_per_op_p99, lead.timer_overhead_ns
    )?;
    let rounds = r.p50_by_round.first().map_or(1, Vec::len);
    if rounds > 1 {
        let by_round: Vec<String> = r.p50_by_round[0].iter().map(u64::to_string).collect();
        writeln!(
            out,
            "  medians of {rounds} interleaved rounds; p50 by round: {}",
            by_round.join(" ")
        )?;
    }
    for p in all {
        for e in &p.invariant_errors {
            writeln!(out, "  INVARIANT BROKEN in {}: {e}", label(p))?;
        }
    }
    if lead.placement_checked {
        let held = all.iter().all(|p| p.invariant_errors.is_empty());
        writeln!(
            out,
            "  every placement checked for alignment and overlap{}",
            if held { ": all held" } else { "" }
        )?;
    }
    if compare {
        let how = if rounds > 1 {
            format!("; ns: median of {rounds} rounds, backends taking turns")
        } else {
            String::new()
        };
        writeln!(
            out,
            "  comparison (same trace, same run, same carve rule{how}):"
        )?;
        writeln!(
            out,
            "    {:<34} {:>16} {:>6} {:>7} {:>9} {:>9} {:>6}",
            "allocator", "peak reserved", "util", "calls", "ns p50", "ns p99", "oom"
        )?;
        for p in all {
            writeln!(
                out,
                "    {:<34} {:>16} {:>6.3} {:>7} {:>9} {:>9} {:>6}",
                label(p),
                mib(p.peak_reserved_bytes),
                p.utilization,
                p.backend_alloc_calls,
                p.ns_per_op_p50,
                p.ns_per_op_p99,
                p.errors.get(ascend_pool::trace::RejectKind::OutOfMemory)
            )?;
        }
    }
    writeln!(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn progress_bar_only_on_a_terminal_and_never_with_json() {
        assert!(progress_wanted(false, true));
        assert!(!progress_wanted(true, true));
        assert!(!progress_wanted(false, false));
        assert!(!progress_wanted(true, false));
    }

    #[test]
    fn rounds_combine_to_medians_and_catch_other_memory_figures() {
        use ascend_pool::trace::replay;
        let trace: &[u8] = b"{\"op\":\"alloc\",\"id\":1,\"size\":100,\"mem\":\"device\"}
{\"op\":\"alloc\",\"id\":2,\"size\":5000,\"mem\":\"dvpp\"}
{\"op\":\"free\",\"id\":1}
";
        let run = |p50: u64, p99: u64| {
            let mut r = replay(
                trace,
                TraceConfig::default(),
                &EngineFactory::default(),
                |_| {},
            )
            .unwrap();
            r.ns_per_op_p50 = p50;
            r.ns_per_op_p99 = p99;
            r
        };
        let (r, p50s) = combine_rounds(vec![run(40, 90), run(10, 300), run(30, 100)]).unwrap();
        assert_eq!(p50s, [40, 10, 30]);
        assert_eq!((r.ns_per_op_p50, r.ns_per_op_p99), (30, 100));
        assert!(r.invariant_errors.is_empty(), "{:?}", r.invariant_errors);
        // An even count takes the lower of the middle two.
        assert_eq!(median(&[7, 1, 5, 3]), 3);
        assert_eq!(median(&[]), 0);
        assert!(combine_rounds(Vec::new()).is_none());

        let mut odd = run(20, 20);
        odd.peak_reserved_bytes += 64;
        let (r, _) = combine_rounds(vec![run(20, 20), odd]).unwrap();
        assert_eq!(r.invariant_errors.len(), 1, "{:?}", r.invariant_errors);
        assert!(r.invariant_errors[0].contains("round 2"));
        // A broken invariant in any backend of any trace fails the run.
        let result = |peer: ReplayReport| TraceResult {
            path: PathBuf::from("t.jsonl"),
            snapshot_at: None,
            outcome: Ok((run(20, 20), vec![run(20, 20), peer])),
            p50_by_round: Vec::new(),
        };
        assert!(!broke_an_invariant(&[result(run(20, 20))]));
        assert!(broke_an_invariant(&[result(run(20, 20)), result(r)]));

        // Each broken check is said once, whichever rounds it broke in.
        let failing = |errors: &[&str]| {
            let mut r = run(20, 20);
            r.invariant_errors = errors.iter().map(|e| e.to_string()).collect();
            r
        };
        let (r, _) = combine_rounds(vec![
            failing(&["overlap"]),
            failing(&["overlap", "misaligned"]),
            failing(&["misaligned", "high water"]),
        ])
        .unwrap();
        assert_eq!(r.invariant_errors, ["overlap", "misaligned", "high water"]);
    }

    #[test]
    fn arguments_parse() {
        use clap::CommandFactory;
        Cli::command().debug_assert();
        let cli = Cli::try_parse_from(["ascend-pool", "replay", "t.jsonl", "--ranges"]).unwrap();
        let Command::Replay(a) = cli.command;
        assert!(a.ranges && a.engine.is_none());
    }
}
