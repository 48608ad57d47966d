//! Stream-ordered reuse on the simulator's real asynchronous streams.
//!
//! - Memory a stream is still writing is not handed out until the stream has passed it:
//!   a long async copy into a region, the region dropped, and new allocations up to the one
//!   that makes the pool grow (and look at its pending frees first) that must not land on
//!   it (checked by address, and by the data the late copy would clobber).
//! - Allocation on the same stream reuses such memory at once, without waiting, and the
//!   region stays safe for host-side access and for other streams.
//! - When memory runs short, the pool waits for the streams before it fails.
//! - A stream the runtime would not wait for at its drop is kept, not destroyed under its
//!   work, and destroyed by a later retry (the pool's synchronize or trim) once the runtime
//!   answers; a retry waiting for one holds up no other thread's drop.

use ascend_pool::region::{streams_kept_on, DeviceRegion, HostRegion, Region};
use ascend_pool::source::sim::{AclFunc, Fault, SimConfig, SimSource, SimStats};
use ascend_pool::source::{BlockSource, MemcpyKind};
use ascend_pool::{AclError, Error, MemKind, Pool, PoolConfig, Stream};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;
use std::time::Duration;

#[path = "common/child.rs"]
mod common_child;
#[path = "common/hooked.rs"]
mod common_hooked;
use common_hooked::{Call, Watched};

const LEN: u64 = 1 << 20;

fn sim(bandwidth: u64) -> Arc<SimSource> {
    Arc::new(
        SimSource::new(
            SimConfig::default()
                .with_device_capacity(512 << 20)
                .with_copy_bandwidth(bandwidth),
        )
        .unwrap(),
    )
}

fn pool_over(sim: &Arc<SimSource>) -> Pool {
    let source: Arc<dyn BlockSource> = Arc::clone(sim) as Arc<dyn BlockSource>;
    Pool::new(source, PoolConfig::default().with_chunk_size(32 << 20)).unwrap()
}

/// A pool in debug mode (canaries over every segment's padding) over `sim`.
fn debug_pool_over(sim: &Arc<SimSource>) -> Pool {
    let source: Arc<dyn BlockSource> = Arc::clone(sim) as Arc<dyn BlockSource>;
    Pool::new(source, PoolConfig::default().with_debug(true)).unwrap()
}

/// Queues on `s` a fill of 8 bytes of `d`'s padding from its byte `at`: an overrun made by
/// work queued on the stream, which happens only when the stream runs it.
fn queue_padding_fill(pool: &Pool, d: &DeviceRegion, at: u64, s: &Stream) {
    let padding = d.len().next_multiple_of(32);
    assert!(
        at >= padding && at + 8 <= padding + 32,
        "in the rule's 32 bytes of padding"
    );
    // SAFETY: the 8 bytes lie in the segment's padding (asserted), which stays carved until
    // the stream has passed the fill: a free of `d` waits for the stream first.
    unsafe {
        pool.source()
            .memset_async(d.addr() + at as usize, 8, 0x55, 8, s.handle())
            .unwrap();
    }
}

fn overlaps(a: usize, b: usize, len: u64) -> bool {
    a < b + len as usize && b < a + len as usize
}

fn read(pool: &Pool, r: &impl Region) -> Vec<u8> {
    let mut out = vec![0u8; r.len() as usize];
    pool.copy_to_host(r, 0, &mut out).unwrap();
    out
}

/// Drops a device region of `LEN` bytes with a copy into it queued on `stream`, so its free
/// waits for the stream. Returns the region's address.
fn drop_behind_a_copy(pool: &Pool, staging: &HostRegion, stream: &Stream) -> usize {
    let mut target = pool.alloc_device(LEN).unwrap();
    let addr = target.addr();
    pool.copy_async(&mut target, 0, staging, 0, LEN, stream)
        .unwrap();
    addr
}

/// A device region of `LEN` bytes with a fill queued on `stream`. No other region waits on
/// the stream, so only this region's free can make the pool wait for it.
fn filled_on(pool: &Pool, stream: &Stream) -> DeviceRegion {
    let mut target = pool.alloc_device(LEN).unwrap();
    pool.memset_async(&mut target, 0, 0xAB, LEN, stream)
        .unwrap();
    target
}

/// Makes every call of each of `funcs` fail, until the faults are cleared.
fn fail_always<const N: usize>(sim: &SimSource, funcs: [AclFunc; N]) {
    for func in funcs {
        sim.inject_fault(Fault::always(func, AclError::RT_FAILURE));
    }
}

/// Waits for the streams: every deferred free completes and the pool is whole.
fn every_free_completes(pool: &Pool) {
    pool.synchronize().unwrap();
    assert_eq!(pool.stats(MemKind::DEVICE).pending_frees, 0);
    pool.validate().unwrap();
}

/// Every free completes, and device memory holds no region and refused nothing.
fn nothing_live_and_no_refusal(pool: &Pool) {
    every_free_completes(pool);
    let st = pool.stats(MemKind::DEVICE);
    assert_eq!(
        (st.live_regions, st.allocated_bytes, st.ooms),
        (0, 0, 0),
        "{st:?}"
    );
    assert_eq!(st.allocations, st.frees, "{st:?}");
}

/// Drops `pool` once every free of it has completed, with no refusal and nothing leaked, and
/// checks that `sim` then holds the streams and events it held `before`, and no block.
fn drop_leaving_nothing(pool: Pool, sim: &SimSource, before: &SimStats) {
    nothing_live_and_no_refusal(&pool);
    assert!(pool.leak_report().is_empty(), "{:?}", pool.leak_report());
    drop(pool);
    let after = sim.stats();
    assert_eq!(
        (after.live_streams, after.live_events, after.live_blocks),
        (before.live_streams, before.live_events, 0),
        "streams, events or blocks left"
    );
}

#[test]
fn a_long_async_copy_keeps_its_target_from_reuse_until_done() {
    // A size thread caches keep, and one they do not.
    for len in [4096, LEN] {
        long_copy_then_reuse(len);
    }
}

fn long_copy_then_reuse(len: u64) {
    // 64 MiB at 1 GB/s: the copy runs for about 60 ms after it is queued.
    let sim = sim(1_000_000_000);
    let pool = pool_over(&sim);
    let stream = pool.create_stream().unwrap();
    let big = 64u64 << 20;
    let src = pool.alloc_device(big).unwrap();
    let mut staging = pool.alloc_host(len).unwrap();
    staging.as_mut_slice().fill(0xEE);
    // A round tells something only if the copy into `target` is still queued once the new
    // allocations have returned; a test thread descheduled for the whole 60 ms (a loaded
    // machine) makes its round inconclusive, and another one runs.
    let mut conclusive = 0;
    for round in 0..10 {
        let mut target = pool.alloc_device(len).unwrap();
        let target_addr = target.addr();
        let mut sink = pool.alloc_device(big).unwrap();
        pool.copy_async(&mut sink, 0, &src, 0, big, &stream)
            .unwrap();
        pool.copy_async(&mut target, 0, &staging, 0, len, &stream)
            .unwrap();
        drop(sink);
        drop(target); // the copy into it is still queued behind 64 MiB
        let fresh = alloc_until_growth(&pool, len);
        // The stream runs in order, and the event the pool records when `target` drops (after
        // the copy into it) is its last work: anything pending now means that event had not
        // completed when these regions were handed out.
        if sim.pending_ops(stream.handle()).unwrap() > 0 {
            conclusive += 1;
            for r in &fresh {
                assert!(
                    !overlaps(r.addr(), target_addr, len),
                    "round {round}: got memory the stream is still writing"
                );
            }
        }
        // Whatever the timing, the late copy must not land in a new region: one on the
        // target's bytes (handed out after the copy ran) keeps what is written to it.
        let mut reused: Vec<_> = fresh
            .into_iter()
            .filter(|r| overlaps(r.addr(), target_addr, len))
            .collect();
        for r in &mut reused {
            pool.memset(r, 0, 0x11, len).unwrap();
        }
        stream.synchronize().unwrap();
        for r in &reused {
            assert!(
                read(&pool, r).iter().all(|&b| b == 0x11),
                "round {round}: a late copy clobbered a new region"
            );
        }
        if conclusive == 3 {
            break;
        }
    }
    assert!(
        conclusive > 0,
        "in no round was the stream still busy after the allocations"
    );
    // Once the stream has passed, the memory comes back.
    pool.synchronize().unwrap();
    assert_eq!(pool.stats(MemKind::DEVICE).pending_frees, 0);
    pool.validate().unwrap();
}

/// Regions of `len` bytes, allocated until the pool has had to grow: the allocation that
/// grows it first looks at the frees pending behind streams, so both the free space the
/// pool has and the path that reclaims pending memory hand out regions here.
fn alloc_until_growth(pool: &Pool, len: u64) -> Vec<DeviceRegion> {
    let calls = || pool.stats(MemKind::DEVICE).source_alloc_calls;
    let before = calls();
    let mut out = Vec::new();
    while calls() == before {
        assert!(out.len() < 100_000, "the pool never grew");
        out.push(pool.alloc_device(len).unwrap());
    }
    out
}

#[test]
fn a_held_stream_keeps_freed_memory_from_other_allocations() {
    let sim = sim(0);
    let pool = pool_over(&sim);
    let (s, t) = (pool.create_stream().unwrap(), pool.create_stream().unwrap());
    let staging = pool.alloc_host(LEN).unwrap();
    let hold = sim.hold_stream(s.handle()).unwrap();
    let target_addr = drop_behind_a_copy(&pool, &staging, &s);
    // Neither a plain allocation nor one on another stream may land on it.
    let plain = pool.alloc_device(LEN).unwrap();
    let on_t = pool.alloc_device_on(LEN, &t).unwrap();
    assert!(!overlaps(plain.addr(), target_addr, LEN));
    assert!(!overlaps(on_t.addr(), target_addr, LEN));
    assert_eq!(pool.stats(MemKind::DEVICE).pending_frees, 1);
    hold.release();
    every_free_completes(&pool);
}

#[test]
fn a_free_its_stream_has_passed_is_reused_before_the_kind_grows() {
    // Chunks of one granule, each holding two segments of a 1 MiB footprint.
    let sim = sim(0);
    let source: Arc<dyn BlockSource> = Arc::clone(&sim) as Arc<dyn BlockSource>;
    let pool = Pool::new(source, PoolConfig::default().with_chunk_size(2 << 20)).unwrap();
    let half = LEN - 64;
    let s = pool.create_stream().unwrap();
    let staging = pool.alloc_host(half).unwrap();
    let mut a = pool.alloc_device(half).unwrap();
    let b = pool.alloc_device(half).unwrap();
    let a_addr = a.addr();
    let before = pool.stats(MemKind::DEVICE);
    assert_eq!((before.chunks, before.allocated_bytes), (1, 2 << 20));
    pool.copy_async(&mut a, 0, &staging, 0, half, &s).unwrap();
    drop(a); // pending behind the copy
    s.synchronize().unwrap();
    assert_eq!(pool.stats(MemKind::DEVICE).pending_frees, 1);
    // The chunk is full but for the pending free, whose event has completed: the pool
    // looks at its pending frees before it grows, and carves there.
    let c = pool.alloc_device(half).unwrap();
    let after = pool.stats(MemKind::DEVICE);
    assert_eq!(c.addr(), a_addr);
    assert_eq!(
        (
            after.source_alloc_calls,
            after.reserved_bytes,
            after.pending_frees
        ),
        (before.source_alloc_calls, before.reserved_bytes, 0)
    );
    drop((b, c));
    every_free_completes(&pool);
}

/// The same when the pending free is the chunk's only segment: the chunk is not given back
/// to the source as empty and a new one taken for the same request.
#[test]
fn a_chunk_a_passed_free_empties_is_reused_not_swapped() {
    // One shared chunk (not one request's own) of one granule, holding one 1 MiB segment.
    let sim = sim(0);
    let source: Arc<dyn BlockSource> = Arc::clone(&sim) as Arc<dyn BlockSource>;
    let mut config = PoolConfig::default().with_chunk_size(4 << 20);
    config.large_threshold = 64 << 20;
    let pool = Pool::new(source, config).unwrap();
    let half = LEN - 64;
    let s = pool.create_stream().unwrap();
    let staging = pool.alloc_host(half).unwrap();
    let mut a = pool.alloc_device(half).unwrap();
    let a_addr = a.addr();
    let before = pool.stats(MemKind::DEVICE);
    assert_eq!((before.chunks, before.reserved_bytes), (1, 2 << 20));
    pool.copy_async(&mut a, 0, &staging, 0, half, &s).unwrap();
    drop(a);
    s.synchronize().unwrap();
    // A request for the whole chunk: it fits once the pending free is done, not before.
    let c = pool.alloc_device((2 << 20) - 64).unwrap();
    let after = pool.stats(MemKind::DEVICE);
    assert_eq!(c.addr(), a_addr);
    assert_eq!(
        (
            after.source_alloc_calls,
            after.source_free_calls,
            after.chunks
        ),
        (before.source_alloc_calls, before.source_free_calls, 1)
    );
    drop(c);
    every_free_completes(&pool);
}

#[test]
fn the_event_of_a_passed_free_is_kept_for_the_next_one() {
    let sim = sim(0);
    let pool = pool_over(&sim);
    let s = pool.create_stream().unwrap();
    let staging = pool.alloc_host(LEN).unwrap();
    let events = |sim: &SimSource| {
        let st = sim.stats();
        (
            st.calls(AclFunc::CreateEvent),
            st.calls(AclFunc::DestroyEvent),
        )
    };
    for round in 0..10 {
        drop_behind_a_copy(&pool, &staging, &s);
        s.synchronize().unwrap();
        pool.synchronize().unwrap();
        // One event, created for the first free and fenced again for each later one.
        assert_eq!(events(&sim), (1, 0), "round {round}");
    }
    assert_eq!(sim.stats().live_events, 1);
    drop(staging);
    drop(pool);
    assert_eq!(events(&sim), (1, 1), "the pool's idle events go with it");
    assert_eq!(sim.stats().live_events, 0);
}

#[test]
fn allocation_on_the_same_stream_reuses_at_once_and_stays_ordered() {
    let sim = sim(0);
    let pool = pool_over(&sim);
    let s = pool.create_stream().unwrap();
    let mut first_data = pool.alloc_host(LEN).unwrap();
    first_data.as_mut_slice().fill(0xAA);
    let mut second_data = pool.alloc_host(LEN).unwrap();
    second_data.as_mut_slice().fill(0xBB);

    let hold = sim.hold_stream(s.handle()).unwrap();
    let mut a = pool.alloc_device_on(LEN, &s).unwrap();
    let a_addr = a.addr();
    pool.copy_async(&mut a, 0, &first_data, 0, LEN, &s).unwrap();
    drop(a); // its copy is held in the queue
    let before = pool.stats(MemKind::DEVICE);
    assert_eq!(before.pending_frees, 1);

    // Same stream, same shape: taken over at once while the stream is still held.
    let waits = |sim: &SimSource| {
        let st = sim.stats();
        (
            st.calls(AclFunc::StreamWaitEvent),
            st.calls(AclFunc::QueryEventStatus),
            st.calls(AclFunc::SynchronizeEvent),
        )
    };
    let waits_before = waits(&sim);
    let mut b = pool.alloc_device_on(LEN, &s).unwrap();
    assert_eq!(b.addr(), a_addr, "same-stream allocation reuses at once");
    let after = pool.stats(MemKind::DEVICE);
    assert_eq!(after.pending_frees, 0);
    assert_eq!(after.allocations, before.allocations + 1);
    assert_eq!(after.frees, before.frees + 1);
    assert_eq!(after.reserved_bytes, before.reserved_bytes);
    pool.validate().unwrap();

    // Work queued on the stream runs after the old work: the second copy wins.
    pool.copy_async(&mut b, 0, &second_data, 0, LEN, &s)
        .unwrap();
    assert_eq!(
        waits(&sim),
        waits_before,
        "the same stream needs no event queried or waited for"
    );
    hold.release();
    s.synchronize().unwrap();
    assert!(read(&pool, &b).iter().all(|&x| x == 0xBB));
    drop(b);

    // Host-side access to a taken-over region waits for the old work first.
    let hold = sim.hold_stream(s.handle()).unwrap();
    let mut c = pool.alloc_device_on(LEN, &s).unwrap();
    pool.copy_async(&mut c, 0, &first_data, 0, LEN, &s).unwrap();
    drop(c);
    let mut d = pool.alloc_device_on(LEN, &s).unwrap();
    assert_eq!(d.addr(), a_addr);
    std::thread::scope(|scope| {
        scope.spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            hold.release();
        });
        // Without the wait, this write would land first and the held copy would clobber it.
        pool.copy_from_host(&mut d, 0, &vec![0xCC; LEN as usize])
            .unwrap();
    });
    s.synchronize().unwrap();
    assert!(
        read(&pool, &d).iter().all(|&x| x == 0xCC),
        "old work clobbered host-side data"
    );
    drop(d);

    // Another stream's work on a taken-over region is queued after the old work.
    let t = pool.create_stream().unwrap();
    let hold = sim.hold_stream(s.handle()).unwrap();
    let mut e = pool.alloc_device_on(LEN, &s).unwrap();
    pool.copy_async(&mut e, 0, &first_data, 0, LEN, &s).unwrap();
    drop(e);
    let mut f = pool.alloc_device_on(LEN, &s).unwrap();
    assert_eq!(f.addr(), a_addr);
    let t_waits = waits(&sim).0;
    pool.copy_async(&mut f, 0, &second_data, 0, LEN, &t)
        .unwrap();
    assert_eq!(waits(&sim).0, t_waits + 1, "t is made to wait once");
    std::thread::sleep(Duration::from_millis(20));
    assert!(sim.pending_ops(t.handle()).unwrap() > 0, "t waits for s");
    hold.release();
    t.synchronize().unwrap();
    assert!(
        read(&pool, &f).iter().all(|&x| x == 0xBB),
        "t's copy ran before s's"
    );
    drop(f);
    pool.synchronize().unwrap();
    pool.validate().unwrap();
    assert!(
        pool.leak_report().len() == 2,
        "only the two staging buffers live"
    );
}

#[test]
fn running_short_waits_for_streams_before_failing() {
    // 256 MiB of device memory; each region's free waits behind a slow copy.
    let sim = Arc::new(
        SimSource::new(
            SimConfig::default()
                .with_device_capacity(256 << 20)
                .with_copy_bandwidth(4_000_000_000),
        )
        .unwrap(),
    );
    let pool = pool_over(&sim);
    let stream = pool.create_stream().unwrap();
    let staging = pool.alloc_host(8 << 20).unwrap();
    let mut n = 0;
    loop {
        match pool.alloc_device(8 << 20) {
            Ok(mut r) => {
                pool.copy_async(&mut r, 0, &staging, 0, 8 << 20, &stream)
                    .unwrap();
                n += 1; // dropped with its copy queued
            }
            Err(e) => panic!("after {n} regions: {e}"),
        }
        if n == 60 {
            break; // 480 MiB through 256 MiB: the pool had to wait for the stream
        }
    }
    let st = pool.stats(MemKind::DEVICE);
    assert!(st.reserved_bytes <= 256 << 20);
    assert_eq!(st.ooms, 0);
    pool.synchronize().unwrap();
    pool.validate().unwrap();
}

/// A host region's slice is handed out only once the streams with work on the region have
/// run it: a copy still on its way into the region is never read half done (nor raced).
#[test]
fn a_host_slice_waits_for_queued_stream_writes() {
    let sim = sim(1 << 30);
    let pool = pool_over(&sim);
    let stream = pool.create_stream().unwrap();
    let mut dev = pool.alloc_device(LEN).unwrap();
    pool.memset(&mut dev, 0, 0xAB, LEN).unwrap();
    let mut host = pool.alloc_host(LEN).unwrap();
    host.as_mut_slice().fill(0);
    // Busy time ahead of the copy, so it surely has not run when the slice is asked for.
    sim.enqueue_delay(stream.handle(), Duration::from_millis(200))
        .unwrap();
    pool.copy_async(&mut host, 0, &dev, 0, LEN, &stream)
        .unwrap();
    assert!(host.as_slice().iter().all(|&b| b == 0xAB));
    // Again for the writable slice, behind a copy out of the region.
    host.as_mut_slice().fill(0x11);
    sim.enqueue_delay(stream.handle(), Duration::from_millis(200))
        .unwrap();
    pool.copy_async(&mut dev, 0, &host, 0, LEN, &stream)
        .unwrap();
    host.as_mut_slice().fill(0x22);
    assert!(read(&pool, &dev).iter().all(|&b| b == 0x11));
    // A recorded stream that is gone since has run its work: no error.
    drop(stream);
    assert!(host.try_as_slice().is_ok());
}

/// A failed event query says nothing about the stream: the deferred free stays pending (it
/// is asked again later, and waited for when memory runs short) rather than being taken for
/// done, which would hand out memory the stream may still write.
#[test]
fn a_failed_event_query_keeps_the_free_pending() {
    let sim = sim(0);
    let pool = pool_over(&sim);
    let s = pool.create_stream().unwrap();
    let staging = pool.alloc_host(LEN).unwrap();
    let hold = sim.hold_stream(s.handle()).unwrap();
    let target_addr = drop_behind_a_copy(&pool, &staging, &s);
    assert_eq!(pool.stats(MemKind::DEVICE).pending_frees, 1);

    sim.inject_fault(Fault::next(
        AclFunc::QueryEventStatus,
        AclError::RT_FAILURE,
        u64::MAX,
    ));
    pool.trim(); // asks the event, and is refused
    assert!(sim.stats().failures(AclFunc::QueryEventStatus) > 0);
    assert_eq!(pool.stats(MemKind::DEVICE).pending_frees, 1);
    let plain = pool.alloc_device(LEN).unwrap();
    assert!(
        !overlaps(plain.addr(), target_addr, LEN),
        "got memory the held stream may still write"
    );
    pool.validate().unwrap();

    sim.clear_faults();
    hold.release();
    every_free_completes(&pool);
}

/// `synchronize` reports a wait the runtime refused instead of returning as if every free had
/// completed: that free stays pending (its memory is not handed out), and a later call
/// finishes it.
/// `Pool::synchronize` waits for a held stream without the kind's lock: another thread
/// allocates the kind's memory meanwhile (it used to wait behind the stream). The 60 s bound
/// only turns a thread that waits for ever into a failure; the allocation takes microseconds.
#[test]
fn synchronize_waits_for_streams_without_the_kind_lock() {
    let sim = sim(0);
    let source: Arc<dyn BlockSource> = Arc::clone(&sim) as Arc<dyn BlockSource>;
    // No thread cache: the allocation must go through the kind's lock.
    let config = PoolConfig::default()
        .with_chunk_size(32 << 20)
        .with_thread_cache(0);
    let pool = Arc::new(Pool::new(source, config).unwrap());
    let s = pool.create_stream().unwrap();
    let staging = pool.alloc_host(LEN).unwrap();
    let hold = sim.hold_stream(s.handle()).unwrap();
    drop_behind_a_copy(&pool, &staging, &s);
    assert_eq!(pool.stats(MemKind::DEVICE).pending_frees, 1);

    let waits = || sim.stats().calls(AclFunc::SynchronizeEvent);
    let before = waits();
    let syncer = {
        let pool = Arc::clone(&pool);
        std::thread::spawn(move || pool.synchronize())
    };
    // The first wait of the synchronize is for the held stream, on the device kind.
    while waits() == before {
        std::thread::yield_now();
    }
    let (tx, rx) = std::sync::mpsc::channel();
    let worker = {
        let pool = Arc::clone(&pool);
        std::thread::spawn(move || tx.send(pool.alloc_device(LEN).map(drop)).unwrap())
    };
    let got = rx.recv_timeout(Duration::from_secs(60));
    hold.release();
    worker.join().unwrap();
    syncer.join().unwrap().unwrap();
    assert!(
        matches!(got, Ok(Ok(()))),
        "an allocation waited for a stream it does not use: {got:?}"
    );
    assert_eq!(pool.stats(MemKind::DEVICE).pending_frees, 0);
    pool.validate().unwrap();
}

/// `Pool::synchronize` waits for the work queued before each deferred free, not for what the
/// stream was given after it: that may wait for the caller itself, here a hold the caller
/// releases only once `synchronize` has returned. (Fencing the stream anew, as a first
/// version of the unlocked wait did, waited for the hold for ever; the 60 s bound turns that
/// into a failure, and the copy before the free takes about half a second.)
#[test]
fn synchronize_waits_for_the_work_before_a_free_not_after() {
    let sim = sim(2 << 20);
    let pool = Arc::new(pool_over(&sim));
    let s = pool.create_stream().unwrap();
    let staging = pool.alloc_host(LEN).unwrap();
    drop_behind_a_copy(&pool, &staging, &s);
    let after = sim.hold_stream(s.handle()).unwrap();
    assert_eq!(pool.stats(MemKind::DEVICE).pending_frees, 1);
    let (tx, rx) = std::sync::mpsc::channel();
    let syncer = {
        let pool = Arc::clone(&pool);
        std::thread::spawn(move || tx.send(pool.synchronize()).unwrap())
    };
    let got = rx.recv_timeout(Duration::from_secs(60));
    after.release();
    syncer.join().unwrap();
    assert!(
        matches!(got, Ok(Ok(()))),
        "synchronize waited for work queued after the free: {got:?}"
    );
    assert_eq!(pool.stats(MemKind::DEVICE).pending_frees, 0);
    pool.validate().unwrap();
}

/// A pool whose one device chunk (the limit, 2 MiB) holds `kept` and a region freed behind a
/// fill queued on a held stream (512 KiB each), and a thread whose allocation (1.25 MiB)
/// fits only once that free completes, so it waits for the stream. While it waits, `other` runs on a third
/// thread with the pool and `kept`. Returns whether `other` finished while the stream was
/// still held (it used to wait behind the stream, for the allocation held the kind's lock
/// through its wait); then checks that the allocation succeeded once the stream ran, and
/// that the pool is whole and gives everything back.
///
/// The 60 s bound only turns a thread that waits for as long as the hold into a failure:
/// `other` takes microseconds.
fn meanwhile_an_allocation_waits_for_a_held_stream(
    other: impl FnOnce(&Pool, DeviceRegion) + Send + 'static,
) -> bool {
    let sim = sim(0);
    let source: Arc<dyn BlockSource> = Arc::clone(&sim) as Arc<dyn BlockSource>;
    // No thread cache: frees and allocations go through the kind's lock.
    let config = PoolConfig::default()
        .with_limit(2 << 20)
        .with_thread_cache(0);
    let pool = Arc::new(Pool::new(source, config).unwrap());
    let s = pool.create_stream().unwrap();
    let hold = sim.hold_stream(s.handle()).unwrap();
    let kept = pool.alloc_device(LEN / 2).unwrap();
    let mut busy = pool.alloc_device(LEN / 2).unwrap();
    pool.memset_async(&mut busy, 0, 0xAB, LEN / 2, &s).unwrap();
    drop(busy);
    let st = pool.stats(MemKind::DEVICE);
    assert_eq!(
        (st.pending_frees, st.reserved_bytes),
        (1, 2 << 20),
        "{st:?}"
    );

    let waits = || {
        let st = sim.stats();
        st.calls(AclFunc::SynchronizeEvent) + st.calls(AclFunc::SynchronizeStream)
    };
    let before = waits();
    let waiter = {
        let pool = Arc::clone(&pool);
        std::thread::spawn(move || pool.alloc_device(LEN + LEN / 4))
    };
    // Nothing else waits for a stream: the next wait is the allocation's, for the hold.
    while waits() == before && !waiter.is_finished() {
        std::thread::yield_now();
    }
    let (tx, rx) = std::sync::mpsc::channel();
    let third = {
        let pool = Arc::clone(&pool);
        std::thread::spawn(move || {
            other(&pool, kept);
            tx.send(()).unwrap();
        })
    };
    let got = rx.recv_timeout(Duration::from_secs(60));
    hold.release();
    third.join().unwrap();
    let region = waiter.join().unwrap();
    assert!(region.is_ok(), "{region:?}");
    drop(region);
    nothing_live_and_no_refusal(&pool);
    pool.trim();
    assert_eq!(pool.stats(MemKind::DEVICE).reserved_bytes, 0);
    got.is_ok()
}

/// An allocation short of memory waits for a held stream without the kind's lock: another
/// thread frees a region of the kind meanwhile (it used to wait for the stream too, and a
/// thread that had to free something before the stream could go on never would have).
#[test]
fn a_free_does_not_wait_behind_an_allocation_waiting_for_a_stream() {
    assert!(
        meanwhile_an_allocation_waits_for_a_held_stream(|_, kept| drop(kept)),
        "a free waited for a stream an allocation was waiting for"
    );
}

/// The same for an allocation the kind's free space holds; the waiting allocation still
/// gets its memory once the stream has run, and the pool loses nothing.
#[test]
fn an_allocation_does_not_wait_behind_another_waiting_for_a_stream() {
    assert!(
        meanwhile_an_allocation_waits_for_a_held_stream(|pool, kept| {
            drop(pool.alloc_device(LEN / 8).unwrap());
            drop(kept);
        }),
        "an allocation waited for a stream another allocation was waiting for"
    );
}

/// A request that fits nowhere even once the free it waited for has completed is refused
/// as before the wait was made without the kind's lock: with the limit's error, or the
/// source's (after the other kinds were asked for memory, and the kind tried once more),
/// and counted once in `ooms`.
#[test]
fn a_request_refused_after_waiting_for_a_stream_counts_one_refusal() {
    for by_source in [false, true] {
        let sim = Arc::new(
            SimSource::new(SimConfig::default().with_device_capacity(if by_source {
                8 << 20
            } else {
                512 << 20
            }))
            .unwrap(),
        );
        let source: Arc<dyn BlockSource> = Arc::clone(&sim) as Arc<dyn BlockSource>;
        let config = PoolConfig::default().with_thread_cache(0);
        let config = if by_source {
            config
        } else {
            config.with_limit(2 << 20)
        };
        let pool = Arc::new(Pool::new(source, config).unwrap());
        let s = pool.create_stream().unwrap();
        let hold = sim.hold_stream(s.handle()).unwrap();
        drop(filled_on(&pool, &s));
        assert_eq!(pool.stats(MemKind::DEVICE).pending_frees, 1);
        let waits = || sim.stats().calls(AclFunc::SynchronizeEvent);
        let before = waits();
        let waiter = {
            let pool = Arc::clone(&pool);
            std::thread::spawn(move || pool.alloc_device(16 << 20).map(drop))
        };
        while waits() == before && !waiter.is_finished() {
            std::thread::yield_now();
        }
        hold.release();
        let got = waiter.join().unwrap();
        assert!(waits() > before, "the request did not wait for the stream");
        if by_source {
            assert!(
                matches!(
                    got,
                    Err(Error::OutOfMemory {
                        source: Some(_),
                        ..
                    })
                ),
                "{got:?}"
            );
        } else {
            assert!(matches!(got, Err(Error::LimitExceeded { .. })), "{got:?}");
        }
        let st = pool.stats(MemKind::DEVICE);
        assert_eq!((st.ooms, st.pending_frees), (1, 0), "{st:?}");
        every_free_completes(&pool);
    }
}

#[test]
fn a_failed_wait_is_reported_and_its_free_stays_pending() {
    let sim = sim(0);
    let pool = pool_over(&sim);
    let s = pool.create_stream().unwrap();
    let staging = pool.alloc_host(LEN).unwrap();
    drop_behind_a_copy(&pool, &staging, &s);
    assert_eq!(pool.stats(MemKind::DEVICE).pending_frees, 1);

    // Every wait fails, and every query, so the free cannot be seen to have passed either
    // (`synchronize` asks first, then waits for the stream, then for the free's event).
    fail_always(&sim, [AclFunc::QueryEventStatus, AclFunc::SynchronizeEvent]);
    let got = pool.synchronize();
    assert!(
        matches!(&got, Err(Error::Runtime { code, .. }) if *code == AclError::RT_FAILURE),
        "{got:?}"
    );
    assert_eq!(pool.stats(MemKind::DEVICE).pending_frees, 1);
    pool.validate().unwrap();
    sim.clear_faults();

    every_free_completes(&pool);
}

/// A region taken over on its stream while the old owner's copy is still queued there: when
/// the runtime refuses the wait a host-side use needs, or the ordering another stream's work
/// needs, the use is refused and writes nothing, and the region still orders its next use
/// after the old copy.
#[test]
fn a_refused_wait_for_the_old_owner_refuses_the_use_and_keeps_the_order() {
    use std::sync::atomic::{AtomicBool, Ordering};
    let sim = sim(0);
    let pool = pool_over(&sim);
    let (s, t) = (pool.create_stream().unwrap(), pool.create_stream().unwrap());
    let mut old_data = pool.alloc_host(LEN).unwrap();
    old_data.as_mut_slice().fill(0xAA);
    let hold = sim.hold_stream(s.handle()).unwrap();
    let addr = drop_behind_a_copy(&pool, &old_data, &s);
    let mut b = pool.alloc_device_on(LEN, &s).unwrap();
    assert_eq!(b.addr(), addr, "taken over on its stream");

    let refused = |r: Result<(), Error>, what: &str| {
        assert!(
            matches!(&r, Err(Error::Runtime { code, .. }) if *code == AclError::RT_FAILURE),
            "{what}: {r:?}"
        );
    };
    sim.inject_fault(Fault::next(
        AclFunc::SynchronizeEvent,
        AclError::RT_FAILURE,
        1,
    ));
    let host_side = pool.copy_from_host(&mut b, 0, &vec![0xCC; LEN as usize]);
    refused(host_side, "a host-side write");
    sim.inject_fault(Fault::next(
        AclFunc::StreamWaitEvent,
        AclError::RT_FAILURE,
        1,
    ));
    refused(
        pool.memset_async(&mut b, 0, 0xDD, LEN, &t),
        "a fill on another stream",
    );
    assert_eq!(
        sim.pending_ops(t.handle()).unwrap(),
        0,
        "queued on t anyway"
    );
    pool.validate().unwrap();

    // Asked again, a host-side read waits for the held copy, and only that copy wrote.
    let released = AtomicBool::new(false);
    let got = std::thread::scope(|scope| {
        scope.spawn(|| {
            std::thread::sleep(Duration::from_millis(100));
            released.store(true, Ordering::SeqCst);
            hold.release();
        });
        let got = read(&pool, &b);
        assert!(
            released.load(Ordering::SeqCst),
            "read before the old owner's copy ran"
        );
        got
    });
    assert!(got.iter().all(|&x| x == 0xAA), "a refused use wrote");
    drop(b);
    every_free_completes(&pool);
}

/// A free whose stream the runtime will neither fence with an event nor wait for stays
/// pending: its memory is not handed out while the stream may still write it. Once the
/// runtime answers again, the free completes.
#[test]
fn a_free_the_runtime_cannot_fence_or_wait_for_stays_pending() {
    let sim = sim(0);
    let pool = pool_over(&sim);
    let s = pool.create_stream().unwrap();
    let hold = sim.hold_stream(s.handle()).unwrap();
    let target = filled_on(&pool, &s);
    let target_addr = target.addr();

    fail_always(&sim, [AclFunc::RecordEvent, AclFunc::SynchronizeStream]);
    drop(target);
    assert_eq!(pool.stats(MemKind::DEVICE).pending_frees, 1);
    pool.trim(); // tries to fence the stream again, and is refused
    let plain = pool.alloc_device(LEN).unwrap();
    assert!(
        !overlaps(plain.addr(), target_addr, LEN),
        "got memory the held stream may still write"
    );
    assert_eq!(pool.stats(MemKind::DEVICE).pending_frees, 1);
    pool.validate().unwrap();

    sim.clear_faults();
    hold.release();
    every_free_completes(&pool);
}

/// When the pool's last handle goes and the runtime will wait neither for a deferred free's
/// event nor for its stream, that free's chunk is kept from the runtime: giving back memory
/// a stream may still write is worse than holding it.
#[test]
fn a_dropped_pool_keeps_a_chunk_it_cannot_wait_for() {
    let sim = sim(0);
    let pool = pool_over(&sim);
    let s = pool.create_stream().unwrap();
    let hold = sim.hold_stream(s.handle()).unwrap();
    drop(filled_on(&pool, &s));
    assert_eq!(pool.stats(MemKind::DEVICE).pending_frees, 1);
    fail_always(
        &sim,
        [AclFunc::SynchronizeEvent, AclFunc::SynchronizeStream],
    );
    drop(pool);
    assert_eq!(
        sim.stats().live_blocks,
        1,
        "the chunk went back while the stream was held"
    );
    sim.clear_faults();
    hold.release(); // the fill lands in memory that is still the pool's
    s.synchronize().unwrap();
}

/// The last handle of a pool can go while a stream is still writing a freed region. If the
/// runtime then refuses to wait for the free's events, the pool waits for their streams
/// before its chunks go back, rather than hand the runtime memory a stream still writes:
/// for a region used on one stream, and on two.
#[test]
fn a_dropped_pool_waits_for_the_stream_when_the_event_wait_fails() {
    for also_on_another_stream in [false, true] {
        dropped_pool_waits(also_on_another_stream);
    }
}

fn dropped_pool_waits(also_on_another_stream: bool) {
    use std::sync::atomic::{AtomicBool, Ordering};
    let sim = sim(0);
    let pool = pool_over(&sim);
    let (s, t) = (pool.create_stream().unwrap(), pool.create_stream().unwrap());
    let hold = sim.hold_stream(s.handle()).unwrap();
    let target = filled_on(&pool, &s);
    if also_on_another_stream {
        target.record_stream(&t).unwrap();
    }
    drop(target);
    assert_eq!(pool.stats(MemKind::DEVICE).pending_frees, 1);
    fail_always(&sim, [AclFunc::SynchronizeEvent]);
    let released = AtomicBool::new(false);
    std::thread::scope(|scope| {
        scope.spawn(|| {
            std::thread::sleep(Duration::from_millis(100));
            released.store(true, Ordering::SeqCst);
            hold.release();
        });
        drop(pool); // the last handle: the chunks go back now
        assert!(
            released.load(Ordering::SeqCst),
            "the chunks went back while the stream was held (also on another stream: \
             {also_on_another_stream})"
        );
    });
    sim.clear_faults();
    assert_eq!(sim.stats().live_blocks, 0);
}

#[test]
fn a_stream_waits_for_its_work_and_is_destroyed_on_drop() {
    let sim = sim(0);
    let pool = pool_over(&sim);
    let streams = sim.stats().live_streams;
    let s = pool.create_stream().unwrap();
    assert_eq!(sim.stats().live_streams, streams + 1);
    let hold = sim.hold_stream(s.handle()).unwrap();
    sim.enqueue_delay(s.handle(), Duration::from_millis(1))
        .unwrap();
    std::thread::scope(|scope| {
        scope.spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            hold.release();
        });
        s.synchronize().unwrap();
        assert_eq!(
            sim.pending_ops(s.handle()).unwrap(),
            0,
            "synchronize returned early"
        );
    });
    // Dropped with work queued: the work runs, then the stream is gone.
    let handle = s.handle();
    sim.enqueue_delay(handle, Duration::from_millis(20))
        .unwrap();
    let syncs = sim.stats().calls(AclFunc::SynchronizeStream);
    drop(s);
    assert_eq!(sim.stats().calls(AclFunc::SynchronizeStream), syncs + 1);
    assert_eq!(sim.stats().live_streams, streams);
    assert!(sim.pending_ops(handle).is_err(), "the handle is dead");
}

/// Frees pending behind streams are looked at once per batch of 64, even when no
/// allocation comes to look: the list stays bounded, and is not queried on every free.
#[test]
fn pending_frees_are_reclaimed_a_batch_at_a_time_without_allocations() {
    let sim = sim(0);
    let pool = pool_over(&sim);
    let s = pool.create_stream().unwrap();
    let regions: Vec<DeviceRegion> = (0..128)
        .map(|_| {
            let r = pool.alloc_device(64 << 10).unwrap();
            r.record_stream(&s).unwrap();
            r
        })
        .collect();
    let pending = || pool.stats(MemKind::DEVICE).pending_frees;
    let hold = sim.hold_stream(s.handle()).unwrap();
    let mut regions = regions.into_iter();
    for r in regions.by_ref().take(64) {
        drop(r);
    }
    // The 64th free looked at the list, while the stream still held every segment.
    assert_eq!(pending(), 64);
    hold.release();
    s.synchronize().unwrap();
    for r in regions.by_ref().take(63) {
        drop(r);
    }
    assert_eq!(pending(), 127, "not looked at between batches");
    // Every fence recorded so far has run; the next free's own fence may not have yet.
    s.synchronize().unwrap();
    drop(regions.next());
    assert!(
        pending() <= 1,
        "the 128th free completes the others: {}",
        pending()
    );
    pool.validate().unwrap();
}

/// Events of completed frees are kept for the next fences, up to 256; the rest go back to
/// the runtime at once rather than pile up.
#[test]
fn at_most_256_idle_events_are_kept() {
    let sim = sim(0);
    let pool = pool_over(&sim);
    let s = pool.create_stream().unwrap();
    let regions: Vec<DeviceRegion> = (0..300)
        .map(|_| {
            let r = pool.alloc_device(4096).unwrap();
            r.record_stream(&s).unwrap();
            r
        })
        .collect();
    let hold = sim.hold_stream(s.handle()).unwrap();
    drop(regions); // 300 frees, each fenced by an event of its own
    assert_eq!(pool.stats(MemKind::DEVICE).pending_frees, 300);
    let created = sim.stats().calls(AclFunc::CreateEvent);
    assert!(created >= 300, "{created}");
    hold.release();
    pool.synchronize().unwrap();
    assert_eq!(pool.stats(MemKind::DEVICE).pending_frees, 0);
    assert_eq!(
        sim.stats().calls(AclFunc::DestroyEvent),
        created - 256,
        "all but 256 destroyed"
    );
    pool.validate().unwrap();
}

/// A free behind two streams, the first of which could not be fenced but was waited for:
/// only the second stream's event guards it, and an allocation on the first stream must not
/// take it at once, since the second may still be writing.
#[test]
fn a_free_fenced_on_its_second_stream_only_is_not_reused_on_the_first() {
    let sim = sim(0);
    let pool = pool_over(&sim);
    let (s1, s2) = (pool.create_stream().unwrap(), pool.create_stream().unwrap());
    let r = pool.alloc_device(LEN).unwrap();
    let addr = r.addr();
    r.record_stream(&s1).unwrap();
    r.record_stream(&s2).unwrap();
    let hold = sim.hold_stream(s2.handle()).unwrap();
    // The fence on `s1` fails; `s1` is idle, so the wait for it succeeds.
    sim.inject_fault(Fault::next(AclFunc::RecordEvent, AclError::RT_FAILURE, 1));
    drop(r);
    assert_eq!(sim.stats().failures(AclFunc::RecordEvent), 1);
    assert_eq!(pool.stats(MemKind::DEVICE).pending_frees, 1);
    let on_s1 = pool.alloc_device_on(LEN, &s1).unwrap();
    assert!(
        !overlaps(on_s1.addr(), addr, LEN),
        "got memory the held stream may still write"
    );
    pool.validate().unwrap();
    hold.release();
    drop(on_s1);
    every_free_completes(&pool);
}

/// Set in the child process `a_dropped_pool_reports_held_regions_not_pending_frees` runs
/// itself in.
const DROP_REPORT_CHILD: &str = "ASCEND_POOL_DROP_REPORT_CHILD";

/// A pool dropped with one region still held and one freed behind a held stream reports
/// the held region as live, and not the free, which the application did make.
#[test]
fn a_dropped_pool_reports_held_regions_not_pending_frees() {
    if std::env::var_os(DROP_REPORT_CHILD).is_none() {
        // The report goes to stderr: read it from a child running this test.
        let (stdout, stderr) = common_child::rerun_in_child(
            "a_dropped_pool_reports_held_regions_not_pending_frees",
            DROP_REPORT_CHILD,
            &[],
        );
        let held = stdout
            .lines()
            .find_map(|l| l.split_once("held at ").map(|(_, at)| at))
            .expect("the child names the held region");
        assert!(
            stderr.contains("pool dropped with 1 live region(s)"),
            "{stderr}"
        );
        assert_eq!(stderr.matches(" at 0x").count(), 1, "{stderr}");
        assert!(stderr.contains(&format!(" at {held} ")), "{stderr}");
        return;
    }
    let sim = sim(1 << 30);
    let pool = pool_over(&sim);
    let stream = pool.create_stream().unwrap();
    let hold = sim.hold_stream(stream.handle()).unwrap();
    drop(filled_on(&pool, &stream)); // freed; the free waits for the held stream
    let held = pool.alloc_device(LEN).unwrap();
    println!("held at {:#x}", held.addr());
    assert_eq!(pool.stats(MemKind::DEVICE).pending_frees, 1);
    drop(pool);
    hold.release();
    drop((held, stream));
}

/// Work a caller queues itself on a second stream, after `record_stream`, on memory taken
/// over behind the first stream's queued work runs after that work: `record_stream` has the
/// stream wait for the previous owner's work, as the pool's own copies and fills do.
#[test]
fn record_stream_orders_the_callers_own_work_after_the_previous_owner() {
    let sim = sim(1 << 30);
    let pool = pool_over(&sim);
    let (first, second) = (pool.create_stream().unwrap(), pool.create_stream().unwrap());
    let hold = sim.hold_stream(first.handle()).unwrap();
    let mut old = pool.alloc_device_on(LEN, &first).unwrap();
    pool.memset_async(&mut old, 0, 0xAA, LEN, &first).unwrap(); // queued behind the hold
    let addr = old.addr();
    drop(old);
    let new = pool.alloc_device_on(LEN, &first).unwrap();
    assert_eq!(new.addr(), addr, "taken over at once on the same stream");
    new.record_stream(&second).unwrap();
    // The caller's own work on the second stream (a kernel, say), straight to the runtime.
    // SAFETY: `new` is a live region of LEN bytes at `addr`; the fill stays inside it.
    unsafe { sim.memset_async(addr, LEN, 0xBB, LEN, second.handle()) }.unwrap();
    hold.release();
    second.synchronize().unwrap();
    first.synchronize().unwrap();
    assert!(
        read(&pool, &new).iter().all(|&b| b == 0xBB),
        "the previous owner's fill ran after the new owner's"
    );
    drop(new);
    every_free_completes(&pool);
}

/// A region that lives for the whole run (weights, a KV cache) used on a stream made per
/// request keeps no note of the streams gone since: each host-side access waits for the
/// streams still noted, and a server would otherwise wait for one more per request served.
#[test]
fn a_long_lived_region_forgets_streams_that_are_gone() {
    let sim = sim(0);
    let pool = pool_over(&sim);
    let mut weights = pool.alloc_device(LEN).unwrap();
    let syncs = || {
        let calls = sim.stats().calls;
        calls.get(&AclFunc::SynchronizeStream).copied().unwrap_or(0)
    };
    // Synchronizations a host-side copy into `weights` makes after `n` more requests.
    let mut serve_then_copy = |n: usize| {
        for _ in 0..n {
            let stream = pool.create_stream().unwrap();
            weights.record_stream(&stream).unwrap();
        }
        let before = syncs();
        pool.copy_from_host(&mut weights, 0, &[1; 64]).unwrap();
        syncs() - before
    };
    let after_n = serve_then_copy(200);
    let after_2n = serve_then_copy(200);
    assert!(
        after_n <= 1 && after_2n <= 1,
        "a host copy waited for {after_n}, then {after_2n} streams, all gone"
    );
}

/// A stream per request, a region filled on it and freed behind it, the stream dropped: what
/// the pool holds for those frees (pending frees, their events, the streams) stays within
/// its bounds however many requests come (checked after N requests and after 2N).
#[test]
fn a_stream_per_request_leaves_no_streams_events_or_pending_frees() {
    let sim = sim(0);
    let pool = pool_over(&sim);
    let serve = |n: usize| {
        for i in 0..n {
            let stream = pool.create_stream().unwrap();
            // A size per request, past the thread caches, so each free goes to the kind.
            let mut r = pool.alloc_device(LEN + 4096 * (i as u64 % 7)).unwrap();
            pool.memset_async(&mut r, 0, 1, 4096, &stream).unwrap();
            drop(r);
            drop(stream);
        }
        let s = sim.stats();
        let pending = pool.leak_report().iter().filter(|l| l.pending).count();
        (s.live_streams, s.live_events, pending)
    };
    let after_n = serve(300);
    let after_2n = serve(300);
    assert_eq!(after_n.0, 0, "streams left");
    assert!(
        after_2n.1 <= after_n.1.max(256) && after_2n.2 <= after_n.2.max(64),
        "events and pending frees grew: {after_n:?} then {after_2n:?}"
    );
}

/// A `Stream` whose synchronize and destroy the runtime refused is gone from the program but
/// not from the device: its queued work still runs, so a region it was noted on still waits
/// for it when freed afterwards (the stream is not forgotten with its `Stream`).
#[test]
fn a_stream_the_runtime_would_not_destroy_still_holds_its_regions() {
    let sim = sim(0);
    let pool = pool_over(&sim);
    let s = pool.create_stream().unwrap();
    let staging = pool.alloc_host(LEN).unwrap();
    let hold = sim.hold_stream(s.handle()).unwrap();
    let mut target = pool.alloc_device(LEN).unwrap();
    let target_addr = target.addr();
    pool.copy_async(&mut target, 0, &staging, 0, LEN, &s)
        .unwrap();
    for func in [AclFunc::SynchronizeStream, AclFunc::DestroyStream] {
        sim.inject_fault(Fault::next(func, AclError::RT_FAILURE, 1));
    }
    drop(s);
    drop(target);
    assert_eq!(pool.stats(MemKind::DEVICE).pending_frees, 1);
    let next = pool.alloc_device(LEN).unwrap();
    assert!(!overlaps(next.addr(), target_addr, LEN));
    hold.release();
    every_free_completes(&pool);
}

/// `Pool::synchronize` records nothing on a stream the application has destroyed: a free
/// pending on a busy stream and on one since waited for and destroyed (its event passed)
/// waits for the busy one only. On the real runtime a destroyed stream's handle is freed
/// memory: an event recorded on it is a use after free.
#[test]
fn synchronize_records_nothing_on_a_stream_destroyed_after_a_free() {
    let sim = sim(0);
    let pool = pool_over(&sim);
    let (busy, done) = (pool.create_stream().unwrap(), pool.create_stream().unwrap());
    let hold = sim.hold_stream(busy.handle()).unwrap();
    let mut target = filled_on(&pool, &busy);
    pool.memset_async(&mut target, 0, 1, LEN, &done).unwrap();
    drop(target);
    assert_eq!(pool.stats(MemKind::DEVICE).pending_frees, 1);
    drop(done);
    let waits = || sim.stats().calls(AclFunc::SynchronizeEvent);
    let refused = || sim.stats().failures(AclFunc::RecordEvent);
    let (before, refused_before) = (waits(), refused());
    std::thread::scope(|scope| {
        let waiter = scope.spawn(|| pool.synchronize());
        // The waiter waits for the busy stream before the hold goes.
        while waits() == before {
            std::thread::yield_now();
        }
        hold.release();
        waiter.join().unwrap().unwrap();
    });
    assert_eq!(
        refused(),
        refused_before,
        "an event recorded on a destroyed stream"
    );
    every_free_completes(&pool);
}

/// `Stream::wait_for`: a pipeline that decodes on `a` and runs its model on `b` orders `b`'s
/// later copy after `a`'s earlier one, and the call returns while `a` is still held. Without
/// the wait, `b` would copy the zeros the device region held before `a`'s copy.
#[test]
fn wait_for_orders_a_later_copy_after_another_streams_earlier_one() {
    let sim = sim(0);
    let pool = pool_over(&sim);
    let (a, b) = (pool.create_stream().unwrap(), pool.create_stream().unwrap());
    let mut packet = pool.alloc_host(LEN).unwrap();
    packet.as_mut_slice().fill(0xAA);
    let mut frame = pool.alloc_device(LEN).unwrap();
    let mut out = pool.alloc_host(LEN).unwrap();
    out.as_mut_slice().fill(0);
    let hold = sim.hold_stream(a.handle()).unwrap();
    pool.copy_async(&mut frame, 0, &packet, 0, LEN, &a).unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::scope(|scope| {
        // Releases `a` when told, or after 10 s: a wait_for that blocked on the held stream
        // ends then, and fails the timing check below rather than hanging.
        scope.spawn(move || {
            let _ = rx.recv_timeout(Duration::from_secs(10));
            hold.release();
        });
        let started = std::time::Instant::now();
        b.wait_for(&a).unwrap();
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "wait_for blocked until the other stream ran"
        );
        pool.copy_async(&mut out, 0, &frame, 0, LEN, &b).unwrap();
        std::thread::sleep(Duration::from_millis(20));
        assert!(sim.pending_ops(b.handle()).unwrap() > 0, "b waits for a");
        tx.send(()).unwrap();
    });
    b.synchronize().unwrap();
    assert!(
        out.as_slice().iter().all(|&x| x == 0xAA),
        "b's copy ran before a's"
    );
}

/// Each `wait_for` needs an event recorded on the other stream; the waiting stream keeps a
/// few and records them again once its waits on them have passed, so a long run creates a
/// bounded number, and dropping the stream destroys them.
#[test]
fn wait_for_keeps_a_bounded_number_of_events() {
    let sim = sim(0);
    let pool = pool_over(&sim);
    let (a, b) = (pool.create_stream().unwrap(), pool.create_stream().unwrap());
    let mut dev = pool.alloc_device(4096).unwrap();
    let before = sim.stats().live_events;
    for _ in 0..2000 {
        pool.memset_async(&mut dev, 0, 1, 4096, &a).unwrap();
        b.wait_for(&a).unwrap();
        a.wait_for(&b).unwrap();
    }
    let st = sim.stats();
    assert!(
        st.live_events - before <= 20 && st.calls(AclFunc::CreateEvent) <= 20,
        "events grow with the calls: {} live, {} created",
        st.live_events,
        st.calls(AclFunc::CreateEvent)
    );
    // Waiting on itself orders nothing new, and queues nothing.
    let waits = sim.stats().calls(AclFunc::StreamWaitEvent);
    b.wait_for(&b).unwrap();
    assert_eq!(sim.stats().calls(AclFunc::StreamWaitEvent), waits);
    drop((a, b));
    assert_eq!(
        sim.stats().live_events,
        before,
        "the streams' events go with them"
    );
    drop(dev);
    pool.synchronize().unwrap();
}

/// A stream of another source, or of another device of the same source, is refused: its
/// handle names nothing here, and the reference does not say that a stream may wait for an
/// event of another device.
#[test]
fn wait_for_refuses_streams_of_another_source_or_device() {
    let sim = Arc::new(SimSource::new(SimConfig::default().with_devices(2)).unwrap());
    let source: Arc<dyn BlockSource> = Arc::clone(&sim) as Arc<dyn BlockSource>;
    let pool0 = Pool::new(Arc::clone(&source), PoolConfig::default()).unwrap();
    let pool1 = Pool::new(source, PoolConfig::default().with_device(1)).unwrap();
    let other = pool_over(&self::sim(0));
    let (s0, s1, foreign) = (
        pool0.create_stream().unwrap(),
        pool1.create_stream().unwrap(),
        other.create_stream().unwrap(),
    );
    let calls = sim.stats().calls(AclFunc::RecordEvent);
    assert_eq!(s0.wait_for(&s1), Err(Error::ForeignHandle));
    assert_eq!(s1.wait_for(&s0), Err(Error::ForeignHandle));
    assert_eq!(s0.wait_for(&foreign), Err(Error::ForeignHandle));
    assert_eq!(sim.stats().calls(AclFunc::RecordEvent), calls);
}

/// `alloc_model_input_on`: model input for work ordered on a stream is 128-aligned, reused
/// at once after a region of its shape freed behind that stream's work, and never takes a
/// freed segment whose start is only 64-aligned.
#[test]
fn model_input_on_a_stream_is_reused_at_once_and_stays_128_aligned() {
    let sim = sim(0);
    let pool = pool_over(&sim);
    let s = pool.create_stream().unwrap();
    let staging = pool.alloc_host(LEN).unwrap();
    let hold = sim.hold_stream(s.handle()).unwrap();
    let mut a = pool.alloc_model_input_on(LEN, &s).unwrap();
    let a_addr = a.addr();
    assert_eq!(a_addr % 128, 0);
    pool.copy_async(&mut a, 0, &staging, 0, LEN, &s).unwrap();
    drop(a);
    let b = pool.alloc_model_input_on(LEN, &s).unwrap();
    assert_eq!(b.addr(), a_addr, "same stream, same shape: reused at once");
    assert_eq!(pool.stats(MemKind::DEVICE).pending_frees, 0);

    // Two 100-byte device regions take 192 bytes each: the second starts 64-aligned only.
    let mut small: Vec<_> = (0..2)
        .map(|_| pool.alloc_device_on(100, &s).unwrap())
        .collect();
    let odd = small.iter().position(|r| r.addr() % 128 != 0).unwrap();
    let odd_addr = small[odd].addr();
    for r in &mut small {
        pool.memset_async(r, 0, 1, 100, &s).unwrap();
    }
    drop(small);
    let taken: Vec<_> = (0..2)
        .map(|_| pool.alloc_model_input_on(100, &s).unwrap())
        .collect();
    for r in &taken {
        assert_eq!(r.addr() % 128, 0);
        assert_ne!(r.addr(), odd_addr);
    }
    pool.validate().unwrap();
    hold.release();
    drop((b, taken));
    every_free_completes(&pool);
}

/// Nor a freed segment whose start happens to be 128-aligned but whose footprint is the
/// 64-aligned rule's, short of the 128-aligned one's (4,160 bytes for 4,096 against 4,224):
/// taken over, it went into the thread cache's bin for its shape when freed, where every
/// take refused it.
#[test]
fn model_input_on_a_stream_takes_no_segment_short_of_its_footprint() {
    let sim = sim(0);
    let pool = pool_over(&sim);
    let s = pool.create_stream().unwrap();
    let hold = sim.hold_stream(s.handle()).unwrap();
    let mut device: Vec<_> = (0..2)
        .map(|_| pool.alloc_device_on(4096, &s).unwrap())
        .collect();
    let aligned = device.iter().find(|r| r.addr() % 128 == 0).unwrap().addr();
    for r in &mut device {
        pool.memset_async(r, 0, 1, 4096, &s).unwrap();
    }
    drop(device);
    let input = pool.alloc_model_input_on(4096, &s).unwrap();
    assert_eq!(input.addr() % 128, 0);
    assert_ne!(
        input.addr(),
        aligned,
        "a 4,160-byte segment is no 4,224-byte one"
    );
    pool.validate().unwrap();
    hold.release();
    drop(input);
    every_free_completes(&pool);
}

/// A `Stream` whose synchronize the runtime refuses on drop may still have work queued:
/// it is not destroyed under that work. It used to be (the simulator drains a destroyed
/// stream, but takes its handle out first), so a region freed meanwhile, whose free could
/// not fence the stream with an event (the handle was gone), took the stream for one whose
/// work had run and was handed out while the held fill could still write it. Kept, it is
/// destroyed by the pool's next synchronize, which waits for it (a trim while it is held
/// leaves it).
///
/// The 60 s bound only turns a drop that waits for the hold into a failure.
#[test]
fn a_stream_whose_synchronize_fails_on_drop_is_not_destroyed_under_its_work() {
    let sim = sim(0);
    let pool = pool_over(&sim);
    let s = pool.create_stream().unwrap();
    let handle = s.handle();
    let hold = sim.hold_stream(handle).unwrap();
    let target = filled_on(&pool, &s);
    let target_addr = target.addr();
    let streams = sim.stats().live_streams;
    // The drop's wait is refused.
    sim.inject_fault(Fault::next(
        AclFunc::SynchronizeStream,
        AclError::RT_FAILURE,
        1,
    ));
    let (tx, rx) = std::sync::mpsc::channel();
    let dropper = std::thread::spawn(move || {
        drop(s);
        tx.send(()).unwrap();
    });
    // Until the drop has returned, or has taken the stream out of the runtime's table.
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while rx.try_recv().is_err() && sim.stats().live_streams == streams {
        assert!(
            std::time::Instant::now() < deadline,
            "the drop neither returned nor destroyed the stream"
        );
        std::thread::yield_now();
    }
    drop(target);
    pool.trim(); // looks at the pending free again
    let next = pool.alloc_device(LEN).unwrap();
    let reused = overlaps(next.addr(), target_addr, LEN);
    let pending = pool.stats(MemKind::DEVICE).pending_frees;
    hold.release();
    dropper.join().unwrap();
    assert!(!reused, "got memory the held stream may still write");
    assert_eq!(
        pending, 1,
        "the free completed while the held stream may still write"
    );
    assert!(sim.pending_ops(handle).is_ok(), "the stream was destroyed");
    assert_eq!(streams_kept_on(&*sim), 1, "the stream is not counted kept");
    drop(next);
    every_free_completes(&pool); // waits for the kept stream, then destroys it
    assert!(
        sim.pending_ops(handle).is_err(),
        "a synchronize that waited for the kept stream left it"
    );
    assert_eq!(
        (streams_kept_on(&*sim), sim.stats().live_streams),
        (0, streams - 1)
    );
}

/// Makes the next synchronize of any stream fail, as a device fault would.
fn refuse_next_synchronize(sim: &SimSource) {
    sim.inject_fault(Fault::next(
        AclFunc::SynchronizeStream,
        AclError::RT_FAILURE,
        1,
    ));
}

/// A stream kept at its drop (its synchronize refused once) is recovered once the runtime
/// answers again. While the runtime still refuses, the stream stays kept, its handle live,
/// and a free behind it that can be neither fenced nor waited for stays pending. Once the
/// runtime answers, the pool's synchronize waits for the stream and destroys it with the wait
/// event it kept, the free completes, and a region that noted the stream no longer waits for
/// it: nothing is left at the simulator.
#[test]
fn a_stream_kept_at_drop_is_destroyed_once_the_runtime_waits_for_it() {
    let sim = sim(0);
    let pool = pool_over(&sim);
    let before = sim.stats();
    let (s, t) = (pool.create_stream().unwrap(), pool.create_stream().unwrap());
    // An event a wait queued on `s` may still name: kept with the stream.
    s.wait_for(&t).unwrap();
    let mut noted = pool.alloc_device(LEN).unwrap();
    pool.memset_async(&mut noted, 0, 0xCD, LEN, &s).unwrap();
    let freed = filled_on(&pool, &s);
    let handle = s.handle();
    refuse_next_synchronize(&sim);
    drop(s);
    assert_eq!(streams_kept_on(&*sim), 1);
    assert!(sim.pending_ops(handle).is_ok(), "destroyed without a wait");
    assert_eq!(sim.stats().live_streams, before.live_streams + 2);

    // The runtime still refuses: the stream stays kept.
    fail_always(&sim, [AclFunc::RecordEvent, AclFunc::SynchronizeStream]);
    drop(freed);
    pool.trim();
    assert!(
        pool.synchronize().is_err(),
        "the pending free's refused wait is not reported"
    );
    assert_eq!(
        streams_kept_on(&*sim),
        1,
        "a refused retry let the stream go"
    );
    assert!(
        sim.pending_ops(handle).is_ok(),
        "a refused retry destroyed it"
    );
    assert_eq!(sim.stats().live_streams, before.live_streams + 2);
    assert_eq!(pool.stats(MemKind::DEVICE).pending_frees, 1);
    pool.validate().unwrap();

    // It answers again: the pool's synchronize destroys the stream, the free completes.
    sim.clear_faults();
    every_free_completes(&pool);
    assert_eq!(streams_kept_on(&*sim), 0);
    assert!(sim.pending_ops(handle).is_err(), "the kept stream is live");
    assert_eq!(
        sim.stats().live_streams,
        before.live_streams + 1,
        "`t` only"
    );

    // The region that noted the stream has forgotten it: its free needs neither a fence
    // nor a wait.
    fail_always(&sim, [AclFunc::RecordEvent, AclFunc::SynchronizeStream]);
    drop(noted);
    assert_eq!(
        pool.stats(MemKind::DEVICE).pending_frees,
        0,
        "a free waits for a destroyed stream"
    );
    sim.clear_faults();
    drop(t);
    drop_leaving_nothing(pool, &sim, &before);
}

/// A trim destroys a kept stream once it has run its work, without waiting for it: while
/// the work is held, trims leave the stream (recording one probe event on it, not one per
/// trim) and the free behind it; once the work has run, a trim destroys the stream and its
/// probe, and the free completes.
///
/// The 60 s bound only turns a kept stream that trims never destroy into a failure.
#[test]
fn trim_destroys_a_kept_stream_once_it_has_run_its_work() {
    let sim = sim(0);
    let pool = pool_over(&sim);
    let before = sim.stats();
    let s = pool.create_stream().unwrap();
    let handle = s.handle();
    let hold = sim.hold_stream(handle).unwrap();
    let target = filled_on(&pool, &s);
    refuse_next_synchronize(&sim);
    drop(s);
    drop(target);
    let calls = |f| sim.stats().calls(f);
    let (syncs, records) = (
        calls(AclFunc::SynchronizeStream),
        calls(AclFunc::RecordEvent),
    );
    for _ in 0..3 {
        pool.trim();
    }
    assert_eq!(
        calls(AclFunc::SynchronizeStream),
        syncs,
        "a trim waited for a held stream"
    );
    assert_eq!(calls(AclFunc::RecordEvent), records + 1, "one probe");
    assert_eq!(streams_kept_on(&*sim), 1);
    assert_eq!(pool.stats(MemKind::DEVICE).pending_frees, 1);

    hold.release();
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while streams_kept_on(&*sim) > 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "no trim destroyed the kept stream"
        );
        pool.trim();
        std::thread::yield_now();
    }
    assert!(sim.pending_ops(handle).is_err(), "the kept stream is live");
    // The free's event was recorded before the probe: the same trim completed it.
    assert_eq!(pool.stats(MemKind::DEVICE).pending_frees, 0);
    drop_leaving_nothing(pool, &sim, &before);
}

/// A retry waiting for a kept stream holds no lock a drop needs: while the pool's
/// synchronize waits for a held kept stream, another thread drops a stream that is kept and
/// counts the kept streams, both at once. Both streams are destroyed afterwards.
///
/// The 60 s bounds only turn a wait behind the retry into a failure.
#[test]
fn a_drop_does_not_wait_behind_a_retry_waiting_for_a_kept_stream() {
    let sim = sim(0);
    let pool = Arc::new(pool_over(&sim));
    let before = sim.stats().live_streams;
    let s = pool.create_stream().unwrap();
    let held = s.handle();
    refuse_next_synchronize(&sim);
    drop(s);
    let hold = sim.hold_stream(held).unwrap();
    let syncs = || sim.stats().calls(AclFunc::SynchronizeStream);
    let first = syncs();
    let retrier = {
        let pool = Arc::clone(&pool);
        std::thread::spawn(move || pool.synchronize())
    };
    // The retry is waiting for the held stream.
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while syncs() == first {
        assert!(std::time::Instant::now() < deadline, "no retry came");
        std::thread::yield_now();
    }
    let (tx, rx) = std::sync::mpsc::channel();
    let dropper = {
        let (pool, sim) = (Arc::clone(&pool), Arc::clone(&sim));
        std::thread::spawn(move || {
            let u = pool.create_stream().unwrap();
            refuse_next_synchronize(&sim);
            drop(u);
            tx.send(streams_kept_on(&*sim)).unwrap();
        })
    };
    let kept = rx.recv_timeout(Duration::from_secs(60));
    let retrying = !retrier.is_finished();
    hold.release();
    dropper.join().unwrap();
    retrier.join().unwrap().unwrap();
    assert_eq!(
        kept.expect("a drop waited behind a retry waiting for a kept stream"),
        2
    );
    assert!(retrying, "the retry ended before the hold");
    assert!(
        sim.pending_ops(held).is_err(),
        "the retry left the held stream"
    );
    // The stream kept during the retry: the next one destroys it.
    assert_eq!(streams_kept_on(&*sim), 1);
    pool.synchronize().unwrap();
    assert_eq!(
        (streams_kept_on(&*sim), sim.stats().live_streams),
        (0, before)
    );
}

/// Threads drop streams, every other one kept (its synchronize refused), with regions freed
/// behind them, while other threads retry the kept streams through the pool's synchronize
/// and trim: no thread waits for good, and once the runtime answers every kept stream is
/// destroyed and nothing is left.
#[test]
fn retries_race_with_drops_that_keep_streams() {
    use std::sync::atomic::{AtomicBool, Ordering};
    let sim = sim(0);
    let pool = pool_over(&sim);
    let before = sim.stats();
    let stop = AtomicBool::new(false);
    std::thread::scope(|scope| {
        let retriers: Vec<_> = (0..2)
            .map(|_| {
                scope.spawn(|| {
                    while !stop.load(Ordering::Relaxed) {
                        // A retry that met a refused synchronize may report a free's.
                        let _ = pool.synchronize();
                        pool.trim();
                    }
                })
            })
            .collect();
        let droppers: Vec<_> = (0..3)
            .map(|_| {
                scope.spawn(|| {
                    for i in 0..100 {
                        let s = pool.create_stream().unwrap();
                        drop(filled_on(&pool, &s));
                        if i % 2 == 0 {
                            refuse_next_synchronize(&sim);
                        }
                        drop(s);
                    }
                })
            })
            .collect();
        for d in droppers {
            d.join().unwrap();
        }
        stop.store(true, Ordering::Relaxed);
        for r in retriers {
            r.join().unwrap();
        }
    });
    sim.clear_faults();
    // After the frees' wait, which retried the kept streams.
    nothing_live_and_no_refusal(&pool);
    assert_eq!(streams_kept_on(&*sim), 0);
    drop_leaving_nothing(pool, &sim, &before);
}

/// An allocation short of memory waits without the kind's lock for frees deferred while it
/// waited, too: a region freed behind a second held stream during its wait for the first
/// used to be waited for under the lock once the first stream ran, so a third thread's free
/// waited behind the second stream (and one that had to run before it, never would have).
///
/// The 60 s bounds only turn a thread that waits for as long as a hold into a failure.
#[test]
fn a_free_does_not_wait_behind_an_allocation_waiting_for_a_free_deferred_meanwhile() {
    let sim = sim(0);
    let source: Arc<dyn BlockSource> = Arc::clone(&sim) as Arc<dyn BlockSource>;
    // No thread cache: frees and allocations go through the kind's lock.
    let config = PoolConfig::default()
        .with_limit(2 << 20)
        .with_thread_cache(0);
    let pool = Arc::new(Pool::new(source, config).unwrap());
    let (s1, s2) = (pool.create_stream().unwrap(), pool.create_stream().unwrap());
    let hold1 = sim.hold_stream(s1.handle()).unwrap();
    let hold2 = sim.hold_stream(s2.handle()).unwrap();
    let kept = pool.alloc_device(LEN / 2).unwrap();
    let mut later = pool.alloc_device(LEN / 2).unwrap();
    let mut first = pool.alloc_device(LEN / 2).unwrap();
    pool.memset_async(&mut first, 0, 0xAB, LEN / 2, &s1)
        .unwrap();
    pool.memset_async(&mut later, 0, 0xCD, LEN / 2, &s2)
        .unwrap();
    drop(first);
    let st = pool.stats(MemKind::DEVICE);
    assert_eq!(
        (st.pending_frees, st.reserved_bytes),
        (1, 2 << 20),
        "{st:?}"
    );

    let waits = || sim.stats().calls(AclFunc::SynchronizeEvent);
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    let wait_until = |n: u64, waiter: &std::thread::JoinHandle<_>| {
        while waits() < n && !waiter.is_finished() {
            assert!(std::time::Instant::now() < deadline, "no wait came");
            std::thread::yield_now();
        }
    };
    let before = waits();
    // Fits only once `first`'s free completes (and maybe `later`'s).
    let waiter = {
        let pool = Arc::clone(&pool);
        std::thread::spawn(move || pool.alloc_device(LEN * 3 / 4))
    };
    // Waiting for `first`'s stream, without the lock: `later` is freed meanwhile.
    wait_until(before + 1, &waiter);
    drop(later);
    assert_eq!(pool.stats(MemKind::DEVICE).pending_frees, 2);
    hold1.release();
    // The next wait is for `later`'s event (under the lock, it used to be).
    wait_until(before + 2, &waiter);
    let (tx, rx) = std::sync::mpsc::channel();
    let third = {
        let pool = Arc::clone(&pool);
        std::thread::spawn(move || {
            drop(kept);
            drop(pool.alloc_device(LEN / 8).unwrap());
            tx.send(()).unwrap();
        })
    };
    let got = rx.recv_timeout(Duration::from_secs(60));
    hold2.release();
    third.join().unwrap();
    let region = waiter.join().unwrap();
    assert!(
        got.is_ok(),
        "a free waited for a stream an allocation was waiting for under the lock"
    );
    assert!(region.is_ok(), "{region:?}");
    drop(region);
    nothing_live_and_no_refusal(&pool);
}

/// A free whose stream could not be fenced waits for that stream without the kind's lock:
/// it used to wait under it, so another thread's allocation of the kind waited behind a held
/// stream. The memory still waits for the stream's work.
///
/// The 60 s bound only turns an allocation that waits for as long as the hold into a failure.
#[test]
fn a_free_without_an_event_waits_for_its_stream_without_the_kind_lock() {
    let sim = sim(0);
    let source: Arc<dyn BlockSource> = Arc::clone(&sim) as Arc<dyn BlockSource>;
    // No thread cache: frees and allocations go through the kind's lock.
    let config = PoolConfig::default().with_thread_cache(0);
    let pool = Arc::new(Pool::new(source, config).unwrap());
    let s = pool.create_stream().unwrap();
    let mut r = pool.alloc_device(LEN).unwrap();
    let addr = r.addr();
    let hold = sim.hold_stream(s.handle()).unwrap();
    pool.memset_async(&mut r, 0, 0xAB, LEN, &s).unwrap();
    let syncs = || sim.stats().calls(AclFunc::SynchronizeStream);
    let before = syncs();
    // The free's fence fails: it waits for the held stream itself.
    sim.inject_fault(Fault::next(AclFunc::RecordEvent, AclError::RT_FAILURE, 1));
    let freeing = std::thread::spawn(move || drop(r));
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while syncs() == before && !freeing.is_finished() {
        assert!(std::time::Instant::now() < deadline, "no wait came");
        std::thread::yield_now();
    }
    assert_eq!(sim.stats().failures(AclFunc::RecordEvent), 1);
    let (tx, rx) = std::sync::mpsc::channel();
    let other = {
        let pool = Arc::clone(&pool);
        std::thread::spawn(move || {
            let got = pool.alloc_device(LEN).unwrap();
            tx.send(got.addr()).unwrap();
            drop(got);
        })
    };
    let got = rx.recv_timeout(Duration::from_secs(60));
    hold.release();
    other.join().unwrap();
    freeing.join().unwrap();
    let got = got.expect("an allocation waited behind a free waiting for a held stream");
    assert!(
        !overlaps(got, addr, LEN),
        "got memory the held stream may still write"
    );
    every_free_completes(&pool);
    let st = pool.stats(MemKind::DEVICE);
    assert_eq!((st.live_regions, st.pending_frees), (0, 0), "{st:?}");
}

/// A pool over `sim` seen through a [`Watched`] source, and that source.
fn watched_pool(sim: &Arc<SimSource>) -> (Arc<Watched>, Pool) {
    let watched = Arc::new(Watched::new(Arc::clone(sim)));
    let source = Arc::clone(&watched) as Arc<dyn BlockSource>;
    (watched, Pool::new(source, PoolConfig::default()).unwrap())
}

/// A source that panics while a retry destroys a kept stream's wait events loses only the
/// event of the call that panicked: the others stay with the stream, and the next retry
/// destroys them with it. (The drain lost them all.)
#[test]
fn a_retry_whose_source_panics_keeps_the_events_it_has_not_destroyed() {
    let sim = sim(0);
    let (watched, pool) = watched_pool(&sim);
    let (s, other) = (pool.create_stream().unwrap(), pool.create_stream().unwrap());
    // Held, `s` passes none of its waits: each takes an event of its own.
    let hold = sim.hold_stream(s.handle()).unwrap();
    for _ in 0..3 {
        s.wait_for(&other).unwrap();
    }
    refuse_next_synchronize(&sim);
    drop(s);
    hold.release();
    assert_eq!(streams_kept_on(&*watched), 1);
    assert_eq!(sim.stats().live_events, 3, "the three wait events kept");

    watched.panic_in(Call::DestroyEvent);
    assert!(catch_unwind(AssertUnwindSafe(|| pool.synchronize())).is_err());
    assert_eq!(streams_kept_on(&*watched), 1);
    pool.synchronize().unwrap();
    assert_eq!(streams_kept_on(&*watched), 0);
    assert_eq!(
        sim.stats().live_events,
        1,
        "events other than the one whose destroy panicked were lost"
    );
    drop(other);
}

/// A source that panics while a trim records the probe on a kept stream loses no event:
/// the probe is destroyed with the stream by the next retry.
#[test]
fn a_trim_whose_source_panics_recording_the_probe_keeps_the_probe() {
    let sim = sim(0);
    let (watched, pool) = watched_pool(&sim);
    let s = pool.create_stream().unwrap();
    refuse_next_synchronize(&sim);
    drop(s);
    assert_eq!(streams_kept_on(&*watched), 1);

    watched.panic_in(Call::RecordEvent);
    assert!(catch_unwind(AssertUnwindSafe(|| pool.trim())).is_err());
    assert_eq!(streams_kept_on(&*watched), 1);
    pool.synchronize().unwrap();
    assert_eq!(streams_kept_on(&*watched), 0);
    assert_eq!(
        (sim.stats().live_streams, sim.stats().live_events),
        (0, 0),
        "the probe was lost"
    );
}

/// In debug mode a padding overrun is reported once, by the region that made it: a region
/// whose free waited for its stream and was reported there, taken over on that stream by a
/// new region that writes only its own bytes, gives the new region a fresh canary.
#[test]
fn a_segment_taken_over_on_its_stream_gets_a_fresh_canary() {
    let sim = sim(0);
    let pool = debug_pool_over(&sim);
    let s = pool.create_stream().unwrap();
    let hold = sim.hold_stream(s.handle()).unwrap();
    let a = pool.alloc_device_on(100, &s).unwrap();
    let a_addr = a.addr();
    let junk = [0x55u8; 8];
    // SAFETY: bytes 130..138 of a 100-byte segment lie in its padding (128..192).
    unsafe {
        pool.source()
            .memcpy(
                a_addr + 130,
                8,
                junk.as_ptr() as usize,
                8,
                MemcpyKind::HostToDevice,
            )
            .unwrap();
    }
    assert!(matches!(a.free(), Err(Error::Corruption { .. })));
    assert_eq!(pool.stats(MemKind::DEVICE).pending_frees, 1);
    assert_eq!(pool.take_corruption_reports().len(), 1);

    let b = pool.alloc_device_on(100, &s).unwrap();
    assert_eq!(b.addr(), a_addr, "taken over on the same stream");
    // `b` never wrote past its end: its free finds nothing.
    let freed = b.free();
    assert!(freed.is_ok(), "{freed:?}");
    assert!(pool.take_corruption_reports().is_empty());
    // A segment whose canary cannot be written is not taken over: a fresh one serves.
    sim.inject_fault(Fault::next(AclFunc::Memset, AclError::RT_FAILURE, 1));
    let c = pool.alloc_device_on(100, &s).unwrap();
    assert_ne!(c.addr(), a_addr);
    assert_eq!(pool.stats(MemKind::DEVICE).pending_frees, 1);
    assert!(c.free().is_ok());
    drop(hold);
    pool.synchronize().unwrap();
    pool.validate().unwrap();
}

/// In debug mode a region dropped while its stream still had work queued is checked again
/// once that work has run: an overrun the work makes after the drop (a kernel writing past
/// its output, the overrun debug mode is for) is reported then, once.
#[test]
fn an_overrun_queued_on_a_stream_before_the_free_is_reported_when_the_stream_passes() {
    let sim = sim(0);
    let pool = debug_pool_over(&sim);
    let s = pool.create_stream().unwrap();
    for len in [100u64, 1 << 20] {
        let hold = sim.hold_stream(s.handle()).unwrap();
        let d = pool.alloc_device_on(len, &s).unwrap();
        let at = len.next_multiple_of(32) + 2;
        queue_padding_fill(&pool, &d, at, &s);
        // The fill has not run: the free finds the canary whole, and waits for the stream.
        assert!(d.free().is_ok());
        assert_eq!(pool.stats(MemKind::DEVICE).pending_frees, 1);
        hold.release();
        pool.synchronize().unwrap();
        let reports = pool.take_corruption_reports();
        assert!(
            matches!(reports[..], [Error::Corruption { len: l, first_bad, .. }] if l == len && first_bad == at),
            "{reports:?}"
        );
    }
    // An overrun found at the free is not reported a second time when the stream passes.
    let hold = sim.hold_stream(s.handle()).unwrap();
    let d = pool.alloc_device_on(100, &s).unwrap();
    let junk = [0x55u8; 8];
    // SAFETY: bytes 130..138 of a 100-byte segment lie in its padding (128..192).
    unsafe {
        pool.source()
            .memcpy(
                d.addr() + 130,
                8,
                junk.as_ptr() as usize,
                8,
                MemcpyKind::HostToDevice,
            )
            .unwrap();
    }
    assert!(matches!(d.free(), Err(Error::Corruption { .. })));
    hold.release();
    pool.synchronize().unwrap();
    assert_eq!(pool.take_corruption_reports().len(), 1);
    pool.validate().unwrap();
}

/// Set in the child process `an_overrun_queued_before_a_free_is_reported_when_the_pool_drops`
/// runs itself in.
const DROP_CANARY_CHILD: &str = "ASCEND_POOL_DROP_CANARY_CHILD";

/// The pool's drop is one more route by which a deferred free completes (it waits for the
/// streams, then gives the chunks back): in debug mode the canary is checked again there
/// too, so an overrun the queued work made after the free is reported (on stderr, the only
/// place left once the pool is gone) instead of being lost with the pool.
#[test]
fn an_overrun_queued_before_a_free_is_reported_when_the_pool_drops() {
    if std::env::var_os(DROP_CANARY_CHILD).is_none() {
        let (_, stderr) = common_child::rerun_in_child(
            "an_overrun_queued_before_a_free_is_reported_when_the_pool_drops",
            DROP_CANARY_CHILD,
            &[],
        );
        // Exactly one report: the overrun the fill made after the free.
        assert_eq!(stderr.matches("ascend-pool: ").count(), 1, "{stderr}");
        assert!(
            stderr.contains("134"),
            "the first bad byte is named: {stderr}"
        );
        return;
    }
    let sim = sim(0);
    let pool = debug_pool_over(&sim);
    let s = pool.create_stream().unwrap();
    let hold = sim.hold_stream(s.handle()).unwrap();
    let d = pool.alloc_device_on(100, &s).unwrap();
    queue_padding_fill(&pool, &d, 134, &s);
    // The fill has not run: the free finds the canary whole and waits for the stream.
    assert!(d.free().is_ok());
    assert_eq!(pool.stats(MemKind::DEVICE).pending_frees, 1);
    hold.release();
    // Nothing but the pool's drop completes the free (no call of the pool comes between).
    drop(pool);
    drop(s);
}

/// In debug mode a free the runtime gave no event for waits for its stream itself (without
/// the kind lock) and completes then: the canary is checked again at that point too, so an
/// overrun the stream's work made after the drop is reported once, as on the other routes.
#[test]
fn an_overrun_behind_an_unfenced_free_is_reported_when_the_free_completes() {
    let sim = sim(0);
    let pool = debug_pool_over(&sim);
    let s = pool.create_stream().unwrap();
    let hold = sim.hold_stream(s.handle()).unwrap();
    let d = pool.alloc_device_on(100, &s).unwrap();
    let at = 100u64.next_multiple_of(32) + 2;
    queue_padding_fill(&pool, &d, at, &s);
    // No event for the free: it waits for the stream, which is released meanwhile.
    sim.inject_fault(Fault::next(AclFunc::RecordEvent, AclError::RT_FAILURE, 1));
    std::thread::scope(|t| {
        t.spawn(move || {
            std::thread::sleep(std::time::Duration::from_millis(50));
            hold.release();
        });
        assert!(d.free().is_ok(), "the canary is whole at the free");
    });
    assert_eq!(sim.stats().failures(AclFunc::RecordEvent), 1);
    assert_eq!(pool.stats(MemKind::DEVICE).pending_frees, 0);
    let reports = pool.take_corruption_reports();
    assert!(
        matches!(reports[..], [Error::Corruption { len: 100, first_bad, .. }] if first_bad == at),
        "{reports:?}"
    );
    pool.validate().unwrap();
}

/// A model input taken over on its stream starts 128-aligned even where the freed segment's
/// footprint would do: 1,120 bytes take 1,152 under the 64- and the 128-aligned rule alike,
/// and a device segment of that shape starting 64 bytes past a 128-byte boundary is left to
/// its free.
#[test]
fn model_input_on_a_stream_takes_no_segment_starting_only_64_aligned() {
    let sim = sim(0);
    let pool = pool_over(&sim);
    let s = pool.create_stream().unwrap();
    let hold = sim.hold_stream(s.handle()).unwrap();
    // 1,088-byte footprints (17 x 64) and 1,152-byte ones (9 x 128), carved one after
    // another: some 1,120-byte segment starts 64 bytes past a 128-byte boundary.
    let mut regions = Vec::new();
    for _ in 0..4 {
        regions.push(pool.alloc_device_on(1056, &s).unwrap());
        regions.push(pool.alloc_device_on(1120, &s).unwrap());
    }
    let odd = regions
        .iter()
        .position(|r| r.len() == 1120 && r.addr() % 128 != 0)
        .expect("a 1,120-byte segment starting 64-aligned only");
    let mut target = regions.swap_remove(odd);
    let odd_addr = target.addr();
    pool.memset_async(&mut target, 0, 1, 1120, &s).unwrap();
    drop(target); // pending on the held stream alone
    assert_eq!(pool.stats(MemKind::DEVICE).pending_frees, 1);
    let input = pool.alloc_model_input_on(1120, &s).unwrap();
    assert_eq!(input.addr() % 128, 0, "a model input starts 128-aligned");
    assert_ne!(input.addr(), odd_addr);
    assert_eq!(pool.stats(MemKind::DEVICE).pending_frees, 1);
    pool.validate().unwrap();
    hold.release();
    drop((input, regions));
    every_free_completes(&pool);
}
