//! The shape slots inside a pool: what they hold counts as cached, they never move a
//! placement, and nothing they hold is lost or leaked.

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
fn a_second_free_of_a_shape_displaces_the_first_into_its_engine() {
    let (_, pool) = pool("");
    let a = alloc(&pool, MemKind::DEVICE, OUTPUT);
    let b = alloc(&pool, MemKind::DEVICE, OUTPUT);
    let addr_b = b.raw.addr;
    free(a);
    free(b);
    let s = pool.stats(MemKind::DEVICE);
    assert_eq!((s.cached_regions, s.frees, s.live_regions), (1, 2, 0));
    pool.validate().unwrap();
    // The newer one is in the slot (as a stack would hand it back), the older parked.
    let c = alloc(&pool, MemKind::DEVICE, OUTPUT);
    assert_eq!(c.raw.addr, addr_b);
    free(c);
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
