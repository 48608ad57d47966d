//! A faithful AscendCL simulator on host memory: the default [`BlockSource`].
//!
//! [`SimSource`] answers every call the way the AscendCL runtime documents it, with the
//! same `aclError` codes, so that the pool above can be tested without an NPU:
//!
//! - **Allocation**: size 0 is refused with `ACL_ERROR_INVALID_PARAM`; each block is
//!   accounted at the runtime's rounding `ALIGN_UP(size, 32) + padding` (no padding for
//!   `aclrtMallocAlign32` and the `HUGE1G` policies); running out of device, DVPP
//!   (16 GiB of address space per process) or pinned host capacity answers
//!   `ACL_ERROR_RT_MEMORY_ALLOCATION` (207001). Device, align32, cached and DVPP memory of
//!   one device share its capacity. Blocks are page-aligned (so 64- and 128-aligned)
//!   anonymous mappings made with `MAP_NORESERVE`: a 64 GiB simulated device costs host
//!   memory only for the pages actually touched. `aclrtMallocHost` takes no device, but
//!   the id given is checked like any other (pinned memory lives in a device's context),
//!   and so is the one a host memory query names.
//! - **Streams** run asynchronously: each has a worker thread that runs its queue in
//!   order (copies, fills, delays, event records and waits). Events follow
//!   `aclrtQueryEventStatus`: complete once the most recent record has been passed, and
//!   complete when never recorded.
//! - **Copies and fills** move real bytes. Device-side addresses must lie, with the whole
//!   range, inside a live block of this source; a host-side address in a block of this
//!   source must be pinned host memory, with the whole range inside it (other host-side
//!   addresses cannot be checked and are accepted); `count > dst_max` is refused; so is a
//!   copy between device memory of two devices (`ACL_MEMCPY_DEVICE_TO_DEVICE`, or
//!   `ACL_MEMCPY_DEFAULT` with both sides device memory), which the runtime makes only once
//!   peer access is enabled between them (not simulated); an asynchronous copy of any kind
//!   needs 64-aligned `src` and `dst` (`ACL_ERROR_RT_ADDR_UNALIGNED`, 107008), and none
//!   runs within the host.
//! - **Virtual memory** (`vmm.rs`): reservations are real address-space reservations,
//!   physical memory is a shareable memory object (memfd) charged against the device,
//!   mappings are made with `MAP_FIXED` over the reservation; see [`SimSource::map_mem`].
//! - **Sharing between processes** (`share.rs`): shareable handles that other, real
//!   processes import only when whitelisted; see [`SimSource::export_to_shareable_handle`].
//! - **Shared buffers** (`mbuf.rs`): `acltdtAllocBuf` and friends; see [`SimSource::alloc_buf`].
//! - **One-sided writes** (`comm.rs`): every device a rank of one communicator, windows,
//!   channels, `HcommWriteOnThread` and the channels' notifications; see
//!   [`Pool::register_window`](crate::Pool::register_window) and
//!   [`SimSource::notify_wait_on_thread`].
//! - **Observability**: [`SimSource::stats`] counts calls and failures per function and
//!   live bytes per device and kind; [`SimSource::inject_fault`] makes chosen calls fail.
//!
//! # Error codes
//!
//! | situation | code |
//! |---|---|
//! | size 0, `count > dst_max`, a device range outside every live block, a host-side address in device memory or a range past the end of the pinned block it starts in, a host-side range touching reserved virtual address space, a null address, a copy between device memory of two devices (no peer access) | `ACL_ERROR_INVALID_PARAM` (100000) |
//! | device id out of range (for host memory too); recording an event on a stream of another device | `ACL_ERROR_RT_PARAM_INVALID` (107000) |
//! | device, DVPP or host capacity exceeded (or the host refuses the mapping) | `ACL_ERROR_RT_MEMORY_ALLOCATION` (207001) |
//! | free of an unknown address, a double free, or the wrong free function (`aclrtFree` on DVPP memory, or on the data of a shared buffer) | `ACL_ERROR_RT_MEMORY_FREE` (207002) |
//! | free with the right function but a [`Block`] whose kind, size or device differ from what was handed out | `ACL_ERROR_INVALID_PARAM` (100000) |
//! | async copy within the host (`ACL_MEMCPY_HOST_TO_HOST`, or both ends host memory under `ACL_MEMCPY_DEFAULT`) | `ACL_ERROR_RT_FEATURE_NOT_SUPPORT` (207000) |
//! | async copy (any kind, host side included) with an address not 64-aligned | `ACL_ERROR_RT_ADDR_UNALIGNED` (107008) |
//! | unknown or destroyed stream or event | `ACL_ERROR_RT_INVALID_HANDLE` (107017) |
//! | a stream worker thread cannot be started; `aclrtSynchronizeStream` after a notification wait on the stream timed out | `ACL_ERROR_RT_FAILURE` (500003) |
//! | `HcommWriteOnThread` outside the far end's windows or the thread's device, of length 0; a channel from a rank to itself; a notification index not below the channel's, or a thread on another device than the channel's near end | `HCCL_E_PARA` (1, an `HcclResult`) |
//! | `HcommWriteOnThread` or a notification with an unknown thread or channel, or a thread whose stream is gone | `HCCL_E_NOT_FOUND` (6) |
//!
//! Every error is an [`Error::Runtime`] whose `func` names the AscendCL function the call
//! stands for (see [`AclFunc`]): `aclrtMalloc`, `aclrtMallocAlign32`, `aclrtMallocCached`,
//! `acldvppMalloc`, `aclrtMallocHost` for allocation; `aclrtFree`, `acldvppFree`,
//! `aclrtFreeHost` for freeing.
//!
//! # Memory safety
//!
//! A freed block is removed from the source at once, but its mapping stays alive until
//! every copy or fill already queued on it has run, so a free racing with queued work is
//! never a use-after-unmap. A one-sided write into a window is the exception: the free
//! closes the window first, and the write, when its turn comes, lands nowhere. Host-side ranges remain the caller's responsibility, as the
//! `unsafe` contracts of [`BlockSource::memcpy`] and friends say.
//!
//! # Limits of the simulation
//!
//! A double free is detected only while the address has not been handed out again (the
//! host may reuse a freed mapping's address, as the real runtime reuses device addresses).
//! Huge-page granules (2 MiB, 1 GiB) are not simulated: rounding stops at 32 bytes.

mod comm;
mod fault;
pub(crate) mod mapping;
mod mbuf;
mod share;
mod stats;
mod stream;
mod vmm;

pub use comm::{CHANNEL_NOTIFIES, WINDOW_GRANULE};
pub use fault::{AclFunc, Fault, FaultTimes};
pub use mbuf::{MbufHandle, USER_DATA_BYTES};
pub use share::NOT_WHITELISTED;
pub(crate) use share::{hold_for_fork, release_after_fork};
pub use stats::{KindUsage, SimStats};
pub use vmm::DEFAULT_GRANULARITY;

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use self::fault::FaultPlan;
use self::mapping::Mapping;
use self::stream::{Event, Gate, Op, Stream};
use crate::align::{CarveRule, DEFAULT_ALIGN, MODEL_INPUT_ALIGN};
use crate::error::{AclError, Error, Result};
use crate::kind::MemKind;
use crate::source::{
    Block, BlockSource, ChannelHandle, CommThreadHandle, DeviceId, EventHandle, MemcpyKind,
    StreamHandle,
};

/// DVPP address space one process may use on Atlas A2/A3 and inference products: 16 GiB.
pub const DVPP_ADDRESS_LIMIT: u64 = 16 << 30;

/// Default device capacity: 64 GiB, an Atlas 800T A2 card.
pub const DEFAULT_DEVICE_CAPACITY: u64 = 64 << 30;

/// Default pinned host capacity: 64 GiB.
pub const DEFAULT_HOST_CAPACITY: u64 = 64 << 30;

/// Most devices one simulator holds. Each device keeps per-device state from the start, so a
/// count of billions (a typo, or `u32::MAX` from an environment variable) would ask the host
/// for gigabytes before the first call; real servers have 8 or 16.
pub const MAX_DEVICES: u32 = 1024;

/// What the simulated machine looks like.
///
/// Plain fields with a [`Default`], plus `with_*` builders:
///
/// ```
/// use ascend_pool::source::sim::SimConfig;
/// use std::time::Duration;
/// let cfg = SimConfig::default()
///     .with_devices(2)
///     .with_device_capacity(1 << 30)
///     .with_copy_bandwidth(1 << 30)
///     .with_op_latency(Duration::from_micros(5));
/// assert_eq!(cfg.devices, 2);
/// assert_eq!(cfg.padding, 32);
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SimConfig {
    /// Number of devices, ids `0..devices` (default 1, at most [`MAX_DEVICES`]).
    pub devices: u32,
    /// Bytes per device, shared by device, align32, cached and DVPP memory (default 64 GiB).
    pub device_capacity: u64,
    /// DVPP address space for the whole process, over every device (default 16 GiB).
    pub dvpp_limit: u64,
    /// Pinned host bytes for `aclrtMallocHost` (default 64 GiB).
    pub host_capacity: u64,
    /// Padding the runtime adds after each rounded size (default 32; a multiple of 32).
    pub padding: u64,
    /// Copy and fill bandwidth in bytes per second; `None` (default) moves bytes at host speed.
    pub copy_bandwidth: Option<u64>,
    /// Fixed time every copy and fill takes on top of the bandwidth (default zero).
    pub op_latency: Duration,
    /// Granularity of physical memory for virtual memory management (default 2 MiB; a
    /// power of two, at least the host page size).
    pub vmm_granularity: u64,
}

impl Default for SimConfig {
    fn default() -> Self {
        Self {
            devices: 1,
            device_capacity: DEFAULT_DEVICE_CAPACITY,
            dvpp_limit: DVPP_ADDRESS_LIMIT,
            host_capacity: DEFAULT_HOST_CAPACITY,
            padding: crate::align::DEFAULT_PADDING,
            copy_bandwidth: None,
            op_latency: Duration::ZERO,
            vmm_granularity: DEFAULT_GRANULARITY,
        }
    }
}

impl SimConfig {
    /// Sets the number of devices.
    pub fn with_devices(mut self, devices: u32) -> Self {
        self.devices = devices;
        self
    }

    /// Sets the capacity of each device in bytes.
    pub fn with_device_capacity(mut self, bytes: u64) -> Self {
        self.device_capacity = bytes;
        self
    }

    /// Sets the DVPP address-space limit of the process in bytes.
    pub fn with_dvpp_limit(mut self, bytes: u64) -> Self {
        self.dvpp_limit = bytes;
        self
    }

    /// Sets the pinned host capacity in bytes.
    pub fn with_host_capacity(mut self, bytes: u64) -> Self {
        self.host_capacity = bytes;
        self
    }

    /// Sets the runtime padding (a multiple of 32, at most 1 MiB).
    pub fn with_padding(mut self, padding: u64) -> Self {
        self.padding = padding;
        self
    }

    /// Makes copies and fills take `count / bytes_per_sec` seconds.
    pub fn with_copy_bandwidth(mut self, bytes_per_sec: u64) -> Self {
        self.copy_bandwidth = Some(bytes_per_sec);
        self
    }

    /// Makes every copy and fill take at least `latency`.
    pub fn with_op_latency(mut self, latency: Duration) -> Self {
        self.op_latency = latency;
        self
    }

    /// Sets the granularity of physical memory (`aclrtMemGetAllocationGranularity`).
    pub fn with_vmm_granularity(mut self, bytes: u64) -> Self {
        self.vmm_granularity = bytes;
        self
    }

    /// Simulated time a copy or fill of `count` bytes takes.
    fn cost(&self, count: u64) -> Duration {
        let transfer = match self.copy_bandwidth {
            Some(bw) if bw > 0 => {
                let nanos = u128::from(count) * 1_000_000_000 / u128::from(bw);
                Duration::from_nanos(u64::try_from(nanos).unwrap_or(u64::MAX))
            }
            _ => Duration::ZERO,
        };
        self.op_latency.saturating_add(transfer)
    }
}

/// One live block.
#[derive(Debug)]
struct BlockRecord {
    /// The host memory standing in for it; shared with queued ops that touch it.
    mapping: Arc<Mapping>,
    kind: MemKind,
    device: DeviceId,
    /// Bytes asked for.
    size: u64,
    /// Bytes accounted (the runtime's rounding); `mapping.len() == rounded`.
    rounded: u64,
    /// A virtual-memory mapping (`aclrtMapMem`), not an allocation: never freed by
    /// `aclrtFree`, accounted with its physical memory, and contiguous with the mappings
    /// next to it in the same reservation.
    vmm: bool,
    /// The data of a shared buffer (`acltdtAllocBuf`): its handles own it, so only
    /// `acltdtFreeBuf` frees it, never `aclrtFree`.
    buffer: bool,
}

impl BlockRecord {
    fn start(&self) -> usize {
        self.mapping.addr()
    }

    /// Whether `addr..addr + count` lies inside the block's rounded bytes.
    fn covers(&self, addr: usize, count: u64) -> bool {
        let start = self.start() as u64;
        let addr = addr as u64;
        addr >= start
            && addr
                .checked_add(count)
                .is_some_and(|end| end <= start + self.rounded)
    }
}

/// Accounting of every live block.
///
/// Invariants: `device_used[d]` is the sum of `rounded` over live non-host blocks on
/// device `d` plus the physical memory of `d` still charged (see `vmm.rs`); `dvpp_used`
/// over live DVPP blocks; `host_used` over live host blocks; `usage` matches the non-VMM
/// `blocks` per (device, kind); blocks never overlap.
#[derive(Debug, Default)]
struct MemState {
    /// Live blocks and virtual-memory mappings by start address.
    blocks: BTreeMap<usize, BlockRecord>,
    device_used: Vec<u64>,
    dvpp_used: u64,
    host_used: u64,
    usage: HashMap<(DeviceId, MemKind), KindUsage>,
    /// Reservations and physical memory.
    vmm: vmm::VmmState,
    /// Shared buffers.
    mbufs: mbuf::MbufState,
}

impl MemState {
    /// The live block containing `addr`, if any.
    fn block_containing(&self, addr: usize) -> Option<&BlockRecord> {
        let (_, rec) = self.blocks.range(..=addr).next_back()?;
        (addr < rec.start() + rec.mapping.len()).then_some(rec)
    }

    /// Checks that `addr..addr + count` lies in a live block (of device memory when
    /// `device`), or in virtual-memory mappings that follow each other without a gap;
    /// adds the mappings it touches to `keep`. Answers the device all of it is on, or `None`
    /// for a run of mappings that joins memory of several devices.
    fn range(
        &self,
        addr: usize,
        count: u64,
        device: bool,
        keep: &mut Vec<Arc<Mapping>>,
    ) -> Result<Option<DeviceId>, AclError> {
        let rec = self.block_containing(addr).ok_or(AclError::INVALID_PARAM)?;
        if device && !rec.kind.is_device() {
            return Err(AclError::INVALID_PARAM);
        }
        if rec.covers(addr, count) {
            keep.push(Arc::clone(&rec.mapping));
            return Ok(Some(rec.device));
        }
        let end = (addr as u64)
            .checked_add(count)
            .ok_or(AclError::INVALID_PARAM)?;
        if !rec.vmm {
            return Err(AclError::INVALID_PARAM);
        }
        let first = keep.len();
        keep.push(Arc::clone(&rec.mapping));
        let mut on = Some(rec.device);
        let mut at = rec.start() + rec.mapping.len();
        while (at as u64) < end {
            match self.blocks.get(&at) {
                Some(next) if next.vmm => {
                    keep.push(Arc::clone(&next.mapping));
                    on = on.filter(|&d| d == next.device);
                    at += next.mapping.len();
                }
                _ => {
                    keep.truncate(first);
                    return Err(AclError::INVALID_PARAM);
                }
            }
        }
        Ok(on)
    }

    /// Whether every block `addr..addr + count` touches is memory of `device`: a run of
    /// mappings that [`range`](Self::range) accepts may join physical memory of several
    /// devices, so the first block alone does not tell.
    fn all_on_device(&self, addr: usize, count: u64, device: DeviceId) -> bool {
        let Some(first) = self.block_containing(addr) else {
            return false;
        };
        let end = (addr as u64).saturating_add(count);
        self.blocks
            .range(first.start()..)
            .take_while(|(&start, _)| (start as u64) < end)
            .all(|(_, rec)| rec.device == device)
    }

    fn is_device_addr(&self, addr: usize) -> bool {
        self.block_containing(addr)
            .is_some_and(|rec| rec.kind.is_device())
    }
}

/// Calls and failures per function.
#[derive(Debug, Default)]
struct Counters {
    calls: BTreeMap<AclFunc, u64>,
    failures: BTreeMap<AclFunc, u64>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // No code path panics while holding a simulator lock with state half-updated.
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The AscendCL simulator: a [`BlockSource`] on host memory.
///
/// `Send + Sync`; every method takes `&self`. Dropping it drains and joins every
/// stream, then unmaps every block still live.
///
/// ```
/// use ascend_pool::source::sim::{SimConfig, SimSource};
/// use ascend_pool::source::{BlockSource, MemcpyKind};
/// use ascend_pool::MemKind;
/// use std::time::Duration;
///
/// let sim = SimSource::new(SimConfig::default().with_device_capacity(1 << 30))?;
/// let block = sim.alloc_block(0, MemKind::DEVICE, 4096)?;
/// assert_eq!(block.addr % 64, 0);
///
/// let stream = sim.create_stream(0)?;
/// let done = sim.create_event(0)?;
/// // Async copies want both ends 64-aligned: pinned host memory is.
/// let src = sim.alloc_block(0, MemKind::Host, 4096)?;
/// // SAFETY: `src` is a live block of at least 4096 bytes, written by no one else.
/// unsafe { std::ptr::write_bytes(src.addr as *mut u8, 7, 4096) };
/// sim.enqueue_delay(stream, Duration::from_millis(5))?; // a "kernel" holds the stream
/// // SAFETY: `src` stays live until after the copy (we synchronize below); `block` is live.
/// unsafe {
///     sim.memcpy_async(block.addr, block.size, src.addr, 4096,
///                      MemcpyKind::HostToDevice, stream)?;
/// }
/// sim.record_event(done, stream)?;
/// sim.synchronize_event(done)?;
/// assert!(sim.query_event(done)?);
///
/// let mut back = vec![0u8; 4096];
/// // SAFETY: `back` is 4096 writable bytes; the block range is live and in bounds.
/// unsafe {
///     sim.memcpy(back.as_mut_ptr() as usize, 4096, block.addr, 4096,
///                MemcpyKind::DeviceToHost)?;
/// }
/// assert_eq!(back, [7u8; 4096]);
///
/// sim.destroy_event(done)?;
/// sim.destroy_stream(stream)?;
/// sim.free_block(block)?;
/// sim.free_block(src)?;
/// # Ok::<(), ascend_pool::Error>(())
/// ```
pub struct SimSource {
    config: SimConfig,
    /// Rule giving the runtime rounding with the configured padding.
    padded: CarveRule,
    /// Rule giving the runtime rounding without padding (align32, HUGE1G).
    unpadded: CarveRule,
    /// Shared with the exports of physical memory, which release it when the last
    /// importing process lets go (see `share.rs`).
    mem: Arc<Mutex<MemState>>,
    streams: Mutex<HashMap<usize, Arc<Stream>>>,
    events: Mutex<HashMap<usize, Arc<Event>>>,
    /// Next stream or event id; ids are never reused, so a stale handle stays invalid.
    next_handle: AtomicUsize,
    counters: Mutex<Counters>,
    faults: Mutex<FaultPlan>,
    /// The simulated communicator: threads, channels and windows (`comm.rs`). Lock order:
    /// `mem` before `comm`, never the other way (a free drops the windows on its block
    /// under both, so no write can reach them once the block is gone); `comm` before
    /// `streams` and a stream's queue (a thread is made for a stream checked under `comm`,
    /// a notification op queued under it). Shared (weakly) with the notifications, whose
    /// last op forgets them once idle, from a stream's worker holding no lock (`comm.rs`).
    comm: Arc<Mutex<comm::CommState>>,
    /// The fork generation the simulator was made in. A child made by `fork` has neither
    /// the streams' worker threads nor, on hardware, the device context: there, every call
    /// is refused with [`Error::Forked`] and a drop frees nothing ([`crate::fork`]).
    forks: u64,
    /// Unique in the process (never reused, unlike an address): what a handle read from
    /// this simulator alone, such as a [`RemoteWindow`](crate::comm::RemoteWindow), names it by.
    id: u64,
}

/// Ids for [`SimSource::id`].
static NEXT_SIM_ID: AtomicU64 = AtomicU64::new(1);

impl std::fmt::Debug for SimSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.ours().is_err() {
            // The parent's, in a child made by `fork`: its locks are not to be taken here.
            return f
                .debug_struct("SimSource")
                .field("config", &self.config)
                .field("forked", &true)
                .finish_non_exhaustive();
        }
        let (blocks, device_used) = {
            let mem = lock(&self.mem);
            (mem.blocks.len(), mem.device_used.clone())
        };
        f.debug_struct("SimSource")
            .field("config", &self.config)
            .field("live_blocks", &blocks)
            .field("device_used", &device_used)
            .field("streams", &lock(&self.streams).len())
            .field("events", &lock(&self.events).len())
            .finish()
    }
}

impl Default for SimSource {
    /// One device of 64 GiB, 16 GiB of DVPP space, 64 GiB of pinned host memory, padding 32.
    fn default() -> Self {
        Self::new(SimConfig::default()).expect("the default configuration is valid")
    }
}

impl SimSource {
    /// A simulator for the machine `config` describes.
    ///
    /// Fails with [`Error::Config`] when there are no devices or more than [`MAX_DEVICES`], a
    /// capacity is 0, or the padding is not a multiple of 32 up to 1 MiB.
    pub fn new(config: SimConfig) -> Result<Self> {
        if config.devices == 0 {
            return Err(Error::Config(
                "the simulator needs at least one device".into(),
            ));
        }
        if config.devices > MAX_DEVICES {
            return Err(Error::Config(format!(
                "{} simulated devices is past the simulator's {MAX_DEVICES}",
                config.devices
            )));
        }
        let granularity = config.vmm_granularity;
        if !granularity.is_power_of_two() || granularity < mapping::page_size() as u64 {
            return Err(Error::Config(format!(
                "VMM granularity {granularity} is not a power of two of at least a page"
            )));
        }
        if config.device_capacity == 0 || config.host_capacity == 0 || config.dvpp_limit == 0 {
            return Err(Error::Config(
                "simulated capacities must be above 0 bytes".into(),
            ));
        }
        let padded = CarveRule::new(config.padding, DEFAULT_ALIGN)?;
        let unpadded = CarveRule::new(0, DEFAULT_ALIGN)?;
        let mem = MemState {
            device_used: vec![0; config.devices as usize],
            ..MemState::default()
        };
        Ok(Self {
            config,
            padded,
            unpadded,
            mem: Arc::new(Mutex::new(mem)),
            streams: Mutex::new(HashMap::new()),
            events: Mutex::new(HashMap::new()),
            next_handle: AtomicUsize::new(1),
            counters: Mutex::new(Counters::default()),
            faults: Mutex::new(FaultPlan::default()),
            comm: Arc::default(),
            forks: crate::fork::generation(),
            id: NEXT_SIM_ID.fetch_add(1, Ordering::Relaxed),
        })
    }

    /// The configuration the simulator runs with.
    pub fn config(&self) -> &SimConfig {
        &self.config
    }

    /// Bytes the runtime accounts for an allocation of `size` bytes of `kind`:
    /// `ALIGN_UP(size, 32) + padding`, padding 0 for `aclrtMallocAlign32` and `HUGE1G`.
    /// `None` for size 0 or on overflow.
    ///
    /// ```
    /// use ascend_pool::source::sim::SimSource;
    /// use ascend_pool::{MallocPolicy, MemKind};
    /// let sim = SimSource::default();
    /// assert_eq!(sim.rounded_size(MemKind::DEVICE, 33), Some(96));
    /// assert_eq!(sim.rounded_size(MemKind::DeviceAlign32(MallocPolicy::HugeFirst), 33), Some(64));
    /// assert_eq!(sim.rounded_size(MemKind::Device(MallocPolicy::Huge1gOnly), 33), Some(64));
    /// assert_eq!(sim.rounded_size(MemKind::Dvpp, 0), None);
    /// ```
    pub fn rounded_size(&self, kind: MemKind, size: u64) -> Option<u64> {
        let no_padding = matches!(kind, MemKind::DeviceAlign32(_))
            || kind.policy().is_some_and(|p| p.has_no_padding());
        let rule = if no_padding {
            &self.unpadded
        } else {
            &self.padded
        };
        rule.runtime_rounded(size).ok()
    }

    /// A snapshot of the call counters and the live usage (empty in a child made by `fork`
    /// of the process that made the simulator).
    pub fn stats(&self) -> SimStats {
        if self.ours().is_err() {
            return SimStats::default();
        }
        let (calls, failures) = {
            let c = lock(&self.counters);
            (c.calls.clone(), c.failures.clone())
        };
        let (usage, live_blocks, (reservations, physical_handles, mappings), mbufs) = {
            let mem = lock(&self.mem);
            let usage = mem
                .usage
                .iter()
                .filter(|(_, u)| u.blocks > 0)
                .map(|(k, u)| (*k, *u))
                .collect();
            let live = mem.blocks.values().filter(|b| !b.vmm).count();
            (usage, live as u64, mem.vmm.counts(), mem.mbufs.len() as u64)
        };
        SimStats {
            calls,
            failures,
            usage,
            live_blocks,
            live_streams: lock(&self.streams).len() as u64,
            live_events: lock(&self.events).len() as u64,
            reservations,
            physical_handles,
            mappings,
            mbuf_handles: mbufs,
        }
    }

    /// Plans a failure: the calls `fault` names fail with its code instead of running.
    ///
    /// Faults fire in injection order; an injected failure has no effect besides being
    /// counted. See [`Fault`].
    ///
    /// ```
    /// use ascend_pool::source::sim::{AclFunc, Fault, SimSource};
    /// use ascend_pool::source::BlockSource;
    /// use ascend_pool::{AclError, Error, MemKind};
    /// let sim = SimSource::default();
    /// sim.inject_fault(Fault::out_of_memory(AclFunc::Malloc));
    /// let err = sim.alloc_block(0, MemKind::DEVICE, 64).unwrap_err();
    /// assert_eq!(err, Error::Runtime { func: "aclrtMalloc", code: AclError::RT_MEMORY_ALLOCATION });
    /// assert!(sim.alloc_block(0, MemKind::DEVICE, 64).is_ok()); // the fault is spent
    /// ```
    pub fn inject_fault(&self, fault: Fault) {
        // In a child made by `fork`, every call is refused before any fault would fire.
        if self.ours().is_ok() {
            lock(&self.faults).push(fault);
        }
    }

    /// Removes every planned fault.
    pub fn clear_faults(&self) {
        if self.ours().is_ok() {
            lock(&self.faults).clear();
        }
    }

    /// Queues `duration` of busy time on `stream`, as a kernel launch would.
    ///
    /// An unknown stream is refused with `RT_INVALID_HANDLE` under the name `"aclrtLaunchKernel"`.
    pub fn enqueue_delay(&self, stream: StreamHandle, duration: Duration) -> Result<()> {
        const FUNC: &str = "aclrtLaunchKernel";
        self.ours()?;
        let s = self
            .stream(stream)
            .map_err(|code| Error::Runtime { func: FUNC, code })?;
        if s.push(Op::Delay(duration)) {
            Ok(())
        } else {
            Err(Error::Runtime {
                func: FUNC,
                code: AclError::RT_INVALID_HANDLE,
            })
        }
    }

    /// Holds `stream` at this point of its queue until the returned [`StreamHold`] is
    /// released or dropped: a deterministic way to keep queued work pending in tests.
    ///
    /// Forgetting the hold (`mem::forget`) blocks the stream for good, and then
    /// `destroy_stream`, `synchronize_stream` and dropping the simulator never return.
    ///
    /// ```
    /// use ascend_pool::source::sim::SimSource;
    /// use ascend_pool::source::BlockSource;
    /// let sim = SimSource::default();
    /// let stream = sim.create_stream(0)?;
    /// let event = sim.create_event(0)?;
    /// let hold = sim.hold_stream(stream)?;
    /// sim.record_event(event, stream)?;
    /// assert!(!sim.query_event(event)?); // cannot complete while held
    /// hold.release();
    /// sim.synchronize_event(event)?;
    /// assert!(sim.query_event(event)?);
    /// # Ok::<(), ascend_pool::Error>(())
    /// ```
    pub fn hold_stream(&self, stream: StreamHandle) -> Result<StreamHold<'_>> {
        const FUNC: &str = "aclrtLaunchKernel";
        self.ours()?;
        let s = self
            .stream(stream)
            .map_err(|code| Error::Runtime { func: FUNC, code })?;
        let gate = Arc::new(Gate::default());
        if s.push(Op::Gate(Arc::clone(&gate))) {
            Ok(StreamHold {
                gate,
                _source: std::marker::PhantomData,
            })
        } else {
            Err(Error::Runtime {
                func: FUNC,
                code: AclError::RT_INVALID_HANDLE,
            })
        }
    }

    /// Ops queued on `stream` and not yet finished.
    pub fn pending_ops(&self, stream: StreamHandle) -> Result<u64> {
        self.ours()?;
        let s = self.stream(stream).map_err(|code| Error::Runtime {
            func: AclFunc::SynchronizeStream.name(),
            code,
        })?;
        Ok(s.pending())
    }

    /// Waits for every stream of `device` (`aclrtSynchronizeDevice`). A task that failed on
    /// any of them since its last synchronize (a notification wait that timed out) makes it
    /// fail with `ACL_ERROR_RT_FAILURE`, and is reported only here.
    pub fn synchronize_device(&self, device: DeviceId) -> Result<()> {
        self.ours()?;
        if !self.valid_device(device) {
            return Err(Error::Runtime {
                func: "aclrtSynchronizeDevice",
                code: AclError::RT_PARAM_INVALID,
            });
        }
        let streams: Vec<Arc<Stream>> = lock(&self.streams)
            .values()
            .filter(|s| s.device() == device)
            .cloned()
            .collect();
        let mut faulted = false;
        for s in streams {
            s.synchronize();
            faulted |= s.take_fault();
        }
        if faulted {
            return Err(Error::Runtime {
                func: "aclrtSynchronizeDevice",
                code: AclError::RT_FAILURE,
            });
        }
        Ok(())
    }

    /// The live block containing `addr`, as it was handed out (none in a child made by
    /// `fork` of the process that made the simulator).
    pub fn block_containing(&self, addr: usize) -> Option<Block> {
        self.ours().ok()?;
        let mem = lock(&self.mem);
        mem.block_containing(addr).map(|rec| Block {
            addr: rec.start(),
            size: rec.size,
            kind: rec.kind,
            device: rec.device,
        })
    }

    fn valid_device(&self, device: DeviceId) -> bool {
        u32::try_from(device).is_ok_and(|d| d < self.config.devices)
    }

    /// Counts a call of `func`, fires a planned fault or runs `body`, and names the error.
    fn call<T>(&self, func: AclFunc, body: impl FnOnce() -> Result<T, AclError>) -> Result<T> {
        self.ours()?;
        *lock(&self.counters).calls.entry(func).or_default() += 1;
        let fault = {
            let mut faults = lock(&self.faults);
            if faults.is_empty() {
                None
            } else {
                faults.fire(func)
            }
        };
        let result = match fault {
            Some(code) => Err(code),
            None => body(),
        };
        result.map_err(|code| {
            *lock(&self.counters).failures.entry(func).or_default() += 1;
            Error::Runtime {
                func: func.name(),
                code,
            }
        })
    }

    /// Refuses a call in a child made by `fork` of the process that made the simulator.
    fn ours(&self) -> Result<()> {
        crate::fork::check(self.forks)
    }

    fn stream(&self, stream: StreamHandle) -> Result<Arc<Stream>, AclError> {
        lock(&self.streams)
            .get(&stream.0)
            .cloned()
            .ok_or(AclError::RT_INVALID_HANDLE)
    }

    fn event(&self, event: EventHandle) -> Result<Arc<Event>, AclError> {
        lock(&self.events)
            .get(&event.0)
            .cloned()
            .ok_or(AclError::RT_INVALID_HANDLE)
    }

    /// Allocates a block; `buffer` for the data of a shared buffer (see `BlockRecord`).
    fn alloc(
        &self,
        device: DeviceId,
        kind: MemKind,
        size: u64,
        buffer: bool,
    ) -> Result<Block, AclError> {
        if size == 0 {
            return Err(AclError::INVALID_PARAM);
        }
        // Host memory too: the runtime takes pinned memory in the context aclrtSetDevice
        // made, which a device it lacks never gets.
        if !self.valid_device(device) {
            return Err(AclError::RT_PARAM_INVALID);
        }
        let rounded = self
            .rounded_size(kind, size)
            .ok_or(AclError::RT_MEMORY_ALLOCATION)?;
        let len = usize::try_from(rounded).map_err(|_| AclError::RT_MEMORY_ALLOCATION)?;

        let mut mem = lock(&self.mem);
        let mem = &mut *mem;
        let fits = |used: u64, cap: u64| used.checked_add(rounded).is_some_and(|u| u <= cap);
        match kind {
            MemKind::Host => {
                if !fits(mem.host_used, self.config.host_capacity) {
                    return Err(AclError::RT_MEMORY_ALLOCATION);
                }
            }
            _ => {
                let used = mem.device_used[device as usize];
                if !fits(used, self.config.device_capacity) {
                    return Err(AclError::RT_MEMORY_ALLOCATION);
                }
                if kind == MemKind::Dvpp && !fits(mem.dvpp_used, self.config.dvpp_limit) {
                    return Err(AclError::RT_MEMORY_ALLOCATION);
                }
            }
        }
        let mapping = Mapping::new(len).ok_or(AclError::RT_MEMORY_ALLOCATION)?;
        let addr = mapping.addr();
        debug_assert_eq!(addr as u64 % DEFAULT_ALIGN, 0);
        debug_assert_eq!(addr as u64 % MODEL_INPUT_ALIGN, 0);
        match kind {
            MemKind::Host => mem.host_used += rounded,
            MemKind::Dvpp => {
                mem.device_used[device as usize] += rounded;
                mem.dvpp_used += rounded;
            }
            _ => mem.device_used[device as usize] += rounded,
        }
        let u = mem.usage.entry((device, kind)).or_default();
        u.blocks += 1;
        u.rounded_bytes += rounded;
        u.requested_bytes += size;
        let previous = mem.blocks.insert(
            addr,
            BlockRecord {
                mapping: Arc::new(mapping),
                kind,
                device,
                size,
                rounded,
                vmm: false,
                buffer,
            },
        );
        debug_assert!(previous.is_none(), "two live mappings at one address");
        Ok(Block {
            addr,
            size,
            kind,
            device,
        })
    }

    /// Frees a block; `buffer` when a shared buffer's last handle frees its data.
    fn free(&self, block: Block, buffer: bool) -> Result<(), AclError> {
        let mut mem = lock(&self.mem);
        let rec = mem
            .blocks
            .get(&block.addr)
            .ok_or(AclError::RT_MEMORY_FREE)?;
        if rec.vmm
            || rec.buffer != buffer
            || AclFunc::free_for(rec.kind) != AclFunc::free_for(block.kind)
        {
            return Err(AclError::RT_MEMORY_FREE);
        }
        if rec.kind != block.kind || rec.size != block.size || rec.device != block.device {
            return Err(AclError::INVALID_PARAM);
        }
        let rec = mem
            .blocks
            .remove(&block.addr)
            .expect("the block was found above");
        match rec.kind {
            MemKind::Host => mem.host_used -= rec.rounded,
            MemKind::Dvpp => {
                mem.device_used[rec.device as usize] -= rec.rounded;
                mem.dvpp_used -= rec.rounded;
            }
            _ => mem.device_used[rec.device as usize] -= rec.rounded,
        }
        let u = mem
            .usage
            .get_mut(&(rec.device, rec.kind))
            .expect("usage tracks every live block");
        u.blocks -= 1;
        u.rounded_bytes -= rec.rounded;
        u.requested_bytes -= rec.size;
        // A window registered on the block goes with it: writes queued into it land nowhere
        // (their tasks fail), later ones are refused.
        lock(&self.comm).drop_windows_in(block.addr, rec.rounded);
        // The mapping is unmapped here, or when the last queued op holding it has run.
        drop(rec);
        Ok(())
    }

    fn info(&self, device: DeviceId, kind: MemKind) -> Result<(u64, u64), AclError> {
        // Host memory too, as its allocation checks it: a query must not report room for
        // memory that device can never get.
        if !self.valid_device(device) {
            return Err(AclError::RT_PARAM_INVALID);
        }
        let mem = lock(&self.mem);
        let cfg = &self.config;
        if kind == MemKind::Host {
            return Ok((cfg.host_capacity - mem.host_used, cfg.host_capacity));
        }
        let device_free = cfg.device_capacity - mem.device_used[device as usize];
        Ok(match kind {
            MemKind::Dvpp => (
                device_free.min(cfg.dvpp_limit - mem.dvpp_used),
                cfg.device_capacity.min(cfg.dvpp_limit),
            ),
            _ => (device_free, cfg.device_capacity),
        })
    }

    /// Checks a copy like the runtime; returns the blocks it touches, to keep them mapped.
    fn check_copy(
        &self,
        dst: usize,
        dst_max: u64,
        src: usize,
        count: u64,
        kind: MemcpyKind,
        asynchronous: bool,
    ) -> Result<(usize, Vec<Arc<Mapping>>), AclError> {
        if count > dst_max || dst == 0 || src == 0 {
            return Err(AclError::INVALID_PARAM);
        }
        let count_usize = usize::try_from(count).map_err(|_| AclError::INVALID_PARAM)?;
        let mem = lock(&self.mem);
        let (dst_dev, src_dev) = match kind {
            MemcpyKind::HostToHost => (false, false),
            MemcpyKind::HostToDevice => (true, false),
            MemcpyKind::DeviceToHost => (false, true),
            MemcpyKind::DeviceToDevice => (true, true),
            MemcpyKind::Default => (mem.is_device_addr(dst), mem.is_device_addr(src)),
        };
        if asynchronous && !dst_dev && !src_dev {
            // aclrtMemcpyAsync does no copy within the host.
            return Err(AclError::RT_FEATURE_NOT_SUPPORT);
        }
        let mut keep = Vec::with_capacity(2);
        // For each device side, the device it is on (`None`: several, see `range`).
        let mut devices = [None; 2];
        for (on, (addr, on_device)) in devices.iter_mut().zip([(dst, dst_dev), (src, src_dev)]) {
            if on_device {
                *on = Some(mem.range(addr, count, true, &mut keep)?);
            } else if let Some(rec) = mem.block_containing(addr) {
                // Host side in a block of ours: device memory named as host memory is the
                // wrong kind, and pinned memory has an end we know (past it the copy would
                // run into whatever the host mapped next). Kept mapped until the copy runs.
                if rec.kind.is_device() || !rec.covers(addr, count) {
                    return Err(AclError::INVALID_PARAM);
                }
                keep.push(Arc::clone(&rec.mapping));
            } else if mem.vmm.overlaps_reservation(addr, count) {
                // Reserved device address space is no host memory (unmapped, no memory at
                // all): refused as a mapping named as host memory is, not read or written.
                return Err(AclError::INVALID_PARAM);
            }
        }
        // Between device memory the runtime copies within one device, and across two only
        // once peer access is enabled between them, which is not simulated.
        if let [Some(to), Some(from)] = devices {
            if to.is_none() || to != from {
                return Err(AclError::INVALID_PARAM);
            }
        }
        // aclrtMemcpyAsync wants both addresses 64-aligned, whatever the kind.
        let unaligned = |a: usize| a as u64 % DEFAULT_ALIGN != 0;
        if asynchronous && (unaligned(dst) || unaligned(src)) {
            return Err(AclError::RT_ADDR_UNALIGNED);
        }
        Ok((count_usize, keep))
    }

    /// Checks a fill like the runtime; returns the block it touches.
    fn check_fill(
        &self,
        dst: usize,
        max: u64,
        count: u64,
    ) -> Result<(usize, Vec<Arc<Mapping>>), AclError> {
        if count > max || dst == 0 {
            return Err(AclError::INVALID_PARAM);
        }
        let count_usize = usize::try_from(count).map_err(|_| AclError::INVALID_PARAM)?;
        let mut keep = Vec::with_capacity(1);
        lock(&self.mem).range(dst, count, false, &mut keep)?;
        Ok((count_usize, keep))
    }
}

/// Keeps a stream stopped at one point of its queue; see [`SimSource::hold_stream`].
///
/// Dropping it releases the stream. It borrows the simulator, so it cannot outlive it.
#[derive(Debug)]
#[must_use = "dropping the hold releases the stream at once"]
pub struct StreamHold<'a> {
    gate: Arc<Gate>,
    _source: std::marker::PhantomData<&'a SimSource>,
}

impl StreamHold<'_> {
    /// Lets the stream go on.
    pub fn release(self) {}
}

impl Drop for StreamHold<'_> {
    fn drop(&mut self) {
        self.gate.open();
    }
}

impl Drop for SimSource {
    fn drop(&mut self) {
        if self.ours().is_err() {
            // The streams' worker threads are the parent's: closing one would wait for a
            // thread this process does not have. The memory is this process's copy, unmapped
            // when `mem` drops; physical memory and reservations are left as they are.
            let streams = self
                .streams
                .get_mut()
                .unwrap_or_else(PoisonError::into_inner);
            std::mem::forget(std::mem::take(streams));
            return;
        }
        let streams: Vec<Arc<Stream>> = lock(&self.streams).drain().map(|(_, s)| s).collect();
        // Every stream is told first: one may wait on an event queued behind another's
        // endless notification wait, which gives up only once its own stream is closing.
        for s in &streams {
            s.begin_close();
        }
        for s in &streams {
            s.close();
        }
        // Blocks are unmapped when `mem` drops: no op is left holding them. Reservations
        // and physical memory are given back here.
        self.drop_vmm();
    }
}

impl BlockSource for SimSource {
    fn name(&self) -> &str {
        "sim"
    }

    fn simulator_id(&self) -> Option<u64> {
        Some(self.id)
    }

    fn alloc_block(&self, device: DeviceId, kind: MemKind, size: u64) -> Result<Block> {
        self.call(AclFunc::alloc_for(kind), || {
            self.alloc(device, kind, size, false)
        })
    }

    fn free_block(&self, block: Block) -> Result<()> {
        self.call(AclFunc::free_for(block.kind), || self.free(block, false))
    }

    fn mem_info(&self, device: DeviceId, kind: MemKind) -> Result<(u64, u64)> {
        self.call(AclFunc::GetMemInfo, || self.info(device, kind))
    }

    fn create_stream(&self, device: DeviceId) -> Result<StreamHandle> {
        self.call(AclFunc::CreateStream, || {
            if !self.valid_device(device) {
                return Err(AclError::RT_PARAM_INVALID);
            }
            let id = self.next_handle.fetch_add(1, Ordering::Relaxed);
            let stream = Stream::spawn(id, device).map_err(|_| AclError::RT_FAILURE)?;
            lock(&self.streams).insert(id, Arc::new(stream));
            Ok(StreamHandle(id))
        })
    }

    fn destroy_stream(&self, stream: StreamHandle) -> Result<()> {
        self.call(AclFunc::DestroyStream, || {
            let s = lock(&self.streams)
                .remove(&stream.0)
                .ok_or(AclError::RT_INVALID_HANDLE)?;
            s.close();
            // Its communication threads have nowhere to run any more (a write or notify on
            // one is refused as unknown either way): forgotten, or they would pile up.
            lock(&self.comm).threads.retain(|_, on| *on != stream);
            Ok(())
        })
    }

    fn synchronize_stream(&self, stream: StreamHandle) -> Result<()> {
        self.call(AclFunc::SynchronizeStream, || {
            let s = self.stream(stream)?;
            s.synchronize();
            // A task that failed since the last synchronize (a notification wait that
            // timed out), reported once.
            if s.take_fault() {
                return Err(AclError::RT_FAILURE);
            }
            Ok(())
        })
    }

    fn device_count(&self) -> Option<u32> {
        Some(self.config.devices)
    }

    fn create_event(&self, device: DeviceId) -> Result<EventHandle> {
        self.call(AclFunc::CreateEvent, || {
            if !self.valid_device(device) {
                return Err(AclError::RT_PARAM_INVALID);
            }
            let id = self.next_handle.fetch_add(1, Ordering::Relaxed);
            lock(&self.events).insert(id, Arc::new(Event::new(device)));
            Ok(EventHandle(id))
        })
    }

    fn destroy_event(&self, event: EventHandle) -> Result<()> {
        self.call(AclFunc::DestroyEvent, || {
            // Ops already queued keep their own reference and still run.
            lock(&self.events)
                .remove(&event.0)
                .map(drop)
                .ok_or(AclError::RT_INVALID_HANDLE)
        })
    }

    fn record_event(&self, event: EventHandle, stream: StreamHandle) -> Result<()> {
        self.call(AclFunc::RecordEvent, || {
            let e = self.event(event)?;
            let s = self.stream(stream)?;
            if e.device() != s.device() {
                return Err(AclError::RT_PARAM_INVALID);
            }
            let queued = s.push_with(|| Op::Record {
                seq: e.next_record(),
                event: Arc::clone(&e),
            });
            queued.then_some(()).ok_or(AclError::RT_INVALID_HANDLE)
        })
    }

    fn query_event(&self, event: EventHandle) -> Result<bool> {
        self.call(AclFunc::QueryEventStatus, || {
            Ok(self.event(event)?.is_complete())
        })
    }

    fn synchronize_event(&self, event: EventHandle) -> Result<()> {
        self.call(AclFunc::SynchronizeEvent, || {
            self.event(event)?.synchronize();
            Ok(())
        })
    }

    fn stream_wait_event(&self, stream: StreamHandle, event: EventHandle) -> Result<()> {
        self.call(AclFunc::StreamWaitEvent, || {
            let e = self.event(event)?;
            let s = self.stream(stream)?;
            let seq = e.last_record();
            let queued = s.push(Op::Wait { event: e, seq });
            queued.then_some(()).ok_or(AclError::RT_INVALID_HANDLE)
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
        self.call(AclFunc::Memcpy, || {
            let (n, keep) = self.check_copy(dst, dst_max, src, count, kind, false)?;
            let cost = self.config.cost(count);
            if !cost.is_zero() {
                std::thread::sleep(cost);
            }
            // SAFETY: device-side ranges were checked to lie in live blocks, which `keep`
            // holds mapped; host-side ranges are valid by this method's contract.
            unsafe { mapping::copy_bytes(dst, src, n) };
            drop(keep);
            Ok(())
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
        self.call(AclFunc::MemcpyAsync, || {
            let s = self.stream(stream)?;
            let (n, keep) = self.check_copy(dst, dst_max, src, count, kind, true)?;
            let op = Op::Copy {
                dst,
                src,
                count: n,
                cost: self.config.cost(count),
                keep,
                inbound: None,
            };
            s.push(op).then_some(()).ok_or(AclError::RT_INVALID_HANDLE)
        })
    }

    unsafe fn memset(&self, dst: usize, max: u64, value: u8, count: u64) -> Result<()> {
        self.call(AclFunc::Memset, || {
            let (n, mapping) = self.check_fill(dst, max, count)?;
            let cost = self.config.cost(count);
            if !cost.is_zero() {
                std::thread::sleep(cost);
            }
            // SAFETY: the range was checked to lie in live blocks, held mapped by `mapping`.
            unsafe { mapping::fill_bytes(dst, value, n) };
            drop(mapping);
            Ok(())
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
        self.call(AclFunc::MemsetAsync, || {
            let s = self.stream(stream)?;
            let (n, mapping) = self.check_fill(dst, max, count)?;
            let op = Op::Fill {
                dst,
                value,
                count: n,
                cost: self.config.cost(count),
                keep: mapping,
            };
            s.push(op).then_some(()).ok_or(AclError::RT_INVALID_HANDLE)
        })
    }

    fn acquire_comm_thread(&self, stream: StreamHandle) -> Result<CommThreadHandle> {
        self.comm_thread(stream)
    }

    unsafe fn register_window(&self, device: DeviceId, addr: usize, len: u64) -> Result<()> {
        // SAFETY: the caller upholds the contract, which is the same.
        unsafe { SimSource::register_window(self, device, addr, len) }
    }

    fn deregister_window(&self, addr: usize) -> Result<()> {
        SimSource::deregister_window(self, addr)
    }

    unsafe fn write_on_thread(
        &self,
        thread: CommThreadHandle,
        channel: ChannelHandle,
        dst: usize,
        src: usize,
        len: u64,
    ) -> Result<()> {
        // Both ranges are checked against live blocks and kept mapped until the write runs.
        self.write_on(thread, channel, dst, src, len)
    }
}

#[cfg(test)]
mod tests;
