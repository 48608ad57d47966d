//! The pool's thread-cache fast path keeps the carve rule, the registry and the figures
//! exactly as the kind pool's own path does.

use ascend_pool::pool::{Pool, PoolConfig};
use ascend_pool::source::sim::SimSource;
use ascend_pool::{DeviceRegion, MallocPolicy, MemKind, Region};
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
fn a_small_request_takes_a_proven_slots_room_before_the_kind_grows() {
    // The first chunk is one 2 MiB granule: two segments of a 1 MiB footprint fill it.
    let pool = Pool::new(
        Arc::new(SimSource::default()),
        PoolConfig::default().with_chunk_size(4 << 20),
    )
    .unwrap();
    let half = (1 << 20) - 64;
    let a = pool.alloc_host(half).unwrap();
    let _b = pool.alloc_host(half).unwrap();
    let a_addr = a.addr();
    // Back from its shape slot once, the shape is proven: its slot keeps it through the
    // small requests that would otherwise take its room.
    drop(a);
    let a = pool.alloc_host(half).unwrap();
    assert_eq!(a.addr(), a_addr);
    drop(a);
    let before = pool.stats(MemKind::Host);
    assert_eq!(before.chunks, 1);
    // A segment in a slot is free to users of the figures: only `_b` is live.
    assert_eq!(
        (
            before.allocated_bytes,
            before.requested_bytes,
            before.live_regions
        ),
        (1 << 20, half, 1)
    );
    assert_eq!((before.cached_bytes, before.cached_regions), (1 << 20, 1));
    // A size the thread caches keep (they are empty, so it reaches the kind): proven slots
    // stay held while the chunks are walked, and are emptied only before the kind grows.
    let small = pool.alloc_host(200 << 10).unwrap();
    let after = pool.stats(MemKind::Host);
    assert_eq!(
        (after.source_alloc_calls, after.reserved_bytes),
        (before.source_alloc_calls, before.reserved_bytes),
        "the kind grew rather than take the slot's room"
    );
    assert!(small.addr() >= a_addr && small.addr() < a_addr + (1 << 20));
    drop(small);
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

#[test]
fn a_free_into_a_full_thread_cache_empties_it_and_is_kept() {
    let pool = pool();
    let cap = pool.config().thread_cache;
    let n = cap / (64 << 10);
    // Segments of a 64 KiB footprint until the cache holds its whole budget.
    let regions: Vec<_> = (0..n)
        .map(|_| pool.alloc_device((64 << 10) - 64).unwrap())
        .collect();
    drop(regions);
    let device = pool.stats(MemKind::DEVICE);
    assert_eq!((device.cached_bytes, device.cached_regions), (cap, n));
    // One more free, of another kind: the cache gives everything back to the kinds
    // (flushing, not refusing) and keeps the newest.
    drop(pool.alloc_host(100).unwrap());
    let (device, host) = (pool.stats(MemKind::DEVICE), pool.stats(MemKind::Host));
    assert_eq!((device.cached_bytes, device.cached_regions), (0, 0));
    assert_eq!((host.cached_regions, host.live_regions), (1, 0));
    assert_eq!(device.allocated_bytes, 0);
    pool.validate().unwrap();
}

/// A region a thread keeps in a thread-local of its own is freed when that thread-local is
/// destroyed at thread exit, which can be after the thread's cache has been given back: the
/// free must then go to the kind, not into the cache the thread no longer has.
#[test]
fn a_region_freed_by_a_thread_local_after_the_threads_cache_is_gone() {
    use std::cell::RefCell;
    thread_local! {
        static KEPT: RefCell<Vec<DeviceRegion>> = const { RefCell::new(Vec::new()) };
    }
    let pool = Arc::new(pool());
    let p = Arc::clone(&pool);
    std::thread::spawn(move || {
        // `KEPT` is touched before the pool makes this thread's cache, so it is destroyed
        // after it (thread-locals go in the reverse order of their first use).
        KEPT.with(|k| k.borrow_mut().push(p.alloc_device(4096).unwrap()));
        for _ in 0..3 {
            drop(p.alloc_device(4096).unwrap());
        }
        KEPT.with(|k| k.borrow_mut().push(p.alloc_device(4096).unwrap()));
    })
    .join()
    .unwrap();
    let s = pool.stats(MemKind::DEVICE);
    assert_eq!(
        (s.live_regions, s.cached_regions, s.frees),
        (0, 0, 5),
        "both kept regions freed to the kind"
    );
    pool.validate().unwrap();
    // The freed segments are the pool's to hand out again.
    let again = pool.alloc_device(4096).unwrap();
    assert_eq!(pool.stats(MemKind::DEVICE).live_regions, 1);
    drop(again);
    pool.validate().unwrap();
}

/// A segment too large for the thread caches waits in a shape slot once freed; a flush
/// gives it back with the cached ones, and counts its bytes.
#[test]
fn a_flush_gives_back_and_counts_shape_slots_too() {
    let pool = pool();
    let frame = 1920 * 1080 * 3 / 2;
    let big = pool.alloc_device(frame).unwrap();
    let small = pool.alloc_device(1000).unwrap();
    let big_footprint = footprint_at(&pool, big.addr());
    assert!(big_footprint > 256 << 10, "past the thread caches' limit");
    drop(big);
    drop(small);
    assert_eq!(
        pool.stats(MemKind::DEVICE).cached_regions,
        2,
        "one slot, one cache"
    );
    assert_eq!(pool.flush_thread_caches(), big_footprint + 1088);
    let s = pool.stats(MemKind::DEVICE);
    assert_eq!((s.cached_regions, s.allocated_bytes), (0, 0));
    pool.validate().unwrap();
}

/// A segment of exactly the dedicated-chunk size has a chunk of its own: freed, it goes
/// back to the source with its chunk rather than into a shape slot, and one 64 bytes
/// smaller waits in a slot.
#[test]
fn a_segment_of_the_dedicated_size_skips_the_shape_slots() {
    let config = PoolConfig {
        large_threshold: 4 << 20,
        ..PoolConfig::default()
    };
    let pool = Pool::new(Arc::new(SimSource::default()), config).unwrap();
    for (footprint, slotted) in [(4 << 20, false), ((4 << 20) - 64, true)] {
        let r = pool.alloc_device(footprint - 64).unwrap();
        assert_eq!(footprint_at(&pool, r.addr()), footprint);
        let before = pool.stats(MemKind::DEVICE);
        drop(r);
        let s = pool.stats(MemKind::DEVICE);
        assert_eq!(
            (
                s.cached_regions,
                s.source_free_calls - before.source_free_calls
            ),
            if slotted { (1, 0) } else { (0, 1) },
            "footprint {footprint}"
        );
        pool.validate().unwrap();
    }
}
