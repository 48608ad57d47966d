//! Many threads at once on one pool over the simulator's real asynchronous streams.
//!
//! Each thread, with its own stream and a seeded random sequence, allocates regions of every
//! kind and many sizes, writes them synchronously and through async copies (from pinned
//! staging buffers dropped while the copy is queued, and region to region), frees them —
//! often with copies still queued — and hands some to another thread to free. Every region's
//! bytes are compared with a shadow copy. At quiescent points (every thread stopped, its
//! stream drained) one thread runs `validate()` and checks that the statistics add up:
//! live regions minus pending frees equal the regions the threads hold, and cached bytes
//! are never counted as in use. At the end: no corruption report, no leak, every counter
//! back to zero, every chunk returned by `trim`. A last test checks the exact figures and the
//! debug canary of one segment held in a thread cache.

use ascend_pool::region::{AsyncCopySafe, Region};
use ascend_pool::source::sim::{SimConfig, SimSource};
use ascend_pool::{MemKind, Pool, PoolConfig, Stream};
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Barrier};

#[path = "common/regions.rs"]
mod common_regions;
use common_regions::{assert_all_freed, with_region, Any, Rng};

const THREADS: usize = 4;
const STEPS: usize = 600;
/// Steps between quiescent points.
const QUIESCE: usize = 120;
/// Most regions one thread holds.
const MAX_LIVE: usize = 24;

fn pattern(seed: u64, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (seed as u8).wrapping_add((i % 251) as u8))
        .collect()
}

fn len_of(r: &Any) -> u64 {
    with_region!(r, x => x.len())
}

fn write_sync(pool: &Pool, r: &mut Any, data: &[u8]) {
    match r {
        Any::Host(h) => h.as_mut_slice().copy_from_slice(data),
        other => with_region!(other, x => pool.copy_from_host(x, 0, data).unwrap()),
    }
}

fn read(pool: &Pool, r: &Any) -> Vec<u8> {
    let mut out = vec![0u8; len_of(r) as usize];
    match r {
        Any::Host(h) => out.copy_from_slice(h.as_slice()),
        other => with_region!(other, x => pool.copy_to_host(x, 0, &mut out).unwrap()),
    }
    out
}

fn copy_async(
    pool: &Pool,
    dst: &mut Any,
    dst_off: u64,
    src: &impl AsyncCopySafe,
    len: u64,
    stream: &Stream,
) {
    // The runtime does no asynchronous copy within the host: host to host takes the
    // synchronous copy, which first waits for the work queued on both regions.
    with_region!(dst, d => if d.kind().is_device() || src.kind().is_device() {
        pool.copy_async(d, dst_off, src, 0, len, stream).unwrap()
    } else {
        pool.copy(d, dst_off, src, 0, len).unwrap()
    })
}

fn alloc(pool: &Pool, rng: &mut Rng) -> Any {
    let len = match rng.below(10) {
        0..=4 => 1 + rng.below(2048),
        5..=8 => 2048 + rng.below(256 << 10),
        _ => (256 << 10) + rng.below(1 << 20),
    };
    match rng.below(3) {
        0 => Any::Device(pool.alloc_device(len).unwrap()),
        1 => Any::Dvpp(pool.alloc_dvpp(len).unwrap()),
        _ => Any::Host(pool.alloc_host(len).unwrap()),
    }
}

/// Live regions minus pending frees, over every kind.
fn settled_live(pool: &Pool) -> i64 {
    pool.all_stats()
        .iter()
        .map(|s| s.live_regions as i64 - s.pending_frees as i64)
        .sum()
}

/// Returns the regions held in thread caches.
fn check_stats_add_up(pool: &Pool, held: i64) -> u64 {
    for s in pool.all_stats() {
        assert!(
            s.allocated_bytes + s.cached_bytes <= s.reserved_bytes,
            "{:?}: {} allocated + {} cached > {} reserved",
            s.kind,
            s.allocated_bytes,
            s.cached_bytes,
            s.reserved_bytes
        );
        assert!(s.requested_bytes <= s.allocated_bytes);
        assert_eq!(
            s.allocations,
            s.frees + s.live_regions,
            "{:?}: every allocation is freed or live",
            s.kind
        );
    }
    assert_eq!(settled_live(pool), held, "live regions the threads hold");
    pool.all_stats().iter().map(|s| s.cached_regions).sum()
}

fn worker(
    t: usize,
    pool: Arc<Pool>,
    barrier: Arc<Barrier>,
    held: Arc<AtomicI64>,
    most_cached: Arc<AtomicU64>,
    to_next: mpsc::Sender<Any>,
    from_prev: mpsc::Receiver<Any>,
) {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ ((t as u64 + 1) * 0x1234_5678_9abc));
    let stream = pool.create_stream().unwrap();
    let mut live: Vec<(Any, Vec<u8>)> = Vec::new();
    let alloc_tracked = |pool: &Pool, rng: &mut Rng| {
        held.fetch_add(1, Ordering::Relaxed);
        alloc(pool, rng)
    };
    let drop_tracked = |held: &AtomicI64, r: Any| {
        drop(r);
        held.fetch_sub(1, Ordering::Relaxed);
    };
    for step in 0..=STEPS {
        while let Ok(r) = from_prev.try_recv() {
            drop_tracked(&held, r); // freed on another thread than its own
        }
        if step % QUIESCE == 0 {
            stream.synchronize().unwrap();
            for (r, expected) in &live {
                assert!(
                    read(&pool, r) == *expected,
                    "thread {t}: data differs at step {step}"
                );
            }
            barrier.wait();
            if t == 0 {
                pool.validate().unwrap();
                let cached = check_stats_add_up(&pool, held.load(Ordering::Relaxed));
                most_cached.fetch_max(cached, Ordering::Relaxed);
            }
            barrier.wait();
            if step == STEPS {
                break;
            }
        }
        match rng.below(12) {
            0..=2 if live.len() < MAX_LIVE => {
                let mut r = alloc_tracked(&pool, &mut rng);
                let data = pattern(rng.next(), len_of(&r) as usize);
                write_sync(&pool, &mut r, &data);
                live.push((r, data));
            }
            3 | 4 if !live.is_empty() => {
                // Async write from a staging buffer dropped while the copy is queued.
                let i = rng.below(live.len() as u64) as usize;
                let len = live[i].1.len() as u64;
                let offset = rng.below(len) / 64 * 64;
                let n = (len - offset).min(1 + rng.below(128 << 10));
                let mut staging = pool.alloc_host(n).unwrap();
                let data = pattern(rng.next(), n as usize);
                staging.as_mut_slice().copy_from_slice(&data);
                copy_async(&pool, &mut live[i].0, offset, &staging, n, &stream);
                drop(staging);
                live[i].1[offset as usize..(offset + n) as usize].copy_from_slice(&data);
            }
            5 if live.len() >= 2 => {
                // Region to region on the stream.
                let i = rng.below(live.len() as u64) as usize;
                let j = (i + 1 + rng.below(live.len() as u64 - 1) as usize) % live.len();
                let n = live[i].1.len().min(live[j].1.len()) as u64;
                let n = 1 + rng.below(n);
                let (lo, hi) = live.split_at_mut(i.max(j));
                let (dst, src) = if i < j {
                    (&mut lo[i], &hi[0])
                } else {
                    (&mut hi[0], &lo[j])
                };
                with_region!(&src.0, s => copy_async(&pool, &mut dst.0, 0, s, n, &stream));
                let bytes = src.1[..n as usize].to_vec();
                dst.1[..n as usize].copy_from_slice(&bytes);
            }
            6 if !live.is_empty() => {
                // A host-side write must not race the queued ones.
                stream.synchronize().unwrap();
                let i = rng.below(live.len() as u64) as usize;
                let data = pattern(rng.next(), live[i].1.len());
                write_sync(&pool, &mut live[i].0, &data);
                live[i].1 = data;
            }
            7 if !live.is_empty() => {
                stream.synchronize().unwrap();
                let i = rng.below(live.len() as u64) as usize;
                assert!(
                    read(&pool, &live[i].0) == live[i].1,
                    "thread {t}: data differs"
                );
            }
            8..=10 if !live.is_empty() => {
                // Freed, often with copies still queued into or out of it.
                let i = rng.below(live.len() as u64) as usize;
                let (r, _) = live.swap_remove(i);
                drop_tracked(&held, r);
            }
            11 if !live.is_empty() => {
                let i = rng.below(live.len() as u64) as usize;
                let (r, _) = live.swap_remove(i);
                to_next.send(r).unwrap();
            }
            _ => {}
        }
    }
    for (r, _) in live {
        drop_tracked(&held, r);
    }
    // Wait until every thread has stopped sending, then free what is left in the channel.
    barrier.wait();
    while let Ok(r) = from_prev.try_recv() {
        drop_tracked(&held, r);
    }
    drop(stream);
}

fn run(config: PoolConfig) {
    let caches_on = config.thread_cache > 0;
    let sim = SimSource::new(
        SimConfig::default()
            .with_device_capacity(1 << 30)
            .with_host_capacity(1 << 30)
            .with_dvpp_limit(1 << 30)
            // Copies take real time, so reuse before a stream passes would corrupt data.
            .with_copy_bandwidth(4_000_000_000),
    )
    .unwrap();
    let pool = Arc::new(Pool::new(Arc::new(sim), config).unwrap());
    let barrier = Arc::new(Barrier::new(THREADS));
    let held = Arc::new(AtomicI64::new(0));
    let most_cached = Arc::new(AtomicU64::new(0));
    let (senders, receivers): (Vec<_>, Vec<_>) = (0..THREADS).map(|_| mpsc::channel()).unzip();
    let handles: Vec<_> = receivers
        .into_iter()
        .enumerate()
        .map(|(t, rx)| {
            let tx = senders[(t + 1) % THREADS].clone();
            let (pool, barrier) = (Arc::clone(&pool), Arc::clone(&barrier));
            let (held, most_cached) = (Arc::clone(&held), Arc::clone(&most_cached));
            std::thread::spawn(move || worker(t, pool, barrier, held, most_cached, tx, rx))
        })
        .collect();
    drop(senders);
    for h in handles {
        h.join().unwrap();
    }
    assert_eq!(held.load(Ordering::Relaxed), 0);
    // The caches were in use (or off) at the quiescent points.
    assert_eq!(most_cached.load(Ordering::Relaxed) > 0, caches_on);
    assert!(
        pool.take_corruption_reports().is_empty(),
        "corruption reported"
    );
    pool.synchronize().unwrap();
    pool.validate().unwrap();
    assert!(
        pool.leak_report().is_empty(),
        "leaks: {:?}",
        pool.leak_report()
    );
    // The threads have exited, so their caches went back with them.
    assert_all_freed(&pool);
    assert!(pool.stats(MemKind::DEVICE).allocations > 0);
    assert_eq!(pool.flush_thread_caches(), 0);
    pool.trim();
    for s in pool.all_stats() {
        assert_eq!((s.reserved_bytes, s.chunks), (0, 0), "{:?}", s.kind);
    }
    pool.validate().unwrap();
}

#[test]
fn many_threads_with_thread_caches_and_canaries() {
    run(PoolConfig::default()
        .with_chunk_size(8 << 20)
        .with_debug(true));
}

#[test]
fn many_threads_without_thread_caches() {
    run(PoolConfig::default()
        .with_chunk_size(8 << 20)
        .with_thread_cache(0));
}

#[test]
fn cached_segments_keep_exact_stats_and_their_canaries() {
    use ascend_pool::source::MemcpyKind;
    let pool = Pool::new(
        Arc::new(SimSource::default()),
        PoolConfig::default().with_debug(true),
    )
    .unwrap();
    let a = pool.alloc_device(100).unwrap();
    let addr = a.addr();
    let fresh = pool.stats(MemKind::DEVICE);
    drop(a); // kept in this thread's cache
    let s = pool.stats(MemKind::DEVICE);
    assert_eq!(
        (s.live_regions, s.allocated_bytes, s.requested_bytes),
        (0, 0, 0)
    );
    assert_eq!((s.cached_regions, s.cached_bytes), (1, 192));
    assert_eq!((s.allocations, s.frees), (1, 1));
    assert_eq!(s.reserved_bytes, fresh.reserved_bytes);
    assert!(
        pool.leak_report().is_empty(),
        "a cached segment is not a leak"
    );
    let snap = serde_json::to_value(pool.snapshot()).unwrap();
    assert_eq!(snap["kinds"][0]["chunks"][0]["segments"][0]["cached"], true);
    pool.validate().unwrap();

    // A write into its padding while it sits in the cache (a use after free) is reported
    // when the segment is handed out again, and the new owner gets a fresh canary.
    let junk = [0x55u8; 4];
    // SAFETY: bytes 130..134 lie in the cached segment's padding (128..192), still carved.
    unsafe {
        pool.source()
            .memcpy(
                addr + 130,
                4,
                junk.as_ptr() as usize,
                4,
                MemcpyKind::HostToDevice,
            )
            .unwrap();
    }
    let b = pool.alloc_device(100).unwrap();
    assert_eq!(b.addr(), addr, "served from the cache");
    assert_eq!(pool.take_corruption_reports().len(), 1);
    let s = pool.stats(MemKind::DEVICE);
    assert_eq!((s.live_regions, s.cached_regions, s.allocations), (1, 0, 2));
    b.free().unwrap();
    assert!(pool.take_corruption_reports().is_empty());

    // Flushing gives it back to the kind pool; the counters do not move.
    assert_eq!(pool.flush_thread_caches(), 192);
    let s = pool.stats(MemKind::DEVICE);
    assert_eq!(
        (s.cached_regions, s.cached_bytes, s.live_regions),
        (0, 0, 0)
    );
    assert_eq!((s.allocations, s.frees), (2, 2));
    pool.validate().unwrap();
}

/// A debug pool in a long run whose overruns nobody takes keeps at most
/// `CORRUPTION_REPORTS_MAX` of them (every one is still printed): the list does not grow
/// with the run.
#[test]
fn corruption_reports_nobody_takes_stay_bounded() {
    use ascend_pool::pool::CORRUPTION_REPORTS_MAX;
    use ascend_pool::source::MemcpyKind;
    let pool = Pool::new(
        Arc::new(SimSource::default()),
        PoolConfig::default().with_debug(true).with_thread_cache(0),
    )
    .unwrap();
    let junk = [0x55u8; 4];
    let overrun = |n: usize| {
        for _ in 0..n {
            let a = pool.alloc_device(100).unwrap();
            // SAFETY: bytes 130..134 lie in the live segment's padding (128..192).
            unsafe {
                pool.source()
                    .memcpy(
                        a.addr() + 130,
                        4,
                        junk.as_ptr() as usize,
                        4,
                        MemcpyKind::HostToDevice,
                    )
                    .unwrap();
            }
            drop(a);
        }
    };
    overrun(CORRUPTION_REPORTS_MAX + 10);
    overrun(CORRUPTION_REPORTS_MAX + 10);
    assert_eq!(pool.take_corruption_reports().len(), CORRUPTION_REPORTS_MAX);
    overrun(3);
    assert_eq!(pool.take_corruption_reports().len(), 3);
}
