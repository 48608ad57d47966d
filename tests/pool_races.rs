//! Races between the pool's operations on several threads, driven deterministically.
//!
//! A wrapper source stops one thread inside a chosen source call (while it holds whatever
//! lock the pool holds around that call) until the test lets it go, so the other thread's
//! steps land exactly in that window. Verdicts never depend on timing: where the test
//! waits for the other thread to reach a point, it polls a figure that only that point
//! changes.

use ascend_pool::source::sim::{SimConfig, SimSource};
use ascend_pool::source::BlockSource;
use ascend_pool::{MallocPolicy, MemKind, Pool, PoolConfig};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

#[path = "common/regions.rs"]
mod common_regions;

#[path = "common/hooked.rs"]
mod common_hooked;
use common_hooked::{Call, Hook, Hooked};

const MIB: u64 = 1 << 20;
const CACHED: MemKind = MemKind::Cached(MallocPolicy::HugeFirst);

/// Stops a thread inside one call: the next `free_block` of a cached-memory block, once
/// `armed`, waits at `paused` (the test then knows it is there) and then at `resume` before
/// the block is freed.
#[derive(Debug)]
struct Pause {
    armed: AtomicBool,
    /// Stops the next `memset` (the debug canary a new segment gets) the same way.
    armed_memset: AtomicBool,
    paused: Barrier,
    resume: Barrier,
}

impl Pause {
    fn new() -> Self {
        Self {
            armed: AtomicBool::new(false),
            armed_memset: AtomicBool::new(false),
            paused: Barrier::new(2),
            resume: Barrier::new(2),
        }
    }

    /// Stops here, once `armed` was set, until the test lets the thread go.
    fn stop_if(&self, armed: &AtomicBool) {
        if armed.swap(false, Ordering::SeqCst) {
            self.paused.wait();
            self.resume.wait();
        }
    }
}

impl Hook for Pause {
    fn on(&self, call: Call) {
        match call {
            Call::FreeBlock(MemKind::Cached(_)) => self.stop_if(&self.armed),
            Call::Memset => self.stop_if(&self.armed_memset),
            _ => {}
        }
    }
}

/// The simulator with one call that can be made to stop ([`Pause`]).
type Pausing = Hooked<Pause>;

/// Polls `cond` until it holds; panics after a minute (a hang, not a verdict).
fn wait_until(what: &str, cond: impl Fn() -> bool) {
    let t0 = Instant::now();
    while !cond() {
        assert!(t0.elapsed() < Duration::from_secs(60), "never saw {what}");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// A device on which the default device kind holds an 8 MiB chunk with 6 MiB in use and
/// the cached kind an 8 MiB chunk whose one segment was freed (it waits in a shape slot; a
/// release threshold that high keeps the chunk): 1 MiB of the device is left, too little
/// for a new chunk, while 8 MiB of it lies idle in the cached kind.
fn a_full_device_with_idle_cached_memory() -> (
    Arc<SimSource>,
    Arc<Pausing>,
    Arc<Pool>,
    ascend_pool::DeviceRegion,
) {
    let probe = SimSource::default();
    let block = probe.rounded_size(MemKind::DEVICE, 8 * MIB).unwrap();
    let capacity = 2 * block + MIB;
    let sim =
        Arc::new(SimSource::new(SimConfig::default().with_device_capacity(capacity)).unwrap());
    let source = Arc::new(Pausing::with(Arc::clone(&sim), Pause::new()));
    let config = PoolConfig::default()
        .with_chunk_size(16 * MIB)
        .with_release_threshold(1 << 40);
    let pool = Arc::new(Pool::new(Arc::clone(&source) as Arc<dyn BlockSource>, config).unwrap());
    let filler = pool.alloc_device(6 * MIB).unwrap();
    drop(pool.alloc_device_kind(CACHED, 6 * MIB).unwrap());
    let (device, cached) = (pool.stats(MemKind::DEVICE), pool.stats(CACHED));
    assert_eq!(
        (
            device.reserved_bytes,
            cached.reserved_bytes,
            cached.live_regions,
            device.ooms
        ),
        (8 * MIB, 8 * MIB, 0, 0),
        "{device:?} {cached:?}"
    );
    (sim, source, pool, filler)
}

/// The same two 3 MiB device requests one after the other both succeed: the first takes
/// the cached kind's idle chunk back from the source's refusal and grows by 4 MiB, the
/// second grows by the 4 MiB left. (The baseline for the race below.)
#[test]
fn two_device_requests_in_turn_both_take_back_the_idle_cached_memory() {
    let (_sim, _source, pool, filler) = a_full_device_with_idle_cached_memory();
    let a = pool.alloc_device(3 * MIB).unwrap();
    let b = pool.alloc_device(3 * MIB).unwrap();
    assert_eq!(pool.stats(MemKind::DEVICE).ooms, 0);
    drop((a, b, filler));
    pool.validate().unwrap();
}

/// The same two requests at once. Both are refused by the source; A's pass across kinds
/// gives the cached chunk back, and B's pass, which comes after it, finds nothing left to
/// give back and so never tries again: B fails with OutOfMemory although the source has
/// 4 MiB free, enough for B, as the call made right after it shows. The refusal is also
/// counted in `ooms`.
#[test]
fn a_device_request_refused_while_another_takes_back_idle_memory_tries_again() {
    let (sim, source, pool, filler) = a_full_device_with_idle_cached_memory();
    source.hook.armed.store(true, Ordering::SeqCst);
    let a = {
        let pool = Arc::clone(&pool);
        std::thread::spawn(move || pool.alloc_device(3 * MIB))
    };
    // A is refused, and stops in its pass across kinds, holding the cached kind's lock,
    // as it gives that kind's empty chunk back.
    source.hook.paused.wait();
    assert_eq!(pool.stats(MemKind::DEVICE).ooms, 1, "A's refusal");
    let b = {
        let pool = Arc::clone(&pool);
        std::thread::spawn(move || pool.alloc_device(3 * MIB))
    };
    // B's growth is refused too (the device is still full): it counts its refusal under the
    // device kind's lock, then starts its own pass, and waits for the cached kind's lock.
    wait_until("B's refusal", || pool.stats(MemKind::DEVICE).ooms == 2);
    source.hook.resume.wait();
    let a = a.join().unwrap();
    let b = b.join().unwrap();
    let a = a.expect("A takes the cached chunk back");
    let free_now = sim.mem_info(0, MemKind::DEVICE).unwrap().0;
    let b_result = match b {
        Ok(r) => Ok(r),
        Err(e) => {
            // Whether B's request could have been served: the same call once more.
            let again = pool.alloc_device(3 * MIB).map(drop);
            Err(format!(
                "{e:?}; device bytes free then: {free_now}; the same request again: {:?}; \
                 stats: {:?}",
                again.map_err(|e| e.to_string()),
                pool.stats(MemKind::DEVICE)
            ))
        }
    };
    let b = b_result.unwrap_or_else(|why| panic!("B was refused: {why}"));
    assert_eq!(pool.stats(MemKind::DEVICE).ooms, 0);
    drop((a, b, filler));
    pool.validate().unwrap();
}

/// `trim` returns the bytes it gave back. A chunk whose last segment waited in this thread's
/// cache goes back as trim flushes the cache (the free past the release threshold gives it
/// back itself), before trim's own pass over empty chunks, which then finds none.
#[test]
fn trim_counts_the_chunks_its_own_flush_gives_back() {
    let sim = Arc::new(SimSource::default());
    let pool = Pool::new(sim, PoolConfig::default().with_release_threshold(0)).unwrap();
    drop(pool.alloc_device(4096).unwrap()); // into this thread's cache
    let held = pool.stats(MemKind::DEVICE);
    assert_eq!((held.cached_regions, held.chunks), (1, 1), "{held:?}");
    let released = pool.trim();
    assert_eq!(pool.stats(MemKind::DEVICE).reserved_bytes, 0);
    assert_eq!(released, held.reserved_bytes, "bytes trim says it released");
}

/// In debug mode an allocation lets the kind lock go while it writes the new segment's
/// canary, with the segment already counted in `allocated_bytes`: a thread reading the
/// figures meanwhile must not see `peak_allocated_bytes` below `allocated_bytes` (the peaks
/// were raised only once the lock was back).
#[test]
fn a_debug_allocation_is_never_seen_above_its_peak() {
    let sim = Arc::new(SimSource::default());
    let source = Arc::new(Pausing::with(Arc::clone(&sim), Pause::new()));
    let config = PoolConfig::default().with_debug(true);
    let pool = Arc::new(Pool::new(Arc::clone(&source) as Arc<dyn BlockSource>, config).unwrap());
    source.hook.armed_memset.store(true, Ordering::SeqCst);
    let a = {
        let pool = Arc::clone(&pool);
        std::thread::spawn(move || pool.alloc_device(4000).map(drop))
    };
    source.hook.paused.wait(); // A is writing its canary, the kind lock let go
    let seen = pool.stats(MemKind::DEVICE);
    let snap = pool.snapshot().kinds[0].stats;
    source.hook.resume.wait();
    a.join().unwrap().unwrap();
    for s in [seen, snap] {
        assert!(
            s.peak_allocated_bytes >= s.allocated_bytes + s.cached_bytes
                && s.peak_requested_bytes >= s.requested_bytes,
            "a peak below its figure: {s:?}"
        );
    }
}

mod stress {
    //! Worker threads allocate and free every kind and size class (thread-cache sizes,
    //! shape-slot sizes, dedicated chunks), on and off their streams (deferred frees, frees
    //! taken over on the same stream), hand regions to each other, start short-lived
    //! threads that exit with a full cache, and run short of device memory (so device kinds
    //! take idle memory back from each other), while a checker thread runs `validate`,
    //! `stats`, `snapshot`, `leak_report`, `trim`, `flush_thread_caches` and `synchronize`
    //! over and over. Each region carries a tag of its own at offset 0, written when it is
    //! handed out and compared before it is freed: a segment handed out twice would show
    //! another holder's tag. The verdict depends on no timing: `validate` must pass every
    //! time, the figures must obey the inequalities that hold at any instant, and at the end
    //! every counter is back to zero and every block back with the source.

    use super::*;
    use crate::common_regions::{assert_all_freed, with_region, Any, Rng};
    use ascend_pool::region::Region;
    use ascend_pool::Stream;
    use std::sync::atomic::AtomicU64;
    use std::sync::mpsc;

    const WORKERS: usize = 3;
    const STEPS: usize = 12_000;

    fn write_tag(pool: &Pool, r: &mut Any, tag: u64) {
        let bytes = tag.to_le_bytes();
        match r {
            Any::Host(h) => h.as_mut_slice()[..8].copy_from_slice(&bytes),
            other => with_region!(other, x => pool.copy_from_host(x, 0, &bytes).unwrap()),
        }
    }

    fn read_tag(pool: &Pool, r: &Any) -> u64 {
        let mut bytes = [0u8; 8];
        match r {
            Any::Host(h) => bytes.copy_from_slice(&h.as_slice()[..8]),
            other => with_region!(other, x => pool.copy_to_host(x, 0, &mut bytes).unwrap()),
        }
        u64::from_le_bytes(bytes)
    }

    /// A region of a random kind and size class; `None` when the device is out of memory.
    fn alloc(pool: &Pool, rng: &mut Rng, stream: &Stream) -> Option<Any> {
        let len = match rng.below(10) {
            0..=5 => 64 + rng.below(32 << 10),         // thread caches
            6..=8 => (300 << 10) + rng.below(3 << 20), // shape slots
            _ => (4 << 20) + rng.below(6 << 20),       // dedicated chunks
        };
        // A few recurring shapes, so slots and caches are hit.
        let len = if rng.below(2) == 0 {
            len / 4096 * 4096 + 64
        } else {
            len
        };
        let r = match rng.below(7) {
            0 => pool.alloc_device(len).map(Any::Device),
            1 => pool.alloc_device_on(len, stream).map(Any::Device),
            2 => pool.alloc_device_kind(CACHED, len).map(Any::Device),
            3 => pool
                .alloc_device_kind(MemKind::DeviceAlign32(MallocPolicy::HugeFirst), len)
                .map(Any::Device),
            4 => pool.alloc_dvpp(len).map(Any::Dvpp),
            5 => pool.alloc_dvpp_on(len, stream).map(Any::Dvpp),
            _ => pool.alloc_host(len).map(Any::Host),
        };
        match r {
            Ok(r) => Some(r),
            Err(ascend_pool::Error::OutOfMemory { .. }) => None,
            Err(e) => panic!("allocation of {len} bytes: {e:?}"),
        }
    }

    /// Queues a fill past the tag on `stream`, where the kind allows one.
    fn queue_work(pool: &Pool, r: &mut Any, stream: &Stream) {
        match r {
            Any::Host(_) => {}
            other => with_region!(other, x => {
                let len = x.len();
                if len >= 128 {
                    pool.memset_async(x, 64, 0x5A, (len - 64).min(64 << 10), stream).unwrap();
                }
            }),
        }
    }

    /// Compares the tag and frees the region (often with work still queued on it).
    fn free_checked(pool: &Pool, r: Any, tag: u64, stream: &Stream, rng: &mut Rng) {
        let mut r = r;
        assert_eq!(
            read_tag(pool, &r),
            tag,
            "another holder wrote into this region"
        );
        if rng.below(3) == 0 {
            queue_work(pool, &mut r, stream);
        }
        drop(r);
    }

    /// The checks that hold at any instant.
    fn check_figures(pool: &Pool) {
        pool.validate().unwrap();
        for s in pool.all_stats() {
            assert!(
                s.allocated_bytes + s.cached_bytes <= s.reserved_bytes,
                "allocated + cached past reserved: {s:?}"
            );
            assert!(s.requested_bytes <= s.allocated_bytes, "{s:?}");
            assert!(
                s.peak_allocated_bytes >= s.allocated_bytes + s.cached_bytes,
                "a peak below the figure: {s:?}"
            );
            assert!(s.peak_reserved_bytes >= s.reserved_bytes, "{s:?}");
            assert!(s.pending_frees <= s.live_regions, "{s:?}");
        }
    }

    fn worker(
        t: usize,
        pool: Arc<Pool>,
        next_tag: Arc<AtomicU64>,
        to_next: mpsc::Sender<(Any, u64)>,
        from_prev: mpsc::Receiver<(Any, u64)>,
        done: Arc<Barrier>,
    ) -> u64 {
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ ((t as u64 + 1) * 0x1234_5678_9abc));
        let stream = pool.create_stream().unwrap();
        let mut live: Vec<(Any, u64)> = Vec::new();
        let mut refused = 0;
        for step in 0..STEPS {
            while let Ok((r, tag)) = from_prev.try_recv() {
                free_checked(&pool, r, tag, &stream, &mut rng);
            }
            match rng.below(20) {
                0..=7 if live.len() < 12 => match alloc(&pool, &mut rng, &stream) {
                    Some(mut r) => {
                        let tag = next_tag.fetch_add(1, Ordering::Relaxed);
                        write_tag(&pool, &mut r, tag);
                        if rng.below(2) == 0 {
                            queue_work(&pool, &mut r, &stream);
                        }
                        live.push((r, tag));
                    }
                    None => refused += 1,
                },
                8..=14 if !live.is_empty() => {
                    let (r, tag) = live.swap_remove(rng.below(live.len() as u64) as usize);
                    free_checked(&pool, r, tag, &stream, &mut rng);
                }
                15 if !live.is_empty() => {
                    let item = live.swap_remove(rng.below(live.len() as u64) as usize);
                    to_next.send(item).unwrap();
                }
                16 if step % 50 == 0 => {
                    // A short-lived thread: its frees stay in its cache until it exits.
                    let pool_ = Arc::clone(&pool);
                    let next_tag = Arc::clone(&next_tag);
                    let seed = rng.next();
                    let short_lived = std::thread::spawn(move || {
                        let pool = pool_;
                        let mut rng = Rng(seed | 1);
                        let stream = pool.create_stream().unwrap();
                        let mut mine = Vec::new();
                        let mut refused = 0u64;
                        for _ in 0..8 {
                            match alloc(&pool, &mut rng, &stream) {
                                Some(mut r) => {
                                    let tag = next_tag.fetch_add(1, Ordering::Relaxed);
                                    write_tag(&pool, &mut r, tag);
                                    mine.push((r, tag));
                                }
                                None => refused += 1,
                            }
                        }
                        for (r, tag) in mine {
                            free_checked(&pool, r, tag, &stream, &mut rng);
                        }
                        refused
                    })
                    .join()
                    .unwrap();
                    refused += short_lived;
                }
                17 => {
                    for (r, tag) in &live {
                        assert_eq!(read_tag(&pool, r), *tag, "thread {t} step {step}");
                    }
                }
                _ => {}
            }
        }
        for (r, tag) in live {
            free_checked(&pool, r, tag, &stream, &mut rng);
        }
        // Every worker has stopped sending: free what is left in the channel.
        done.wait();
        while let Ok((r, tag)) = from_prev.try_recv() {
            free_checked(&pool, r, tag, &stream, &mut rng);
        }
        refused
    }

    #[test]
    fn every_pool_operation_at_once_keeps_the_pool_whole() {
        run(false);
    }

    /// The same with debug canaries (no shape slots then, and the kind lock let go while a
    /// new segment's canary is written).
    #[test]
    fn every_pool_operation_at_once_keeps_the_pool_whole_with_canaries() {
        run(true);
    }

    fn run(debug: bool) {
        let sim = Arc::new(
            SimSource::new(
                SimConfig::default()
                    .with_device_capacity(64 * MIB)
                    .with_op_latency(Duration::from_micros(20)),
            )
            .unwrap(),
        );
        let config = PoolConfig::default()
            .with_chunk_size(8 * MIB)
            .with_release_threshold(16 * MIB)
            .with_thread_cache(1 << 20)
            .with_debug(debug);
        let pool = Arc::new(Pool::new(Arc::clone(&sim) as Arc<dyn BlockSource>, config).unwrap());
        let next_tag = Arc::new(AtomicU64::new(1));
        let stop = Arc::new(AtomicBool::new(false));
        let checker = {
            let (pool, stop) = (Arc::clone(&pool), Arc::clone(&stop));
            std::thread::spawn(move || {
                let mut rounds = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    check_figures(&pool);
                    let snap = pool.snapshot();
                    assert!(snap.kinds.len() <= 5);
                    let _ = pool.leak_report();
                    match rounds % 4 {
                        0 => drop(pool.trim()),
                        1 => drop(pool.flush_thread_caches()),
                        2 => pool.synchronize().unwrap(),
                        _ => {}
                    }
                    rounds += 1;
                }
                rounds
            })
        };
        let done = Arc::new(Barrier::new(WORKERS));
        let (senders, receivers): (Vec<_>, Vec<_>) = (0..WORKERS).map(|_| mpsc::channel()).unzip();
        let workers: Vec<_> = receivers
            .into_iter()
            .enumerate()
            .map(|(t, rx)| {
                let tx = senders[(t + 1) % WORKERS].clone();
                let (pool, next_tag, done) =
                    (Arc::clone(&pool), Arc::clone(&next_tag), Arc::clone(&done));
                std::thread::spawn(move || worker(t, pool, next_tag, tx, rx, done))
            })
            .collect();
        drop(senders);
        let refused: u64 = workers.into_iter().map(|w| w.join().unwrap()).sum();
        stop.store(true, Ordering::Relaxed);
        let rounds = checker.join().unwrap();
        assert!(rounds > 0);
        pool.synchronize().unwrap();
        pool.flush_thread_caches();
        check_figures(&pool);
        assert!(pool.leak_report().is_empty(), "{:?}", pool.leak_report());
        assert_all_freed(&pool);
        pool.trim();
        for s in pool.all_stats() {
            assert_eq!((s.reserved_bytes, s.chunks), (0, 0), "{s:?}");
        }
        let ooms: u64 = pool.all_stats().iter().map(|s| s.ooms).sum();
        eprintln!("refused {refused}, counted {ooms}, checker rounds {rounds}");
        assert_eq!(
            ooms, refused,
            "every refusal counted once, and nothing else"
        );
        assert!(pool.take_corruption_reports().is_empty());
        drop(pool);
        assert_eq!(sim.stats().live_blocks, 0);
    }
}

/// Memory a held stream is still to write is never handed out, whatever other threads do
/// meanwhile: allocate and free its shape (through their caches and the shape slots), trim,
/// flush every cache, exit, and allocate on streams of their own.
#[test]
fn memory_a_held_stream_still_writes_is_never_handed_out_while_threads_churn() {
    use ascend_pool::Region;
    let sim = Arc::new(SimSource::default());
    let pool = Arc::new(
        Pool::new(
            Arc::clone(&sim) as Arc<dyn BlockSource>,
            PoolConfig::default(),
        )
        .unwrap(),
    );
    let stream = pool.create_stream().unwrap();
    let mut fenced = Vec::new();
    let hold = sim.hold_stream(stream.handle()).unwrap();
    for len in [4096u64, 1 << 20] {
        let mut r = pool.alloc_device(len).unwrap();
        pool.memset_async(&mut r, 0, 0xAB, len, &stream).unwrap();
        fenced.push((r.addr(), len));
        drop(r); // its free waits for the held stream
    }
    assert_eq!(pool.stats(MemKind::DEVICE).pending_frees, 2);
    let fenced = Arc::new(fenced);
    let overlaps = |addr: usize, len: u64, fenced: &[(usize, u64)]| {
        fenced
            .iter()
            .any(|&(a, l)| addr < a + l as usize && a < addr + len as usize)
    };
    let threads: Vec<_> = (0..3)
        .map(|t| {
            let (pool, fenced) = (Arc::clone(&pool), Arc::clone(&fenced));
            std::thread::spawn(move || {
                let own = pool.create_stream().unwrap();
                for i in 0..2000u64 {
                    let len = if i % 2 == 0 { 4096 } else { 1 << 20 };
                    let r = if i % 5 == 0 {
                        pool.alloc_device_on(len, &own).unwrap()
                    } else {
                        pool.alloc_device(len).unwrap()
                    };
                    assert!(!overlaps(r.addr(), len, &fenced), "thread {t} step {i}");
                    drop(r);
                    match (t, i % 97) {
                        (0, 0) => drop(pool.trim()),
                        (1, 0) => drop(pool.flush_thread_caches()),
                        (2, 0) => {
                            let pool = Arc::clone(&pool);
                            let fenced = Arc::clone(&fenced);
                            std::thread::spawn(move || {
                                let rs: Vec<_> =
                                    (0..4).map(|_| pool.alloc_device(4096).unwrap()).collect();
                                for r in &rs {
                                    assert!(!overlaps(r.addr(), 4096, &fenced));
                                }
                            })
                            .join()
                            .unwrap();
                        }
                        _ => {}
                    }
                }
            })
        })
        .collect();
    let results: Vec<_> = threads.into_iter().map(|t| t.join()).collect();
    let pending_at: Vec<usize> = pool
        .snapshot()
        .kinds
        .iter()
        .flat_map(|k| k.chunks.iter().flat_map(|c| c.segments.iter()))
        .filter(|s| s.pending)
        .map(|s| s.addr)
        .collect();
    let still_pending = fenced
        .iter()
        .filter(|(a, _)| pending_at.contains(a))
        .count();
    hold.release();
    for r in results {
        r.unwrap();
    }
    assert_eq!(
        still_pending, 2,
        "a free completed before its stream passed it"
    );
    pool.synchronize().unwrap();
    pool.validate().unwrap();
    let s = pool.stats(MemKind::DEVICE);
    assert_eq!((s.pending_frees, s.live_regions), (0, 0), "{s:?}");
}

/// A device request the source refused, that tries again once another kind gave memory back
/// and is then refused for another reason (a runtime failure, not counted as an
/// out-of-memory itself), still counts its first refusal in `ooms`: one refusal per
/// refused request, whatever ended it.
#[test]
fn a_request_refused_again_for_another_reason_counts_its_refusal() {
    use ascend_pool::source::sim::{AclFunc, Fault};
    use ascend_pool::AclError;
    let malloc = AclFunc::alloc_for(MemKind::DEVICE);
    // The source calls the request makes when its retry succeeds; the last is the retry's.
    let calls = {
        let (sim, _source, pool, filler) = a_full_device_with_idle_cached_memory();
        let before = sim.stats().calls(malloc);
        let a = pool.alloc_device(3 * MIB).unwrap();
        drop((a, filler));
        sim.stats().calls(malloc) - before
    };
    let (sim, _source, pool, filler) = a_full_device_with_idle_cached_memory();
    sim.inject_fault(Fault::after(malloc, AclError::RT_FAILURE, calls - 1));
    let refused = pool.alloc_device(3 * MIB).unwrap_err();
    assert!(
        matches!(refused, ascend_pool::Error::Runtime { code, .. } if code == AclError::RT_FAILURE),
        "{refused:?}"
    );
    assert_eq!(pool.stats(MemKind::DEVICE).ooms, 1);
    drop(filler);
    pool.validate().unwrap();
}
