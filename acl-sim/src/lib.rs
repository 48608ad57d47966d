//! The ascend-pool simulator ([`SimSource`]) behind the AscendCL C API, built as a drop-in
//! `libascendcl.so`.
//!
//! Every AscendCL and HCOMM function it exports has the prototype of
//! `include/ascend_pool_acl.h`; every export checks its
//! pointers (a null out-pointer is `ACL_ERROR_INVALID_PARAM`), fills every out-parameter on
//! success and returns the `aclError` code the simulator gives. It exports the core runtime
//! (init, devices and their count, memory, copies, fills, memory info, streams, events), the DVPP
//! allocators, virtual memory management (`aclrtReserveMemAddress` ... `aclrtUnmapMem`),
//! the sharing of physical memory between processes (`aclrtMemExportToShareableHandle`,
//! `aclrtMemImportFromShareableHandle`, `aclrtMemSetPidToShareableHandle`,
//! `aclrtDeviceGetBareTgid`: real processes, see the simulator's `share` module) and
//! shared buffers (`acltdt*Buf*`, on the current device). It also exports HCOMM's
//! `HcommWriteOnThread` and the channels' notifications (`HcommChannelNotifyRecordOnThread`,
//! `HcommChannelNotifyWaitOnThread`), over the simulator's communicator of one rank per device, and
//! functions of its own to set that communicator up and take it down (`ascendSimAcquireThread`,
//! `ascendSimAcquireChannel`, `ascendSimReleaseChannel`, `ascendSimRegisterWindow`,
//! `ascendSimDeregisterWindow`), which no real library has.
//!
//! Behaviour beyond the simulator's own:
//! - `aclInit` answers `ACL_ERROR_REPEAT_INITIALIZE` (100002) when already initialised;
//!   `aclFinalize` makes the next `aclInit` succeed again. Other calls do not require `aclInit`.
//! - The current device is per thread (`aclrtSetDevice`, `aclrtGetDevice`), device 0 until
//!   set; an id outside the simulated devices is `ACL_ERROR_RT_PARAM_INVALID`.
//! - A null stream is the current device's default stream, created on first use.
//! - Freeing an address that does not start a live block, or with the wrong free function,
//!   is `ACL_ERROR_RT_MEMORY_FREE`.
//! - Copies between device memory take one device only: the runtime copies across two devices
//!   only once peer access is enabled between them (`aclrtDeviceEnablePeerAccess`), which is
//!   not simulated. `ACL_MEMCPY_DEVICE_TO_DEVICE` (3), `ACL_MEMCPY_DEFAULT` (4) between
//!   device memory and `ACL_MEMCPY_INNER_DEVICE_TO_DEVICE` (6, a copy within one device) with
//!   their sides on two devices are `ACL_ERROR_INVALID_PARAM`, as the simulator answers them.
//!   `ACL_MEMCPY_INTER_DEVICE_TO_DEVICE` (7) names a copy between two devices: with its sides
//!   on one device they are on the wrong devices, and on two peer access is missing, so it is
//!   always `ACL_ERROR_INVALID_PARAM`, from `aclrtMemcpy` and `aclrtMemcpyAsync` alike.
//! - A panic inside the simulator is caught and answered `ACL_ERROR_INTERNAL_ERROR`.
//! - In a child made by `fork` of a process that used the library, every call is
//!   `ACL_ERROR_RT_FAILURE`, as the simulator answers it.
//!
//! Configuration, read once when the library is first used: `ASCEND_POOL_SIM_DEVICES`
//! (default 8), `ASCEND_POOL_SIM_DEVICE_CAPACITY` (bytes per device),
//! `ASCEND_POOL_SIM_HOST_CAPACITY` (bytes of pinned host memory),
//! `ASCEND_POOL_SIM_DVPP_LIMIT` (bytes of DVPP address space per process) and
//! `ASCEND_POOL_SIM_COPY_BANDWIDTH` (bytes per second of a simulated copy), each the
//! simulator's default when unset. A value that is not a whole number (or a device count
//! past 1,024, [`MAX_DEVICES`]), or one the simulator cannot run with (0 devices, a capacity or DVPP limit of
//! 0), fails the start: every call answers `ACL_ERROR_INVALID_PARAM`, and the variable is
//! named on standard error.
//!
//! # Safety
//! Every function is `unsafe`: pointer arguments must be null or valid for what the AscendCL
//! function of the same name reads or writes, as in the real runtime.
#![warn(missing_docs, missing_debug_implementations, rust_2018_idioms)]
#![allow(clippy::missing_safety_doc)] // one contract for all, stated above

use std::cell::Cell;
use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_void};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, OnceLock};

use ascend_pool::source::sim::{MbufHandle, SimConfig, SimSource, MAX_DEVICES, USER_DATA_BYTES};
use ascend_pool::source::vmm::{PhysicalHandle, PhysicalMemProp};
use ascend_pool::source::{
    BlockSource, ChannelHandle, CommThreadHandle, DeviceId, EventHandle, MemcpyKind, StreamHandle,
};
use ascend_pool::{AclError, Error, MallocPolicy, MemKind};

type AclResult = Result<(), i32>;

const INVALID_PARAM: i32 = AclError::INVALID_PARAM.0;
const REPEAT_INITIALIZE: i32 = 100_002;

/// The simulator and the little state the C API adds to it.
struct DropIn {
    sim: SimSource,
    devices: u32,
    initialized: AtomicBool,
    /// The stream a null `aclrtStream` stands for, per device.
    default_streams: Mutex<HashMap<DeviceId, StreamHandle>>,
    /// The fork generation the simulator was made in (see `run`).
    forks: u64,
}

static STATE: OnceLock<Result<DropIn, i32>> = OnceLock::new();

thread_local! {
    /// This thread's current device (`aclrtSetDevice`).
    static DEVICE: Cell<DeviceId> = const { Cell::new(0) };
}

/// A whole number from the environment: `None` when `name` is unset; a value that does not
/// read as one fails the library's start, so a typo does not quietly run with the default.
fn env_u64(name: &str) -> Result<Option<u64>, i32> {
    let Some(raw) = std::env::var_os(name) else {
        return Ok(None);
    };
    match raw.to_str().and_then(|v| v.trim().parse().ok()) {
        Some(v) => Ok(Some(v)),
        None => {
            eprintln!("libascendcl (ascend-pool simulator): {name}={raw:?} is not a whole number");
            Err(INVALID_PARAM)
        }
    }
}

/// [`env_u64`] for a device count or a capacity, which the simulator needs above 0: a 0 fails
/// the start too, naming the variable.
fn env_positive(name: &str) -> Result<Option<u64>, i32> {
    match env_u64(name)? {
        Some(0) => {
            eprintln!(
                "libascendcl (ascend-pool simulator): {name}=0, and the simulator needs more"
            );
            Err(INVALID_PARAM)
        }
        value => Ok(value),
    }
}

fn state() -> Result<&'static DropIn, i32> {
    STATE
        .get_or_init(|| {
            let devices = match env_positive("ASCEND_POOL_SIM_DEVICES")? {
                None => 8,
                Some(d) => u32::try_from(d)
                    .ok()
                    .filter(|&d| d <= MAX_DEVICES)
                    .ok_or_else(|| {
                        eprintln!(
                            "libascendcl (ascend-pool simulator): ASCEND_POOL_SIM_DEVICES={d} is past the simulator's {MAX_DEVICES}"
                        );
                        INVALID_PARAM
                    })?,
            };
            let mut config = SimConfig::default().with_devices(devices);
            if let Some(bytes) = env_positive("ASCEND_POOL_SIM_DEVICE_CAPACITY")? {
                config = config.with_device_capacity(bytes);
            }
            if let Some(bytes) = env_positive("ASCEND_POOL_SIM_HOST_CAPACITY")? {
                config = config.with_host_capacity(bytes);
            }
            if let Some(bytes) = env_positive("ASCEND_POOL_SIM_DVPP_LIMIT")? {
                config = config.with_dvpp_limit(bytes);
            }
            if let Some(rate) = env_u64("ASCEND_POOL_SIM_COPY_BANDWIDTH")? {
                config = config.with_copy_bandwidth(rate);
            }
            // Anything else the simulator refuses fails the start the same way, and says why.
            let sim = SimSource::new(config).map_err(|e| {
                eprintln!("libascendcl (ascend-pool simulator): {e}");
                INVALID_PARAM
            })?;
            Ok(DropIn {
                sim,
                devices,
                initialized: AtomicBool::new(false),
                default_streams: Mutex::new(HashMap::new()),
                forks: ascend_pool::fork::generation(),
            })
        })
        .as_ref()
        .map_err(|code| *code)
}

/// The `aclError` code for a library error.
fn code_of(e: &Error) -> i32 {
    match e {
        Error::Runtime { code, .. } => code.0,
        Error::NotSupported { .. } => AclError::RT_FEATURE_NOT_SUPPORT.0,
        Error::OutOfMemory {
            source: Some(code), ..
        } => code.0,
        Error::OutOfMemory { .. }
        | Error::LimitExceeded { .. }
        | Error::TotalLimitExceeded { .. } => AclError::RT_MEMORY_ALLOCATION.0,
        Error::ForeignHandle | Error::AlreadyFreed => AclError::RT_INVALID_HANDLE.0,
        // A child made by `fork` calling into its parent's runtime (the simulator's choice:
        // the runtime documents no code for it).
        Error::Forked => AclError::RT_FAILURE.0,
        _ => AclError::INTERNAL_ERROR.0,
    }
}

/// Runs `body`, turning its error (or a panic) into an `aclError`.
fn run(body: impl FnOnce(&'static DropIn) -> AclResult) -> c_int {
    match catch_unwind(AssertUnwindSafe(|| {
        let s = state()?;
        // A child made by `fork` is refused as the simulator refuses it, before any lock of
        // the drop-in's own (a parent's thread may have held one) and before a lookup that
        // would call the parent's block an unknown address.
        acl(ascend_pool::fork::check(s.forks))?;
        body(s)
    })) {
        Ok(Ok(())) => 0,
        Ok(Err(code)) => code,
        Err(_) => AclError::INTERNAL_ERROR.0,
    }
}

/// Maps a library result to the C API's.
fn acl<T>(r: ascend_pool::Result<T>) -> Result<T, i32> {
    r.map_err(|e| code_of(&e))
}

/// Writes `value` through a C out-pointer, refusing null.
unsafe fn put<T>(out: *mut T, value: T) -> AclResult {
    if out.is_null() {
        return Err(INVALID_PARAM);
    }
    // SAFETY: non-null, and the caller's contract makes it valid for a write of `T`.
    unsafe { out.write(value) };
    Ok(())
}

fn current_device() -> DeviceId {
    DEVICE.with(Cell::get)
}

fn policy(raw: u32) -> MallocPolicy {
    // Flags sit above the low byte; unknown policies fall back to the default, as the runtime does.
    match raw & 0xff {
        1 => MallocPolicy::HugeOnly,
        2 => MallocPolicy::NormalOnly,
        3 => MallocPolicy::HugeFirstP2p,
        4 => MallocPolicy::HugeOnlyP2p,
        5 => MallocPolicy::NormalOnlyP2p,
        6 => MallocPolicy::Huge1gOnly,
        7 => MallocPolicy::Huge1gOnlyP2p,
        _ => MallocPolicy::HugeFirst,
    }
}

/// The simulator's kind for raw kind `raw`. INNER_DEVICE_TO_DEVICE (6) is a device-to-device
/// copy, which the simulator keeps within one device. INTER_DEVICE_TO_DEVICE (7), a copy
/// between two devices, is refused: the runtime makes one only once peer access is enabled,
/// which is not simulated (and on one device its sides are on the wrong devices).
fn copy_kind(raw: u32) -> Result<MemcpyKind, i32> {
    Ok(match raw {
        0 => MemcpyKind::HostToHost,
        1 | 5 => MemcpyKind::HostToDevice,
        2 => MemcpyKind::DeviceToHost,
        3 | 6 => MemcpyKind::DeviceToDevice,
        4 => MemcpyKind::Default,
        // Between two devices: peer access is never enabled here.
        7 => return Err(INVALID_PARAM),
        _ => return Err(INVALID_PARAM),
    })
}

impl DropIn {
    fn alloc(
        &self,
        out: *mut *mut c_void,
        device: DeviceId,
        kind: MemKind,
        size: usize,
    ) -> AclResult {
        if out.is_null() {
            return Err(INVALID_PARAM);
        }
        let block = acl(self.sim.alloc_block(device, kind, size as u64))?;
        // SAFETY: `out` is non-null and valid per the caller's contract.
        unsafe { put(out, block.addr as *mut c_void) }
    }

    /// Frees the block starting at `ptr` if `is_kind` accepts its kind.
    fn free(&self, ptr: *mut c_void, is_kind: impl Fn(MemKind) -> bool) -> AclResult {
        if ptr.is_null() {
            return Err(INVALID_PARAM);
        }
        match self.sim.block_containing(ptr as usize) {
            Some(block) if block.addr == ptr as usize && is_kind(block.kind) => {
                acl(self.sim.free_block(block))
            }
            _ => Err(AclError::RT_MEMORY_FREE.0),
        }
    }

    /// The stream a C handle names: itself, or the current device's default stream for null.
    fn stream(&self, raw: *mut c_void) -> Result<StreamHandle, i32> {
        if !raw.is_null() {
            return Ok(StreamHandle(raw as usize));
        }
        let device = current_device();
        let mut defaults = self
            .default_streams
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if let Some(s) = defaults.get(&device) {
            return Ok(*s);
        }
        let s = acl(self.sim.create_stream(device))?;
        defaults.insert(device, s);
        Ok(s)
    }
}

fn is_device(kind: MemKind) -> bool {
    matches!(
        kind,
        MemKind::Device(_) | MemKind::DeviceAlign32(_) | MemKind::Cached(_)
    )
}

// ---- initialisation and devices ----------------------------------------------------------

/// `aclInit`: 0 the first time, `ACL_ERROR_REPEAT_INITIALIZE` after.
#[no_mangle]
pub unsafe extern "C" fn aclInit(_config_path: *const c_char) -> c_int {
    run(|s| match s.initialized.swap(true, Ordering::AcqRel) {
        false => Ok(()),
        true => Err(REPEAT_INITIALIZE),
    })
}

/// `aclFinalize`.
#[no_mangle]
pub unsafe extern "C" fn aclFinalize() -> c_int {
    run(|s| {
        s.initialized.store(false, Ordering::Release);
        Ok(())
    })
}

/// `aclrtSetDevice`: makes `device` current on this thread.
#[no_mangle]
pub unsafe extern "C" fn aclrtSetDevice(device: i32) -> c_int {
    run(|s| {
        if device < 0 || device as u32 >= s.devices {
            return Err(AclError::RT_PARAM_INVALID.0);
        }
        DEVICE.with(|d| d.set(device));
        Ok(())
    })
}

/// `aclrtGetDevice`: this thread's current device (0 until `aclrtSetDevice`).
#[no_mangle]
pub unsafe extern "C" fn aclrtGetDevice(out: *mut i32) -> c_int {
    // SAFETY: `put` refuses a null `out`; the caller's contract makes any other writable.
    run(|_| unsafe { put(out, current_device()) })
}

/// `aclrtGetDeviceCount`: the simulated devices (`ASCEND_POOL_SIM_DEVICES`).
#[no_mangle]
pub unsafe extern "C" fn aclrtGetDeviceCount(out: *mut u32) -> c_int {
    // SAFETY: `put` refuses a null `out`; the caller's contract makes any other writable.
    run(|s| unsafe { put(out, s.devices) })
}

/// `aclrtResetDevice`.
#[no_mangle]
pub unsafe extern "C" fn aclrtResetDevice(device: i32) -> c_int {
    run(|s| {
        if device < 0 || device as u32 >= s.devices {
            return Err(AclError::RT_PARAM_INVALID.0);
        }
        Ok(())
    })
}

// ---- memory ------------------------------------------------------------------------------

/// `aclrtMalloc`.
#[no_mangle]
pub unsafe extern "C" fn aclrtMalloc(out: *mut *mut c_void, size: usize, pol: u32) -> c_int {
    run(|s| s.alloc(out, current_device(), MemKind::Device(policy(pol)), size))
}

/// `aclrtMallocAlign32`.
#[no_mangle]
pub unsafe extern "C" fn aclrtMallocAlign32(out: *mut *mut c_void, size: usize, pol: u32) -> c_int {
    run(|s| {
        s.alloc(
            out,
            current_device(),
            MemKind::DeviceAlign32(policy(pol)),
            size,
        )
    })
}

/// `aclrtMallocCached`.
#[no_mangle]
pub unsafe extern "C" fn aclrtMallocCached(out: *mut *mut c_void, size: usize, pol: u32) -> c_int {
    run(|s| s.alloc(out, current_device(), MemKind::Cached(policy(pol)), size))
}

/// `aclrtFree`: device, align32 and cached memory.
#[no_mangle]
pub unsafe extern "C" fn aclrtFree(ptr: *mut c_void) -> c_int {
    run(|s| s.free(ptr, is_device))
}

/// `aclrtMallocHost`.
#[no_mangle]
pub unsafe extern "C" fn aclrtMallocHost(out: *mut *mut c_void, size: usize) -> c_int {
    run(|s| s.alloc(out, current_device(), MemKind::Host, size))
}

/// `aclrtFreeHost`.
#[no_mangle]
pub unsafe extern "C" fn aclrtFreeHost(ptr: *mut c_void) -> c_int {
    run(|s| s.free(ptr, |k| k == MemKind::Host))
}

/// `acldvppMalloc`.
#[no_mangle]
pub unsafe extern "C" fn acldvppMalloc(out: *mut *mut c_void, size: usize) -> c_int {
    run(|s| s.alloc(out, current_device(), MemKind::Dvpp, size))
}

/// `acldvppFree`.
#[no_mangle]
pub unsafe extern "C" fn acldvppFree(ptr: *mut c_void) -> c_int {
    run(|s| s.free(ptr, |k| k == MemKind::Dvpp))
}

/// `hi_mpi_dvpp_malloc`: DVPP memory on the current device. `dev_id` is reserved: the
/// runtime ignores it, so a program that relies on it fails on hardware.
#[no_mangle]
pub unsafe extern "C" fn hi_mpi_dvpp_malloc(_dev_id: u32, out: *mut *mut c_void, size: u64) -> i32 {
    run(|s| {
        let size = usize::try_from(size).map_err(|_| INVALID_PARAM)?;
        s.alloc(out, current_device(), MemKind::Dvpp, size)
    })
}

/// `hi_mpi_dvpp_free`.
#[no_mangle]
pub unsafe extern "C" fn hi_mpi_dvpp_free(ptr: *mut c_void) -> i32 {
    run(|s| s.free(ptr, |k| k == MemKind::Dvpp))
}

/// `aclrtMemcpy`.
#[no_mangle]
pub unsafe extern "C" fn aclrtMemcpy(
    dst: *mut c_void,
    dst_max: usize,
    src: *const c_void,
    count: usize,
    kind: u32,
) -> c_int {
    run(|s| {
        let kind = copy_kind(kind)?;
        // SAFETY: the caller's contract (AscendCL's) makes both ranges valid.
        acl(unsafe {
            s.sim.memcpy(
                dst as usize,
                dst_max as u64,
                src as usize,
                count as u64,
                kind,
            )
        })
    })
}

/// `aclrtMemcpyAsync`.
#[no_mangle]
pub unsafe extern "C" fn aclrtMemcpyAsync(
    dst: *mut c_void,
    dst_max: usize,
    src: *const c_void,
    count: usize,
    kind: u32,
    stream: *mut c_void,
) -> c_int {
    run(|s| {
        let kind = copy_kind(kind)?;
        let stream = s.stream(stream)?;
        // SAFETY: the caller's contract makes both ranges valid until the stream passes them.
        acl(unsafe {
            s.sim.memcpy_async(
                dst as usize,
                dst_max as u64,
                src as usize,
                count as u64,
                kind,
                stream,
            )
        })
    })
}

/// `aclrtMemset`.
#[no_mangle]
pub unsafe extern "C" fn aclrtMemset(
    dst: *mut c_void,
    max: usize,
    value: i32,
    count: usize,
) -> c_int {
    run(|s| {
        // SAFETY: the caller's contract makes the range valid.
        acl(unsafe {
            s.sim
                .memset(dst as usize, max as u64, value as u8, count as u64)
        })
    })
}

/// `aclrtMemsetAsync`.
#[no_mangle]
pub unsafe extern "C" fn aclrtMemsetAsync(
    dst: *mut c_void,
    max: usize,
    value: i32,
    count: usize,
    stream: *mut c_void,
) -> c_int {
    run(|s| {
        let stream = s.stream(stream)?;
        // SAFETY: the caller's contract makes the range valid until the stream passes it.
        acl(unsafe {
            s.sim
                .memset_async(dst as usize, max as u64, value as u8, count as u64, stream)
        })
    })
}

/// `aclrtGetMemInfo`: device memory of the current device, whatever the class asked.
#[no_mangle]
pub unsafe extern "C" fn aclrtGetMemInfo(attr: u32, free: *mut usize, total: *mut usize) -> c_int {
    run(|s| {
        let pol = match attr {
            0 | 1 => MallocPolicy::HugeFirst,
            2 | 4 => MallocPolicy::HugeOnly,
            3 | 5 => MallocPolicy::NormalOnly,
            6 | 8 => MallocPolicy::HugeOnlyP2p,
            7 | 9 => MallocPolicy::NormalOnlyP2p,
            10 => MallocPolicy::Huge1gOnly,
            11 => MallocPolicy::Huge1gOnlyP2p,
            _ => return Err(INVALID_PARAM),
        };
        if free.is_null() || total.is_null() {
            return Err(INVALID_PARAM);
        }
        let (f, t) = acl(s.sim.mem_info(current_device(), MemKind::Device(pol)))?;
        // SAFETY: both checked non-null; valid per the caller's contract.
        unsafe {
            put(free, f as usize)?;
            put(total, t as usize)
        }
    })
}

// ---- streams and events ------------------------------------------------------------------

/// `aclrtCreateStream` on the current device.
#[no_mangle]
pub unsafe extern "C" fn aclrtCreateStream(out: *mut *mut c_void) -> c_int {
    run(|s| {
        if out.is_null() {
            return Err(INVALID_PARAM);
        }
        let stream = acl(s.sim.create_stream(current_device()))?;
        // SAFETY: checked non-null; valid per the caller's contract.
        unsafe { put(out, stream.0 as *mut c_void) }
    })
}

/// `aclrtDestroyStream`.
#[no_mangle]
pub unsafe extern "C" fn aclrtDestroyStream(stream: *mut c_void) -> c_int {
    run(|s| {
        if stream.is_null() {
            return Err(INVALID_PARAM);
        }
        acl(s.sim.destroy_stream(StreamHandle(stream as usize)))
    })
}

/// `aclrtSynchronizeStream` (null: the default stream).
#[no_mangle]
pub unsafe extern "C" fn aclrtSynchronizeStream(stream: *mut c_void) -> c_int {
    run(|s| acl(s.sim.synchronize_stream(s.stream(stream)?)))
}

/// `aclrtCreateEvent` on the current device.
#[no_mangle]
pub unsafe extern "C" fn aclrtCreateEvent(out: *mut *mut c_void) -> c_int {
    run(|s| {
        if out.is_null() {
            return Err(INVALID_PARAM);
        }
        let event = acl(s.sim.create_event(current_device()))?;
        // SAFETY: checked non-null; valid per the caller's contract.
        unsafe { put(out, event.0 as *mut c_void) }
    })
}

/// `aclrtDestroyEvent`.
#[no_mangle]
pub unsafe extern "C" fn aclrtDestroyEvent(event: *mut c_void) -> c_int {
    run(|s| acl(s.sim.destroy_event(event_handle(event)?)))
}

/// `aclrtRecordEvent` (null stream: the default stream).
#[no_mangle]
pub unsafe extern "C" fn aclrtRecordEvent(event: *mut c_void, stream: *mut c_void) -> c_int {
    run(|s| acl(s.sim.record_event(event_handle(event)?, s.stream(stream)?)))
}

/// `aclrtQueryEventStatus`: `ACL_EVENT_RECORDED_STATUS_COMPLETE` (1) or `NOT_READY` (0).
#[no_mangle]
pub unsafe extern "C" fn aclrtQueryEventStatus(event: *mut c_void, status: *mut u32) -> c_int {
    run(|s| {
        if status.is_null() {
            return Err(INVALID_PARAM);
        }
        let done = acl(s.sim.query_event(event_handle(event)?))?;
        // SAFETY: checked non-null; valid per the caller's contract.
        unsafe { put(status, u32::from(done)) }
    })
}

/// `aclrtQueryEvent`: `ACL_EVENT_STATUS_COMPLETE` (0) or `NOT_READY` (1).
#[no_mangle]
pub unsafe extern "C" fn aclrtQueryEvent(event: *mut c_void, status: *mut u32) -> c_int {
    run(|s| {
        if status.is_null() {
            return Err(INVALID_PARAM);
        }
        let done = acl(s.sim.query_event(event_handle(event)?))?;
        // SAFETY: checked non-null; valid per the caller's contract.
        unsafe { put(status, u32::from(!done)) }
    })
}

/// `aclrtStreamWaitEvent` (null stream: the default stream).
#[no_mangle]
pub unsafe extern "C" fn aclrtStreamWaitEvent(stream: *mut c_void, event: *mut c_void) -> c_int {
    run(|s| {
        acl(s
            .sim
            .stream_wait_event(s.stream(stream)?, event_handle(event)?))
    })
}

/// `aclrtSynchronizeEvent`.
#[no_mangle]
pub unsafe extern "C" fn aclrtSynchronizeEvent(event: *mut c_void) -> c_int {
    run(|s| acl(s.sim.synchronize_event(event_handle(event)?)))
}

// ---- virtual memory management ------------------------------------------------------

/// `aclrtPhysicalMemProp` as C lays it out (enums are `int`-sized).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct AclrtPhysicalMemProp {
    /// `aclrtMemHandleType`.
    pub handle_type: u32,
    /// `aclrtMemAllocationType`.
    pub allocation_type: u32,
    /// `aclrtMemAttr`.
    pub mem_attr: u32,
    /// `aclrtMemLocation.id`.
    pub location_id: u32,
    /// `aclrtMemLocation.type`.
    pub location_type: u32,
    /// Reserved.
    pub reserve: u64,
}

/// The property behind a C pointer, `None` for null.
unsafe fn prop(raw: *const AclrtPhysicalMemProp) -> Option<PhysicalMemProp> {
    // SAFETY: null or valid per the caller's contract.
    unsafe { raw.as_ref() }.map(|p| PhysicalMemProp {
        handle_type: p.handle_type,
        allocation_type: p.allocation_type,
        mem_attr: p.mem_attr,
        location_id: p.location_id,
        location_type: p.location_type,
    })
}

/// An event argument: null is a bad parameter, as for every other handle.
fn event_handle(event: *mut c_void) -> Result<EventHandle, i32> {
    non_null(event).map(EventHandle)
}

fn non_null(ptr: *const c_void) -> Result<usize, i32> {
    if ptr.is_null() {
        Err(INVALID_PARAM)
    } else {
        Ok(ptr as usize)
    }
}

/// `aclrtMemGetAllocationGranularity`.
#[no_mangle]
pub unsafe extern "C" fn aclrtMemGetAllocationGranularity(
    raw_prop: *mut AclrtPhysicalMemProp,
    option: u32,
    granularity: *mut usize,
) -> c_int {
    run(|s| {
        // SAFETY: null or valid per the caller's contract.
        let p = unsafe { prop(raw_prop) };
        let g = acl(s.sim.mem_get_allocation_granularity(p.as_ref(), option))?;
        // SAFETY: checked by `put`; valid per the caller's contract.
        unsafe { put(granularity, g as usize) }
    })
}

/// `aclrtReserveMemAddress`.
#[no_mangle]
pub unsafe extern "C" fn aclrtReserveMemAddress(
    vir_ptr: *mut *mut c_void,
    size: usize,
    alignment: usize,
    expect_ptr: *mut c_void,
    flags: u64,
) -> c_int {
    run(|s| {
        if vir_ptr.is_null() {
            return Err(INVALID_PARAM);
        }
        let va = acl(s.sim.reserve_mem_address(
            size as u64,
            alignment as u64,
            expect_ptr as usize,
            flags,
        ))?;
        // SAFETY: checked non-null; valid per the caller's contract.
        unsafe { put(vir_ptr, va as *mut c_void) }
    })
}

/// `aclrtReleaseMemAddress`.
#[no_mangle]
pub unsafe extern "C" fn aclrtReleaseMemAddress(vir_ptr: *mut c_void) -> c_int {
    run(|s| acl(s.sim.release_mem_address(non_null(vir_ptr)?)))
}

/// `aclrtMallocPhysical`.
#[no_mangle]
pub unsafe extern "C" fn aclrtMallocPhysical(
    handle: *mut *mut c_void,
    size: usize,
    raw_prop: *const AclrtPhysicalMemProp,
    flags: u64,
) -> c_int {
    run(|s| {
        if handle.is_null() {
            return Err(INVALID_PARAM);
        }
        // SAFETY: null or valid per the caller's contract.
        let p = unsafe { prop(raw_prop) };
        let h = acl(s.sim.malloc_physical_with(size as u64, p.as_ref(), flags))?;
        // SAFETY: checked non-null; valid per the caller's contract.
        unsafe { put(handle, h.0 as *mut c_void) }
    })
}

/// `aclrtFreePhysical`.
#[no_mangle]
pub unsafe extern "C" fn aclrtFreePhysical(handle: *mut c_void) -> c_int {
    run(|s| {
        acl(s
            .sim
            .free_physical_handle(PhysicalHandle(non_null(handle)?)))
    })
}

/// `aclrtMapMem`.
#[no_mangle]
pub unsafe extern "C" fn aclrtMapMem(
    vir_ptr: *mut c_void,
    size: usize,
    offset: usize,
    handle: *mut c_void,
    flags: u64,
) -> c_int {
    run(|s| {
        let va = non_null(vir_ptr)?;
        let h = PhysicalHandle(non_null(handle)?);
        acl(s.sim.map_mem(va, size as u64, offset as u64, h, flags))
    })
}

/// `aclrtUnmapMem`.
#[no_mangle]
pub unsafe extern "C" fn aclrtUnmapMem(vir_ptr: *mut c_void) -> c_int {
    run(|s| acl(s.sim.unmap_mem(non_null(vir_ptr)?)))
}

// ---- cross-process sharing ----------------------------------------------------------

/// `aclrtMemExportToShareableHandle`.
#[no_mangle]
pub unsafe extern "C" fn aclrtMemExportToShareableHandle(
    handle: *mut c_void,
    handle_type: u32,
    flags: u64,
    shareable: *mut u64,
) -> c_int {
    run(|s| {
        if shareable.is_null() {
            return Err(INVALID_PARAM);
        }
        let h = PhysicalHandle(non_null(handle)?);
        let out = acl(s.sim.export_to_shareable_handle(h, handle_type, flags))?;
        // SAFETY: checked non-null; valid per the caller's contract.
        unsafe { put(shareable, out) }
    })
}

/// `aclrtMemImportFromShareableHandle`.
#[no_mangle]
pub unsafe extern "C" fn aclrtMemImportFromShareableHandle(
    shareable: u64,
    device: i32,
    handle: *mut *mut c_void,
) -> c_int {
    run(|s| {
        if handle.is_null() {
            return Err(INVALID_PARAM);
        }
        let h = acl(s.sim.import_from_shareable_handle(shareable, device))?;
        // SAFETY: checked non-null; valid per the caller's contract.
        unsafe { put(handle, h.0 as *mut c_void) }
    })
}

/// `aclrtMemSetPidToShareableHandle`.
#[no_mangle]
pub unsafe extern "C" fn aclrtMemSetPidToShareableHandle(
    shareable: u64,
    pid: *mut i32,
    pid_num: usize,
) -> c_int {
    run(|s| {
        if pid.is_null() || pid_num == 0 {
            return Err(INVALID_PARAM);
        }
        // SAFETY: non-null, and valid for `pid_num` ids per the caller's contract.
        let pids = unsafe { std::slice::from_raw_parts(pid, pid_num) };
        acl(s.sim.set_pid_to_shareable_handle(shareable, pids))
    })
}

/// `aclrtDeviceGetBareTgid`.
#[no_mangle]
pub unsafe extern "C" fn aclrtDeviceGetBareTgid(pid: *mut i32) -> c_int {
    run(|s| {
        let id = acl(s.sim.device_get_bare_tgid())?;
        // SAFETY: checked by `put`; valid per the caller's contract.
        unsafe { put(pid, id) }
    })
}

// ---- shared buffers (mbuf) ----------------------------------------------------------

fn mbuf(buf: *const c_void) -> Result<MbufHandle, i32> {
    non_null(buf).map(MbufHandle)
}

/// `acltdtAllocBuf` on the current device.
#[no_mangle]
pub unsafe extern "C" fn acltdtAllocBuf(size: usize, ty: u32, buf: *mut *mut c_void) -> c_int {
    run(|s| {
        if buf.is_null() {
            return Err(INVALID_PARAM);
        }
        let b = acl(s.sim.alloc_buf(current_device(), size as u64, ty))?;
        // SAFETY: checked non-null; valid per the caller's contract.
        unsafe { put(buf, b.0 as *mut c_void) }
    })
}

/// `acltdtFreeBuf`.
#[no_mangle]
pub unsafe extern "C" fn acltdtFreeBuf(buf: *mut c_void) -> c_int {
    run(|s| acl(s.sim.free_buf(mbuf(buf)?)))
}

/// `acltdtGetBufData`.
#[no_mangle]
pub unsafe extern "C" fn acltdtGetBufData(
    buf: *const c_void,
    data: *mut *mut c_void,
    size: *mut usize,
) -> c_int {
    run(|s| {
        if data.is_null() || size.is_null() {
            return Err(INVALID_PARAM);
        }
        let (addr, len) = acl(s.sim.buf_data(mbuf(buf)?))?;
        // SAFETY: both checked non-null; valid per the caller's contract.
        unsafe {
            put(data, addr as *mut c_void)?;
            put(size, len as usize)
        }
    })
}

/// `acltdtSetBufDataLen`.
#[no_mangle]
pub unsafe extern "C" fn acltdtSetBufDataLen(buf: *mut c_void, len: usize) -> c_int {
    run(|s| acl(s.sim.set_buf_data_len(mbuf(buf)?, len as u64)))
}

/// `acltdtGetBufDataLen`.
#[no_mangle]
pub unsafe extern "C" fn acltdtGetBufDataLen(buf: *mut c_void, len: *mut usize) -> c_int {
    run(|s| {
        let n = acl(s.sim.buf_data_len(mbuf(buf)?))?;
        // SAFETY: checked by `put`; valid per the caller's contract.
        unsafe { put(len, n as usize) }
    })
}

/// `acltdtSetBufUserData`.
#[no_mangle]
pub unsafe extern "C" fn acltdtSetBufUserData(
    buf: *mut c_void,
    data: *const c_void,
    size: usize,
    offset: usize,
) -> c_int {
    run(|s| {
        let b = mbuf(buf)?;
        if data.is_null() || size > USER_DATA_BYTES {
            return Err(INVALID_PARAM);
        }
        // SAFETY: non-null, and readable for `size` bytes per the caller's contract.
        let bytes = unsafe { std::slice::from_raw_parts(data.cast::<u8>(), size) };
        acl(s.sim.set_buf_user_data(b, bytes, offset as u64))
    })
}

/// `acltdtGetBufUserData`.
#[no_mangle]
pub unsafe extern "C" fn acltdtGetBufUserData(
    buf: *const c_void,
    data: *mut c_void,
    size: usize,
    offset: usize,
) -> c_int {
    run(|s| {
        let b = mbuf(buf)?;
        if data.is_null() || size > USER_DATA_BYTES {
            return Err(INVALID_PARAM);
        }
        // SAFETY: non-null, and writable for `size` bytes per the caller's contract.
        let out = unsafe { std::slice::from_raw_parts_mut(data.cast::<u8>(), size) };
        acl(s.sim.buf_user_data(b, out, offset as u64))
    })
}

/// `acltdtCopyBufRef`.
#[no_mangle]
pub unsafe extern "C" fn acltdtCopyBufRef(buf: *const c_void, new_buf: *mut *mut c_void) -> c_int {
    run(|s| {
        if new_buf.is_null() {
            return Err(INVALID_PARAM);
        }
        let b = acl(s.sim.copy_buf_ref(mbuf(buf)?))?;
        // SAFETY: checked non-null; valid per the caller's contract.
        unsafe { put(new_buf, b.0 as *mut c_void) }
    })
}

// ---- one-sided communication (HCOMM) -------------------------------------------------------

/// An `HcclResult` for a drop-in result: HCCL codes pass through, an AscendCL code (a panic,
/// a simulator that failed to start) is `HCCL_E_INTERNAL`.
fn hccl_code(code: c_int) -> i32 {
    const HCCL_E_INTERNAL: i32 = 4;
    if code >= AclError::INVALID_PARAM.0 {
        HCCL_E_INTERNAL
    } else {
        code
    }
}

/// `HcommWriteOnThread`: an `HcclResult`, checked as [`SimSource`] checks it (see
/// `ascend_pool::source::sim`'s `comm` module): threads, channels and windows come from the
/// `ascendSim*` functions below.
#[no_mangle]
pub unsafe extern "C" fn HcommWriteOnThread(
    thread: u64,
    channel: u64,
    dst: *mut c_void,
    src: *const c_void,
    len: u64,
) -> i32 {
    hccl_code(run(|s| {
        // SAFETY: the simulator checks both ranges against live blocks and the far end's
        // windows before it queues the write.
        acl(unsafe {
            s.sim.write_on_thread(
                CommThreadHandle(thread),
                ChannelHandle(channel),
                dst as usize,
                src as usize,
                len,
            )
        })
    }))
}

/// `HcommChannelNotifyRecordOnThread`: queues on `thread`'s stream the record of notification
/// `remote_notify_idx` of the far end of `channel`. An `HcclResult` (see
/// `SimSource::notify_record_on_thread`).
#[no_mangle]
pub extern "C" fn HcommChannelNotifyRecordOnThread(
    thread: u64,
    channel: u64,
    remote_notify_idx: u32,
) -> i32 {
    hccl_code(run(|s| {
        acl(s.sim.notify_record_on_thread(
            CommThreadHandle(thread),
            ChannelHandle(channel),
            remote_notify_idx,
        ))
    }))
}

/// `HcommChannelNotifyWaitOnThread`: queues on `thread`'s stream a wait for notification
/// `local_notify_idx` of `channel`, for at most `timeout` ms (0: for ever); a wait that
/// times out fails the stream's next `aclrtSynchronizeStream`. An `HcclResult` (see
/// `SimSource::notify_wait_on_thread`).
#[no_mangle]
pub extern "C" fn HcommChannelNotifyWaitOnThread(
    thread: u64,
    channel: u64,
    local_notify_idx: u32,
    timeout: u32,
) -> i32 {
    hccl_code(run(|s| {
        acl(s.sim.notify_wait_on_thread(
            CommThreadHandle(thread),
            ChannelHandle(channel),
            local_notify_idx,
            timeout,
        ))
    }))
}

/// Simulator only (no AscendCL or HCCL function): a communication thread whose writes run on
/// `stream` (null: the current device's default stream), as `HcclThreadAcquireWithStream`
/// gives one. Returns an `HcclResult`.
#[no_mangle]
pub unsafe extern "C" fn ascendSimAcquireThread(stream: *mut c_void, thread: *mut u64) -> i32 {
    hccl_code(run(|s| {
        if thread.is_null() {
            return Err(AclError::HCCL_E_PTR.0);
        }
        let t = acl(s.sim.acquire_comm_thread(s.stream(stream)?))?;
        // SAFETY: checked non-null; valid per the caller's contract.
        unsafe { put(thread, t.0) }
    }))
}

/// Simulator only: a channel from rank (device) `local` to rank `remote`, as
/// `HcclChannelAcquire` opens one. Returns an `HcclResult`.
#[no_mangle]
pub unsafe extern "C" fn ascendSimAcquireChannel(
    local: i32,
    remote: i32,
    channel: *mut u64,
) -> i32 {
    hccl_code(run(|s| {
        if channel.is_null() {
            return Err(AclError::HCCL_E_PTR.0);
        }
        let c = acl(s.sim.acquire_channel(local, remote))?;
        // SAFETY: checked non-null; valid per the caller's contract.
        unsafe { put(channel, c.0) }
    }))
}

/// Simulator only: closes `channel`, as HCCL's channels go with their communicator (see
/// `SimSource::release_channel`): writes and notifications already queued through it still
/// run, and its handle is unknown from then on. Returns an `HcclResult` (`HCCL_E_NOT_FOUND`
/// for a channel not open).
#[no_mangle]
pub extern "C" fn ascendSimReleaseChannel(channel: u64) -> i32 {
    hccl_code(run(|s| acl(s.sim.release_channel(ChannelHandle(channel)))))
}

/// Simulator only: registers `len` bytes at `addr`, device memory of `device`, as a window
/// other ranks may write; start and length must be multiples of 2 MiB. Returns an
/// `HcclResult` (`HCCL_E_PARA` for any refusal).
///
/// # Safety
/// As for HCCL's registration: the caller keeps the memory for the window alone until
/// the window is deregistered (or the memory freed with `aclrtFree`).
#[no_mangle]
pub unsafe extern "C" fn ascendSimRegisterWindow(device: i32, addr: *mut c_void, len: u64) -> i32 {
    hccl_code(run(|s| {
        // SAFETY: the C caller keeps the memory for the window, as this function's
        // contract (HCCL's) asks.
        unsafe { s.sim.register_window(device, addr as usize, len) }
            .map_err(|_| AclError::HCCL_E_PARA.0)
    }))
}

/// Simulator only: deregisters the window registered at `addr`; no write lands in it once
/// this has returned (one still queued fails its stream's task), so the memory may then go
/// to another use. Returns an `HcclResult`
/// (`HCCL_E_PARA` when no window starts at `addr`).
#[no_mangle]
pub extern "C" fn ascendSimDeregisterWindow(addr: *mut c_void) -> i32 {
    hccl_code(run(|s| {
        s.sim
            .deregister_window(addr as usize)
            .map_err(|_| AclError::HCCL_E_PARA.0)
    }))
}
