//! Trace reading, replay and the `ascend-pool replay` binary, on tiny hand-made traces.

use std::path::PathBuf;
use std::process::{Command, Output};

use ascend_pool::peers::{BuddyFactory, OffsetAllocatorFactory, RlsfFactory};
use ascend_pool::trace::{
    replay, RejectKind, ReplayReport, ReplayerFactory, TraceConfig, TraceItem, TraceReader,
};
use serde_json::Value;

const BIN: &str = env!("CARGO_BIN_EXE_ascend-pool");

/// A fresh directory for one test.
fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("ascend-pool-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
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

    // Without --compare there is no peers array; text mode is not JSON.
    let v = json_of(&run(&[p.as_os_str(), "--json".as_ref()]));
    assert!(v.get("peers").is_none());
    let out = run(&[p.as_os_str(), "--compare".as_ref()]);
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(
        text.contains("peak reserved") && text.contains("rlsf"),
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
