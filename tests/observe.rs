//! Snapshots, leak reports and statistics agree with each other and with the pool, also
//! while other threads allocate and free.

use ascend_pool::pool::{Pool, PoolConfig};
use ascend_pool::source::sim::SimSource;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// A snapshot's counters describe the segments it lists: the live ones (not held free in
/// a thread cache or shape slot) are `live_regions`, the cached ones `cached_regions`,
/// even while another thread takes segments from its cache and puts them back.
#[test]
fn a_snapshots_counters_match_its_segments_under_traffic() {
    let pool = Arc::new(Pool::new(Arc::new(SimSource::default()), PoolConfig::default()).unwrap());
    let stop = Arc::new(AtomicBool::new(false));
    let worker = {
        let (pool, stop) = (Arc::clone(&pool), Arc::clone(&stop));
        std::thread::spawn(move || {
            let mut held = Vec::new();
            let mut i = 0u64;
            while !stop.load(Ordering::Relaxed) {
                held.push(pool.alloc_host(100 + (i % 3) * 64).unwrap());
                if held.len() > 3 {
                    held.remove((i % 3) as usize);
                }
                i += 1;
            }
        })
    };
    let mut bad = None;
    let end = std::time::Instant::now() + std::time::Duration::from_secs(1);
    let mut seen = 0u64;
    while std::time::Instant::now() < end {
        let snap = pool.snapshot();
        seen += snap.kinds.len() as u64;
        for k in &snap.kinds {
            let segs = k.chunks.iter().flat_map(|c| &c.segments);
            let cached = segs.clone().filter(|s| s.cached).count() as u64;
            let live = segs.clone().filter(|s| !s.cached).count() as u64;
            let bytes: u64 = segs.filter(|s| !s.cached).map(|s| s.footprint).sum();
            let got = (live, cached, bytes);
            let want = (
                k.stats.live_regions,
                k.stats.cached_regions,
                k.stats.allocated_bytes,
            );
            if got != want {
                bad.get_or_insert(format!(
                    "{:?}: segments {got:?}, counters {want:?}",
                    k.stats.kind
                ));
            }
        }
        if bad.is_some() {
            break;
        }
    }
    stop.store(true, Ordering::Relaxed);
    worker.join().unwrap();
    assert!(seen > 0, "no snapshot saw the worker's kind");
    assert!(bad.is_none(), "{}", bad.unwrap());
}

/// A kind whose only requests failed was still used: the snapshot lists it with its
/// counters (the failure among them), as `stats` does, rather than leaving it out.
#[test]
fn a_kind_whose_requests_failed_is_in_the_snapshot() {
    let pool = Pool::new(
        Arc::new(SimSource::default()),
        PoolConfig::parse("limit:2m").unwrap(),
    )
    .unwrap();
    let refused = pool.alloc_dvpp(3 << 20);
    assert!(
        matches!(refused, Err(ascend_pool::Error::LimitExceeded { .. })),
        "{refused:?}"
    );
    assert_eq!(pool.stats(ascend_pool::MemKind::Dvpp).ooms, 1);
    let snap = pool.snapshot();
    let kinds: Vec<_> = snap.kinds.iter().map(|k| k.stats.kind).collect();
    assert_eq!(
        kinds,
        [ascend_pool::MemKind::Dvpp],
        "no other kind was touched"
    );
    assert_eq!(snap.kinds[0].stats.ooms, 1);
    assert!(snap.kinds[0].chunks.is_empty());
    let svg = ascend_pool::svg::pool_state(&snap, "refused");
    assert!(svg.contains("dvpp: 0 chunk(s)"), "{svg}");
}

/// After `reset_peak_stats` a kind's peaks are its current figures, and then follow what
/// runs after the call (as `torch.npu.reset_peak_memory_stats`): a phase's own peak can be
/// read without making a new pool.
#[test]
fn reset_peak_stats_lowers_the_peaks_to_the_current_figures() {
    use ascend_pool::MemKind;
    let pool = Pool::new(Arc::new(SimSource::default()), PoolConfig::default()).unwrap();
    let kept = pool.alloc_dvpp(1 << 20).unwrap();
    drop(pool.alloc_dvpp(40 << 20).unwrap());
    pool.trim();
    let before = pool.stats(MemKind::Dvpp);
    assert!(before.peak_requested_bytes > 40 << 20, "{before:?}");
    pool.reset_peak_stats();
    let s = pool.stats(MemKind::Dvpp);
    assert_eq!(
        (
            s.peak_allocated_bytes,
            s.peak_requested_bytes,
            s.peak_reserved_bytes
        ),
        (
            s.allocated_bytes + s.cached_bytes,
            s.requested_bytes,
            s.reserved_bytes
        ),
        "{s:?}"
    );
    assert_eq!(s.requested_bytes, 1 << 20);
    // The next phase raises them again.
    let more = pool.alloc_dvpp(3 << 20).unwrap();
    let s = pool.stats(MemKind::Dvpp);
    assert_eq!(s.peak_requested_bytes, 4 << 20, "{s:?}");
    assert!(s.peak_reserved_bytes >= s.reserved_bytes);
    drop((kept, more));
    pool.validate().unwrap();
}

/// A region dropped before its stream has run stays in `live_regions` and `pending_frees`
/// after the stream is gone (its drop waited for the work), as `KindStats` documents: the
/// pool completes the free when it next looks at its deferred frees, here on `synchronize`.
#[test]
fn a_free_pending_on_a_dropped_stream_is_counted_until_the_pool_looks() {
    use ascend_pool::MemKind;
    let pool = Pool::new(Arc::new(SimSource::default()), PoolConfig::default()).unwrap();
    let stream = pool.create_stream().unwrap();
    let mut r = pool.alloc_device(4096).unwrap();
    pool.memset_async(&mut r, 0, 1, 4096, &stream).unwrap();
    drop(r);
    drop(stream);
    let figures = |s: ascend_pool::pool::KindStats| (s.live_regions, s.pending_frees, s.frees);
    assert_eq!(figures(pool.stats(MemKind::DEVICE)), (1, 1, 0));
    let listed = pool.leak_report();
    assert!(listed.len() == 1 && listed[0].pending, "{listed:?}");
    pool.synchronize().unwrap();
    assert_eq!(figures(pool.stats(MemKind::DEVICE)), (0, 0, 1));
    assert!(pool.leak_report().is_empty());
}

/// A refusal's `in_use` is the bytes live in regions, as `stats` counts `allocated_bytes`: a
/// segment its region let go of, held free in a thread cache, is not in use, also for a
/// request no chunk could ever hold (refused before any cache is flushed) and for one past
/// the kind's limit.
#[test]
fn a_refusals_in_use_leaves_out_segments_held_free_in_thread_caches() {
    use ascend_pool::{Error, MemKind};
    for config in [
        PoolConfig::default(),
        PoolConfig::default().with_limit(4 << 20),
    ] {
        let pool = Pool::new(Arc::new(SimSource::default()), config).unwrap();
        let kept = pool.alloc_host(1000).unwrap();
        drop(pool.alloc_host(4096).unwrap());
        let s = pool.stats(MemKind::Host);
        assert_eq!((s.cached_regions, s.live_regions), (1, 1), "{s:?}");
        // Past what any chunk's engine addresses: refused before the pool makes room.
        let in_use = match pool.alloc_host(300 << 30) {
            Err(Error::OutOfMemory { in_use, .. } | Error::LimitExceeded { in_use, .. }) => in_use,
            other => panic!("{other:?}"),
        };
        assert_eq!(in_use, s.allocated_bytes, "{s:?}");
        drop(kept);
        pool.validate().unwrap();
    }
}
