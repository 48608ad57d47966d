//! Chunk growth of kinds that cannot grow in place (pinned host and DVPP memory on the
//! simulator): how many bytes a kind takes from the source, and when.
//!
//! Each test builds a small, deterministic sequence and checks the pool's own counters
//! (`reserved_bytes`, `peak_reserved_bytes`, source calls): a growth policy that strands
//! memory or calls the source per request fails them.

use ascend_pool::region::{DvppRegion, HostRegion};
use ascend_pool::source::sim::{AclFunc, SimConfig, SimSource};
use ascend_pool::{MemKind, Pool, PoolConfig};
use std::sync::Arc;

const MIB: u64 = 1 << 20;
/// A request whose footprint under the default rule is exactly 1 MiB.
const ONE_MIB_FOOTPRINT: u64 = MIB - 64;
/// One 1080p NV12 frame.
const FRAME: u64 = 1920 * 1080 * 3 / 2;

fn pool() -> Pool {
    let config = PoolConfig {
        thread_cache: 0,
        ..PoolConfig::default()
    };
    Pool::new(Arc::new(SimSource::default()), config).unwrap()
}

/// Once a kind's live bytes level off, a request that finds no hole only because the free
/// bytes are scattered gets a chunk about its own size, not a whole balanced chunk.
#[test]
fn fragmented_kind_grows_by_about_the_request() {
    let pool = pool();
    // At least 64 MiB live, and every chunk full: no free tail anywhere.
    let mut regions: Vec<Option<HostRegion>> = Vec::new();
    loop {
        regions.push(Some(pool.alloc_host(ONE_MIB_FOOTPRINT).unwrap()));
        let s = pool.stats(MemKind::Host);
        if regions.len() >= 64 && s.allocated_bytes == s.reserved_bytes {
            break;
        }
    }
    let live = regions.len() as u64 * MIB;
    // Every other region goes: half the bytes free, in 1 MiB holes between live regions.
    for r in regions.iter_mut().skip(1).step_by(2) {
        *r = None;
    }
    let before = pool.stats(MemKind::Host);
    assert_eq!(before.reserved_bytes, live);
    assert_eq!(before.allocated_bytes, live - live / 2);

    let big = pool.alloc_host(3 * MIB).unwrap();
    let after = pool.stats(MemKind::Host);
    // The request's footprint (3 MiB + 64) in whole 2 MiB granules. A chunk sized from
    // reserved bytes alone would be about sqrt(8 x 2 MiB x 64 MiB) = 32 MiB.
    assert_eq!(after.reserved_bytes - before.reserved_bytes, 4 * MIB);
    assert_eq!(after.source_alloc_calls, before.source_alloc_calls + 1);

    drop(big);
    drop(regions);
    pool.validate().unwrap();
}

/// While a kind ramps up with full chunks, each new chunk is the balanced headroom
/// `sqrt(8 x 2 MiB x reserved)` in whole granules: a footprint of 1 MiB tiles every size
/// near it exactly, so no other size wins on fit.
#[test]
fn a_ramping_kind_takes_chunks_of_the_balanced_size() {
    let pool = pool();
    let granule = 2 * MIB;
    let cap = pool.config().chunk_size;
    let mut regions = Vec::new();
    let mut chunks = Vec::new();
    while regions.len() < 600 {
        let before = pool.stats(MemKind::Host);
        regions.push(pool.alloc_host(ONE_MIB_FOOTPRINT).unwrap());
        let after = pool.stats(MemKind::Host);
        if after.source_alloc_calls == before.source_alloc_calls {
            continue;
        }
        assert_eq!(
            before.allocated_bytes, before.reserved_bytes,
            "grew with room left"
        );
        let balanced = (8 * u128::from(granule) * u128::from(before.reserved_bytes)).isqrt() as u64;
        let expected = (balanced / granule * granule).clamp(granule, cap);
        let size = after.reserved_bytes - before.reserved_bytes;
        assert_eq!(size, expected, "at {} reserved", before.reserved_bytes);
        chunks.push(size);
    }
    // From one granule up: 600 MiB live in a few dozen chunks, the last near 92 MiB.
    assert_eq!(chunks.first(), Some(&granule));
    assert!(chunks.len() < 40, "{chunks:?}");
    drop(regions);
    pool.validate().unwrap();
}

/// Under a limit, a kind whose next balanced chunk would pass it takes a chunk of just the
/// request's granules instead, and so fills the limit before it refuses.
#[test]
fn a_kind_near_its_limit_grows_by_just_the_request() {
    let limit = 40 * MIB;
    let pool = Pool::new(
        Arc::new(SimSource::default()),
        PoolConfig::default().with_thread_cache(0).with_limit(limit),
    )
    .unwrap();
    let mut regions = Vec::new();
    let err = loop {
        match pool.alloc_host(ONE_MIB_FOOTPRINT) {
            Ok(r) => regions.push(r),
            Err(e) => break e,
        }
    };
    assert!(
        matches!(err, ascend_pool::Error::LimitExceeded { .. }),
        "{err:?}"
    );
    let s = pool.stats(MemKind::Host);
    // 1 MiB footprints tile every chunk: the whole limit is live.
    assert_eq!(
        (s.reserved_bytes, s.allocated_bytes, regions.len() as u64),
        (limit, limit, limit / MIB),
        "{s:?}"
    );
    drop(regions);
    pool.validate().unwrap();
}

/// An empty chunk too small for a request goes back before the new chunk is taken, so the
/// kind's peak holds only the new one.
#[test]
fn empty_chunk_goes_back_before_a_larger_one_comes() {
    let pool = pool();
    drop(pool.alloc_host(ONE_MIB_FOOTPRINT).unwrap());
    let s = pool.stats(MemKind::Host);
    // Below the release threshold, the empty chunk is kept for reuse.
    assert_eq!(
        (s.reserved_bytes, s.chunks, s.source_free_calls),
        (2 * MIB, 1, 0)
    );

    let big = pool.alloc_host(3 * MIB).unwrap();
    let s = pool.stats(MemKind::Host);
    assert_eq!(s.reserved_bytes, 4 * MIB);
    assert_eq!(
        s.peak_reserved_bytes,
        4 * MIB,
        "old and new chunk held at once"
    );
    assert_eq!((s.chunks, s.source_free_calls), (1, 1));

    // A request the kept chunk fits is served from it: no call to the source.
    drop(big);
    let calls = pool.stats(MemKind::Host).source_alloc_calls;
    let again = pool.alloc_host(3 * MIB).unwrap();
    assert_eq!(pool.stats(MemKind::Host).source_alloc_calls, calls);
    drop(again);
    pool.validate().unwrap();
}

/// A kind that ramps up with a recurring size grows in few chunks cut for it (each full
/// before the next is taken), holds little more than it needs along the way, and then
/// serves the same sizes without the source.
#[test]
fn frame_ramp_uses_few_chunks_and_stops_growing_once_warm() {
    let pool = pool();
    let mut frames: Vec<DvppRegion> = Vec::new();
    let (mut calls, mut previous, mut full_before, mut utilization_sum) = (0, 0.0, 1.0f64, 0.0);
    for n in 1..=100 {
        frames.push(pool.alloc_dvpp(FRAME).unwrap());
        let s = pool.stats(MemKind::Dvpp);
        let utilization = s.allocated_bytes as f64 / s.reserved_bytes as f64;
        if s.source_alloc_calls > calls && n > 8 {
            full_before = full_before.min(previous);
        }
        (calls, previous) = (s.source_alloc_calls, utilization);
        if n > 16 {
            utilization_sum += utilization;
        }
    }
    // One chunk per frame (4 MiB for 2.97 MiB) would be 100 calls at 0.74.
    assert!(calls <= 14, "{calls} chunks for 100 frames");
    assert!(
        full_before >= 0.95,
        "a chunk was taken at {full_before:.3} full"
    );
    let mean = utilization_sum / 84.0;
    assert!(mean >= 0.85, "mean utilization over the ramp {mean:.3}");

    // Steady state: frames freed and allocated in a scrambled order.
    let mut x: u64 = 0x2545_F491_4F6C_DD1D;
    for _ in 0..2000 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let i = (x % frames.len() as u64) as usize;
        frames.swap_remove(i);
        frames.push(pool.alloc_dvpp(FRAME).unwrap());
    }
    assert_eq!(pool.stats(MemKind::Dvpp).source_alloc_calls, calls);
    drop(frames);
    pool.validate().unwrap();
}

/// A frame is taken back from the chunk where a frame was last freed, where it waits
/// parked: not carved from an earlier chunk's free frame, which the walk in chunk order
/// would reach first (and merge on the way through every full chunk before it).
#[test]
fn a_recurring_frame_comes_back_from_the_chunk_that_last_freed_one() {
    use ascend_pool::region::Region;
    let pool = pool();
    let mut frames: Vec<Option<DvppRegion>> = Vec::new();
    while pool.stats(MemKind::Dvpp).chunks < 3 {
        frames.push(Some(pool.alloc_dvpp(FRAME).unwrap()));
    }
    let snap = pool.snapshot();
    let chunks = &snap
        .kinds
        .iter()
        .find(|k| k.stats.kind == MemKind::Dvpp)
        .unwrap()
        .chunks;
    let chunk_of = |addr: usize| {
        chunks
            .iter()
            .position(|c| (c.addr..c.addr + c.size as usize).contains(&addr))
            .unwrap()
    };
    let first = frames[0].take().unwrap();
    let last = frames.pop().unwrap().unwrap();
    let (first_addr, last_addr) = (first.addr(), last.addr());
    // The first frame is in the first chunk made, which the walk tries first.
    assert_ne!(chunk_of(first_addr), chunk_of(last_addr));
    drop(first);
    drop(last);
    let again = pool.alloc_dvpp(FRAME).unwrap();
    assert_eq!(
        again.addr(),
        last_addr,
        "the frame freed last, in its own chunk"
    );
    let next = pool.alloc_dvpp(FRAME).unwrap();
    assert_eq!(next.addr(), first_addr, "the other free frame");
    pool.validate().unwrap();
    drop((again, next, frames));
    pool.validate().unwrap();
}

/// A shape slot counts its segment's footprint in 4 KiB units, in a field of the slot's word:
/// the largest footprint it takes fills that field, and a footprint within the next unit
/// (here 64 bytes short of 32 GiB, freed by a pool whose dedicated-chunk threshold is
/// higher) goes back to its engine instead of spilling into the word's other fields.
#[test]
fn shape_slots_take_footprints_up_to_their_last_unit_and_no_further() {
    use ascend_pool::region::Region;
    use ascend_pool::source::sim::SimConfig;
    const GIB: u64 = 1 << 30;
    // Lazily mapped: the test touches none of these bytes.
    let sim = SimSource::new(SimConfig::default().with_device_capacity(80 * GIB)).unwrap();
    let config = PoolConfig {
        large_threshold: 64 * GIB,
        release_threshold: 64 * GIB,
        ..PoolConfig::default()
    };
    let pool = Pool::new(Arc::new(sim), config).unwrap();
    let cached = |pool: &Pool| pool.stats(MemKind::DEVICE).cached_regions;
    // Footprint 2^35 - 4096, the slots' largest: kept in a slot, and taken back from it.
    let largest = (1 << 35) - 4128;
    let r = pool.alloc_device(largest).unwrap();
    let addr = r.addr();
    drop(r);
    assert_eq!(cached(&pool), 1, "the largest footprint a slot takes");
    let again = pool.alloc_device(largest).unwrap();
    assert_eq!((again.addr(), cached(&pool)), (addr, 0));
    drop(again);
    pool.validate().unwrap();
    pool.trim();
    // Footprint 2^35 - 64: one unit more than a slot's word can count.
    let r = pool.alloc_device((1 << 35) - 100).unwrap();
    drop(r);
    assert_eq!(cached(&pool), 0, "past the slots' last unit");
    pool.validate().unwrap();
    let st = pool.stats(MemKind::DEVICE);
    assert_eq!((st.live_regions, st.allocated_bytes), (0, 0));
}

/// A kind trimmed down to no chunks was still used: the snapshot keeps listing it, with its
/// counters, and lists no kind the pool never touched.
#[test]
fn a_kind_trimmed_to_no_chunks_stays_in_the_snapshot() {
    let pool = pool();
    drop(pool.alloc_host(4096).unwrap());
    let _dvpp = pool.alloc_dvpp(FRAME).unwrap();
    assert!(pool.trim() > 0, "the host chunk goes back to the source");
    assert_eq!(pool.stats(MemKind::Host).chunks, 0);
    let snap = pool.snapshot();
    let kinds: Vec<MemKind> = snap.kinds.iter().map(|k| k.stats.kind).collect();
    assert_eq!(kinds.len(), 2, "host and DVPP, nothing else: {kinds:?}");
    let host = snap
        .kinds
        .iter()
        .find(|k| k.stats.kind == MemKind::Host)
        .expect("the trimmed kind is listed");
    assert!(host.chunks.is_empty());
    assert_eq!((host.stats.allocations, host.stats.frees), (1, 1));
    pool.validate().unwrap();
}

/// Empty chunks go back to the source once their bytes pass the release threshold, and not
/// before: at exactly the threshold the chunk is kept for the next request.
#[test]
fn an_empty_chunk_goes_back_only_past_the_release_threshold() {
    let with_threshold = |t: u64| {
        let config = PoolConfig {
            thread_cache: 0,
            release_threshold: t,
            ..PoolConfig::default()
        };
        Pool::new(Arc::new(SimSource::default()), config).unwrap()
    };
    let chunk = {
        let probe = with_threshold(u64::MAX);
        let _r = probe.alloc_host(4096).unwrap();
        probe.stats(MemKind::Host).reserved_bytes
    };
    for (threshold, kept) in [(chunk, true), (chunk - 1, false)] {
        let pool = with_threshold(threshold);
        drop(pool.alloc_host(4096).unwrap());
        let st = pool.stats(MemKind::Host);
        let expected = if kept { (1, chunk, 0) } else { (0, 0, 1) };
        assert_eq!(
            (st.chunks, st.reserved_bytes, st.source_free_calls),
            expected,
            "threshold {threshold}, chunk {chunk}"
        );
        pool.validate().unwrap();
    }
}

/// A request the device cannot hold is refused as out of memory, and the runtime is asked
/// once per size the pool tries on each of its three passes (trim, flush, wait), never
/// twice for the same size in one pass.
#[test]
fn a_request_past_the_device_asks_the_runtime_once_per_pass() {
    let sim = SimSource::new(SimConfig::default().with_device_capacity(64 * MIB));
    let sim = Arc::new(sim.unwrap());
    let pool = Pool::new(Arc::clone(&sim) as _, PoolConfig::default()).unwrap();
    let mallocs = || sim.stats().calls(AclFunc::Malloc);
    for len in [100 * MIB, 40 * MIB] {
        let _held = (len < 64 * MIB).then(|| pool.alloc_device(40 * MIB).unwrap());
        let before = mallocs();
        let err = pool.alloc_device(len).unwrap_err();
        assert!(
            matches!(err, ascend_pool::Error::OutOfMemory { .. }),
            "{err:?}"
        );
        assert_eq!(mallocs() - before, 3, "{len} bytes: one call per pass");
    }
    let st = pool.stats(MemKind::DEVICE);
    assert_eq!((st.live_regions, st.ooms), (0, 2));
    pool.validate().unwrap();
}

/// A kind one chunk short of its limit takes a chunk of just the request when extending
/// the last chunk would pass the limit (the plain simulator extends nothing): the limit is
/// filled, not refused one chunk early.
#[test]
fn a_request_that_lands_exactly_on_the_limit_is_served() {
    let pool = Pool::new(
        Arc::new(SimSource::default()),
        PoolConfig::default()
            .with_limit(4 * MIB)
            .with_thread_cache(0),
    )
    .unwrap();
    // A footprint of exactly one 2 MiB granule, twice.
    let a = pool.alloc_device(2 * MIB - 64).unwrap();
    let b = pool.alloc_device(2 * MIB - 64).unwrap();
    let st = pool.stats(MemKind::DEVICE);
    assert_eq!(
        (st.reserved_bytes, st.chunks, st.ooms),
        (4 * MIB, 2, 0),
        "{st:?}"
    );
    assert!(matches!(
        pool.alloc_device(64),
        Err(ascend_pool::Error::LimitExceeded { .. })
    ));
    drop((a, b));
    pool.validate().unwrap();
}

/// A dedicated chunk that empties goes back at once, but the ordinary empty chunks the
/// kind keeps under its release threshold stay: freeing a large region does not make the
/// small ones ask the source again.
#[test]
fn freeing_a_dedicated_region_keeps_the_empty_chunks_under_the_threshold() {
    let pool = pool();
    let small = pool.alloc_device(MIB).unwrap();
    let kept = pool.stats(MemKind::DEVICE).reserved_bytes;
    let large = pool.alloc_device(100 * MIB).unwrap(); // past large_threshold: its own chunk
    assert_eq!(pool.stats(MemKind::DEVICE).chunks, 2);
    drop(small); // an empty ordinary chunk, far under the 128 MiB threshold
    drop(large);
    let st = pool.stats(MemKind::DEVICE);
    assert_eq!(
        (st.chunks, st.reserved_bytes, st.source_free_calls),
        (1, kept, 1),
        "{st:?}"
    );
    // The kept chunk serves the next small request without the source.
    let again = pool.alloc_device(MIB).unwrap();
    assert_eq!(pool.stats(MemKind::DEVICE).source_alloc_calls, 2);
    drop(again);
    pool.validate().unwrap();
}

/// A snapshot's segment offsets are from their chunk's address, also in a chunk whose
/// engine starts past its block's first address to meet a large alignment: chunk address
/// plus offset is the segment's address (the pool-state picture draws from that).
#[test]
fn snapshot_offsets_count_from_the_chunks_address_in_over_aligned_chunks() {
    let pool = pool();
    let mut keep = Vec::new();
    for align in [4 * MIB, 16 * MIB, 64 * MIB] {
        keep.push(pool.alloc_device_aligned(70 * MIB, align).unwrap());
        keep.push(pool.alloc_device_aligned(MIB, align).unwrap());
    }
    let snap = pool.snapshot();
    let mut skipped = 0;
    for c in snap.kinds.iter().flat_map(|k| &k.chunks) {
        for s in &c.segments {
            assert_eq!(
                s.addr,
                c.addr + s.offset as usize,
                "chunk {:#x}: {s:?}",
                c.addr
            );
            assert!(
                s.offset + s.footprint <= c.size,
                "chunk {:#x}: {s:?}",
                c.addr
            );
        }
        skipped += usize::from(c.segments.iter().all(|s| s.offset > 0));
    }
    assert!(skipped > 0, "no chunk started past its block: {snap:#?}");
    drop(keep);
    pool.validate().unwrap();
}

/// A small segment goes in a slab page; a chunk with too little room left for a page, in a
/// kind that cannot grow, still serves the segment alone from its range.
#[test]
fn a_small_request_with_no_room_for_its_slab_page_is_served_before_the_kind_is_refused() {
    let pool = Pool::new(
        Arc::new(SimSource::default()),
        PoolConfig::default()
            .with_chunk_size(4 * MIB)
            .with_limit(2 * MIB)
            .with_thread_cache(0),
    )
    .unwrap();
    // 16 KiB left at the end of the one 2 MiB chunk: a 900-byte segment's page takes 30 KiB.
    let big = pool.alloc_device(2 * MIB - (16 << 10) - 64).unwrap();
    let small = pool.alloc_device(900).unwrap();
    let st = pool.stats(MemKind::DEVICE);
    assert_eq!((st.chunks, st.live_regions, st.ooms), (1, 2, 0), "{st:?}");
    // Then the chunk is full: the next is refused by the limit.
    assert!(matches!(
        pool.alloc_device(16 << 10),
        Err(ascend_pool::Error::LimitExceeded { .. })
    ));
    pool.validate().unwrap();
    drop((big, small));
    pool.validate().unwrap();
    assert_eq!(pool.stats(MemKind::DEVICE).live_regions, 0);
}

/// A kind the device has no room to grow takes back what the other device kinds hold idle:
/// their empty chunks (kept under a high release threshold), cached segments and frees
/// waiting for a stream. The source used to refuse the new chunk while the pool itself
/// held the device's memory, empty, in another kind.
#[test]
fn a_device_kind_short_of_memory_takes_back_what_other_kinds_hold_idle() {
    use ascend_pool::MallocPolicy;
    let sim =
        Arc::new(SimSource::new(SimConfig::default().with_device_capacity(16 * MIB)).unwrap());
    let config = PoolConfig::default()
        .with_chunk_size(2 * MIB)
        .with_release_threshold(1 << 40);
    let pool = Pool::new(sim.clone(), config).unwrap();
    let cached = MemKind::Cached(MallocPolicy::HugeFirst);
    let stream = pool.create_stream().unwrap();
    // Cached memory takes 10 MiB and frees it, 4 MiB of it behind a stream still busy.
    let a = pool.alloc_device_kind(cached, 6 * MIB).unwrap();
    let b = pool.alloc_device_kind(cached, 4 * MIB).unwrap();
    sim.enqueue_delay(stream.handle(), std::time::Duration::from_millis(50))
        .unwrap();
    b.record_stream(&stream).unwrap();
    drop((a, b));
    let held = pool.stats(cached);
    assert!(
        held.reserved_bytes >= 4 * MIB && held.pending_frees == 1,
        "{held:?}"
    );
    // 12 MiB for the default kind: the device has less left beside the cached chunk.
    let calls = sim.stats().calls(AclFunc::Malloc);
    let d = pool.alloc_device(12 * MIB);
    let d = d.unwrap_or_else(|e| panic!("{e:?} {:?} {:?}", pool.stats(cached), sim.stats()));
    assert!(sim.stats().calls(AclFunc::Malloc) > calls);
    assert_eq!(
        pool.stats(cached).reserved_bytes,
        0,
        "the idle cached chunks went back"
    );
    let s = pool.stats(MemKind::DEVICE);
    assert_eq!((s.live_regions, s.ooms), (1, 0), "{s:?}");
    // With nothing idle anywhere the refusal stands, counted once.
    let e = pool.alloc_device(12 * MIB);
    assert!(
        matches!(
            e,
            Err(ascend_pool::Error::OutOfMemory {
                source: Some(_),
                ..
            })
        ),
        "{e:?}"
    );
    assert_eq!(pool.stats(MemKind::DEVICE).ooms, 1);
    drop(d);
    pool.validate().unwrap();
}

/// A pool of `total` bytes over its device kinds, 8 MiB for each kind, no thread caches.
fn pool_with_total(total: u64) -> Pool {
    let config = PoolConfig::default()
        .with_limit(8 * MIB)
        .with_total_limit(total)
        .with_thread_cache(0);
    Pool::new(Arc::new(SimSource::default()), config).unwrap()
}

/// Device memory and DVPP share the device's memory: a total limit caps their sum though
/// each kind is under its own limit, says which limit it is and what the other kinds hold,
/// and leaves the pool as it was.
#[test]
fn a_total_limit_caps_two_device_kinds_together() {
    let pool = pool_with_total(4 * MIB);
    let dev = pool.alloc_device(MIB).unwrap();
    let dvpp = pool.alloc_dvpp(MIB).unwrap();
    let (d, v) = (pool.stats(MemKind::DEVICE), pool.stats(MemKind::Dvpp));
    assert_eq!((d.reserved_bytes, v.reserved_bytes), (2 * MIB, 2 * MIB));
    let before = (d, v);
    // A third granule for either kind passes the total, not the kind's own 8 MiB.
    let err = pool.alloc_device(3 * MIB / 2).unwrap_err();
    match &err {
        ascend_pool::Error::TotalLimitExceeded {
            kind,
            requested,
            limit,
            reserved,
            in_use,
            largest_free,
            elsewhere,
        } => {
            assert_eq!(*kind, MemKind::DEVICE);
            assert_eq!(
                (*requested, *limit, *reserved),
                (3 * MIB / 2, 4 * MIB, 4 * MIB)
            );
            assert_eq!(*in_use, d.allocated_bytes);
            assert!(
                *largest_free >= MIB - 64 && *largest_free < 3 * MIB / 2,
                "{err:?}"
            );
            assert!(elsewhere.contains(&(MemKind::Dvpp, 2 * MIB)), "{err:?}");
            assert!(!elsewhere.iter().any(|(k, _)| !k.is_device()), "{err:?}");
        }
        other => panic!("expected TotalLimitExceeded, got {other:?}"),
    }
    let m = err.to_string();
    assert!(m.contains("total limit 4194304"), "{m}");
    assert!(m.contains("DVPP") || m.contains("dvpp"), "{m}");
    // Nothing lost, nothing counted but the refusal.
    let (d2, v2) = (pool.stats(MemKind::DEVICE), pool.stats(MemKind::Dvpp));
    assert_eq!(
        (d2.reserved_bytes, d2.allocated_bytes, d2.live_regions),
        (
            before.0.reserved_bytes,
            before.0.allocated_bytes,
            before.0.live_regions
        )
    );
    assert_eq!(v2, before.1);
    pool.validate().unwrap();
    assert!(matches!(
        pool.alloc_dvpp(3 * MIB / 2),
        Err(ascend_pool::Error::TotalLimitExceeded {
            kind: MemKind::Dvpp,
            ..
        })
    ));
    // Pinned host memory is not the device's: the total does not count it.
    let host = pool.alloc_host(6 * MIB).unwrap();
    // Freeing DVPP and trimming gives its chunk back: the device kind has room again.
    drop(dvpp);
    pool.trim();
    assert_eq!(pool.stats(MemKind::Dvpp).reserved_bytes, 0);
    let more = pool.alloc_device(3 * MIB / 2).unwrap();
    assert_eq!(pool.stats(MemKind::DEVICE).reserved_bytes, 4 * MIB);
    drop((dev, more, host));
    pool.validate().unwrap();
}

/// `total_limit` in the configuration string, its builder, and the same floor as `limit`.
#[test]
fn the_total_limit_is_configured_as_the_kind_limit_is() {
    let c = PoolConfig::parse("total_limit:6g,limit:4g").unwrap();
    assert_eq!((c.total_limit, c.limit), (6 << 30, 4 << 30));
    assert_eq!(PoolConfig::parse("total_limit:0").unwrap().total_limit, 0);
    assert_eq!(PoolConfig::default().total_limit, 0);
    assert_eq!(
        PoolConfig::default().with_total_limit(2 * MIB).total_limit,
        2 * MIB
    );
    for bad in ["total_limit:1m", "total_limit:lots", "total_limit:2097151"] {
        assert!(
            matches!(PoolConfig::parse(bad), Err(ascend_pool::Error::Config(m)) if m.contains("total_limit")),
            "{bad} was accepted"
        );
    }
    assert!(PoolConfig::default()
        .with_total_limit(MIB)
        .validate()
        .is_err());
}

/// With no total limit, two kinds take what they need side by side.
#[test]
fn without_a_total_limit_the_kinds_grow_apart() {
    let pool = pool_with_total(0);
    let held: Vec<_> = (0..3)
        .map(|_| pool.alloc_device(3 * MIB / 2).unwrap())
        .collect();
    let dvpp: Vec<_> = (0..3)
        .map(|_| pool.alloc_dvpp(3 * MIB / 2).unwrap())
        .collect();
    assert!(
        pool.stats(MemKind::DEVICE).reserved_bytes + pool.stats(MemKind::Dvpp).reserved_bytes
            > 8 * MIB
    );
    drop((held, dvpp));
}

/// A request refused by the total limit first takes back what the other device kinds hold
/// idle (an emptied DVPP chunk, kept under the release threshold), as one short of memory
/// from the source does, and only then fails; the figures of a refusal that stands are
/// those after the retry.
#[test]
fn a_total_limit_refusal_takes_back_what_other_device_kinds_hold_idle() {
    let pool = pool_with_total(4 * MIB);
    let dev = pool.alloc_device(MIB).unwrap();
    let dvpp = pool.alloc_dvpp(MIB).unwrap();
    drop(dvpp);
    // The emptied chunk stays: 128 MiB may stay cached.
    assert_eq!(pool.stats(MemKind::Dvpp).reserved_bytes, 2 * MIB);
    let more = pool.alloc_device(3 * MIB / 2).unwrap();
    assert_eq!(pool.stats(MemKind::Dvpp).reserved_bytes, 0);
    assert_eq!(pool.stats(MemKind::DEVICE).reserved_bytes, 4 * MIB);
    assert_eq!(
        pool.stats(MemKind::DEVICE).ooms,
        0,
        "the refusal did not stand"
    );
    drop(more);
    pool.trim();

    // Live DVPP memory beside an idle chunk: the idle one goes back, the request still
    // passes the total, and the error says what is held after the retry.
    let pool = pool_with_total(6 * MIB);
    let _dev = pool.alloc_device(MIB).unwrap();
    let live = pool.alloc_dvpp(MIB).unwrap();
    let idle = pool.alloc_dvpp(3 * MIB / 2).unwrap();
    drop(idle);
    let held = pool.stats(MemKind::Dvpp).reserved_bytes;
    assert!(held > 2 * MIB, "an idle DVPP chunk beside the live one");
    let err = pool.alloc_device(3 * MIB).unwrap_err();
    let (d, v) = (pool.stats(MemKind::DEVICE), pool.stats(MemKind::Dvpp));
    assert!(v.reserved_bytes < held, "the idle DVPP chunk went back");
    match &err {
        ascend_pool::Error::TotalLimitExceeded {
            reserved,
            elsewhere,
            ..
        } => {
            assert_eq!(*reserved, d.reserved_bytes + v.reserved_bytes, "{err:?}");
            assert!(
                elsewhere.contains(&(MemKind::Dvpp, v.reserved_bytes)),
                "{err:?}"
            );
        }
        other => panic!("expected TotalLimitExceeded, got {other:?}"),
    }
    assert_eq!(d.ooms, 1, "one refusal counted");
    pool.validate().unwrap();
    drop((dev, live));
}

/// The device kinds' total, and the total limit when one is set, are read beside the
/// kinds' figures: `Pool::device_reserved_bytes` and the snapshot (and its JSON), which
/// leaves the limit out when there is none.
#[test]
fn the_device_total_and_the_total_limit_are_in_the_figures() {
    let pool = pool_with_total(6 * MIB);
    assert_eq!(pool.device_reserved_bytes(), 0);
    let dev = pool.alloc_device(MIB).unwrap();
    let dvpp = pool.alloc_dvpp(MIB).unwrap();
    let host = pool.alloc_host(MIB).unwrap();
    let sum = pool.stats(MemKind::DEVICE).reserved_bytes + pool.stats(MemKind::Dvpp).reserved_bytes;
    assert_eq!(
        pool.device_reserved_bytes(),
        sum,
        "pinned host memory not counted"
    );
    let snap = pool.snapshot();
    assert_eq!(
        (snap.device_reserved_bytes, snap.total_limit),
        (sum, Some(6 * MIB))
    );
    let json: serde_json::Value = serde_json::to_value(&snap).unwrap();
    assert_eq!(json["device_reserved_bytes"], sum);
    assert_eq!(json["total_limit"], 6 * MIB);
    drop((dev, dvpp, host));
    pool.trim();
    assert_eq!(pool.device_reserved_bytes(), 0);

    let pool = pool_with_total(0);
    let dev = pool.alloc_device(MIB).unwrap();
    let snap = pool.snapshot();
    assert_eq!(snap.total_limit, None);
    assert_eq!(
        snap.device_reserved_bytes,
        pool.stats(MemKind::DEVICE).reserved_bytes
    );
    let json: serde_json::Value = serde_json::to_value(&snap).unwrap();
    assert!(json.get("total_limit").is_none(), "{json}");
    drop(dev);
}

/// Two threads on two device kinds allocate and free near the total limit at once, each
/// trimming and validating now and then (so growth, refusals, the release of the other
/// kind's idle memory, the release threshold and trim all race): the total never passes
/// the limit, no thread waits for ever, and afterwards nothing leaked and the total is the
/// sum of the kinds' reserved bytes.
#[test]
fn two_device_kinds_racing_near_the_total_keep_it_exact() {
    use std::sync::mpsc;
    use std::time::Duration;
    const TOTAL: u64 = 8 * MIB;
    let config = PoolConfig::default()
        .with_total_limit(TOTAL)
        .with_release_threshold(2 * MIB);
    let pool = Arc::new(Pool::new(Arc::new(SimSource::default()), config).unwrap());
    let (done, finished) = mpsc::channel();
    for dvpp in [false, true] {
        let (pool, done) = (Arc::clone(&pool), done.clone());
        std::thread::spawn(move || {
            let mut held = std::collections::VecDeque::new();
            for i in 0..400u64 {
                let len = (i * 7 + u64::from(dvpp) * 3) % 5 * (MIB / 2) + 4096;
                let got = if dvpp {
                    pool.alloc_dvpp(len)
                        .map(|r| Box::new(r) as Box<dyn std::any::Any + Send>)
                } else {
                    pool.alloc_device(len)
                        .map(|r| Box::new(r) as Box<dyn std::any::Any + Send>)
                };
                match got {
                    Ok(r) => held.push_back(r),
                    Err(ascend_pool::Error::TotalLimitExceeded { .. }) => {
                        held.pop_front();
                    }
                    Err(e) => panic!("unexpected refusal: {e}"),
                }
                assert!(pool.device_reserved_bytes() <= TOTAL);
                if held.len() > 3 {
                    held.pop_front();
                }
                if i % 64 == 63 {
                    if dvpp {
                        pool.trim();
                    } else {
                        pool.validate().unwrap();
                    }
                }
            }
            drop(held);
            done.send(()).unwrap();
        });
    }
    for _ in 0..2 {
        finished
            .recv_timeout(Duration::from_secs(120))
            .expect("a thread finished (or panicked, dropping its sender)");
    }
    pool.validate().unwrap();
    assert!(pool.leak_report().is_empty());
    let sum = pool.stats(MemKind::DEVICE).reserved_bytes + pool.stats(MemKind::Dvpp).reserved_bytes;
    assert_eq!(pool.device_reserved_bytes(), sum);
    pool.trim();
    assert_eq!(pool.device_reserved_bytes(), 0);
    pool.validate().unwrap();
}

/// A chunk whose one block that holds a request lies past the few entries of its size
/// class the engines' good-fit search looks at still serves it: the kind does not take a
/// new chunk from the source while one it holds has room. It did: the pool asked each
/// chunk with the good-fit search only, and grew.
#[test]
fn a_block_past_the_good_fit_probes_serves_before_the_kind_grows() {
    use ascend_pool::Region;
    let mut config = PoolConfig {
        thread_cache: 0,
        ..PoolConfig::default()
    };
    // The 2 KiB separators go on the range tier, between the blocks.
    config.engine.slab_max = 1024;
    let pool = Pool::new(Arc::new(SimSource::default()), config).unwrap();
    // A footprint under the default rule is the length plus 64 bytes, for these lengths.
    let host = |footprint: u64| pool.alloc_host(footprint - 64).unwrap();
    let (mut blocks, mut kept) = (Vec::new(), Vec::new());
    // One block of 8,640 bytes (135 units of 64), then eight of 8,448 (132) in the same
    // size class, [132, 136) units. Freed, each length waits in a list of its own until the
    // next search merges them in turn (the lists' order is a hash of the length, 135's
    // first), so the one block that holds 8,512 bytes (133) ends up ninth in its class.
    for footprint in [8640].into_iter().chain([8448; 8]) {
        blocks.push(host(footprint));
        kept.push(host(2048));
    }
    let s = pool.stats(MemKind::Host);
    assert_eq!(s.chunks, 1, "{s:?}");
    kept.push(host(s.reserved_bytes - s.allocated_bytes));
    let s = pool.stats(MemKind::Host);
    assert_eq!(s.allocated_bytes, s.reserved_bytes, "the chunk is full");
    let fitting = blocks[0].addr();
    drop(blocks);
    let calls = pool.source_alloc_calls(MemKind::Host);
    let r = host(8512);
    assert_eq!(r.addr(), fitting);
    assert_eq!(pool.source_alloc_calls(MemKind::Host), calls);
    assert_eq!(pool.stats(MemKind::Host).chunks, 1);
    pool.validate().unwrap();
}

/// Past the release threshold, a free gives back empty chunks until at most the threshold's
/// bytes of them stay: one chunk of exactly the threshold is kept, the first one, and the
/// rest go back.
#[test]
fn a_trim_past_the_threshold_keeps_an_empty_chunk_of_exactly_the_threshold() {
    // The first chunk's size, from a pool that keeps everything.
    let first = {
        let probe = Pool::new(
            Arc::new(SimSource::default()),
            PoolConfig::default().with_thread_cache(0),
        )
        .unwrap();
        let _r = probe.alloc_host(4096).unwrap();
        probe.stats(MemKind::Host).reserved_bytes
    };
    let config = PoolConfig {
        thread_cache: 0,
        release_threshold: first,
        ..PoolConfig::default()
    };
    let pool = Pool::new(Arc::new(SimSource::default()), config).unwrap();
    let a = pool.alloc_host(4096).unwrap();
    // Too big for what the first chunk has left: a second chunk.
    let b = pool.alloc_host(first - 64).unwrap();
    let st = pool.stats(MemKind::Host);
    assert_eq!(st.chunks, 2, "{st:?}");
    let second = st.reserved_bytes - first;
    // Empty at exactly the threshold: kept.
    drop(a);
    assert_eq!(pool.stats(MemKind::Host).chunks, 2);
    // Both empty, past the threshold: the second goes back, the first (the threshold's
    // bytes, no more) stays.
    drop(b);
    let st = pool.stats(MemKind::Host);
    assert_eq!(
        (st.chunks, st.reserved_bytes, st.source_free_calls),
        (1, first, 1),
        "second chunk of {second} bytes: {st:?}"
    );
    pool.validate().unwrap();
}

/// The growth size is picked within a quarter either side of the balanced target, the lower
/// side included: a kind of 4 MiB, full, whose balance is 8 MiB, takes a 6 MiB chunk for a
/// request of 3 MiB (two of it tile 6 MiB exactly; 8 and 10 MiB leave bytes over).
#[test]
fn growth_takes_the_best_tiling_size_below_the_target_too() {
    let pool = pool();
    // One full chunk of 4 MiB: the first chunk is just the request.
    let _full = pool.alloc_host(4 * MIB - 64).unwrap();
    let st = pool.stats(MemKind::Host);
    assert_eq!((st.reserved_bytes, st.allocated_bytes), (4 * MIB, 4 * MIB));
    // sqrt(8 x 2 MiB x 4 MiB) = 8 MiB of headroom, none free: the target is 8 MiB, and
    // 6 MiB (a quarter below) tiles 3 MiB footprints best.
    let _three = pool.alloc_host(3 * MIB - 64).unwrap();
    let st = pool.stats(MemKind::Host);
    assert_eq!((st.chunks, st.reserved_bytes), (2, 10 * MIB), "{st:?}");
    pool.validate().unwrap();
}
