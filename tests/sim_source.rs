//! The simulator against the AscendCL behaviour it stands for.

use std::sync::Arc;
use std::time::{Duration, Instant};

use ascend_pool::source::sim::{AclFunc, Fault, SimConfig, SimSource};
use ascend_pool::source::{Block, BlockSource, MemcpyKind};
use ascend_pool::{AclError, Error, MallocPolicy, MemKind};

#[path = "common/device.rs"]
mod common_device;

#[path = "common/cases.rs"]
mod cases;

#[path = "common/address_space.rs"]
mod address_space;
use cases::cases;

const GIB: u64 = 1 << 30;

fn err<T: std::fmt::Debug>(r: ascend_pool::Result<T>) -> (&'static str, AclError) {
    match r {
        Err(Error::Runtime { func, code }) => (func, code),
        other => panic!("expected a runtime error, got {other:?}"),
    }
}

use common_device::read;

/// Host bytes at a 64-aligned address, as `aclrtMemcpyAsync` wants of both ends.
#[repr(C, align(64))]
#[derive(Clone, Copy)]
struct Line([u8; 64]);

/// A host buffer of whole [`Line`]s.
struct HostBuf(Vec<Line>);

impl HostBuf {
    fn new(len: usize, byte: impl Fn(usize) -> u8) -> Self {
        let mut lines = vec![Line([0; 64]); len.div_ceil(64)];
        for (i, b) in lines.iter_mut().flat_map(|l| l.0.iter_mut()).enumerate() {
            *b = byte(i);
        }
        Self(lines)
    }
    fn addr(&self) -> usize {
        self.0.as_ptr() as usize
    }
    fn bytes(&self) -> Vec<u8> {
        self.0.iter().flat_map(|l| l.0).collect()
    }
}

/// A block maps host memory lazily and freeing it unmaps all of it: a pipeline that
/// allocates and frees for hours keeps the same address space.
#[test]
fn a_freed_block_gives_back_its_address_space() {
    let sim = SimSource::default();
    for kind in [MemKind::DEVICE, MemKind::Dvpp, MemKind::Host] {
        assert!(
            address_space::in_some_try(|| {
                let before = address_space::mapped_bytes();
                let b = sim.alloc_block(0, kind, GIB).unwrap();
                let mapped = address_space::mapped_bytes() - before;
                sim.free_block(b).unwrap();
                let kept = address_space::mapped_bytes() - before;
                mapped >= GIB as i64 && kept == 0
            }),
            "{kind}"
        );
    }
}

#[test]
fn every_kind_is_aligned_and_rounded() {
    let sim = SimSource::default();
    let p = MallocPolicy::HugeFirst;
    for (kind, size, rounded) in [
        (MemKind::Device(p), 100, 160),
        (MemKind::DeviceAlign32(p), 100, 128),
        (MemKind::Cached(p), 100, 160),
        (MemKind::Device(MallocPolicy::Huge1gOnly), 100, 128),
        (MemKind::Dvpp, 100, 160),
        (MemKind::Host, 100, 160),
    ] {
        let blocks: Vec<Block> = (0..8)
            .map(|_| sim.alloc_block(0, kind, size).unwrap())
            .collect();
        for b in &blocks {
            assert_eq!(b.addr % kind.default_align() as usize, 0, "{kind}");
            assert_eq!(b.size, size);
            assert_eq!(sim.block_containing(b.addr + 50), Some(*b));
        }
        let u = sim.stats().usage(0, kind);
        assert_eq!(
            (u.blocks, u.rounded_bytes, u.requested_bytes),
            (8, 8 * rounded, 800)
        );
        for b in blocks {
            sim.free_block(b).unwrap();
        }
    }
    assert_eq!(sim.stats().live_blocks, 0);
}

#[test]
fn size_zero_is_invalid_param() {
    let sim = SimSource::default();
    assert_eq!(
        err(sim.alloc_block(0, MemKind::DEVICE, 0)),
        ("aclrtMalloc", AclError::INVALID_PARAM)
    );
    assert_eq!(
        err(sim.alloc_block(0, MemKind::Host, 0)),
        ("aclrtMallocHost", AclError::INVALID_PARAM)
    );
}

#[test]
fn exhaustion_then_recovery() {
    let sim = SimSource::new(SimConfig::default().with_device_capacity(GIB)).unwrap();
    // 4 blocks of 256 MiB - 32 fill 1 GiB exactly (each is accounted 256 MiB).
    let blocks: Vec<Block> = (0..4)
        .map(|_| {
            sim.alloc_block(0, MemKind::DEVICE, (256 << 20) - 32)
                .unwrap()
        })
        .collect();
    assert_eq!(sim.mem_info(0, MemKind::DEVICE).unwrap(), (0, GIB));
    let e = sim.alloc_block(0, MemKind::DEVICE, 1).unwrap_err();
    assert_eq!(
        e,
        Error::Runtime {
            func: "aclrtMalloc",
            code: AclError::RT_MEMORY_ALLOCATION
        }
    );
    assert!(matches!(e, Error::Runtime { code, .. } if code.is_out_of_memory()));
    assert_eq!(sim.stats().failures(AclFunc::Malloc), 1);
    let mut blocks = blocks.into_iter();
    sim.free_block(blocks.next().unwrap()).unwrap();
    let again = sim.alloc_block(0, MemKind::DEVICE, 100 << 20).unwrap();
    for b in blocks.chain([again]) {
        sim.free_block(b).unwrap();
    }
    assert_eq!(sim.mem_info(0, MemKind::DEVICE).unwrap(), (GIB, GIB));
}

#[test]
fn dvpp_is_limited_to_16_gib_of_address_space() {
    let sim = SimSource::default(); // 64 GiB device: the DVPP limit bites first
                                    // Each 4 GiB block is accounted 4 GiB + 32: three fit, the fourth passes 16 GiB.
    let blocks: Vec<Block> = (0..3)
        .map(|_| sim.alloc_block(0, MemKind::Dvpp, 4 * GIB).unwrap())
        .collect();
    assert_eq!(
        err(sim.alloc_block(0, MemKind::Dvpp, 4 * GIB)),
        ("acldvppMalloc", AclError::RT_MEMORY_ALLOCATION)
    );
    let (free, total) = sim.mem_info(0, MemKind::Dvpp).unwrap();
    assert_eq!(total, 16 * GIB);
    assert_eq!(free, 4 * GIB - 96);
    // A block that fits the remainder is still served; aclrtMalloc is untouched by the limit.
    let tail = sim.alloc_block(0, MemKind::Dvpp, 4 * GIB - 128).unwrap();
    let dev = sim.alloc_block(0, MemKind::DEVICE, 8 * GIB).unwrap();
    for b in blocks.into_iter().chain([tail, dev]) {
        assert_eq!(b.addr % 128, 0);
        sim.free_block(b).unwrap();
    }
}

#[test]
fn lazy_mapping_of_a_64_gib_device() {
    // This machine has far less than 32 GiB; only touched pages cost memory.
    let sim = SimSource::default();
    assert_eq!(
        sim.mem_info(0, MemKind::DEVICE).unwrap(),
        (64 * GIB, 64 * GIB)
    );
    let b = sim.alloc_block(0, MemKind::DEVICE, 32 * GIB).unwrap();
    let last = b.addr + (32 * GIB) as usize - 8;
    // SAFETY: both ranges lie inside the live block (checked by the simulator too).
    unsafe {
        sim.memset(b.addr, 8, 0x5a, 8).unwrap();
        sim.memset(last, 8, 0xa5, 8).unwrap();
        // The padding bytes belong to the allocation as well.
        sim.memset(b.addr + (32 * GIB) as usize, 32, 1, 32).unwrap();
    }
    assert_eq!(read(&sim, b.addr, 8), [0x5a; 8]);
    assert_eq!(read(&sim, last, 8), [0xa5; 8]);
    assert_eq!(read(&sim, b.addr + (GIB as usize), 4), [0; 4]);
    assert_eq!(sim.mem_info(0, MemKind::DEVICE).unwrap().0, 32 * GIB - 32);
    sim.free_block(b).unwrap();
}

#[test]
fn unknown_and_double_free() {
    let sim = SimSource::default();
    let b = sim.alloc_block(0, MemKind::Host, 4096).unwrap();
    let unknown = Block { addr: 0x1000, ..b };
    assert_eq!(
        err(sim.free_block(unknown)),
        ("aclrtFreeHost", AclError::RT_MEMORY_FREE)
    );
    sim.free_block(b).unwrap();
    assert_eq!(
        err(sim.free_block(b)),
        ("aclrtFreeHost", AclError::RT_MEMORY_FREE)
    );
    let d = sim.alloc_block(0, MemKind::Dvpp, 4096).unwrap();
    let via_aclrt_free = Block {
        kind: MemKind::DEVICE,
        ..d
    };
    assert_eq!(
        err(sim.free_block(via_aclrt_free)),
        ("aclrtFree", AclError::RT_MEMORY_FREE)
    );
    sim.free_block(d).unwrap();
}

#[test]
fn async_copy_runs_on_the_stream_worker() {
    let sim = SimSource::default();
    let dev = sim.alloc_block(0, MemKind::DEVICE, 1 << 20).unwrap();
    let stream = sim.create_stream(0).unwrap();
    let event = sim.create_event(0).unwrap();
    let src = HostBuf::new(1 << 20, |i| (i % 251) as u8);

    // Held, so the checks below that the calls returned early cannot race the worker (a
    // delay alone would let a thread descheduled for longer than it fail them).
    let hold = sim.hold_stream(stream).unwrap();
    sim.enqueue_delay(stream, Duration::from_millis(100))
        .unwrap();
    // SAFETY: `src` lives until the event has completed below; `dev` is live.
    unsafe {
        sim.memcpy_async(
            dev.addr,
            dev.size,
            src.addr(),
            1 << 20,
            MemcpyKind::HostToDevice,
            stream,
        )
        .unwrap();
    }
    sim.record_event(event, stream).unwrap();
    // The calls returned while the stream still has its 100 ms "kernel" ahead of it.
    assert!(!sim.query_event(event).unwrap());
    assert!(sim.pending_ops(stream).unwrap() >= 2);
    assert_eq!(read(&sim, dev.addr, 4), [0; 4], "the copy has not run");
    let t0 = Instant::now();
    hold.release();
    sim.synchronize_event(event).unwrap();
    assert!(
        t0.elapsed() >= Duration::from_millis(100),
        "the event waited for the kernel"
    );
    assert!(sim.query_event(event).unwrap());
    assert_eq!(read(&sim, dev.addr, 1 << 20), src.bytes());

    sim.destroy_event(event).unwrap();
    sim.destroy_stream(stream).unwrap();
    sim.free_block(dev).unwrap();
}

#[test]
fn held_stream_is_deterministic() {
    let sim = SimSource::default();
    let dev = sim.alloc_block(0, MemKind::DEVICE, 4096).unwrap();
    let stream = sim.create_stream(0).unwrap();
    let event = sim.create_event(0).unwrap();
    let hold = sim.hold_stream(stream).unwrap();
    // SAFETY: `dev` is live and in bounds.
    unsafe { sim.memset_async(dev.addr, 4096, 9, 4096, stream).unwrap() };
    sim.record_event(event, stream).unwrap();
    std::thread::sleep(Duration::from_millis(20));
    assert!(!sim.query_event(event).unwrap());
    assert_eq!(read(&sim, dev.addr, 4), [0; 4], "the fill has not run");
    hold.release();
    sim.synchronize_stream(stream).unwrap();
    assert!(sim.query_event(event).unwrap());
    assert_eq!(read(&sim, dev.addr, 4096), vec![9; 4096]);
    // Re-recording makes the event pending again; synchronize_event waits for the new record.
    let hold = sim.hold_stream(stream).unwrap();
    sim.record_event(event, stream).unwrap();
    assert!(!sim.query_event(event).unwrap());
    drop(hold);
    sim.synchronize_event(event).unwrap();
    assert!(sim.query_event(event).unwrap());
    sim.free_block(dev).unwrap();
}

#[test]
fn stream_wait_event_orders_two_streams() {
    let sim = SimSource::default();
    let a = sim.create_stream(0).unwrap();
    let b = sim.create_stream(0).unwrap();
    let produced = sim.create_event(0).unwrap();
    let consumed = sim.create_event(0).unwrap();
    let x = sim.alloc_block(0, MemKind::DEVICE, 4096).unwrap();
    let y = sim.alloc_block(0, MemKind::DEVICE, 4096).unwrap();

    // Stream a produces x (after a "kernel" we hold), stream b copies x to y.
    let hold = sim.hold_stream(a).unwrap();
    // SAFETY: x and y are live, 64-aligned, in bounds.
    unsafe {
        sim.memset_async(x.addr, 4096, 0xab, 4096, a).unwrap();
        sim.record_event(produced, a).unwrap();
        sim.stream_wait_event(b, produced).unwrap();
        sim.memcpy_async(y.addr, 4096, x.addr, 4096, MemcpyKind::DeviceToDevice, b)
            .unwrap();
    }
    sim.record_event(consumed, b).unwrap();
    std::thread::sleep(Duration::from_millis(20));
    assert!(!sim.query_event(consumed).unwrap(), "b waits for a");
    assert_eq!(read(&sim, y.addr, 4), [0; 4]);
    drop(hold);
    sim.synchronize_event(consumed).unwrap();
    assert!(sim.query_event(produced).unwrap());
    assert_eq!(read(&sim, y.addr, 4096), vec![0xab; 4096]);

    // Waiting on an event never recorded does not block.
    let never = sim.create_event(0).unwrap();
    sim.stream_wait_event(b, never).unwrap();
    sim.synchronize_stream(b).unwrap();

    sim.destroy_stream(a).unwrap();
    sim.destroy_stream(b).unwrap();
    sim.free_block(x).unwrap();
    sim.free_block(y).unwrap();
}

#[test]
fn async_copies_need_64_aligned_addresses_of_every_kind() {
    let sim = SimSource::default();
    let s = sim.create_stream(0).unwrap();
    let a = sim.alloc_block(0, MemKind::DEVICE, 4096).unwrap();
    let b = sim.alloc_block(0, MemKind::DEVICE, 4096).unwrap();
    // SAFETY: every range is inside a live block; refused calls touch nothing.
    unsafe {
        for (dst, src) in [(a.addr + 32, b.addr), (a.addr, b.addr + 8)] {
            assert_eq!(
                err(sim.memcpy_async(dst, 64, src, 64, MemcpyKind::DeviceToDevice, s)),
                ("aclrtMemcpyAsync", AclError::RT_ADDR_UNALIGNED)
            );
        }
        // Inferred direction: both sides are device memory.
        assert_eq!(
            err(sim.memcpy_async(a.addr + 32, 64, b.addr, 64, MemcpyKind::Default, s)).1,
            AclError::RT_ADDR_UNALIGNED
        );
        // 64-aligned offsets are fine, and so is the synchronous copy at any offset. The
        // two write disjoint bytes: the async copy may still be running when the other lands.
        sim.memcpy_async(
            a.addr + 64,
            64,
            b.addr + 128,
            64,
            MemcpyKind::DeviceToDevice,
            s,
        )
        .unwrap();
        sim.memcpy(a.addr + 160, 64, b.addr + 8, 64, MemcpyKind::DeviceToDevice)
            .unwrap();
        // Host-side addresses need it too: the runtime asks it of every async copy.
        let host = sim.alloc_block(0, MemKind::Host, 4096).unwrap();
        std::ptr::write_bytes(host.addr as *mut u8, 1, 128);
        for (dst, src, kind) in [
            (a.addr, host.addr + 1, MemcpyKind::HostToDevice),
            (a.addr + 32, host.addr, MemcpyKind::HostToDevice),
            (host.addr + 8, a.addr, MemcpyKind::DeviceToHost),
            (host.addr, a.addr + 16, MemcpyKind::DeviceToHost),
            (a.addr, host.addr + 32, MemcpyKind::Default),
        ] {
            assert_eq!(
                err(sim.memcpy_async(dst, 64, src, 63, kind, s)),
                ("aclrtMemcpyAsync", AclError::RT_ADDR_UNALIGNED),
                "{kind:?}"
            );
        }
        sim.memcpy_async(a.addr, 64, host.addr + 64, 63, MemcpyKind::HostToDevice, s)
            .unwrap();
        sim.synchronize_stream(s).unwrap();
        sim.free_block(host).unwrap();
    }
    assert_eq!(read(&sim, a.addr, 63), vec![1; 63]);
    sim.destroy_stream(s).unwrap();
    sim.free_block(a).unwrap();
    sim.free_block(b).unwrap();
}

#[test]
fn out_of_bounds_copies_and_fills_are_refused() {
    let sim = SimSource::default();
    let s = sim.create_stream(0).unwrap();
    let a = sim.alloc_block(0, MemKind::DEVICE, 1000).unwrap(); // accounted 1056 bytes
    let h = sim.alloc_block(0, MemKind::Host, 1000).unwrap();
    let mut host = vec![0u8; 4096];
    let hp = host.as_mut_ptr() as usize;
    let bad = AclError::INVALID_PARAM;
    // SAFETY: all accepted ranges are inside live blocks or `host`; refused ones touch nothing.
    unsafe {
        // count > dst_max.
        assert_eq!(
            err(sim.memcpy(a.addr, 10, hp, 11, MemcpyKind::HostToDevice)),
            ("aclrtMemcpy", bad)
        );
        // Past the end of the allocation, on either side.
        assert_eq!(
            err(sim.memcpy(a.addr + 1000, 4096, hp, 57, MemcpyKind::HostToDevice)).1,
            bad
        );
        assert_eq!(
            err(sim.memcpy(hp, 4096, a.addr, 1057, MemcpyKind::DeviceToHost)).1,
            bad
        );
        assert_eq!(
            err(sim.memcpy_async(
                a.addr,
                2048,
                a.addr + 64,
                1056,
                MemcpyKind::DeviceToDevice,
                s
            ))
            .1,
            bad
        );
        // A device address that is no block of ours, or pinned host memory named as device.
        assert_eq!(
            err(sim.memcpy(hp, 64, hp + 64, 64, MemcpyKind::DeviceToHost)).1,
            bad
        );
        assert_eq!(
            err(sim.memcpy(h.addr, 64, hp, 64, MemcpyKind::HostToDevice)).1,
            bad
        );
        assert_eq!(
            err(sim.memcpy(0, 64, hp, 64, MemcpyKind::HostToHost)).1,
            bad
        );
        // Fills.
        assert_eq!(err(sim.memset(a.addr, 10, 0, 11)), ("aclrtMemset", bad));
        assert_eq!(err(sim.memset(a.addr + 1024, 64, 0, 64)).1, bad);
        assert_eq!(
            err(sim.memset_async(hp, 64, 0, 64, s)),
            ("aclrtMemsetAsync", bad)
        );
        // Up to the last accounted byte is fine; pinned host memory can be filled.
        sim.memcpy(a.addr + 1000, 4096, hp, 56, MemcpyKind::HostToDevice)
            .unwrap();
        sim.memset(h.addr, 1056, 3, 1056).unwrap();
        sim.memcpy(hp, 4096, h.addr, 1000, MemcpyKind::Default)
            .unwrap();
    }
    assert!(host[..1000].iter().all(|&b| b == 3));
    let st = sim.stats();
    assert_eq!(st.failures(AclFunc::Memcpy), 6);
    assert_eq!(st.failures(AclFunc::MemcpyAsync), 1);
    sim.destroy_stream(s).unwrap();
    sim.free_block(a).unwrap();
    sim.free_block(h).unwrap();
}

#[test]
fn fault_injection() {
    let sim = SimSource::default();
    sim.inject_fault(Fault::next(AclFunc::Malloc, AclError::RT_DEVICE_OOM, 2));
    for _ in 0..2 {
        assert_eq!(
            err(sim.alloc_block(0, MemKind::DEVICE, 64)),
            ("aclrtMalloc", AclError::RT_DEVICE_OOM)
        );
    }
    let b = sim.alloc_block(0, MemKind::DEVICE, 64).unwrap();
    // Other functions are untouched; an injected failure accounts nothing.
    assert_eq!(sim.stats().live_blocks, 1);
    sim.inject_fault(Fault::always(AclFunc::Free, AclError::RT_MEMORY_FREE));
    sim.inject_fault(Fault::always(AclFunc::MemcpyAsync, AclError::RT_FAILURE));
    let s = sim.create_stream(0).unwrap();
    for _ in 0..3 {
        assert_eq!(err(sim.free_block(b)).1, AclError::RT_MEMORY_FREE);
        // SAFETY: refused before touching anything.
        let r = unsafe { sim.memcpy_async(b.addr, 64, b.addr, 64, MemcpyKind::DeviceToDevice, s) };
        assert_eq!(err(r), ("aclrtMemcpyAsync", AclError::RT_FAILURE));
    }
    sim.clear_faults();
    sim.free_block(b).unwrap();
    let st = sim.stats();
    assert_eq!(st.calls(AclFunc::Malloc), 3);
    assert_eq!(st.failures(AclFunc::Malloc), 2);
    assert_eq!(st.calls(AclFunc::Free), 4);
    assert_eq!(st.failures(AclFunc::Free), 3);
    assert_eq!(st.live_blocks, 0);
    sim.destroy_stream(s).unwrap();
}

#[test]
fn free_with_queued_copy_keeps_memory_mapped() {
    let sim = SimSource::default();
    let s = sim.create_stream(0).unwrap();
    let dev = sim.alloc_block(0, MemKind::DEVICE, 4096).unwrap();
    // SAFETY: dev is live.
    unsafe { sim.memset(dev.addr, 4096, 0x77, 4096).unwrap() };
    let out = HostBuf::new(4096, |_| 0);
    let hold = sim.hold_stream(s).unwrap();
    // SAFETY: `out` outlives the copy: we synchronize before reading it.
    unsafe {
        sim.memcpy_async(
            out.addr(),
            4096,
            dev.addr,
            4096,
            MemcpyKind::DeviceToHost,
            s,
        )
        .unwrap();
    }
    // Freeing releases the accounting at once; the bytes stay mapped for the queued copy.
    sim.free_block(dev).unwrap();
    assert_eq!(sim.stats().live_blocks, 0);
    assert_eq!(sim.block_containing(dev.addr), None);
    drop(hold);
    sim.synchronize_stream(s).unwrap();
    assert_eq!(out.bytes(), vec![0x77; 4096]);
}

#[test]
fn bandwidth_makes_copies_take_time() {
    let sim = SimSource::new(SimConfig::default().with_copy_bandwidth(10 << 20)).unwrap();
    let s = sim.create_stream(0).unwrap();
    let dev = sim.alloc_block(0, MemKind::DEVICE, 1 << 20).unwrap();
    let src = HostBuf::new(1 << 20, |_| 5);
    let t0 = Instant::now();
    // SAFETY: `src` outlives the copy (synchronized below).
    unsafe {
        sim.memcpy_async(
            dev.addr,
            dev.size,
            src.addr(),
            1 << 20,
            MemcpyKind::HostToDevice,
            s,
        )
        .unwrap();
    }
    sim.synchronize_stream(s).unwrap();
    assert!(
        t0.elapsed() >= Duration::from_millis(100),
        "1 MiB at 10 MiB/s"
    );
    assert_eq!(read(&sim, dev.addr + 4000, 4), [5; 4]);
}

#[test]
fn drop_drains_streams_and_unmaps() {
    let sim = SimSource::default();
    let s = sim.create_stream(0).unwrap();
    let dev = sim.alloc_block(0, MemKind::DEVICE, 1 << 16).unwrap();
    let out = HostBuf::new(1 << 16, |_| 0);
    sim.enqueue_delay(s, Duration::from_millis(50)).unwrap();
    // SAFETY: dev stays mapped until the queued ops have run; `out` outlives `sim`.
    unsafe {
        sim.memset_async(dev.addr, 1 << 16, 1, 1 << 16, s).unwrap();
        sim.memcpy_async(
            out.addr(),
            1 << 16,
            dev.addr,
            1 << 16,
            MemcpyKind::DeviceToHost,
            s,
        )
        .unwrap();
    }
    // The stream and the block are still live: dropping drains the stream, then unmaps.
    drop(sim);
    assert_eq!(
        out.bytes(),
        vec![1; 1 << 16],
        "the queued work ran before the drop returned"
    );
}

#[test]
fn usable_as_a_shared_trait_object_across_threads() {
    let sim: Arc<dyn BlockSource> =
        Arc::new(SimSource::new(SimConfig::default().with_device_capacity(64 << 20)).unwrap());
    let threads: Vec<_> = (0..4)
        .map(|t| {
            let sim = Arc::clone(&sim);
            std::thread::spawn(move || {
                let s = sim.create_stream(0).unwrap();
                for i in 0..200u64 {
                    let b = sim.alloc_block(0, MemKind::DEVICE, 1 + i * 97 + t).unwrap();
                    // SAFETY: b is live and in bounds.
                    unsafe { sim.memset_async(b.addr, b.size, 1, b.size, s).unwrap() };
                    sim.synchronize_stream(s).unwrap();
                    sim.free_block(b).unwrap();
                }
                sim.destroy_stream(s).unwrap();
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    assert_eq!(
        sim.mem_info(0, MemKind::DEVICE).unwrap(),
        (64 << 20, 64 << 20)
    );
    assert_eq!(sim.name(), "sim");
}

mod model {
    //! Random alloc/free sequences against a plain model of the runtime's accounting.
    use super::*;
    use proptest::prelude::*;

    #[derive(Debug, Clone)]
    enum Step {
        Alloc { kind: usize, device: i32, size: u64 },
        Free { pick: usize },
    }

    fn step() -> impl Strategy<Value = Step> {
        prop_oneof![
            (0..5usize, 0..3i32, 0..40_000u64).prop_map(|(kind, device, size)| Step::Alloc {
                kind,
                device,
                size
            }),
            any::<usize>().prop_map(|pick| Step::Free { pick }),
        ]
    }

    const DEVICE_CAP: u64 = 100_000;
    const DVPP_CAP: u64 = 60_000;
    const HOST_CAP: u64 = 50_000;

    fn rounded(kind: MemKind, size: u64) -> u64 {
        let padding = match kind {
            MemKind::DeviceAlign32(_) | MemKind::Device(MallocPolicy::Huge1gOnly) => 0,
            _ => 32,
        };
        size.div_ceil(32) * 32 + padding
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(cases(64)))]
        #[test]
        fn accounting_matches_model(steps in proptest::collection::vec(step(), 1..60)) {
            let kinds = [
                MemKind::DEVICE,
                MemKind::DeviceAlign32(MallocPolicy::HugeFirst),
                MemKind::Device(MallocPolicy::Huge1gOnly),
                MemKind::Dvpp,
                MemKind::Host,
            ];
            let sim = SimSource::new(
                SimConfig::default()
                    .with_devices(2)
                    .with_device_capacity(DEVICE_CAP)
                    .with_dvpp_limit(DVPP_CAP)
                    .with_host_capacity(HOST_CAP),
            )
            .unwrap();
            let mut live: Vec<(Block, u64)> = Vec::new();
            let (mut dev_used, mut dvpp_used, mut host_used) = ([0u64; 2], 0u64, 0u64);
            for s in steps {
                match s {
                    Step::Alloc { kind, device, size } => {
                        let kind = kinds[kind];
                        let r = sim.alloc_block(device, kind, size);
                        let want = if size == 0 {
                            Err(AclError::INVALID_PARAM)
                        } else if device >= 2 {
                            Err(AclError::RT_PARAM_INVALID)
                        } else {
                            let m = rounded(kind, size);
                            let ok = match kind {
                                MemKind::Host => host_used + m <= HOST_CAP,
                                MemKind::Dvpp => dev_used[device as usize] + m <= DEVICE_CAP
                                    && dvpp_used + m <= DVPP_CAP,
                                _ => dev_used[device as usize] + m <= DEVICE_CAP,
                            };
                            if ok { Ok(m) } else { Err(AclError::RT_MEMORY_ALLOCATION) }
                        };
                        match (r, want) {
                            (Ok(b), Ok(m)) => {
                                prop_assert_eq!(b.addr as u64 % kind.default_align(), 0);
                                match kind {
                                    MemKind::Host => host_used += m,
                                    MemKind::Dvpp => {
                                        dvpp_used += m;
                                        dev_used[device as usize] += m;
                                    }
                                    _ => dev_used[device as usize] += m,
                                }
                                live.push((b, m));
                            }
                            (Err(Error::Runtime { code, .. }), Err(want)) => {
                                prop_assert_eq!(code, want)
                            }
                            (got, want) => prop_assert!(false, "got {:?}, model says {:?}", got, want),
                        }
                    }
                    Step::Free { pick } => {
                        if live.is_empty() {
                            continue;
                        }
                        let (b, m) = live.swap_remove(pick % live.len());
                        sim.free_block(b).unwrap();
                        match b.kind {
                            MemKind::Host => host_used -= m,
                            MemKind::Dvpp => {
                                dvpp_used -= m;
                                dev_used[b.device as usize] -= m;
                            }
                            _ => dev_used[b.device as usize] -= m,
                        }
                        // A second free of the same block is refused and changes nothing.
                        prop_assert!(sim.free_block(b).is_err());
                    }
                }
                for d in 0..2 {
                    prop_assert_eq!(
                        sim.mem_info(d, MemKind::DEVICE).unwrap(),
                        (DEVICE_CAP - dev_used[d as usize], DEVICE_CAP)
                    );
                    prop_assert_eq!(sim.stats().rounded_bytes_on(d), dev_used[d as usize]
                        + sim.stats().usage(d, MemKind::Host).rounded_bytes);
                }
                prop_assert_eq!(
                    sim.mem_info(0, MemKind::Dvpp).unwrap().0,
                    (DEVICE_CAP - dev_used[0]).min(DVPP_CAP - dvpp_used)
                );
                prop_assert_eq!(sim.mem_info(0, MemKind::Host).unwrap().0, HOST_CAP - host_used);
                prop_assert_eq!(sim.stats().live_blocks, live.len() as u64);
            }
        }
    }
}

/// Events and streams belong to a device: an event is recorded on a stream of its own
/// device, on any device, and a stream of another device is refused.
#[test]
fn events_are_recorded_on_streams_of_their_own_device() {
    let sim = SimSource::new(SimConfig::default().with_devices(2)).unwrap();
    let (s0, s1) = (sim.create_stream(0).unwrap(), sim.create_stream(1).unwrap());
    let (e0, e1) = (sim.create_event(0).unwrap(), sim.create_event(1).unwrap());
    sim.record_event(e0, s0).unwrap();
    sim.record_event(e1, s1).unwrap();
    assert_eq!(
        err(sim.record_event(e0, s1)),
        ("aclrtRecordEvent", AclError::RT_PARAM_INVALID)
    );
    assert_eq!(
        err(sim.record_event(e1, s0)),
        ("aclrtRecordEvent", AclError::RT_PARAM_INVALID)
    );
    sim.synchronize_device(1).unwrap();
    assert!(sim.query_event(e1).unwrap());
    sim.synchronize_event(e0).unwrap();
    for s in [s0, s1] {
        sim.destroy_stream(s).unwrap();
    }
}
