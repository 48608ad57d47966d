//! Trace reading, replay and the `ascend-pool replay` binary, on tiny hand-made traces.

use std::path::PathBuf;
use std::process::{Command, Output};

use ascend_pool::peers::{BuddyFactory, OffsetAllocatorFactory, RlsfFactory};
use ascend_pool::trace::{
    replay, EngineFactory, LockedEngineFactory, RejectKind, ReplayReport, ReplayerFactory,
    TraceConfig, TraceItem, TraceReader,
};
use serde_json::Value;

const BIN: &str = env!("CARGO_BIN_EXE_ascend-pool");

/// A fresh directory for one test, removed with everything in it when the test ends
/// (passed or not), so runs do not pile up in the temporary directory.
struct TempDir(PathBuf);

impl std::ops::Deref for TempDir {
    type Target = std::path::Path;
    fn deref(&self) -> &std::path::Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn temp_dir(name: &str) -> TempDir {
    let dir = std::env::temp_dir().join(format!("ascend-pool-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    TempDir(dir)
}

fn write_trace(dir: &std::path::Path, name: &str, bytes: &[u8]) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, bytes).unwrap();
    p
}

fn run(args: &[&std::ffi::OsStr]) -> Output {
    Command::new(BIN).arg("replay").args(args).output().unwrap()
}

fn json_of(out: &Output) -> Value {
    let text = String::from_utf8(out.stdout.clone()).unwrap();
    assert_eq!(text.trim().lines().count(), 1, "one line of JSON: {text}");
    serde_json::from_str(&text).unwrap()
}

/// One line of every invalid category, with valid events between them.
const BAD_TRACE: &[u8] = b"{\"op\":\"alloc\",\"id\":1,\"size\":100,\"mem\":\"device\"}
this is not json
{\"op\":\"alloc\",\"id\":2,\"size\":0,\"mem\":\"device\"}
{\"op\":\"alloc\",\"id\":3,\"size\":68719476737,\"mem\":\"device\"}
{\"op\":\"alloc\",\"id\":4,\"size\":10,\"mem\":\"hbm\"}
{\"op\":\"alloc\",\"id\":5,\"size\":10,\"mem\":\"dvpp\",\"align\":100}
{\"op\":\"free\",\"id\":77}
{\"op\":\"alloc\",\"id\":1,\"size\":10,\"mem\":\"host\"}
{\"op\":\"free\",\"id\":1}
{\"op\":\"free\",\"id\":1}
\xff\xfe not utf-8
{\"op\":\"alloc\",\"id\":6}
{\"op\":\"alloc\",\"id\":7,\"size\":10,\"mem\":\"host\"}
";

#[test]
fn every_category_is_counted_and_replay_goes_on() {
    let mut r = TraceReader::new(BAD_TRACE, TraceConfig::default());
    let mut ops = 0;
    while let Some(item) = r.next_item() {
        if let TraceItem::Op(_) = item.unwrap() {
            ops += 1;
        }
    }
    // alloc 1, free 1, alloc 7.
    assert_eq!(ops, 3);
    let e = r.errors();
    assert_eq!(e.get(RejectKind::Malformed), 3);
    for k in [
        RejectKind::ZeroSize,
        RejectKind::SizeTooLarge,
        RejectKind::UnknownKind,
        RejectKind::BadAlign,
        RejectKind::UnknownId,
        RejectKind::DoubleFree,
        RejectKind::IdReused,
    ] {
        assert_eq!(e.get(k), 1, "{k}");
    }
    assert_eq!(e.total(), 10);
}

#[test]
fn configurable_device_size() {
    let t = b"{\"op\":\"alloc\",\"id\":1,\"size\":4097,\"mem\":\"device\"}\n";
    let mut r = TraceReader::new(
        &t[..],
        TraceConfig {
            device_size: 4096,
            ..TraceConfig::default()
        },
    );
    assert!(matches!(
        r.next_item().unwrap().unwrap(),
        TraceItem::Rejected(x) if x.kind == RejectKind::SizeTooLarge
    ));
}

#[test]
fn binary_counts_errors_and_exits_zero() {
    let dir = temp_dir("bad");
    let p = write_trace(&dir, "bad.jsonl", BAD_TRACE);
    let out = run(&[p.as_os_str(), "--json".as_ref()]);
    assert!(out.status.success(), "{out:?}");
    let v = json_of(&out);
    assert_eq!(v["ops"], 3);
    assert_eq!(v["errors"]["malformed"], 3);
    assert_eq!(v["errors"]["double_free"], 1);
    assert_eq!(v["errors"]["id_reused"], 1);
    assert_eq!(v["errors"]["out_of_memory"], 0);
    assert_eq!(v["errors"]["total"], 10);
}

#[test]
fn unreadable_files_exit_nonzero() {
    let dir = temp_dir("missing");
    let missing = dir.join("nope.jsonl");
    let out = run(&[missing.as_os_str()]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("nope.jsonl"));

    // A directory opens but cannot be read.
    let out = run(&[dir.as_os_str(), "--json".as_ref()]);
    assert!(!out.status.success());
    assert!(json_of(&out)["error"].is_string());

    // One good file and one missing: the good one is still reported, the status is non-zero.
    let good = write_trace(
        &dir,
        "good.jsonl",
        b"{\"op\":\"alloc\",\"id\":1,\"size\":1,\"mem\":\"host\"}\n",
    );
    let out = run(&[good.as_os_str(), missing.as_os_str(), "--json".as_ref()]);
    assert!(!out.status.success());
    let v = json_of(&out);
    assert_eq!(v["traces"][0]["ops"], 1);
    assert!(v["traces"][1]["error"].is_string());

    // Usage errors are not read errors, but are failures too.
    let out = Command::new(BIN).arg("replay").output().unwrap();
    assert!(!out.status.success());
}

/// A trace that can be read only once (a pipe) gives every pass and every backend the
/// same events as the file it came from, and the pool's state picture too.
#[test]
fn a_piped_trace_is_replayed_whole_by_every_backend() {
    use std::io::Write;
    use std::process::Stdio;
    let dir = temp_dir("pipe");
    let p = write_trace(&dir, "hand.jsonl", HAND_TRACE);
    let svg = dir.join("state.svg");
    let from_file = json_of(&run(&[
        p.as_os_str(),
        "--json".as_ref(),
        "--compare".as_ref(),
    ]));
    let mut child = Command::new(BIN)
        .args(["replay", "/dev/stdin", "--json", "--compare", "--svg-state"])
        .arg(&svg)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(HAND_TRACE).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "{out:?}");
    let from_pipe = json_of(&out);
    assert_eq!(from_pipe["ops"], 10);
    let figures = |v: &Value| {
        v["peers"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| (p["name"].clone(), p["peak_reserved_bytes"].clone()))
            .collect::<Vec<_>>()
    };
    assert_eq!(figures(&from_pipe), figures(&from_file));
    assert!(figures(&from_pipe)
        .iter()
        .all(|(_, reserved)| reserved.as_u64() > Some(0)));
    assert!(std::fs::read_to_string(&svg).unwrap().contains("<svg"));
}

/// A piped trace is copied up to `--spool-max` bytes: one of exactly that length replays,
/// one a byte longer cannot be read (exit status 1, the limit named), and so a trace that
/// never ends (`/dev/zero`) stops there instead of filling the temporary directory.
#[test]
fn a_piped_trace_past_the_spool_limit_cannot_be_read() {
    use std::io::Write;
    use std::process::Stdio;
    let piped = |limit: usize| {
        let mut child = Command::new(BIN)
            .args(["replay", "/dev/stdin", "--json", "--spool-max"])
            .arg(limit.to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        // The tool may stop reading at the limit: a broken pipe here is expected.
        let _ = child.stdin.take().unwrap().write_all(HAND_TRACE);
        child.wait_with_output().unwrap()
    };
    let whole = piped(HAND_TRACE.len());
    assert!(whole.status.success(), "{whole:?}");
    assert_eq!(json_of(&whole)["ops"], 10);
    let short = piped(HAND_TRACE.len() - 1);
    assert_eq!(short.status.code(), Some(1), "{short:?}");
    let limit = format!("--spool-max ({} bytes)", HAND_TRACE.len() - 1);
    assert!(
        String::from_utf8_lossy(&short.stderr).contains(&limit),
        "{short:?}"
    );
    assert!(json_of(&short)["error"].as_str().unwrap().contains(&limit));

    let endless = Command::new(BIN)
        .args(["replay", "/dev/zero", "--spool-max", "1048576"])
        .output()
        .unwrap();
    assert_eq!(endless.status.code(), Some(1), "{endless:?}");
    assert!(String::from_utf8_lossy(&endless.stderr).contains("--spool-max (1048576 bytes)"));
}

/// host: 1 B -> 64, 100 B -> 192 (ALIGN_UP(ALIGN_UP(100,32)+32, 64) = ALIGN_UP(160, 64));
/// dvpp 3110400 B at 128 -> 3110528; device 33 B -> 128.
const HAND_TRACE: &[u8] = b"{\"op\":\"alloc\",\"id\":1,\"size\":1,\"mem\":\"host\"}
{\"op\":\"alloc\",\"id\":2,\"size\":100,\"mem\":\"host\"}
{\"op\":\"alloc\",\"id\":3,\"size\":3110400,\"mem\":\"dvpp\",\"align\":128}
{\"op\":\"free\",\"id\":1}
{\"op\":\"alloc\",\"id\":4,\"size\":33,\"mem\":\"device\"}
{\"op\":\"alloc\",\"id\":5,\"size\":33,\"mem\":\"device\"}
{\"op\":\"free\",\"id\":4}
{\"op\":\"free\",\"id\":2}
{\"op\":\"free\",\"id\":3}
{\"op\":\"free\",\"id\":5}
";

#[test]
fn peak_required_by_hand() {
    // host peak 64 + 192 = 256; dvpp 3110528; device 128 + 128 = 256.
    let required = 256 + 3_110_528 + 256;
    let requested = 101 + 3_110_400 + 66;
    let dir = temp_dir("hand");
    let p = write_trace(&dir, "hand.jsonl", HAND_TRACE);
    let out = run(&[p.as_os_str(), "--json".as_ref(), "--compare".as_ref()]);
    assert!(out.status.success());
    let v = json_of(&out);
    assert_eq!(v["peak_required_bytes"], required);
    assert_eq!(v["peak_requested_bytes"], requested);
    assert_eq!(v["ops"], 10);
    assert_eq!(v["backend_alloc_calls"], 3);
    // First-fit-like allocators on a fresh range need exactly the footprints here, except rlsf
    // whose in-band header pushes each range's first segment to its alignment.
    for peer in v["peers"].as_array().unwrap() {
        let reserved = peer["peak_reserved_bytes"].as_u64().unwrap();
        assert!(reserved >= required, "{peer}");
    }
}

#[test]
fn json_has_every_key() {
    let dir = temp_dir("keys");
    let p = write_trace(&dir, "t.jsonl", HAND_TRACE);
    let out = run(&[p.as_os_str(), "--json".as_ref(), "--compare".as_ref()]);
    let v = json_of(&out);
    for key in [
        "ops",
        "errors",
        "peak_requested_bytes",
        "peak_required_bytes",
        "peak_reserved_bytes",
        "utilization",
        "backend_alloc_calls",
        "ns_per_op_p50",
        "ns_per_op_p99",
        "per_kind",
        "trace",
        "backend",
    ] {
        assert!(v.get(key).is_some(), "missing {key}: {v}");
    }
    let peers = v["peers"].as_array().unwrap();
    assert!(peers.len() >= 3);
    let names: Vec<&str> = peers.iter().map(|p| p["name"].as_str().unwrap()).collect();
    assert_eq!(v["backend"], "ascend-pool");
    for n in [
        "ascend-pool",
        "offset-allocator",
        "rlsf",
        "buddy_system_allocator",
    ] {
        assert!(names.contains(&n), "{names:?}");
    }
    for p in peers {
        for key in [
            "name",
            "peak_reserved_bytes",
            "utilization",
            "ns_per_op_p50",
        ] {
            assert!(p.get(key).is_some(), "missing {key}: {p}");
        }
        let u = p["utilization"].as_f64().unwrap();
        assert!(u > 0.0 && u <= 1.0);
    }

    // The placement check passes for every backend.
    let v = json_of(&run(&[
        p.as_os_str(),
        "--json".as_ref(),
        "--compare".as_ref(),
        "--check".as_ref(),
    ]));
    for peer in v["peers"].as_array().unwrap() {
        assert_eq!(peer["invariant_errors"], serde_json::json!([]), "{peer}");
    }
    assert_eq!(v["placement_checked"], true);

    // Without --compare there is no peers array; text mode is not JSON.
    let v = json_of(&run(&[p.as_os_str(), "--json".as_ref()]));
    assert!(v.get("peers").is_none());
    assert_eq!(v["placement_checked"], false);
    let out = run(&[p.as_os_str(), "--compare".as_ref()]);
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(
        text.contains("peak reserved") && text.contains("rlsf"),
        "{text}"
    );
    assert!(!text.contains("placement checked"), "{text}");
    let out = run(&[p.as_os_str(), "--compare".as_ref(), "--check".as_ref()]);
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(
        text.contains("every placement checked for alignment and overlap: all held"),
        "{text}"
    );
}

fn check_peer<F: ReplayerFactory>(f: &F) -> ReplayReport {
    let r = replay(HAND_TRACE, TraceConfig::default(), f, |_| {}).unwrap();
    assert_eq!(r.errors.total(), 0);
    assert_eq!(r.peak_required_bytes, 256 + 3_110_528 + 256);
    assert!(r.peak_reserved_bytes >= r.peak_required_bytes);
    assert_eq!(r.live_at_end, 0);
    r
}

#[test]
fn peers_replay_the_hand_trace() {
    // Both offset-allocator and the buddy put every first segment at offset 0 and reuse freed
    // space, so here they reserve exactly the footprints.
    assert_eq!(
        check_peer(&OffsetAllocatorFactory).peak_reserved_bytes,
        256 + 3_110_528 + 256
    );
    check_peer(&RlsfFactory::default());
    let b = check_peer(&BuddyFactory);
    // Buddy: host 64 at 0, 192 -> a 256-byte block at 256: high water 256 + 192 = 448.
    let host = b.per_kind.iter().find(|k| k.mem == "host").unwrap();
    assert_eq!(host.peak_reserved_bytes, 448);
}

#[test]
fn the_locked_engine_places_exactly_as_the_engine() {
    // The lock-and-handle floor must time the same placement, or its time would mean nothing.
    let plain = check_peer(&EngineFactory::default());
    let locked = check_peer(&LockedEngineFactory::default());
    assert_eq!(locked.peak_reserved_bytes, plain.peak_reserved_bytes);
    for (l, p) in locked.per_kind.iter().zip(&plain.per_kind) {
        assert_eq!(l.peak_reserved_bytes, p.peak_reserved_bytes, "{}", l.mem);
    }
    assert_eq!(locked.backend, "ascend-pool (locked)");
}

#[test]
fn default_replay_runs_the_whole_pool_and_counts_its_chunks() {
    let dir = temp_dir("pool");
    let p = write_trace(&dir, "hand.jsonl", HAND_TRACE);
    let v = json_of(&run(&[
        p.as_os_str(),
        "--json".as_ref(),
        "--check".as_ref(),
    ]));
    assert_eq!(v["mode"], "pool");
    assert_eq!(v["backend"], "ascend-pool");
    // One chunk per kind, each as small as the growth policy allows: 2 MiB for host and
    // device, 4 MiB for the 3110528-byte frame.
    assert_eq!(v["backend_alloc_calls"], 3);
    assert_eq!(v["peak_reserved_bytes"], 8 << 20);
    assert_eq!(v["source_calls"]["alloc"], 3);
    assert_eq!(v["source_calls"]["free"], 0);
    // The warm half is events 6..=10: one allocation, served from the device chunk.
    assert_eq!(v["source_calls"]["warm_from_op"], 6);
    assert_eq!(v["source_calls"]["warm_allocs"], 1);
    assert_eq!(v["source_calls"]["warm_alloc_calls"], 0);
    let dvpp = v["per_kind"]
        .as_array()
        .unwrap()
        .iter()
        .find(|k| k["mem"] == "dvpp")
        .unwrap();
    assert_eq!(dvpp["peak_reserved_bytes"], 4 << 20);
    assert_eq!(dvpp["source_alloc_calls"], 1);
    assert_eq!(v["invariant_errors"], serde_json::json!([]));

    // --ranges keeps the old mode: one range per kind, reserved = highest offset.
    let v = json_of(&run(&[
        p.as_os_str(),
        "--json".as_ref(),
        "--ranges".as_ref(),
    ]));
    assert_eq!(v["mode"], "ranges");
    let reserved = v["peak_reserved_bytes"].as_u64().unwrap();
    assert!(
        (256 + 3_110_528 + 256..4 << 20).contains(&reserved),
        "{reserved}"
    );

    // --compare: the pool leads, the range backends follow, each with its mode.
    let v = json_of(&run(&[
        p.as_os_str(),
        "--json".as_ref(),
        "--compare".as_ref(),
    ]));
    let peers = v["peers"].as_array().unwrap();
    assert_eq!(peers[0]["mode"], "pool");
    assert!(peers[1..].iter().all(|p| p["mode"] == "ranges"));
}

/// `rounds` rounds of `n` host allocations of 1 MiB, each round freed before the next.
fn rounds_trace(rounds: u64, n: u64) -> Vec<u8> {
    let mut t = String::new();
    for r in 0..rounds {
        for i in 0..n {
            let id = r * n + i;
            t += &format!("{{\"op\":\"alloc\",\"id\":{id},\"size\":1048576,\"mem\":\"host\"}}\n");
        }
        for i in 0..n {
            t += &format!("{{\"op\":\"free\",\"id\":{}}}\n", r * n + i);
        }
    }
    t.into_bytes()
}

#[test]
fn a_warm_pool_does_not_call_the_source_and_a_cold_one_does() {
    use ascend_pool::pool::PoolConfig;
    use ascend_pool::trace::{PoolFactory, DEFAULT_DEVICE_SIZE};
    let trace = rounds_trace(4, 64);
    let warm = PoolFactory::new(PoolConfig::default(), DEFAULT_DEVICE_SIZE).unwrap();
    let r = replay(&trace[..], TraceConfig::default(), &warm, |_| {}).unwrap();
    assert_eq!(r.ops, 512);
    assert!(r.backend_alloc_calls > 1);
    let c = r.source_calls;
    // The warm half starts with the third round.
    assert_eq!(c.warm_from_op, 257);
    assert_eq!((c.warm_allocs, c.warm_alloc_calls), (128, 0), "{c:?}");
    assert_eq!(
        c.free, 0,
        "64 MiB of empty chunks stay under the release threshold"
    );

    // With no release threshold every round gives its chunks back and asks again.
    let cold = PoolFactory::new(
        PoolConfig::default().with_release_threshold(0),
        DEFAULT_DEVICE_SIZE,
    )
    .unwrap();
    let r = replay(&trace[..], TraceConfig::default(), &cold, |_| {}).unwrap();
    let c = r.source_calls;
    assert!(c.warm_alloc_calls > 0 && c.free > 0, "{c:?}");
    assert_eq!(
        c.warm_alloc_calls_per_10k_allocs,
        c.warm_alloc_calls as f64 * 10_000.0 / 128.0
    );
    // Per-kind counts add up to the totals.
    let k = &r.per_kind[0];
    assert_eq!(
        (k.source_alloc_calls, k.source_free_calls),
        (c.alloc, c.free)
    );
    assert!(r.invariant_errors.is_empty(), "{:?}", r.invariant_errors);
}

#[test]
fn pictures_of_the_pool_and_of_the_replay() {
    let dir = temp_dir("svg");
    let p = write_trace(&dir, "hand.jsonl", HAND_TRACE);
    let state = dir.join("state.svg");
    let timeline = dir.join("timeline.svg");
    let out = run(&[
        p.as_os_str(),
        "--svg-state".as_ref(),
        state.as_os_str(),
        "--svg-timeline".as_ref(),
        timeline.as_os_str(),
        "--json".as_ref(),
    ]);
    assert!(out.status.success(), "{out:?}");
    json_of(&out);
    let s = std::fs::read_to_string(&state).unwrap();
    assert!(s.starts_with("<svg") && s.trim_end().ends_with("</svg>"));
    // The fullest moment is after event 6 (the frame, one host and both device segments).
    assert!(s.contains("after event 6"), "{s}");
    assert!(
        s.contains("dvpp: 1 chunk(s), 4.00 MiB reserved, 1 live segments"),
        "{s}"
    );
    assert!(
        s.contains("device: 1 chunk(s), 2.00 MiB reserved, 2 live segments"),
        "{s}"
    );
    let t = std::fs::read_to_string(&timeline).unwrap();
    assert_eq!(t.matches("<polyline").count(), 3);

    // The state picture needs the pool; pictures need exactly one trace.
    let ranges = run(&[
        p.as_os_str(),
        "--ranges".as_ref(),
        "--svg-state".as_ref(),
        state.as_os_str(),
    ]);
    assert_eq!(ranges.status.code(), Some(2));
    let two = run(&[
        p.as_os_str(),
        p.as_os_str(),
        "--svg-timeline".as_ref(),
        timeline.as_os_str(),
    ]);
    assert_eq!(two.status.code(), Some(2));
    // --ranges draws a timeline too (reserved = high water).
    let out = run(&[
        p.as_os_str(),
        "--ranges".as_ref(),
        "--svg-timeline".as_ref(),
        timeline.as_os_str(),
    ]);
    assert!(out.status.success());
}

#[test]
fn no_progress_bar_off_a_terminal_or_in_json() {
    // Under the test harness stdout and stderr are pipes: nothing but the report is written.
    let dir = temp_dir("bar");
    let p = write_trace(&dir, "hand.jsonl", HAND_TRACE);
    for json in [true, false] {
        let mut args = vec![p.as_os_str(), "--compare".as_ref()];
        if json {
            args.push("--json".as_ref());
        }
        let out = run(&args);
        assert!(out.status.success());
        assert!(
            out.stderr.is_empty(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let text = String::from_utf8(out.stdout.clone()).unwrap();
        assert!(!text.contains('\r') && !text.contains('\x1b'), "{text:?}");
        if json {
            json_of(&out);
        }
    }
}

#[test]
fn bad_pool_configuration_is_a_usage_error() {
    let dir = temp_dir("conf");
    let p = write_trace(&dir, "hand.jsonl", HAND_TRACE);
    let out = run(&[
        p.as_os_str(),
        "--pool-conf".as_ref(),
        "chunk_size:3m".as_ref(),
    ]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("chunk_size"));
    // Device sizes: none, and past what the simulator reserves, are usage errors.
    for size in ["0", "17592186044417", "18446744073709551615"] {
        let out = run(&[p.as_os_str(), "--device-size".as_ref(), size.as_ref()]);
        assert_eq!(out.status.code(), Some(2), "{size}: {out:?}");
    }
    // A device the simulator does not have parses, but no pool can be built on it.
    for source in ["vmm", "sim"] {
        let out = run(&[
            p.as_os_str(),
            "--pool-conf".as_ref(),
            "device:5".as_ref(),
            "--source".as_ref(),
            source.as_ref(),
        ]);
        assert_eq!(out.status.code(), Some(2), "{source}: {out:?}");
        assert!(String::from_utf8_lossy(&out.stderr).contains("cannot build the pool"));
    }
    // A good one changes the figures: 4 MiB chunks cap the growth, the frame stays 4 MiB.
    let v = json_of(&run(&[
        p.as_os_str(),
        "--json".as_ref(),
        "--pool-conf".as_ref(),
        "chunk_size:4m".as_ref(),
    ]));
    assert_eq!(v["peak_reserved_bytes"], 8 << 20);
}

#[test]
fn rounds_take_turns_and_report_each_backends_median() {
    let dir = temp_dir("rounds");
    let p = write_trace(&dir, "hand.jsonl", HAND_TRACE);
    let once = json_of(&run(&[
        p.as_os_str(),
        "--json".as_ref(),
        "--compare".as_ref(),
    ]));
    let out = run(&[
        p.as_os_str(),
        "--json".as_ref(),
        "--compare".as_ref(),
        "--rounds".as_ref(),
        "3".as_ref(),
    ]);
    assert!(out.status.success());
    let v = json_of(&out);
    assert_eq!(v["rounds"], 3);
    let lower_median = |by_round: &Value| {
        let mut ns: Vec<u64> = by_round
            .as_array()
            .unwrap()
            .iter()
            .map(|n| n.as_u64().unwrap())
            .collect();
        assert_eq!(ns.len(), 3, "{by_round}");
        ns.sort_unstable();
        ns[1]
    };
    assert_eq!(
        v["ns_per_op_p50"].as_u64().unwrap(),
        lower_median(&v["ns_per_op_p50_by_round"])
    );
    // Memory figures do not depend on time: every round gives the single run's.
    for key in ["peak_reserved_bytes", "utilization", "backend_alloc_calls"] {
        assert_eq!(v[key], once[key], "{key}");
    }
    let peers = v["peers"].as_array().unwrap();
    assert_eq!(peers.len(), once["peers"].as_array().unwrap().len());
    for (peer, single) in peers.iter().zip(once["peers"].as_array().unwrap()) {
        assert_eq!(peer["name"], single["name"]);
        assert_eq!(peer["peak_reserved_bytes"], single["peak_reserved_bytes"]);
        assert_eq!(peer["invariant_errors"], serde_json::json!([]), "{peer}");
        assert_eq!(
            peer["ns_per_op_p50"].as_u64().unwrap(),
            lower_median(&peer["ns_per_op_p50_by_round"])
        );
    }
    assert_eq!(
        once["ns_per_op_p50_by_round"].as_array().map(Vec::len),
        Some(1)
    );

    // Text mode says how the times were taken.
    let out = run(&[
        p.as_os_str(),
        "--compare".as_ref(),
        "--rounds".as_ref(),
        "2".as_ref(),
    ]);
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.contains("median of 2 rounds"), "{text}");

    // No rounds at all is a usage error, with nothing on stdout.
    let out = run(&[
        p.as_os_str(),
        "--json".as_ref(),
        "--rounds".as_ref(),
        "0".as_ref(),
    ]);
    assert_eq!(out.status.code(), Some(2));
    assert!(out.stdout.is_empty());
}

#[test]
fn the_report_names_the_pools_source_its_rounds_and_its_totals() {
    let dir = temp_dir("report");
    let p = write_trace(&dir, "hand.jsonl", HAND_TRACE);
    let json = |extra: &[&str]| {
        let mut args = vec![p.as_os_str(), "--json".as_ref()];
        args.extend(extra.iter().map(|a| std::ffi::OsStr::new(*a)));
        json_of(&run(&args))
    };
    assert_eq!(json(&[])["pool_source"], "vmm");
    assert_eq!(json(&["--source", "sim"])["pool_source"], "sim");
    assert_eq!(json(&["--source", "vmm"])["pool_source"], "vmm");
    assert!(json(&["--ranges"]).get("pool_source").is_none());
    // --device-size reaches the reader: the 3 MB frame no longer fits a 2 MiB device.
    assert_eq!(json(&[])["errors"]["size_too_large"], 0);
    assert_eq!(
        json(&["--device-size", "2097152"])["errors"]["size_too_large"],
        1
    );
    let compared = json(&["--ranges", "--compare"]);
    assert_eq!(compared["pool_source"], "vmm", "the pool ran as a peer");
    // The buddy tier is its own configuration, not the default engine's again.
    let peak_of = |name: &str| {
        compared["peers"]
            .as_array()
            .unwrap()
            .iter()
            .find(|q| q["name"] == name && q["mode"] == "ranges")
            .map(|q| q["peak_reserved_bytes"].as_u64().unwrap())
            .unwrap()
    };
    assert_ne!(peak_of("ascend-pool (buddy tier)"), peak_of("ascend-pool"));

    let text = |extra: &[&str]| {
        let mut args = vec![p.as_os_str()];
        args.extend(extra.iter().map(|a| std::ffi::OsStr::new(*a)));
        let out = run(&args);
        assert!(out.status.success(), "{out:?}");
        String::from_utf8(out.stdout).unwrap()
    };
    let two = text(&["--compare", "--rounds", "2"]);
    assert!(
        two.contains("medians of 2 interleaved rounds; p50 by round: "),
        "{two}"
    );
    assert!(
        two.contains("; ns: median of 2 rounds, backends taking turns"),
        "{two}"
    );
    let one = text(&["--compare"]);
    assert!(
        !one.contains("interleaved") && !one.contains("median of"),
        "{one}"
    );
    // The totals line carries the peaks in MiB, as the JSON has them in bytes.
    let v = json(&[]);
    let mib = |key: &str| format!("{:.2} MiB", v[key].as_u64().unwrap() as f64 / 1048576.0);
    let total = one
        .lines()
        .find(|l| l.trim_start().starts_with("total"))
        .unwrap();
    for key in ["peak_requested_bytes", "peak_reserved_bytes"] {
        assert!(total.contains(&mib(key)), "{key} in {total}");
    }
}

#[test]
fn a_picture_that_cannot_be_written_fails_the_run() {
    let dir = temp_dir("svg-unwritable");
    let p = write_trace(&dir, "hand.jsonl", HAND_TRACE);
    let nowhere = dir.join("no-such-dir").join("picture.svg");
    for flag in ["--svg-timeline", "--svg-state"] {
        let out = run(&[p.as_os_str(), flag.as_ref(), nowhere.as_os_str()]);
        assert_eq!(out.status.code(), Some(1), "{flag}: {out:?}");
        let err = String::from_utf8(out.stderr).unwrap();
        assert!(err.contains("cannot write"), "{flag}: {err}");
        // The report itself is still written.
        assert!(String::from_utf8(out.stdout).unwrap().contains("total"));
    }
}

/// The minor page faults of one `ascend-pool replay` run with `args` (its exit status checked).
#[cfg(target_os = "linux")]
// `wait4` reaps the child (with its resource usage), which clippy does not see.
#[allow(clippy::zombie_processes)]
fn page_faults_of(args: &[&std::ffi::OsStr]) -> i64 {
    let child = Command::new(BIN)
        .arg("replay")
        .args(args)
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let pid = libc::pid_t::try_from(child.id()).unwrap();
    let mut status = 0;
    // SAFETY: `rusage` is plain data, for which all zeroes is a valid value.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: `pid` is our own child, not waited for yet; both pointers are to live locals.
    let reaped = unsafe { libc::wait4(pid, &mut status, 0, &mut usage) };
    assert_eq!(reaped, pid);
    assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0);
    usage.ru_minflt
}

/// Only the first round has a warm-up pass: the rounds after it must find rlsf's regions
/// (whose pages hold its in-band headers) already faulted in, as the first round's reported
/// pass does, and not fault them in again inside their timed calls (a cold p99 for rlsf,
/// several microseconds, reported as its median over the rounds).
#[cfg(target_os = "linux")]
#[test]
fn later_rounds_find_rlsf_warm() {
    let dir = temp_dir("rlsf-rounds");
    // 4,000 live 64 KiB allocations: rlsf writes a header on a page of its own for each.
    let trace: String = (0..4000)
        .map(|i| format!("{{\"op\":\"alloc\",\"id\":{i},\"size\":65536,\"mem\":\"host\"}}\n"))
        .collect();
    let p = write_trace(&dir, "spread.jsonl", trace.as_bytes());
    let faults = |rounds: &str| {
        page_faults_of(&[
            p.as_os_str(),
            "--json".as_ref(),
            "--engine".as_ref(),
            "rlsf".as_ref(),
            "--rounds".as_ref(),
            rounds.as_ref(),
        ])
    };
    let (one, five) = (faults("1"), faults("5"));
    // A cold pass faults in about 4,000 pages, so four cold rounds 16,000 more (20,872 against
    // 4,863 before the fix); four warm rounds next to none, or about 2,700 under
    // AddressSanitizer, whose quarantine keeps the replay's own freed memory from reuse.
    assert!(
        five - one < 8000,
        "1 round: {one} page faults, 5 rounds: {five}"
    );
}

/// `--device-size` takes 1 byte and up: a replay the pool does not take part in (`--ranges`,
/// a peer as lead) runs on a device smaller than the pool's first chunk, and reports what did
/// not fit, instead of refusing to start because the pool could not be built on it.
#[test]
fn a_device_too_small_for_the_pool_still_replays_ranges() {
    let dir = temp_dir("small-device");
    let p = write_trace(&dir, "hand.jsonl", HAND_TRACE);
    for lead in [["--ranges"].as_slice(), &["--engine", "offset-allocator"]] {
        let mut args = vec![p.as_os_str()];
        args.extend(
            ["--json", "--device-size", "1048576"]
                .iter()
                .chain(lead)
                .map(std::ffi::OsStr::new),
        );
        let out = run(&args);
        assert!(out.status.success(), "{lead:?}: {out:?}");
        let v = json_of(&out);
        // The 3 MB frame does not fit 1 MiB (so its free names an unknown id); the other
        // eight events replay.
        assert_eq!(v["errors"]["size_too_large"], 1, "{lead:?}");
        assert_eq!(v["errors"]["unknown_id"], 1, "{lead:?}");
        assert_eq!(v["ops"], 8, "{lead:?}");
    }
    // The pool itself still needs a device it can take a chunk from.
    let out = run(&[p.as_os_str(), "--device-size".as_ref(), "1048576".as_ref()]);
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stderr).contains("cannot build the pool"));
}

/// The largest `--device-size` the tool takes (16 TiB) replays the hand trace through every
/// backend, the pool in both passes and our engine over ranges beyond its span: nothing it
/// holds is refused for lack of memory. (The pool's second pass used to reserve its virtual
/// addresses while the first pass's were still held, 2 x 64 TiB, and refused every event;
/// our engine refused to make a range past 2^32 64-byte units, and so every event too.)
#[test]
fn the_largest_device_size_replays_every_backend() {
    let dir = temp_dir("largest-device");
    let p = write_trace(&dir, "hand.jsonl", HAND_TRACE);
    for source in ["vmm", "sim"] {
        let out = run(&[
            p.as_os_str(),
            "--json".as_ref(),
            "--compare".as_ref(),
            "--source".as_ref(),
            source.as_ref(),
            "--device-size".as_ref(),
            "17592186044416".as_ref(),
        ]);
        assert!(out.status.success(), "{source}: {out:?}");
        let v = json_of(&out);
        assert_eq!(v["ops"], 10, "{source}");
        for peer in v["peers"].as_array().unwrap() {
            assert_eq!(peer["out_of_memory"], 0, "{source}: {peer}");
            assert!(
                peer["peak_reserved_bytes"].as_u64() > Some(0),
                "{source}: {peer}"
            );
        }
    }
}

/// A trace read to its end exits 0 whatever it held: one with no allocation (empty, or only
/// lines that are counted and skipped) still gets its state picture, a pool with no chunk, as
/// it gets its timeline.
#[test]
fn a_trace_without_allocations_still_gets_its_pictures() {
    let dir = temp_dir("svg-empty");
    let state = dir.join("state.svg");
    let timeline = dir.join("timeline.svg");
    for (name, trace) in [
        ("empty.jsonl", &b""[..]),
        ("bad.jsonl", b"not json\n{\"op\":\"free\",\"id\":3}\n"),
    ] {
        let p = write_trace(&dir, name, trace);
        let _ = std::fs::remove_file(&state);
        let out = run(&[
            p.as_os_str(),
            "--json".as_ref(),
            "--svg-state".as_ref(),
            state.as_os_str(),
            "--svg-timeline".as_ref(),
            timeline.as_os_str(),
        ]);
        assert!(out.status.success(), "{name}: {out:?}");
        assert_eq!(json_of(&out)["ops"], 0, "{name}");
        let s = std::fs::read_to_string(&state).unwrap();
        assert!(
            s.starts_with("<svg") && s.trim_end().ends_with("</svg>"),
            "{s}"
        );
        assert!(s.contains("no allocation"), "{s}");
    }
}

/// `--check` follows the carve rule the pool runs under: with `padding:0` (newer SoCs) or a
/// policy without padding, segments sit closer than the trace's 32-byte padding would put
/// them, and that is no overlap.
#[test]
fn the_placement_check_follows_the_pools_padding() {
    let dir = temp_dir("check-padding");
    let trace = b"{\"op\":\"alloc\",\"id\":1,\"size\":100,\"mem\":\"device\"}
{\"op\":\"alloc\",\"id\":2,\"size\":100,\"mem\":\"device\"}
{\"op\":\"alloc\",\"id\":3,\"size\":100,\"mem\":\"host\"}
{\"op\":\"alloc\",\"id\":4,\"size\":100,\"mem\":\"host\"}
";
    let p = write_trace(&dir, "adjacent.jsonl", trace);
    for conf in ["", "padding:0", "policy:huge1g_only", "padding:64"] {
        let out = run(&[
            p.as_os_str(),
            "--json".as_ref(),
            "--check".as_ref(),
            "--pool-conf".as_ref(),
            conf.as_ref(),
        ]);
        let v = json_of(&out);
        assert_eq!(v["invariant_errors"], serde_json::json!([]), "{conf}: {v}");
        assert!(out.status.success(), "{conf}: {out:?}");
        // The required bytes stay the trace's, whatever the pool's padding.
        assert_eq!(v["peak_required_bytes"], 4 * 192, "{conf}");
    }
}

/// A line with bytes that are not UTF-8 is not JSON, wherever the bytes are: in a field the
/// reader does not know too.
#[test]
fn bytes_that_are_not_utf8_make_a_line_malformed_anywhere() {
    let text: &[u8] = b"{\"op\":\"alloc\",\"id\":1,\"size\":1,\"mem\":\"host\",\"note\":\"\xff\"}
{\"op\":\"alloc\",\"id\":2,\"size\":1,\"mem\":\"ho\xffst\"}
{\"op\":\"alloc\",\"id\":3,\"size\":1,\"mem\":\"host\",\"note\":\"ok\"}
";
    let mut r = TraceReader::new(text, TraceConfig::default());
    let mut ops = 0;
    while let Some(item) = r.next_item() {
        if let TraceItem::Op(_) = item.unwrap() {
            ops += 1;
        }
    }
    assert_eq!(ops, 1, "only the third line is an event");
    assert_eq!(r.errors().get(RejectKind::Malformed), 2);
}

/// The timeline's reserved bytes are what the backend holds after each event, over every
/// kind: when a device kind short of memory makes the pool give back what another device
/// kind held idle, the other kind's bytes leave the timeline at once.
#[test]
fn the_timeline_sees_one_kind_give_back_for_another() {
    use ascend_pool::pool::PoolConfig;
    use ascend_pool::trace::{PoolFactory, ReplaySource};
    // An 8 MiB device: the cached kind keeps its empty 4 MiB chunk (under the release
    // threshold) until the 6 MB device allocation needs the room.
    let text = b"{\"op\":\"alloc\",\"id\":1,\"size\":3000000,\"mem\":\"cached\"}
{\"op\":\"free\",\"id\":1}
{\"op\":\"alloc\",\"id\":2,\"size\":6000000,\"mem\":\"device\"}
{\"op\":\"free\",\"id\":2}
";
    for source in [ReplaySource::Sim, ReplaySource::Vmm] {
        let f = PoolFactory::new(PoolConfig::default(), 8 << 20)
            .unwrap()
            .with_source(source);
        let config = TraceConfig {
            device_size: 8 << 20,
            timeline: true,
            ..TraceConfig::default()
        };
        let r = replay(&text[..], config, &f, |_| {}).unwrap();
        assert_eq!(r.errors.total(), 0, "{source:?}: {:?}", r.errors);
        let held: u64 = f
            .snapshot()
            .unwrap()
            .kinds
            .iter()
            .map(|k| k.stats.reserved_bytes)
            .sum();
        let reserved: Vec<u64> = r.timeline.iter().map(|p| p.reserved).collect();
        assert_eq!(reserved.len(), 4, "{source:?}");
        assert_eq!(reserved[3], held, "{source:?}: {reserved:?}");
        assert!(
            reserved.iter().all(|&b| b <= 8 << 20),
            "{source:?}: more reserved than the device has: {reserved:?}"
        );
    }
}

/// The report's keys are the ones `docs/replay-json.md` lists, no more and no fewer: the
/// report's, `errors`', `source_calls`', `per_kind`'s and `peers`'.
#[test]
fn the_json_report_has_exactly_the_documented_keys() {
    use std::collections::BTreeSet;
    let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/replay-json.md"))
        .unwrap();
    // The table's rows: "| `key` | type | meaning |".
    let rows: Vec<(&str, &str)> = doc
        .lines()
        .filter_map(|l| l.strip_prefix("| `"))
        .filter_map(|l| l.split_once("` |"))
        .collect();
    let top: BTreeSet<&str> = rows.iter().map(|(k, _)| *k).collect();
    let listed = |key: &str| -> BTreeSet<String> {
        let meaning = rows.iter().find(|(k, _)| *k == key).unwrap().1;
        // Backticked names in the meaning, less the ones naming other things.
        meaning
            .split('`')
            .skip(1)
            .step_by(2)
            .filter(|w| {
                w.chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
            })
            .map(str::to_owned)
            .collect()
    };
    let keys = |v: &Value| -> BTreeSet<String> { v.as_object().unwrap().keys().cloned().collect() };
    let dir = temp_dir("doc-keys");
    let p = write_trace(&dir, "hand.jsonl", HAND_TRACE);
    let v = json_of(&run(&[
        p.as_os_str(),
        "--json".as_ref(),
        "--compare".as_ref(),
    ]));
    let got = keys(&v);
    assert_eq!(
        got.iter().map(String::as_str).collect::<BTreeSet<_>>(),
        top,
        "report keys against the doc's table"
    );
    let errors = keys(&v["errors"]);
    assert_eq!(listed("errors"), errors, "errors");
    let mut calls = listed("source_calls");
    calls.retain(|k| k != "ops");
    assert_eq!(calls, keys(&v["source_calls"]), "source_calls");
    for k in v["per_kind"].as_array().unwrap() {
        assert_eq!(listed("per_kind"), keys(k), "per_kind");
    }
    for peer in v["peers"].as_array().unwrap() {
        assert_eq!(listed("peers"), keys(peer), "peers");
    }
}
