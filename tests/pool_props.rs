//! Property tests of whole-pool sequences on the simulator: random allocations of every
//! kind, data written synchronously and through async copies from pinned staging buffers
//! that are dropped while the copy is queued, random frees — every region's bytes are read
//! back and compared with a shadow copy, and `validate()` passes after every step; each
//! sequence runs under one of several configurations (tier, padding, canaries, caches).

use ascend_pool::region::{DeviceRegion, DvppRegion, HostRegion, Region};
use ascend_pool::source::sim::{SimConfig, SimSource};
use ascend_pool::{Pool, PoolConfig, Stream};
use proptest::prelude::*;
use std::sync::Arc;

#[path = "common/cases.rs"]
mod cases;
use cases::cases;

enum Any {
    Device(DeviceRegion),
    Dvpp(DvppRegion),
    Host(HostRegion),
}

#[derive(Debug, Clone)]
enum Op {
    Alloc { kind: u8, len: u64 },
    WriteSync { idx: usize, seed: u8 },
    WriteAsync { idx: usize, seed: u8, block: u64 },
    Free { idx: usize },
    Sync,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0u8..3, prop_oneof![1u64..512, 512u64..65_536, 65_536u64..(3 << 20)])
            .prop_map(|(kind, len)| Op::Alloc { kind, len }),
        3 => (any::<usize>(), any::<u8>()).prop_map(|(idx, seed)| Op::WriteSync { idx, seed }),
        3 => (any::<usize>(), any::<u8>(), any::<u64>())
            .prop_map(|(idx, seed, block)| Op::WriteAsync { idx, seed, block }),
        3 => any::<usize>().prop_map(|idx| Op::Free { idx }),
        1 => Just(Op::Sync),
    ]
}

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| seed.wrapping_add((i % 251) as u8))
        .collect()
}

fn write_sync(pool: &Pool, r: &mut Any, data: &[u8]) {
    match r {
        Any::Device(d) => pool.copy_from_host(d, 0, data).unwrap(),
        Any::Dvpp(d) => pool.copy_from_host(d, 0, data).unwrap(),
        Any::Host(h) => h.as_mut_slice().copy_from_slice(data),
    }
}

fn write_async(pool: &Pool, r: &mut Any, offset: u64, staging: &HostRegion, stream: &Stream) {
    let len = staging.len();
    match r {
        Any::Device(d) => pool.copy_async(d, offset, staging, 0, len, stream).unwrap(),
        Any::Dvpp(d) => pool.copy_async(d, offset, staging, 0, len, stream).unwrap(),
        // No asynchronous copy runs within the host: the synchronous one waits for `stream`.
        Any::Host(h) => pool.copy(h, offset, staging, 0, len).unwrap(),
    }
}

fn read(pool: &Pool, r: &Any) -> Vec<u8> {
    let len = match r {
        Any::Device(d) => d.len(),
        Any::Dvpp(d) => d.len(),
        Any::Host(h) => h.len(),
    } as usize;
    let mut out = vec![0u8; len];
    match r {
        Any::Device(d) => pool.copy_to_host(d, 0, &mut out).unwrap(),
        Any::Dvpp(d) => pool.copy_to_host(d, 0, &mut out).unwrap(),
        Any::Host(h) => out.copy_from_slice(h.as_slice()),
    }
    out
}

/// The configurations each sequence may run under: the default, the buddy tier, canaries
/// in the padding, no padding (newer SoCs), and no thread caches or shape slots.
const CONFIGS: [&str; 5] = [
    "",
    "range:buddy",
    "debug:1",
    "padding:0,range:buddy",
    "thread_cache:off",
];

fn run(conf: &str, ops: Vec<Op>) {
    let sim = SimSource::new(SimConfig::default().with_copy_bandwidth(4_000_000_000)).unwrap();
    let config = PoolConfig::parse(&format!("chunk_size:8m,{conf}")).unwrap();
    let pool = Pool::new(Arc::new(sim), config).unwrap();
    let stream = pool.create_stream().unwrap();
    let mut live: Vec<(Any, Vec<u8>)> = Vec::new();
    for op in ops {
        match op {
            Op::Alloc { kind, len } => {
                let r = match kind {
                    0 => Any::Device(pool.alloc_device(len).unwrap()),
                    1 => Any::Dvpp(pool.alloc_dvpp(len).unwrap()),
                    _ => Any::Host(pool.alloc_host(len).unwrap()),
                };
                let mut r = r;
                let data = pattern(len as u8, len as usize);
                write_sync(&pool, &mut r, &data);
                live.push((r, data));
            }
            Op::WriteSync { idx, seed } if !live.is_empty() => {
                let i = idx % live.len();
                stream.synchronize().unwrap(); // host-side writes must not race queued ones
                let data = pattern(seed, live[i].1.len());
                write_sync(&pool, &mut live[i].0, &data);
                live[i].1 = data;
            }
            Op::WriteAsync { idx, seed, block } if !live.is_empty() => {
                let i = idx % live.len();
                let len = live[i].1.len() as u64;
                // A 64-aligned block inside the region.
                let offset = (block % len) / 64 * 64;
                let n = (len - offset).min(1 + block % 200_000);
                let mut staging = pool.alloc_host(n).unwrap();
                let data = pattern(seed, n as usize);
                staging.as_mut_slice().copy_from_slice(&data);
                write_async(&pool, &mut live[i].0, offset, &staging, &stream);
                drop(staging); // queued copy still reads it: its memory must not be reused yet
                live[i].1[offset as usize..(offset + n) as usize].copy_from_slice(&data);
            }
            Op::Free { idx } if !live.is_empty() => {
                let i = idx % live.len();
                live.swap_remove(i); // possibly with a copy still queued into it
            }
            Op::Sync => stream.synchronize().unwrap(),
            _ => {}
        }
        pool.validate().unwrap();
    }
    stream.synchronize().unwrap();
    for (r, expected) in &live {
        assert!(
            read(&pool, r) == *expected,
            "region data differs from the shadow"
        );
    }
    drop(live);
    pool.synchronize().unwrap();
    pool.trim();
    pool.validate().unwrap();
    assert!(pool.leak_report().is_empty());
    // Every write stayed inside its region: no canary (debug) was touched.
    assert_eq!(pool.take_corruption_reports(), vec![]);
    for s in pool.all_stats() {
        assert_eq!((s.reserved_bytes, s.live_regions), (0, 0), "{:?}", s.kind);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(24), ..ProptestConfig::default() })]

    #[test]
    fn pool_sequences_keep_data_intact(
        conf in prop::sample::select(&CONFIGS[..]),
        ops in prop::collection::vec(op(), 1..120),
    ) {
        run(conf, ops);
    }
}
