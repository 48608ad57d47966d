//! Allocate/free throughput of the whole pool from 1, 2 and 4 threads at once, small and
//! medium sizes, on the simulator.
//!
//! Each thread repeatedly allocates a batch of device regions of one size and drops them
//! all; throughput counts allocations plus frees across all threads. Variants, in the same
//! run:
//! - `pool`: the pool as configured by default (per-thread caches in front of the
//!   per-kind pools);
//! - `uncached`: thread caches off, so every call takes its kind's lock;
//! - `mutex_pool`: thread caches off and every call behind one global mutex, the way a
//!   single-threaded allocator is usually shared;
//! - `kinds` and `uncached_kinds`: as `pool` and `uncached`, but the threads allocate
//!   different memory kinds (device, host, DVPP, then cached device), as a decode thread and
//!   an inference thread do: they share the pool and none of its kind locks.
//!
//! For instruction counts, `POOL_THREADS_ROUNDS=n` skips criterion and runs `n` rounds on
//! one thread (variant `POOL_THREADS_VARIANT`, default `pool`; length `POOL_THREADS_LEN`,
//! default 256): run it under `valgrind --tool=callgrind` with two values of `n` and divide
//! the difference by `32 * Δn` operations. With `POOL_THREADS_THREADS=t` it runs `t` threads
//! of `n` rounds each and prints wall and CPU time per operation: on a machine shared with
//! other work, CPU time per operation that stays flat from 1 to 2 threads shows the threads
//! do not slow each other down, whatever the wall clock says.

use ascend_pool::pool::{Pool, PoolConfig};
use ascend_pool::source::sim::SimSource;
use ascend_pool::MemKind;
use criterion::{criterion_group, BenchmarkId, Criterion, Throughput};
use std::hint::black_box;
use std::sync::{Arc, Barrier, Mutex};
use std::time::{Duration, Instant};

/// Regions held at once by each thread.
const BATCH: usize = 16;

struct Variant {
    name: &'static str,
    pool: Arc<Pool>,
    /// Held around every call when set.
    global: Option<Arc<Mutex<()>>>,
    /// Thread `i` allocates kind `KINDS[i % 4]` instead of device memory.
    per_thread_kind: bool,
}

/// The kinds of the `*kinds` variants' threads, in thread order.
const KINDS: [&str; 4] = ["device", "host", "dvpp", "cached"];

fn variants() -> Vec<Variant> {
    let pool =
        |config: PoolConfig| Arc::new(Pool::new(Arc::new(SimSource::default()), config).unwrap());
    let uncached = || PoolConfig::parse("thread_cache:off").unwrap();
    vec![
        Variant {
            name: "pool",
            pool: pool(PoolConfig::default()),
            global: None,
            per_thread_kind: false,
        },
        Variant {
            name: "uncached",
            pool: pool(uncached()),
            global: None,
            per_thread_kind: false,
        },
        Variant {
            name: "mutex_pool",
            pool: pool(uncached()),
            global: Some(Arc::new(Mutex::new(()))),
            per_thread_kind: false,
        },
        Variant {
            name: "kinds",
            pool: pool(PoolConfig::default()),
            global: None,
            per_thread_kind: true,
        },
        Variant {
            name: "uncached_kinds",
            pool: pool(uncached()),
            global: None,
            per_thread_kind: true,
        },
    ]
}

/// One thread's work: `rounds` batches of `BATCH` allocations, each batch then dropped.
/// `thread` picks the kind in the `*kinds` variants.
#[inline(never)]
fn work(v: &Variant, len: u64, rounds: u64, thread: usize) {
    let p = &v.pool;
    let kind = if v.per_thread_kind {
        thread % KINDS.len()
    } else {
        0
    };
    match KINDS[kind] {
        "host" => batches(v, rounds, || p.alloc_host(len).unwrap()),
        "dvpp" => batches(v, rounds, || p.alloc_dvpp(len).unwrap()),
        "cached" => batches(v, rounds, || {
            let k = MemKind::Cached(p.config().policy);
            p.alloc_device_kind(k, len).unwrap()
        }),
        _ => batches(v, rounds, || p.alloc_device(len).unwrap()),
    }
}

/// `rounds` batches of `BATCH` regions from `alloc`, each batch then dropped.
#[inline(always)]
fn batches<R>(v: &Variant, rounds: u64, alloc: impl Fn() -> R) {
    let mut held = Vec::with_capacity(BATCH);
    for _ in 0..rounds {
        for _ in 0..BATCH {
            let r = match &v.global {
                Some(m) => {
                    let _g = m.lock().unwrap();
                    alloc()
                }
                None => alloc(),
            };
            held.push(r);
        }
        match &v.global {
            Some(m) => {
                for r in held.drain(..) {
                    let _g = m.lock().unwrap();
                    drop(black_box(r));
                }
            }
            None => held.clear(),
        }
    }
}

/// Wall time for `threads` threads each doing `rounds` rounds, started together.
fn run(v: &Arc<Variant>, threads: usize, len: u64, rounds: u64) -> Duration {
    if threads == 1 {
        let t = Instant::now();
        work(v, len, rounds, 0);
        return t.elapsed();
    }
    let barrier = Arc::new(Barrier::new(threads + 1));
    let handles: Vec<_> = (0..threads)
        .map(|i| {
            let (v, barrier) = (Arc::clone(v), Arc::clone(&barrier));
            std::thread::spawn(move || {
                work(&v, len, 1, i); // warm this thread's cache outside the timing
                barrier.wait();
                work(&v, len, rounds, i);
                barrier.wait();
            })
        })
        .collect();
    barrier.wait();
    let t = Instant::now();
    barrier.wait();
    let elapsed = t.elapsed();
    for h in handles {
        h.join().unwrap();
    }
    elapsed
}

fn pool_threads(c: &mut Criterion) {
    let variants: Vec<Arc<Variant>> = variants().into_iter().map(Arc::new).collect();
    for (size_name, len) in [("small", 256u64), ("medium", 64 << 10)] {
        let mut g = c.benchmark_group(format!("pool_threads/{size_name}"));
        g.sample_size(20)
            .warm_up_time(Duration::from_millis(500))
            .measurement_time(Duration::from_secs(2));
        for threads in [1usize, 2, 4] {
            // Allocations plus frees per iteration, over all threads.
            g.throughput(Throughput::Elements((threads * BATCH * 2) as u64));
            for v in &variants {
                g.bench_with_input(
                    BenchmarkId::new(v.name, threads),
                    &threads,
                    |b, &threads| {
                        b.iter_custom(|iters| run(v, threads, len, iters));
                    },
                );
            }
        }
        g.finish();
    }
}

criterion_group!(benches, pool_threads);

/// User plus system CPU time of this process so far.
fn cpu_seconds() -> f64 {
    let mut ru = std::mem::MaybeUninit::<libc::rusage>::uninit();
    // SAFETY: getrusage fills the struct it is given; RUSAGE_SELF is always valid.
    let ru = unsafe {
        libc::getrusage(libc::RUSAGE_SELF, ru.as_mut_ptr());
        ru.assume_init()
    };
    let secs = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 * 1e-6;
    secs(ru.ru_utime) + secs(ru.ru_stime)
}

fn main() {
    if let Ok(rounds) = std::env::var("POOL_THREADS_ROUNDS") {
        let rounds: u64 = rounds.parse().expect("POOL_THREADS_ROUNDS is a number");
        let name = std::env::var("POOL_THREADS_VARIANT").unwrap_or_else(|_| "pool".into());
        let len = std::env::var("POOL_THREADS_LEN").map_or(256, |l| l.parse().expect("a length"));
        let threads: usize =
            std::env::var("POOL_THREADS_THREADS").map_or(0, |t| t.parse().expect("a count"));
        let v = variants()
            .into_iter()
            .find(|v| v.name == name)
            .expect("a variant name");
        if threads == 0 {
            work(&v, len, 1, 0);
            work(&v, len, rounds, 0);
            return;
        }
        let v = Arc::new(v);
        let cpu0 = cpu_seconds();
        let wall = run(&v, threads, len, rounds);
        let cpu = cpu_seconds() - cpu0;
        let ops = (threads as u64 * rounds * BATCH as u64 * 2) as f64;
        println!(
            "{name} len {len} threads {threads}: {:.1} ns wall/op, {:.1} ns cpu/op, {:.2} Mops/s",
            wall.as_secs_f64() * 1e9 / ops,
            cpu * 1e9 / ops,
            ops / wall.as_secs_f64() / 1e6
        );
        return;
    }
    benches();
    Criterion::default().configure_from_args().final_summary();
}
