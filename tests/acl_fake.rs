//! `AclSource` against small fake `libascendcl.so` files built from `tests/fake_acl/fake_acl.c`
//! with the system C compiler: loading errors, missing symbols, failing runtimes, and the
//! bookkeeping (foreign and double frees, handles, devices) over a runtime that works.

use std::path::{Path, PathBuf};
use std::process::Command;

use ascend_pool::source::acl::AclSource;
use ascend_pool::source::{Block, BlockSource, EventHandle, MemcpyKind, StreamHandle};
use ascend_pool::{AclError, Error, MallocPolicy, MemKind};

/// Builds the fake library with `flags` into its own directory and returns its path.
fn fake_lib(name: &str, flags: &[&str]) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join("fake_acl")
        .join(name);
    std::fs::create_dir_all(&dir).unwrap();
    let out = dir.join("libascendcl.so");
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fake_acl/fake_acl.c");
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let status = Command::new(cc)
        .args(["-shared", "-fPIC", "-O1", "-w", "-o"])
        .arg(&out)
        .arg(&src)
        .args(flags)
        .status()
        .expect("a C compiler (cc) is needed for these tests");
    assert!(status.success(), "building the fake library failed");
    out
}

/// The fake library held open by the test, so its counters outlive an `AclSource` (whose drop
/// closes its own handle).
struct Counters(libloading::Library);

impl Counters {
    fn open(lib: &Path) -> Self {
        // SAFETY: the fake library has no initialisers.
        Self(unsafe { libloading::Library::new(lib).unwrap() })
    }

    /// Reads an `int` counter the fake library exports.
    fn get(&self, name: &str) -> i32 {
        // SAFETY: the symbol is a plain `int` of the still-loaded library.
        unsafe {
            let sym: libloading::Symbol<'_, *const i32> = self.0.get(name.as_bytes()).unwrap();
            **sym
        }
    }
}

fn runtime_err(e: Error) -> (&'static str, i32) {
    match e {
        Error::Runtime { func, code } => (func, code.0),
        other => panic!("expected a runtime error, got {other:?}"),
    }
}

#[test]
fn wrong_path_is_a_load_error_naming_the_path() {
    let path = "/nonexistent/ascend/lib64/libascendcl.so";
    match AclSource::open(path) {
        Err(Error::LibraryLoad { library, reason }) => {
            assert_eq!(library, path);
            assert!(!reason.is_empty());
            let shown = Error::LibraryLoad { library, reason }.to_string();
            assert!(shown.contains(path), "{shown}");
        }
        other => panic!("expected LibraryLoad, got {other:?}"),
    }
}

#[test]
fn env_var_points_load_at_the_library() {
    let lib = fake_lib("env", &[]);
    std::env::set_var(ascend_pool::source::acl::LIB_ENV, &lib);
    let loaded = AclSource::load();
    std::env::set_var(
        ascend_pool::source::acl::LIB_ENV,
        "/nonexistent/libascendcl.so",
    );
    let missing = AclSource::load();
    std::env::remove_var(ascend_pool::source::acl::LIB_ENV);
    let acl = loaded.unwrap();
    assert_eq!(acl.library(), lib.display().to_string());
    assert!(acl.name().starts_with("acl:"));
    assert!(
        matches!(missing, Err(Error::LibraryLoad { library, .. }) if library.contains("nonexistent"))
    );
}

#[test]
fn missing_core_symbols_are_named() {
    let lib = fake_lib("omit_malloc", &["-DOMIT_MALLOC"]);
    match AclSource::open(&lib) {
        Err(Error::LibraryLoad { library, reason }) => {
            assert_eq!(library, lib.display().to_string());
            assert!(reason.contains("aclrtMalloc"), "{reason}");
            assert!(reason.contains("aclrtFree"), "{reason}");
            assert!(!reason.contains("aclrtMallocHost"), "{reason}");
        }
        other => panic!("expected LibraryLoad, got {other:?}"),
    }
}

#[test]
fn init_failure_is_typed_and_repeat_initialize_is_tolerated() {
    let bad = fake_lib("init_fails", &["-DINIT_CODE=500001"]);
    assert_eq!(
        runtime_err(AclSource::open(&bad).unwrap_err()),
        ("aclInit", 500_001)
    );
    let again = fake_lib("init_repeat", &["-DINIT_CODE=100002"]);
    AclSource::open(&again).expect("ACL_ERROR_REPEAT_INITIALIZE is not a failure");
}

#[test]
fn set_device_failure_is_typed() {
    let lib = fake_lib("setdev_fails", &["-DSETDEV_CODE=107000"]);
    let acl = AclSource::open(&lib).unwrap();
    assert_eq!(
        runtime_err(acl.alloc_block(3, MemKind::DEVICE, 4096).unwrap_err()),
        ("aclrtSetDevice", 107_000)
    );
    assert_eq!(
        runtime_err(acl.create_stream(3).unwrap_err()),
        ("aclrtSetDevice", 107_000)
    );
}

#[test]
fn every_failing_call_is_a_typed_error() {
    let lib = fake_lib("all_fail", &["-DFAIL_CODE=207001"]);
    let acl = AclSource::open(&lib).unwrap();
    for (kind, func) in [
        (MemKind::DEVICE, "aclrtMalloc"),
        (MemKind::Host, "aclrtMallocHost"),
        (MemKind::Dvpp, "acldvppMalloc"),
    ] {
        let (f, code) = runtime_err(acl.alloc_block(0, kind, 1 << 20).unwrap_err());
        assert_eq!((f, code), (func, 207_001));
        assert!(AclError(code).is_out_of_memory());
    }
    assert_eq!(
        runtime_err(acl.mem_info(0, MemKind::DEVICE).unwrap_err()),
        ("aclrtGetMemInfo", 207_001)
    );
    assert_eq!(
        runtime_err(acl.create_stream(0).unwrap_err()),
        ("aclrtCreateStream", 207_001)
    );
    assert_eq!(
        runtime_err(acl.create_event(0).unwrap_err()),
        ("aclrtCreateEvent", 207_001)
    );
    let mut buf = [0u8; 8];
    let src = [1u8; 8];
    // SAFETY: both are live 8-byte host buffers.
    let e = unsafe {
        acl.memcpy(
            buf.as_mut_ptr() as usize,
            8,
            src.as_ptr() as usize,
            8,
            MemcpyKind::HostToHost,
        )
    };
    assert_eq!(runtime_err(e.unwrap_err()), ("aclrtMemcpy", 207_001));
    // SAFETY: as above.
    let e = unsafe { acl.memset(buf.as_mut_ptr() as usize, 8, 7, 8) };
    assert_eq!(runtime_err(e.unwrap_err()), ("aclrtMemset", 207_001));
    assert_eq!(buf, [0u8; 8], "a failing runtime wrote nothing");
}

#[test]
fn optional_functions_are_not_supported_not_load_failures() {
    let lib = fake_lib("no_optional", &[]);
    let acl = AclSource::open(&lib).unwrap();
    assert!(acl.supports("aclrtMalloc"));
    assert!(!acl.supports("aclrtMapMem"));
    let not_supported = |r: Result<_, Error>, name: &str| match r {
        Err(Error::NotSupported { func }) => assert_eq!(func, name),
        other => panic!("expected NotSupported({name}), got {other:?}"),
    };
    not_supported(
        acl.alloc_block(0, MemKind::DeviceAlign32(MallocPolicy::HugeFirst), 64)
            .map(|_| ()),
        "aclrtMallocAlign32",
    );
    not_supported(
        acl.allocation_granularity(0, true).map(|_| ()),
        "aclrtMemGetAllocationGranularity",
    );
    not_supported(
        acl.reserve_address(0, 2 << 20, 0).map(|_| ()),
        "aclrtReserveMemAddress",
    );
    not_supported(
        acl.malloc_physical(0, 2 << 20).map(|_| ()),
        "aclrtMallocPhysical",
    );
    not_supported(acl.bare_tgid().map(|_| ()), "aclrtDeviceGetBareTgid");
    not_supported(acl.alloc_buf(64, false).map(|_| ()), "acltdtAllocBuf");
}

#[test]
fn blocks_are_tracked_and_foreign_or_double_frees_refused() {
    let lib = fake_lib("tracking", &[]);
    let counters = Counters::open(&lib);
    let acl = AclSource::open(&lib).unwrap();
    let dev = acl.alloc_block(0, MemKind::DEVICE, 1000).unwrap();
    assert_eq!(dev.addr % 64, 0);
    assert_eq!(dev.size, 1000);
    let dvpp = acl.alloc_block(1, MemKind::Dvpp, 4096).unwrap();
    assert_eq!(dvpp.addr % 128, 0);
    assert_eq!(dvpp.device, 1);
    let host = acl.alloc_block(0, MemKind::Host, 256).unwrap();
    assert_eq!(counters.get("fake_live_allocations"), 3);

    let foreign = Block {
        addr: dev.addr + 64,
        ..dev
    };
    assert_eq!(
        runtime_err(acl.free_block(foreign).unwrap_err()),
        ("aclrtFree", AclError::RT_MEMORY_FREE.0)
    );
    let wrong_kind = Block {
        kind: MemKind::Host,
        ..dev
    };
    assert_eq!(
        runtime_err(acl.free_block(wrong_kind).unwrap_err()),
        ("aclrtFreeHost", AclError::RT_MEMORY_FREE.0)
    );
    let wrong_size = Block { size: 999, ..dev };
    assert_eq!(
        runtime_err(acl.free_block(wrong_size).unwrap_err()),
        ("aclrtFree", AclError::INVALID_PARAM.0)
    );
    acl.free_block(dev).unwrap();
    assert_eq!(
        runtime_err(acl.free_block(dev).unwrap_err()),
        ("aclrtFree", AclError::RT_MEMORY_FREE.0)
    );
    acl.free_block(dvpp).unwrap();
    acl.free_block(host).unwrap();
    assert_eq!(counters.get("fake_live_allocations"), 0);
    assert_eq!(
        acl.mem_info(0, MemKind::DEVICE).unwrap(),
        (1 << 30, 2 << 30)
    );
    let (free, total) = acl.mem_info(0, MemKind::Host).unwrap();
    assert!(free <= total && total > 0);
}

#[test]
fn copies_streams_and_events_over_a_working_runtime() {
    let lib = fake_lib("streams", &[]);
    let acl = AclSource::open(&lib).unwrap();
    let a = acl.alloc_block(0, MemKind::DEVICE, 4096).unwrap();
    let b = acl.alloc_block(0, MemKind::DEVICE, 4096).unwrap();
    let s = acl.create_stream(0).unwrap();
    let e = acl.create_event(0).unwrap();
    assert!(
        acl.query_event(e).unwrap(),
        "an unrecorded event is complete"
    );
    // SAFETY: `a` and `b` are live 4096-byte blocks (host memory in the fake).
    unsafe {
        acl.memset_async(a.addr, 4096, 0x5a, 4096, s).unwrap();
        acl.memcpy_async(b.addr, 4096, a.addr, 4096, MemcpyKind::DeviceToDevice, s)
            .unwrap();
    }
    acl.record_event(e, s).unwrap();
    acl.stream_wait_event(s, e).unwrap();
    acl.synchronize_event(e).unwrap();
    assert!(acl.query_event(e).unwrap());
    acl.synchronize_stream(s).unwrap();
    let mut out = [0u8; 16];
    // SAFETY: `out` is a live 16-byte buffer, `b` a live block.
    unsafe {
        acl.memcpy(
            out.as_mut_ptr() as usize,
            16,
            b.addr,
            16,
            MemcpyKind::DeviceToHost,
        )
        .unwrap();
    }
    assert_eq!(out, [0x5a; 16]);

    let bogus = StreamHandle(0xdead_0000);
    assert_eq!(
        runtime_err(acl.synchronize_stream(bogus).unwrap_err()),
        ("aclrtSynchronizeStream", AclError::RT_INVALID_HANDLE.0)
    );
    // SAFETY: the call is refused before any memory is touched.
    let r = unsafe { acl.memset_async(a.addr, 16, 0, 16, bogus) };
    assert_eq!(runtime_err(r.unwrap_err()).0, "aclrtMemsetAsync");
    assert!(acl.query_event(EventHandle(0xbeef_0000)).is_err());

    acl.destroy_event(e).unwrap();
    assert_eq!(
        runtime_err(acl.destroy_event(e).unwrap_err()),
        ("aclrtDestroyEvent", AclError::RT_INVALID_HANDLE.0)
    );
    acl.destroy_stream(s).unwrap();
    assert!(acl.destroy_stream(s).is_err());
    acl.free_block(a).unwrap();
    acl.free_block(b).unwrap();
}

#[test]
fn drop_frees_leftovers_and_balances_set_device() {
    let lib = fake_lib("drop", &[]);
    let counters = Counters::open(&lib);
    let acl = AclSource::open(&lib).unwrap();
    acl.alloc_block(0, MemKind::DEVICE, 64).unwrap();
    acl.alloc_block(2, MemKind::Host, 64).unwrap();
    let t = std::thread::scope(|sc| {
        sc.spawn(|| acl.alloc_block(1, MemKind::DEVICE, 64).unwrap())
            .join()
            .unwrap()
    });
    assert_eq!(t.device, 1);
    assert_eq!(counters.get("fake_live_allocations"), 3);
    let set = counters.get("fake_set_device_calls");
    assert!(
        set >= 3,
        "one aclrtSetDevice per device and thread at least"
    );
    drop(acl);
    assert_eq!(counters.get("fake_live_allocations"), 0);
    // Freeing the leftovers may switch devices again; every aclrtSetDevice is undone.
    assert_eq!(
        counters.get("fake_reset_device_calls"),
        counters.get("fake_set_device_calls")
    );
}
