//! `record`: a pool writes its allocations and frees as a trace, and replaying that trace
//! gives back the same operations and the same live bytes.

use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::Arc;

use ascend_pool::pool::{Pool, PoolConfig};
use ascend_pool::source::sim::SimSource;
use ascend_pool::trace::{
    replay, PoolFactory, TraceConfig, TraceItem, TraceOp, TraceReader, DEFAULT_DEVICE_SIZE,
};
use ascend_pool::MemKind;

fn trace_path(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!(
        "ascend-pool-record-{}-{name}.jsonl",
        std::process::id()
    ))
}

/// A pool over a 512 MiB simulator that records to `path`, without thread caches (so every
/// free reaches the pool and its recorder at once), and its simulator.
fn recording_without_caches(path: &std::path::Path) -> (Arc<SimSource>, Pool) {
    use ascend_pool::source::sim::SimConfig;
    use ascend_pool::source::BlockSource;
    let sim =
        Arc::new(SimSource::new(SimConfig::default().with_device_capacity(512 << 20)).unwrap());
    let config = PoolConfig::default().with_record(path).with_thread_cache(0);
    let pool = Pool::new(Arc::clone(&sim) as Arc<dyn BlockSource>, config).unwrap();
    (sim, pool)
}

/// A small pipeline: packets, frames, model inputs and outputs, some freed behind a stream,
/// two regions still live at the end. Returns the pool's totals (allocations, frees, peak
/// requested bytes summed over kinds, live regions) and the regions still live.
fn workload(pool: &Pool) -> ((u64, u64, u64, u64), Vec<ascend_pool::DeviceRegion>) {
    let stream = pool.create_stream().unwrap();
    let mut kept = Vec::new();
    let mut frames = Vec::new();
    for i in 0..200u64 {
        let mut packet = pool.alloc_host(60_000 + i * 97).unwrap();
        packet.as_mut_slice()[0] = i as u8;
        let mut bitstream = pool.alloc_dvpp(60_000 + i * 97).unwrap();
        // The packet is freed while the copy may still be queued: its free waits for the stream.
        pool.copy_async(&mut bitstream, 0, &packet, 0, 4096, &stream)
            .unwrap();
        drop(packet);
        let frame = pool.alloc_dvpp(1920 * 1080 * 3 / 2).unwrap();
        let input = pool.alloc_model_input(640 * 640 * 3).unwrap();
        let scores = pool.alloc_device(4096 + i).unwrap();
        drop(bitstream);
        frames.push(frame);
        if frames.len() > 6 {
            frames.remove(i as usize % 5);
        }
        drop(input);
        if i % 50 == 0 {
            kept.push(scores);
        }
    }
    stream.synchronize().unwrap();
    pool.synchronize().unwrap();
    drop(frames);
    kept.truncate(2);
    let stats = pool.all_stats();
    let allocs = stats.iter().map(|s| s.allocations).sum();
    let frees = stats.iter().map(|s| s.frees).sum();
    let peak_requested = stats.iter().map(|s| s.peak_requested_bytes).sum();
    let live = stats.iter().map(|s| s.live_regions).sum();
    // The kept regions stay live past the flush: the trace ends with them allocated.
    pool.flush_record().unwrap();
    ((allocs, frees, peak_requested, live), kept)
}

#[test]
fn a_recorded_workload_replays_to_the_same_operations() {
    roundtrip("roundtrip", 0);
}

#[test]
fn a_recorded_workload_with_thread_caches_replays_to_the_same_operations() {
    roundtrip("roundtrip-cached", PoolConfig::default().thread_cache);
}

/// Records [`workload`] on a pool whose threads cache `thread_cache` bytes, checks the
/// file and replays it. Cache hits and frees into a cache are recorded like any other.
fn roundtrip(name: &str, thread_cache: u64) {
    let path = trace_path(name);
    let config = PoolConfig::default()
        .with_record(&path)
        .with_thread_cache(thread_cache);
    let pool = Pool::new(Arc::new(SimSource::default()), config).unwrap();
    let ((allocs, frees, peak_requested, live), kept) = workload(&pool);
    assert_eq!((allocs, frees, live), (1000, 998, 2));

    // Every line is valid, ids increase by one per allocation, frees name live ids.
    let file = std::fs::File::open(&path).unwrap();
    let mut reader = TraceReader::new(std::io::BufReader::new(file), TraceConfig::default());
    let (mut next_id, mut aligned_128_on_device) = (1, 0);
    let mut live_ids = HashSet::new();
    while let Some(item) = reader.next_item() {
        match item.unwrap() {
            TraceItem::Op(TraceOp::Alloc { id, kind, rule, .. }) => {
                assert_eq!(id, next_id);
                next_id += 1;
                live_ids.insert(id);
                if kind == MemKind::DEVICE && rule.align() == 128 {
                    aligned_128_on_device += 1;
                }
            }
            TraceItem::Op(TraceOp::Free { id, .. }) => assert!(live_ids.remove(&id)),
            TraceItem::Rejected(r) => panic!("line {} rejected: {}", r.line, r.kind),
        }
    }
    assert_eq!(next_id - 1, allocs);
    assert_eq!(
        aligned_128_on_device, 200,
        "model inputs keep their 128-byte alignment"
    );
    assert_eq!(live_ids.len() as u64, live);

    // Replaying the file through a fresh pool gives the same operations and peaks.
    let factory = PoolFactory::new(PoolConfig::default(), DEFAULT_DEVICE_SIZE).unwrap();
    let file = std::fs::File::open(&path).unwrap();
    let report = replay(
        std::io::BufReader::new(file),
        TraceConfig::default(),
        &factory,
        |_| {},
    )
    .unwrap();
    assert_eq!(report.ops, allocs + frees);
    assert_eq!(report.errors.total(), 0);
    assert_eq!(report.live_at_end, live);
    if thread_cache == 0 {
        assert_eq!(report.peak_requested_bytes, peak_requested);
    } else {
        // The pool's peaks count bytes parked in thread caches too (documented on KindStats).
        assert!(report.peak_requested_bytes <= peak_requested);
    }
    assert!(
        report.invariant_errors.is_empty(),
        "{:?}",
        report.invariant_errors
    );
    drop(kept);
    let _ = std::fs::remove_file(&path);
}

#[test]
fn record_comes_from_the_configuration_string() {
    let path = trace_path("conf");
    let config = PoolConfig::parse(&format!("chunk_size:64m, record:{}", path.display())).unwrap();
    assert_eq!(config.record.as_deref(), Some(path.as_path()));
    let pool = Pool::new(Arc::new(SimSource::default()), config).unwrap();
    drop(pool.alloc_host(10).unwrap());
    // Dropping the pool flushes the buffer.
    drop(pool);
    let text = std::fs::read_to_string(&path).unwrap();
    assert_eq!(
        text,
        "{\"op\":\"alloc\",\"id\":1,\"size\":10,\"mem\":\"host\"}\n{\"op\":\"free\",\"id\":1}\n"
    );
    let _ = std::fs::remove_file(&path);
}

#[test]
fn an_application_is_recorded_through_the_environment_alone() {
    // The only test in this binary that touches ASCEND_POOL_CONF, so setting it here races
    // with no reader.
    let path = trace_path("env");
    std::env::set_var(
        ascend_pool::pool::config::CONF_ENV,
        format!("chunk_size:4m,thread_cache:off,record:{}", path.display()),
    );
    let pool = Pool::from_env(Arc::new(SimSource::default()));
    std::env::set_var(ascend_pool::pool::config::CONF_ENV, "chunk_size:3m");
    let refused = Pool::from_env(Arc::new(SimSource::default())).unwrap_err();
    // Not Unicode: refused too, not read as unset (which would drop the limit).
    #[cfg(unix)]
    let not_unicode = {
        use std::os::unix::ffi::OsStringExt;
        std::env::set_var(
            ascend_pool::pool::config::CONF_ENV,
            std::ffi::OsString::from_vec(b"limit:1m,record:/tmp/\xff.jsonl".to_vec()),
        );
        PoolConfig::from_env().unwrap_err()
    };
    std::env::remove_var(ascend_pool::pool::config::CONF_ENV);
    assert!(
        matches!(refused, ascend_pool::Error::Config(_)),
        "{refused:?}"
    );
    #[cfg(unix)]
    assert!(
        matches!(&not_unicode, ascend_pool::Error::Config(m) if m.contains("not Unicode")),
        "{not_unicode:?}"
    );
    assert_eq!(PoolConfig::from_env().unwrap(), PoolConfig::default());
    let pool = pool.unwrap();
    assert_eq!(
        (pool.config().chunk_size, pool.config().thread_cache),
        (4 << 20, 0)
    );
    drop(pool.alloc_dvpp(10).unwrap());
    drop(pool);
    assert_eq!(
        std::fs::read_to_string(&path).unwrap(),
        "{\"op\":\"alloc\",\"id\":1,\"size\":10,\"mem\":\"dvpp\"}\n{\"op\":\"free\",\"id\":1}\n"
    );
    let _ = std::fs::remove_file(&path);
}

#[test]
fn an_unwritable_record_path_is_refused_when_the_pool_is_made() {
    let bad = std::env::temp_dir()
        .join("ascend-pool-no-such-directory")
        .join("trace.jsonl");
    let err = Pool::new(
        Arc::new(SimSource::default()),
        PoolConfig::default().with_record(bad),
    )
    .unwrap_err();
    assert!(
        matches!(err, ascend_pool::Error::Io { op: "create", .. }),
        "{err:?}"
    );
}

#[test]
fn without_record_nothing_is_written_and_flush_is_a_no_op() {
    let pool = Pool::new(Arc::new(SimSource::default()), PoolConfig::default()).unwrap();
    drop(pool.alloc_device(100).unwrap());
    pool.flush_record().unwrap();
}

/// A free deferred behind a stream and completed only when the pool's last handle drops is
/// still written: the application freed the region, and the trace replays to nothing live.
#[test]
fn a_free_the_pools_drop_completes_is_recorded() {
    let path = trace_path("drop-pending");
    let (sim, pool) = recording_without_caches(&path);
    let stream = pool.create_stream().unwrap();
    let hold = sim.hold_stream(stream.handle()).unwrap();
    let mut target = pool.alloc_device(1 << 20).unwrap();
    pool.memset_async(&mut target, 0, 0xAB, 1 << 20, &stream)
        .unwrap();
    drop(target); // freed by the application; the free waits for the stream
    assert_eq!(pool.stats(MemKind::DEVICE).pending_frees, 1);
    std::thread::scope(|s| {
        s.spawn(move || {
            std::thread::sleep(std::time::Duration::from_millis(50));
            hold.release();
        });
        drop(pool); // waits for the stream, then frees the chunk
    });
    drop(stream);
    let text = std::fs::read_to_string(&path).unwrap();
    let _ = std::fs::remove_file(&path);
    let count = |op: &str| text.matches(&format!("\"op\":\"{op}\"")).count();
    assert_eq!((count("alloc"), count("free")), (1, 1), "trace:\n{text}");
    let factory = PoolFactory::new(PoolConfig::default(), DEFAULT_DEVICE_SIZE).unwrap();
    let report = replay(text.as_bytes(), TraceConfig::default(), &factory, |_| {}).unwrap();
    assert_eq!((report.errors.total(), report.live_at_end), (0, 0));
}

/// In debug mode an allocation whose canary cannot be written (`aclrtMemset` fails) gives
/// the caller an error and leaves no trace: neither the allocation nor a free is counted
/// or recorded.
#[test]
fn a_debug_allocation_that_fails_is_neither_counted_nor_recorded() {
    use ascend_pool::source::sim::{AclFunc, Fault};
    use ascend_pool::source::BlockSource;
    use ascend_pool::AclError;
    let path = trace_path("debug-fails");
    let sim = Arc::new(SimSource::default());
    let config = PoolConfig::parse("debug:1,thread_cache:off")
        .unwrap()
        .with_record(&path);
    let pool = Pool::new(Arc::clone(&sim) as Arc<dyn BlockSource>, config).unwrap();
    sim.inject_fault(Fault::next(AclFunc::Memset, AclError::RT_FAILURE, 1));
    assert!(matches!(
        pool.alloc_device(100),
        Err(ascend_pool::Error::Runtime { .. })
    ));
    pool.validate().unwrap();
    let st = pool.stats(MemKind::DEVICE);
    assert_eq!(
        (st.allocations, st.frees, st.live_regions),
        (0, 0, 0),
        "{st:?}"
    );
    assert_eq!(
        (st.peak_allocated_bytes, st.peak_requested_bytes),
        (0, 0),
        "the peaks saw a segment never handed out: {st:?}"
    );
    // The next one is recorded, once.
    let r = pool.alloc_device(100).unwrap();
    pool.flush_record().unwrap();
    let text = std::fs::read_to_string(&path).unwrap();
    let _ = std::fs::remove_file(&path);
    assert_eq!(text.lines().count(), 1, "trace:\n{text}");
    assert!(text.contains("\"op\":\"alloc\""), "{text}");
    drop(r);
}

/// A segment taken over on its stream ([`Pool::alloc_device_on`]) while its old region's free
/// is still pending is written as that free and a new allocation: the trace names each
/// region once, and replays to nothing live.
#[test]
fn a_segment_taken_over_on_its_stream_is_recorded_as_a_free_and_an_allocation() {
    use ascend_pool::Region;
    let path = trace_path("taken-over");
    let (sim, pool) = recording_without_caches(&path);
    let stream = pool.create_stream().unwrap();
    let hold = sim.hold_stream(stream.handle()).unwrap();
    let mut old = pool.alloc_device_on(1 << 20, &stream).unwrap();
    let addr = old.addr();
    pool.memset_async(&mut old, 0, 0xAB, 1 << 20, &stream)
        .unwrap();
    drop(old); // its free waits for the held stream
    let new = pool.alloc_device_on(1 << 20, &stream).unwrap();
    assert_eq!(new.addr(), addr, "taken over at once");
    hold.release();
    drop(new);
    pool.synchronize().unwrap();
    pool.flush_record().unwrap();
    let text = std::fs::read_to_string(&path).unwrap();
    let _ = std::fs::remove_file(&path);
    let count = |op: &str| text.matches(&format!("\"op\":\"{op}\"")).count();
    assert_eq!((count("alloc"), count("free")), (2, 2), "trace:\n{text}");
    let factory = PoolFactory::new(PoolConfig::default(), DEFAULT_DEVICE_SIZE).unwrap();
    let report = replay(text.as_bytes(), TraceConfig::default(), &factory, |_| {}).unwrap();
    assert_eq!((report.errors.total(), report.live_at_end), (0, 0));
    drop(stream);
}
