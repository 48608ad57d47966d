//! Inputs the `pool_ops` fuzz target (`fuzz/fuzz_targets/pool_ops.rs`) found, kept as plain
//! tests: each failed before the fix named in it.

use ascend_pool::engine::{EngineConfig, RangeTier};
use ascend_pool::source::sim::{AclFunc, SimConfig, SimSource};
use ascend_pool::{Error, MallocPolicy, MemKind, Pool, PoolConfig, Stream};
use std::sync::Arc;

#[path = "common/empty.rs"]
mod common_empty;
use common_empty::assert_empty;

const MIB: u64 = 1 << 20;

fn small_pool(config: PoolConfig) -> Pool {
    let sim = SimSource::new(SimConfig::default().with_device_capacity(18 * MIB)).unwrap();
    Pool::new(Arc::new(sim), config).unwrap()
}

/// A stream of a pool on another simulator, whose handle numbers start where this one's do.
fn foreign_stream() -> Stream {
    let other = Pool::new(Arc::new(SimSource::default()), PoolConfig::default()).unwrap();
    other.create_stream().unwrap()
}

/// A buddy range holds a segment only in a block of the next power of two: the dedicated
/// chunk for 11 MiB was cut at 12 MiB (8 + 4 MiB blocks), the fresh chunk refused the request
/// and the caller got `Error::Invalid("fresh chunk refused ...")` with 18 MiB free.
/// Fixed by sizing chunks for a buddy range to the next power of two of the footprint.
#[test]
fn buddy_dedicated_chunk_holds_its_request() {
    let pool = small_pool(PoolConfig::default().with_chunk_size(6 * MIB).with_engine(
        EngineConfig {
            range: RangeTier::Buddy,
            slab_max: 1024,
        },
    ));
    for len in [11 * MIB, 5 * MIB + 1, 3 * MIB] {
        let r = pool.alloc_device(len).unwrap();
        pool.validate().unwrap();
        r.free().unwrap();
    }
    assert_empty(&pool);
}

/// Debug mode with padding 0: a segment whose rounded length fills its footprint has no
/// padding, and at the end of its chunk the canary fill of 0 bytes pointed past the block,
/// which the runtime refuses. The allocation failed with `aclrtMemset` INVALID_PARAM after
/// the segment was registered, so it was lost. Fixed by writing and checking no canary
/// when there is no padding (and taking the segment back if arming a canary fails).
#[test]
fn debug_canary_with_no_padding_at_chunk_end() {
    let pool = small_pool(
        PoolConfig::default()
            .with_chunk_size(6 * MIB)
            .with_padding(0)
            .with_debug(true),
    );
    let kind = MemKind::DeviceAlign32(MallocPolicy::HugeFirst);
    let whole = pool.alloc_device_kind(kind, 2 * MIB).unwrap();
    let small = pool.alloc_device_kind(kind, 64).unwrap();
    pool.validate().unwrap();
    small.free().unwrap();
    whole.free().unwrap();
    assert!(pool.take_corruption_reports().is_empty());
    assert_empty(&pool);
}

/// A stream of another simulator passed to `copy_async` / `memset_async`: its handle is a
/// number that may name one of this source's own streams (each simulator counts from 1),
/// and the work was queued there and reported `Ok`. Fixed by refusing streams of another
/// source with `ForeignHandle`, as `alloc_device_on` already did.
#[test]
fn async_work_on_a_foreign_stream_is_refused() {
    let pool = small_pool(PoolConfig::default());
    let foreign = foreign_stream();
    let _own = pool.create_stream().unwrap(); // the handle the foreign one aliases
    let mut dst = pool.alloc_device(256).unwrap();
    let src = pool.alloc_device(256).unwrap();
    assert_eq!(
        pool.memset_async(&mut dst, 0, 1, 64, &foreign),
        Err(Error::ForeignHandle)
    );
    assert_eq!(
        pool.copy_async(&mut dst, 0, &src, 0, 64, &foreign),
        Err(Error::ForeignHandle)
    );
    assert_eq!(
        pool.alloc_dvpp_on(64, &foreign).map(drop),
        Err(Error::ForeignHandle)
    );
    drop((dst, src));
    assert_empty(&pool);
}

/// `record_stream` took a stream of another source without a word: its handle names
/// another stream of this source (or none), so the region's free waited on the wrong
/// work, or on nothing. Fixed by refusing it with `ForeignHandle`, like the async calls.
#[test]
fn recording_a_foreign_stream_is_refused() {
    let pool = small_pool(PoolConfig::default());
    let foreign = foreign_stream();
    let own = pool.create_stream().unwrap();
    let region = pool.alloc_device(256).unwrap();
    assert_eq!(region.record_stream(&foreign), Err(Error::ForeignHandle));
    assert_eq!(region.record_stream(&own), Ok(()));
    let host = pool.alloc_host(256).unwrap();
    assert_eq!(host.record_stream(&foreign), Err(Error::ForeignHandle));
    drop((region, host));
    pool.synchronize().unwrap();
    assert_empty(&pool);
}

/// A stream of another device of the same simulator was taken by every call that queues
/// work or records a stream: the copy ran, and only the free found out, when recording the
/// end of the work on that stream failed (events live on one device) and it fell back to
/// waiting. Found by a review (session 72). Fixed by refusing such a stream with
/// `ForeignHandle`, as a stream of another source is.
#[test]
fn a_stream_of_another_device_is_refused() {
    let sim = Arc::new(SimSource::new(SimConfig::default().with_devices(2)).unwrap());
    let pool = Pool::new(sim.clone(), PoolConfig::default()).unwrap();
    let other = Pool::new(sim.clone(), PoolConfig::default().with_device(1)).unwrap();
    let theirs = other.create_stream().unwrap();
    let ours = pool.create_stream().unwrap();
    assert_eq!((ours.device(), theirs.device()), (0, 1));
    let mut dst = pool.alloc_device(256).unwrap();
    let src = pool.alloc_device(256).unwrap();
    let host = pool.alloc_host(256).unwrap();
    let copies = sim.stats().calls(AclFunc::MemcpyAsync);
    assert_eq!(
        pool.memset_async(&mut dst, 0, 1, 64, &theirs),
        Err(Error::ForeignHandle)
    );
    assert_eq!(
        pool.copy_async(&mut dst, 0, &src, 0, 64, &theirs),
        Err(Error::ForeignHandle)
    );
    assert_eq!(sim.stats().calls(AclFunc::MemcpyAsync), copies);
    assert_eq!(
        pool.alloc_device_on(64, &theirs).map(drop),
        Err(Error::ForeignHandle)
    );
    assert_eq!(dst.record_stream(&theirs), Err(Error::ForeignHandle));
    assert_eq!(host.record_stream(&theirs), Err(Error::ForeignHandle));
    // The pool's own device's streams still do.
    pool.copy_async(&mut dst, 0, &src, 0, 64, &ours).unwrap();
    assert_eq!(dst.record_stream(&ours), Ok(()));
    drop((dst, src, host));
    pool.synchronize().unwrap();
    assert_empty(&pool);
    assert_empty(&other);
}

/// Dropping the pool gave nothing back: the chunks it kept (empty ones below the release
/// threshold, and those of regions that outlived the handle) and its events stayed
/// allocated at the source for the life of the process, though the pool's docs say the
/// chunks go back when the last region does. Fixed by releasing every chunk and event
/// when the pool's shared state drops (after waiting for deferred frees' streams).
#[test]
fn dropping_the_pool_gives_every_chunk_back() {
    let sim = Arc::new(SimSource::default());
    let pool = Pool::new(sim.clone(), PoolConfig::default()).unwrap();
    let stream = pool.create_stream().unwrap();
    drop(pool.alloc_host(5000).unwrap()); // its chunk stays cached in the pool
    let mut queued = pool.alloc_device(1000).unwrap();
    pool.memset_async(&mut queued, 0, 7, 1000, &stream).unwrap();
    drop(queued); // freed once the stream passes the fill
    let outliving = pool.alloc_dvpp(1000).unwrap();
    drop(pool);
    assert!(
        sim.stats().live_blocks > 0,
        "the live region keeps its chunk"
    );
    drop(outliving);
    drop(stream);
    let s = sim.stats();
    assert_eq!((s.live_blocks, s.live_events, s.live_streams), (0, 0, 0));
}

/// A DVPP request of `u64::MAX / 2` bytes under the buddy range tier: the carve rule accepts
/// it (footprint 2^63 + 32), but a buddy chunk must be the next power of two, 2^64, and the
/// caller got `Error::Carve(LengthOverflow)`, an error of the rule, which had not
/// overflowed. The TLSF tier did the same for lengths within 2 MiB of `u64::MAX`, where the
/// chunk's size in whole granules overflows. Fixed by refusing such requests as any other
/// request no chunk can hold: `LimitExceeded` under a limit, else `OutOfMemory`, without
/// asking the source.
#[test]
fn a_request_no_chunk_size_can_hold_is_out_of_memory() {
    let huge = [u64::MAX / 2 - 30, u64::MAX / 2, u64::MAX - MIB];
    for range in [RangeTier::Tlsf, RangeTier::Buddy] {
        for limit in [0, 146 * MIB] {
            let config = PoolConfig::default()
                .with_limit(limit)
                .with_engine(EngineConfig {
                    range,
                    slab_max: 1024,
                });
            let pool = Pool::new(Arc::new(SimSource::default()), config).unwrap();
            let stream = pool.create_stream().unwrap();
            let held = pool.alloc_dvpp(3000).unwrap();
            for len in huge {
                let results = [
                    (MemKind::Dvpp, pool.alloc_dvpp(len).map(drop)),
                    (MemKind::Dvpp, pool.alloc_dvpp_on(len, &stream).map(drop)),
                    (MemKind::Host, pool.alloc_host(len).map(drop)),
                    (
                        MemKind::Device(MallocPolicy::HugeFirst),
                        pool.alloc_device(len).map(drop),
                    ),
                ];
                for (kind, res) in results {
                    let ok = match &res {
                        Err(Error::LimitExceeded { requested, .. }) => {
                            limit != 0 && *requested == len
                        }
                        Err(Error::OutOfMemory { requested, .. }) => *requested == len,
                        _ => false,
                    };
                    assert!(
                        ok,
                        "{range:?}, limit {limit}, {len} bytes of {kind:?}: {res:?}"
                    );
                    pool.validate().unwrap();
                }
            }
            // Each refusal is counted once, as out of memory, in its kind.
            let ooms = |kind| pool.stats(kind).ooms;
            assert_eq!(
                (
                    ooms(MemKind::Dvpp),
                    ooms(MemKind::Host),
                    ooms(MemKind::Device(MallocPolicy::HugeFirst))
                ),
                (6, 3, 3),
                "{range:?}, limit {limit}"
            );
            // The pool still serves, and loses nothing.
            let after = pool.alloc_dvpp(5000).unwrap();
            drop((held, after));
            pool.synchronize().unwrap();
            assert_empty(&pool);
        }
    }
}
