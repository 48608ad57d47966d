//! What the C interface adds to a pool call: the same allocate-and-free cycles through
//! `ap_alloc` / `ap_free` (pool lookup, handle table) and through the Rust API directly,
//! on one simulator pool each, side by side in one run. A second group runs the cycles on two
//! threads at once over one pool, as an inference server's request threads would: a time is
//! the wall time of both threads' rounds.
//!
//! `cargo bench -p ascend-pool-capi`

use ascend_pool::{Pool, PoolConfig, SimSource};
use ascend_pool_capi::*;
use criterion::{criterion_group, criterion_main, BatchSize, Criterion};
use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Sizes of one video frame's buffers and a few small tensors, cycled.
const SIZES: [u64; 8] = [
    3_110_400,
    4096,
    256,
    1 << 20,
    65_536,
    777,
    3_110_400,
    12_288,
];
/// Regions held at once: each round allocates them all, then frees them all.
const BATCH: usize = 64;
/// Threads sharing one pool in the second group.
const THREADS: usize = 2;

/// One round through the Rust API: `BATCH` regions allocated, then all freed.
fn rust_round(pool: &Pool, held: &mut Vec<ascend_pool::region::DeviceRegion>) {
    for i in 0..BATCH {
        held.push(pool.alloc_device(SIZES[i % SIZES.len()]).unwrap());
    }
    held.clear();
}

/// The same round through the C functions.
fn c_round(pool: u64, held: &mut Vec<u64>) {
    for i in 0..BATCH {
        let mut r = 0;
        // SAFETY: a writable handle.
        let s = unsafe { ap_alloc(pool, KIND_DEVICE, SIZES[i % SIZES.len()], &mut r) };
        assert_eq!(s, Status::Ok);
        held.push(r);
    }
    for r in held.drain(..) {
        assert_eq!(black_box(ap_free(pool, r)), Status::Ok);
    }
}

/// The wall time of `THREADS` threads each running `iters` rounds of `round` at once.
fn on_threads(iters: u64, round: impl Fn() + Sync) -> Duration {
    let start = std::sync::Barrier::new(THREADS + 1);
    std::thread::scope(|s| {
        for _ in 0..THREADS {
            s.spawn(|| {
                start.wait();
                for _ in 0..iters {
                    round();
                }
            });
        }
        start.wait();
        let t = Instant::now();
        // The scope joins the threads before it returns.
        t
    })
    .elapsed()
}

fn bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("alloc_free_64");
    // The configuration `ap_pool_create` reads for a NULL one (`ASCEND_POOL_CONF`, else the
    // defaults), so both sides run the same pool.
    let pool = Pool::new(
        Arc::new(SimSource::default()),
        PoolConfig::from_env().unwrap(),
    )
    .unwrap();
    g.bench_function("rust", |b| {
        b.iter_batched_ref(
            || Vec::with_capacity(BATCH),
            |held| rust_round(&pool, held),
            BatchSize::SmallInput,
        )
    });
    let mut handle = 0;
    // SAFETY: NULL configuration (the defaults) and a writable handle.
    assert_eq!(
        unsafe { ap_pool_create(SOURCE_SIM, std::ptr::null(), &mut handle) },
        Status::Ok
    );
    g.bench_function("c_api", |b| {
        b.iter_batched_ref(
            || Vec::with_capacity(BATCH),
            |held| c_round(handle, held),
            BatchSize::SmallInput,
        )
    });
    g.finish();
    let mut g = c.benchmark_group(format!("alloc_free_64_{THREADS}_threads"));
    g.bench_function("rust", |b| {
        b.iter_custom(|iters| {
            on_threads(iters, || rust_round(&pool, &mut Vec::with_capacity(BATCH)))
        })
    });
    g.bench_function("c_api", |b| {
        b.iter_custom(|iters| on_threads(iters, || c_round(handle, &mut Vec::with_capacity(BATCH))))
    });
    g.finish();
    // SAFETY: no count asked for.
    assert_eq!(
        unsafe { ap_pool_destroy(handle, std::ptr::null_mut()) },
        Status::Ok
    );
}

criterion_group!(benches, bench);
criterion_main!(benches);
