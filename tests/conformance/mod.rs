//! The block-source conformance suite: written once, run against every source.
//!
//! `conformance_suite!(make)` expands to one test per property; `make(capacity)` must
//! return a fresh source whose device holds `capacity` bytes and whose copies take real
//! time (so stream-ordering bugs would show as corrupted data).

#[macro_export]
macro_rules! conformance_suite {
    ($make:expr) => {
        use ascend_pool::pool::{Pool, PoolConfig};
        use ascend_pool::region::{Region, SubRegion};
        use ascend_pool::source::{BlockSource, MemcpyKind};
        use ascend_pool::{Error, MemKind};
        use std::sync::Arc;

        fn source(capacity: u64) -> Arc<dyn BlockSource> {
            let make: fn(u64) -> Arc<dyn BlockSource> = $make;
            make(capacity)
        }

        fn pool_with(capacity: u64, config: PoolConfig) -> Pool {
            Pool::new(source(capacity), config).unwrap()
        }

        fn pool() -> Pool {
            pool_with(1 << 30, PoolConfig::default())
        }

        #[test]
        fn typed_regions_are_aligned_and_round_trip() {
            let pool = pool();
            let data: Vec<u8> = (0..10_000u32).map(|i| (i * 7 % 251) as u8).collect();
            let mut d = pool.alloc_device(10_000).unwrap();
            let mut m = pool.alloc_model_input(10_000).unwrap();
            let mut v = pool.alloc_dvpp(10_000).unwrap();
            let mut h = pool.alloc_host(10_000).unwrap();
            let mut a = pool.alloc_device_kind(MemKind::DeviceAlign32(Default::default()), 10_000).unwrap();
            let mut c = pool.alloc_device_kind(MemKind::Cached(Default::default()), 10_000).unwrap();
            assert_eq!(d.addr() % 64, 0);
            assert_eq!(m.addr() % 128, 0);
            assert_eq!(v.addr() % 128, 0);
            assert_eq!(h.addr() % 64, 0);
            pool.copy_from_host(&mut d, 0, &data).unwrap();
            pool.copy_from_host(&mut m, 0, &data).unwrap();
            pool.copy_from_host(&mut v, 0, &data).unwrap();
            pool.copy_from_host(&mut a, 0, &data).unwrap();
            pool.copy_from_host(&mut c, 0, &data).unwrap();
            h.as_mut_slice().copy_from_slice(&data);
            for r in [&d as &dyn Region, &m, &v, &a, &c] {
                let _ = r;
            }
            let mut out = vec![0u8; 10_000];
            pool.copy_to_host(&d, 0, &mut out).unwrap();
            assert_eq!(out, data);
            pool.copy_to_host(&v, 0, &mut out).unwrap();
            assert_eq!(out, data);
            pool.copy_to_host(&c, 0, &mut out).unwrap();
            assert_eq!(out, data);
            // Device -> device and device -> host regions.
            let mut d2 = pool.alloc_device(10_000).unwrap();
            pool.copy(&mut d2, 0, &m, 0, 10_000).unwrap();
            pool.copy(&mut h, 0, &d2, 0, 10_000).unwrap();
            assert_eq!(h.as_slice(), &data[..]);
            pool.memset(&mut d2, 64, 0xAB, 100).unwrap();
            pool.copy_to_host(&d2, 0, &mut out[..256]).unwrap();
            assert!(out[64..164].iter().all(|&b| b == 0xAB));
            assert_eq!(out[0..64], data[0..64]);
            pool.validate().unwrap();
            drop((d, m, v, h, a, c, d2));
            pool.validate().unwrap();
            assert!(pool.leak_report().is_empty());
        }

        #[test]
        fn bad_input_gets_typed_errors_and_leaves_the_pool_valid() {
            let pool = pool_with(256 << 20, PoolConfig::default());
            assert!(matches!(pool.alloc_device(0), Err(Error::Carve(_))));
            assert!(matches!(pool.alloc_dvpp(u64::MAX), Err(Error::Carve(_))));
            assert!(matches!(pool.alloc_host(u64::MAX - 64), Err(Error::Carve(_))));
            assert!(matches!(pool.alloc_device(1 << 50), Err(Error::OutOfMemory { .. })));
            assert!(matches!(pool.alloc_device_kind(MemKind::Host, 10), Err(Error::WrongKind { .. })));
            pool.validate().unwrap();
            let mut d = pool.alloc_device(1000).unwrap();
            let mut small = vec![0u8; 2000];
            assert!(matches!(pool.copy_from_host(&mut d, 0, &small), Err(Error::OutOfBounds { .. })));
            assert!(matches!(pool.copy_from_host(&mut d, u64::MAX, &small[..1]), Err(Error::OutOfBounds { .. })));
            assert!(matches!(pool.copy_to_host(&d, 999, &mut small[..2]), Err(Error::OutOfBounds { .. })));
            assert!(matches!(pool.memset(&mut d, 0, 0, 1001), Err(Error::OutOfBounds { .. })));
            assert!(matches!(pool.memset(&mut d, 0, 0, 0), Err(Error::OutOfBounds { .. })));
            let mut e = pool.alloc_device(1000).unwrap();
            let stream = pool.create_stream().unwrap();
            assert!(matches!(pool.copy_async(&mut e, 32, &d, 0, 64, &stream), Err(Error::Misaligned { required: 64, .. })));
            assert!(matches!(pool.copy_async(&mut e, 0, &d, 0, 1001, &stream), Err(Error::OutOfBounds { .. })));
            // Sub-slicing keeps the guarantee or refuses.
            assert!(SubRegion::new(&mut d, 64, 128).is_ok());
            assert!(matches!(SubRegion::new(&mut d, 32, 128), Err(Error::Misaligned { .. })));
            assert!(matches!(SubRegion::new(&mut d, 960, 128), Err(Error::OutOfBounds { .. })));
            // A region of another pool (another source) is refused.
            let other = pool_with(64 << 20, PoolConfig::default());
            let mut foreign = other.alloc_device(100).unwrap();
            assert!(matches!(pool.copy_from_host(&mut foreign, 0, &small[..10]), Err(Error::ForeignHandle)));
            pool.validate().unwrap();
            drop((d, e));
            pool.validate().unwrap();
            let st = pool.stats(MemKind::DEVICE);
            assert_eq!(st.live_regions, 0);
            assert_eq!(st.allocated_bytes, 0);
        }

        /// Every copy and fill at non-zero offsets, through a view of part of a region,
        /// moves exactly the bytes asked for and touches nothing else.
        /// A free of a live block described with another device or size is refused with
        /// `ACL_ERROR_INVALID_PARAM` (the right free function, the wrong block), and the
        /// block stays live and freeable.
        #[test]
        fn a_free_describing_the_block_wrongly_is_refused() {
            let src = source(64 << 20);
            let b = src.alloc_block(0, MemKind::DEVICE, 4096).unwrap();
            for wrong in [
                ascend_pool::source::Block { device: 1, ..b },
                ascend_pool::source::Block { size: b.size + 1, ..b },
            ] {
                match src.free_block(wrong) {
                    Err(Error::Runtime { code, .. }) => {
                        assert_eq!(code, ascend_pool::AclError::INVALID_PARAM, "{wrong:?}")
                    }
                    other => panic!("{wrong:?} freed: {other:?}"),
                }
            }
            src.free_block(b).unwrap();
        }

        #[test]
        fn offsets_and_views_move_exactly_the_bytes_asked_for() {
            const N: usize = 4096;
            let pool = pool();
            let pattern: Vec<u8> = (0..N).map(|i| (i * 13 % 251) as u8 + 1).collect();
            fn whole(pool: &Pool, r: &impl Region) -> Vec<u8> {
                let mut out = vec![0xEE; N];
                pool.copy_to_host(r, 0, &mut out).unwrap();
                out
            }
            let mut src = pool.alloc_device(N as u64).unwrap();
            let mut dst = pool.alloc_device(N as u64).unwrap();
            pool.memset(&mut src, 0, 0, N as u64).unwrap();
            pool.memset(&mut dst, 0, 0, N as u64).unwrap();
            let mut want = vec![0u8; N];

            pool.copy_from_host(&mut src, 128, &pattern[..1024]).unwrap();
            want[128..1152].copy_from_slice(&pattern[..1024]);
            assert_eq!(whole(&pool, &src), want);
            let mut part = vec![0u8; 512];
            pool.copy_to_host(&src, 192, &mut part).unwrap();
            assert_eq!(part, pattern[64..576]);

            // Region to region, the two offsets different.
            let mut want_dst = vec![0u8; N];
            pool.copy(&mut dst, 256, &src, 192, 512).unwrap();
            want_dst[256..768].copy_from_slice(&pattern[64..576]);
            assert_eq!(whole(&pool, &dst), want_dst);

            // On a stream, at offsets that keep the 64-byte alignment.
            let stream = pool.create_stream().unwrap();
            pool.copy_async(&mut dst, 1024, &src, 128, 640, &stream).unwrap();
            want_dst[1024..1664].copy_from_slice(&pattern[..640]);
            pool.memset_async(&mut dst, 2048, 0x5A, 100, &stream).unwrap();
            want_dst[2048..2148].fill(0x5A);
            stream.synchronize().unwrap();
            assert_eq!(whole(&pool, &dst), want_dst);

            // A view: its own address, length and bounds, its parent's alignment and kind.
            let mut parent = pool.alloc_device(N as u64).unwrap();
            pool.memset(&mut parent, 0, 0, N as u64).unwrap();
            let parent_addr = parent.addr();
            let mut want_parent = vec![0u8; N];
            {
                let mut view = SubRegion::new(&mut parent, 512, 2048).unwrap();
                assert_eq!((view.offset(), view.addr(), view.len()), (512, parent_addr + 512, 2048));
                assert!(!view.is_empty());
                assert_eq!((view.align(), view.kind()), (64, MemKind::DEVICE));
                assert!(matches!(pool.memset(&mut view, 0, 0, 2049), Err(Error::OutOfBounds { .. })));
                assert!(matches!(SubRegion::new(&mut view, 32, 64), Err(Error::Misaligned { required: 64, .. })));
                pool.copy_from_host(&mut view, 64, &pattern[..256]).unwrap();
                want_parent[576..832].copy_from_slice(&pattern[..256]);
                pool.copy_async(&mut view, 512, &src, 128, 512, &stream).unwrap();
                want_parent[1024..1536].copy_from_slice(&pattern[..512]);
                stream.synchronize().unwrap();
                let mut back = vec![0u8; 256];
                pool.copy_to_host(&view, 64, &mut back).unwrap();
                assert_eq!(back, pattern[..256]);
                // A view of a view adds the offsets.
                let mut inner = SubRegion::new(&mut view, 1024, 128).unwrap();
                assert_eq!(inner.addr(), parent_addr + 1536);
                pool.memset(&mut inner, 0, 0x77, 128).unwrap();
                want_parent[1536..1664].fill(0x77);
            }
            assert_eq!(whole(&pool, &parent), want_parent);
            let mut dvpp = pool.alloc_dvpp(1024).unwrap();
            let mut host = pool.alloc_host(1024).unwrap();
            assert_eq!(SubRegion::new(&mut dvpp, 128, 256).unwrap().align(), 128);
            assert_eq!(SubRegion::new(&mut host, 64, 64).unwrap().kind(), MemKind::Host);
            assert!(!dvpp.is_empty() && !host.is_empty());
            pool.validate().unwrap();
        }

        /// Two pools over one source may copy between each other's regions: the runtime
        /// behind them is one. A stream of another source is refused everywhere it is taken.
        #[test]
        fn pools_over_one_source_share_regions_and_refuse_foreign_streams() {
            let shared = source(256 << 20);
            let a = Pool::new(Arc::clone(&shared), PoolConfig::default()).unwrap();
            let b = Pool::new(shared, PoolConfig::default()).unwrap();
            let mut r = a.alloc_device(256).unwrap();
            b.copy_from_host(&mut r, 0, &[7; 256]).unwrap();
            let mut out = [0u8; 256];
            b.copy_to_host(&r, 0, &mut out).unwrap();
            assert_eq!(out, [7; 256]);
            let mut s = b.alloc_device(256).unwrap();
            b.copy(&mut s, 0, &r, 0, 256).unwrap();
            a.copy_to_host(&s, 0, &mut out).unwrap();
            assert_eq!(out, [7; 256]);

            let other = pool_with(64 << 20, PoolConfig::default());
            let foreign = other.create_stream().unwrap();
            assert!(matches!(a.alloc_device_on(256, &foreign), Err(Error::ForeignHandle)));
            assert!(matches!(a.alloc_dvpp_on(256, &foreign), Err(Error::ForeignHandle)));
            assert!(matches!(a.copy_async(&mut r, 0, &s, 0, 64, &foreign), Err(Error::ForeignHandle)));
            assert!(matches!(a.memset_async(&mut r, 0, 1, 64, &foreign), Err(Error::ForeignHandle)));
            assert!(matches!(r.record_stream(&foreign), Err(Error::ForeignHandle)));
            a.copy_to_host(&r, 0, &mut out).unwrap();
            assert_eq!(out, [7; 256], "nothing was queued under the foreign stream");
            drop((r, s));
            a.validate().unwrap();
            b.validate().unwrap();
            assert!(a.leak_report().is_empty() && b.leak_report().is_empty());
        }

        /// Device memory of two devices of one source: the runtime copies between them only
        /// once peer access is enabled, which the pool never does, so the synchronous copy
        /// refuses such a pair as the asynchronous one does, with the same error, and nothing
        /// reaches the runtime. Within one device, and to or from the host, copies between the
        /// two pools' regions run. A source of one device (virtual memory) has no second.
        #[test]
        fn copies_between_two_devices_are_refused_sync_as_async() {
            let shared = source(256 << 20);
            if shared.only_device().is_some() {
                return;
            }
            let a = Pool::new(Arc::clone(&shared), PoolConfig::default()).unwrap();
            let b = Pool::new(shared, PoolConfig::default().with_device(1)).unwrap();
            let mut on0 = a.alloc_device(256).unwrap();
            let mut on1 = b.alloc_device(256).unwrap();
            let mut dvpp1 = b.alloc_dvpp(256).unwrap();
            let mut host0 = a.alloc_host(256).unwrap();
            a.copy_from_host(&mut on0, 0, &[1; 256]).unwrap();
            b.copy_from_host(&mut on1, 0, &[2; 256]).unwrap();
            let stream = a.create_stream().unwrap();
            assert!(matches!(a.copy_async(&mut on0, 0, &on1, 0, 64, &stream), Err(Error::ForeignHandle)));
            for pool in [&a, &b] {
                assert!(matches!(pool.copy(&mut on0, 0, &on1, 0, 64), Err(Error::ForeignHandle)));
                assert!(matches!(pool.copy(&mut on1, 0, &on0, 0, 64), Err(Error::ForeignHandle)));
                assert!(matches!(pool.copy(&mut dvpp1, 0, &on0, 0, 64), Err(Error::ForeignHandle)));
            }
            let mut out = [0u8; 256];
            a.copy_to_host(&on0, 0, &mut out).unwrap();
            assert_eq!(out, [1; 256], "nothing was copied into device 0");
            b.copy_to_host(&on1, 0, &mut out).unwrap();
            assert_eq!(out, [2; 256], "nothing was copied into device 1");
            a.copy(&mut dvpp1, 0, &on1, 0, 256).unwrap();
            b.copy_to_host(&dvpp1, 0, &mut out).unwrap();
            assert_eq!(out, [2; 256]);
            b.copy(&mut host0, 0, &on1, 0, 256).unwrap();
            assert_eq!(host0.as_slice(), &[2; 256][..]);
            drop((on0, on1, dvpp1, host0));
            stream.synchronize().unwrap();
            a.validate().unwrap();
            b.validate().unwrap();
            assert!(a.leak_report().is_empty() && b.leak_report().is_empty());
        }

        /// Below any pool, the source itself: a device-to-device copy (or one of kind
        /// `Default` between device memory) between blocks of two devices is refused with
        /// `ACL_ERROR_INVALID_PARAM`, synchronous or queued, and touches neither block: the
        /// runtime copies across devices only once peer access is enabled, which no source
        /// does. The same copies within one device run. The simulator copied such a pair.
        #[test]
        fn the_source_refuses_device_copies_between_two_devices() {
            let src = source(256 << 20);
            if src.only_device().is_some() {
                return;
            }
            let n = 4096u64;
            let [a, b] = [0, 0].map(|_| src.alloc_block(0, MemKind::DEVICE, n).unwrap());
            let on1 = src.alloc_block(1, MemKind::DEVICE, n).unwrap();
            let dvpp1 = src.alloc_block(1, MemKind::Dvpp, n).unwrap();
            let s = src.create_stream(0).unwrap();
            let refused = |r: ascend_pool::Result<()>| {
                matches!(r, Err(Error::Runtime { code, .. }) if code == ascend_pool::AclError::INVALID_PARAM)
            };
            let read = |block: ascend_pool::source::Block| {
                let mut back = vec![0u8; n as usize];
                // SAFETY: `back` holds `n` bytes; `block` is a live block of `n` bytes that
                // no stream writes any more.
                unsafe {
                    src.memcpy(back.as_mut_ptr() as usize, n, block.addr, n, MemcpyKind::DeviceToHost)
                        .unwrap();
                }
                back
            };
            // SAFETY: every range is a live block of `n` bytes of this source, used by
            // nothing else; the stream is synchronized before the blocks are read or freed.
            unsafe {
                for (block, value) in [(a, 1), (b, 0), (on1, 2), (dvpp1, 3)] {
                    src.memset(block.addr, n, value, n).unwrap();
                }
                for kind in [MemcpyKind::DeviceToDevice, MemcpyKind::Default] {
                    for (dst, from) in [(on1, a), (a, on1), (dvpp1, a), (a, dvpp1)] {
                        let r = src.memcpy(dst.addr, n, from.addr, n, kind);
                        assert!(refused(r), "{kind:?} {:?} <- {:?}", dst.device, from.device);
                        let r = src.memcpy_async(dst.addr, n, from.addr, n, kind, s);
                        assert!(refused(r), "async {kind:?} {:?} <- {:?}", dst.device, from.device);
                    }
                    src.memcpy(b.addr, n, a.addr, n, kind).unwrap();
                    src.memcpy_async(b.addr, n, a.addr, n, kind, s).unwrap();
                    src.synchronize_stream(s).unwrap();
                }
            }
            for (block, value) in [(a, 1), (b, 1), (on1, 2), (dvpp1, 3)] {
                assert!(read(block).iter().all(|&x| x == value), "{block:?} holds {value}");
            }
            src.destroy_stream(s).unwrap();
            for block in [a, b, on1, dvpp1] {
                src.free_block(block).unwrap();
            }
        }

        #[test]
        fn exhaustion_trims_retries_then_reports() {
            let pool = pool_with(256 << 20, PoolConfig::default().with_chunk_size(32 << 20));
            let mut held = Vec::new();
            let err = loop {
                match pool.alloc_device(8 << 20) {
                    Ok(r) => held.push(r),
                    Err(e) => break e,
                }
                assert!(held.len() < 1000);
            };
            match err {
                Error::OutOfMemory { kind, requested, reserved, in_use, largest_free, source, .. } => {
                    assert_eq!(kind, MemKind::DEVICE);
                    assert_eq!(requested, 8 << 20);
                    assert!(reserved > 0 && in_use > 0 && in_use <= reserved);
                    assert!(largest_free < (8 << 20) + 64);
                    assert!(source.is_some_and(|c| c.is_out_of_memory()));
                }
                other => panic!("expected OutOfMemory, got {other:?}"),
            }
            assert!(held.len() >= 20, "only {} regions fit", held.len());
            pool.validate().unwrap();
            // Memory cached in empty chunks of another kind is given back on exhaustion.
            held.truncate(held.len() / 2);
            assert!(pool.alloc_device(8 << 20).is_ok());
            assert_eq!(pool.stats(MemKind::DEVICE).ooms, 1);
            pool.validate().unwrap();
        }

        #[test]
        fn limit_is_honoured() {
            let pool = pool_with(1 << 30, PoolConfig::default().with_chunk_size(16 << 20).with_limit(64 << 20));
            let mut held = Vec::new();
            let err = loop {
                match pool.alloc_dvpp(4 << 20) {
                    Ok(r) => held.push(r),
                    Err(e) => break e,
                }
            };
            assert!(matches!(err, Error::LimitExceeded { limit, .. } if limit == 64 << 20), "{err:?}");
            let reserved = pool.stats(MemKind::Dvpp).reserved_bytes;
            assert!(reserved <= 64 << 20);
            // Refused only once not even a chunk of just the request's granules (6 MiB)
            // fits under the limit: a growth size too big for it falls back to that.
            assert!(reserved + (6 << 20) > 64 << 20, "refused at {reserved} reserved, {} held", held.len());
            pool.validate().unwrap();
        }

        #[test]
        fn trim_gives_empty_chunks_back() {
            let pool = pool();
            let regions: Vec<_> = (0..50).map(|i| pool.alloc_host(1000 + i * 10_000).unwrap()).collect();
            let st = pool.stats(MemKind::Host);
            assert!(st.reserved_bytes >= st.allocated_bytes && st.chunks >= 1);
            drop(regions);
            pool.trim();
            let st = pool.stats(MemKind::Host);
            assert_eq!((st.reserved_bytes, st.chunks, st.live_regions), (0, 0, 0));
            assert_eq!(st.source_alloc_calls, st.source_free_calls);
            pool.validate().unwrap();
        }

        #[test]
        fn empty_chunks_past_the_release_threshold_go_back() {
            let config = PoolConfig::default().with_chunk_size(4 << 20).with_release_threshold(8 << 20);
            let pool = pool_with(1 << 30, config);
            let regions: Vec<_> = (0..12).map(|_| pool.alloc_device(1 << 20).unwrap()).collect();
            let held = pool.stats(MemKind::DEVICE).reserved_bytes;
            assert!(held >= 12 << 20, "twelve 1 MiB segments held, in chunks or one grown range");
            drop(regions);
            let st = pool.stats(MemKind::DEVICE);
            assert!(st.reserved_bytes <= 8 << 20, "kept {} bytes of empty chunks", st.reserved_bytes);
            assert!(st.source_free_calls > 0);
            pool.validate().unwrap();
        }

        #[test]
        fn debug_canary_reports_padding_overruns() {
            let pool = pool_with(1 << 30, PoolConfig::default().with_debug(true));
            let d = pool.alloc_device(100).unwrap();
            // What a buggy kernel would do: write past ALIGN_UP(100, 32) = 128 into the padding.
            let junk = [0x55u8; 8];
            // SAFETY: bytes 130..138 lie inside the segment's footprint (its padding).
            unsafe {
                pool.source()
                    .memcpy(d.addr() + 130, 8, junk.as_ptr() as usize, 8, MemcpyKind::HostToDevice)
                    .unwrap();
            }
            match d.free() {
                Err(Error::Corruption { kind, len, first_bad, .. }) => {
                    assert_eq!(kind, MemKind::DEVICE);
                    assert_eq!(len, 100);
                    assert_eq!(first_bad, 130);
                }
                other => panic!("overrun not caught: {other:?}"),
            }
            assert_eq!(pool.take_corruption_reports().len(), 1);
            // An intact region frees cleanly, and a dropped overrun is kept in the report.
            pool.alloc_dvpp(1000).unwrap().free().unwrap();
            let mut h = pool.alloc_host(40).unwrap();
            h.as_mut_slice()[0] = 1;
            // SAFETY: byte 70 of a 40-byte host segment is inside its padding (64..96).
            unsafe { *(h.addr() as *mut u8).add(70) = 9 };
            drop(h);
            assert_eq!(pool.take_corruption_reports().len(), 1);
            pool.validate().unwrap();
        }

        #[test]
        fn async_copies_round_trip() {
            let pool = pool();
            let stream = pool.create_stream().unwrap();
            let mut src = pool.alloc_host(4 << 20).unwrap();
            for (i, b) in src.as_mut_slice().iter_mut().enumerate() {
                *b = (i % 253) as u8;
            }
            let mut dev = pool.alloc_device(4 << 20).unwrap();
            let mut back = pool.alloc_host(4 << 20).unwrap();
            pool.copy_async(&mut dev, 0, &src, 0, 4 << 20, &stream).unwrap();
            pool.copy_async(&mut back, 0, &dev, 0, 4 << 20, &stream).unwrap();
            stream.synchronize().unwrap();
            assert_eq!(back.as_slice(), src.as_slice());
            pool.validate().unwrap();
        }

        #[test]
        fn memory_in_use_by_a_stream_is_not_reused_before_the_stream_passes() {
            let pool = pool();
            let stream = pool.create_stream().unwrap();
            // Small enough to be carved from a shared chunk, so reuse happens inside the pool.
            let len = 4u64 << 20;
            let mut src = pool.alloc_host(len).unwrap();
            src.as_mut_slice().fill(0xEE);
            // Work queued ahead keeps the stream busy, so the copy into `target` lands late.
            let mut filler_dst = pool.alloc_device(16 * len).unwrap();
            let filler_src = pool.alloc_device(16 * len).unwrap();
            for round in 0..3 {
                let mut target = pool.alloc_device(len).unwrap();
                let target_addr = target.addr();
                pool.copy_async(&mut filler_dst, 0, &filler_src, 0, 16 * len, &stream).unwrap();
                // A copy into `target`, then `target` is dropped before it has run.
                pool.copy_async(&mut target, 0, &src, 0, len, &stream).unwrap();
                drop(target);
                let mut fresh = pool.alloc_device(len).unwrap();
                assert!(fresh.addr() + len as usize <= target_addr || fresh.addr() >= target_addr + len as usize
                    || pool.stats(MemKind::DEVICE).pending_frees == 0,
                    "round {round}: reused memory a stream was still writing");
                pool.memset(&mut fresh, 0, 0x11, len).unwrap();
                stream.synchronize().unwrap();
                let mut check = vec![0u8; len as usize];
                pool.copy_to_host(&fresh, 0, &mut check).unwrap();
                assert!(check.iter().all(|&b| b == 0x11), "round {round}: data corrupted by a late copy");
            }
            pool.synchronize().unwrap();
            assert_eq!(pool.stats(MemKind::DEVICE).pending_frees, 0);
            pool.validate().unwrap();
        }

        #[test]
        fn snapshot_and_leak_report_describe_live_segments() {
            let pool = pool();
            let a = pool.alloc_dvpp(3_110_400).unwrap();
            let b = pool.alloc_host(1024).unwrap();
            let snap = pool.snapshot();
            let json = serde_json::to_value(&snap).unwrap();
            let kinds = json["kinds"].as_array().unwrap();
            assert_eq!(kinds.len(), 2);
            let dvpp = kinds.iter().find(|k| k["stats"]["kind"] == "dvpp").unwrap();
            assert_eq!(dvpp["chunks"][0]["segments"][0]["len"], 3_110_400);
            assert_eq!(dvpp["chunks"][0]["segments"][0]["footprint"], 3_110_528);
            let leaks = pool.leak_report();
            assert_eq!(leaks.len(), 2);
            assert!(leaks.iter().any(|l| l.addr == a.addr() && l.len == 3_110_400));
            assert!(leaks.iter().any(|l| l.addr == b.addr() && l.kind == MemKind::Host));
            drop((a, b));
            assert!(pool.leak_report().is_empty());
        }

        #[test]
        fn regions_outlive_a_dropped_pool() {
            let pool = pool();
            let mut d = pool.alloc_device(1000).unwrap();
            pool.copy_from_host(&mut d, 0, &[1, 2, 3]).unwrap();
            drop(pool); // prints a leak report; the chunk stays until `d` goes
            assert_eq!(d.len(), 1000);
            drop(d);
        }

        #[test]
        fn threads_share_a_pool() {
            let pool = Arc::new(pool());
            let handles: Vec<_> = (0..4u64)
                .map(|t| {
                    let pool = Arc::clone(&pool);
                    std::thread::spawn(move || {
                        let mut live = Vec::new();
                        for i in 0..400u64 {
                            let len = 16 + (i * 7919 + t * 104_729) % 300_000;
                            let mut r = pool.alloc_device(len).unwrap();
                            pool.copy_from_host(&mut r, 0, &[t as u8; 16]).unwrap();
                            live.push(r);
                            if i % 3 == 0 {
                                live.swap_remove((i as usize * 31) % live.len());
                            }
                        }
                        for r in &live {
                            let mut b = [0u8; 16];
                            pool.copy_to_host(r, 0, &mut b).unwrap();
                            assert_eq!(b, [t as u8; 16]);
                        }
                    })
                })
                .collect();
            for h in handles {
                h.join().unwrap();
            }
            pool.validate().unwrap();
            assert_eq!(pool.stats(MemKind::DEVICE).live_regions, 0);
        }

        /// The source's own calls, below any pool: memory info follows allocations, an
        /// event orders two streams, and destroyed streams and events are refused.
        #[test]
        fn streams_events_and_memory_info_follow_the_runtime() {
            let src = source(256 << 20);
            let len = 16u64 << 20;
            let (free0, total) = src.mem_info(0, MemKind::DEVICE).unwrap();
            assert!(total > 0 && free0 <= total, "{free0} free of {total}");
            let a = src.alloc_block(0, MemKind::DEVICE, len).unwrap();
            let b = src.alloc_block(0, MemKind::DEVICE, len).unwrap();
            let (free1, total1) = src.mem_info(0, MemKind::DEVICE).unwrap();
            assert_eq!(total1, total);
            assert!(free1 + 2 * len <= free0, "{free1} free after taking {} of {free0}", 2 * len);
            let s1 = src.create_stream(0).unwrap();
            let s2 = src.create_stream(0).unwrap();
            let e = src.create_event(0).unwrap();
            // SAFETY: `a` and `b` are this source's blocks of `len` bytes, used by nothing
            // else, and stay allocated until both streams have passed.
            unsafe {
                src.memset(a.addr, len, 0xA1, len).unwrap();
                src.memset(b.addr, len, 0, len).unwrap();
                // Copies that take tens of milliseconds on `s1` (four times the fill), then
                // the event...
                for _ in 0..4 {
                    src.memcpy_async(b.addr, len, a.addr, len, MemcpyKind::DeviceToDevice, s1)
                        .unwrap();
                }
                src.record_event(e, s1).unwrap();
                // ...which `s2` waits for: its fill lands after the copy, not under it.
                src.stream_wait_event(s2, e).unwrap();
                src.memset_async(b.addr, len, 0xB2, len, s2).unwrap();
            }
            src.synchronize_event(e).unwrap();
            assert!(src.query_event(e).unwrap(), "an event waited for is complete");
            src.synchronize_stream(s2).unwrap();
            let mut back = vec![0u8; len as usize];
            // SAFETY: `back` holds `len` bytes; both streams have passed `b`.
            unsafe {
                src.memcpy(back.as_mut_ptr() as usize, len, b.addr, len, MemcpyKind::DeviceToHost)
                    .unwrap();
            }
            assert!(back.iter().all(|&x| x == 0xB2), "the fill ran before the copy it waited for");
            src.destroy_event(e).unwrap();
            assert!(src.destroy_event(e).is_err(), "an event destroyed twice");
            assert!(src.query_event(e).is_err(), "a destroyed event queried");
            src.destroy_stream(s1).unwrap();
            src.destroy_stream(s2).unwrap();
            assert!(src.destroy_stream(s1).is_err(), "a stream destroyed twice");
            assert!(src.synchronize_stream(s2).is_err(), "a destroyed stream synchronized");
            src.free_block(a).unwrap();
            src.free_block(b).unwrap();
            assert_eq!(src.mem_info(0, MemKind::DEVICE).unwrap(), (free0, total));
            // A device the runtime lacks is refused for every kind: the real runtime's
            // aclrtSetDevice refuses it before pinned host memory is asked for too.
            for kind in [MemKind::DEVICE, MemKind::Dvpp, MemKind::Host] {
                let r = src.alloc_block(1000, kind, 1 << 20);
                assert!(matches!(r, Err(Error::Runtime { .. })), "{kind}: {r:?}");
            }
            assert_eq!(src.mem_info(0, MemKind::DEVICE).unwrap(), (free0, total));
        }

        /// DVPP memory is device memory, within the DVPP address space the runtime gives one
        /// process (16 GiB on Atlas A2/A3): its free and total bytes are the device's, capped
        /// by what is left of that space, and a DVPP block takes from both. `AclSource`
        /// answered the device's figures (64 GiB of 64 GiB over the drop-in's defaults) where
        /// the simulator answered 16 GiB.
        #[test]
        fn dvpp_memory_info_is_device_memory_within_the_process_address_space() {
            use ascend_pool::source::sim::DVPP_ADDRESS_LIMIT;
            let src = source(2 * DVPP_ADDRESS_LIMIT);
            let device = || src.mem_info(0, MemKind::DEVICE).unwrap();
            let dvpp = || src.mem_info(0, MemKind::Dvpp).unwrap();
            let ((dev_free, dev_total), (free, total)) = (device(), dvpp());
            assert_eq!(total, dev_total.min(DVPP_ADDRESS_LIMIT), "{dev_total}");
            assert_eq!(free, dev_free.min(DVPP_ADDRESS_LIMIT), "{dev_free}");
            let len = 4u64 << 20;
            let b = src.alloc_block(0, MemKind::Dvpp, len).unwrap();
            let (free1, total1) = dvpp();
            assert_eq!(total1, total);
            assert!(free1 + len <= free, "{free1} DVPP bytes free after taking {len} of {free}");
            assert!(device().0 + len <= dev_free, "a DVPP block takes device memory");
            src.free_block(b).unwrap();
            assert_eq!(dvpp(), (free, total));
        }

        /// A one-sided write's ranges, kinds and handles are checked by the pool, before any
        /// runtime call, whatever the source; a source without a communicator of its own
        /// says so with `NotSupported`.
        #[test]
        fn one_sided_writes_are_checked_before_the_runtime() {
            use ascend_pool::comm::{CommThread, RemoteWindow, WINDOW_GRANULE};
            use ascend_pool::source::{ChannelHandle, CommThreadHandle};
            let pool = pool();
            let stream = pool.create_stream().unwrap();
            let thread = match pool.acquire_comm_thread(&stream) {
                Ok(t) => t,
                // SAFETY: every write below is refused before the handle is used.
                Err(Error::NotSupported { .. }) => unsafe { CommThread::from_raw(CommThreadHandle(1), &stream) },
                Err(e) => panic!("acquiring a thread: {e}"),
            };
            let window = pool.alloc_device_aligned(WINDOW_GRANULE, WINDOW_GRANULE).unwrap();
            assert_eq!(window.addr() as u64 % WINDOW_GRANULE, 0);
            // SAFETY: as above; the range is this pool's own window.
            let far = unsafe { RemoteWindow::from_raw(ChannelHandle(1), window.addr(), WINDOW_GRANULE) };
            let src = pool.alloc_device(4096).unwrap();
            let host = pool.alloc_host(4096).unwrap();
            for (dst_off, src_off, len) in [(0, 0, 0), (WINDOW_GRANULE - 64, 0, 128), (0, 4032, 128), (u64::MAX, 0, 1)] {
                assert!(matches!(pool.write_remote(&thread, &far, dst_off, &src, src_off, len), Err(Error::OutOfBounds { .. })));
            }
            assert!(matches!(pool.write_remote(&thread, &far, 0, &host, 0, 64), Err(Error::WrongKind { .. })));
            let other = pool_with(64 << 20, PoolConfig::default());
            let foreign = other.alloc_device(4096).unwrap();
            assert!(matches!(pool.write_remote(&thread, &far, 0, &foreign, 0, 64), Err(Error::ForeignHandle)));
            let foreign_stream = other.create_stream().unwrap();
            assert!(matches!(pool.acquire_comm_thread(&foreign_stream), Err(Error::ForeignHandle)));
            drop((src, host, window, foreign));
            pool.synchronize().unwrap();
            pool.validate().unwrap();
            assert!(pool.leak_report().is_empty());
        }
    };
}
