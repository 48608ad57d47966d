//! Virtual memory, shareable handles and shared buffers through the AscendCL path:
//! `AclSource` over the simulator built as a drop-in `libascendcl.so`, with the codes the
//! simulator gives arriving through the C ABI.

#[path = "common/dropin.rs"]
mod common_dropin;

use std::sync::Arc;

use ascend_pool::share::{Access, SharedMapping};
use ascend_pool::source::acl::AclSource;
use ascend_pool::source::sim::NOT_WHITELISTED;
use ascend_pool::source::vmm::{VmmConfig, VmmSource, EXPORT_FLAG_DISABLE_PID_VALIDATION};
use ascend_pool::source::{BlockSource, MemcpyKind};
use ascend_pool::{AclError, Error, MemKind, Pool, PoolConfig};

const G: u64 = 2 << 20;

fn open() -> Arc<AclSource> {
    Arc::new(AclSource::open(common_dropin::dropin()).expect("the drop-in loads"))
}

fn code<T: std::fmt::Debug>(r: ascend_pool::Result<T>) -> (&'static str, AclError) {
    match r {
        Err(Error::Runtime { func, code }) => (func, code),
        other => panic!("expected a runtime error, got {other:?}"),
    }
}

#[test]
fn virtual_memory_through_the_c_api() {
    let acl = open();
    assert_eq!(acl.allocation_granularity(0, false).unwrap(), G);
    assert_eq!(acl.allocation_granularity(0, true).unwrap(), G);
    let va = acl.reserve_address(0, 4 * G).unwrap();
    let h = acl.malloc_physical(0, 3 * G).unwrap();
    // The simulator's own checks, through the ABI: misaligned, past the physical end, at
    // an offset other than 0, part of the physical memory.
    for (at, size, offset) in [
        (va + 4096, 3 * G, 0),
        (va, 2 * G, 2 * G),
        (va, 2 * G, G),
        (va, 2 * G, 0),
    ] {
        assert_eq!(
            code(acl.map(at, size, offset, h)),
            ("aclrtMapMem", AclError::INVALID_PARAM),
            "{at:#x} {size} {offset}"
        );
    }
    acl.map(va, 3 * G, 0, h).unwrap();
    let data: Vec<u8> = (0..3 * G as usize).map(|i| (i % 253) as u8).collect();
    let mut back = vec![0u8; data.len()];
    // SAFETY: the range is mapped device memory; both host buffers are as long as the copy.
    unsafe {
        acl.memcpy(
            va,
            3 * G,
            data.as_ptr() as usize,
            3 * G,
            MemcpyKind::HostToDevice,
        )
        .unwrap();
        acl.memcpy(
            back.as_mut_ptr() as usize,
            3 * G,
            va,
            3 * G,
            MemcpyKind::DeviceToHost,
        )
        .unwrap();
    }
    assert_eq!(back, data);
    assert_eq!(
        code(acl.free_physical(h)),
        ("aclrtFreePhysical", AclError::RT_MEMORY_FREE)
    );
    assert_eq!(
        code(acl.release_address(va)),
        ("aclrtReleaseMemAddress", AclError::INVALID_PARAM)
    );
    acl.unmap(va).unwrap();
    acl.free_physical(h).unwrap();
    acl.release_address(va).unwrap();
    // Handles and ranges no longer held are refused before they reach the runtime.
    assert_eq!(
        code(acl.free_physical(h)),
        ("aclrtFreePhysical", AclError::RT_INVALID_HANDLE)
    );
    assert_eq!(
        code(acl.release_address(va)),
        ("aclrtReleaseMemAddress", AclError::INVALID_PARAM)
    );
}

#[test]
fn a_pool_over_vmm_over_acl_grows_in_place_and_shares() {
    let acl = open();
    let vmm = Arc::new(
        VmmSource::new(
            Arc::clone(&acl),
            0,
            VmmConfig::default().with_reserve(1 << 30),
        )
        .unwrap(),
    );
    let b = vmm.alloc_block(0, MemKind::DEVICE, G).unwrap();
    let b = vmm.extend_block(b, 2 * G).unwrap().unwrap();
    assert_eq!(b.size, 3 * G);
    vmm.free_block(b).unwrap();

    let pool = Pool::new(vmm.clone(), PoolConfig::default()).unwrap();
    let mut r = pool.alloc_device(10_000).unwrap();
    pool.copy_from_host(&mut r, 0, b"through the C ABI")
        .unwrap();
    // Export rules: one export per handle, the whitelist, use after release.
    let me = acl.bare_tgid().unwrap();
    assert_eq!(me, std::process::id() as i32);
    let desc = vmm
        .publish_region(&r, &Access::Processes(vec![me + 1]))
        .unwrap();
    match SharedMapping::open(Arc::clone(&acl), 0, &desc) {
        Err(Error::ShareRefused { pid, handle }) => {
            assert_eq!((pid, handle), (me, desc.pieces[0].handle));
        }
        other => panic!("expected ShareRefused, got {other:?}"),
    }
    vmm.publish_region(&r, &Access::Processes(vec![me]))
        .unwrap();
    let view = SharedMapping::open(Arc::clone(&acl), 0, &desc).unwrap();
    let mut got = [0u8; 17];
    view.read(0, &mut got).unwrap();
    assert_eq!(&got, b"through the C ABI");
    view.close().unwrap();
    drop(r);
    pool.trim();
    assert!(matches!(
        SharedMapping::open(Arc::clone(&acl), 0, &desc),
        Err(Error::ShareGone { .. })
    ));

    // The raw calls: a handle is exported once; imported memory is not exported again.
    let h = acl.malloc_physical(0, G).unwrap();
    let s = acl
        .export_shareable(h, EXPORT_FLAG_DISABLE_PID_VALIDATION)
        .unwrap();
    let func = "aclrtMemExportToShareableHandle";
    assert_eq!(
        code(acl.export_shareable(h, 0)),
        (func, AclError::RT_PARAM_INVALID)
    );
    assert_eq!(
        code(acl.export_shareable(h, 2)),
        (func, AclError::INVALID_PARAM)
    );
    let imported = acl.import_shareable(s, 0).unwrap();
    assert_eq!(
        code(acl.export_shareable(imported, 0)),
        (func, AclError::RT_PARAM_INVALID)
    );
    acl.free_physical(imported).unwrap();
    acl.free_physical(h).unwrap();
    let func = "aclrtMemImportFromShareableHandle";
    assert_eq!(
        code(acl.import_shareable(s, 0)),
        (func, AclError::RT_INVALID_HANDLE)
    );
    assert_eq!(
        code(acl.import_shareable(0, 0)),
        (func, AclError::RT_INVALID_HANDLE)
    );
    let func = "aclrtMemSetPidToShareableHandle";
    assert_eq!(
        code(acl.set_shareable_pids(s, &[me])),
        (func, AclError::RT_INVALID_HANDLE)
    );
    assert_eq!(
        code(acl.set_shareable_pids(s, &[])),
        (func, AclError::INVALID_PARAM)
    );
    // Off the whitelist, the raw code.
    let h = acl.malloc_physical(0, G).unwrap();
    let s = acl.export_shareable(h, 0).unwrap();
    let func = "aclrtMemImportFromShareableHandle";
    assert_eq!(code(acl.import_shareable(s, 0)), (func, NOT_WHITELISTED));
    acl.free_physical(h).unwrap();
}

#[test]
fn shared_buffers_through_the_c_api() {
    let acl = open();
    for dvpp in [false, true] {
        let buf = acl.alloc_buf(0, 1000, dvpp).unwrap();
        let (addr, size) = acl.buf_data(buf).unwrap();
        assert_eq!(size, 1000);
        assert_eq!(addr % if dvpp { 128 } else { 64 }, 0);
        // SAFETY: the data area is 1000 bytes of device memory.
        unsafe {
            acl.memcpy(
                addr,
                1000,
                b"frame".as_ptr() as usize,
                5,
                MemcpyKind::HostToDevice,
            )
            .unwrap();
        }
        acl.set_buf_data_len(buf, 5).unwrap();
        assert_eq!(
            code(acl.set_buf_data_len(buf, 1001)),
            ("acltdtSetBufDataLen", AclError::INVALID_PARAM)
        );
        acl.set_buf_user_data(buf, &[9; 8], 88).unwrap();
        let func = "acltdtSetBufUserData";
        assert_eq!(
            code(acl.set_buf_user_data(buf, &[9; 8], 89)),
            (func, AclError::INVALID_PARAM)
        );
        assert_eq!(
            code(acl.set_buf_user_data(buf, &[9; 97], 0)),
            (func, AclError::INVALID_PARAM)
        );
        // A reference shares data, length and user data; the memory lives until both are freed.
        let copy = acl.copy_buf_ref(buf).unwrap();
        acl.free_buf(buf).unwrap();
        assert_eq!(acl.buf_data_len(copy).unwrap(), 5);
        let mut user = [0u8; 8];
        acl.buf_user_data(copy, &mut user, 88).unwrap();
        assert_eq!(user, [9; 8]);
        let mut head = [0u8; 5];
        // SAFETY: the data area is still live through `copy`.
        unsafe {
            acl.memcpy(
                head.as_mut_ptr() as usize,
                5,
                addr,
                5,
                MemcpyKind::DeviceToHost,
            )
            .unwrap();
        }
        assert_eq!(&head, b"frame");
        acl.free_buf(copy).unwrap();
        assert_eq!(
            code(acl.free_buf(copy)),
            ("acltdtFreeBuf", AclError::RT_INVALID_HANDLE)
        );
    }
    assert_eq!(
        code(acl.alloc_buf(0, 0, false)),
        ("acltdtAllocBuf", AclError::INVALID_PARAM)
    );
}

#[test]
fn a_shared_buffer_is_allocated_on_the_device_asked_for() {
    // acltdtAllocBuf allocates on the calling thread's current device. The source used to
    // call it on whatever device that was (the application's, or the last one the source
    // used), so a buffer for one device landed on another. Devices 4 and 5 are this test's
    // alone: no other test here moves their free bytes.
    let acl = open();
    let free = |device| acl.mem_info(device, MemKind::DEVICE).unwrap().0;
    for dvpp in [false, true] {
        let before = (free(4), free(5));
        // The application's device is current on this thread.
        acl.use_device(4).unwrap();
        let buf = acl.alloc_buf(5, 1 << 20, dvpp).unwrap();
        assert_eq!(
            free(4),
            before.0,
            "dvpp {dvpp}: nothing taken on the current device"
        );
        assert!(free(5) < before.1, "dvpp {dvpp}: the buffer is on device 5");
        acl.free_buf(buf).unwrap();
        assert_eq!((free(4), free(5)), before, "dvpp {dvpp}");
    }
}

#[test]
fn a_dvpp_shared_buffer_takes_dvpp_space_as_on_the_simulator() {
    // A buffer of DVPP memory takes the process's DVPP address space as acldvppMalloc does:
    // the simulator's DVPP memory info counts it until the last handle on it is freed.
    // AclSource's counted its DVPP blocks only, so its buffers left the figure untouched.
    use ascend_pool::source::sim::SimSource;

    let acl = open();
    let sim = SimSource::default();
    let len = 1 << 30;
    let acl_free = || acl.mem_info(3, MemKind::Dvpp).unwrap().0;
    let sim_free = || sim.mem_info(0, MemKind::Dvpp).unwrap().0;
    let (acl_before, sim_before) = (acl_free(), sim_free());
    let on_sim = sim.alloc_buf(0, len, 1).unwrap();
    let taken = sim_before - sim_free();
    assert!(taken >= len, "{taken}");
    let buf = acl.alloc_buf(3, len, true).unwrap();
    assert_eq!(acl_before - acl_free(), taken);
    // A reference shares the memory: nothing more is taken, and it stays taken until both go.
    let copy = acl.copy_buf_ref(buf).unwrap();
    assert_eq!(acl_before - acl_free(), taken);
    acl.free_buf(buf).unwrap();
    assert_eq!(acl_before - acl_free(), taken);
    acl.free_buf(copy).unwrap();
    assert_eq!(acl_free(), acl_before);
    // A buffer of device memory takes none of the DVPP space.
    let normal = acl.alloc_buf(3, len, false).unwrap();
    assert_eq!(acl_free(), acl_before);
    acl.free_buf(normal).unwrap();
    sim.free_buf(on_sim).unwrap();
    assert_eq!(sim_free(), sim_before);
}

#[test]
fn a_reservation_for_a_device_the_runtime_lacks_is_refused_as_the_simulator_refuses_it() {
    let acl = open();
    for device in [99, -1] {
        assert_eq!(
            code(acl.reserve_address(device, G)),
            ("aclrtSetDevice", AclError::RT_PARAM_INVALID),
            "device {device}"
        );
    }
}
