//! Device regions at an alignment the caller asks for (`Pool::alloc_device_aligned`): page
//! starts, 2 MiB windows for HCCL registration, and every other alignment refused.

use ascend_pool::align::{CarveRuleError, MAX_ALIGN};
use ascend_pool::{DeviceRegion, Error, MemKind, Pool, PoolConfig, Region, SimSource};
use std::sync::Arc;

const MIB: u64 = 1 << 20;

fn pools() -> Vec<(&'static str, Pool)> {
    let sim = || Arc::new(SimSource::default());
    vec![
        (
            "thread cache",
            Pool::new(sim(), PoolConfig::default()).unwrap(),
        ),
        (
            "no thread cache",
            Pool::new(sim(), PoolConfig::default().with_thread_cache(0)).unwrap(),
        ),
    ]
}

fn device(pool: &Pool) -> MemKind {
    MemKind::Device(pool.config().policy)
}

/// Writes a pattern over the whole region and reads it back.
fn round_trip(pool: &Pool, r: &mut DeviceRegion, seed: u8) {
    let data: Vec<u8> = (0..r.len()).map(|i| (i % 251) as u8 ^ seed).collect();
    pool.copy_from_host(r, 0, &data).unwrap();
    let mut back = vec![0u8; data.len()];
    pool.copy_to_host(r, 0, &mut back).unwrap();
    assert!(back == data, "bytes of a {}-aligned region", r.align());
}

#[test]
fn other_alignments_are_refused_and_the_pool_takes_nothing() {
    for (name, pool) in pools() {
        for align in [0, 1, 32, 63, 96, 192, MAX_ALIGN << 1, 1 << 63, u64::MAX] {
            match pool.alloc_device_aligned(4096, align) {
                Err(Error::Carve(CarveRuleError::BadAlignment { align: a })) => {
                    assert_eq!(a, align, "{name}")
                }
                other => panic!("{name}: alignment {align} gave {other:?}"),
            }
        }
        assert!(matches!(
            pool.alloc_device_aligned(0, 4096),
            Err(Error::Carve(CarveRuleError::ZeroLength))
        ));
        let s = pool.stats(device(&pool));
        assert_eq!((s.reserved_bytes, s.live_regions), (0, 0), "{name}");
        pool.validate().unwrap();
    }
}

#[test]
fn regions_start_where_asked_and_keep_their_bytes() {
    for (name, pool) in pools() {
        let mut live = Vec::new();
        // Mixed with 64-aligned regions, so the aligned ones do not start chunks by luck.
        for (i, &(len, align)) in [
            (100, 64),
            (4096, 4096),
            (333, 64),
            (2 * MIB, 2 * MIB),
            (5000, 4096),
            (4 * MIB, 2 * MIB),
            (70_000, 64 << 10),
            (1, 128),
        ]
        .iter()
        .enumerate()
        {
            let mut r = pool.alloc_device_aligned(len, align).unwrap();
            assert_eq!(r.addr() as u64 % align, 0, "{name}: {len} at {align}");
            assert!(r.align() >= align, "{name}");
            assert_eq!(r.len(), len);
            round_trip(&pool, &mut r, i as u8);
            live.push(r);
        }
        for (i, a) in live.iter().enumerate() {
            for b in &live[i + 1..] {
                let (a0, b0) = (a.addr() as u64, b.addr() as u64);
                assert!(a0 + a.len() <= b0 || b0 + b.len() <= a0, "{name}: overlap");
            }
        }
        pool.validate().unwrap();
        drop(live);
        pool.flush_thread_caches();
        pool.trim();
        pool.validate().unwrap();
        assert_eq!(pool.stats(device(&pool)).reserved_bytes, 0, "{name}");
    }
}

#[test]
fn a_freed_segment_is_reused_only_at_an_alignment_it_has() {
    // Each length takes the same footprint at a 64-byte start and at the larger alignment
    // (8,160 bytes: 8 KiB at 64 and at 4 KiB; 524,256: 512 KiB at 64 and at 64 KiB), so a
    // thread cache (the first) or a shape slot (the second, above the cache's 256 KiB) that
    // keyed on the footprint alone would hand a 64-aligned start to the aligned request.
    for (len, align) in [(8192 - 32, 4096), ((512 << 10) - 32, 64 << 10)] {
        for (name, pool) in pools() {
            let mut shifts = Vec::new();
            for i in 0..64 {
                // Moves the next 64-aligned start (above the 1 KiB slabs, so in the same
                // range as the rest), so it is not aligned further by luck.
                shifts.push(pool.alloc_device(2048 + 64 * (i % 7)).unwrap());
                let small = pool.alloc_device(len).unwrap();
                let aligned = pool.alloc_device_aligned(len, align).unwrap();
                drop(small);
                drop(aligned);
                let a = pool.alloc_device_aligned(len, align).unwrap();
                let b = pool.alloc_device_aligned(len, align).unwrap();
                for r in [&a, &b] {
                    assert_eq!(r.addr() as u64 % align, 0, "{name}, {len} bytes, round {i}");
                }
            }
            pool.validate().unwrap();
        }
    }
}

#[test]
fn a_start_the_source_does_not_give_keeps_within_the_limit() {
    // The simulator's blocks are page-aligned: a larger start takes a bigger block, which
    // must be checked against the limit like the block it replaces.
    for align in [128 << 10, MIB, 2 * MIB, 64 * MIB, MAX_ALIGN] {
        let config = PoolConfig::default()
            .with_chunk_size(2 * MIB)
            .with_limit(2 * MIB);
        let pool = Pool::new(Arc::new(SimSource::default()), config).unwrap();
        let kind = device(&pool);
        match pool.alloc_device_aligned(2560, align) {
            Ok(r) => assert_eq!(r.addr() as u64 % align, 0),
            // The footprint rounds up to the alignment: from 2 MiB on it cannot fit in a
            // 2 MiB block past its aligned start, unless the block happens to be aligned.
            Err(Error::LimitExceeded {
                requested, limit, ..
            }) if align >= 2 * MIB => {
                assert_eq!((requested, limit), (2560, 2 * MIB))
            }
            Err(e) => panic!("a {align}-aligned start gave {e:?}"),
        }
        let s = pool.stats(kind);
        // A block given back for a bigger one is counted as given back.
        assert_eq!(
            s.source_alloc_calls - s.source_free_calls,
            s.chunks,
            "{align}: {s:?}"
        );
        if align < 2 * MIB {
            // Started inside the first block, not in a bigger one.
            assert_eq!(s.source_alloc_calls, 1, "{align}: {s:?}");
        }
        assert!(
            s.reserved_bytes <= 2 * MIB && s.peak_reserved_bytes <= 2 * MIB,
            "{align}-aligned start: {s:?}"
        );
        pool.validate().unwrap();
        // The pool still serves what fits.
        drop(pool.alloc_device(4096).unwrap());
    }
}

#[test]
fn an_over_aligned_request_fits_its_fresh_chunk_in_either_range_tier() {
    // A chunk started past the block's start is smaller than the block; a buddy range needs
    // the footprint's next power of two in it, not just the footprint.
    for conf in ["", "padding:0", "range:buddy", "range:buddy,padding:0"] {
        let config = PoolConfig::parse(&format!("chunk_size:2m,{conf}")).unwrap();
        let pool = Pool::new(Arc::new(SimSource::default()), config).unwrap();
        let mut live = Vec::new();
        for (len, align) in [
            (4_259_072, 128 << 10),
            (3 * MIB, 256 << 10),
            (100, 128 << 10),
            (MIB - 32, MIB),
            (9 * MIB, 4096),
            // The whole block: unless the source happens to align it, a bigger one.
            (2 * MIB - 32, MIB),
        ] {
            match pool.alloc_device_aligned(len, align) {
                Ok(r) => {
                    assert_eq!(r.addr() as u64 % align, 0, "{conf}: {len} at {align}");
                    live.push(r);
                }
                Err(e) => panic!("{conf}: {len} bytes at {align} gave {e:?}"),
            }
            // Every block taken is a chunk or was given back, and counted so.
            let s = pool.stats(MemKind::DEVICE);
            assert_eq!(
                s.source_alloc_calls - s.source_free_calls,
                s.chunks,
                "{conf}: {len} at {align}: {s:?}"
            );
        }
        pool.validate().unwrap();
    }
}

#[test]
fn a_footprint_freed_in_a_chunk_is_not_taken_back_there_at_an_alignment_its_start_lacks() {
    // A kind remembers the chunk where each large footprint was last freed, to ask it
    // first. An over-aligned request of the same footprint must not be carved there when
    // the chunk's start is not aligned that far: its engine aligns offsets, not addresses.
    // The simulator's blocks start on 4 KiB pages, so most of these alignments are more
    // than some chunk's start has.
    let len = 512 * 1024 - 32; // a footprint of 512 KiB at every alignment below
    for shift in 13..=18 {
        let align = 1u64 << shift;
        // A chunk that starts aligned anyway proves nothing: keep such pools alive, so that
        // the next pool's block lands elsewhere, until one starts unaligned.
        let mut held = Vec::new();
        let (pool, first, _neighbour) = loop {
            let pool = Pool::new(
                Arc::new(SimSource::default()),
                PoolConfig::default().with_thread_cache(0),
            )
            .unwrap();
            let first = pool.alloc_device(len).unwrap();
            let neighbour = pool.alloc_device(len).unwrap(); // the chunk stays in use
            if first.addr() as u64 % align != 0 || held.len() == 16 {
                break (pool, first, neighbour);
            }
            held.push((pool, first, neighbour));
        };
        let start = first.addr();
        assert_ne!(start as u64 % align, 0, "17 chunks started {align}-aligned");
        drop(first);
        let again = pool.alloc_device_aligned(len, align).unwrap();
        assert_eq!(
            again.addr() as u64 % align,
            0,
            "{align}: freed at {start:#x}"
        );
        pool.validate().unwrap();
    }
}
