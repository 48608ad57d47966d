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

/// A device request naming another allocation policy gets the pool's, and its carve rule:
/// the chunk under it came from the source under the pool's policy. So a segment of one
/// kind always has the padding its block asks for, from the thread cache, a shape slot or
/// the kind (sizes below, within and past the thread caches' range).
#[test]
fn a_device_request_takes_the_pools_policy_and_its_padding() {
    let huge1g = MemKind::Device(MallocPolicy::Huge1gOnly);
    let unpadded = Pool::new(
        Arc::new(SimSource::default()),
        PoolConfig::parse("policy:huge1g_only").unwrap(),
    )
    .unwrap();
    for (pool, padding, kind) in [(pool(), 64, MemKind::DEVICE), (unpadded, 0, huge1g)] {
        for len in [64, 1 << 20, 8 << 20] {
            for asked in [MemKind::DEVICE, huge1g, MemKind::DEVICE] {
                let r = pool.alloc_device_kind(asked, len).unwrap();
                assert_eq!(r.kind(), kind);
                assert_eq!(
                    footprint_at(&pool, r.addr()),
                    len + padding,
                    "{len} bytes asked as {asked:?} in a pool of {kind:?}"
                );
                drop(r); // into a cache or slot, for the next one
            }
        }
        pool.validate().unwrap();
    }
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

mod races {
    //! Thread caches under frees from several threads: a pool dropped while they free, and
    //! figures read while a segment moves from one thread's cache to another's.

    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{mpsc, Barrier, Mutex};
    use std::time::{Duration, Instant};

    /// Regions freed on other threads while the pool's last handle drops never land in a
    /// cache after the drop flushed them: every block is back once the regions are gone,
    /// while those threads live on. (Before, 1 trial in 200 to 700 left a segment in a
    /// cache, whose anchor held every chunk until the thread exited.)
    #[test]
    fn a_pool_dropped_while_threads_free_gives_every_chunk_back() {
        const THREADS: usize = 4;
        let t0 = Instant::now();
        let mut leaked = Vec::new();
        // 3,000 trials, or fewer on a slow (sanitized) build.
        for trial in 0..3000 {
            if t0.elapsed() > Duration::from_secs(15) {
                break;
            }
            let sim = Arc::new(SimSource::default());
            let pool = Pool::new(sim.clone(), PoolConfig::default()).unwrap();
            let start = Arc::new(Barrier::new(THREADS + 1));
            let (done_tx, done_rx) = mpsc::channel();
            let (mut exits, mut threads) = (Vec::new(), Vec::new());
            for _ in 0..THREADS {
                let regions: Vec<_> = (0..4).map(|_| pool.alloc_device(4096).unwrap()).collect();
                let (start, done_tx) = (Arc::clone(&start), done_tx.clone());
                let (exit_tx, exit_rx) = mpsc::channel::<()>();
                exits.push(exit_tx);
                threads.push(std::thread::spawn(move || {
                    start.wait();
                    drop(regions); // this thread's first frees into the pool
                    done_tx.send(()).unwrap();
                    exit_rx.recv().unwrap(); // a long-lived worker, until told
                }));
            }
            start.wait();
            drop(pool); // the last handle, while the threads free
            for _ in 0..THREADS {
                done_rx.recv_timeout(Duration::from_secs(60)).unwrap();
            }
            let held = sim.stats().live_blocks;
            exits.into_iter().for_each(|e| e.send(()).unwrap());
            threads.into_iter().for_each(|t| t.join().unwrap());
            if held != 0 {
                leaked.push((trial, held));
            }
        }
        assert!(leaked.is_empty(), "(trial, blocks held): {leaked:?}");
    }

    const LEN: u64 = 4096;

    type Slot = Arc<Mutex<Option<DeviceRegion>>>;

    fn take(slot: &Slot, stop: &AtomicBool) -> Option<DeviceRegion> {
        loop {
            if let Some(r) = slot.lock().unwrap().take() {
                return Some(r);
            }
            if stop.load(Ordering::Relaxed) {
                return None;
            }
            std::thread::yield_now();
        }
    }

    fn spin(us: u64) {
        let t = Instant::now();
        while t.elapsed() < Duration::from_micros(us) {
            std::hint::spin_loop();
        }
    }

    /// Threads A and B (their caches registered first and last, 64 idle threads' caches
    /// between) pass one 4 KiB device region back and forth, each freeing it into its own
    /// cache and taking it back; B's cache also holds a 12 KiB region. `check` runs meanwhile,
    /// for up to 5 s; returns its first complaint and the number of calls.
    fn hand_over_while(check: impl Fn(&Pool) -> Option<String>) -> (Option<String>, u64) {
        const IDLE: usize = 64;
        let pool = Arc::new(pool());
        let stop = Arc::new(AtomicBool::new(false));
        let (to_a, to_b): (Slot, Slot) = Default::default();
        let a_registered = Arc::new(Barrier::new(2));
        let go = Arc::new(Barrier::new(3));
        let a = {
            let (pool, stop, to_a, to_b) = (pool.clone(), stop.clone(), to_a.clone(), to_b.clone());
            let (go, registered) = (go.clone(), a_registered.clone());
            std::thread::spawn(move || {
                let mut x = Some(pool.alloc_device(LEN).unwrap()); // registers A's cache
                registered.wait();
                go.wait();
                loop {
                    drop(x.take()); // into A's cache
                    spin(3);
                    *to_b.lock().unwrap() = Some(pool.alloc_device(LEN).unwrap()); // a hit
                    match take(&to_a, &stop) {
                        Some(r) => x = Some(r),
                        None => return,
                    }
                }
            })
        };
        a_registered.wait();
        let idle_ready = Arc::new(Barrier::new(IDLE + 1));
        let idle: Vec<_> = (0..IDLE)
            .map(|_| {
                let (pool, stop, ready) = (pool.clone(), stop.clone(), idle_ready.clone());
                std::thread::spawn(move || {
                    let keep = pool.alloc_host(64).unwrap(); // registers an empty cache
                    ready.wait();
                    while !stop.load(Ordering::Relaxed) {
                        std::thread::sleep(Duration::from_millis(5));
                    }
                    drop(keep);
                })
            })
            .collect();
        idle_ready.wait();
        let b = {
            let (pool, stop, to_a, to_b) = (pool.clone(), stop.clone(), to_a.clone(), to_b.clone());
            let go = go.clone();
            std::thread::spawn(move || {
                drop(pool.alloc_device(LEN * 3).unwrap()); // registers B's cache, stays there
                go.wait();
                while let Some(r) = take(&to_b, &stop) {
                    drop(r); // into B's cache
                    spin(3);
                    *to_a.lock().unwrap() = Some(pool.alloc_device(LEN).unwrap());
                    // a hit
                }
            })
        };
        go.wait();
        let t0 = Instant::now();
        let (mut calls, mut bad) = (0u64, None);
        while bad.is_none() && t0.elapsed() < Duration::from_secs(5) {
            calls += 1;
            bad = check(&pool);
        }
        stop.store(true, Ordering::Relaxed);
        a.join().unwrap();
        b.join().unwrap();
        idle.into_iter().for_each(|h| h.join().unwrap());
        (bad, calls)
    }

    /// The figures read every thread's cache at once: a segment handed from one thread's
    /// cache to another's is counted once. (Before, read one cache at a time, it could be
    /// counted in both, and `live_regions` wrapped below zero.)
    #[test]
    fn figures_count_a_segment_moving_between_caches_once() {
        let (bad, calls) = hand_over_while(|pool| {
            let s = pool.stats(MemKind::DEVICE);
            // Two device regions exist: the one handed over and the one in B's cache.
            (s.cached_regions > 2 || s.live_regions > 2).then(|| format!("{s:#?}"))
        });
        assert!(bad.is_none(), "after {calls} reads: {}", bad.unwrap());
    }

    /// `validate` walks every thread's cache at once, and so passes while segments move
    /// between them. (Before, it could find one segment in two caches.)
    #[test]
    fn validate_passes_while_threads_hand_regions_to_each_other() {
        let (bad, calls) = hand_over_while(|pool| pool.validate().err().map(|e| e.to_string()));
        assert!(bad.is_none(), "after {calls} checks: {}", bad.unwrap());
    }
}

/// A thread per request over one pool, and pools made and dropped on a thread that lives
/// on: what exited threads cached goes back, and no pool's memory stays with the source
/// (counted after N rounds and after 2N).
#[test]
fn threads_and_pools_that_come_and_go_leave_nothing_behind() {
    let sim = Arc::new(SimSource::default());
    let shared = Pool::new(sim.clone(), PoolConfig::default()).unwrap();
    let round = |n: usize| {
        for i in 0..n {
            // Joined by its handle: that join waits for the thread's thread-local
            // destructors too (the scope's own wait does not), where its cache goes back.
            std::thread::scope(|s| {
                s.spawn(|| {
                    let held: Vec<DeviceRegion> = (0..8)
                        .map(|j| shared.alloc_device(64 * (1 + (i + j) as u64 % 50)).unwrap())
                        .collect();
                    drop(held);
                })
                .join()
                .unwrap();
            });
            let own = Pool::new(sim.clone(), PoolConfig::default()).unwrap();
            drop(own.alloc_device(4096).unwrap());
        }
        let s = shared.stats(MemKind::DEVICE);
        (s.reserved_bytes, s.cached_regions, sim.stats().live_blocks)
    };
    let after_n = round(100);
    let after_2n = round(100);
    assert_eq!(after_n.1, 0, "an exited thread's cache kept segments");
    assert_eq!(after_n, after_2n);
}

/// In debug mode a write into a segment's padding while it sits in a thread cache (a write
/// after its free) is reported when the next allocation of its shape takes it back, and the
/// new owner gets a whole canary: its own free reports nothing.
#[test]
fn a_write_into_a_cached_segment_is_reported_when_it_is_taken_back() {
    let pool = Pool::new(
        Arc::new(SimSource::default()),
        PoolConfig::default().with_debug(true),
    )
    .unwrap();
    let mut first = pool.alloc_host(1000).unwrap();
    let addr = first.addr();
    first.as_mut_slice().fill(1);
    drop(first); // into this thread's cache, its canary whole
    assert_eq!(pool.stats(MemKind::Host).cached_regions, 1);
    assert!(pool.take_corruption_reports().is_empty());
    // A write after the free, into the padding (1024.., past the rounded length).
    let junk = [0x55u8; 4];
    // SAFETY: 4 bytes inside the cached segment's padding, which stays carved while cached.
    unsafe {
        pool.source()
            .memcpy(
                addr + 1030,
                4,
                junk.as_ptr() as usize,
                4,
                ascend_pool::source::MemcpyKind::HostToHost,
            )
            .unwrap();
    }
    let again = pool.alloc_host(1000).unwrap();
    assert_eq!(again.addr(), addr, "a thread-cache hit");
    let reports = pool.take_corruption_reports();
    assert!(
        matches!(
            reports[..],
            [ascend_pool::Error::Corruption {
                len: 1000,
                first_bad: 1030,
                ..
            }]
        ),
        "{reports:?}"
    );
    assert!(again.free().is_ok(), "the new owner's canary is whole");
    assert!(pool.take_corruption_reports().is_empty());
    pool.validate().unwrap();
}

/// A segment held free in a thread cache is no leak, and giving it back to its kind (a
/// flush) is not a second free: the counters say one allocation and one free throughout.
#[test]
fn a_cached_segment_is_no_leak_and_its_flush_no_second_free() {
    let pool = pool();
    drop(pool.alloc_host(4096).unwrap());
    let st = pool.stats(MemKind::Host);
    assert_eq!((st.allocations, st.frees, st.cached_regions), (1, 1, 1));
    assert!(pool.leak_report().is_empty(), "{:?}", pool.leak_report());
    assert!(pool.flush_thread_caches() > 0);
    let st = pool.stats(MemKind::Host);
    assert_eq!(
        (st.allocations, st.frees, st.cached_regions, st.live_regions),
        (1, 1, 0, 0),
        "{st:?}"
    );
    pool.validate().unwrap();
}

/// In debug mode a thread-cache hit whose canary cannot be written again (`aclrtMemset`
/// fails) gives the segment back and carves a fresh one: the caller's request is one
/// allocation, not two.
#[test]
fn a_debug_cache_hit_that_cannot_arm_its_canary_counts_one_allocation() {
    use ascend_pool::source::sim::{AclFunc, Fault};
    use ascend_pool::source::BlockSource;
    let sim = Arc::new(SimSource::default());
    let pool = Pool::new(
        Arc::clone(&sim) as Arc<dyn BlockSource>,
        PoolConfig::default().with_debug(true),
    )
    .unwrap();
    drop(pool.alloc_device(1000).unwrap()); // into this thread's cache
    assert_eq!(pool.stats(MemKind::DEVICE).cached_regions, 1);
    sim.inject_fault(Fault::next(
        AclFunc::Memset,
        ascend_pool::AclError::RT_FAILURE,
        1,
    ));
    let again = pool.alloc_device(1000).unwrap();
    assert_eq!(
        sim.stats().failures(AclFunc::Memset),
        1,
        "the hit's canary failed"
    );
    let st = pool.stats(MemKind::DEVICE);
    assert_eq!(
        (st.allocations, st.frees, st.live_regions, st.cached_regions),
        (2, 1, 1, 0),
        "{st:?}"
    );
    drop(again);
    assert!(pool.take_corruption_reports().is_empty());
    pool.validate().unwrap();
}
