//! Unit tests of the simulator's accounting and checks (timing-free where possible).

use super::*;
use crate::kind::MallocPolicy;

fn code(r: Result<impl std::fmt::Debug>) -> (&'static str, AclError) {
    match r {
        Err(Error::Runtime { func, code }) => (func, code),
        other => panic!("expected a runtime error, got {other:?}"),
    }
}

fn small() -> SimSource {
    SimSource::new(
        SimConfig::default()
            .with_devices(2)
            .with_device_capacity(1 << 20)
            .with_dvpp_limit(1 << 19)
            .with_host_capacity(1 << 18),
    )
    .unwrap()
}

#[test]
fn rounding_of_every_kind() {
    let sim = SimSource::default();
    let p = MallocPolicy::HugeFirst;
    let cases = [
        (MemKind::Device(p), 1, 64),
        (MemKind::Device(p), 32, 64),
        (MemKind::Device(p), 33, 96),
        (MemKind::Cached(p), 33, 96),
        (MemKind::DeviceAlign32(p), 1, 32),
        (MemKind::DeviceAlign32(p), 33, 64),
        (MemKind::Device(MallocPolicy::Huge1gOnly), 33, 64),
        (MemKind::Cached(MallocPolicy::Huge1gOnlyP2p), 64, 64),
        (MemKind::Dvpp, 3_110_400, 3_110_432),
        (MemKind::Host, 100, 160),
    ];
    for (kind, size, rounded) in cases {
        assert_eq!(sim.rounded_size(kind, size), Some(rounded), "{kind} {size}");
        let b = sim.alloc_block(0, kind, size).unwrap();
        assert_eq!(b.size, size);
        assert_eq!(b.kind, kind);
        assert_eq!(b.addr % 64, 0);
        if kind == MemKind::Dvpp {
            assert_eq!(b.addr % 128, 0);
        }
        assert_eq!(sim.stats().usage(0, kind).rounded_bytes, rounded);
        assert_eq!(sim.stats().usage(0, kind).requested_bytes, size);
        sim.free_block(b).unwrap();
        assert_eq!(sim.stats().usage(0, kind), KindUsage::default());
    }
    assert_eq!(sim.rounded_size(MemKind::DEVICE, u64::MAX), None);
}

#[test]
fn configured_padding_is_used() {
    let sim = SimSource::new(SimConfig::default().with_padding(0)).unwrap();
    assert_eq!(sim.rounded_size(MemKind::DEVICE, 33), Some(64));
    let sim = SimSource::new(SimConfig::default().with_padding(64)).unwrap();
    assert_eq!(sim.rounded_size(MemKind::DEVICE, 33), Some(128));
    assert_eq!(
        sim.rounded_size(MemKind::DeviceAlign32(MallocPolicy::HugeFirst), 33),
        Some(64)
    );
    assert!(matches!(
        SimSource::new(SimConfig::default().with_padding(16)),
        Err(Error::Carve(_))
    ));
    assert!(matches!(
        SimSource::new(SimConfig::default().with_devices(0)),
        Err(Error::Config(_))
    ));
    // u32::MAX devices asked the host for tens of GiB of per-device state before any call.
    assert!(SimSource::new(SimConfig::default().with_devices(super::MAX_DEVICES)).is_ok());
    assert!(matches!(
        SimSource::new(SimConfig::default().with_devices(super::MAX_DEVICES + 1)),
        Err(Error::Config(m)) if m.contains("1024")
    ));
    assert!(matches!(
        SimSource::new(SimConfig::default().with_host_capacity(0)),
        Err(Error::Config(_))
    ));
}

#[test]
fn size_zero_names_the_function() {
    let sim = SimSource::default();
    let p = MallocPolicy::HugeFirst;
    for (kind, func) in [
        (MemKind::Device(p), "aclrtMalloc"),
        (MemKind::DeviceAlign32(p), "aclrtMallocAlign32"),
        (MemKind::Cached(p), "aclrtMallocCached"),
        (MemKind::Dvpp, "acldvppMalloc"),
        (MemKind::Host, "aclrtMallocHost"),
    ] {
        assert_eq!(
            code(sim.alloc_block(0, kind, 0)),
            (func, AclError::INVALID_PARAM)
        );
    }
    let s = sim.stats();
    assert_eq!(s.alloc_calls(MemKind::Dvpp), 1);
    assert_eq!(s.failures(AclFunc::MallocHost), 1);
    assert_eq!(s.live_blocks, 0);
}

#[test]
fn call_counts_group_kinds_by_the_function_they_call() {
    let sim = SimSource::default();
    let mut blocks = Vec::new();
    for kind in [
        MemKind::Device(MallocPolicy::HugeFirst),
        MemKind::Device(MallocPolicy::NormalOnly),
        MemKind::Device(MallocPolicy::HugeOnlyP2p),
        MemKind::Cached(MallocPolicy::HugeFirst),
        MemKind::Host,
        MemKind::Host,
    ] {
        blocks.push(sim.alloc_block(0, kind, 4096).unwrap());
    }
    let s = sim.stats();
    assert_eq!(s.alloc_calls(MemKind::Device(MallocPolicy::HugeOnly)), 3);
    assert_eq!(s.alloc_calls(MemKind::Cached(MallocPolicy::NormalOnly)), 1);
    assert_eq!(s.alloc_calls(MemKind::Host), 2);
    assert_eq!(
        s.alloc_calls(MemKind::DeviceAlign32(MallocPolicy::HugeFirst)),
        0
    );
    for b in blocks {
        sim.free_block(b).unwrap();
    }
    let s = sim.stats();
    // aclrtFree frees all three aclrtMalloc* kinds.
    assert_eq!(
        s.free_calls(MemKind::DeviceAlign32(MallocPolicy::HugeFirst)),
        4
    );
    assert_eq!(s.free_calls(MemKind::Host), 2);
    assert_eq!(s.free_calls(MemKind::Dvpp), 0);
}

#[test]
fn bad_device_ids() {
    let sim = small();
    for d in [-1, 2, 100] {
        assert_eq!(
            code(sim.alloc_block(d, MemKind::DEVICE, 64)).1,
            AclError::RT_PARAM_INVALID
        );
        assert_eq!(code(sim.create_stream(d)).1, AclError::RT_PARAM_INVALID);
        assert_eq!(code(sim.create_event(d)).1, AclError::RT_PARAM_INVALID);
        assert_eq!(
            code(sim.mem_info(d, MemKind::Dvpp)).1,
            AclError::RT_PARAM_INVALID
        );
        // Host memory checks the id too, in its query as in its allocation.
        assert_eq!(
            code(sim.alloc_block(d, MemKind::Host, 64)).1,
            AclError::RT_PARAM_INVALID
        );
        assert_eq!(
            code(sim.mem_info(d, MemKind::Host)),
            ("aclrtGetMemInfo", AclError::RT_PARAM_INVALID)
        );
    }
    // Events are recorded on streams of their own device; waits may cross devices.
    let s0 = sim.create_stream(0).unwrap();
    let e1 = sim.create_event(1).unwrap();
    assert_eq!(
        code(sim.record_event(e1, s0)),
        ("aclrtRecordEvent", AclError::RT_PARAM_INVALID)
    );
    sim.stream_wait_event(s0, e1).unwrap();
    sim.synchronize_stream(s0).unwrap();
    // Device 1 exists and has its own capacity.
    let b = sim.alloc_block(1, MemKind::DEVICE, 1000).unwrap();
    assert_eq!(b.device, 1);
    assert_eq!(
        sim.mem_info(0, MemKind::DEVICE).unwrap(),
        (1 << 20, 1 << 20)
    );
    assert_eq!(
        sim.mem_info(1, MemKind::DEVICE).unwrap(),
        ((1 << 20) - 1056, 1 << 20)
    );
    sim.free_block(b).unwrap();
}

#[test]
fn device_kinds_share_capacity_and_recover() {
    let sim = small();
    let p = MallocPolicy::HugeFirst;
    // 1 MiB device: 512 KiB of align32 plus (512 KiB - 32) of aclrtMalloc fill it exactly.
    let a = sim
        .alloc_block(0, MemKind::DeviceAlign32(p), 512 << 10)
        .unwrap();
    let b = sim
        .alloc_block(0, MemKind::Device(p), (512 << 10) - 32)
        .unwrap();
    assert_eq!(sim.mem_info(0, MemKind::Cached(p)).unwrap().0, 0);
    assert_eq!(
        code(sim.alloc_block(0, MemKind::Cached(p), 1)),
        ("aclrtMallocCached", AclError::RT_MEMORY_ALLOCATION)
    );
    assert_eq!(
        code(sim.alloc_block(0, MemKind::Dvpp, 1)),
        ("acldvppMalloc", AclError::RT_MEMORY_ALLOCATION)
    );
    // Host memory is separate.
    let h = sim.alloc_block(0, MemKind::Host, 1).unwrap();
    sim.free_block(b).unwrap();
    let c = sim.alloc_block(0, MemKind::Cached(p), 1000).unwrap();
    for blk in [a, c, h] {
        sim.free_block(blk).unwrap();
    }
    assert_eq!(
        sim.mem_info(0, MemKind::DEVICE).unwrap(),
        (1 << 20, 1 << 20)
    );
    assert_eq!(sim.stats().live_blocks, 0);
}

#[test]
fn dvpp_limit_and_info() {
    let sim = small();
    assert_eq!(sim.mem_info(0, MemKind::Dvpp).unwrap(), (1 << 19, 1 << 19));
    // The limit is per process: devices 0 and 1 share it.
    let a = sim.alloc_block(0, MemKind::Dvpp, (256 << 10) - 32).unwrap();
    let b = sim.alloc_block(1, MemKind::Dvpp, (256 << 10) - 32).unwrap();
    assert_eq!(sim.mem_info(1, MemKind::Dvpp).unwrap().0, 0);
    assert_eq!(
        code(sim.alloc_block(1, MemKind::Dvpp, 1)).1,
        AclError::RT_MEMORY_ALLOCATION
    );
    // Plain device memory is still there.
    assert_eq!(
        sim.mem_info(1, MemKind::DEVICE).unwrap().0,
        (1 << 20) - (256 << 10)
    );
    sim.free_block(a).unwrap();
    sim.free_block(b).unwrap();
}

#[test]
fn host_capacity() {
    let sim = small();
    let a = sim.alloc_block(0, MemKind::Host, (1 << 18) - 32).unwrap();
    assert_eq!(
        code(sim.alloc_block(0, MemKind::Host, 1)),
        ("aclrtMallocHost", AclError::RT_MEMORY_ALLOCATION)
    );
    assert_eq!(sim.mem_info(0, MemKind::Host).unwrap(), (0, 1 << 18));
    sim.free_block(a).unwrap();
    assert_eq!(sim.mem_info(0, MemKind::Host).unwrap(), (1 << 18, 1 << 18));
}

#[test]
fn bad_frees_are_errors() {
    let sim = small();
    let p = MallocPolicy::HugeFirst;
    let d = sim.alloc_block(0, MemKind::Dvpp, 100).unwrap();
    let m = sim.alloc_block(0, MemKind::Device(p), 100).unwrap();
    // aclrtFree on DVPP memory, acldvppFree on aclrtMalloc memory.
    let as_device = Block {
        kind: MemKind::Device(p),
        ..d
    };
    assert_eq!(
        code(sim.free_block(as_device)),
        ("aclrtFree", AclError::RT_MEMORY_FREE)
    );
    let as_dvpp = Block {
        kind: MemKind::Dvpp,
        ..m
    };
    assert_eq!(
        code(sim.free_block(as_dvpp)),
        ("acldvppFree", AclError::RT_MEMORY_FREE)
    );
    // Same free function, but not the block handed out.
    let wrong_size = Block { size: 99, ..m };
    assert_eq!(code(sim.free_block(wrong_size)).1, AclError::INVALID_PARAM);
    let wrong_kind = Block {
        kind: MemKind::Cached(p),
        ..m
    };
    assert_eq!(code(sim.free_block(wrong_kind)).1, AclError::INVALID_PARAM);
    // Inside a block but not its start, and nowhere at all.
    let inside = Block {
        addr: m.addr + 64,
        ..m
    };
    assert_eq!(code(sim.free_block(inside)).1, AclError::RT_MEMORY_FREE);
    let nowhere = Block { addr: 64, ..m };
    assert_eq!(code(sim.free_block(nowhere)).1, AclError::RT_MEMORY_FREE);
    // The refusals changed nothing.
    assert_eq!(sim.stats().live_blocks, 2);
    sim.free_block(m).unwrap();
    assert_eq!(
        code(sim.free_block(m)),
        ("aclrtFree", AclError::RT_MEMORY_FREE)
    );
    sim.free_block(d).unwrap();
    let s = sim.stats();
    assert_eq!(s.free_calls(MemKind::Dvpp), 2);
    assert_eq!(s.failures(AclFunc::Free), 6);
    assert_eq!(s.live_blocks, 0);
}

#[test]
fn stale_handles() {
    let sim = SimSource::default();
    let s = sim.create_stream(0).unwrap();
    let e = sim.create_event(0).unwrap();
    sim.destroy_stream(s).unwrap();
    sim.destroy_event(e).unwrap();
    let h = AclError::RT_INVALID_HANDLE;
    assert_eq!(code(sim.destroy_stream(s)), ("aclrtDestroyStream", h));
    assert_eq!(code(sim.synchronize_stream(s)).1, h);
    assert_eq!(code(sim.destroy_event(e)), ("aclrtDestroyEvent", h));
    assert_eq!(code(sim.query_event(e)), ("aclrtQueryEventStatus", h));
    assert_eq!(code(sim.synchronize_event(e)).1, h);
    let s2 = sim.create_stream(0).unwrap();
    let e2 = sim.create_event(0).unwrap();
    assert_ne!(s2.0, s.0, "ids are not reused");
    assert_eq!(code(sim.record_event(e, s2)).1, h);
    assert_eq!(code(sim.record_event(e2, s)).1, h);
    assert_eq!(code(sim.stream_wait_event(s2, e)).1, h);
    assert_eq!(code(sim.stream_wait_event(s, e2)).1, h);
    assert_eq!(code(sim.enqueue_delay(s, Duration::ZERO)).1, h);
    assert!(sim.hold_stream(s).is_err());
    assert_eq!(code(sim.pending_ops(s)).1, h);
    let b = sim.alloc_block(0, MemKind::DEVICE, 64).unwrap();
    // SAFETY: the block is live; a refused call touches nothing.
    unsafe {
        assert_eq!(code(sim.memset_async(b.addr, 64, 0, 64, s)).1, h);
        assert_eq!(
            code(sim.memcpy_async(b.addr, 64, b.addr, 64, MemcpyKind::DeviceToDevice, s)).1,
            h
        );
    }
    assert!(sim.query_event(e2).unwrap(), "never recorded is complete");
    let st = sim.stats();
    assert_eq!((st.live_streams, st.live_events), (1, 1));
}

#[test]
fn debug_is_a_summary() {
    let sim = SimSource::default();
    let b = sim.alloc_block(0, MemKind::DEVICE, 64).unwrap();
    let text = format!("{sim:?}");
    assert!(text.contains("live_blocks: 1"), "{text}");
    sim.free_block(b).unwrap();
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<SimSource>();
}

#[test]
fn cost_follows_bandwidth() {
    let cfg = SimConfig::default()
        .with_copy_bandwidth(1 << 20)
        .with_op_latency(Duration::from_millis(1));
    assert_eq!(cfg.cost(1 << 20), Duration::from_millis(1001));
    assert_eq!(SimConfig::default().cost(1 << 30), Duration::ZERO);
}

#[test]
fn shared_buffers_keep_length_user_data_and_memory_across_references() {
    let sim = small();
    let handles = |sim: &SimSource| sim.stats().mbuf_handles;
    for (ty, kind) in [(0, MemKind::DEVICE), (1, MemKind::Dvpp)] {
        let buf = sim.alloc_buf(0, 1000, ty).unwrap();
        assert_eq!(handles(&sim), 1);
        assert_eq!(sim.stats().usage(0, kind).requested_bytes, 1000);
        let (addr, size) = sim.buf_data(buf).unwrap();
        assert_eq!(size, 1000);
        assert_eq!(sim.block_containing(addr).map(|b| b.kind), Some(kind));

        assert_eq!(sim.buf_data_len(buf).unwrap(), 0);
        sim.set_buf_data_len(buf, 1000).unwrap();
        assert_eq!(sim.buf_data_len(buf).unwrap(), 1000);
        let set_len = sim.set_buf_data_len(buf, 1001);
        assert_eq!(
            code(set_len),
            ("acltdtSetBufDataLen", AclError::INVALID_PARAM)
        );
        sim.set_buf_data_len(buf, 7).unwrap();

        sim.set_buf_user_data(buf, b"first", 0).unwrap();
        sim.set_buf_user_data(buf, &[9; 8], 88).unwrap();
        sim.set_buf_user_data(buf, &[5], 95).unwrap();

        // A reference shares everything; the memory stays until the last handle goes.
        let copy = sim.copy_buf_ref(buf).unwrap();
        assert_ne!(copy, buf);
        assert_eq!(handles(&sim), 2);
        sim.free_buf(buf).unwrap();
        assert_eq!(handles(&sim), 1);
        assert_eq!(sim.stats().usage(0, kind).requested_bytes, 1000);
        assert_eq!(sim.buf_data(copy).unwrap(), (addr, 1000));
        assert_eq!(sim.buf_data_len(copy).unwrap(), 7);
        let mut user = [0u8; 96];
        sim.buf_user_data(copy, &mut user, 0).unwrap();
        assert_eq!(&user[..5], b"first");
        assert_eq!(user[5..88], [0; 83]);
        assert_eq!(user[88..95], [9; 7]);
        assert_eq!(user[95], 5);
        sim.free_buf(copy).unwrap();
        assert_eq!(handles(&sim), 0);
        assert_eq!(sim.stats().usage(0, kind), KindUsage::default());
        assert_eq!(
            code(sim.buf_data_len(copy)),
            ("acltdtGetBufDataLen", AclError::RT_INVALID_HANDLE)
        );
    }
    assert_eq!(
        code(sim.alloc_buf(0, 1000, 2)),
        ("acltdtAllocBuf", AclError::INVALID_PARAM)
    );
    assert_eq!(handles(&sim), 0);
}

#[test]
fn shared_buffer_user_data_stays_inside_its_96_bytes() {
    let sim = small();
    let buf = sim.alloc_buf(0, 64, 0).unwrap();
    let fits = [(0, 96), (88, 8), (95, 1), (0, 1)];
    for (offset, len) in fits {
        let data = vec![offset as u8 + 1; len];
        sim.set_buf_user_data(buf, &data, offset).unwrap();
        let mut back = vec![0u8; len];
        sim.buf_user_data(buf, &mut back, offset).unwrap();
        assert_eq!(back, data, "{offset} {len}");
    }
    let refused = [
        (0, 0),
        (96, 0),
        (0, 97),
        (96, 1),
        (97, 1),
        (89, 8),
        (1, 96),
        (u64::MAX, 1),
        (1 << 32, 1),
    ];
    for (offset, len) in refused {
        let data = vec![0xee; len];
        assert_eq!(
            code(sim.set_buf_user_data(buf, &data, offset)),
            ("acltdtSetBufUserData", AclError::INVALID_PARAM),
            "{offset} {len}"
        );
        let mut out = vec![0u8; len];
        assert_eq!(
            code(sim.buf_user_data(buf, &mut out, offset)),
            ("acltdtGetBufUserData", AclError::INVALID_PARAM),
            "{offset} {len}"
        );
    }
    // Nothing refused was written.
    let mut all = [0u8; 96];
    sim.buf_user_data(buf, &mut all, 0).unwrap();
    assert_eq!(all[0], 1);
    assert_eq!(all[1..88], [1; 87]);
    assert_eq!(all[88..95], [89; 7]);
    assert_eq!(all[95], 96);
    sim.free_buf(buf).unwrap();
}

#[test]
fn the_configuration_is_checked_and_kept() {
    use crate::source::vmm::VmmRuntime;
    let config = SimConfig::default()
        .with_devices(3)
        .with_device_capacity(1 << 30)
        .with_vmm_granularity(4 << 20);
    let sim = SimSource::new(config).unwrap();
    assert_eq!(sim.config().devices, 3);
    assert_eq!(sim.config().device_capacity, 1 << 30);
    assert_eq!(sim.allocation_granularity(2, false), Ok(4 << 20));
    let page = mapping::page_size() as u64;
    assert!(SimSource::new(SimConfig::default().with_vmm_granularity(page)).is_ok());
    // 2048 is below every host page size Linux has.
    for bad in [0, 3 << 20, page / 2, 2048] {
        assert!(
            matches!(
                SimSource::new(SimConfig::default().with_vmm_granularity(bad)),
                Err(Error::Config(_))
            ),
            "granularity {bad}"
        );
    }
    for bad in [
        SimConfig::default().with_device_capacity(0),
        SimConfig::default().with_dvpp_limit(0),
        SimConfig::default().with_host_capacity(0),
    ] {
        assert!(matches!(SimSource::new(bad), Err(Error::Config(_))));
    }
}

#[test]
fn a_block_ends_at_its_rounded_size_and_leaves_no_usage_behind() {
    let sim = small();
    let b = sim.alloc_block(0, MemKind::DEVICE, 100).unwrap();
    let rounded = sim.rounded_size(MemKind::DEVICE, 100).unwrap() as usize;
    assert_eq!(sim.block_containing(b.addr), Some(b));
    assert_eq!(sim.block_containing(b.addr + rounded - 1), Some(b));
    // One past the end is another block's, or none.
    let after = sim.block_containing(b.addr + rounded).map(|x| x.addr);
    assert_ne!(after, Some(b.addr));
    assert_eq!(sim.stats().usage.len(), 1);
    sim.free_block(b).unwrap();
    assert!(
        sim.stats().usage.is_empty(),
        "a kind with no block is not listed"
    );
    assert_eq!(sim.block_containing(b.addr), None);
}

#[test]
fn synchronize_device_waits_for_that_devices_streams() {
    let sim = small();
    let on_0 = sim.create_stream(0).unwrap();
    let on_1 = sim.create_stream(1).unwrap();
    sim.enqueue_delay(on_0, Duration::from_millis(30)).unwrap();
    sim.synchronize_device(0).unwrap();
    assert_eq!(sim.pending_ops(on_0), Ok(0));
    sim.enqueue_delay(on_1, Duration::from_millis(30)).unwrap();
    sim.synchronize_device(1).unwrap();
    assert_eq!(sim.pending_ops(on_1), Ok(0));
    assert_eq!(
        code(sim.synchronize_device(2)),
        ("aclrtSynchronizeDevice", AclError::RT_PARAM_INVALID)
    );
    sim.destroy_stream(on_0).unwrap();
    sim.destroy_stream(on_1).unwrap();
}

/// A communication thread goes with its stream: a server that opens a stream and a thread
/// per request would otherwise leave an entry per request in the simulator for good (a
/// thread whose stream is gone has nowhere to run, and is refused as unknown either way).
#[test]
fn comm_threads_go_with_their_stream() {
    let sim = small();
    let threads = |sim: &SimSource| lock(&sim.comm).threads.len();
    let channel = sim.acquire_channel(0, 1).unwrap();
    let cycle = |n: usize| {
        for _ in 0..n {
            let s = sim.create_stream(0).unwrap();
            let t = sim.acquire_comm_thread(s).unwrap();
            sim.destroy_stream(s).unwrap();
            let (_, refused) = code(sim.notify_record_on_thread(t, channel, 0));
            assert_eq!(refused, AclError::HCCL_E_NOT_FOUND);
        }
    };
    cycle(100);
    let after_n = threads(&sim);
    cycle(100);
    assert_eq!((after_n, threads(&sim)), (0, 0));
}

/// `aclrtDestroyStream` waits for the tasks already queued on the stream (only
/// `aclrtDestroyStreamForce` does not): once it returns, a queued copy has landed.
#[test]
fn destroying_a_stream_runs_its_queued_work_first() {
    let sim = small();
    let s = sim.create_stream(0).unwrap();
    let src = sim.alloc_block(0, MemKind::Host, 256).unwrap();
    let dst = sim.alloc_block(0, MemKind::DEVICE, 256).unwrap();
    // SAFETY: `src` is a live block of 256 bytes that nothing else touches.
    unsafe { std::ptr::write_bytes(src.addr as *mut u8, 9, 256) };
    sim.enqueue_delay(s, Duration::from_millis(50)).unwrap();
    // SAFETY: both blocks are live and in bounds until after the stream is destroyed.
    unsafe {
        sim.memcpy_async(dst.addr, 256, src.addr, 256, MemcpyKind::HostToDevice, s)
            .unwrap();
    }
    sim.destroy_stream(s).unwrap();
    // SAFETY: `dst` is live and no queued work touches it any more.
    let landed = unsafe { std::slice::from_raw_parts(dst.addr as *const u8, 256) };
    assert!(landed.iter().all(|&b| b == 9), "the copy had not run");
    sim.free_block(dst).unwrap();
    sim.free_block(src).unwrap();
}

/// HCCL registers a window only when `va % 2 MiB == 0` and `len % 2 MiB == 0`
/// (ACL_REFERENCE.md, section 1): the simulator refuses a window off that granule itself,
/// not only through the pool, which checks first.
#[test]
fn windows_off_the_2_mib_granule_are_refused() {
    let sim = SimSource::default();
    let b = sim.alloc_block(0, MemKind::DEVICE, 6 << 20).unwrap();
    let g = WINDOW_GRANULE as usize;
    let at = b.addr.div_ceil(g) * g;
    let half = WINDOW_GRANULE / 2;
    // SAFETY: every range lies in the live block `b`, which outlives the windows.
    unsafe {
        for (addr, len) in [(at + g / 2, WINDOW_GRANULE), (at, half), (at, 3 * half)] {
            let r = sim.register_window(0, addr, len);
            assert!(matches!(r, Err(Error::Misaligned { .. })), "{r:?}");
        }
        sim.register_window(0, at, WINDOW_GRANULE).unwrap();
    }
    sim.deregister_window(at).unwrap();
    sim.free_block(b).unwrap();
}

/// `aclrtSynchronizeDevice` waits for the streams of its device only: a stream of another
/// device held busy does not keep it waiting.
#[test]
fn synchronize_device_does_not_wait_for_other_devices() {
    let sim = small();
    let on_0 = sim.create_stream(0).unwrap();
    let on_1 = sim.create_stream(1).unwrap();
    let hold = sim.hold_stream(on_1).unwrap();
    let (done, returned) = std::sync::mpsc::channel();
    std::thread::scope(|scope| {
        scope.spawn(|| done.send(sim.synchronize_device(0)).unwrap());
        let r = returned.recv_timeout(Duration::from_secs(5));
        // Before any assertion: a held stream keeps the scope from ending.
        hold.release();
        assert_eq!(r.expect("waited for device 1's stream"), Ok(()));
    });
    sim.destroy_stream(on_0).unwrap();
    sim.destroy_stream(on_1).unwrap();
}
