//! The shape slots inside a pool: what they hold counts as cached, an unproven shape never
//! moves a placement, a proven one never makes the pool grow, and nothing they hold is lost
//! or leaked.

use super::*;
use crate::source::sim::SimSource;

const FRAME: u64 = 3_110_400;
const OUTPUT: u64 = 4_284_000;

fn pool(conf: &str) -> (Arc<SimSource>, Pool) {
    let sim = Arc::new(SimSource::default());
    let pool = Pool::new(sim.clone(), PoolConfig::parse(conf).unwrap()).unwrap();
    (sim, pool)
}

fn alloc(pool: &Pool, kind: MemKind, len: u64) -> OwnedSegment {
    pool.alloc_raw(kind, len, kind.carve_rule().align())
        .unwrap()
}

fn free(s: OwnedSegment) {
    PoolInner::release(s.owner, &s.raw, &[]).unwrap();
}

#[test]
fn a_freed_frame_waits_in_its_slot_counted_as_cached_and_comes_back() {
    let (_, pool) = pool("");
    let a = alloc(&pool, MemKind::Dvpp, FRAME);
    let (addr, footprint) = (a.raw.addr, a.raw.footprint());
    free(a);
    let s = pool.stats(MemKind::Dvpp);
    assert_eq!((s.cached_regions, s.cached_bytes), (1, footprint));
    assert_eq!((s.live_regions, s.allocated_bytes), (0, 0));
    assert_eq!((s.allocations, s.frees), (1, 1));
    assert!(
        pool.leak_report().is_empty(),
        "a slot's segment is free, not a leak"
    );
    let snap = pool.snapshot();
    let held: Vec<_> = snap.kinds[0].chunks[0].segments.iter().collect();
    assert!(held.len() == 1 && held[0].cached);
    pool.validate().unwrap();
    // Same shape: the slot's segment, without the kind carving anything.
    let b = alloc(&pool, MemKind::Dvpp, FRAME);
    assert_eq!(b.raw.addr, addr);
    let s = pool.stats(MemKind::Dvpp);
    assert_eq!((s.cached_regions, s.live_regions, s.allocations), (0, 1, 2));
    free(b);
    pool.validate().unwrap();
    // Trim drains the slots first: the chunk is empty and goes back.
    assert!(pool.trim() > 0);
    let s = pool.stats(MemKind::Dvpp);
    assert_eq!((s.cached_regions, s.reserved_bytes, s.frees), (0, 0, 2));
    pool.validate().unwrap();
}

#[test]
fn the_kind_drains_its_slots_before_it_carves_so_placement_does_not_move() {
    // A larger frame after a smaller one's free: with the free in its engine, the two
    // merge with the free space after them and the larger frame starts where the smaller
    // one did. Had the slot kept the smaller frame, it would start after it.
    for (second, kind) in [
        (OUTPUT, MemKind::Dvpp),
        (OUTPUT, MemKind::Host),
        (60_000, MemKind::Dvpp),
    ] {
        let (_, pool) = pool("");
        // One chunk with room for both (the first chunk is cut to its first request).
        free(alloc(&pool, kind, 32 << 20));
        let a = alloc(&pool, kind, FRAME);
        let addr = a.raw.addr;
        free(a);
        assert_eq!(pool.stats(kind).cached_regions, 1);
        let b = alloc(&pool, kind, second);
        assert_eq!(
            b.raw.addr, addr,
            "{kind}: {second} bytes after a freed frame"
        );
        assert_eq!(pool.stats(kind).cached_regions, 0, "drained");
        pool.validate().unwrap();
        free(b);
    }
}

#[test]
fn frees_of_one_shape_fill_the_slots_and_each_comes_back() {
    let (_, pool) = pool("");
    let segs: Vec<_> = (0..shapes::SLOTS + 1)
        .map(|_| alloc(&pool, MemKind::DEVICE, OUTPUT))
        .collect();
    let mut addrs: Vec<_> = segs.iter().map(|s| s.raw.addr).collect();
    segs.into_iter().for_each(free);
    // The last free found every slot full of its shape and displaced one into its engine.
    let s = pool.stats(MemKind::DEVICE);
    assert_eq!(
        (s.cached_regions, s.frees, s.live_regions),
        (shapes::SLOTS as u64, shapes::SLOTS as u64 + 1, 0)
    );
    pool.validate().unwrap();
    let again: Vec<_> = (0..shapes::SLOTS + 1)
        .map(|_| alloc(&pool, MemKind::DEVICE, OUTPUT))
        .collect();
    let mut got: Vec<_> = again.iter().map(|s| s.raw.addr).collect();
    addrs.sort_unstable();
    got.sort_unstable();
    assert_eq!(got, addrs, "the same segments came back");
    again.into_iter().for_each(free);
    pool.validate().unwrap();
}

#[test]
fn a_proven_frame_stays_in_its_slot_while_small_requests_carve_beside_it() {
    for kind in [MemKind::Dvpp, MemKind::Host] {
        let (_, pool) = pool("");
        free(alloc(&pool, kind, 32 << 20));
        let a = alloc(&pool, kind, FRAME);
        let addr = a.raw.addr;
        free(a);
        // Taken back once: proven.
        let a = alloc(&pool, kind, FRAME);
        assert_eq!(a.raw.addr, addr);
        free(a);
        // A packet in the same chunk no longer drains it (an unproven one would: see
        // `the_kind_drains_its_slots_before_it_carves_so_placement_does_not_move`)...
        let p = alloc(&pool, kind, 60_000);
        assert_ne!(p.raw.addr, addr, "{kind}");
        assert_eq!(pool.stats(kind).cached_regions, 1, "{kind}: still held");
        pool.validate().unwrap();
        // ...and the next frame takes it without a carve.
        let b = alloc(&pool, kind, FRAME);
        assert_eq!(b.raw.addr, addr, "{kind}");
        // A request larger than the thread caches' limit still drains it.
        free(b);
        let c = alloc(&pool, kind, OUTPUT);
        assert_eq!(pool.stats(kind).cached_regions, 0, "{kind}: drained");
        free(c);
        free(p);
        pool.validate().unwrap();
    }
}

#[test]
fn a_request_with_room_only_under_a_proven_frame_gets_it_and_the_pool_does_not_grow() {
    let (sim, pool) = pool("limit:4m");
    let kind = MemKind::Dvpp;
    let a = alloc(&pool, kind, FRAME);
    let addr = a.raw.addr;
    // Fill the rest of the kind's memory.
    let mut fillers = Vec::new();
    while let Ok(f) = pool.alloc_raw(kind, 16 << 10, 128) {
        fillers.push(f);
    }
    assert!(!fillers.is_empty());
    // The replay's cheap read agrees with the full figures.
    let grown = pool.stats(kind).source_alloc_calls;
    assert!(grown > 0);
    assert_eq!(pool.source_alloc_calls(kind), grown);
    free(a);
    let a = alloc(&pool, kind, FRAME);
    free(a);
    assert_eq!(pool.stats(kind).cached_regions, 1, "proven, in its slot");
    let (calls, blocks) = (pool.stats(kind).source_alloc_calls, sim.stats().live_blocks);
    // Room only where the frame is: the kind empties the slots and carves again.
    let p = alloc(&pool, kind, 100_000);
    assert_eq!(p.raw.addr, addr);
    assert_eq!(pool.stats(kind).source_alloc_calls, calls);
    assert_eq!(sim.stats().live_blocks, blocks);
    assert_eq!(pool.stats(kind).cached_regions, 0);
    pool.validate().unwrap();
    free(p);
    fillers.into_iter().for_each(free);
    pool.validate().unwrap();
}

#[test]
fn debug_mode_recording_and_caches_off_keep_large_frees_out_of_the_slots() {
    let dir = std::env::temp_dir().join(format!("ascend-pool-slots-{}", std::process::id()));
    let record = format!("record:{}", dir.display());
    for conf in ["debug:1", "thread_cache:off", record.as_str()] {
        let (_, pool) = pool(conf);
        free(alloc(&pool, MemKind::Dvpp, FRAME));
        assert_eq!(pool.stats(MemKind::Dvpp).cached_regions, 0, "{conf}");
        pool.validate().unwrap();
    }
    let _ = std::fs::remove_file(dir);
}

#[test]
fn a_pool_dropped_with_full_slots_gives_every_block_back() {
    let (sim, pool) = pool("");
    for kind in [MemKind::Dvpp, MemKind::Host, MemKind::DEVICE] {
        free(alloc(&pool, kind, FRAME));
    }
    assert!(sim.stats().live_blocks > 0);
    drop(pool);
    assert_eq!(
        sim.stats().live_blocks,
        0,
        "the slots' handles did not keep the pool alive"
    );
}

#[test]
fn threads_sharing_the_slots_lose_nothing() {
    let (sim, pool) = pool("");
    let pool = Arc::new(pool);
    let threads: Vec<_> = (0..4)
        .map(|t| {
            let pool = Arc::clone(&pool);
            std::thread::spawn(move || {
                let kinds = [MemKind::Dvpp, MemKind::Host];
                let mut held = Vec::new();
                for i in 0..2_000u64 {
                    let kind = kinds[(i as usize + t) % 2];
                    let len = if i % 3 == 0 { OUTPUT } else { FRAME };
                    held.push(alloc(&pool, kind, len));
                    if held.len() > 3 {
                        free(held.swap_remove((i as usize * 7 + t) % held.len()));
                    }
                }
                held.into_iter().for_each(free);
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    pool.validate().unwrap();
    for kind in [MemKind::Dvpp, MemKind::Host] {
        let s = pool.stats(kind);
        assert_eq!(s.live_regions, 0);
        assert_eq!(s.allocations, s.frees, "{kind}");
        assert_eq!(
            s.allocations, 4_000,
            "{kind}: every allocation counted once"
        );
    }
    let pool = Arc::into_inner(pool).unwrap();
    drop(pool);
    assert_eq!(sim.stats().live_blocks, 0);
}
