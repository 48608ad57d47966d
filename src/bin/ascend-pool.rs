//! `ascend-pool`: command-line tools for the ascend-pool sub-allocator.
//!
//! `ascend-pool replay TRACE... [--compare] [--json] [--engine NAME]` replays
//! allocation traces (JSON Lines, see `shared/traces/README.md`) and reports
//! peak requested / required / reserved bytes, utilization and time per
//! operation. The JSON schema is in `docs/replay-json.md`.
//!
//! Each backend replays each trace twice, in its own passes: an untimed-in-effect
//! warm-up (page faults, allocator caches) and the reported pass (`--cold` reports a
//! single first pass instead). Both passes give the same memory figures.
//!
//! Exit status: 0 when every trace was read to its end (bad events are counted,
//! not fatal), 1 when a trace could not be opened or read, 2 on a usage error.

use std::fs::File;
use std::io::{BufReader, IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::{Parser, Subcommand, ValueEnum};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde_json::{json, Value};

use ascend_pool::engine::{EngineConfig, RangeTier};
use ascend_pool::peers::{BuddyFactory, OffsetAllocatorFactory, RlsfFactory};
use ascend_pool::trace::{
    replay, EngineFactory, ReplayReport, ReplayerFactory, TraceConfig, DEFAULT_DEVICE_SIZE,
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
    /// Replay allocation traces and report peak memory, utilization and ns/op.
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
    /// The allocator whose figures the report leads with.
    #[arg(long, value_enum, default_value_t = Backend::Carve)]
    engine: Backend,
    /// Check every placement against a shadow map (alignment, overlap, high water);
    /// problems are reported as invariant errors. Slows the replay.
    #[arg(long)]
    check: bool,
    /// Report the first pass: skip the untimed warm-up pass each backend otherwise runs first.
    #[arg(long)]
    cold: bool,
    /// Device size in bytes: larger allocations are rejected, and each range gets this capacity.
    #[arg(long, default_value_t = DEFAULT_DEVICE_SIZE)]
    device_size: u64,
}

/// Every allocator the tool can replay through.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Backend {
    /// Our CarveEngine (TLSF range tier, slabs for small segments).
    Carve,
    /// Our CarveEngine with the buddy range tier.
    CarveBuddy,
    /// The offset-allocator crate.
    OffsetAllocator,
    /// The rlsf crate (TLSF).
    Rlsf,
    /// buddy_system_allocator's FrameAllocator.
    Buddy,
}

impl Backend {
    const ALL: [Backend; 5] = [
        Backend::Carve,
        Backend::CarveBuddy,
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

/// Replays `path` through `backend` `passes` times with one factory (the last pass is
/// reported), advancing `bar` by bytes read.
fn replay_one(
    path: &Path,
    backend: Backend,
    config: TraceConfig,
    passes: u32,
    bar: &ProgressBar,
) -> std::io::Result<ReplayReport> {
    fn go<F: ReplayerFactory>(
        path: &Path,
        config: TraceConfig,
        factory: &F,
        passes: u32,
        bar: &ProgressBar,
    ) -> std::io::Result<ReplayReport> {
        let mut last = None;
        for pass in 1..=passes {
            let file = File::open(path)?;
            let start = bar.position();
            let what = if pass < passes { " (warm-up)" } else { "" };
            bar.set_message(format!("{} via {}{what}", path.display(), factory.name()));
            let input = BufReader::with_capacity(1 << 20, file);
            last = Some(replay(input, config, factory, |bytes| {
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
        Backend::Carve => go(path, config, &engine(RangeTier::Tlsf), passes, bar),
        Backend::CarveBuddy => go(path, config, &engine(RangeTier::Buddy), passes, bar),
        Backend::OffsetAllocator => go(path, config, &OffsetAllocatorFactory, passes, bar),
        Backend::Rlsf => go(path, config, &RlsfFactory::default(), passes, bar),
        Backend::Buddy => go(path, config, &BuddyFactory, passes, bar),
    }
}

/// The result for one trace: the lead backend's report and, with `--compare`, every backend's.
struct TraceResult {
    path: PathBuf,
    outcome: std::io::Result<(ReplayReport, Vec<ReplayReport>)>,
}

fn run_replay(args: &ReplayArgs) -> ExitCode {
    let config = TraceConfig {
        device_size: args.device_size,
        check_placement: args.check,
    };
    let backends: Vec<Backend> = if args.compare {
        std::iter::once(args.engine)
            .chain(Backend::ALL.into_iter().filter(|&b| b != args.engine))
            .collect()
    } else {
        vec![args.engine]
    };

    let passes = if args.cold { 1 } else { 2 };
    let show_bar = !args.json && std::io::stdout().is_terminal() && std::io::stderr().is_terminal();
    let total: u64 = args
        .traces
        .iter()
        .filter_map(|p| std::fs::metadata(p).ok())
        .map(|m| m.len() * backends.len() as u64 * u64::from(passes))
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
    for path in &args.traces {
        let mut reports = Vec::new();
        let mut failure = None;
        for &b in &backends {
            match replay_one(path, b, config, passes, &bar) {
                Ok(r) => reports.push(r),
                Err(e) => {
                    failure = Some(e);
                    break;
                }
            }
        }
        let outcome = match failure {
            Some(e) => Err(e),
            None => Ok((reports[0].clone(), reports)),
        };
        results.push(TraceResult {
            path: path.clone(),
            outcome,
        });
    }
    bar.finish_and_clear();

    let failed = results.iter().any(|r| r.outcome.is_err());
    for r in &results {
        if let Err(e) = &r.outcome {
            eprintln!("ascend-pool: cannot read {}: {e}", r.path.display());
        }
    }
    let mut out = std::io::stdout().lock();
    let written = if args.json {
        let objs: Vec<Value> = results.iter().map(|r| json_for(r, args.compare)).collect();
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
    if written.is_err() {
        return ExitCode::FAILURE;
    }
    if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}

fn json_for(r: &TraceResult, compare: bool) -> Value {
    let (lead, all) = match &r.outcome {
        Ok(x) => x,
        Err(e) => {
            return json!({ "trace": r.path.display().to_string(), "error": e.to_string() });
        }
    };
    let mut v = serde_json::to_value(lead).unwrap_or(Value::Null);
    if let Value::Object(m) = &mut v {
        m.insert("trace".into(), json!(r.path.display().to_string()));
        if compare {
            let peers: Vec<Value> = all
                .iter()
                .map(|p| {
                    json!({
                        "name": p.backend,
                        "peak_reserved_bytes": p.peak_reserved_bytes,
                        "utilization": p.utilization,
                        "ns_per_op_p50": p.ns_per_op_p50,
                        "ns_per_op_p99": p.ns_per_op_p99,
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

fn write_text(out: &mut impl Write, r: &TraceResult, compare: bool) -> std::io::Result<()> {
    let (lead, all) = match &r.outcome {
        Ok(x) => x,
        Err(e) => return writeln!(out, "{}: cannot read: {e}\n", r.path.display()),
    };
    writeln!(out, "{}  [{}]", r.path.display(), lead.backend)?;
    writeln!(
        out,
        "  lines {}, ops {}, errors {}, live at end {}, ranges {}",
        lead.lines,
        lead.ops,
        lead.errors.total(),
        lead.live_at_end,
        lead.backend_alloc_calls
    )?;
    for (k, n) in lead.errors.nonzero() {
        writeln!(out, "    {k:<16} {n}")?;
    }
    writeln!(
        out,
        "  {:<15} {:>9} {:>16} {:>16} {:>16} {:>6}",
        "mem", "allocs", "peak requested", "peak required", "peak reserved", "util"
    )?;
    for k in &lead.per_kind {
        writeln!(
            out,
            "  {:<15} {:>9} {:>16} {:>16} {:>16} {:>6.3}",
            k.mem,
            k.allocs,
            mib(k.peak_requested_bytes),
            mib(k.peak_required_bytes),
            mib(k.peak_reserved_bytes),
            k.utilization
        )?;
    }
    writeln!(
        out,
        "  {:<15} {:>9} {:>16} {:>16} {:>16} {:>6.3}",
        "total",
        "",
        mib(lead.peak_requested_bytes),
        mib(lead.peak_required_bytes),
        mib(lead.peak_reserved_bytes),
        lead.utilization
    )?;
    writeln!(
        out,
        "  ns/op p50 {}  p99 {}  (each call timed alone; includes ~{} ns of clock read)",
        lead.ns_per_op_p50, lead.ns_per_op_p99, lead.timer_overhead_ns
    )?;
    for p in all {
        for e in &p.invariant_errors {
            writeln!(out, "  INVARIANT BROKEN in {}: {e}", p.backend)?;
        }
    }
    if compare {
        writeln!(out, "  comparison (same trace, same run, same carve rule):")?;
        writeln!(
            out,
            "    {:<24} {:>16} {:>6} {:>9} {:>9} {:>6}",
            "allocator", "peak reserved", "util", "ns p50", "ns p99", "oom"
        )?;
        for p in all {
            writeln!(
                out,
                "    {:<24} {:>16} {:>6.3} {:>9} {:>9} {:>6}",
                p.backend,
                mib(p.peak_reserved_bytes),
                p.utilization,
                p.ns_per_op_p50,
                p.ns_per_op_p99,
                p.errors.get(ascend_pool::trace::RejectKind::OutOfMemory)
            )?;
        }
    }
    writeln!(out)
}
