//! `AclSource` against small fake `libascendcl.so` files built from `tests/fake_acl/fake_acl.c`
//! with the system C compiler: loading errors, missing symbols, failing runtimes, and the
//! bookkeeping (foreign and double frees, handles, devices) over a runtime that works.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;

use ascend_pool::source::acl::AclSource;
use ascend_pool::source::vmm::PhysicalHandle;
use ascend_pool::source::{Block, BlockSource, EventHandle, MemcpyKind, StreamHandle, VmmRuntime};
use ascend_pool::{AclError, Error, MallocPolicy, MemKind};

/// Held by every test that changes the environment `AclSource::load` reads.
static ENV_LOCK: Mutex<()> = Mutex::new(());

/// Builds the fake library with `flags` into its own directory and returns its path.
fn fake_lib(name: &str, flags: &[&str]) -> PathBuf {
    fake_lib_file(name, "libascendcl.so", flags)
}

/// Builds the fake library with `flags` as `file` in directory `name` and returns its path.
fn fake_lib_file(name: &str, file: &str, flags: &[&str]) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join("fake_acl")
        .join(name);
    std::fs::create_dir_all(&dir).unwrap();
    let out = dir.join(file);
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

/// The fake library built as `name` with `flags`: its counters, and a source over it.
fn fake_source(name: &str, flags: &[&str]) -> (Counters, AclSource) {
    let lib = fake_lib(name, flags);
    (Counters::open(&lib), AclSource::open(&lib).unwrap())
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

    /// Writes an `int` the fake library exports.
    fn set(&self, name: &str, value: i32) {
        // SAFETY: the symbol is a plain `int` of the still-loaded library, and only the
        // calling test uses this copy of the library.
        unsafe {
            let sym: libloading::Symbol<'_, *mut i32> = self.0.get(name.as_bytes()).unwrap();
            **sym = value;
        }
    }
}

#[path = "common/runtime.rs"]
mod common_runtime;
use common_runtime::refusal as runtime_err;

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
    let _env = ENV_LOCK.lock().unwrap_or_else(|p| p.into_inner());
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
        acl.reserve_address(0, 2 << 20).map(|_| ()),
        "aclrtReserveMemAddress",
    );
    not_supported(
        acl.malloc_physical(0, 2 << 20).map(|_| ()),
        "aclrtMallocPhysical",
    );
    not_supported(acl.bare_tgid().map(|_| ()), "aclrtDeviceGetBareTgid");
    not_supported(acl.alloc_buf(0, 64, false).map(|_| ()), "acltdtAllocBuf");
}

#[test]
fn blocks_are_tracked_and_foreign_or_double_frees_refused() {
    let (counters, acl) = fake_source("tracking", &[]);
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
    let (counters, acl) = fake_source("drop", &[]);
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

/// The variables `AclSource::load` reads, saved and cleared; restored on drop.
struct SavedEnv(Vec<(&'static str, Option<std::ffi::OsString>)>);

impl SavedEnv {
    fn clear() -> Self {
        let vars = [
            ascend_pool::source::acl::LIB_ENV,
            "ASCEND_HOME_PATH",
            "ASCEND_TOOLKIT_HOME",
        ];
        let saved = vars.iter().map(|v| (*v, std::env::var_os(v))).collect();
        for v in vars {
            std::env::remove_var(v);
        }
        Self(saved)
    }
}

impl Drop for SavedEnv {
    fn drop(&mut self) {
        for (var, value) in &self.0 {
            match value {
                Some(value) => std::env::set_var(var, value),
                None => std::env::remove_var(var),
            }
        }
    }
}

#[test]
fn load_looks_in_the_cann_homes() {
    let _env = ENV_LOCK.lock().unwrap_or_else(|p| p.into_inner());
    let _saved = SavedEnv::clear();
    let lib = fake_lib("home/lib64", &[]);
    let home = lib.parent().unwrap().parent().unwrap();

    std::env::set_var("ASCEND_TOOLKIT_HOME", home);
    assert_eq!(
        AclSource::load().unwrap().library(),
        lib.display().to_string()
    );
    // A home without the library is passed over for the next one.
    std::env::set_var("ASCEND_HOME_PATH", "/nonexistent/cann");
    assert_eq!(
        AclSource::load().unwrap().library(),
        lib.display().to_string()
    );
    // Empty variables count as unset: an empty ASCEND_POOL_ACL_LIB was opened as the path "".
    std::env::set_var(ascend_pool::source::acl::LIB_ENV, "");
    std::env::set_var("ASCEND_HOME_PATH", "");
    assert_eq!(
        AclSource::load().unwrap().library(),
        lib.display().to_string()
    );
}

/// Set in the child process `a_failed_load_names_the_homes_it_looked_in` runs itself in.
const FAILED_LOAD_CHILD: &str = "ACL_FAKE_FAILED_LOAD_CHILD";

#[test]
fn a_failed_load_names_the_homes_it_looked_in() {
    if std::env::var_os(FAILED_LOAD_CHILD).is_none() {
        // Cargo runs tests with its target directories on the loader path, where the drop-in
        // simulator is built as libascendcl.so, and the loader reads that path only when a
        // process starts: the loads by bare name run in a child started without it.
        let out = Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "a_failed_load_names_the_homes_it_looked_in",
                "--test-threads=1",
            ])
            .env(FAILED_LOAD_CHILD, "1")
            .env("ASCEND_HOME_PATH", "/nonexistent/cann")
            .env_remove("ASCEND_TOOLKIT_HOME")
            .env_remove(ascend_pool::source::acl::LIB_ENV)
            .env_remove("LD_LIBRARY_PATH")
            .output()
            .unwrap();
        let shown = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(out.status.success(), "{shown}");
        assert!(shown.contains("1 passed"), "the child ran no test: {shown}");
        return;
    }
    let with_home = AclSource::load();
    std::env::remove_var("ASCEND_HOME_PATH");
    let bare = AclSource::load();
    if with_home.is_ok() || bare.is_ok() {
        // This machine has CANN on the loader's default path: the failures cannot be seen.
        return;
    }
    match with_home {
        Err(Error::LibraryLoad { library, reason }) => {
            assert_eq!(library, "libascendcl.so");
            assert!(
                reason.contains("also looked for /nonexistent/cann/lib64/libascendcl.so"),
                "{reason}"
            );
        }
        other => panic!("expected LibraryLoad, got {other:?}"),
    }
    match bare {
        Err(Error::LibraryLoad { library, reason }) => {
            assert_eq!(library, "libascendcl.so");
            assert!(!reason.contains("also looked for"), "{reason}");
        }
        other => panic!("expected LibraryLoad, got {other:?}"),
    }
}

#[test]
fn a_dvpp_library_beside_the_runtime_serves_dvpp_memory() {
    let main = fake_lib_file("dvpp_beside", "libascendcl.so", &["-DOMIT_DVPP"]);
    let dvpp = fake_lib_file("dvpp_beside", "libacl_dvpp.so", &[]);
    let (main_counters, dvpp_counters) = (Counters::open(&main), Counters::open(&dvpp));
    let acl = AclSource::open(&main).unwrap();
    assert_eq!(
        acl.dvpp_library(),
        Some(dvpp.display().to_string().as_str())
    );
    assert!(acl.supports("acldvppMalloc") && acl.supports("acldvppFree"));
    // Only the DVPP functions count from the DVPP library, and only the ones it has.
    assert!(!acl.supports("aclrtMallocAlign32"));
    assert!(!acl.supports("aclrtMapMem"));
    assert!(!acl.supports("no_such_function"));

    let block = acl.alloc_block(0, MemKind::Dvpp, 4096).unwrap();
    assert_eq!(block.addr % 128, 0);
    assert_eq!(dvpp_counters.get("fake_live_allocations"), 1);
    assert_eq!(main_counters.get("fake_live_allocations"), 0);
    acl.free_block(block).unwrap();
    assert_eq!(dvpp_counters.get("fake_live_allocations"), 0);

    // Without one, a runtime that lacks DVPP says so.
    let alone = fake_lib("dvpp_missing", &["-DOMIT_DVPP"]);
    let acl = AclSource::open(&alone).unwrap();
    assert_eq!(acl.dvpp_library(), None);
    assert!(!acl.supports("acldvppMalloc"));
    match acl.alloc_block(0, MemKind::Dvpp, 4096) {
        Err(Error::NotSupported { func }) => assert_eq!(func, "acldvppMalloc"),
        other => panic!("expected NotSupported, got {other:?}"),
    }
}

#[test]
fn copies_and_fills_run_on_the_device_of_the_block_they_touch() {
    let (counters, acl) = fake_source("copy_device", &[]);
    acl.mem_info(0, MemKind::DEVICE).unwrap(); // device 0 is now the lowest one used
    let b3 = acl.alloc_block(3, MemKind::DEVICE, 4096).unwrap();
    let b2 = acl.alloc_block(2, MemKind::DEVICE, 4096).unwrap();
    assert_eq!(counters.get("fake_current_device"), 2);

    // SAFETY: 16 bytes inside the live block `b3`.
    unsafe { acl.memset(b3.addr + 100, 16, 0, 16).unwrap() };
    assert_eq!(counters.get("fake_copy_device"), 3);

    acl.mem_info(2, MemKind::DEVICE).unwrap();
    let mut out = [0u8; 16];
    // SAFETY: `out` is a live 16-byte buffer; the source is the last 16 bytes of `b3`.
    unsafe {
        acl.memcpy(
            out.as_mut_ptr() as usize,
            16,
            b3.addr + 4080,
            16,
            MemcpyKind::DeviceToHost,
        )
        .unwrap();
    }
    assert_eq!(counters.get("fake_copy_device"), 3, "the source's device");

    // The first byte past the higher of the two blocks is in neither (the other lies below;
    // an allocator may well put one right after the other): the lowest device used so far.
    let end = b2.addr.max(b3.addr) + 4096;
    acl.mem_info(2, MemKind::DEVICE).unwrap();
    // SAFETY: a fill of 0 bytes touches no memory.
    unsafe { acl.memset(end, 0, 0, 0).unwrap() };
    assert_eq!(counters.get("fake_copy_device"), 0);
}

#[test]
fn memory_info_asks_for_the_class_of_the_kind() {
    let (counters, acl) = fake_source("mem_attr", &[]);
    use MallocPolicy as P;
    // aclrtMemAttr: ACL_HBM_MEM 1, _HUGE 4, _NORMAL 5, _P2P_HUGE 8, _P2P_NORMAL 9,
    // _HUGE1G 10, _P2P_HUGE1G 11.
    for (kind, attr) in [
        (MemKind::Device(P::HugeFirst), 1),
        (MemKind::Device(P::HugeFirstP2p), 1),
        (MemKind::Device(P::HugeOnly), 4),
        (MemKind::Cached(P::NormalOnly), 5),
        (MemKind::DeviceAlign32(P::HugeOnlyP2p), 8),
        (MemKind::Device(P::NormalOnlyP2p), 9),
        (MemKind::Device(P::Huge1gOnly), 10),
        (MemKind::Device(P::Huge1gOnlyP2p), 11),
        (MemKind::Dvpp, 1),
    ] {
        acl.mem_info(0, kind).unwrap();
        assert_eq!(counters.get("fake_mem_attr"), attr, "{kind:?}");
    }

    // Host memory is the machine's RAM, not a runtime query.
    counters.set("fake_mem_attr", -1);
    let (free, total) = acl.mem_info(0, MemKind::Host).unwrap();
    assert_eq!(counters.get("fake_mem_attr"), -1);
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap();
    let kib: u64 = meminfo
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap();
    let ram = kib * 1024;
    assert!(
        total.abs_diff(ram) <= ram / 10,
        "total {total} against MemTotal {ram}"
    );
    assert!(free <= total);
}

#[test]
fn finalize_reaches_the_runtime() {
    let (counters, acl) = fake_source("finalize", &[]);
    acl.finalize().unwrap();
    assert_eq!(counters.get("fake_finalize_calls"), 1);
}

#[test]
fn both_event_queries_read_their_own_status_values() {
    // aclrtQueryEventStatus answers COMPLETE as 1; the older aclrtQueryEvent as 0.
    for (name, flags) in [("query_new", &[][..]), ("query_old", &["-DOLD_QUERY"][..])] {
        let (counters, acl) = fake_source(name, flags);
        assert_eq!(acl.supports("aclrtQueryEvent"), name == "query_old");
        let s = acl.create_stream(0).unwrap();
        let e = acl.create_event(0).unwrap();
        acl.record_event(e, s).unwrap();
        counters.set("fake_event_done", 0);
        assert!(!acl.query_event(e).unwrap(), "{name}: not done yet");
        counters.set("fake_event_done", 1);
        assert!(acl.query_event(e).unwrap(), "{name}: done");
    }
}

#[test]
fn debug_output_shows_the_library_and_what_is_live() {
    let lib = fake_lib("debug", &[]);
    let acl = AclSource::open(&lib).unwrap();
    let _block = acl.alloc_block(0, MemKind::DEVICE, 64).unwrap();
    let _stream = acl.create_stream(0).unwrap();
    let shown = format!("{acl:?}");
    assert!(shown.starts_with("AclSource"), "{shown}");
    assert!(shown.contains(&lib.display().to_string()), "{shown}");
    for field in ["live_blocks: 1", "streams: 1", "events: 0"] {
        assert!(shown.contains(field), "{field} in {shown}");
    }
}

#[test]
fn dropping_one_source_keeps_anothers_device_current() {
    let lib = fake_lib("two_sources", &[]);
    let counters = Counters::open(&lib);
    let first = AclSource::open(&lib).unwrap();
    let second = AclSource::open(&lib).unwrap();
    let block = first.alloc_block(0, MemKind::DEVICE, 64).unwrap();
    first.free_block(block).unwrap();
    let kept = second.alloc_block(0, MemKind::DEVICE, 64).unwrap();
    drop(first);
    let set = counters.get("fake_set_device_calls");
    let again = second.alloc_block(0, MemKind::DEVICE, 64).unwrap();
    assert_eq!(
        counters.get("fake_set_device_calls"),
        set,
        "the second source's device was still current on this thread"
    );
    second.free_block(kept).unwrap();
    second.free_block(again).unwrap();
}

#[test]
fn mappings_outside_the_sources_reservations_never_reach_the_runtime() {
    let lib = fake_lib("vmm", &["-DWITH_VMM"]);
    let counters = Counters::open(&lib);
    let acl = AclSource::open(&lib).unwrap();
    let g = acl.allocation_granularity(0, false).unwrap();
    assert_eq!(g, 2 << 20);
    let g_us = g as usize;
    // The fake refuses an alignment other than 0, as the runtime does; huge pages are
    // reserved for the huge-page memory `malloc_physical` allocates.
    let va = acl.reserve_address(0, 2 * g).unwrap();
    assert_eq!(counters.get("fake_reserve_flags"), 1);
    let h = acl.malloc_physical(0, 2 * g).unwrap();
    acl.map(va, 2 * g, 0, h).unwrap();
    acl.unmap(va).unwrap();
    acl.map(va + g_us, g, 0, h).unwrap();
    acl.unmap(va + g_us).unwrap();
    assert_eq!(counters.get("fake_map_calls"), 2);

    let invalid = |r: Result<(), Error>, what: &str| {
        assert_eq!(
            runtime_err(r.unwrap_err()).1,
            AclError::INVALID_PARAM.0,
            "{what}"
        );
    };
    invalid(acl.map(va + g_us, 2 * g, 0, h), "past the end");
    invalid(acl.map(va + 2 * g_us, 0, 0, h), "empty, at the end");
    invalid(acl.map(va + 3 * g_us, g, 0, h), "beyond the end");
    invalid(acl.map(va - g_us, g, 0, h), "before the start");
    invalid(acl.unmap(va + 2 * g_us), "unmap at the end");
    invalid(acl.unmap(va), "unmap where nothing is mapped");
    assert_eq!(
        runtime_err(acl.map(va, g, 0, PhysicalHandle(h.0 + 1)).unwrap_err()),
        ("aclrtMapMem", AclError::RT_INVALID_HANDLE.0)
    );
    // Another source over the same runtime holds neither the range nor the handle.
    let other = AclSource::open(&lib).unwrap();
    let h2 = other.malloc_physical(0, g).unwrap();
    invalid(other.map(va, g, 0, h2), "another source's range");
    assert_eq!(counters.get("fake_map_calls"), 2);
    assert_eq!(counters.get("fake_unmap_calls"), 2);

    // The trait the virtual-memory source uses reaches the runtime too.
    VmmRuntime::release_address(&acl, va).unwrap();
    assert_eq!(counters.get("fake_release_calls"), 1);
    invalid(VmmRuntime::release_address(&acl, va), "released already");
    assert_eq!(counters.get("fake_release_calls"), 1);
    acl.free_physical(h).unwrap();
    other.free_physical(h2).unwrap();
    assert_eq!(counters.get("fake_free_physical_calls"), 2);
}

#[test]
fn drop_unmaps_then_frees_physical_memory_then_releases_ranges() {
    let (counters, acl) = fake_source("vmm_drop", &["-DWITH_VMM"]);
    let g = 2u64 << 20;
    let va = acl.reserve_address(0, 2 * g).unwrap();
    let (h, h2) = (
        acl.malloc_physical(0, g).unwrap(),
        acl.malloc_physical(0, g).unwrap(),
    );
    acl.map(va, g, 0, h).unwrap();
    acl.map(va + g as usize, g, 0, h2).unwrap();
    let spare = acl.reserve_address(0, g).unwrap();
    assert_ne!(spare, va);
    // While mapped, the fake runtime refuses both, as the real one does.
    assert!(acl.free_physical(h).is_err());
    assert!(acl.release_address(va).is_err());
    drop(acl);
    assert_eq!(counters.get("fake_unmap_calls"), 2);
    assert_eq!(counters.get("fake_free_physical_calls"), 2);
    assert_eq!(counters.get("fake_release_calls"), 2);
}

// The runtime runs threads of its own and registers thread-local destructors in its
// callers' threads: unloading it when the last source dropped left them running unmapped
// code (the drop-in crashed a test process one run in three so). It now stays loaded.
#[test]
fn the_runtime_stays_loaded_after_its_last_source_drops() {
    let lib = fake_lib("stays-loaded", &[]);
    let loaded = || {
        let path = std::ffi::CString::new(lib.to_str().unwrap()).unwrap();
        // SAFETY: RTLD_NOLOAD only looks the library up; a handle it returns is closed at once.
        unsafe {
            let h = libc::dlopen(path.as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD);
            if !h.is_null() {
                libc::dlclose(h);
            }
            !h.is_null()
        }
    };
    assert!(!loaded());
    let acl = AclSource::open(&lib).unwrap();
    let b = acl.alloc_block(0, MemKind::DEVICE, 4096).unwrap();
    acl.free_block(b).unwrap();
    drop(acl);
    assert!(loaded(), "unloaded with its last source");
}

/// A copy or fill of memory mapped into a reserved range (a pool over virtual memory, a
/// shared mapping) ran on the lowest device the source had used, not the range's: only
/// blocks from `aclrtMalloc*` were looked up. A pool on device 3 beside one on device 0 (or
/// any call for device 0 before) copied with device 0 current. Found by a review (session
/// 77). Fixed by looking up the reserved range holding the address, whose device the source
/// knows.
#[test]
fn copies_and_fills_of_mapped_memory_run_on_the_device_of_its_range() {
    let (counters, acl) = fake_source("copy_device_vmm", &["-DWITH_VMM"]);
    acl.mem_info(0, MemKind::DEVICE).unwrap(); // device 0 is now the lowest one used
    let g = acl.allocation_granularity(3, false).unwrap();
    let va = acl.reserve_address(3, 2 * g).unwrap();
    let h = acl.malloc_physical(3, g).unwrap();
    acl.map(va, g, 0, h).unwrap();
    acl.mem_info(2, MemKind::DEVICE).unwrap();
    assert_eq!(counters.get("fake_current_device"), 2);
    // SAFETY: fills of 0 bytes touch no memory (the fake's addresses are never mapped).
    unsafe { acl.memset(va + 4096, 0, 0, 0).unwrap() };
    assert_eq!(counters.get("fake_copy_device"), 3, "the range's device");
    acl.mem_info(2, MemKind::DEVICE).unwrap();
    let mut out = [0u8; 1];
    // SAFETY: as above, a copy of 0 bytes.
    unsafe {
        acl.memcpy(
            out.as_mut_ptr() as usize,
            0,
            va,
            0,
            MemcpyKind::DeviceToHost,
        )
        .unwrap()
    };
    assert_eq!(counters.get("fake_copy_device"), 3, "the source's device");
    acl.unmap(va).unwrap();
    acl.free_physical(h).unwrap();
    VmmRuntime::release_address(&acl, va).unwrap();
}

#[test]
fn devices_are_counted_where_the_runtime_can_count_them() {
    use ascend_pool::{Pool, PoolConfig};
    use std::sync::Arc;

    // An older runtime without aclrtGetDeviceCount: the source cannot tell, and a pool of
    // any device is made (the runtime refuses its calls instead).
    let old = Arc::new(AclSource::open(fake_lib("no_count", &[])).unwrap());
    assert!(!old.supports("aclrtGetDeviceCount"));
    assert_eq!(old.device_count(), None);
    Pool::new(old, PoolConfig::default().with_device(7)).unwrap();
    // A runtime that counts two devices: device 2 is refused at creation.
    let two = Arc::new(AclSource::open(fake_lib("count_two", &["-DDEVICE_COUNT=2"])).unwrap());
    assert!(two.supports("aclrtGetDeviceCount"));
    assert_eq!(two.device_count(), Some(2));
    let r = Pool::new(two.clone(), PoolConfig::default().with_device(2));
    assert!(matches!(r, Err(Error::Config(_))), "{r:?}");
    Pool::new(two, PoolConfig::default().with_device(1)).unwrap();
    // A count the runtime fails to give is no count.
    let failing = fake_lib("count_fails", &["-DDEVICE_COUNT=2", "-DFAIL_CODE=507033"]);
    assert_eq!(AclSource::open(failing).unwrap().device_count(), None);
}

#[test]
fn copies_and_fills_of_a_shared_buffer_run_on_the_buffer_s_device() {
    // A shared buffer's data area is device memory of the device it was allocated on, but
    // only blocks and reserved ranges were looked up: a copy into it ran with the lowest
    // device the source had used current.
    let (counters, acl) = fake_source("mbuf_copy_device", &["-DWITH_MBUF"]);
    acl.mem_info(0, MemKind::DEVICE).unwrap(); // device 0 is now the lowest one used
    for dvpp in [false, true] {
        let buf = acl.alloc_buf(3, 4096, dvpp).unwrap();
        let (data, size) = acl.buf_data(buf).unwrap();
        assert_eq!(size, 4096);
        acl.mem_info(2, MemKind::DEVICE).unwrap();
        // SAFETY: 16 bytes inside the live data area of `buf`.
        unsafe { acl.memset(data + 100, 16, 0, 16).unwrap() };
        assert_eq!(counters.get("fake_copy_device"), 3, "dvpp {dvpp}");
        acl.mem_info(2, MemKind::DEVICE).unwrap();
        let mut out = [0u8; 16];
        // SAFETY: `out` is a live 16-byte buffer; the source is the last 16 bytes of the data.
        unsafe {
            acl.memcpy(
                out.as_mut_ptr() as usize,
                16,
                data + 4080,
                16,
                MemcpyKind::DeviceToHost,
            )
            .unwrap();
        }
        assert_eq!(counters.get("fake_copy_device"), 3, "dvpp {dvpp}");
        acl.free_buf(buf).unwrap();
        // Once freed, the area is no device's memory of this source any more.
        acl.mem_info(2, MemKind::DEVICE).unwrap();
        // SAFETY: a fill of 0 bytes touches no memory.
        unsafe { acl.memset(data, 0, 0, 0).unwrap() };
        assert_eq!(counters.get("fake_copy_device"), 0, "dvpp {dvpp}");
    }
    assert_eq!(counters.get("fake_live_allocations"), 0);
}

#[test]
fn a_source_dropped_by_a_thread_local_destructor_frees_its_memory() {
    // A source kept in a thread-local (a per-thread pool) is dropped as the thread exits,
    // possibly after the library's own per-thread state is gone: its drop then panicked
    // inside a thread-local destructor, which aborts the process.
    use std::cell::RefCell;
    thread_local! {
        static KEPT: RefCell<Option<AclSource>> = const { RefCell::new(None) };
    }
    let lib = fake_lib("tls_drop", &[]);
    let counters = Counters::open(&lib);
    let resets = counters.get("fake_reset_device_calls");
    let path = lib.clone();
    std::thread::spawn(move || {
        let acl = AclSource::open(&path).unwrap();
        // Kept first, so its destructor is registered before (and runs after) the ones the
        // source's first call registers.
        KEPT.with(|k| *k.borrow_mut() = Some(acl));
        KEPT.with(|k| {
            let k = k.borrow();
            let acl = k.as_ref().unwrap();
            acl.alloc_block(1, MemKind::DEVICE, 4096).unwrap();
        });
    })
    .join()
    .expect("the thread ends without a panic");
    assert_eq!(
        counters.get("fake_live_allocations"),
        0,
        "the block is freed"
    );
    assert!(
        counters.get("fake_reset_device_calls") > resets,
        "aclrtSetDevice undone"
    );
}
