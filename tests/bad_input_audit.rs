//! Bad input the earlier audits missed: one test per defect, each failing before its fix.

use ascend_pool::engine::{CarveEngine, EngineConfig, EngineError};
use ascend_pool::share::{Access, ShareDescriptor, SharedMapping, SharedPiece};
use ascend_pool::source::sim::{SimConfig, SimSource, StreamHold};
use ascend_pool::source::vmm::{VmmConfig, VmmRuntime, VmmSource};
use ascend_pool::source::{Block, BlockSource, MemcpyKind};
use ascend_pool::trace::{RejectKind, Rejection, TraceConfig, TraceItem, TraceReader};
use ascend_pool::{region::Region, AclError, CarveRule, Error, MallocPolicy, MemKind, Pool};
use ascend_pool::{PoolConfig, Result};
use std::sync::Arc;
use std::time::Duration;

#[path = "common/empty.rs"]
mod common_empty;
use common_empty::assert_empty;

const MIB: u64 = 1 << 20;

fn sim(device_capacity: u64) -> Arc<SimSource> {
    Arc::new(SimSource::new(SimConfig::default().with_device_capacity(device_capacity)).unwrap())
}

/// Runs `act` while `hold` keeps its stream from running; releases it 50 ms later from
/// another thread (so an `act` that waits for the stream returns).
fn release_later_while(hold: StreamHold<'_>, act: impl FnOnce()) {
    std::thread::scope(|s| {
        s.spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            hold.release();
        });
        act();
    });
}

// Used to panic with "attempt to add with overflow" on the piece's end (wrap in release).
#[test]
fn share_descriptor_with_an_overflowing_piece_is_refused() {
    let g = 2 * MIB;
    let desc = ShareDescriptor {
        exporter: 1,
        base: 0x1000_0000,
        span: g,
        pieces: vec![
            SharedPiece {
                offset: 0,
                len: g,
                handle: 1,
            },
            SharedPiece {
                offset: u64::MAX - g + 1,
                len: 2 * g,
                handle: 2,
            },
        ],
        offset: 0,
        len: g,
        buffer: 0,
    };
    let sim = sim(256 * MIB);
    assert!(matches!(
        SharedMapping::open(Arc::clone(&sim), 0, &desc),
        Err(Error::Config(_))
    ));
    let st = sim.stats();
    assert_eq!((st.reservations, st.physical_handles), (0, 0));
}

// Used to hand the runtime's memcpy a range of reserved, unmapped addresses between two pieces
// (breaking its safety contract); the simulator refused it with aclrtMemcpy INVALID_PARAM.
#[test]
fn shared_mapping_refuses_copies_into_holes_between_pieces() {
    let sim = sim(256 * MIB);
    let vmm = Arc::new(VmmSource::new(Arc::clone(&sim), 0, VmmConfig::default()).unwrap());
    let pool = Pool::new(vmm.clone(), PoolConfig::default()).unwrap();
    // Two kinds grow side by side in the reservation, with free addresses between them.
    let mut a = pool.alloc_device(1000).unwrap();
    let b = pool
        .alloc_device_kind(MemKind::Cached(MallocPolicy::HugeFirst), 1000)
        .unwrap();
    pool.copy_from_host(&mut a, 0, b"first piece").unwrap();
    let desc = vmm.publish_all(&Access::AnyProcess).unwrap();
    assert_eq!(desc.pieces.len(), 2);
    let hole = desc.pieces[0].offset + desc.pieces[0].len;
    assert!(hole < desc.pieces[1].offset, "{desc:?}");

    let m = SharedMapping::open(Arc::clone(&sim), 0, &desc).unwrap();
    let mut buf = [0u8; 64];
    let refused = |r: Result<()>| matches!(r, Err(Error::OutOfBounds { .. }));
    assert!(refused(m.read(hole, &mut buf)));
    assert!(refused(m.write(hole, &buf)));
    // Straddling the end of the first piece into the hole.
    assert!(refused(m.read(hole - 8, &mut buf)));
    // Inside the pieces, copies still work.
    let mut got = [0u8; 11];
    m.read(0, &mut got).unwrap();
    assert_eq!(&got, b"first piece");
    m.read(desc.pieces[1].offset, &mut buf).unwrap();
    m.close().unwrap();
    drop((a, b));
    pool.validate().unwrap();
}

// Used to panic on `debug_assert!(align.is_power_of_two())` (and compute garbage in release).
#[test]
fn align_up_refuses_an_alignment_that_is_not_a_power_of_two() {
    use ascend_pool::align::align_up;
    assert_eq!(align_up(100, 0), None);
    assert_eq!(align_up(100, 3), None);
    assert_eq!(align_up(100, 96), None);
    assert_eq!(align_up(100, 64), Some(128));
    assert_eq!(align_up(0, 64), Some(0));
}

// Used to panic in `align_up` (debug) when the reservation was rounded to a 6 MiB granule.
#[test]
fn vmm_source_refuses_a_granule_that_is_not_a_power_of_two() {
    let sim = sim(256 * MIB);
    let config = VmmConfig::default().with_granule(6 * MIB);
    assert!(matches!(
        VmmSource::new(Arc::clone(&sim), 0, config),
        Err(Error::Config(_))
    ));
    assert_eq!(sim.stats().reservations, 0);
}

// Used to deserialize into a rule its constructor refuses (padding 7, alignment 3), whose
// `footprint` then panicked.
#[test]
fn carve_rule_deserialization_checks_the_rule() {
    for json in [
        r#"{"padding":7,"align":64}"#,
        r#"{"padding":32,"align":3}"#,
        r#"{"padding":32,"align":0}"#,
        r#"{"padding":32,"align":4294967296}"#,
    ] {
        assert!(
            serde_json::from_str::<CarveRule>(json).is_err(),
            "{json} accepted"
        );
    }
    let ok: CarveRule = serde_json::from_str(r#"{"padding":0,"align":128}"#).unwrap();
    assert_eq!(ok, CarveRule::new(0, 128).unwrap());
    let round = serde_json::to_string(&CarveRule::model_input()).unwrap();
    assert_eq!(
        serde_json::from_str::<CarveRule>(&round).unwrap(),
        CarveRule::model_input()
    );
}

// Used to pass validation; the first allocation above the slab limit (then 64 KiB) asked the range tier for
// a slab page of 0 bytes and panicked on its assertion.
#[test]
fn pool_config_refuses_slab_max_past_a_slab_page() {
    assert!(matches!(
        PoolConfig::parse("slab_max:1m"),
        Err(Error::Config(_))
    ));
    let config = PoolConfig::default().with_engine(EngineConfig {
        slab_max: 512 << 10,
        ..EngineConfig::default()
    });
    assert!(matches!(config.validate(), Err(Error::Config(_))));
    assert!(PoolConfig::parse("slab_max:256k").is_ok());
}

// Used to build the engine, which then panicked on its first slab allocation past 64 KiB (and
// aborted the process for a slab_max of 1 TiB: one size class per 64 bytes up to it).
#[test]
fn carve_engine_refuses_slab_max_past_a_slab_page() {
    let config = EngineConfig {
        slab_max: MIB,
        ..EngineConfig::default()
    };
    assert!(matches!(
        CarveEngine::new(8 * MIB, config),
        Err(EngineError::SlabMaxTooLarge { .. })
    ));
    let mut e = CarveEngine::new(
        8 * MIB,
        EngineConfig {
            slab_max: 64 << 10,
            ..EngineConfig::default()
        },
    )
    .unwrap();
    let a = e.alloc(60_000, CarveRule::default()).unwrap();
    e.free(a).unwrap();
    e.validate().unwrap();
}

// Used to write the host region while a copy queued earlier on a stream still had to read it
// (a data race with the stream's worker); the queued copy then read the new bytes.
#[test]
fn sync_copies_wait_for_work_queued_on_the_region() {
    let sim = sim(256 * MIB);
    let pool = Pool::new(sim.clone(), PoolConfig::default()).unwrap();
    let stream = pool.create_stream().unwrap();
    let mut host = pool.alloc_host(4096).unwrap();
    host.as_mut_slice().fill(1);
    let mut dev = pool.alloc_device(4096).unwrap();

    let hold = sim.hold_stream(stream.handle()).unwrap();
    pool.copy_async(&mut dev, 0, &host, 0, 4096, &stream)
        .unwrap();
    // Without the wait this write lands first and the held copy reads it.
    release_later_while(hold, || {
        pool.copy_from_host(&mut host, 0, &[2u8; 4096]).unwrap()
    });
    stream.synchronize().unwrap();
    let mut back = [0u8; 4096];
    pool.copy_to_host(&dev, 0, &mut back).unwrap();
    assert!(
        back.iter().all(|&b| b == 1),
        "the queued copy read later data"
    );

    // The same for a fill of a region a held stream still reads.
    let hold = sim.hold_stream(stream.handle()).unwrap();
    pool.copy_async(&mut host, 0, &dev, 0, 4096, &stream)
        .unwrap();
    release_later_while(hold, || pool.memset(&mut dev, 0, 9, 4096).unwrap());
    assert!(
        host.as_slice().iter().all(|&b| b == 1),
        "the queued copy read the fill"
    );
    drop((host, dev));
    pool.synchronize().unwrap();
    assert_empty(&pool);
}

// `aclrtFree` used to accept the data of a shared buffer (`acltdtAllocBuf`): the memory went
// away under the buffer's handles, and `acltdtFreeBuf` then failed with the handle gone.
#[test]
fn sim_free_block_refuses_the_memory_of_a_shared_buffer() {
    let sim = SimSource::default();
    let buf = sim.alloc_buf(0, 4096, 0).unwrap();
    let (addr, size) = sim.buf_data(buf).unwrap();
    let block = Block {
        addr,
        size,
        kind: MemKind::DEVICE,
        device: 0,
    };
    assert_eq!(
        sim.free_block(block),
        Err(Error::Runtime {
            func: "aclrtFree",
            code: AclError::RT_MEMORY_FREE
        })
    );
    // The buffer is intact: its data is still device memory, and it frees normally.
    let bytes = [7u8; 16];
    // SAFETY: the first 16 bytes of the buffer's live data area; `bytes` is 16 bytes.
    unsafe {
        sim.memcpy(
            addr,
            16,
            bytes.as_ptr() as usize,
            16,
            MemcpyKind::HostToDevice,
        )
        .unwrap();
    }
    sim.free_buf(buf).unwrap();
    assert_eq!(sim.stats().live_blocks, 0);
}

// Used to panic with "attempt to add with overflow" in the limit check of a new chunk
// (`reserved_bytes + size`), and to wrap past the limit in release.
#[test]
fn a_huge_request_under_a_limit_is_refused_without_overflow() {
    let pool = Pool::new(sim(64 * MIB), PoolConfig::default().with_limit(1 << 30)).unwrap();
    // Fills its 2 MiB chunk to the end, so growing that chunk in place cannot help.
    let full = pool.alloc_device(2 * MIB - 64).unwrap();
    // Footprint 2^64 - 2 MiB: a whole number of 2 MiB granules, and past any limit.
    let res = pool.alloc_device(u64::MAX - 2 * MIB - 31);
    assert!(
        matches!(res, Err(Error::LimitExceeded { .. })),
        "{:?}",
        res.map(|r| r.addr())
    );
    pool.validate().unwrap();
    drop(full);
    assert_empty(&pool);
}

// Used to keep the segment live for good: the free stopped at the error, the region had
// handed its pool handle over, and the memory never went back (a leaked live segment).
#[test]
fn a_padding_overrun_is_reported_and_the_segment_still_freed() {
    let pool = Pool::new(sim(64 * MIB), PoolConfig::default().with_debug(true)).unwrap();
    for len in [100, 1 << 20] {
        // 1 MiB is past the thread caches' largest footprint: the kind pool's free path.
        let d = pool.alloc_device(len).unwrap();
        let junk = [0x55u8; 8];
        let at = d.addr() + len.next_multiple_of(32) as usize + 2;
        // SAFETY: 8 bytes inside the segment's padding (32 bytes past its rounded length).
        unsafe {
            pool.source()
                .memcpy(at, 8, junk.as_ptr() as usize, 8, MemcpyKind::HostToDevice)
                .unwrap();
        }
        assert!(matches!(d.free(), Err(Error::Corruption { .. })));
    }
    // Room for fewer than there are takes none of them.
    assert_eq!(pool.take_corruption_reports_within(1), Err(2));
    assert_eq!(
        pool.take_corruption_reports_within(2).map(|r| r.len()),
        Ok(2)
    );
    assert!(pool.take_corruption_reports().is_empty());
    assert_empty(&pool);
}

// Used to panic with "attempt to add with overflow" on the live byte counts when the
// configured device size lets two huge allocations (2^63 bytes each) live at once, and to
// count live bytes whose sums over kinds overflow. A kind now counts at most its share of
// `u64::MAX`: past it an allocation is refused as too large.
#[test]
fn a_trace_of_huge_live_allocations_does_not_overflow_the_counts() {
    let huge = "{\"op\":\"alloc\",\"id\":1,\"size\":9223372036854775808,\"mem\":\"device\"}\n\
                {\"op\":\"alloc\",\"id\":2,\"size\":9223372036854775808,\"mem\":\"device\"}\n";
    let config = TraceConfig {
        device_size: u64::MAX,
        ..TraceConfig::default()
    };
    let mut r = TraceReader::new(huge.as_bytes(), config);
    for _ in 0..2 {
        assert!(matches!(
            r.next_item(),
            Some(Ok(TraceItem::Rejected(Rejection {
                kind: RejectKind::SizeTooLarge,
                ..
            })))
        ));
    }
    let trace = "{\"op\":\"alloc\",\"id\":1,\"size\":2305843009213693952,\"mem\":\"device\"}\n\
                 {\"op\":\"alloc\",\"id\":2,\"size\":2305843009213693952,\"mem\":\"device\"}\n\
                 {\"op\":\"free\",\"id\":1}\n\
                 {\"op\":\"free\",\"id\":2}\n";
    let config = TraceConfig {
        device_size: u64::MAX,
        ..TraceConfig::default()
    };
    let mut r = TraceReader::new(trace.as_bytes(), config);
    let items: Vec<TraceItem> = std::iter::from_fn(|| r.next_item())
        .map(|i| i.unwrap())
        .collect();
    // The second allocation cannot be counted: refused as too large, and its free unknown.
    assert!(matches!(items[0], TraceItem::Op(_)));
    assert!(matches!(
        items[1],
        TraceItem::Rejected(Rejection {
            kind: RejectKind::SizeTooLarge,
            ..
        })
    ));
    assert!(matches!(items[2], TraceItem::Op(_)));
    assert!(matches!(
        items[3],
        TraceItem::Rejected(Rejection {
            kind: RejectKind::UnknownId,
            ..
        })
    ));
    let device = r.kind_stats()[MemKind::DEVICE.index()];
    assert_eq!((device.live_requested, device.live_required), (0, 0));
    assert_eq!(device.peak_requested, 1 << 61);
}

// Used to answer `Ok` with a block of 0 bytes (nothing given back), which no allocation
// hands out; the block's size then disagreed with every other view of it.
#[test]
fn vmm_shrink_to_zero_bytes_is_refused() {
    let sim = sim(256 * MIB);
    let vmm = VmmSource::new(Arc::clone(&sim), 0, VmmConfig::default()).unwrap();
    let block = vmm.alloc_block(0, MemKind::DEVICE, 6 * MIB).unwrap();
    assert_eq!(
        vmm.shrink_block(block, 0),
        Err(Error::Runtime {
            func: "aclrtUnmapMem",
            code: AclError::INVALID_PARAM
        })
    );
    assert_eq!(vmm.stats().mapped_bytes, 6 * MIB);
    // One physical allocation backs the block: it stays whole, and so does the block (what
    // stays mapped is the holder's, counted in its size).
    let kept = vmm.shrink_block(block, 1).unwrap();
    assert_eq!((kept.addr, kept.size), (block.addr, 6 * MIB));
    vmm.validate().unwrap();
    vmm.free_block(kept).unwrap();
    assert_eq!(vmm.stats().mapped_bytes, 0);
}

// Used to panic with "attempt to subtract with overflow" (and add) on a snapshot whose
// segments were not made by a pool: a footprint below the length, an end past u64::MAX.
#[test]
fn pool_picture_of_a_hand_made_snapshot_does_not_panic() {
    use ascend_pool::engine::EngineStats;
    use ascend_pool::pool::{ChunkInfo, KindSnapshot, PoolSnapshot, SegmentInfo};
    let pool = Pool::new(sim(64 * MIB), PoolConfig::default()).unwrap();
    let stats = pool.stats(MemKind::DEVICE);
    let seg = |offset: u64, len: u64, footprint: u64| SegmentInfo {
        kind: MemKind::DEVICE,
        addr: 0x1000,
        offset,
        len,
        footprint,
        pending: false,
        cached: false,
    };
    let snap = PoolSnapshot {
        source: "hand-made".into(),
        device: 0,
        device_reserved_bytes: 0,
        total_limit: None,
        kinds: vec![KindSnapshot {
            stats,
            chunks: vec![ChunkInfo {
                addr: 0x1000,
                size: 2 * MIB,
                dedicated: false,
                engine: EngineStats::default(),
                segments: vec![seg(0, 100, 64), seg(u64::MAX - 10, u64::MAX, u64::MAX)],
            }],
        }],
    };
    let svg = ascend_pool::svg::pool_state(&snap, "hand-made");
    assert!(svg.ends_with("</svg>\n"));
}

// Used to hand a second free of a copied token (and any made-up token) to rlsf's
// `deallocate` from safe code: rlsf's debug assertion fired, release builds corrupted it.
// Tokens are now moved into `free` (a second free of one segment does not compile), and a
// token of another range, or of a range dropped before, is refused.
#[test]
fn rlsf_peer_refuses_tokens_of_other_ranges() {
    use ascend_pool::peers::RlsfRange;
    use ascend_pool::trace::RangeReplayer;
    let mut r = RlsfRange::new(MIB).unwrap();
    let mut other = RlsfRange::new(MIB).unwrap();
    let rule = CarveRule::default();
    let (_, first) = r.alloc(1000, rule).unwrap();
    let (_, second) = r.alloc(1000, rule).unwrap();
    let (_, elsewhere) = other.alloc(100, rule).unwrap();
    let (_, stale) = RlsfRange::new(MIB).unwrap().alloc(100, rule).unwrap();
    r.free(first);
    other.free(second); // a token of another range, at an offset `other` never carved
    r.free(elsewhere); // and one from there
    r.free(stale); // and one of a range dropped since
    assert_eq!(
        r.validate(),
        Err("2 frees were refused".to_string()),
        "refused frees are reported"
    );
    assert_eq!(other.validate(), Err("1 frees were refused".to_string()));
    // Both ranges are intact: new segments do not overlap the live ones.
    let (a, _) = r.alloc(1000, rule).unwrap();
    let (b, _) = r.alloc(1000, rule).unwrap();
    assert!(a.abs_diff(b) >= rule.footprint(1000).unwrap());
    let (c, _) = other.alloc(100, rule).unwrap();
    assert_ne!(c, 0, "other's first segment is still live at 0");
}

// The runtime does no asynchronous copy within the host (ACL_ERROR_RT_FEATURE_NOT_SUPPORT);
// two host regions used to reach aclrtMemcpyAsync as a host-to-host copy.
#[test]
fn an_async_copy_between_two_host_regions_is_the_wrong_kind() {
    let sim = sim(64 * MIB);
    let pool = Pool::new(sim.clone(), PoolConfig::default()).unwrap();
    let stream = pool.create_stream().unwrap();
    let mut a = pool.alloc_host(4096).unwrap();
    let mut b = pool.alloc_host(4096).unwrap();
    b.as_mut_slice().fill(9);
    let calls = sim
        .stats()
        .calls(ascend_pool::source::sim::AclFunc::MemcpyAsync);
    let e = pool
        .copy_async(&mut a, 0, &b, 0, 4096, &stream)
        .unwrap_err();
    assert!(
        matches!(
            e,
            Error::WrongKind {
                expected: "device",
                got: MemKind::Host
            }
        ),
        "{e:?}"
    );
    assert_eq!(
        sim.stats()
            .calls(ascend_pool::source::sim::AclFunc::MemcpyAsync),
        calls,
        "refused before the runtime"
    );
    // The synchronous copy is the way, and one device end makes the async one fine.
    pool.copy(&mut a, 0, &b, 0, 4096).unwrap();
    assert_eq!(a.as_slice(), &[9; 4096][..]);
    let mut d = pool.alloc_device(4096).unwrap();
    pool.copy_async(&mut d, 0, &b, 0, 4096, &stream).unwrap();
    pool.copy_async(&mut a, 0, &d, 0, 4096, &stream).unwrap();
    stream.synchronize().unwrap();
    // And the simulator refuses what the pool now keeps from it.
    // SAFETY: both blocks are live host memory of this simulator; the call is refused.
    let raw = unsafe {
        sim.memcpy_async(
            a.addr(),
            4096,
            b.addr(),
            4096,
            MemcpyKind::HostToHost,
            stream.handle(),
        )
    };
    assert!(
        matches!(raw, Err(Error::Runtime { func: "aclrtMemcpyAsync", code }) if code == AclError::RT_FEATURE_NOT_SUPPORT),
        "{raw:?}"
    );
    drop((a, b, d));
    drop(stream);
    assert_empty(&pool);
}

// Used to answer `Error::Invalid` ("invariant violated"), after asking the runtime for the
// block: a chunk past the engine's (2^32 - 1) * 64 bytes cannot be carved.
#[test]
fn a_request_past_what_the_engine_addresses_is_out_of_memory() {
    let sim = Arc::new(SimSource::new(SimConfig::default().with_host_capacity(1 << 40)).unwrap());
    let pool = Pool::new(
        Arc::clone(&sim) as Arc<dyn BlockSource>,
        PoolConfig::default(),
    )
    .unwrap();
    let err = pool.alloc_host(300 << 30).unwrap_err();
    assert!(matches!(err, Error::OutOfMemory { .. }), "{err:?}");
    let st = pool.stats(MemKind::Host);
    assert_eq!((st.ooms, st.source_alloc_calls), (1, 0), "{st:?}");
    assert_eq!(sim.stats().live_blocks, 0);
    pool.validate().unwrap();
}

// Used to answer `LimitExceeded` (`TotalLimitExceeded` under a total limit) naming a limit
// the request stayed well under: what refused it is the engine, which cannot address such a
// chunk, not the limit.
#[test]
fn a_request_past_what_the_engine_addresses_under_a_higher_limit_is_out_of_memory() {
    for conf in ["limit:1024g", "total_limit:1024g"] {
        let pool = Pool::new(sim(64 * MIB), PoolConfig::parse(conf).unwrap()).unwrap();
        let err = pool.alloc_device(300 << 30).unwrap_err();
        assert!(
            matches!(err, Error::OutOfMemory { requested, source: None, .. } if requested == 300 << 30),
            "{conf}: {err:?}"
        );
        // A request past the limit is refused by the limit, as before.
        let err = pool.alloc_device(2048 << 30).unwrap_err();
        let limit = err.shortage().and_then(|s| s.limit);
        assert_eq!(limit, Some(1024 << 30), "{conf}: {err:?}");
        let st = pool.stats(MemKind::DEVICE);
        assert_eq!((st.ooms, st.source_alloc_calls), (2, 0), "{conf}: {st:?}");
        pool.validate().unwrap();
    }
}

// Used to spin for ever holding the kind lock (a release build; an overflow panic in a
// debug one): with no dedicated chunks, a length rounding to a chunk of 2^64 - 2 MiB made
// the chunk-size search step past 2^64.
#[test]
fn a_huge_request_without_dedicated_chunks_returns() {
    let config =
        PoolConfig::parse("thread_cache:off,large_threshold:18446744073709551615").unwrap();
    let pool = Arc::new(Pool::new(sim(64 * MIB), config).unwrap());
    let (tx, rx) = std::sync::mpsc::channel();
    let p = Arc::clone(&pool);
    std::thread::spawn(move || {
        let _ = tx.send(p.alloc_device(u64::MAX - (4 << 20)).map(|_| ()));
    });
    match rx.recv_timeout(Duration::from_secs(60)) {
        Ok(r) => assert!(matches!(r, Err(Error::OutOfMemory { .. })), "{r:?}"),
        Err(_) => panic!("alloc_device(u64::MAX - 4 MiB) did not return within 60 s"),
    }
    pool.validate().unwrap();
}

// Used to count one allocation twice: in debug mode a thread-cache hit whose canary
// cannot be re-armed goes back, and the fresh carve that serves the caller counted again.
#[test]
fn a_cached_segment_that_cannot_be_rearmed_counts_one_allocation() {
    use ascend_pool::source::sim::{AclFunc, Fault};
    let sim = sim(512 * MIB);
    let pool = Pool::new(
        Arc::clone(&sim) as Arc<dyn BlockSource>,
        PoolConfig::parse("debug:1").unwrap(),
    )
    .unwrap();
    drop(pool.alloc_device(100).unwrap()); // into this thread's cache
    sim.inject_fault(Fault::next(AclFunc::Memset, AclError::RT_FAILURE, 1));
    let r = pool.alloc_device(100).unwrap(); // the hit's re-arm fails: a fresh carve
    pool.validate().unwrap();
    let st = pool.stats(MemKind::DEVICE);
    assert_eq!(
        (st.allocations, st.frees, st.live_regions),
        (2, 1, 1),
        "{st:?}"
    );
    drop(r);
}

// Used to queue device 1's memory on a device-0 stream: `copy_async` and `memset_async`
// checked the stream's device but not the regions', which `record_stream` refuses (the free
// could not fence the stream: events live on one device).
#[test]
fn async_work_on_a_region_of_another_device_is_refused() {
    let sim = Arc::new(SimSource::new(SimConfig::default().with_devices(2)).unwrap());
    let p0 = Pool::new(
        Arc::clone(&sim) as Arc<dyn BlockSource>,
        PoolConfig::default(),
    )
    .unwrap();
    let p1 = Pool::new(
        Arc::clone(&sim) as Arc<dyn BlockSource>,
        PoolConfig {
            device: 1,
            ..PoolConfig::default()
        },
    )
    .unwrap();
    let s0 = p0.create_stream().unwrap();
    let mut a = p0.alloc_device(4096).unwrap();
    let mut b = p1.alloc_device(4096).unwrap();
    assert!(matches!(b.record_stream(&s0), Err(Error::ForeignHandle)));
    for r in [
        p0.copy_async(&mut a, 0, &b, 0, 4096, &s0),
        p0.copy_async(&mut b, 0, &a, 0, 4096, &s0),
        p0.memset_async(&mut b, 0, 7, 4096, &s0),
    ] {
        assert!(matches!(r, Err(Error::ForeignHandle)), "{r:?}");
    }
    // Nothing was queued or noted: both frees complete at once.
    drop((a, b));
    for p in [&p0, &p1] {
        assert_eq!(p.stats(MemKind::DEVICE).pending_frees, 0);
        p.validate().unwrap();
    }
    assert_eq!(
        sim.stats()
            .calls(ascend_pool::source::sim::AclFunc::MemcpyAsync),
        0
    );
}

// A refused publish used to export what it overlapped first, with its access: a range that
// ran past a hole (or past the address space) left the memory exported to any process, and
// the region's own publish to named processes was then refused as ShareAccessFixed.
#[test]
#[cfg_attr(
    miri,
    ignore = "virtual memory reserves addresses with PROT_NONE, which Miri refuses"
)]
fn a_refused_publish_exports_nothing() {
    let (sim, vmm, pool) = vmm_pool();
    // Two kinds grow side by side in the reservation, with free addresses between them.
    let a = pool.alloc_device(1000).unwrap();
    let b = pool
        .alloc_device_kind(MemKind::Cached(MallocPolicy::HugeFirst), 1000)
        .unwrap();
    let all = (b.addr() + 1000 - a.addr()) as u64;
    for len in [all, u64::MAX] {
        assert!(matches!(
            vmm.publish_range(a.addr(), len, &Access::AnyProcess),
            Err(Error::ForeignHandle)
        ));
    }
    let me = sim.bare_tgid().unwrap();
    vmm.publish_region(&a, &Access::Processes(vec![me]))
        .unwrap();
    vmm.publish_region(&b, &Access::Processes(vec![me]))
        .unwrap();
    drop((a, b));
    pool.validate().unwrap();
}

// An empty whitelist used to export the memory with pid checks on and let no process in: the
// descriptor opened nowhere and the memory's access stayed fixed to whitelists (the C API
// already refused it).
#[test]
#[cfg_attr(
    miri,
    ignore = "virtual memory reserves addresses with PROT_NONE, which Miri refuses"
)]
fn a_publish_to_no_process_is_refused_and_exports_nothing() {
    let (_sim, vmm, pool) = vmm_pool();
    let a = pool.alloc_device(1000).unwrap();
    for r in [
        vmm.publish_region(&a, &Access::Processes(vec![])),
        vmm.publish_all(&Access::Processes(vec![])),
    ] {
        assert!(
            matches!(r, Err(Error::Config(ref m)) if m.contains("names no process")),
            "{r:?}"
        );
    }
    // Nothing was exported: the memory can still go to any process.
    vmm.publish_region(&a, &Access::AnyProcess).unwrap();
    drop(a);
    pool.validate().unwrap();
}

/// A pool over virtual memory of a 256 MiB simulated device, with its source and simulator.
fn vmm_pool() -> (Arc<SimSource>, Arc<VmmSource<SimSource>>, Pool) {
    let sim = sim(256 * MIB);
    let vmm = Arc::new(VmmSource::new(Arc::clone(&sim), 0, VmmConfig::default()).unwrap());
    let pool = Pool::new(vmm.clone(), PoolConfig::default()).unwrap();
    (sim, vmm, pool)
}

// Said "range 0..0+0 is out of bounds of 4096 bytes": a copy of nothing, well inside the
// region, read as a range past its end, and the message did not say what to change.
#[test]
fn a_copy_or_fill_of_zero_bytes_says_it_is_empty() {
    let pool = Pool::new(sim(256 * MIB), PoolConfig::default()).unwrap();
    let stream = pool.create_stream().unwrap();
    let (mut a, b) = (
        pool.alloc_device(4096).unwrap(),
        pool.alloc_device(4096).unwrap(),
    );
    let mut host = [0u8; 0];
    for r in [
        pool.copy(&mut a, 0, &b, 0, 0),
        pool.copy_async(&mut a, 0, &b, 0, 0, &stream),
        pool.memset(&mut a, 64, 1, 0),
        pool.copy_from_host(&mut a, 0, &[]),
        pool.copy_to_host(&b, 0, &mut host),
    ] {
        let e = r.unwrap_err();
        assert!(matches!(e, Error::OutOfBounds { len: 0, .. }), "{e:?}");
        let m = e.to_string();
        assert!(m.contains("0 bytes") && !m.contains("out of bounds"), "{m}");
    }
    // A range that does pass the end still says so.
    let m = pool.copy(&mut a, 64, &b, 0, 4096).unwrap_err().to_string();
    assert!(m.contains("out of bounds"), "{m}");
    drop((a, b));
    pool.validate().unwrap();
}

// A limit below one 2 MiB chunk was taken, and then every allocation of the kind failed
// with "device pool limit 1048576 bytes would be passed: requested 64, reserved 0".
#[test]
fn a_limit_below_one_chunk_granule_is_refused_when_the_pool_is_made() {
    for limit in [MIB, 2 * MIB - 1] {
        let made = Pool::new(sim(256 * MIB), PoolConfig::default().with_limit(limit));
        let parsed = PoolConfig::parse(&format!("limit:{limit}"));
        for e in [made.map(|_| ()).unwrap_err(), parsed.unwrap_err()] {
            assert!(
                matches!(e, Error::Config(ref m) if m.contains("limit") && m.contains("2 MiB")),
                "{limit}: {e:?}"
            );
        }
    }
    // One granule is enough for a small request.
    let pool = Pool::new(sim(256 * MIB), PoolConfig::parse("limit:2m").unwrap()).unwrap();
    drop(pool.alloc_device(64).unwrap());
}

// Was Error::Carve(BadPadding): a configuration the pool refuses is an Error::Config, as
// PoolConfig::from_env and Error::Config say, whichever key is wrong.
#[test]
fn a_padding_the_carve_rule_refuses_is_a_configuration_error() {
    let made = Pool::new(sim(256 * MIB), PoolConfig::default().with_padding(16));
    for e in [
        PoolConfig::parse("padding:16").unwrap_err(),
        made.map(|_| ()).unwrap_err(),
    ] {
        assert!(
            matches!(e, Error::Config(ref m) if m.contains("padding 16")),
            "{e:?}"
        );
    }
}

// A pool of a device the simulator lacks was made, and then every allocation and stream
// failed with ACL_ERROR_RT_PARAM_INVALID: the simulator knows how many devices it has.
#[test]
fn a_pool_of_a_device_the_source_lacks_is_refused_when_made() {
    let two = || Arc::new(SimSource::new(SimConfig::default().with_devices(2)).unwrap());
    for device in [2, 5] {
        let made = Pool::new(two(), PoolConfig::default().with_device(device));
        let e = made.map(|_| ()).unwrap_err();
        assert!(
            matches!(e, Error::Config(ref m) if m.contains(&format!("device {device} is not one of the 2 devices"))),
            "{device}: {e:?}"
        );
    }
    let pool = Pool::new(two(), PoolConfig::default().with_device(1)).unwrap();
    drop(pool.alloc_device(64).unwrap());
    drop(pool.create_stream().unwrap());
}

// Used to read "device pool limit 4194304 bytes would be passed: requested 1048576,
// reserved 4194304": nothing said that half the reserved bytes were free, in ranges too
// small for the request, so raising the limit looked like the only way out.
#[test]
fn a_limit_refusal_says_what_is_free_but_too_fragmented() {
    let config = PoolConfig::default()
        .with_chunk_size(4 * MIB)
        .with_limit(4 * MIB);
    let pool = Pool::new(sim(256 * MIB), config).unwrap();
    let mut held = Vec::new();
    while let Ok(r) = pool.alloc_device(256 << 10) {
        held.push(r);
        assert!(held.len() < 64);
    }
    // Every other region goes back: half the bytes are free, none next to another.
    let kept: Vec<_> = held
        .into_iter()
        .enumerate()
        .filter_map(|(i, r)| (i % 2 == 0).then_some(r))
        .collect();
    let err = pool.alloc_device(MIB).unwrap_err();
    let s = pool.stats(MemKind::DEVICE);
    match &err {
        Error::LimitExceeded {
            requested,
            limit,
            reserved,
            in_use,
            largest_free,
            ..
        } => {
            assert_eq!(
                (*requested, *limit, *reserved),
                (MIB, 4 * MIB, s.reserved_bytes)
            );
            assert_eq!(*in_use, s.allocated_bytes);
            assert!(*largest_free < MIB && *largest_free >= 256 << 10, "{err:?}");
            assert!(reserved - in_use >= MIB, "{err:?}");
        }
        other => panic!("expected LimitExceeded, got {other:?}"),
    }
    let m = err.to_string();
    let free = s.reserved_bytes - s.allocated_bytes;
    assert!(
        m.contains(&format!("in use {}", s.allocated_bytes))
            && m.contains(&format!("{free} bytes are free"))
            && m.contains("fragmented"),
        "{m}"
    );
    drop(kept);
    pool.validate().unwrap();
    assert_empty(&pool);
}

// Used to read "out of dvpp memory: requested 33554432 bytes, reserved 0, in use 0, largest
// free range 0": DVPP memory is the device's, and the device kind held it, unsaid.
#[test]
fn an_out_of_memory_says_what_the_device_s_other_kinds_hold() {
    let pool = Pool::new(sim(64 * MIB), PoolConfig::default()).unwrap();
    let hbm = pool.alloc_device(40 * MIB).unwrap();
    let held = pool.stats(MemKind::DEVICE).reserved_bytes;
    let err = pool.alloc_dvpp(32 * MIB).unwrap_err();
    match &err {
        Error::OutOfMemory {
            kind: MemKind::Dvpp,
            reserved: 0,
            source: Some(_),
            elsewhere,
            ..
        } => {
            // Every other kind over the device's memory, the host's not among them.
            let kinds: Vec<MemKind> = elsewhere.iter().map(|&(k, _)| k).collect();
            assert_eq!(
                kinds,
                [
                    MemKind::DEVICE,
                    MemKind::DeviceAlign32(MallocPolicy::HugeFirst),
                    MemKind::Cached(MallocPolicy::HugeFirst)
                ]
            );
            assert_eq!(elsewhere[0].1, held);
            assert!(elsewhere[1..].iter().all(|&(_, b)| b == 0), "{err:?}");
        }
        other => panic!("expected DVPP OutOfMemory, got {other:?}"),
    }
    let m = err.to_string();
    assert!(m.contains(&format!("device {held} bytes reserved")), "{m}");
    // With nothing held elsewhere it says that too: the memory is used outside the pool.
    drop(hbm);
    pool.trim();
    let config = SimConfig::default()
        .with_device_capacity(64 * MIB)
        .with_host_capacity(64 * MIB);
    let other = Pool::new(
        Arc::new(SimSource::new(config).unwrap()),
        PoolConfig::default(),
    )
    .unwrap();
    let m = other.alloc_dvpp(128 * MIB).unwrap_err().to_string();
    assert!(m.contains("no other kind of this pool holds any"), "{m}");
    // Host memory is the host kind's alone: nothing about the device.
    let e = other.alloc_host(128 * MIB).unwrap_err();
    assert!(
        matches!(&e, Error::OutOfMemory { source: Some(_), elsewhere, .. } if elsewhere.is_empty()),
        "{e:?}"
    );
    assert_empty(&pool);
}

// Used to read "address 0x10000000020 is not 64-byte aligned" for a copy given offset 32:
// an address the caller never passed, and no word of which end it belonged to. A range past
// either end did not say which either.
#[test]
fn a_refused_copy_says_which_end_is_at_fault() {
    use ascend_pool::error::CopySide::{Destination, Source};
    let pool = Pool::new(sim(256 * MIB), PoolConfig::default()).unwrap();
    let stream = pool.create_stream().unwrap();
    let (mut a, b) = (
        pool.alloc_device(4096).unwrap(),
        pool.alloc_device(4096).unwrap(),
    );
    for (r, side, text) in [
        (
            pool.copy_async(&mut a, 32, &b, 0, 64, &stream),
            Destination,
            "destination offset 32",
        ),
        (
            pool.copy_async(&mut a, 0, &b, 96, 64, &stream),
            Source,
            "source offset 96",
        ),
    ] {
        let e = r.unwrap_err();
        assert_eq!(
            e,
            Error::Misaligned {
                addr: text.rsplit(' ').next().unwrap().parse().unwrap(),
                required: 64,
                side: Some(side),
            }
        );
        let m = e.to_string();
        assert!(m.contains(text) && m.contains("64-byte"), "{m}");
    }
    let mut host = [0u8; 128];
    for (r, side, text) in [
        (
            pool.copy(&mut a, 4000, &b, 0, 128),
            Destination,
            "destination range 4000..4000+128",
        ),
        (
            pool.copy(&mut a, 0, &b, 4000, 128),
            Source,
            "source range 4000..4000+128",
        ),
        (
            pool.copy_async(&mut a, 4032, &b, 0, 128, &stream),
            Destination,
            "destination range 4032..4032+128",
        ),
        (
            pool.copy_async(&mut a, 0, &b, 4032, 128, &stream),
            Source,
            "source range 4032..4032+128",
        ),
        (
            pool.copy_from_host(&mut a, 4000, &host),
            Destination,
            "destination range 4000..4000+128",
        ),
        (
            pool.copy_to_host(&b, 4000, &mut host),
            Source,
            "source range 4000..4000+128",
        ),
    ] {
        let e = r.unwrap_err();
        assert!(
            matches!(e, Error::OutOfBounds { side: Some(s), capacity: 4096, .. } if s == side),
            "{e:?}"
        );
        let m = e.to_string();
        assert!(m.contains(text) && m.contains("out of bounds"), "{m}");
    }
    // A fill has one end: nothing to tell apart.
    let e = pool.memset(&mut a, 4000, 1, 128).unwrap_err();
    assert!(matches!(e, Error::OutOfBounds { side: None, .. }), "{e:?}");
    drop((a, b));
    drop(stream);
    assert_empty(&pool);
}

// `Error::Misaligned` without a side names an address, with a side the offset the caller
// passed for that end of a copy: a misaligned sub-range names the address it would start at.
#[test]
fn a_misaligned_sub_region_names_its_address() {
    use ascend_pool::region::{Region, SubRegion};
    let pool = Pool::new(sim(256 * MIB), PoolConfig::default()).unwrap();
    let mut d = pool.alloc_device(4096).unwrap();
    let at = d.addr() as u64 + 32;
    let e = SubRegion::new(&mut d, 32, 64).unwrap_err();
    assert_eq!(
        e,
        Error::Misaligned {
            addr: at,
            required: 64,
            side: None,
        }
    );
    assert!(e.to_string().contains(&format!("{at:#x}")), "{e}");
    assert_eq!(
        SubRegion::new(&mut d, 64, 64).unwrap().addr() as u64,
        at + 32
    );
}

// A synchronous copy between device memory of two devices (pools of one source) is refused
// before the runtime sees it, as the asynchronous one is: the pool never enables peer access.
#[test]
fn a_sync_copy_between_two_devices_memory_is_refused() {
    let sim = Arc::new(SimSource::new(SimConfig::default().with_devices(2)).unwrap());
    let zero = Pool::new(
        Arc::clone(&sim) as Arc<dyn BlockSource>,
        PoolConfig::default(),
    )
    .unwrap();
    let one = Pool::new(sim, PoolConfig::default().with_device(1)).unwrap();
    let mut a = zero.alloc_device(4096).unwrap();
    let b = one.alloc_device(4096).unwrap();
    assert!(matches!(
        zero.copy(&mut a, 0, &b, 0, 4096),
        Err(Error::ForeignHandle)
    ));
    // Host memory of the other device's pool is fine on either side.
    let h = one.alloc_host(4096).unwrap();
    zero.copy(&mut a, 0, &h, 0, 4096).unwrap();
    zero.validate().unwrap();
    one.validate().unwrap();
}
