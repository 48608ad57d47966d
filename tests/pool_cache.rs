//! The pool's thread-cache fast path keeps the carve rule, the registry and the figures
//! exactly as the kind pool's own path does.

use ascend_pool::pool::{Pool, PoolConfig};
use ascend_pool::source::sim::SimSource;
use ascend_pool::{MallocPolicy, MemKind, Region};
use std::sync::Arc;

fn pool() -> Pool {
    Pool::new(Arc::new(SimSource::default()), PoolConfig::default()).unwrap()
}

/// Footprint of the live segment at `addr`, from a snapshot.
fn footprint_at(pool: &Pool, addr: usize) -> u64 {
    pool.snapshot()
        .kinds
        .iter()
        .flat_map(|k| &k.chunks)
        .flat_map(|c| &c.segments)
        .find(|s| s.addr == addr && !s.cached)
        .map(|s| s.footprint)
        .expect("the segment is live")
}

#[test]
fn an_unpadded_segment_is_not_reused_for_a_padded_request() {
    let pool = pool();
    // 1 GiB-page policies add no padding: 64 bytes take 64; the pool's policy takes 128.
    let unpadded = pool
        .alloc_device_kind(MemKind::Device(MallocPolicy::Huge1gOnly), 64)
        .unwrap();
    let addr = unpadded.addr();
    assert_eq!(footprint_at(&pool, addr), 64);
    drop(unpadded);
    let padded = pool.alloc_device(64).unwrap();
    assert_eq!(footprint_at(&pool, padded.addr()), 128);
    // The other way round is fine: a padded segment has room for an unpadded request.
    let a = padded.addr();
    drop(padded);
    let reused = pool
        .alloc_device_kind(MemKind::Device(MallocPolicy::Huge1gOnly), 64)
        .unwrap();
    assert_eq!(reused.addr(), a, "served from the thread cache");
    assert!(footprint_at(&pool, a) >= 64);
    drop(reused);
    pool.validate().unwrap();
}

#[test]
fn cache_hits_keep_length_alignment_and_figures() {
    let pool = pool();
    let kind = MemKind::Device(pool.config().policy);
    let first = pool.alloc_model_input(1000).unwrap();
    let addr = first.addr();
    assert_eq!(
        (first.len(), first.align(), first.kind()),
        (1000, 128, kind)
    );
    drop(first);
    for round in 0..100 {
        let r = pool.alloc_model_input(1000).unwrap();
        assert_eq!(r.addr(), addr, "round {round} reuses the cached segment");
        assert_eq!((r.len(), r.align()), (1000, 128));
        let s = pool.stats(kind);
        assert_eq!((s.live_regions, s.requested_bytes), (1, 1000));
        assert_eq!(s.allocations, round + 2);
    }
    let s = pool.stats(kind);
    assert_eq!((s.live_regions, s.cached_regions, s.frees), (0, 1, 101));
    // Another shape is not served from that segment.
    let other = pool.alloc_model_input(999).unwrap();
    assert_ne!(other.addr(), addr);
    assert_eq!(other.len(), 999);
    drop(other);
    pool.validate().unwrap();
    assert_eq!(pool.flush_thread_caches(), 2 * 1152);
    pool.validate().unwrap();
}

#[test]
fn bad_requests_fail_before_and_after_a_cache_hit() {
    let pool = pool();
    drop(pool.alloc_host(64).unwrap());
    assert!(pool.alloc_host(0).is_err());
    assert!(pool.alloc_host(u64::MAX).is_err());
    let r = pool.alloc_host(64).unwrap();
    assert_eq!(r.len(), 64);
    drop(r);
    pool.validate().unwrap();
}

/// A thread's hot path remembers the cache it used last: two pools worked in turn on one
/// thread, a pool dropped and a new one made, and threads that exit each keep their
/// segments apart and their figures exact.
#[test]
fn pools_worked_in_turn_keep_their_own_cached_segments() {
    let (a, b) = (pool(), pool());
    let (ra, rb) = (a.alloc_device(4096).unwrap(), b.alloc_device(4096).unwrap());
    let (addr_a, addr_b) = (ra.addr(), rb.addr());
    drop(ra);
    drop(rb);
    for round in 0..50 {
        // Each free and each hit switches the pool this thread worked last.
        let ra = a.alloc_device(4096).unwrap();
        let rb = b.alloc_device(4096).unwrap();
        assert_eq!((ra.addr(), rb.addr()), (addr_a, addr_b), "round {round}");
        drop(rb);
        drop(ra);
    }
    for p in [&a, &b] {
        let s = p.stats(MemKind::DEVICE);
        assert_eq!((s.live_regions, s.cached_regions, s.frees), (0, 1, 51));
        p.validate().unwrap();
    }
    // A pool that goes away while this thread remembers its cache: the next pool made
    // here gets a cache of its own, and nothing of the old one.
    drop(b);
    let c = pool();
    let rc = c.alloc_device(4096).unwrap();
    let s = c.stats(MemKind::DEVICE);
    assert_eq!((s.live_regions, s.cached_regions, s.allocations), (1, 0, 1));
    drop(rc);
    assert_eq!(c.stats(MemKind::DEVICE).cached_regions, 1);
    c.validate().unwrap();
    // Threads that used `a` and exit give their caches back.
    let a = Arc::new(a);
    let threads: Vec<_> = (0..4)
        .map(|_| {
            let a = Arc::clone(&a);
            std::thread::spawn(move || {
                for _ in 0..100 {
                    drop(a.alloc_device(4096).unwrap());
                    drop(a.alloc_host(512).unwrap());
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let s = a.stats(MemKind::DEVICE);
    assert_eq!(
        (s.live_regions, s.cached_regions),
        (0, 1),
        "only this thread's"
    );
    assert_eq!(a.stats(MemKind::Host).cached_regions, 0);
    a.validate().unwrap();
}
