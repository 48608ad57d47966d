//! What the C interface adds to a pool call: the same allocate-and-free cycles through
//! `ap_alloc` / `ap_free` (pool lookup, handle table) and through the Rust API directly,
//! on one simulator pool each, side by side in one run.
//!
//! `cargo bench -p ascend-pool-capi`

use ascend_pool::{Pool, PoolConfig, SimSource};
use ascend_pool_capi::*;
use criterion::{criterion_group, criterion_main, BatchSize, Criterion};
use std::hint::black_box;
use std::sync::Arc;

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

fn bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("alloc_free_64");
    let pool = Pool::new(Arc::new(SimSource::default()), PoolConfig::default()).unwrap();
    g.bench_function("rust", |b| {
        b.iter_batched_ref(
            || Vec::with_capacity(BATCH),
            |held| {
                for i in 0..BATCH {
                    held.push(pool.alloc_device(SIZES[i % SIZES.len()]).unwrap());
                }
                held.clear();
            },
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
            |held: &mut Vec<u64>| {
                for i in 0..BATCH {
                    let mut r = 0;
                    // SAFETY: a writable handle.
                    let s =
                        unsafe { ap_alloc(handle, KIND_DEVICE, SIZES[i % SIZES.len()], &mut r) };
                    assert_eq!(s, Status::Ok);
                    held.push(r);
                }
                for r in held.drain(..) {
                    assert_eq!(black_box(ap_free(handle, r)), Status::Ok);
                }
            },
            BatchSize::SmallInput,
        )
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
