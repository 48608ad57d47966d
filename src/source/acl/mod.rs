//! [`AclSource`]: the real AscendCL runtime, loaded at run time.
//!
//! Nothing links against CANN: `libascendcl.so` (and `libacl_dvpp.so`, where real CANN keeps
//! the DVPP allocator) is opened with `libloading` when an [`AclSource`] is built, so one
//! binary runs with or without CANN. The library is looked for, in order:
//! 1. the path given to [`AclSource::open`];
//! 2. `$ASCEND_POOL_ACL_LIB` (a file);
//! 3. `$ASCEND_HOME_PATH/lib64/libascendcl.so`, then `$ASCEND_TOOLKIT_HOME/lib64/libascendcl.so`;
//! 4. `libascendcl.so` on the default loader path (`LD_LIBRARY_PATH`, `ld.so.cache`).
//!
//! HCOMM's `HcommWriteOnThread` (one-sided writes) comes from `libhcomm.so` beside it, or the
//! file `$ASCEND_POOL_HCOMM_LIB` names, else from the AscendCL library itself. A file the
//! variable names that cannot be loaded, or that has no `HcommWriteOnThread`, fails the load
//! with [`Error::LibraryLoad`].
//!
//! A variable set to the empty string counts as unset, as the shells' `VAR= cmd` means it.
//!
//! The core symbols (init, devices, `aclrtMalloc`/`aclrtFree`, host memory, copies, fills,
//! `aclrtGetMemInfo`, streams, events) must all be present, or loading fails with
//! [`Error::LibraryLoad`] naming the library and the missing symbols. Everything else
//! (`aclrtMallocAlign32`, `aclrtMallocCached`, DVPP, event queries, virtual memory, shareable
//! handles, mbuf, one-sided writes) is optional: a missing symbol answers
//! [`Error::NotSupported`] when used. Without `aclrtGetDevice` the source trusts the device it
//! set to be current, and without `aclrtGetDeviceCount` (older CANN) it cannot count devices
//! ([`BlockSource::device_count`] is `None`).
//!
//! Every non-zero `aclError` becomes [`Error::Runtime`] with the function name and the raw code.
//! Blocks, streams, events, reserved ranges, mappings, physical handles and mbufs are tracked,
//! so a handle or address this source did not hand out (or already released) is refused before
//! it reaches the runtime, with the code the simulator gives for the same mistake:
//! [`AclError::RT_MEMORY_FREE`] for an unknown or already freed block or the wrong free
//! function, [`AclError::INVALID_PARAM`] for a known address described with another size or
//! device and for an address outside this source's ranges and mappings,
//! [`AclError::RT_INVALID_HANDLE`] for handles.

pub mod sys;

use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::ffi::{c_void, OsString};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use crate::align::CarveRule;
use crate::error::{AclError, Error, Result};
use crate::kind::{MallocPolicy, MemKind};
use crate::source::sim::DVPP_ADDRESS_LIMIT;
use crate::source::{
    Block, BlockSource, ChannelHandle, CommThreadHandle, DeviceId, EventHandle, MemcpyKind,
    StreamHandle,
};

/// Environment variable naming the AscendCL library file to load.
pub const LIB_ENV: &str = "ASCEND_POOL_ACL_LIB";
/// File name of the AscendCL runtime library.
pub const LIBRARY_NAME: &str = "libascendcl.so";
/// File name of the library that holds the DVPP allocator on real CANN.
pub const DVPP_LIBRARY_NAME: &str = "libacl_dvpp.so";
/// File name of the library that holds HCOMM's one-sided writes (`HcommWriteOnThread`).
pub const HCOMM_LIBRARY_NAME: &str = "libhcomm.so";
/// Environment variable naming the HCOMM library file to load instead of the one beside the
/// AscendCL library.
pub const HCOMM_LIB_ENV: &str = "ASCEND_POOL_HCOMM_LIB";

/// Symbols every AscendCL library must export for an [`AclSource`] to load.
pub const REQUIRED_SYMBOLS: &[&str] = &[
    "aclInit",
    "aclFinalize",
    "aclrtSetDevice",
    "aclrtResetDevice",
    "aclrtMalloc",
    "aclrtFree",
    "aclrtMallocHost",
    "aclrtFreeHost",
    "aclrtMemcpy",
    "aclrtMemcpyAsync",
    "aclrtMemset",
    "aclrtMemsetAsync",
    "aclrtGetMemInfo",
    "aclrtCreateStream",
    "aclrtDestroyStream",
    "aclrtSynchronizeStream",
    "aclrtCreateEvent",
    "aclrtDestroyEvent",
    "aclrtRecordEvent",
    "aclrtSynchronizeEvent",
    "aclrtStreamWaitEvent",
];

/// The resolved function pointer `$api.$func`, or `NotSupported` when the library lacks it.
macro_rules! sym {
    ($api:expr, $func:ident) => {
        match &$api.$func {
            Ok(f) => *f,
            Err(_) => {
                return Err(Error::NotSupported {
                    func: stringify!($func),
                })
            }
        }
    };
}

/// Whether `$api` resolved each listed symbol, as `(name, present)` pairs.
macro_rules! presence {
    ($api:expr; $($func:ident),* $(,)?) => {
        [$((stringify!($func), $api.$func.is_ok())),*]
    };
}

/// `Ok(())` for `ACL_SUCCESS`, [`Error::Runtime`] with the raw code otherwise.
fn check(func: &'static str, code: sys::aclError) -> Result<()> {
    AclError::check(code).map_err(|code| Error::Runtime { func, code })
}

/// The error for a call refused before the runtime: a handle or address this source does not
/// hold, or a value that does not fit the C type the runtime takes.
fn refused(func: &'static str, code: AclError) -> Error {
    Error::Runtime { func, code }
}

fn to_usize(func: &'static str, v: u64) -> Result<usize> {
    usize::try_from(v).map_err(|_| refused(func, AclError::INVALID_PARAM))
}

/// A process-unique id per [`AclSource`], for the per-thread current-device cache.
static NEXT_SOURCE_ID: AtomicU64 = AtomicU64::new(1);

thread_local! {
    /// Per loaded runtime (keyed by the address of its `aclrtSetDevice`), the source that last
    /// set this thread's device and the device it set.
    static CURRENT_DEVICE: RefCell<HashMap<usize, (u64, DeviceId)>> = RefCell::new(HashMap::new());
}

/// Which runtime call frees a block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Freer {
    AclrtFree,
    AclrtFreeHost,
    AcldvppFree,
    HiMpiDvppFree,
}

/// What the source knows about one of its events.
#[derive(Debug, Clone, Copy)]
struct EventState {
    device: DeviceId,
    /// Whether the event was ever recorded (an unrecorded event counts as complete).
    recorded: bool,
}

/// Everything the source has handed out and not yet taken back.
#[derive(Debug, Default)]
struct Live {
    /// Live blocks by start address.
    blocks: BTreeMap<usize, (Block, Freer)>,
    /// Streams and the device each was created on.
    streams: HashMap<usize, DeviceId>,
    /// Events and their state.
    events: HashMap<usize, EventState>,
    /// Reserved virtual ranges: start -> size, and the device they were reserved for (whose
    /// memory is mapped there, and whose context copies of it run in).
    reserved: BTreeMap<usize, (usize, DeviceId)>,
    /// Mappings made by `map`: start -> physical handle. Each start lies in a range of
    /// `reserved`; unmapped before the physical memory is freed when the source drops.
    mappings: BTreeMap<usize, PhysicalHandle>,
    /// Physical allocations (from `aclrtMallocPhysical` or an import).
    physical: HashSet<usize>,
    /// Shared buffers (mbuf), each with what is known of its buffer, shared by every handle
    /// on it (`acltdtCopyBufRef`): the memory goes back with the last of them.
    mbufs: HashMap<usize, Arc<BufInfo>>,
    /// `aclrtSetDevice` calls made per device, undone by as many `aclrtResetDevice` on drop.
    set_device_calls: BTreeMap<DeviceId, u64>,
}

/// What a source knows of the buffer behind one or more of its mbuf handles.
#[derive(Debug)]
struct BufInfo {
    /// The device it was allocated on.
    device: DeviceId,
    /// Bytes it takes of the process's DVPP address space: DVPP memory as the runtime rounds
    /// it, 0 for device memory.
    dvpp_bytes: u64,
    /// Its data area (start, bytes), device memory of `device`, as `acltdtGetBufData` gave it
    /// (`None` from a runtime without the call or when the call failed).
    data: Option<(usize, usize)>,
}

impl Live {
    /// The device of the live shared buffer whose data area holds `addr`.
    fn buffer_device(&self, addr: usize) -> Option<DeviceId> {
        self.mbufs
            .values()
            .find(|b| {
                b.data
                    .is_some_and(|(start, len)| addr >= start && addr - start < len.max(1))
            })
            .map(|b| b.device)
    }

    /// The live block whose range holds `addr`.
    fn block_containing(&self, addr: usize) -> Option<&Block> {
        let (_, (block, _)) = self.blocks.range(..=addr).next_back()?;
        (addr - block.addr < usize::try_from(block.size).unwrap_or(usize::MAX).max(1))
            .then_some(block)
    }

    /// The device of the reserved range that holds `addr`.
    fn reserved_device(&self, addr: usize) -> Option<DeviceId> {
        let (start, (len, device)) = self.reserved.range(..=addr).next_back()?;
        (addr - start < *len).then_some(*device)
    }
}

pub use crate::source::vmm::PhysicalHandle;

/// A shared buffer (`acltdtBuf`) held by an [`AclSource`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct MbufHandle(usize);

/// A [`BlockSource`] over the real AscendCL runtime, loaded at run time.
///
/// ```no_run
/// use ascend_pool::source::{AclSource, BlockSource};
/// use ascend_pool::MemKind;
///
/// let acl = AclSource::load()?; // $ASCEND_POOL_ACL_LIB, $ASCEND_HOME_PATH/lib64, or ld.so
/// let block = acl.alloc_block(0, MemKind::DEVICE, 2 << 20)?;
/// acl.free_block(block)?;
/// # Ok::<(), ascend_pool::Error>(())
/// ```
pub struct AclSource {
    /// `"acl:<path>"`.
    name: String,
    /// The library file (or loader name) that was opened.
    library: String,
    /// Functions of `libascendcl.so`.
    api: sys::AclApi,
    /// Functions of `libacl_dvpp.so`, when it was found; DVPP calls try it first.
    dvpp: Option<(String, sys::AclApi)>,
    /// Functions of `libhcomm.so`, when it was found; one-sided writes try it first.
    hcomm: Option<(String, sys::AclApi)>,
    /// Process-unique id of this source.
    id: u64,
    /// Key of the loaded runtime in [`CURRENT_DEVICE`].
    runtime_key: usize,
    /// What is live; never held across a runtime call that can block.
    live: Mutex<Live>,
    /// The fork generation the library was loaded in: in a child made by `fork`, every call
    /// is refused and nothing is freed on drop ([`crate::fork`]).
    forks: u64,
}

impl std::fmt::Debug for AclSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut d = f.debug_struct("AclSource");
        d.field("library", &self.library)
            .field("dvpp_library", &self.dvpp.as_ref().map(|(p, _)| p))
            .field("hcomm_library", &self.hcomm.as_ref().map(|(p, _)| p));
        if crate::fork::ours(self.forks) {
            let live = self.lock();
            d.field("live_blocks", &live.blocks.len())
                .field("streams", &live.streams.len())
                .field("events", &live.events.len());
        } else {
            // A parent's: its lock may be held by a thread this process does not have.
            d.field("forked", &true);
        }
        d.finish_non_exhaustive()
    }
}

/// The variable `var`, unless unset or empty: an empty `ASCEND_POOL_ACL_LIB` was opened as the
/// path "" (a load error naming no file), and an empty home as `lib64/` under the current
/// directory.
fn env_path(var: &str) -> Option<std::ffi::OsString> {
    std::env::var_os(var).filter(|v| !v.is_empty())
}

impl AclSource {
    /// Loads the AscendCL library from the first place that has one (see the module docs):
    /// `$ASCEND_POOL_ACL_LIB`, `$ASCEND_HOME_PATH/lib64`, `$ASCEND_TOOLKIT_HOME/lib64`,
    /// then `libascendcl.so` on the default loader path.
    ///
    /// Fails with [`Error::LibraryLoad`] listing every place tried when none loads.
    pub fn load() -> Result<Self> {
        if let Some(path) = env_path(LIB_ENV) {
            return Self::open(path);
        }
        let mut tried = Vec::new();
        for var in ["ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME"] {
            if let Some(home) = env_path(var) {
                let path = Path::new(&home).join("lib64").join(LIBRARY_NAME);
                if path.is_file() {
                    return Self::open(path);
                }
                tried.push(path.display().to_string());
            }
        }
        Self::open(LIBRARY_NAME).map_err(|e| match e {
            Error::LibraryLoad { library, reason } if !tried.is_empty() => Error::LibraryLoad {
                library,
                reason: format!("{reason} (also looked for {})", tried.join(", ")),
            },
            other => other,
        })
    }

    /// Loads the AscendCL library at `path` (a file path, or a bare name the loader searches),
    /// checks its core symbols and calls `aclInit(NULL)`.
    ///
    /// DVPP symbols come from `libacl_dvpp.so` beside `path` (or on the loader path when `path`
    /// is a bare name) when there is one, else from the library itself.
    ///
    /// # Errors
    /// [`Error::LibraryLoad`] when the file cannot be loaded or lacks a core symbol (the reason
    /// names them); [`Error::Runtime`] when `aclInit` fails with anything but
    /// `ACL_ERROR_REPEAT_INITIALIZE` (100002).
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let library = path.display().to_string();
        let api = open_api(path).map_err(|reason| Error::LibraryLoad {
            library: library.clone(),
            reason,
        })?;
        let missing: Vec<&str> = core_presence(&api)
            .iter()
            .filter(|(_, present)| !present)
            .map(|(name, _)| *name)
            .collect();
        if !missing.is_empty() {
            return Err(Error::LibraryLoad {
                library,
                reason: format!("missing required symbol(s): {}", missing.join(", ")),
            });
        }

        let dvpp_path = dvpp_path_beside(path);
        let dvpp = (dvpp_path.as_path() != path)
            .then(|| open_api(&dvpp_path).ok())
            .flatten()
            .map(|api| (dvpp_path.display().to_string(), api));
        // A library the caller named must load: falling back to the runtime's own
        // `HcommWriteOnThread` would send one-sided writes somewhere they did not ask for.
        let named = env_path(HCOMM_LIB_ENV).map(PathBuf::from);
        let hcomm_path = named
            .clone()
            .unwrap_or_else(|| beside(path, HCOMM_LIBRARY_NAME));
        let hcomm = if hcomm_path.as_path() == path {
            None
        } else {
            // A named one must also have the one function taken from it: one without it
            // would be reported as HCOMM's while the writes went to the runtime's own.
            let opened = open_api(&hcomm_path).and_then(|api| match api.HcommWriteOnThread {
                Err(_) if named.is_some() => Err("it has no HcommWriteOnThread".to_string()),
                _ => Ok(api),
            });
            match opened {
                Ok(api) => Some((hcomm_path.display().to_string(), api)),
                Err(reason) if named.is_some() => {
                    return Err(Error::LibraryLoad {
                        library: hcomm_path.display().to_string(),
                        reason: format!("${HCOMM_LIB_ENV} names it: {reason}"),
                    });
                }
                Err(_) => None,
            }
        };

        let aclinit = sym!(api, aclInit);
        // SAFETY: `aclInit` takes an optional config path; NULL means "no config file".
        let code = unsafe { aclinit(std::ptr::null()) };
        if code != sys::ACL_ERROR_REPEAT_INITIALIZE {
            check("aclInit", code)?;
        }
        let runtime_key = sym!(api, aclrtSetDevice) as usize;
        Ok(Self {
            name: format!("acl:{library}"),
            library,
            api,
            dvpp,
            hcomm,
            id: NEXT_SOURCE_ID.fetch_add(1, Ordering::Relaxed),
            runtime_key,
            live: Mutex::new(Live::default()),
            forks: crate::fork::generation(),
        })
    }

    /// The library file (or loader name) this source loaded.
    pub fn library(&self) -> &str {
        &self.library
    }

    /// The DVPP library loaded beside it, if any (otherwise DVPP symbols come from
    /// [`AclSource::library`]).
    pub fn dvpp_library(&self) -> Option<&str> {
        self.dvpp.as_ref().map(|(p, _)| p.as_str())
    }

    /// The HCOMM library loaded beside it (or from `$ASCEND_POOL_HCOMM_LIB`), if any
    /// (otherwise `HcommWriteOnThread` comes from [`AclSource::library`], if it has one).
    pub fn hcomm_library(&self) -> Option<&str> {
        self.hcomm.as_ref().map(|(p, _)| p.as_str())
    }

    /// Whether the loaded runtime exports `func` (one of the functions in
    /// `include/ascend_pool_acl.h`); DVPP and HCOMM functions count when any of the loaded
    /// libraries has them.
    pub fn supports(&self, func: &str) -> bool {
        self.dvpp
            .iter()
            .chain(self.hcomm.iter())
            .map(|(_, api)| api)
            .chain(std::iter::once(&self.api))
            .any(|api| all_presence(api).iter().any(|(n, p)| *n == func && *p))
    }

    /// Calls `aclFinalize`. Only for a process that is done with AscendCL altogether: the
    /// runtime is process-wide, so every other user of it stops working too.
    pub fn finalize(&self) -> Result<()> {
        let f = sym!(self.api()?, aclFinalize);
        // SAFETY: `aclFinalize` takes no arguments.
        check("aclFinalize", unsafe { f() })
    }

    /// The library's functions; refused in a child made by `fork`, which has none of the
    /// parent's device context.
    fn api(&self) -> Result<&sys::AclApi> {
        crate::fork::check(self.forks)?;
        Ok(&self.api)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Live> {
        // A panic while the lock was held cannot leave `Live` half-updated (every update is a
        // single insert or remove), so a poisoned lock is still usable.
        self.live.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Makes `device` current on the calling thread (`aclrtSetDevice`) unless this source
    /// already made it current there and it still is.
    pub fn use_device(&self, device: DeviceId) -> Result<()> {
        let api = self.api()?;
        let key = self.runtime_key;
        // `try_with`: a source dropped by a thread-local destructor may outlive this thread's
        // cache, and a panic there aborts the process; without the cache the device is set.
        let current = CURRENT_DEVICE
            .try_with(|c| c.borrow().get(&key).copied())
            .ok()
            .flatten();
        if current == Some((self.id, device)) && self.still_current(api, device) {
            return Ok(());
        }
        let f = sym!(api, aclrtSetDevice);
        // SAFETY: `aclrtSetDevice` takes a plain device id; a bad id is answered with a code.
        check("aclrtSetDevice", unsafe { f(device) })?;
        *self.lock().set_device_calls.entry(device).or_insert(0) += 1;
        let _ = CURRENT_DEVICE.try_with(|c| c.borrow_mut().insert(key, (self.id, device)));
        Ok(())
    }

    /// Whether `device` is still the thread's current device, as `aclrtGetDevice` says: the
    /// application (or another library) may have set another on this thread since, and a
    /// block allocated then would land on that device. A runtime without the call is
    /// trusted to be as this source left it.
    fn still_current(&self, api: &sys::AclApi, device: DeviceId) -> bool {
        let Ok(get) = &api.aclrtGetDevice else {
            return true;
        };
        let mut now = -1;
        // SAFETY: `now` is a live `i32` the call may write.
        (unsafe { get(&mut now) }) == 0 && now == device
    }

    /// The device whose context a copy or fill touching `addrs` should run in: the device of
    /// the first device memory among them (a live device block, a reserved range with memory
    /// mapped there, or the data area of a live shared buffer), else of the first pinned host
    /// block (allocated with a device current: a copy between it and another device's memory
    /// runs on that other device), else the lowest device used so far, else 0.
    fn device_for(&self, addrs: &[usize]) -> DeviceId {
        let live = self.lock();
        let mut host = None;
        for &a in addrs {
            match live.block_containing(a) {
                Some(b) if b.kind.is_device() => return b.device,
                Some(b) => host = host.or(Some(b.device)),
                None => {
                    if let Some(device) = live.reserved_device(a).or_else(|| live.buffer_device(a))
                    {
                        return device;
                    }
                }
            }
        }
        host.or_else(|| live.set_device_calls.keys().next().copied())
            .unwrap_or(0)
    }

    fn stream_device(&self, func: &'static str, stream: StreamHandle) -> Result<DeviceId> {
        // In a child made by `fork`, before the lock: a parent's thread may have held it.
        crate::fork::check(self.forks)?;
        self.lock()
            .streams
            .get(&stream.0)
            .copied()
            .ok_or(refused(func, AclError::RT_INVALID_HANDLE))
    }

    fn event_state(&self, func: &'static str, event: EventHandle) -> Result<EventState> {
        // As in `stream_device`.
        crate::fork::check(self.forks)?;
        self.lock()
            .events
            .get(&event.0)
            .copied()
            .ok_or(refused(func, AclError::RT_INVALID_HANDLE))
    }

    /// Free and total bytes of the raw `aclrtMemAttr` class `attr` on `device`.
    pub fn mem_info_attr(&self, device: DeviceId, attr: u32) -> Result<(u64, u64)> {
        self.use_device(device)?;
        let f = sym!(self.api()?, aclrtGetMemInfo);
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: both out-pointers point at live locals.
        check("aclrtGetMemInfo", unsafe { f(attr, &mut free, &mut total) })?;
        Ok((free as u64, total as u64))
    }

    /// Runs the allocation call for `kind`, returning the address and how to free it.
    fn raw_alloc(&self, device: DeviceId, kind: MemKind, size: usize) -> Result<(usize, Freer)> {
        let mut ptr: *mut c_void = std::ptr::null_mut();
        let (func, code, freer) = match kind {
            MemKind::Device(p) => {
                let f = sym!(self.api()?, aclrtMalloc);
                // SAFETY: `ptr` is a live out-pointer; size and policy are plain values.
                let code = unsafe { f(&mut ptr, size, p.raw()) };
                ("aclrtMalloc", code, Freer::AclrtFree)
            }
            MemKind::DeviceAlign32(p) => {
                let f = sym!(self.api()?, aclrtMallocAlign32);
                // SAFETY: as for `aclrtMalloc`.
                let code = unsafe { f(&mut ptr, size, p.raw()) };
                ("aclrtMallocAlign32", code, Freer::AclrtFree)
            }
            MemKind::Cached(p) => {
                let f = sym!(self.api()?, aclrtMallocCached);
                // SAFETY: as for `aclrtMalloc`.
                let code = unsafe { f(&mut ptr, size, p.raw()) };
                ("aclrtMallocCached", code, Freer::AclrtFree)
            }
            MemKind::Host => {
                let f = sym!(self.api()?, aclrtMallocHost);
                // SAFETY: `ptr` is a live out-pointer.
                let code = unsafe { f(&mut ptr, size) };
                ("aclrtMallocHost", code, Freer::AclrtFreeHost)
            }
            MemKind::Dvpp => {
                if let Ok(f) = self.dvpp_fn(|a| &a.acldvppMalloc, |a| &a.acldvppFree) {
                    // SAFETY: `ptr` is a live out-pointer.
                    let code = unsafe { f(&mut ptr, size) };
                    ("acldvppMalloc", code, Freer::AcldvppFree)
                } else {
                    let f = self
                        .dvpp_fn(|a| &a.hi_mpi_dvpp_malloc, |a| &a.hi_mpi_dvpp_free)
                        .map_err(|_| Error::NotSupported {
                            func: "acldvppMalloc",
                        })?;
                    let dev = u32::try_from(device)
                        .map_err(|_| refused("hi_mpi_dvpp_malloc", AclError::INVALID_PARAM))?;
                    // SAFETY: `ptr` is a live out-pointer.
                    let code = unsafe { f(dev, &mut ptr, size as u64) };
                    ("hi_mpi_dvpp_malloc", code, Freer::HiMpiDvppFree)
                }
            }
        };
        check(func, code)?;
        if ptr.is_null() {
            return Err(Error::Invalid(format!(
                "{func} returned success and a null pointer"
            )));
        }
        Ok((ptr as usize, freer))
    }

    /// A DVPP allocator from `libacl_dvpp.so`, else from the main library, provided its
    /// matching free function is there too.
    fn dvpp_fn<A: Copy, F>(
        &self,
        alloc: impl Fn(&sys::AclApi) -> &std::result::Result<A, libloading::Error>,
        free: impl Fn(&sys::AclApi) -> &std::result::Result<F, libloading::Error>,
    ) -> std::result::Result<A, ()> {
        self.dvpp
            .iter()
            .map(|(_, api)| api)
            .chain(std::iter::once(&self.api))
            .find_map(|api| match (alloc(api), free(api)) {
                (Ok(a), Ok(_)) => Some(*a),
                _ => None,
            })
            .ok_or(())
    }

    /// Runs the free call matching `freer`.
    fn raw_free(&self, addr: usize, freer: Freer) -> Result<()> {
        let ptr = addr as *mut c_void;
        let (func, code) = match freer {
            Freer::AclrtFree => {
                let f = sym!(self.api()?, aclrtFree);
                // SAFETY: `ptr` came from the matching allocation call and was live in `Live`.
                ("aclrtFree", unsafe { f(ptr) })
            }
            Freer::AclrtFreeHost => {
                let f = sym!(self.api()?, aclrtFreeHost);
                // SAFETY: as above, from `aclrtMallocHost`.
                ("aclrtFreeHost", unsafe { f(ptr) })
            }
            Freer::AcldvppFree => {
                let f = self
                    .dvpp_fn(|a| &a.acldvppFree, |a| &a.acldvppMalloc)
                    .map_err(|_| Error::NotSupported {
                        func: "acldvppFree",
                    })?;
                // SAFETY: as above, from `acldvppMalloc` of the same library.
                ("acldvppFree", unsafe { f(ptr) })
            }
            Freer::HiMpiDvppFree => {
                let f = self
                    .dvpp_fn(|a| &a.hi_mpi_dvpp_free, |a| &a.hi_mpi_dvpp_malloc)
                    .map_err(|_| Error::NotSupported {
                        func: "hi_mpi_dvpp_free",
                    })?;
                // SAFETY: as above, from `hi_mpi_dvpp_malloc` of the same library.
                ("hi_mpi_dvpp_free", unsafe { f(ptr) })
            }
        };
        check(func, code)
    }
}

/// Where the DVPP library would be beside the runtime at `path`.
fn dvpp_path_beside(path: &Path) -> PathBuf {
    beside(path, DVPP_LIBRARY_NAME)
}

/// Where library `name` would be beside the runtime at `path`: in the same directory, or a
/// bare name for the loader to search when `path` is one (its parent is then "").
fn beside(path: &Path, name: &str) -> PathBuf {
    path.parent().unwrap_or(Path::new("")).join(name)
}

/// Opens `path` and resolves every symbol of `include/ascend_pool_acl.h` it has.
fn open_api(path: &Path) -> std::result::Result<sys::AclApi, String> {
    // A bare name goes to the loader's search; anything with a '/' is a file.
    let name: OsString = path.as_os_str().to_owned();
    // Never unloaded (RTLD_NODELETE): the runtime runs threads of its own and registers
    // thread-local destructors in every thread that calls it, which would run code unmapped
    // by a `dlclose` (the simulator's drop-in crashed a test process one run in three so).
    let flags =
        libloading::os::unix::RTLD_LAZY | libloading::os::unix::RTLD_LOCAL | libc::RTLD_NODELETE;
    // SAFETY: loading a shared library runs its initialisers; AscendCL's (and the simulator's)
    // have no preconditions on the caller. `from_library` only resolves symbols.
    unsafe {
        let lib =
            libloading::os::unix::Library::open(Some(&name), flags).map_err(|e| e.to_string())?;
        sys::AclApi::from_library(libloading::Library::from(lib)).map_err(|e| e.to_string())
    }
}

/// Presence of each of [`REQUIRED_SYMBOLS`] in `api` (same order).
fn core_presence(api: &sys::AclApi) -> [(&'static str, bool); 21] {
    presence!(api;
        aclInit, aclFinalize, aclrtSetDevice, aclrtResetDevice, aclrtMalloc, aclrtFree,
        aclrtMallocHost, aclrtFreeHost, aclrtMemcpy, aclrtMemcpyAsync, aclrtMemset,
        aclrtMemsetAsync, aclrtGetMemInfo, aclrtCreateStream, aclrtDestroyStream,
        aclrtSynchronizeStream, aclrtCreateEvent, aclrtDestroyEvent, aclrtRecordEvent,
        aclrtSynchronizeEvent, aclrtStreamWaitEvent,
    )
}

/// Presence of every function of `include/ascend_pool_acl.h` in `api`.
fn all_presence(api: &sys::AclApi) -> Vec<(&'static str, bool)> {
    let mut v = core_presence(api).to_vec();
    v.extend(presence!(api;
        aclrtGetDevice, aclrtGetDeviceCount, aclrtMallocAlign32, aclrtMallocCached, acldvppMalloc, acldvppFree, hi_mpi_dvpp_malloc,
        hi_mpi_dvpp_free, aclrtQueryEvent, aclrtQueryEventStatus,
        aclrtMemGetAllocationGranularity, aclrtReserveMemAddress, aclrtReleaseMemAddress,
        aclrtMallocPhysical, aclrtFreePhysical, aclrtMapMem, aclrtUnmapMem,
        aclrtMemExportToShareableHandle, aclrtMemImportFromShareableHandle,
        aclrtMemSetPidToShareableHandle, aclrtDeviceGetBareTgid, acltdtAllocBuf, acltdtFreeBuf,
        acltdtGetBufData, acltdtSetBufDataLen, acltdtGetBufDataLen, acltdtSetBufUserData,
        acltdtGetBufUserData, acltdtCopyBufRef, HcommWriteOnThread,
    ));
    v
}

/// The function that frees a block of `kind` (DVPP blocks from `hi_mpi_dvpp_malloc` count
/// as `acldvppFree`).
fn free_func(kind: MemKind) -> &'static str {
    match kind {
        MemKind::Host => "aclrtFreeHost",
        MemKind::Dvpp => "acldvppFree",
        MemKind::Device(_) | MemKind::DeviceAlign32(_) | MemKind::Cached(_) => "aclrtFree",
    }
}

/// The `aclrtMemAttr` class `aclrtGetMemInfo` reports for a device kind.
fn mem_attr(kind: MemKind) -> u32 {
    use MallocPolicy as P;
    match kind.policy() {
        Some(P::HugeOnly) => sys::ACL_HBM_MEM_HUGE,
        Some(P::NormalOnly) => sys::ACL_HBM_MEM_NORMAL,
        Some(P::HugeOnlyP2p) => sys::ACL_HBM_MEM_P2P_HUGE,
        Some(P::NormalOnlyP2p) => sys::ACL_HBM_MEM_P2P_NORMAL,
        Some(P::Huge1gOnly) => sys::ACL_HBM_MEM_HUGE1G,
        Some(P::Huge1gOnlyP2p) => sys::ACL_HBM_MEM_P2P_HUGE1G,
        Some(P::HugeFirst | P::HugeFirstP2p) | None => sys::ACL_HBM_MEM,
    }
}

/// Free and total host RAM, for [`MemKind::Host`] (AscendCL has no query for host memory).
fn host_mem_info() -> Result<(u64, u64)> {
    // SAFETY: `sysinfo` is plain old data; all-zero is a valid value.
    let mut info: libc::sysinfo = unsafe { std::mem::zeroed() };
    // SAFETY: `info` is a live, writable `struct sysinfo`.
    if unsafe { libc::sysinfo(&mut info) } != 0 {
        return Err(Error::NotSupported { func: "sysinfo" });
    }
    let unit = u64::from(info.mem_unit.max(1));
    Ok((
        (info.freeram as u64).saturating_mul(unit),
        (info.totalram as u64).saturating_mul(unit),
    ))
}

impl BlockSource for AclSource {
    fn name(&self) -> &str {
        &self.name
    }

    fn alloc_block(&self, device: DeviceId, kind: MemKind, size: u64) -> Result<Block> {
        let func = match kind {
            MemKind::Device(_) => "aclrtMalloc",
            MemKind::DeviceAlign32(_) => "aclrtMallocAlign32",
            MemKind::Cached(_) => "aclrtMallocCached",
            MemKind::Dvpp => "acldvppMalloc",
            MemKind::Host => "aclrtMallocHost",
        };
        let len = to_usize(func, size)?;
        self.use_device(device)?;
        let (addr, freer) = self.raw_alloc(device, kind, len)?;
        let block = Block {
            addr,
            size,
            kind,
            device,
        };
        self.lock().blocks.insert(addr, (block, freer));
        Ok(block)
    }

    fn free_block(&self, block: Block) -> Result<()> {
        let func = free_func(block.kind);
        // In a child made by `fork`, before the lock (see `stream_device`).
        crate::fork::check(self.forks)?;
        let freer = {
            let mut live = self.lock();
            match live.blocks.get(&block.addr) {
                Some((b, freer)) if *b == block => {
                    let freer = *freer;
                    live.blocks.remove(&block.addr);
                    freer
                }
                // Ours, but freed with the wrong function: what the runtime says to that.
                Some((b, _)) if func != free_func(b.kind) => {
                    return Err(refused(func, AclError::RT_MEMORY_FREE))
                }
                // Ours and the right function, but described differently.
                Some(_) => return Err(refused(func, AclError::INVALID_PARAM)),
                None => return Err(refused(func, AclError::RT_MEMORY_FREE)),
            }
        };
        let result = self
            .use_device(block.device)
            .and_then(|()| self.raw_free(block.addr, freer));
        if result.is_err() {
            // The runtime kept the memory: keep tracking it so the caller can retry.
            self.lock().blocks.insert(block.addr, (block, freer));
        }
        result
    }

    /// DVPP memory is device memory within the DVPP address space one process gets
    /// ([`DVPP_ADDRESS_LIMIT`]), which `aclrtGetMemInfo` has no class for: the device's
    /// figures, capped by that space less what this source's DVPP blocks and shared buffers of
    /// DVPP memory take of it (as the runtime rounds them; other users of the process's space
    /// are not seen). Host memory is the machine's RAM (`sysinfo`), once `device` is made
    /// current: a device the runtime lacks is refused, as `aclrtMallocHost` is for it.
    fn mem_info(&self, device: DeviceId, kind: MemKind) -> Result<(u64, u64)> {
        if kind == MemKind::Host {
            // Pinned host memory is taken in the context `aclrtSetDevice` makes: a device the
            // runtime lacks gets none, and its query is refused as its allocation is.
            self.use_device(device)?;
            return host_mem_info();
        }
        let (free, total) = self.mem_info_attr(device, mem_attr(kind))?;
        if kind != MemKind::Dvpp {
            return Ok((free, total));
        }
        let rule = CarveRule::default();
        let live = self.lock();
        let blocks: u64 = live
            .blocks
            .values()
            .filter(|(b, _)| b.kind == MemKind::Dvpp)
            .map(|(b, _)| rule.runtime_rounded(b.size).unwrap_or(b.size))
            .sum();
        // Shared buffers of DVPP memory too, each buffer once whatever its handles.
        let mut seen = HashSet::new();
        let buffers: u64 = live
            .mbufs
            .values()
            .filter(|b| seen.insert(Arc::as_ptr(b)))
            .map(|b| b.dvpp_bytes)
            .sum();
        drop(live);
        let held = blocks.saturating_add(buffers);
        Ok((
            free.min(DVPP_ADDRESS_LIMIT.saturating_sub(held)),
            total.min(DVPP_ADDRESS_LIMIT),
        ))
    }

    /// `aclrtGetDeviceCount`'s answer; `None` from a runtime without it (older CANN) or
    /// when it fails, so that such a runtime still serves pools (it refuses a device it
    /// lacks call by call instead).
    fn device_count(&self) -> Option<u32> {
        let api = self.api().ok()?;
        let f = api.aclrtGetDeviceCount.as_ref().ok()?;
        let mut n = 0u32;
        // SAFETY: `n` is a live `u32` the call may write.
        (unsafe { f(&mut n) } == 0).then_some(n)
    }

    fn create_stream(&self, device: DeviceId) -> Result<StreamHandle> {
        self.use_device(device)?;
        let f = sym!(self.api()?, aclrtCreateStream);
        let mut stream: sys::aclrtStream = std::ptr::null_mut();
        // SAFETY: `stream` is a live out-pointer.
        check("aclrtCreateStream", unsafe { f(&mut stream) })?;
        if stream.is_null() {
            return Err(Error::Invalid(
                "aclrtCreateStream returned success and a null stream".into(),
            ));
        }
        self.lock().streams.insert(stream as usize, device);
        Ok(StreamHandle(stream as usize))
    }

    fn destroy_stream(&self, stream: StreamHandle) -> Result<()> {
        let device = self.stream_device("aclrtDestroyStream", stream)?;
        self.use_device(device)?;
        self.synchronize_stream(stream)?;
        if self.lock().streams.remove(&stream.0).is_none() {
            // Another thread destroyed it meanwhile.
            return Err(refused("aclrtDestroyStream", AclError::RT_INVALID_HANDLE));
        }
        let f = sym!(self.api()?, aclrtDestroyStream);
        // SAFETY: `stream` was created by this runtime and is no longer tracked as live.
        let result = check("aclrtDestroyStream", unsafe {
            f(stream.0 as sys::aclrtStream)
        });
        if result.is_err() {
            self.lock().streams.insert(stream.0, device);
        }
        result
    }

    fn synchronize_stream(&self, stream: StreamHandle) -> Result<()> {
        let device = self.stream_device("aclrtSynchronizeStream", stream)?;
        self.use_device(device)?;
        let f = sym!(self.api()?, aclrtSynchronizeStream);
        // SAFETY: `stream` is a live stream of this runtime.
        check("aclrtSynchronizeStream", unsafe {
            f(stream.0 as sys::aclrtStream)
        })
    }

    fn create_event(&self, device: DeviceId) -> Result<EventHandle> {
        self.use_device(device)?;
        let f = sym!(self.api()?, aclrtCreateEvent);
        let mut event: sys::aclrtEvent = std::ptr::null_mut();
        // SAFETY: `event` is a live out-pointer.
        check("aclrtCreateEvent", unsafe { f(&mut event) })?;
        if event.is_null() {
            return Err(Error::Invalid(
                "aclrtCreateEvent returned success and a null event".into(),
            ));
        }
        self.lock().events.insert(
            event as usize,
            EventState {
                device,
                recorded: false,
            },
        );
        Ok(EventHandle(event as usize))
    }

    fn destroy_event(&self, event: EventHandle) -> Result<()> {
        // In a child made by `fork`, before the lock (see `stream_device`).
        crate::fork::check(self.forks)?;
        let state = self
            .lock()
            .events
            .remove(&event.0)
            .ok_or(refused("aclrtDestroyEvent", AclError::RT_INVALID_HANDLE))?;
        let result = self.use_device(state.device).and_then(|()| {
            let f = sym!(self.api()?, aclrtDestroyEvent);
            // SAFETY: `event` was created by this runtime and is no longer tracked as live.
            check("aclrtDestroyEvent", unsafe {
                f(event.0 as sys::aclrtEvent)
            })
        });
        if result.is_err() {
            self.lock().events.insert(event.0, state);
        }
        result
    }

    fn record_event(&self, event: EventHandle, stream: StreamHandle) -> Result<()> {
        self.event_state("aclrtRecordEvent", event)?;
        let device = self.stream_device("aclrtRecordEvent", stream)?;
        self.use_device(device)?;
        let f = sym!(self.api()?, aclrtRecordEvent);
        // SAFETY: both handles are live objects of this runtime.
        check("aclrtRecordEvent", unsafe {
            f(event.0 as sys::aclrtEvent, stream.0 as sys::aclrtStream)
        })?;
        if let Some(s) = self.lock().events.get_mut(&event.0) {
            s.recorded = true;
        }
        Ok(())
    }

    fn query_event(&self, event: EventHandle) -> Result<bool> {
        let state = self.event_state("aclrtQueryEventStatus", event)?;
        if !state.recorded {
            return Ok(true);
        }
        self.use_device(state.device)?;
        let handle = event.0 as sys::aclrtEvent;
        if let Ok(f) = &self.api()?.aclrtQueryEventStatus {
            let mut status = sys::ACL_EVENT_RECORDED_STATUS_NOT_READY;
            // SAFETY: `handle` is a live event, `status` a live out-pointer.
            check("aclrtQueryEventStatus", unsafe { f(handle, &mut status) })?;
            return Ok(status == sys::ACL_EVENT_RECORDED_STATUS_COMPLETE);
        }
        let f = sym!(self.api()?, aclrtQueryEvent);
        let mut status = sys::ACL_EVENT_STATUS_NOT_READY;
        // SAFETY: as above (the older query, where COMPLETE is 0).
        check("aclrtQueryEvent", unsafe { f(handle, &mut status) })?;
        Ok(status == sys::ACL_EVENT_STATUS_COMPLETE)
    }

    fn synchronize_event(&self, event: EventHandle) -> Result<()> {
        let state = self.event_state("aclrtSynchronizeEvent", event)?;
        if !state.recorded {
            return Ok(());
        }
        self.use_device(state.device)?;
        let f = sym!(self.api()?, aclrtSynchronizeEvent);
        // SAFETY: `event` is a live event of this runtime.
        check("aclrtSynchronizeEvent", unsafe {
            f(event.0 as sys::aclrtEvent)
        })
    }

    fn stream_wait_event(&self, stream: StreamHandle, event: EventHandle) -> Result<()> {
        self.event_state("aclrtStreamWaitEvent", event)?;
        let device = self.stream_device("aclrtStreamWaitEvent", stream)?;
        self.use_device(device)?;
        let f = sym!(self.api()?, aclrtStreamWaitEvent);
        // SAFETY: both handles are live objects of this runtime.
        check("aclrtStreamWaitEvent", unsafe {
            f(stream.0 as sys::aclrtStream, event.0 as sys::aclrtEvent)
        })
    }

    unsafe fn memcpy(
        &self,
        dst: usize,
        dst_max: u64,
        src: usize,
        count: u64,
        kind: MemcpyKind,
    ) -> Result<()> {
        let func = "aclrtMemcpy";
        let (dst_max, count) = (to_usize(func, dst_max)?, to_usize(func, count)?);
        // The library first: in a child made by `fork` it is refused before `device_for`
        // takes the lock, which a parent's thread may have held.
        let f = sym!(self.api()?, aclrtMemcpy);
        self.use_device(self.device_for(&[dst, src]))?;
        // SAFETY: the caller guarantees both ranges are valid for the copy (trait contract).
        check(func, unsafe {
            f(
                dst as *mut c_void,
                dst_max,
                src as *const c_void,
                count,
                kind as u32,
            )
        })
    }

    unsafe fn memcpy_async(
        &self,
        dst: usize,
        dst_max: u64,
        src: usize,
        count: u64,
        kind: MemcpyKind,
        stream: StreamHandle,
    ) -> Result<()> {
        let func = "aclrtMemcpyAsync";
        let (dst_max, count) = (to_usize(func, dst_max)?, to_usize(func, count)?);
        let device = self.stream_device(func, stream)?;
        self.use_device(device)?;
        let f = sym!(self.api()?, aclrtMemcpyAsync);
        // SAFETY: the caller guarantees both ranges stay valid until the stream passes the
        // copy (trait contract); `stream` is a live stream of this runtime.
        check(func, unsafe {
            f(
                dst as *mut c_void,
                dst_max,
                src as *const c_void,
                count,
                kind as u32,
                stream.0 as sys::aclrtStream,
            )
        })
    }

    unsafe fn write_on_thread(
        &self,
        thread: CommThreadHandle,
        channel: ChannelHandle,
        dst: usize,
        src: usize,
        len: u64,
    ) -> Result<()> {
        let func = "HcommWriteOnThread";
        // Refused in a child made by `fork` before `device_for` takes the lock.
        self.api()?;
        let f = self
            .hcomm
            .iter()
            .map(|(_, api)| api)
            .chain(std::iter::once(&self.api))
            .find_map(|api| api.HcommWriteOnThread.as_ref().ok().copied())
            .ok_or(Error::NotSupported { func })?;
        // The source range's device is made current, as for a copy from it.
        self.use_device(self.device_for(&[src]))?;
        // SAFETY: the caller guarantees `src` stays valid until the thread's stream passes the
        // write and that `dst..dst + len` is registered memory of the remote rank (trait
        // contract); the handles are passed through as the communicator gave them.
        check(func, unsafe {
            f(
                thread.0,
                channel.0,
                dst as *mut c_void,
                src as *const c_void,
                len,
            )
        })
    }

    unsafe fn memset(&self, dst: usize, max: u64, value: u8, count: u64) -> Result<()> {
        let func = "aclrtMemset";
        let (max, count) = (to_usize(func, max)?, to_usize(func, count)?);
        // The library first, as in `memcpy`.
        let f = sym!(self.api()?, aclrtMemset);
        self.use_device(self.device_for(&[dst]))?;
        // SAFETY: the caller guarantees `dst` is valid for `max` bytes (trait contract).
        check(func, unsafe {
            f(dst as *mut c_void, max, i32::from(value), count)
        })
    }

    unsafe fn memset_async(
        &self,
        dst: usize,
        max: u64,
        value: u8,
        count: u64,
        stream: StreamHandle,
    ) -> Result<()> {
        let func = "aclrtMemsetAsync";
        let (max, count) = (to_usize(func, max)?, to_usize(func, count)?);
        let device = self.stream_device(func, stream)?;
        self.use_device(device)?;
        let f = sym!(self.api()?, aclrtMemsetAsync);
        // SAFETY: the caller guarantees `dst` stays valid for `max` bytes until the stream
        // passes the fill (trait contract); `stream` is a live stream of this runtime.
        check(func, unsafe {
            f(
                dst as *mut c_void,
                max,
                i32::from(value),
                count,
                stream.0 as sys::aclrtStream,
            )
        })
    }
}

impl Drop for AclSource {
    /// Frees what is still live (blocks, events, streams, mappings, physical memory, reserved
    /// ranges, mbufs), best effort, then undoes each `aclrtSetDevice` this source made. Never calls `aclFinalize`.
    fn drop(&mut self) {
        if !crate::fork::ours(self.forks) {
            // The parent's: not this process's to free (and its lock may be held by a
            // thread this process does not have).
            return;
        }
        let live = std::mem::take(&mut *self.lock());
        for (addr, (block, freer)) in live.blocks {
            let _ = self.use_device(block.device);
            let _ = self.raw_free(addr, freer);
        }
        if let Ok(f) = &self.api.aclrtDestroyEvent {
            for (event, state) in live.events {
                let _ = self.use_device(state.device);
                // SAFETY: a live event of this runtime, dropped from tracking above.
                let _ = unsafe { f(event as sys::aclrtEvent) };
            }
        }
        if let Ok(f) = &self.api.aclrtDestroyStream {
            for (stream, device) in live.streams {
                let _ = self.use_device(device);
                // SAFETY: a live stream of this runtime, dropped from tracking above.
                let _ = unsafe { f(stream as sys::aclrtStream) };
            }
        }
        // Physical memory is freed only once unmapped, and a range released only once empty.
        if let Ok(f) = &self.api.aclrtUnmapMem {
            for va in live.mappings.into_keys() {
                // SAFETY: a mapping this source made, dropped from tracking above.
                let _ = unsafe { f(va as *mut c_void) };
            }
        }
        if let Ok(f) = &self.api.aclrtFreePhysical {
            for handle in live.physical {
                // SAFETY: a live physical allocation of this runtime.
                let _ = unsafe { f(handle as sys::aclrtDrvMemHandle) };
            }
        }
        if let Ok(f) = &self.api.aclrtReleaseMemAddress {
            for va in live.reserved.into_keys() {
                // SAFETY: a range this runtime reserved, dropped from tracking above.
                let _ = unsafe { f(va as *mut c_void) };
            }
        }
        if let Ok(f) = &self.api.acltdtFreeBuf {
            for buf in live.mbufs.into_keys() {
                // SAFETY: a live mbuf of this runtime.
                let _ = unsafe { f(buf as sys::acltdtBuf) };
            }
        }
        let calls = std::mem::take(&mut self.lock().set_device_calls);
        if let Ok(f) = &self.api.aclrtResetDevice {
            for (device, n) in calls.into_iter().chain(live.set_device_calls) {
                for _ in 0..n {
                    // SAFETY: plain device id; balances one `aclrtSetDevice` of this source.
                    let _ = unsafe { f(device) };
                }
            }
        }
        let key = self.runtime_key;
        let id = self.id;
        // `try_with`: the cache may already be gone when a thread-local destructor drops us.
        let _ = CURRENT_DEVICE.try_with(|c| {
            let mut c = c.borrow_mut();
            if c.get(&key).is_some_and(|(owner, _)| *owner == id) {
                c.remove(&key);
            }
        });
    }
}

mod optional;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_dvpp_library_is_looked_for_beside_the_runtime() {
        for (runtime, dvpp) in [
            (
                "/opt/cann/lib64/libascendcl.so",
                "/opt/cann/lib64/libacl_dvpp.so",
            ),
            ("lib64/libascendcl.so", "lib64/libacl_dvpp.so"),
            ("libascendcl.so", "libacl_dvpp.so"),
            ("/", "libacl_dvpp.so"),
        ] {
            assert_eq!(dvpp_path_beside(Path::new(runtime)), Path::new(dvpp));
        }
    }
}
