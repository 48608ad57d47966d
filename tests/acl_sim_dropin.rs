//! `AclSource` end to end over the simulator built as a drop-in `libascendcl.so` (`acl-sim/`):
//! allocation of every kind, copies, fills, streams and events, several devices, and the
//! error codes the simulator gives, through the C ABI and back.
//!
//! The library is `$ASCEND_POOL_SIM_LIB` when set, otherwise it is built here with
//! `cargo build -p acl-sim` into a target directory of its own (a nested build in the
//! test's target directory would wait on cargo's lock).

#[path = "common/child.rs"]
mod common_child;
#[path = "common/dropin.rs"]
mod common_dropin;
use common_dropin::dropin;

use ascend_pool::source::acl::{sys, AclSource};
use ascend_pool::source::{BlockSource, MemcpyKind};
use ascend_pool::{AclError, Error, MallocPolicy, MemKind};

fn open() -> AclSource {
    AclSource::open(dropin()).expect("the drop-in loads")
}

#[path = "common/runtime.rs"]
mod common_runtime;
use common_runtime::refusal as code;

#[test]
fn every_kind_allocates_with_its_alignment() {
    let acl = open();
    assert!(acl.name().ends_with("libascendcl.so"));
    for kind in [
        MemKind::DEVICE,
        MemKind::DeviceAlign32(MallocPolicy::HugeFirst),
        MemKind::Cached(MallocPolicy::NormalOnly),
        MemKind::Device(MallocPolicy::Huge1gOnly),
        MemKind::Dvpp,
        MemKind::Host,
    ] {
        let b = acl.alloc_block(0, kind, 3 << 20).unwrap();
        assert_eq!(b.addr % kind.default_align() as usize, 0, "{kind}");
        assert_eq!(b.size, 3 << 20);
        acl.free_block(b).unwrap();
    }
    let (free, total) = acl.mem_info(0, MemKind::DEVICE).unwrap();
    assert!(total > 0 && free <= total);
}

#[test]
fn the_malloc_policy_reaches_the_runtime() {
    // The runtime pads every block by 32 bytes except under the HUGE1G policies and for
    // aclrtMallocAlign32, so the free bytes it reports show which policy it was given.
    // Device 7 is this test's alone: no other test here moves its free bytes.
    let acl = open();
    let dev = 7;
    let free = |acl: &AclSource| acl.mem_info(dev, MemKind::DEVICE).unwrap().0;
    let len: u64 = (3 << 20) + 1;
    let rounded = len.next_multiple_of(32);
    for (kind, charged) in [
        (MemKind::DEVICE, rounded + 32),
        (MemKind::Device(MallocPolicy::HugeOnly), rounded + 32),
        (MemKind::Device(MallocPolicy::NormalOnlyP2p), rounded + 32),
        (MemKind::Device(MallocPolicy::Huge1gOnly), rounded),
        (MemKind::Device(MallocPolicy::Huge1gOnlyP2p), rounded),
        (MemKind::Cached(MallocPolicy::Huge1gOnly), rounded),
        (MemKind::Cached(MallocPolicy::HugeFirst), rounded + 32),
        (MemKind::DeviceAlign32(MallocPolicy::HugeOnly), rounded),
    ] {
        let before = free(&acl);
        let b = acl.alloc_block(dev, kind, len).unwrap();
        assert_eq!(before - free(&acl), charged, "{kind}");
        acl.free_block(b).unwrap();
        assert_eq!(free(&acl), before, "{kind}");
    }
}

#[test]
fn simulator_errors_arrive_as_typed_runtime_errors() {
    let acl = open();
    assert_eq!(
        code(acl.alloc_block(0, MemKind::DEVICE, 0).unwrap_err()),
        ("aclrtMalloc", AclError::INVALID_PARAM.0)
    );
    let e = acl.alloc_block(0, MemKind::DEVICE, 1 << 50).unwrap_err();
    assert_eq!(code(e.clone()), ("aclrtMalloc", 207_001));
    assert!(matches!(e, Error::Runtime { code, .. } if code.is_out_of_memory()));
    assert_eq!(
        code(acl.alloc_block(99, MemKind::DEVICE, 64).unwrap_err()),
        ("aclrtSetDevice", AclError::RT_PARAM_INVALID.0)
    );
    // An unaligned asynchronous device-to-device copy, refused by the simulator itself.
    let a = acl.alloc_block(0, MemKind::DEVICE, 4096).unwrap();
    let s = acl.create_stream(0).unwrap();
    // SAFETY: both ranges lie inside the live 4096-byte block `a`.
    let r = unsafe {
        acl.memcpy_async(
            a.addr + 1,
            100,
            a.addr + 2048,
            100,
            MemcpyKind::DeviceToDevice,
            s,
        )
    };
    assert_eq!(
        code(r.unwrap_err()),
        ("aclrtMemcpyAsync", AclError::RT_ADDR_UNALIGNED.0)
    );
    acl.destroy_stream(s).unwrap();
    acl.free_block(a).unwrap();
}

/// The drop-in's functions, raw: for calls below `AclSource`'s own checks.
/// `aclrtMemcpy`, then `aclrtMemcpyAsync` on `stream`, of `n` bytes from `src` to `dst` with
/// `kind`, each expected to answer `want`; the stream is synchronized before the next
/// synchronous copy touches the same bytes (the runtime orders neither after the other, and
/// ThreadSanitizer saw the two copies race).
///
/// # Safety
/// `dst` and `src` each lie in a live block of at least `n` bytes of the drop-in, or the
/// copy is refused before it touches them; `stream` is a live stream of the drop-in.
unsafe fn copy_both_ways(
    api: &sys::AclApi,
    (dst, src, n): (*mut std::ffi::c_void, *const std::ffi::c_void, usize),
    kind: sys::aclrtMemcpyKind,
    stream: sys::aclrtStream,
    want: sys::aclError,
) {
    let memcpy = api.aclrtMemcpy.as_ref().unwrap();
    let memcpy_async = api.aclrtMemcpyAsync.as_ref().unwrap();
    let sync = api.aclrtSynchronizeStream.as_ref().unwrap();
    assert_eq!(
        memcpy(dst, n, src, n, kind),
        want,
        "aclrtMemcpy kind {kind}"
    );
    let queued = memcpy_async(dst, n, src, n, kind, stream);
    assert_eq!(queued, want, "aclrtMemcpyAsync kind {kind}");
    assert_eq!(sync(stream), 0);
}

fn raw_api() -> sys::AclApi {
    // SAFETY: the drop-in's initialisers have no preconditions.
    let lib = unsafe { libloading::Library::new(dropin()) }.unwrap();
    // SAFETY: resolving symbols only.
    unsafe { sys::AclApi::from_library(lib) }.unwrap()
}

#[test]
fn the_c_functions_check_pointers_and_frees_themselves() {
    // Below AclSource's own checks: the drop-in's answers to bad calls, through the raw table.
    let api = raw_api();
    let (malloc, free, info) = (
        api.aclrtMalloc.as_ref().unwrap(),
        api.aclrtFree.as_ref().unwrap(),
        api.aclrtGetMemInfo.as_ref().unwrap(),
    );
    let dvpp_free = api.acldvppFree.as_ref().unwrap();
    // SAFETY: every pointer passed is null, a live local, or an address the drop-in handed out.
    unsafe {
        let init = (api.aclInit.as_ref().unwrap())(std::ptr::null());
        assert!(init == 0 || init == sys::ACL_ERROR_REPEAT_INITIALIZE);
        assert_eq!(
            (api.aclInit.as_ref().unwrap())(std::ptr::null()),
            sys::ACL_ERROR_REPEAT_INITIALIZE
        );
        assert_eq!(
            malloc(std::ptr::null_mut(), 64, 0),
            sys::ACL_ERROR_INVALID_PARAM
        );
        let mut p = std::ptr::null_mut();
        assert_eq!(malloc(&mut p, 64, sys::ACL_MEM_MALLOC_HUGE_FIRST), 0);
        assert!(!p.is_null() && p as usize % 64 == 0);
        assert_eq!(
            dvpp_free(p),
            sys::ACL_ERROR_RT_MEMORY_FREE,
            "wrong free function"
        );
        assert_eq!(free(p), 0);
        assert_eq!(free(p), sys::ACL_ERROR_RT_MEMORY_FREE, "double free");
        assert_eq!(free(std::ptr::null_mut()), sys::ACL_ERROR_INVALID_PARAM);
        let (mut f, mut t) = (0usize, 0usize);
        assert_eq!(info(sys::ACL_HBM_MEM, &mut f, &mut t), 0);
        assert!(t > 0 && f <= t);
        assert_eq!(info(99, &mut f, &mut t), sys::ACL_ERROR_INVALID_PARAM);
        assert_eq!(
            info(sys::ACL_HBM_MEM, std::ptr::null_mut(), &mut t),
            sys::ACL_ERROR_INVALID_PARAM
        );
    }
}

#[test]
fn null_events_and_the_reserved_dvpp_device_id() {
    let api = raw_api();
    let null = std::ptr::null_mut();
    let bad = sys::ACL_ERROR_INVALID_PARAM;
    // SAFETY: every pointer passed is null, a live local, or an address the drop-in handed out.
    unsafe {
        // A null event is a bad parameter, as a null stream is to aclrtDestroyStream.
        let mut status = 0u32;
        assert_eq!((api.aclrtDestroyEvent.as_ref().unwrap())(null), bad);
        assert_eq!((api.aclrtSynchronizeEvent.as_ref().unwrap())(null), bad);
        assert_eq!(
            (api.aclrtQueryEvent.as_ref().unwrap())(null, &mut status),
            bad
        );
        assert_eq!(
            (api.aclrtQueryEventStatus.as_ref().unwrap())(null, &mut status),
            bad
        );
        assert_eq!((api.aclrtRecordEvent.as_ref().unwrap())(null, null), bad);
        assert_eq!(
            (api.aclrtStreamWaitEvent.as_ref().unwrap())(null, null),
            bad
        );

        // hi_mpi_dvpp_malloc's dev_id is reserved: memory lands on the device set last.
        // Device 6 is this test's alone; the current device is per thread.
        let (dvpp, dvpp_free) = (
            api.hi_mpi_dvpp_malloc.as_ref().unwrap(),
            api.hi_mpi_dvpp_free.as_ref().unwrap(),
        );
        let info = api.aclrtGetMemInfo.as_ref().unwrap();
        let free_on_6 = || {
            let (mut f, mut t) = (0usize, 0usize);
            assert_eq!(info(sys::ACL_HBM_MEM, &mut f, &mut t), 0);
            f
        };
        assert_eq!((api.aclrtSetDevice.as_ref().unwrap())(6), 0);
        let before = free_on_6();
        let mut p = null;
        for dev_id in [2, 1000] {
            assert_eq!(dvpp(dev_id, &mut p, 1 << 20), 0, "dev_id {dev_id}");
            assert_eq!(before - free_on_6(), (1 << 20) + 32, "dev_id {dev_id}");
            assert_eq!(dvpp_free(p), 0);
        }
        assert_eq!(free_on_6(), before);
    }
}

#[test]
fn copies_fills_streams_and_events_end_to_end() {
    let acl = open();
    let n = 1 << 16;
    let host = acl.alloc_block(0, MemKind::Host, n).unwrap();
    let a = acl.alloc_block(0, MemKind::DEVICE, n).unwrap();
    let b = acl.alloc_block(0, MemKind::Dvpp, n).unwrap();
    let pattern: Vec<u8> = (0..n).map(|i| (i * 7 % 251) as u8).collect();
    let (s1, s2) = (acl.create_stream(0).unwrap(), acl.create_stream(0).unwrap());
    let done = acl.create_event(0).unwrap();
    assert!(acl.query_event(done).unwrap());
    // SAFETY: `pattern` and `back` are live host buffers of `n` bytes; `host`, `a` and `b` are
    // live blocks of `n` bytes; every stream is synchronised before the buffers are reused.
    let back = unsafe {
        acl.memcpy(
            host.addr,
            n,
            pattern.as_ptr() as usize,
            n,
            MemcpyKind::HostToHost,
        )
        .unwrap();
        acl.memcpy_async(a.addr, n, host.addr, n, MemcpyKind::HostToDevice, s1)
            .unwrap();
        acl.memset_async(a.addr, n, 0xee, 64, s1).unwrap();
        acl.record_event(done, s1).unwrap();
        acl.stream_wait_event(s2, done).unwrap();
        acl.memcpy_async(b.addr, n, a.addr, n, MemcpyKind::DeviceToDevice, s2)
            .unwrap();
        acl.synchronize_stream(s2).unwrap();
        acl.synchronize_event(done).unwrap();
        assert!(acl.query_event(done).unwrap());
        let mut back = vec![0u8; n as usize];
        acl.memcpy(
            back.as_mut_ptr() as usize,
            n,
            b.addr,
            n,
            MemcpyKind::DeviceToHost,
        )
        .unwrap();
        acl.memset(host.addr, n, 0, n).unwrap();
        back
    };
    assert!(back[..64].iter().all(|&x| x == 0xee));
    assert_eq!(&back[64..], &pattern[64..]);

    acl.destroy_event(done).unwrap();
    acl.destroy_stream(s1).unwrap();
    acl.destroy_stream(s2).unwrap();
    assert_eq!(
        code(acl.synchronize_stream(s1).unwrap_err()),
        ("aclrtSynchronizeStream", AclError::RT_INVALID_HANDLE.0)
    );
    for blk in [host, a, b] {
        acl.free_block(blk).unwrap();
    }
    assert_eq!(
        code(acl.free_block(a).unwrap_err()),
        ("aclrtFree", AclError::RT_MEMORY_FREE.0)
    );
}

#[test]
fn several_devices_and_threads() {
    let acl = open();
    std::thread::scope(|sc| {
        for dev in 0..4 {
            let acl = &acl;
            sc.spawn(move || {
                for _ in 0..8 {
                    let blk = acl.alloc_block(dev, MemKind::DEVICE, 1 << 20).unwrap();
                    assert_eq!(blk.device, dev);
                    let s = acl.create_stream(dev).unwrap();
                    // SAFETY: `blk` is a live 1 MiB block.
                    unsafe { acl.memset_async(blk.addr, 1 << 20, 1, 1 << 20, s).unwrap() };
                    acl.synchronize_stream(s).unwrap();
                    acl.destroy_stream(s).unwrap();
                    acl.free_block(blk).unwrap();
                }
            });
        }
    });
}

#[test]
fn the_drop_in_exports_virtual_memory_sharing_and_mbuf() {
    // Tested in depth through AclSource in tests/acl_vmm_dropin.rs.
    let acl = open();
    for func in [
        "aclrtMallocAlign32",
        "hi_mpi_dvpp_malloc",
        "aclrtReserveMemAddress",
        "aclrtMemImportFromShareableHandle",
        "acltdtAllocBuf",
        "HcommWriteOnThread",
    ] {
        assert!(acl.supports(func), "{func}");
    }
    // What the library never calls, for applications written against HCOMM.
    // SAFETY: the drop-in; loading it again only takes another reference.
    let lib = unsafe { libloading::Library::new(dropin()) }.unwrap();
    for func in [
        "HcommChannelNotifyRecordOnThread",
        "HcommChannelNotifyWaitOnThread",
    ] {
        // SAFETY: only looked up, never called.
        let found = unsafe { lib.get::<unsafe extern "C" fn()>(func.as_bytes()) };
        assert!(found.is_ok(), "{func}");
    }
}

/// Sets up the communicator of the drop-in at `lib` with its own `ascendSim*` functions, which
/// stand in for HCCL's: a thread on the native `stream`, a channel from rank 0 to rank 1, and
/// `len` bytes at `window` (device 1's memory) registered. Returns `(thread, channel)`.
fn set_up_comm(lib: &std::path::Path, stream: usize, window: usize, len: u64) -> (u64, u64) {
    use std::ffi::c_void;
    // SAFETY: a drop-in library; loading it again only takes another reference.
    let lib = unsafe { libloading::Library::new(lib) }.unwrap();
    type Thread = unsafe extern "C" fn(*mut c_void, *mut u64) -> i32;
    type Channel = unsafe extern "C" fn(i32, i32, *mut u64) -> i32;
    type Register = unsafe extern "C" fn(i32, *mut c_void, u64) -> i32;
    let (mut thread, mut channel) = (0u64, 0u64);
    // SAFETY: symbols of the drop-in with these prototypes; live out-pointers; the stream
    // handle is the drop-in's `aclrtStream`, the window live device memory of device 1.
    unsafe {
        let acquire_thread = lib.get::<Thread>(b"ascendSimAcquireThread\0").unwrap();
        let acquire_channel = lib.get::<Channel>(b"ascendSimAcquireChannel\0").unwrap();
        let register = lib.get::<Register>(b"ascendSimRegisterWindow\0").unwrap();
        assert_eq!(acquire_thread(stream as *mut c_void, &mut thread), 0);
        assert_eq!(acquire_channel(0, 1, &mut channel), 0);
        assert_eq!(register(1, window as *mut c_void, len), 0);
        assert_eq!(register(1, window as *mut c_void, 64), 1); // HCCL_E_PARA
    }
    (thread, channel)
}

#[test]
fn one_sided_writes_reach_the_drop_in_and_land() {
    use ascend_pool::comm::{CommThread, RemoteWindow, WINDOW_GRANULE};
    use ascend_pool::source::{ChannelHandle, CommThreadHandle};
    use ascend_pool::{Pool, PoolConfig, Region};
    use std::sync::Arc;

    let acl: Arc<dyn BlockSource> = Arc::new(open());
    let rank0 = Pool::new(acl.clone(), PoolConfig::default().with_device(0)).unwrap();
    let rank1 = Pool::new(acl.clone(), PoolConfig::default().with_device(1)).unwrap();
    let stream = rank0.create_stream().unwrap();
    // The real runtime's threads come from the communicator, not from the pool.
    assert!(matches!(
        rank0.acquire_comm_thread(&stream),
        Err(Error::NotSupported { .. })
    ));

    let window = rank1
        .alloc_device_aligned(WINDOW_GRANULE, WINDOW_GRANULE)
        .unwrap();
    let native = stream.handle().0;
    let (thread, channel) = set_up_comm(dropin(), native, window.addr(), WINDOW_GRANULE);
    // SAFETY: the thread was acquired on `stream`; the window is the far end's, registered.
    let (thread, far) = unsafe {
        (
            CommThread::from_raw(CommThreadHandle(thread), &stream),
            RemoteWindow::from_raw(ChannelHandle(channel), window.addr(), WINDOW_GRANULE),
        )
    };
    let mut src = rank0.alloc_device(8192).unwrap();
    rank0.copy_from_host(&mut src, 0, &[0x3C; 8192]).unwrap();
    rank0
        .write_remote(&thread, &far, 4096, &src, 0, 8192)
        .unwrap();
    drop(src);
    stream.synchronize().unwrap();
    let mut seen = vec![0u8; 8192 + 64];
    rank1.copy_to_host(&window, 4096 - 64, &mut seen).unwrap();
    assert!(seen[..64].iter().all(|&x| x == 0));
    assert!(seen[64..].iter().all(|&x| x == 0x3C));

    // The drop-in refuses what the pool cannot check: here, a window larger than registered.
    let src = rank0.alloc_device(4096).unwrap();
    // SAFETY: refused by the simulator before any byte moves.
    let too_far = unsafe {
        RemoteWindow::from_raw(ChannelHandle(channel), window.addr(), 2 * WINDOW_GRANULE)
    };
    let e = rank0
        .write_remote(&thread, &too_far, WINDOW_GRANULE, &src, 0, 4096)
        .unwrap_err();
    assert_eq!(code(e), ("HcommWriteOnThread", AclError::HCCL_E_PARA.0));
    drop((src, window));
    for pool in [&rank0, &rank1] {
        pool.synchronize().unwrap();
        pool.validate().unwrap();
        assert!(pool.leak_report().is_empty());
    }
}

#[test]
fn one_sided_writes_go_to_a_libhcomm_beside_the_runtime() {
    use ascend_pool::comm::{CommThread, RemoteWindow, WINDOW_GRANULE};
    use ascend_pool::source::{ChannelHandle, CommThreadHandle};
    use ascend_pool::{Pool, PoolConfig, Region};
    use std::sync::Arc;

    // Without one, HcommWriteOnThread comes from the runtime itself.
    assert_eq!(open().hcomm_library(), None);

    // A second copy of the drop-in as libhcomm.so: its simulator is another one, which knows
    // no thread of the first, so a write through it is refused there.
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("hcomm-beside-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (main, hcomm) = (dir.join("libascendcl.so"), dir.join("libhcomm.so"));
    std::fs::copy(dropin(), &main).unwrap();
    std::fs::copy(dropin(), &hcomm).unwrap();
    let acl: Arc<dyn BlockSource> = Arc::new(AclSource::open(&main).unwrap());
    let rank0 = Pool::new(acl.clone(), PoolConfig::default().with_device(0)).unwrap();
    let rank1 = Pool::new(acl, PoolConfig::default().with_device(1)).unwrap();
    let stream = rank0.create_stream().unwrap();
    let window = rank1
        .alloc_device_aligned(WINDOW_GRANULE, WINDOW_GRANULE)
        .unwrap();
    // A write the runtime's own simulator would take...
    let native = stream.handle().0;
    let (thread, channel) = set_up_comm(&main, native, window.addr(), WINDOW_GRANULE);
    let src = rank0.alloc_device(4096).unwrap();
    // SAFETY: the thread was acquired on `stream`; the window is registered.
    let (thread, far) = unsafe {
        (
            CommThread::from_raw(CommThreadHandle(thread), &stream),
            RemoteWindow::from_raw(ChannelHandle(channel), window.addr(), WINDOW_GRANULE),
        )
    };
    // ...goes to libhcomm.so, whose simulator knows no such thread.
    let e = rank0
        .write_remote(&thread, &far, 0, &src, 0, 64)
        .unwrap_err();
    assert_eq!(
        code(e),
        ("HcommWriteOnThread", AclError::HCCL_E_NOT_FOUND.0)
    );
    drop((src, window));
    // The two copies are 46 MB a run; the mapped libraries outlive their files.
    let _ = std::fs::remove_dir_all(&dir);
}

/// Set in the child process `a_named_hcomm_library_that_cannot_load_fails_the_load` runs in.
const HCOMM_CHILD: &str = "ACL_SIM_DROPIN_HCOMM_CHILD";

#[test]
fn a_named_hcomm_library_that_cannot_load_fails_the_load() {
    use ascend_pool::source::acl::HCOMM_LIB_ENV;
    let missing = "/nonexistent/hcomm/libhcomm.so";
    if std::env::var_os(HCOMM_CHILD).is_none() {
        // Every load reads the variable: set here, it would fail the other tests' loads.
        common_child::rerun_in_child(
            "a_named_hcomm_library_that_cannot_load_fails_the_load",
            HCOMM_CHILD,
            &[(HCOMM_LIB_ENV, missing)],
        );
        return;
    }
    // The writes would otherwise go to the runtime's own HcommWriteOnThread, silently.
    match AclSource::open(dropin()) {
        Err(Error::LibraryLoad { library, reason }) => {
            assert_eq!(library, missing);
            assert!(reason.contains(HCOMM_LIB_ENV), "{reason}");
        }
        other => panic!("expected LibraryLoad for {missing}, got {other:?}"),
    }
    // A library that loads but has no HcommWriteOnThread is no HCOMM either: the writes
    // went to the runtime's own, silently, with the library reported as HCOMM's.
    let lacking = "libm.so.6";
    std::env::set_var(HCOMM_LIB_ENV, lacking);
    match AclSource::open(dropin()) {
        Err(Error::LibraryLoad { library, reason }) => {
            assert_eq!(library, lacking);
            assert!(reason.contains("HcommWriteOnThread"), "{reason}");
        }
        other => panic!("expected LibraryLoad for {lacking}, got {other:?}"),
    }
    // Naming the runtime itself is naming no other library.
    std::env::set_var(HCOMM_LIB_ENV, dropin());
    assert_eq!(open().hcomm_library(), None);
}

#[test]
fn the_host_side_of_a_copy_is_checked_when_it_is_a_block_of_the_runtime() {
    // Device memory named as host memory is the wrong kind, and pinned host memory has an
    // end the runtime knows: both used to be copied through unchecked (past a block's end
    // into whatever the host mapped next).
    let api = raw_api();
    let (malloc, malloc_host, free, free_host, memcpy) = (
        api.aclrtMalloc.as_ref().unwrap(),
        api.aclrtMallocHost.as_ref().unwrap(),
        api.aclrtFree.as_ref().unwrap(),
        api.aclrtFreeHost.as_ref().unwrap(),
        api.aclrtMemcpy.as_ref().unwrap(),
    );
    let bad = sys::ACL_ERROR_INVALID_PARAM;
    let mut host = vec![0u8; 4096];
    let hp = host.as_mut_ptr().cast::<std::ffi::c_void>();
    // SAFETY: every range passed is inside `host` or inside a live block of the drop-in;
    // the refused calls touch nothing.
    unsafe {
        let (mut dev, mut pinned) = (std::ptr::null_mut(), std::ptr::null_mut());
        assert_eq!(malloc(&mut dev, 4096, 0), 0);
        assert_eq!(malloc_host(&mut pinned, 1000), 0); // accounted 1056 bytes
        for (dst, src, kind) in [
            (hp, dev.cast_const(), sys::ACL_MEMCPY_HOST_TO_HOST),
            (dev, hp.cast_const(), sys::ACL_MEMCPY_HOST_TO_HOST),
            (dev, dev.cast_const(), sys::ACL_MEMCPY_HOST_TO_DEVICE),
            (dev, dev.cast_const(), sys::ACL_MEMCPY_DEVICE_TO_HOST),
        ] {
            assert_eq!(memcpy(dst, 64, src, 64, kind), bad, "kind {kind}");
        }
        // Past the end of the pinned block, on either side.
        assert_eq!(
            memcpy(pinned, 4096, dev, 2000, sys::ACL_MEMCPY_DEVICE_TO_HOST),
            bad
        );
        assert_eq!(
            memcpy(dev, 4096, pinned, 2000, sys::ACL_MEMCPY_HOST_TO_DEVICE),
            bad
        );
        // Inside it, and to or from memory that is no block of the runtime, all is well.
        assert_eq!(
            memcpy(pinned, 1056, dev, 1056, sys::ACL_MEMCPY_DEVICE_TO_HOST),
            0
        );
        assert_eq!(
            memcpy(hp, 1056, pinned, 1056, sys::ACL_MEMCPY_HOST_TO_HOST),
            0
        );
        assert_eq!(
            memcpy(dev, 4096, hp, 4096, sys::ACL_MEMCPY_HOST_TO_DEVICE),
            0
        );
        assert_eq!(free(dev), 0);
        assert_eq!(free_host(pinned), 0);
    }
}

#[test]
fn inner_device_copies_stay_on_one_device_and_inter_device_copies_need_peer_access() {
    // ACL_MEMCPY_INNER_DEVICE_TO_DEVICE (6) is a copy within one device and
    // ACL_MEMCPY_INTER_DEVICE_TO_DEVICE (7) one between two: both used to be taken as plain
    // device-to-device copies, whatever devices the two sides were on. Then kind 7 across
    // two devices was still copied, though the runtime copies between devices only once
    // aclrtDeviceEnablePeerAccess has been called, which the drop-in does not simulate (kinds
    // 3 and 4 across two devices are refused for that): kind 7 never copies here.
    let api = raw_api();
    let (set, malloc, free) = (
        api.aclrtSetDevice.as_ref().unwrap(),
        api.aclrtMalloc.as_ref().unwrap(),
        api.aclrtFree.as_ref().unwrap(),
    );
    let (create, destroy) = (
        api.aclrtCreateStream.as_ref().unwrap(),
        api.aclrtDestroyStream.as_ref().unwrap(),
    );
    let (memset, memcpy) = (
        api.aclrtMemset.as_ref().unwrap(),
        api.aclrtMemcpy.as_ref().unwrap(),
    );
    let (inner, inter) = (
        sys::ACL_MEMCPY_INNER_DEVICE_TO_DEVICE,
        sys::ACL_MEMCPY_INTER_DEVICE_TO_DEVICE,
    );
    let bad = sys::ACL_ERROR_INVALID_PARAM;
    let n = 4096;
    let host = vec![0u8; n];
    // SAFETY: every range passed lies in a live block of `n` bytes of the drop-in (or in
    // `host`, refused before it is touched); the stream is synchronized after each queued
    // copy, so before the frees.
    unsafe {
        let mut on0 = [std::ptr::null_mut(); 2];
        let mut on1 = std::ptr::null_mut();
        assert_eq!(set(0), 0);
        for p in &mut on0 {
            assert_eq!(malloc(p, n, 0), 0);
        }
        assert_eq!(set(1), 0);
        assert_eq!(malloc(&mut on1, n, 0), 0);
        assert_eq!(memset(on1, n, 7, n), 0);
        let mut stream = std::ptr::null_mut();
        assert_eq!(create(&mut stream), 0);
        let [a, b] = on0;
        for (dst, src, kind, want) in [
            (a, b, inner, 0),
            (on1, a, inner, bad),
            (a, on1, inner, bad),
            (on1, a, inter, bad),
            (a, on1, inter, bad),
            (a, b, inter, bad),
            (a, host.as_ptr().cast_mut().cast(), inner, bad),
            (a, host.as_ptr().cast_mut().cast(), inter, bad),
        ] {
            copy_both_ways(&api, (dst, src.cast_const(), n), kind, stream, want);
        }
        assert_eq!(destroy(stream), 0);
        // Nothing crossed between the devices: `a` holds `b`'s zeros, `on1` its sevens.
        let mut back = vec![0u8; n];
        for (p, value) in [(a, 0), (on1, 7)] {
            let to_host = sys::ACL_MEMCPY_DEVICE_TO_HOST;
            assert_eq!(memcpy(back.as_mut_ptr().cast(), n, p, n, to_host), 0);
            assert!(back.iter().all(|&x| x == value), "{p:?} holds {value}");
        }
        for p in [a, b, on1] {
            assert_eq!(free(p), 0);
        }
    }
}

#[test]
fn a_copy_runs_on_the_device_of_the_device_memory_it_touches() {
    // Pinned host memory is allocated with a device current, and the source looked the sides
    // of a copy up in order: a copy from device 2's memory into host memory pinned for
    // device 1 ran with device 1 current, not the device whose memory it reads.
    let acl = open();
    let api = raw_api();
    let get = api.aclrtGetDevice.as_ref().unwrap();
    let current = || {
        let mut d = -1;
        // SAFETY: `d` is a live i32 the call writes.
        assert_eq!(unsafe { get(&mut d) }, 0);
        d
    };
    let n = 4096;
    let host = acl.alloc_block(1, MemKind::Host, n).unwrap();
    let dev = acl.alloc_block(2, MemKind::DEVICE, n).unwrap();
    for kind in [MemcpyKind::DeviceToHost, MemcpyKind::Default] {
        acl.use_device(1).unwrap();
        // SAFETY: both are live blocks of `n` bytes that nothing else uses.
        unsafe { acl.memcpy(host.addr, n, dev.addr, n, kind).unwrap() };
        assert_eq!(current(), 2, "{kind:?}");
    }
    acl.use_device(1).unwrap();
    // SAFETY: as above.
    unsafe {
        acl.memcpy(dev.addr, n, host.addr, n, MemcpyKind::HostToDevice)
            .unwrap()
    };
    assert_eq!(current(), 2);
    // Host memory alone: its own device.
    acl.use_device(3).unwrap();
    // SAFETY: as above.
    unsafe { acl.memset(host.addr, n, 0, n).unwrap() };
    assert_eq!(current(), 1);
    acl.free_block(host).unwrap();
    acl.free_block(dev).unwrap();
}

#[test]
fn a_device_set_behind_the_source_s_back_is_set_again() {
    // The source remembers per thread which device it made current; the application (or
    // another library) may set another one on the thread since. The source used to trust
    // its memory, skip aclrtSetDevice and allocate on the application's device while the
    // block said device 6.
    let acl = open();
    let api = raw_api();
    let (set, get) = (
        api.aclrtSetDevice.as_ref().unwrap(),
        api.aclrtGetDevice.as_ref().unwrap(),
    );
    let current = || {
        let mut d = -1;
        // SAFETY: `d` is a live i32 the call writes.
        assert_eq!(unsafe { get(&mut d) }, 0);
        d
    };
    let a = acl.alloc_block(6, MemKind::DEVICE, 1 << 20).unwrap();
    assert_eq!(current(), 6);
    // SAFETY: a plain device id the drop-in has.
    assert_eq!(unsafe { set(2) }, 0);
    let b = acl.alloc_block(6, MemKind::DEVICE, 1 << 20).unwrap();
    assert_eq!(current(), 6, "the source made its device current again");
    assert_eq!(b.device, 6);
    // SAFETY: null is refused, not written.
    assert_eq!(
        unsafe { get(std::ptr::null_mut()) },
        sys::ACL_ERROR_INVALID_PARAM
    );
    acl.free_block(a).unwrap();
    acl.free_block(b).unwrap();
}

#[test]
fn a_configuration_it_cannot_read_or_use_fails_the_start() {
    // The drop-in reads its variables once per process, so each case runs in a child: this
    // test again, told by `CHILD` to call the library and say what it answered. A device
    // count past u32 used to wrap (4294967297 devices was 1) and a typo ran with the default.
    // A whole number the simulator refuses (no devices, a capacity of 0) used to fail every
    // call with ACL_ERROR_INTERNAL_ERROR, and nothing said why.
    const CHILD: &str = "ACL_SIM_DROPIN_CONFIG_CHILD";
    if std::env::var_os(CHILD).is_some() {
        // SAFETY: the drop-in's initialisers have no preconditions.
        let lib = unsafe { libloading::Library::new(dropin()) }.unwrap();
        // SAFETY: resolving symbols only.
        let api = unsafe { sys::AclApi::from_library(lib) }.unwrap();
        // SAFETY: a plain device id.
        let code = unsafe { (api.aclrtSetDevice.as_ref().unwrap())(0) };
        println!("@@code {code}");
        return;
    }
    let run = |var: &str, value: &str| {
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "a_configuration_it_cannot_read_or_use_fails_the_start",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(CHILD, "1")
            .env(var, value)
            .env("ASCEND_POOL_SIM_LIB", dropin())
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        let code: i32 = stdout
            .lines()
            .find_map(|l| l.split_once("@@code ").map(|(_, c)| c))
            .unwrap_or_else(|| panic!("no answer from the child: {stdout}"))
            .parse()
            .unwrap();
        (code, String::from_utf8_lossy(&out.stderr).into_owned())
    };
    for (var, value) in [
        ("ASCEND_POOL_SIM_DEVICES", "4294967297"),
        // Past u32 was refused, but 4e9 made the start ask the host for 32 GB and abort.
        ("ASCEND_POOL_SIM_DEVICES", "4000000000"),
        ("ASCEND_POOL_SIM_DEVICES", "1025"),
        ("ASCEND_POOL_SIM_DEVICES", "eight"),
        ("ASCEND_POOL_SIM_DEVICE_CAPACITY", "1G"),
        ("ASCEND_POOL_SIM_COPY_BANDWIDTH", "-1"),
        ("ASCEND_POOL_SIM_DEVICES", "0"),
        ("ASCEND_POOL_SIM_DEVICE_CAPACITY", "0"),
        ("ASCEND_POOL_SIM_HOST_CAPACITY", "0"),
        ("ASCEND_POOL_SIM_DVPP_LIMIT", "0"),
    ] {
        let (code, said) = run(var, value);
        assert_eq!(code, sys::ACL_ERROR_INVALID_PARAM, "{var}={value}");
        assert!(said.contains(var), "{var}={value}: {said}");
    }
    assert_eq!(run("ASCEND_POOL_SIM_DEVICES", " 2 ").0, 0);
}

#[test]
fn a_pool_of_a_device_the_runtime_lacks_is_refused_up_front() {
    // AclSource could not count devices: a pool of device 8 on the drop-in's 8 was made, and
    // every call of it then failed with ACL_ERROR_RT_PARAM_INVALID (the simulator refused it
    // at creation with Error::Config).
    use ascend_pool::source::vmm::{VmmConfig, VmmSource};
    use ascend_pool::{Pool, PoolConfig};
    use std::sync::Arc;

    let acl = Arc::new(open());
    let api = raw_api();
    let count = api
        .aclrtGetDeviceCount
        .as_ref()
        .expect("the drop-in exports aclrtGetDeviceCount");
    let mut n = 0u32;
    // SAFETY: `n` is a live u32 the call writes; null is refused before any write.
    unsafe {
        assert_eq!(count(&mut n), 0);
        assert_eq!(count(std::ptr::null_mut()), sys::ACL_ERROR_INVALID_PARAM);
    }
    assert!(n > 0);
    assert_eq!(acl.device_count(), Some(n));
    let past = i32::try_from(n).unwrap();
    let r = Pool::new(acl.clone(), PoolConfig::default().with_device(past));
    assert!(matches!(r, Err(Error::Config(_))), "{r:?}");
    let r = VmmSource::new(acl.clone(), past, VmmConfig::default());
    assert!(matches!(r, Err(Error::Config(_))), "{r:?}");
    Pool::new(acl, PoolConfig::default().with_device(past - 1)).unwrap();
}

#[test]
fn a_device_to_device_copy_between_two_devices_needs_peer_access() {
    // ACL_MEMCPY_DEVICE_TO_DEVICE (3) and ACL_MEMCPY_DEFAULT (4) between memory of two
    // devices were copied, though the runtime copies across devices only once
    // aclrtDeviceEnablePeerAccess has been called, which the drop-in does not simulate: the
    // pool refuses such a pair (ForeignHandle), the drop-in took it.
    let api = raw_api();
    let (set, malloc, free) = (
        api.aclrtSetDevice.as_ref().unwrap(),
        api.aclrtMalloc.as_ref().unwrap(),
        api.aclrtFree.as_ref().unwrap(),
    );
    let (create, destroy) = (
        api.aclrtCreateStream.as_ref().unwrap(),
        api.aclrtDestroyStream.as_ref().unwrap(),
    );
    let bad = sys::ACL_ERROR_INVALID_PARAM;
    let n = 4096;
    // SAFETY: every range passed lies in a live block of `n` bytes of the drop-in; the stream
    // is synchronized after each queued copy, so before the next copy and the frees.
    unsafe {
        let (mut a, mut b, mut on1) = (
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            std::ptr::null_mut(),
        );
        assert_eq!(set(0), 0);
        assert_eq!(malloc(&mut a, n, 0), 0);
        assert_eq!(malloc(&mut b, n, 0), 0);
        assert_eq!(set(1), 0);
        assert_eq!(malloc(&mut on1, n, 0), 0);
        let mut stream = std::ptr::null_mut();
        assert_eq!(create(&mut stream), 0);
        for kind in [sys::ACL_MEMCPY_DEVICE_TO_DEVICE, sys::ACL_MEMCPY_DEFAULT] {
            for (dst, src, want) in [(a, b, 0), (on1, a, bad), (a, on1, bad)] {
                copy_both_ways(&api, (dst, src.cast_const(), n), kind, stream, want);
            }
        }
        assert_eq!(destroy(stream), 0);
        for p in [a, b, on1] {
            assert_eq!(free(p), 0);
        }
    }
}

/// C users of the drop-in close the channels they open (`ascendSimReleaseChannel`), as
/// `SimSource::release_channel` does: it had no export, so they could not.
#[test]
fn the_drop_in_releases_channels() {
    // SAFETY: the drop-in; loading it again only takes another reference.
    let lib = unsafe { libloading::Library::new(dropin()) }.unwrap();
    type Acquire = unsafe extern "C" fn(i32, i32, *mut u64) -> i32;
    type Release = unsafe extern "C" fn(u64) -> i32;
    let not_found = AclError::HCCL_E_NOT_FOUND.0;
    // SAFETY: symbols of the drop-in with these prototypes; a live out-pointer.
    unsafe {
        let acquire = lib.get::<Acquire>(b"ascendSimAcquireChannel\0").unwrap();
        let release = lib.get::<Release>(b"ascendSimReleaseChannel\0").unwrap();
        let mut channel = 0u64;
        assert_eq!(acquire(0, 1, &mut channel), 0);
        assert_eq!(release(channel), 0);
        assert_eq!(release(channel), not_found, "released twice");
        assert_eq!(release(0), not_found, "never opened");
    }
}

#[test]
fn host_memory_info_of_a_device_the_runtime_lacks_is_refused_as_the_simulator_refuses_it() {
    // Pinned host memory is taken in the context aclrtSetDevice makes, so a device the
    // runtime lacks has none: the simulator refuses its host memory info as it refuses its
    // aclrtMallocHost. AclSource answered the machine's RAM for any device id.
    use ascend_pool::source::sim::{SimConfig, SimSource};

    let acl = open();
    let n = acl.device_count().expect("the drop-in counts its devices");
    let sim = SimSource::new(SimConfig::default().with_devices(n)).unwrap();
    for device in [i32::try_from(n).unwrap(), 99, -1] {
        let want = code(sim.mem_info(device, MemKind::Host).unwrap_err()).1;
        assert_eq!(want, AclError::RT_PARAM_INVALID.0);
        let got = acl.mem_info(device, MemKind::Host);
        assert_eq!(
            got.map_err(code).map_err(|(_, c)| c),
            Err(want),
            "device {device}"
        );
        assert_eq!(
            code(acl.alloc_block(device, MemKind::Host, 64).unwrap_err()).1,
            want,
            "device {device}"
        );
    }
    let (free, total) = acl.mem_info(0, MemKind::Host).unwrap();
    assert!(free <= total && total > 0);
}

#[test]
fn reserved_addresses_named_as_host_memory_are_refused_not_read() {
    // Addresses reserved with aclrtReserveMemAddress are device address space: where nothing
    // is mapped they are no memory at all. A copy naming them as its host side was let
    // through as host memory the caller vouched for, and the drop-in read or wrote them
    // (SIGSEGV) instead of answering ACL_ERROR_INVALID_PARAM as it does for mapped ones.
    const G: usize = 2 << 20;
    let api = raw_api();
    let null = std::ptr::null_mut();
    let bad = sys::ACL_ERROR_INVALID_PARAM;
    let (malloc, free) = (
        api.aclrtMalloc.as_ref().unwrap(),
        api.aclrtFree.as_ref().unwrap(),
    );
    let (reserve, release) = (
        api.aclrtReserveMemAddress.as_ref().unwrap(),
        api.aclrtReleaseMemAddress.as_ref().unwrap(),
    );
    let (memcpy, stream_sync) = (
        api.aclrtMemcpy.as_ref().unwrap(),
        api.aclrtSynchronizeStream.as_ref().unwrap(),
    );
    let memcpy_async = api.aclrtMemcpyAsync.as_ref().unwrap();
    // SAFETY: every pointer passed is null, a live local, or an address the drop-in handed
    // out; the copies name a reservation as host memory and must be refused untouched.
    unsafe {
        let mut dev = null;
        assert_eq!(malloc(&mut dev, 4096, 0), 0);
        let mut va = null;
        assert_eq!(reserve(&mut va, 2 * G, 0, null, 1), 0);
        let mut host = [0u8; 64];
        let h = host.as_mut_ptr().cast::<std::ffi::c_void>();
        for at in [va, va.cast::<u8>().add(G + 64).cast()] {
            for (dst, src, kind) in [
                (dev, at.cast_const(), sys::ACL_MEMCPY_HOST_TO_DEVICE),
                (at, dev.cast_const(), sys::ACL_MEMCPY_DEVICE_TO_HOST),
                (h, at.cast_const(), sys::ACL_MEMCPY_HOST_TO_HOST),
                (at, h.cast_const(), sys::ACL_MEMCPY_HOST_TO_HOST),
                (dev, at.cast_const(), sys::ACL_MEMCPY_DEFAULT),
            ] {
                assert_eq!(memcpy(dst, 64, src, 64, kind), bad, "kind {kind}");
                assert_eq!(
                    memcpy_async(dst, 64, src, 64, kind, null),
                    if kind == sys::ACL_MEMCPY_HOST_TO_HOST {
                        sys::ACL_ERROR_RT_FEATURE_NOT_SUPPORT
                    } else {
                        bad
                    },
                    "async kind {kind}"
                );
            }
        }
        // A host range that runs into the reservation is refused too.
        let below = va.cast::<u8>().sub(32).cast::<std::ffi::c_void>();
        assert_eq!(
            memcpy(dev, 64, below, 64, sys::ACL_MEMCPY_HOST_TO_DEVICE),
            bad
        );
        assert_eq!(stream_sync(null), 0);
        assert_eq!(release(va), 0);
        assert_eq!(free(dev), 0);
    }
}
