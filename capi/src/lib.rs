//! The C interface to ascend-pool: `libascend_pool_capi.so`, declared in `include/ascend_pool.h`.
//!
//! A C or C++ program (a video pipeline, an inference server) gets pools, regions and streams
//! as 64-bit handles. Handles come from one process-wide counter (a block at a time for each
//! thread), so none is 0 and none is ever reused: a freed region, a destroyed pool or stream,
//! or a handle of another pool is refused with a status ([`Status::BadRegion`],
//! [`Status::BadPool`], [`Status::BadStream`]) instead of touching memory. Every function but
//! [`ap_status_name`] and [`ap_last_error`] (a name, a length) returns a [`Status`]; on
//! failure [`ap_last_error`] gives the message, and the pool is left as it was. Panics are caught at the boundary ([`Status::Panic`]).
//!
//! The functions are the Rust ones behind a lookup: a region handle names a typed region in
//! its pool's table, and a copy is [`Pool::copy_from_host`] and so on, with its bounds,
//! alignment and stream checks. Regions of one pool are spread over [`SHARDS`] tables so that
//! threads allocating and freeing through one pool rarely meet on a lock.
//!
//! A pool over virtual memory publishes regions that other processes open as mappings
//! ([`ap_share_publish`], [`ap_share_open`]); a pool's live segments, a JSON snapshot and an
//! SVG picture of it come into a caller's buffer ([`ap_pool_leak_report`]).
//!
//! ```
//! use ascend_pool_capi::*;
//! let mut pool = 0;
//! assert_eq!(unsafe { ap_pool_create(SOURCE_SIM, std::ptr::null(), &mut pool) }, Status::Ok);
//! let mut region = 0;
//! assert_eq!(unsafe { ap_alloc(pool, KIND_DVPP, 1 << 20, &mut region) }, Status::Ok);
//! let mut info = RegionInfo::default();
//! assert_eq!(unsafe { ap_region_get_info(pool, region, &mut info) }, Status::Ok);
//! assert_eq!(info.addr % 128, 0);
//! assert_eq!(ap_free(pool, region), Status::Ok);
//! assert_eq!(ap_free(pool, region), Status::BadRegion); // freed: refused, nothing touched
//! assert_eq!(unsafe { ap_pool_destroy(pool, std::ptr::null_mut()) }, Status::Ok);
//! ```
#![warn(missing_docs, missing_debug_implementations, rust_2018_idioms)]

use ascend_pool::error::Error;
use ascend_pool::region::{Align128, DeviceRegion, DvppRegion, HostRegion, Region, Stream};
use ascend_pool::source::acl::AclSource;
use ascend_pool::source::BlockSource;
use ascend_pool::{MemKind, Pool, PoolConfig, SimSource};
use static_assertions::const_assert_eq;
use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_void, CStr};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, LazyLock, Mutex, MutexGuard, RwLock};

/// What every function returns; `ap_status` in the header, with the same values.
#[repr(i32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Status {
    /// Done; also the zero a C program's status variable starts at.
    #[default]
    Ok = 0,
    /// A pointer the call writes or reads is NULL.
    NullArgument = 1,
    /// An unknown kind or source, or the same region as both ends of a copy.
    InvalidArgument = 2,
    /// Not a live pool: destroyed, or never created.
    BadPool = 3,
    /// Not a live region of this pool: freed, another pool's, or never handed out.
    BadRegion = 4,
    /// Not a live stream of this pool.
    BadStream = 5,
    /// Size 0, a size that overflows, an alignment the carve rule refuses.
    InvalidSize = 6,
    /// The pool and its source could not serve the request.
    OutOfMemory = 7,
    /// Serving it would pass the configured limit.
    LimitExceeded = 8,
    /// A copy or fill past the end of a region, or of length 0.
    OutOfBounds = 9,
    /// An async copy whose ends are not 64-byte aligned.
    Misaligned = 10,
    /// A kind the call does not take.
    WrongKind = 11,
    /// A configuration string the pool refuses.
    Config = 12,
    /// An AscendCL call failed.
    Runtime = 13,
    /// The runtime lacks a function.
    NotSupported = 14,
    /// `libascendcl.so` could not be loaded.
    LibraryLoad = 15,
    /// A segment's padding was overwritten (debug mode).
    Corruption = 16,
    /// `ap_pool_validate` found a broken invariant.
    InvalidState = 17,
    /// A bug inside the library.
    Panic = 18,
    /// Anything else.
    Other = 19,
    /// The caller's buffer cannot hold the answer; the size it needs was written.
    BufferTooSmall = 20,
    /// Not an open mapping: closed, or never opened.
    BadMapping = 21,
    /// The exporting process did not let this process in.
    ShareRefused = 22,
    /// The published memory is no longer exported: its exporter released it or is gone.
    ShareGone = 23,
    /// Memory first published to any process (or to listed ones) asked for under the other
    /// access.
    ShareAccessFixed = 24,
    /// Not a live buffer: freed, another pool's, or never handed out; or not an open buffer
    /// of another process.
    BadBuffer = 25,
    /// A handle made by the process this one was forked from: it belongs to that process.
    /// Destroying or closing it only forgets it.
    Forked = 26,
    /// A file the pool writes (the recorded trace) could not be created or written.
    Io = 27,
}

impl Status {
    /// Every status, in value order (`ap_status_name` indexes it).
    pub const ALL: [Status; 28] = [
        Status::Ok,
        Status::NullArgument,
        Status::InvalidArgument,
        Status::BadPool,
        Status::BadRegion,
        Status::BadStream,
        Status::InvalidSize,
        Status::OutOfMemory,
        Status::LimitExceeded,
        Status::OutOfBounds,
        Status::Misaligned,
        Status::WrongKind,
        Status::Config,
        Status::Runtime,
        Status::NotSupported,
        Status::LibraryLoad,
        Status::Corruption,
        Status::InvalidState,
        Status::Panic,
        Status::Other,
        Status::BufferTooSmall,
        Status::BadMapping,
        Status::ShareRefused,
        Status::ShareGone,
        Status::ShareAccessFixed,
        Status::BadBuffer,
        Status::Forked,
        Status::Io,
    ];

    fn name(self) -> &'static CStr {
        match self {
            Status::Ok => c"AP_OK",
            Status::NullArgument => c"AP_ERR_NULL_ARGUMENT",
            Status::InvalidArgument => c"AP_ERR_INVALID_ARGUMENT",
            Status::BadPool => c"AP_ERR_BAD_POOL",
            Status::BadRegion => c"AP_ERR_BAD_REGION",
            Status::BadStream => c"AP_ERR_BAD_STREAM",
            Status::InvalidSize => c"AP_ERR_INVALID_SIZE",
            Status::OutOfMemory => c"AP_ERR_OUT_OF_MEMORY",
            Status::LimitExceeded => c"AP_ERR_LIMIT_EXCEEDED",
            Status::OutOfBounds => c"AP_ERR_OUT_OF_BOUNDS",
            Status::Misaligned => c"AP_ERR_MISALIGNED",
            Status::WrongKind => c"AP_ERR_WRONG_KIND",
            Status::Config => c"AP_ERR_CONFIG",
            Status::Runtime => c"AP_ERR_RUNTIME",
            Status::NotSupported => c"AP_ERR_NOT_SUPPORTED",
            Status::LibraryLoad => c"AP_ERR_LIBRARY_LOAD",
            Status::Corruption => c"AP_ERR_CORRUPTION",
            Status::InvalidState => c"AP_ERR_INVALID_STATE",
            Status::Panic => c"AP_ERR_PANIC",
            Status::Other => c"AP_ERR_OTHER",
            Status::BufferTooSmall => c"AP_ERR_BUFFER_TOO_SMALL",
            Status::BadMapping => c"AP_ERR_BAD_MAPPING",
            Status::ShareRefused => c"AP_ERR_SHARE_REFUSED",
            Status::ShareGone => c"AP_ERR_SHARE_GONE",
            Status::ShareAccessFixed => c"AP_ERR_SHARE_ACCESS_FIXED",
            Status::BadBuffer => c"AP_ERR_BAD_BUFFER",
            Status::Forked => c"AP_ERR_FORKED",
            Status::Io => c"AP_ERR_IO",
        }
    }

    /// The status a library error maps to.
    pub fn of(e: &Error) -> Status {
        match e {
            Error::Carve(_) => Status::InvalidSize,
            Error::Runtime { .. } => Status::Runtime,
            Error::OutOfMemory { .. } => Status::OutOfMemory,
            // Which limit it was, the detail of the error tells (`ap_last_error_detail`).
            Error::LimitExceeded { .. } | Error::TotalLimitExceeded { .. } => Status::LimitExceeded,
            // The table lookups refuse other pools' handles before the pool sees them.
            Error::ForeignHandle | Error::AlreadyFreed => Status::BadRegion,
            Error::OutOfBounds { .. } => Status::OutOfBounds,
            Error::Misaligned { .. } => Status::Misaligned,
            Error::WrongKind { .. } => Status::WrongKind,
            Error::NotSupported { .. } => Status::NotSupported,
            Error::LibraryLoad { .. } => Status::LibraryLoad,
            Error::Config(_) => Status::Config,
            Error::Io { .. } => Status::Io,
            Error::Corruption { .. } => Status::Corruption,
            Error::Invalid(_) => Status::InvalidState,
            Error::ShareRefused { .. } => Status::ShareRefused,
            Error::ShareGone { .. } => Status::ShareGone,
            Error::ShareAccessFixed { .. } => Status::ShareAccessFixed,
            Error::Forked => Status::Forked,
            _ => Status::Other,
        }
    }
}

/// `ap_kind`: blocks from `aclrtMalloc` with the pool's policy.
pub const KIND_DEVICE: c_int = 0;
/// `ap_kind`: `aclrtMallocAlign32`.
pub const KIND_DEVICE_ALIGN32: c_int = 1;
/// `ap_kind`: `aclrtMallocCached`.
pub const KIND_CACHED: c_int = 2;
/// `ap_kind`: `acldvppMalloc`, 128-byte starts.
pub const KIND_DVPP: c_int = 3;
/// `ap_kind`: `aclrtMallocHost`.
pub const KIND_HOST: c_int = 4;
/// `ap_source`: the simulator.
pub const SOURCE_SIM: c_int = 0;

/// Devices of the simulator behind [`SOURCE_SIM`] and [`SOURCE_VMM_SIM`] (and of the one
/// [`ap_share_open`] maps with): the drop-in `libascendcl.so`'s default machine, so that
/// pools (and mappings) on several devices work as they do there. With one device, a pool
/// of `device:1` was made and then refused every allocation and stream.
const SIM_DEVICES: u32 = 8;

/// A simulator of [`SIM_DEVICES`] devices, the rest as [`SimSource::default`].
fn simulator() -> Result<SimSource, Failure> {
    Ok(SimSource::new(
        ascend_pool::source::sim::SimConfig::default().with_devices(SIM_DEVICES),
    )?)
}
/// `ap_source`: `libascendcl.so`, found as [`AclSource::load`] looks for it.
pub const SOURCE_ACL: c_int = 1;
/// `ap_source`: the simulator's virtual memory: device chunks mapped into one reserved
/// range, and regions other processes can open ([`ap_share_publish`]).
pub const SOURCE_VMM_SIM: c_int = 2;
/// `ap_source`: as [`SOURCE_VMM_SIM`], over `libascendcl.so`'s virtual-memory functions.
pub const SOURCE_VMM_ACL: c_int = 3;

/// `ap_error_figures`: [`ErrorDetail::figures`] of an error that carries none.
pub const FIGURES_NONE: u32 = 0;
/// `ap_error_figures`: the pool and its source could not serve the request
/// ([`Error::OutOfMemory`]).
pub const FIGURES_OUT_OF_MEMORY: u32 = 1;
/// `ap_error_figures`: the kind's own limit ([`Error::LimitExceeded`], `limit:`).
pub const FIGURES_LIMIT: u32 = 2;
/// `ap_error_figures`: the total over the device kinds ([`Error::TotalLimitExceeded`],
/// `total_limit:`).
pub const FIGURES_TOTAL_LIMIT: u32 = 3;

/// `ap_error_detail`: the figures of this thread's last error, for a caller to decide
/// between trimming, waiting for streams, another kind and giving up. Fields an error does
/// not carry are 0.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ErrorDetail {
    /// Bytes of the struct: set by the caller to what it has room for, answered with what
    /// was written (the smaller of that and the library's own size).
    pub size: u32,
    /// The last call's `ap_status`; `AP_OK` after a success.
    pub status: u32,
    /// Which figures follow: one of the `FIGURES_*` values.
    pub figures: u32,
    /// The `ap_kind` the figures are of.
    pub kind: u32,
    /// Bytes asked for.
    pub requested: u64,
    /// Bytes the kind held reserved from the source; for the total limit, the bytes the
    /// device kinds held together.
    pub reserved: u64,
    /// Bytes of the kind live in regions (footprints).
    pub in_use: u64,
    /// The largest free range in any chunk of the kind.
    pub largest_free: u64,
    /// The limit that would be passed (the kind's, or the total).
    pub limit: u64,
    /// The runtime's `aclError` when the source refused; 0 otherwise.
    pub source_code: i32,
    /// Zero.
    pub reserved_pad: u32,
    /// By `ap_kind`: the bytes each other device kind holds reserved, when the source
    /// refused device memory or the total limit was hit; 0 for the kind itself, for host
    /// memory and otherwise.
    pub elsewhere: [u64; 5],
}

/// The leading fields every caller's struct holds: `size` and `status`.
const DETAIL_MIN: u32 = 8;

impl ErrorDetail {
    /// The detail of a call that answered `status` with `error` (the library's error, if any).
    fn of(status: Status, error: Option<&Error>) -> Self {
        let mut d = ErrorDetail {
            status: status as u32,
            ..Default::default()
        };
        let Some(s) = error.and_then(Error::shortage) else {
            return d;
        };
        d.figures = match error {
            Some(Error::OutOfMemory { source, .. }) => {
                d.source_code = source.map_or(0, |c| c.0);
                FIGURES_OUT_OF_MEMORY
            }
            Some(Error::LimitExceeded { .. }) => FIGURES_LIMIT,
            _ => FIGURES_TOTAL_LIMIT,
        };
        d.kind = s.kind.index() as u32;
        (d.requested, d.reserved, d.in_use) = (s.requested, s.reserved, s.in_use);
        (d.largest_free, d.limit) = (s.largest_free, s.limit.unwrap_or(0));
        for (k, bytes) in s.elsewhere {
            d.elsewhere[k.index()] = *bytes;
        }
        d
    }
}

/// `ap_region_info`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RegionInfo {
    /// Start; a device address for device kinds.
    pub addr: u64,
    /// Usable bytes: the length asked for.
    pub len: u64,
    /// Guaranteed start alignment.
    pub align: u64,
    /// An `ap_kind`.
    pub kind: u32,
    /// Zero.
    pub reserved: u32,
}

/// `ap_stats`: the fields of [`ascend_pool::pool::KindStats`], in its order.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[allow(missing_docs)] // documented on KindStats
pub struct Stats {
    pub allocated_bytes: u64,
    pub requested_bytes: u64,
    pub reserved_bytes: u64,
    pub peak_allocated_bytes: u64,
    pub peak_requested_bytes: u64,
    pub peak_reserved_bytes: u64,
    pub live_regions: u64,
    pub allocations: u64,
    pub frees: u64,
    pub pending_frees: u64,
    pub chunks: u64,
    pub source_alloc_calls: u64,
    pub source_free_calls: u64,
    pub ooms: u64,
    pub cached_bytes: u64,
    pub cached_regions: u64,
}

/// `ap_segment_info`: one live segment of a leak report ([`ascend_pool::pool::SegmentInfo`]).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SegmentInfo {
    /// Start of the segment: the region's address.
    pub addr: u64,
    /// Offset in its chunk.
    pub offset: u64,
    /// Bytes asked for.
    pub len: u64,
    /// Bytes it takes under the carve rule.
    pub footprint: u64,
    /// An `ap_kind`.
    pub kind: u32,
    /// 1 when the region was freed and its memory waits for a stream's work, else 0.
    pub pending: u32,
}

/// `ap_corruption_info`: one padding overrun found in debug mode
/// ([`ascend_pool::Error::Corruption`]).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CorruptionInfo {
    /// Offset of the segment in its chunk.
    pub offset: u64,
    /// Bytes asked for.
    pub len: u64,
    /// First overwritten padding byte, from the segment's start.
    pub first_bad: u64,
    /// An `ap_kind`.
    pub kind: u32,
    /// Always 0; keeps the size a multiple of 8 for the header's struct.
    pub reserved: u32,
}

// The header's layouts (`include/ascend_pool.h` at the repository root) must follow any change.
const_assert_eq!(std::mem::size_of::<RegionInfo>(), 32);
const_assert_eq!(std::mem::size_of::<ErrorDetail>(), 104);
// Field by field as the header's `ap_error_detail` (and `tests/c/pipeline.c` checks the
// same offsets from C): a caller's older, smaller struct relies on every offset staying put.
const_assert_eq!(std::mem::align_of::<ErrorDetail>(), 8);
const_assert_eq!(std::mem::offset_of!(ErrorDetail, size), 0);
const_assert_eq!(std::mem::offset_of!(ErrorDetail, status), 4);
const_assert_eq!(std::mem::offset_of!(ErrorDetail, figures), 8);
const_assert_eq!(std::mem::offset_of!(ErrorDetail, kind), 12);
const_assert_eq!(std::mem::offset_of!(ErrorDetail, requested), 16);
const_assert_eq!(std::mem::offset_of!(ErrorDetail, reserved), 24);
const_assert_eq!(std::mem::offset_of!(ErrorDetail, in_use), 32);
const_assert_eq!(std::mem::offset_of!(ErrorDetail, largest_free), 40);
const_assert_eq!(std::mem::offset_of!(ErrorDetail, limit), 48);
const_assert_eq!(std::mem::offset_of!(ErrorDetail, source_code), 56);
const_assert_eq!(std::mem::offset_of!(ErrorDetail, reserved_pad), 60);
const_assert_eq!(std::mem::offset_of!(ErrorDetail, elsewhere), 64);
const_assert_eq!(std::mem::size_of::<Stats>(), 16 * 8);
const_assert_eq!(std::mem::size_of::<SegmentInfo>(), 40);
const_assert_eq!(std::mem::size_of::<CorruptionInfo>(), 32);
const_assert_eq!(std::mem::size_of::<Status>(), std::mem::size_of::<c_int>());

/// Region tables per pool: a handle's table is its block's number (the handle over the 1,024
/// handles a thread takes at a time) modulo `SHARDS`, so a thread's run of handles stays in
/// one table.
pub const SHARDS: usize = 16;

/// A region as the pool handed it out; the handle table keeps its type.
#[derive(Debug)]
enum AnyRegion {
    Device(DeviceRegion),
    Model(DeviceRegion<Align128>),
    Dvpp(DvppRegion),
    Host(HostRegion),
}

/// Runs `$body` with `$x` bound to the typed region inside `$r`.
macro_rules! with_region {
    ($r:expr, $x:ident => $body:expr) => {
        match $r {
            AnyRegion::Device($x) => $body,
            AnyRegion::Model($x) => $body,
            AnyRegion::Dvpp($x) => $body,
            AnyRegion::Host($x) => $body,
        }
    };
}

type Shared<T> = Arc<Mutex<T>>;

/// A region's cell in its table. It holds the region (`Some`) while the handle is live; an
/// empty cell is only ever a spare (see [`spare_cell`]), which no table and no call can reach.
type RegionCell = Shared<Option<AnyRegion>>;

/// The region a call has locked.
struct Held<'a>(MutexGuard<'a, Option<AnyRegion>>);

impl std::ops::Deref for Held<'_> {
    type Target = AnyRegion;
    fn deref(&self) -> &AnyRegion {
        // A cell reached through a table is never empty (see `RegionCell`).
        self.0.as_ref().expect("a live region's cell holds it")
    }
}

impl std::ops::DerefMut for Held<'_> {
    fn deref_mut(&mut self) -> &mut AnyRegion {
        self.0.as_mut().expect("a live region's cell holds it")
    }
}

/// Locks a region for a call.
fn hold(cell: &RegionCell) -> Held<'_> {
    Held(lock(cell))
}

/// Empty cells a thread keeps for its next allocations, at most.
const SPARE_CELLS: usize = 256;

thread_local! {
    /// Cells of regions this thread freed, emptied, for its next allocations: a cell is a heap
    /// allocation, and a batch of frees followed by a batch of allocations would otherwise take
    /// most of them from the C allocator's slower paths.
    static SPARES: RefCell<Vec<RegionCell>> = const { RefCell::new(Vec::new()) };
}

/// A cell holding `region`: one of this thread's spares, or a new one.
fn spare_cell(region: AnyRegion) -> RegionCell {
    // Gone only in a call from a thread-local destructor: that call makes a new cell.
    if let Some(mut cell) = SPARES.try_with(|s| s.borrow_mut().pop()).ok().flatten() {
        // A spare has no other owner: it was unique when kept, and nothing can reach it.
        if let Some(m) = Arc::get_mut(&mut cell) {
            *m.get_mut().unwrap_or_else(|p| p.into_inner()) = Some(region);
            return cell;
        }
    }
    Arc::new(Mutex::new(Some(region)))
}

/// Takes the region out of a cell no table holds any more. `None` when another thread's call
/// still holds the cell: its drop frees the region when that call is done.
fn take_region(mut cell: RegionCell) -> Option<AnyRegion> {
    let m = Arc::get_mut(&mut cell)?;
    // A call that panicked while it held the region poisoned the cell: not kept.
    let keep = !m.is_poisoned();
    let region = m.get_mut().unwrap_or_else(|p| p.into_inner()).take();
    if keep {
        let _ = SPARES.try_with(|s| {
            let mut s = s.borrow_mut();
            if s.len() < SPARE_CELLS {
                s.push(cell);
            }
        });
    }
    region
}

mod comm;
mod fork;
mod lookup;
mod mbuf;
mod share;
pub use comm::*;
use lookup::{entry, next_handle, HANDLE_BLOCK};
pub use mbuf::*;
pub use share::*;

/// Hashes handles, which the process hands out itself: no adversary picks them, so SipHash's
/// cost buys nothing. SplitMix64's finalizer (two multiplies) spreads them as a random hash
/// would, though a shard's handles come in runs of consecutive numbers.
#[derive(Debug, Default, Clone, Copy)]
struct HandleHasher(u64);

impl std::hash::Hasher for HandleHasher {
    fn write(&mut self, bytes: &[u8]) {
        // Only `u64` keys use this hasher; any other write still hashes, just slowly.
        for &b in bytes {
            self.write_u64(self.0 ^ u64::from(b));
        }
    }
    fn write_u64(&mut self, n: u64) {
        let mut z = n.wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        self.0 = z ^ (z >> 31);
    }
    fn finish(&self) -> u64 {
        self.0
    }
}

/// A map keyed by handle.
type Handles<T> = HashMap<u64, T, std::hash::BuildHasherDefault<HandleHasher>>;

/// One region table, on cache lines of its own: threads allocate from consecutive handle
/// blocks, and so from neighbouring tables, whose locks would otherwise share a line.
#[derive(Debug, Default)]
#[repr(align(128))]
struct Shard(Mutex<Handles<RegionCell>>);

const_assert_eq!(std::mem::align_of::<Shard>(), 128);

/// One pool and what its handles name.
#[derive(Debug)]
struct Entry {
    /// Live regions by handle. A region is locked while a call uses it, so a free racing with
    /// a copy waits for the copy (the handle is gone at once; the memory goes after).
    regions: [Shard; SHARDS],
    /// Live streams by handle.
    streams: Mutex<Handles<Arc<Stream>>>,
    /// Live buffer handles; several may name one buffer.
    mbufs: Mutex<Handles<ascend_pool::mbuf::Mbuf>>,
    /// Shared with the buffers, which each hold the pool.
    pool: Arc<Pool>,
    /// The publishing side of a source over virtual memory.
    publisher: Option<Arc<dyn share::Publish>>,
    /// Cleared by `ap_pool_destroy` before it empties the tables, each under its lock. The
    /// destroy waits for the calls that announced the pool (see `lookup`); a call without a
    /// slot, which holds a counted reference instead, may still run, and answers
    /// [`Status::BadPool`] from then on, for a handle the destroy took away as for a new one.
    alive: AtomicBool,
    /// The pool's own handle.
    id: u64,
    /// The fork generation the pool was made in: in a child made by `fork` after that, the
    /// pool is the parent's (see `fork`).
    forks: u64,
}

/// Live pools. Read-locked when a thread calls with a pool other than its last one (or after a
/// destroy), written only to create and destroy.
static POOLS: LazyLock<RwLock<Handles<Arc<Entry>>>> = LazyLock::new(Default::default);

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Calls run under catch_unwind; a panic never leaves a table half-changed.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Why a call failed.
#[derive(Debug)]
enum Failure {
    Null(&'static str),
    Invalid(String),
    BadPool(u64),
    BadRegion(u64),
    BadStream(u64),
    BadMapping(u64),
    BadBuffer(u64),
    /// A pool whose source cannot publish.
    NotShared(u64),
    /// A pool, mapping or buffer of the process this one was forked from.
    Forked(u64),
    /// The answer needs `needed` items where the caller gave room for `cap`.
    TooSmall {
        needed: usize,
        cap: usize,
    },
    /// A host buffer of `len` bytes, longer than any slice: so longer than anything it is
    /// copied to or from.
    HostTooLong {
        offset: u64,
        len: u64,
    },
    Lib(Error),
}

impl From<Error> for Failure {
    fn from(e: Error) -> Self {
        Failure::Lib(e)
    }
}

impl Failure {
    fn status(&self) -> Status {
        match self {
            Failure::Null(_) => Status::NullArgument,
            Failure::Invalid(_) => Status::InvalidArgument,
            Failure::BadPool(_) => Status::BadPool,
            Failure::BadRegion(_) => Status::BadRegion,
            Failure::BadStream(_) => Status::BadStream,
            Failure::TooSmall { .. } => Status::BufferTooSmall,
            Failure::HostTooLong { .. } => Status::OutOfBounds,
            Failure::BadMapping(_) => Status::BadMapping,
            Failure::BadBuffer(_) => Status::BadBuffer,
            Failure::NotShared(_) => Status::NotSupported,
            Failure::Forked(_) => Status::Forked,
            Failure::Lib(e) => Status::of(e),
        }
    }

    /// The figures of the library's error, when it carries some (see [`ErrorDetail::of`]).
    fn detail(&self) -> ErrorDetail {
        let error = match self {
            Failure::Lib(e) => Some(e),
            _ => None,
        };
        ErrorDetail::of(self.status(), error)
    }

    fn message(&self) -> String {
        match self {
            Failure::Null(what) => format!("`{what}` is NULL"),
            Failure::Invalid(why) => why.clone(),
            Failure::BadPool(h) => format!("pool {h} is not a live pool"),
            Failure::BadRegion(h) => format!("region {h} is not a live region of this pool"),
            Failure::BadStream(h) => format!("stream {h} is not a live stream of this pool"),
            Failure::BadMapping(h) => format!("mapping {h} is not an open mapping"),
            Failure::BadBuffer(h) => format!("buffer {h} is not a live buffer here"),
            Failure::Forked(h) => format!(
                "handle {h} was made before this process was forked: it belongs to the parent \
                 process (make a pool of this process's own)"
            ),
            Failure::NotShared(h) => format!(
                "pool {h} cannot publish: create it over virtual memory \
                 (AP_SOURCE_VMM_SIM or AP_SOURCE_VMM_ACL)"
            ),
            Failure::TooSmall { needed, cap } => {
                format!("the answer needs room for {needed}, the buffer has {cap}")
            }
            Failure::HostTooLong { offset, len } => format!(
                "range {offset}..{offset}+{len} is out of bounds: {len} bytes is longer than any \
                 region or buffer"
            ),
            Failure::Lib(e) => e.to_string(),
        }
    }
}

/// This thread's last failed call, as [`ap_last_error`] and [`ap_last_error_detail`] tell it.
#[derive(Default)]
struct LastError {
    /// Its message; empty after a success.
    message: String,
    /// Its figures; all 0 after a success (`size` is set when they are handed over).
    detail: ErrorDetail,
}

thread_local! {
    /// This thread's last failed call; empty after a success.
    static LAST_ERROR: RefCell<LastError> = RefCell::new(LastError::default());
}

/// Runs one call at the boundary: its failure or panic becomes a status and a message.
fn run(f: impl FnOnce() -> Result<(), Failure>) -> Status {
    let (status, message, detail) = match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(())) => (Status::Ok, String::new(), ErrorDetail::default()),
        Ok(Err(fail)) => (fail.status(), fail.message(), fail.detail()),
        Err(payload) => {
            let what = payload
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a panic".into());
            let message = format!("internal error: {what}");
            (Status::Panic, message, ErrorDetail::of(Status::Panic, None))
        }
    };
    // Gone only for a call from a thread-local destructor, after this one's: the status
    // still tells.
    let _ = LAST_ERROR.try_with(|m| {
        let mut m = m.borrow_mut();
        // A success after a success writes nothing.
        if !(message.is_empty() && m.message.is_empty()) {
            *m = LastError { message, detail };
        }
    });
    status
}

fn non_null<T>(p: *mut T, what: &'static str) -> Result<NonNull<T>, Failure> {
    NonNull::new(p).ok_or(Failure::Null(what))
}

fn mem_kind(pool: &Pool, kind: c_int) -> Result<MemKind, Failure> {
    let policy = pool.config().policy;
    Ok(match kind {
        KIND_DEVICE => MemKind::Device(policy),
        KIND_DEVICE_ALIGN32 => MemKind::DeviceAlign32(policy),
        KIND_CACHED => MemKind::Cached(policy),
        KIND_DVPP => MemKind::Dvpp,
        KIND_HOST => MemKind::Host,
        other => return Err(Failure::Invalid(format!("{other} is not an ap_kind"))),
    })
}

impl Entry {
    fn table(&self, handle: u64) -> &Mutex<Handles<RegionCell>> {
        &self.regions[((handle / HANDLE_BLOCK) % SHARDS as u64) as usize].0
    }

    /// `missing` for a handle not in a table, unless the pool is being destroyed.
    fn gone(&self, missing: Failure) -> Failure {
        if self.alive.load(Ordering::Acquire) {
            missing
        } else {
            Failure::BadPool(self.id)
        }
    }

    /// Files `value` under a new handle, unless the pool is being destroyed: its tables have
    /// been emptied, or will be, and the value is dropped (a region freed) instead.
    fn file<T>(&self, table: &Mutex<Handles<T>>, handle: u64, value: T) -> Result<u64, Failure> {
        let mut t = lock(table);
        if !self.alive.load(Ordering::Acquire) {
            drop(t);
            drop(value);
            return Err(Failure::BadPool(self.id));
        }
        t.insert(handle, value);
        Ok(handle)
    }

    fn insert(&self, region: AnyRegion) -> Result<u64, Failure> {
        let handle = next_handle();
        self.file(self.table(handle), handle, spare_cell(region))
    }

    fn region(&self, handle: u64) -> Result<RegionCell, Failure> {
        let found = lock(self.table(handle)).get(&handle).cloned();
        found.ok_or_else(|| self.gone(Failure::BadRegion(handle)))
    }

    fn stream(&self, handle: u64) -> Result<Arc<Stream>, Failure> {
        let found = lock(&self.streams).get(&handle).cloned();
        found.ok_or_else(|| self.gone(Failure::BadStream(handle)))
    }

    /// Locks two distinct regions, in handle order so that two calls never wait on each other.
    fn pair(
        &self,
        dst: u64,
        src: u64,
        f: impl FnOnce(&mut AnyRegion, &AnyRegion) -> Result<(), Failure>,
    ) -> Result<(), Failure> {
        if dst == src {
            return Err(Failure::Invalid(format!(
                "region {dst} is both ends of the copy"
            )));
        }
        let (d, s) = (self.region(dst)?, self.region(src)?);
        let (mut dg, sg);
        if dst < src {
            dg = hold(&d);
            sg = hold(&s);
        } else {
            sg = hold(&s);
            dg = hold(&d);
        }
        f(&mut dg, &sg)
    }
}

/// The name of status value `status` (`"AP_ERR_BAD_REGION"`), or `"AP_ERR_UNKNOWN"`; a static
/// NUL-terminated string.
#[no_mangle]
pub extern "C" fn ap_status_name(status: c_int) -> *const c_char {
    usize::try_from(status)
        .ok()
        .and_then(|i| Status::ALL.get(i))
        .map_or(c"AP_ERR_UNKNOWN", |s| s.name())
        .as_ptr()
}

/// Copies this thread's last failure message into `buf` (cut to `cap - 1` bytes and
/// NUL-terminated) and returns its full length in bytes; 0 when the last call succeeded, or
/// when the thread is exiting and its message has gone (a call from a thread-local
/// destructor).
///
/// # Safety
/// `buf` is NULL or valid for writes of `cap` bytes.
#[no_mangle]
pub unsafe extern "C" fn ap_last_error(buf: *mut c_char, cap: usize) -> usize {
    LAST_ERROR
        .try_with(|m| {
            let m = &m.borrow().message;
            if !buf.is_null() && cap > 0 {
                let n = m.len().min(cap - 1);
                // SAFETY: the caller gives `cap` writable bytes at `buf`; n + 1 <= cap, and the
                // message is a separate allocation.
                unsafe {
                    std::ptr::copy_nonoverlapping(m.as_ptr(), buf.cast::<u8>(), n);
                    buf.add(n).write(0);
                }
            }
            m.len()
        })
        .unwrap_or_else(|_| {
            if !buf.is_null() && cap > 0 {
                // SAFETY: the caller gives `cap >= 1` writable bytes at `buf`.
                unsafe { buf.write(0) };
            }
            0
        })
}

/// Copies the figures of this thread's last failure into `out`: as many bytes as
/// `out->size` says the caller's struct has, at most the library's [`ErrorDetail`], with
/// `size` set to the bytes written (an older caller gets the fields it knows). After a
/// success, or an error without figures, all fields but `size` and `status` are 0. Like
/// [`ap_last_error`], it leaves the thread's last failure as it was: its own status is
/// [`Status::NullArgument`] for a NULL `out`, [`Status::InvalidArgument`] when `out->size`
/// leaves no room for `size` and `status`. In a thread-local destructor, after the thread's
/// state has gone, the answer is a success's.
///
/// # Safety
/// `out` is NULL, or valid for reads of 4 bytes and for writes of `out->size` bytes, and
/// aligned as `ap_error_detail`.
#[no_mangle]
pub unsafe extern "C" fn ap_last_error_detail(out: *mut ErrorDetail) -> Status {
    let Some(out) = NonNull::new(out) else {
        return Status::NullArgument;
    };
    // SAFETY: the caller gives a readable `size` at an aligned `out`.
    let room = unsafe { (&raw const (*out.as_ptr()).size).read() };
    if room < DETAIL_MIN {
        return Status::InvalidArgument;
    }
    let mut d = LAST_ERROR
        .try_with(|m| m.borrow().detail)
        .unwrap_or_default();
    let n = room.min(std::mem::size_of::<ErrorDetail>() as u32);
    d.size = n;
    // SAFETY: the caller gives `room >= n` writable bytes at `out`, and `d` is a separate
    // local.
    unsafe {
        std::ptr::copy_nonoverlapping(
            (&raw const d).cast::<u8>(),
            out.as_ptr().cast::<u8>(),
            n as usize,
        )
    };
    Status::Ok
}

/// Files `pool` under a new pool handle and returns the handle.
fn file_pool(pool: Pool, publisher: Option<Arc<dyn share::Publish>>) -> u64 {
    let handle = next_handle();
    let entry = Entry {
        regions: Default::default(),
        streams: Mutex::default(),
        mbufs: Mutex::default(),
        pool: Arc::new(pool),
        publisher,
        alive: AtomicBool::new(true),
        id: handle,
        forks: fork::generation(),
    };
    POOLS
        .write()
        .unwrap_or_else(|p| p.into_inner())
        .insert(handle, Arc::new(entry));
    handle
}

/// Creates a pool over `source` ([`SOURCE_SIM`], [`SOURCE_ACL`], or their virtual memory:
/// [`SOURCE_VMM_SIM`], [`SOURCE_VMM_ACL`], whose regions can be shared) with the configuration
/// `conf` in `ASCEND_POOL_CONF` syntax, or from `$ASCEND_POOL_CONF` when `conf` is NULL.
///
/// # Safety
/// `conf` is NULL or a NUL-terminated string; `out` is NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn ap_pool_create(
    source: c_int,
    conf: *const c_char,
    out: *mut u64,
) -> Status {
    run(|| {
        let out = non_null(out, "out")?;
        let config = if conf.is_null() {
            PoolConfig::from_env()?
        } else {
            // SAFETY: the caller passes a NUL-terminated string.
            let text = unsafe { CStr::from_ptr(conf) };
            let text = text
                .to_str()
                .map_err(|_| Error::Config("the configuration is not UTF-8".into()))?;
            PoolConfig::parse(text)?
        };
        let device = config.device;
        let (source, publisher): share::Sources = match source {
            SOURCE_SIM => (Arc::new(simulator()?), None),
            SOURCE_ACL => (Arc::new(AclSource::load()?), None),
            SOURCE_VMM_SIM => share::vmm_source(Arc::new(simulator()?), device)?,
            SOURCE_VMM_ACL => share::vmm_source(Arc::new(AclSource::load()?), device)?,
            other => return Err(Failure::Invalid(format!("{other} is not an ap_source"))),
        };
        let handle = file_pool(Pool::new(source, config)?, publisher);
        // SAFETY: non-null, and the caller gives a writable u64.
        unsafe { out.as_ptr().write(handle) };
        Ok(())
    })
}

/// Destroys a pool: waits for its streams, frees its live regions and buffer handles (their
/// number in `*freed_regions` when it is not NULL), destroys its streams and returns its
/// blocks.
///
/// A call on the pool still running in another thread finishes first; the blocks go back
/// when it has. The handle goes whatever the status: a failed stream synchronisation is
/// reported after the pool is gone (the pool's drop keeps from the source what such a
/// stream may still write). A stream the runtime would not wait for when destroyed is kept,
/// as [`ap_stream_destroy`] keeps one, and waited for once more by the pool's last
/// [`Pool::synchronize`] here; one still refused then stays kept for good.
///
/// In debug mode, an overwritten padding in a region freed here is [`Status::Corruption`]
/// (the first one in [`ap_last_error`]; the regions are freed and the pool gone all the
/// same), after a stream's failure if there is one.
///
/// # Safety
/// `freed_regions` is NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn ap_pool_destroy(pool: u64, freed_regions: *mut u64) -> Status {
    run(|| {
        let entry = POOLS
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&pool)
            .ok_or(Failure::BadPool(pool))?;
        if !fork::ours(entry.forks) {
            // The parent's pool, which a call cut short by the fork may hold for good: no
            // waiting for calls, and nothing freed (on hardware the memory is the parent
            // context's). Only the handle goes.
            lookup::forget();
            std::mem::forget(entry);
            if let Some(out) = NonNull::new(freed_regions) {
                // SAFETY: non-null, and the caller gives a writable u64.
                unsafe { out.as_ptr().write(0) };
            }
            return Ok(());
        }
        // No call that found the entry is still running after this.
        lookup::retire(pool);
        entry.alive.store(false, Ordering::Release);
        // Overruns found before, which `ap_pool_take_corruption_reports` could have taken,
        // go: what the list holds at the end is what this destroy found.
        drop(entry.pool.take_corruption_reports());
        // Work still queued on a region runs first, so its free completes at once.
        let streams: Vec<_> = lock(&entry.streams).drain().map(|(_, s)| s).collect();
        let waited = streams.iter().try_for_each(|s| s.synchronize());
        let mut freed = 0;
        for table in &entry.regions {
            let regions: Vec<_> = lock(&table.0).drain().collect();
            freed += regions.len() as u64;
        }
        let mbufs: Vec<_> = lock(&entry.mbufs).drain().collect();
        freed += mbufs.len() as u64;
        drop(mbufs);
        // The streams go before the pool's synchronize: one the runtime would not wait for at
        // its drop is kept, and that synchronize retries it, as no C call could afterwards.
        drop(streams);
        // Frees that waited on the streams complete now, not in the pool's drop, which
        // would report them as still live.
        let settled = entry.pool.synchronize();
        // An overrun in a region freed here has no later call to report it: the status does.
        let found = entry.pool.take_corruption_reports();
        if let Some(out) = NonNull::new(freed_regions) {
            // SAFETY: non-null, and the caller gives a writable u64.
            unsafe { out.as_ptr().write(freed) };
        }
        drop(entry);
        waited.and(settled)?;
        found.into_iter().next().map_or(Ok(()), |e| Err(e.into()))
    })
}

/// Counters of one kind of the pool.
///
/// # Safety
/// `out` is NULL or valid for a write of an [`Stats`].
#[no_mangle]
pub unsafe extern "C" fn ap_pool_stats(pool: u64, kind: c_int, out: *mut Stats) -> Status {
    run(|| {
        let out = non_null(out, "out")?;
        let e = entry(pool)?;
        let s = e.pool.stats(mem_kind(&e.pool, kind)?);
        let stats = Stats {
            allocated_bytes: s.allocated_bytes,
            requested_bytes: s.requested_bytes,
            reserved_bytes: s.reserved_bytes,
            peak_allocated_bytes: s.peak_allocated_bytes,
            peak_requested_bytes: s.peak_requested_bytes,
            peak_reserved_bytes: s.peak_reserved_bytes,
            live_regions: s.live_regions,
            allocations: s.allocations,
            frees: s.frees,
            pending_frees: s.pending_frees,
            chunks: s.chunks,
            source_alloc_calls: s.source_alloc_calls,
            source_free_calls: s.source_free_calls,
            ooms: s.ooms,
            cached_bytes: s.cached_bytes,
            cached_regions: s.cached_regions,
        };
        // SAFETY: non-null, and the caller gives a writable ap_stats.
        unsafe { out.as_ptr().write(stats) };
        Ok(())
    })
}

/// Checks every invariant of the pool ([`Pool::validate`]): its chunks, engines, caches and
/// counters.
#[no_mangle]
pub extern "C" fn ap_pool_validate(pool: u64) -> Status {
    run(|| Ok(entry(pool)?.pool.validate()?))
}

/// Gives empty chunks back to the source; the bytes released in `*released` when it is not
/// NULL. First destroys the streams [`ap_stream_destroy`] had to keep that have run their work
/// ([`Pool::trim`]).
///
/// # Safety
/// `released` is NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn ap_pool_trim(pool: u64, released: *mut u64) -> Status {
    run(|| {
        let bytes = entry(pool)?.pool.trim();
        if let Some(out) = NonNull::new(released) {
            // SAFETY: non-null, and the caller gives a writable u64.
            unsafe { out.as_ptr().write(bytes) };
        }
        Ok(())
    })
}

/// Waits until every free waiting on a stream has completed ([`Pool::synchronize`]), after
/// waiting for and destroying the streams [`ap_stream_destroy`] had to keep.
#[no_mangle]
pub extern "C" fn ap_pool_synchronize(pool: u64) -> Status {
    run(|| Ok(entry(pool)?.pool.synchronize()?))
}

/// Lowers every kind's peaks to its current figures ([`Pool::reset_peak_stats`]): the peaks
/// [`ap_pool_stats`] reads afterwards are those of what ran since.
#[no_mangle]
pub extern "C" fn ap_pool_reset_peak_stats(pool: u64) -> Status {
    run(|| {
        entry(pool)?.pool.reset_peak_stats();
        Ok(())
    })
}

/// Hands `items` to a caller's buffer of `cap` at `buf`, all or nothing: `*needed` gets their
/// number either way, and a buffer too small (or NULL, unless there are no items) gets
/// [`Status::BufferTooSmall`].
///
/// # Safety
/// `buf` is NULL or valid for writes of `cap` items.
unsafe fn hand_over<T: Copy>(
    items: &[T],
    buf: *mut T,
    cap: usize,
    needed: NonNull<usize>,
) -> Result<(), Failure> {
    // SAFETY: the callers checked `needed`, a writable size_t of the caller's.
    unsafe { needed.as_ptr().write(items.len()) };
    // No items (an empty leak report) is the whole answer: the size-asking call with no
    // buffer has it, and the second call of the usual pattern may pass a NULL from malloc(0).
    if items.is_empty() {
        return Ok(());
    }
    if buf.is_null() || cap < items.len() {
        return Err(Failure::TooSmall {
            needed: items.len(),
            cap: if buf.is_null() { 0 } else { cap },
        });
    }
    // SAFETY: `buf` holds `cap >= items.len()` writable items; `items` is the library's own
    // allocation, so the two do not overlap.
    unsafe { std::ptr::copy_nonoverlapping(items.as_ptr(), buf, items.len()) };
    Ok(())
}

/// Hands `text` and a terminating NUL to a caller's buffer, as [`hand_over`].
///
/// # Safety
/// As [`hand_over`].
unsafe fn hand_over_text(
    text: String,
    buf: *mut c_char,
    cap: usize,
    needed: NonNull<usize>,
) -> Result<(), Failure> {
    let mut bytes = text.into_bytes();
    bytes.push(0);
    // SAFETY: as the caller's contract.
    unsafe { hand_over(&bytes, buf.cast::<u8>(), cap, needed) }
}

/// The pool's snapshot rendered as text by `render`, handed over as [`hand_over_text`].
///
/// # Safety
/// As [`ap_pool_snapshot_json`].
unsafe fn snapshot_as(
    pool: u64,
    buf: *mut c_char,
    cap: usize,
    needed: *mut usize,
    render: impl FnOnce(&ascend_pool::pool::PoolSnapshot) -> Result<String, Failure>,
) -> Status {
    run(|| {
        let needed = non_null(needed, "needed")?;
        let text = render(&entry(pool)?.pool.snapshot())?;
        // SAFETY: as the caller's contract.
        unsafe { hand_over_text(text, buf, cap, needed) }
    })
}

/// The live segments of every kind, by address ([`Pool::leak_report`]): regions not freed,
/// and freed ones whose memory waits for a stream (`pending`). `*count` gets their number; a
/// buffer of fewer than `*count` entries (or NULL) gets nothing and
/// [`Status::BufferTooSmall`], so a first call with `cap` 0 asks for the size. With no live
/// segment, any buffer (NULL included) gets the empty answer and [`Status::Ok`].
///
/// # Safety
/// `out` is NULL or valid for writes of `cap` entries; `count` is NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn ap_pool_leak_report(
    pool: u64,
    out: *mut SegmentInfo,
    cap: usize,
    count: *mut usize,
) -> Status {
    run(|| {
        let count = non_null(count, "count")?;
        let segments: Vec<SegmentInfo> = entry(pool)?
            .pool
            .leak_report()
            .iter()
            .map(|s| SegmentInfo {
                addr: s.addr as u64,
                offset: s.offset,
                len: s.len,
                footprint: s.footprint,
                kind: s.kind.index() as u32,
                pending: u32::from(s.pending),
            })
            .collect();
        // SAFETY: as this function's contract.
        unsafe { hand_over(&segments, out, cap, count) }
    })
}

/// The padding overruns debug mode found since the last call
/// ([`Pool::take_corruption_reports`]), taking them: those an [`ap_free`] answered with
/// [`Status::Corruption`], and those no call could answer (a region freed by another thread's
/// call that still held it, or by the drop of a shared buffer's last handle). `*count` gets
/// their number; a buffer of fewer (or NULL) gets nothing, takes nothing and gets
/// [`Status::BufferTooSmall`]. With none, any buffer (NULL included) gets `*count` 0 and
/// [`Status::Ok`]. The pool keeps at most 1,024 between two calls; every one is printed.
///
/// # Safety
/// `out` is NULL or valid for writes of `cap` entries; `count` is NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn ap_pool_take_corruption_reports(
    pool: u64,
    out: *mut CorruptionInfo,
    cap: usize,
    count: *mut usize,
) -> Status {
    run(|| {
        let count = non_null(count, "count")?;
        // A NULL buffer holds nothing, whatever `cap` says.
        let room = if out.is_null() { 0 } else { cap };
        let reports = match entry(pool)?.pool.take_corruption_reports_within(room) {
            Ok(reports) => reports,
            Err(needed) => {
                // SAFETY: `count` is the caller's writable size_t.
                unsafe { count.as_ptr().write(needed) };
                return Err(Failure::TooSmall { needed, cap: room });
            }
        };
        let infos: Vec<CorruptionInfo> = reports
            .iter()
            .filter_map(|e| match *e {
                Error::Corruption {
                    kind,
                    offset,
                    len,
                    first_bad,
                } => Some(CorruptionInfo {
                    offset,
                    len,
                    first_bad,
                    kind: kind.index() as u32,
                    reserved: 0,
                }),
                _ => None,
            })
            .collect();
        // SAFETY: as this function's contract; `infos` fits in `room` entries.
        unsafe { hand_over(&infos, out, cap, count) }
    })
}

/// The pool's chunks and live segments as JSON ([`Pool::snapshot`], the schema of the Rust
/// `PoolSnapshot`: with the device kinds' total, `device_reserved_bytes`, and `total_limit`
/// when one is set), NUL-terminated: `*needed` gets its bytes with the NUL; a smaller buffer
/// (or NULL) gets nothing and [`Status::BufferTooSmall`].
///
/// # Safety
/// `buf` is NULL or valid for writes of `cap` bytes; `needed` is NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn ap_pool_snapshot_json(
    pool: u64,
    buf: *mut c_char,
    cap: usize,
    needed: *mut usize,
) -> Status {
    // SAFETY: as this function's contract.
    unsafe {
        snapshot_as(pool, buf, cap, needed, |snap| {
            serde_json::to_string(snap)
                .map_err(|e| Failure::Lib(Error::Invalid(format!("snapshot as JSON: {e}"))))
        })
    }
}

/// A picture of the pool as SVG: each chunk a bar of allocated, padding and free bytes
/// ([`ascend_pool::svg::pool_state`]). The buffer as [`ap_pool_snapshot_json`]'s.
///
/// # Safety
/// As [`ap_pool_snapshot_json`].
#[no_mangle]
pub unsafe extern "C" fn ap_pool_picture_svg(
    pool: u64,
    buf: *mut c_char,
    cap: usize,
    needed: *mut usize,
) -> Status {
    // SAFETY: as this function's contract.
    unsafe {
        snapshot_as(pool, buf, cap, needed, |snap| {
            Ok(ascend_pool::svg::pool_state(snap, &format!("pool {pool}")))
        })
    }
}

/// Writes out the trace a pool with `record:PATH` in its configuration has buffered
/// ([`Pool::flush_record`]); [`Status::Io`] names the first write error since the pool
/// was created. Without recording, does nothing.
#[no_mangle]
pub extern "C" fn ap_pool_flush_record(pool: u64) -> Status {
    run(|| Ok(entry(pool)?.pool.flush_record()?))
}

/// Allocates, then publishes the handle; nothing is handed out when `out` is NULL.
fn alloc_with(
    pool: u64,
    out: *mut u64,
    f: impl FnOnce(&Entry) -> Result<AnyRegion, Failure>,
) -> Result<(), Failure> {
    let out = non_null(out, "out")?;
    let e = entry(pool)?;
    let handle = e.insert(f(&e)?)?;
    // SAFETY: non-null, and the caller gives a writable u64.
    unsafe { out.as_ptr().write(handle) };
    Ok(())
}

/// Allocates `len` bytes of `kind` (an `ap_kind`): 64-byte starts, 128 for DVPP.
///
/// # Safety
/// `out` is NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn ap_alloc(pool: u64, kind: c_int, len: u64, out: *mut u64) -> Status {
    run(|| {
        alloc_with(pool, out, |e| {
            let p = &e.pool;
            Ok(match mem_kind(p, kind)? {
                MemKind::Dvpp => AnyRegion::Dvpp(p.alloc_dvpp(len)?),
                MemKind::Host => AnyRegion::Host(p.alloc_host(len)?),
                k => AnyRegion::Device(p.alloc_device_kind(k, len)?),
            })
        })
    })
}

/// Device memory (the pool's policy) starting at a multiple of `align`, a power of two from
/// 64 to 1 GiB ([`Pool::alloc_device_aligned`]; another is [`Status::InvalidSize`]).
///
/// # Safety
/// `out` is NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn ap_alloc_aligned(
    pool: u64,
    len: u64,
    align: u64,
    out: *mut u64,
) -> Status {
    run(|| {
        alloc_with(pool, out, |e| {
            Ok(AnyRegion::Device(e.pool.alloc_device_aligned(len, align)?))
        })
    })
}

/// Device memory with 128-byte starts, fit for model input.
///
/// # Safety
/// `out` is NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn ap_alloc_model_input(pool: u64, len: u64, out: *mut u64) -> Status {
    run(|| {
        alloc_with(pool, out, |e| {
            Ok(AnyRegion::Model(e.pool.alloc_model_input(len)?))
        })
    })
}

/// Device or DVPP memory for work ordered on `stream` ([`Pool::alloc_device_on`]); other
/// kinds are refused with [`Status::WrongKind`].
///
/// # Safety
/// `out` is NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn ap_alloc_on(
    pool: u64,
    kind: c_int,
    len: u64,
    stream: u64,
    out: *mut u64,
) -> Status {
    run(|| {
        alloc_with(pool, out, |e| {
            let p = &e.pool;
            let kind = mem_kind(p, kind)?;
            let s = e.stream(stream)?;
            Ok(match kind {
                MemKind::Device(_) => AnyRegion::Device(p.alloc_device_on(len, &s)?),
                MemKind::Dvpp => AnyRegion::Dvpp(p.alloc_dvpp_on(len, &s)?),
                got => {
                    return Err(Error::WrongKind {
                        expected: "device or dvpp",
                        got,
                    }
                    .into())
                }
            })
        })
    })
}

/// Model input (device memory, 128-byte starts) for work ordered on `stream`
/// ([`Pool::alloc_model_input_on`]): as [`ap_alloc_model_input`], with reuse ordered on the
/// stream as [`ap_alloc_on`]'s.
///
/// # Safety
/// `out` is NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn ap_alloc_model_input_on(
    pool: u64,
    len: u64,
    stream: u64,
    out: *mut u64,
) -> Status {
    run(|| {
        alloc_with(pool, out, |e| {
            let s = e.stream(stream)?;
            Ok(AnyRegion::Model(e.pool.alloc_model_input_on(len, &s)?))
        })
    })
}

/// Frees a region. Streams with work queued on it delay the reuse of its memory, not the
/// call. In debug mode, an overwritten padding is reported as [`Status::Corruption`] (the
/// region is freed all the same).
#[no_mangle]
pub extern "C" fn ap_free(pool: u64, region: u64) -> Status {
    run(|| {
        let e = entry(pool)?;
        let found = lock(e.table(region)).remove(&region);
        let r = found.ok_or_else(|| e.gone(Failure::BadRegion(region)))?;
        // Another thread's call still holding it frees it when done (its drop reports an
        // overrun to the pool's corruption list instead).
        if let Some(r) = take_region(r) {
            with_region!(r, x => x.free())?;
        }
        Ok(())
    })
}

/// Where a region lies, how long it is, its start alignment and kind.
///
/// Work the caller gives the address itself is ordered by the caller: memory
/// [`ap_alloc_on`] took over behind its stream's work may still have that work to run
/// ([`Region::addr`] says what orders a use after it: the same stream, [`ap_record_stream`]
/// for another, [`ap_stream_synchronize`] of that stream for the host or no stream). The
/// library's own calls do this themselves.
///
/// # Safety
/// `out` is NULL or valid for a write of a [`RegionInfo`].
#[no_mangle]
pub unsafe extern "C" fn ap_region_get_info(
    pool: u64,
    region: u64,
    out: *mut RegionInfo,
) -> Status {
    run(|| {
        let out = non_null(out, "out")?;
        let r = entry(pool)?.region(region)?;
        let r = hold(&r);
        let info = with_region!(&*r, x => RegionInfo {
            addr: x.addr() as u64,
            len: x.len(),
            align: x.align(),
            kind: x.kind().index() as u32,
            reserved: 0,
        });
        // SAFETY: non-null, and the caller gives a writable ap_region_info.
        unsafe { out.as_ptr().write(info) };
        Ok(())
    })
}

/// The bytes of a host region, after every stream with work queued on it has run that work
/// ([`HostRegion::try_as_mut_slice`]); other kinds are refused with [`Status::WrongKind`].
///
/// # Safety
/// `out` is NULL or valid for a write. The bytes stay valid until the region is freed; the
/// caller must not touch them while it has work of its own queued on them.
#[no_mangle]
pub unsafe extern "C" fn ap_host_ptr(pool: u64, region: u64, out: *mut *mut c_void) -> Status {
    run(|| {
        let out = non_null(out, "out")?;
        let r = entry(pool)?.region(region)?;
        let mut r = hold(&r);
        let AnyRegion::Host(h) = &mut *r else {
            let got = with_region!(&*r, x => x.kind());
            return Err(Error::WrongKind {
                expected: "host",
                got,
            }
            .into());
        };
        let ptr = h.try_as_mut_slice()?.as_mut_ptr();
        // SAFETY: non-null, and the caller gives a writable pointer.
        unsafe { out.as_ptr().write(ptr.cast()) };
        Ok(())
    })
}

/// Marks a region as used by work the caller queued on `stream`: its memory is reused only
/// after that work has run.
#[no_mangle]
pub extern "C" fn ap_record_stream(pool: u64, region: u64, stream: u64) -> Status {
    run(|| {
        let e = entry(pool)?;
        let r = e.region(region)?;
        let s = e.stream(stream)?;
        let r = hold(&r);
        Ok(with_region!(&*r, x => x.record_stream(&s))?)
    })
}

/// A caller's host buffer of `len` bytes to read, checked as [`host_buffer`] checks it.
///
/// # Safety
/// `p` is valid for reads of `len` bytes, which nothing writes meanwhile, if it is not NULL.
unsafe fn host_bytes<'a>(p: *const c_void, offset: u64, len: u64) -> Result<&'a [u8], Failure> {
    let (p, n) = host_buffer(p.cast_mut(), offset, len)?;
    // SAFETY: the caller gives `len` readable bytes at `p` (checked non-null unless empty,
    // `p` dangling and aligned then); they are only read.
    Ok(unsafe { std::slice::from_raw_parts(p.cast_const(), n) })
}

/// A caller's host buffer of `len` bytes to write, checked as [`host_buffer`] checks it.
///
/// # Safety
/// `p` is valid for writes of `len` bytes, which nothing else uses meanwhile, if it is not
/// NULL.
unsafe fn host_bytes_mut<'a>(
    p: *mut c_void,
    offset: u64,
    len: u64,
) -> Result<&'a mut [u8], Failure> {
    let (p, n) = host_buffer(p, offset, len)?;
    // SAFETY: the caller gives `len` writable bytes at `p` that nothing else uses meanwhile
    // (checked non-null unless empty, `p` dangling and aligned then).
    Ok(unsafe { std::slice::from_raw_parts_mut(p, n) })
}

/// Checks a caller's host buffer of `len` bytes: non-null unless empty, and short enough to
/// be a slice (a longer one fits no region: [`Status::OutOfBounds`]).
fn host_buffer(p: *mut c_void, offset: u64, len: u64) -> Result<(*mut u8, usize), Failure> {
    if len == 0 {
        // The pool refuses empty copies itself; no pointer is needed to say so.
        return Ok((NonNull::dangling().as_ptr(), 0));
    }
    let p = non_null(p, "host buffer")?;
    let n = usize::try_from(len)
        .ok()
        .filter(|&n| n <= isize::MAX as usize)
        .ok_or(Failure::HostTooLong { offset, len })?;
    Ok((p.as_ptr().cast(), n))
}

/// Copies `len` bytes from host memory at `src` into `dst` at `offset`, and waits.
///
/// # Safety
/// `src` is valid for reads of `len` bytes (NULL only if `len` is 0), which nothing writes
/// during the call: the bytes the call writes may not overlap them.
#[no_mangle]
pub unsafe extern "C" fn ap_copy_from_host(
    pool: u64,
    dst: u64,
    offset: u64,
    src: *const c_void,
    len: u64,
) -> Status {
    run(|| {
        let e = entry(pool)?;
        let r = e.region(dst)?;
        // SAFETY: as this function's contract.
        let bytes = unsafe { host_bytes(src, offset, len)? };
        let mut r = hold(&r);
        Ok(with_region!(&mut *r, x => e.pool.copy_from_host(x, offset, bytes))?)
    })
}

/// Copies `len` bytes of `src` from `offset` into host memory at `dst`, and waits.
///
/// # Safety
/// `dst` is valid for writes of `len` bytes (NULL only if `len` is 0), which nothing else
/// uses during the call: the bytes the call reads may not overlap them.
#[no_mangle]
pub unsafe extern "C" fn ap_copy_to_host(
    pool: u64,
    src: u64,
    offset: u64,
    dst: *mut c_void,
    len: u64,
) -> Status {
    run(|| {
        let e = entry(pool)?;
        let r = e.region(src)?;
        // SAFETY: as this function's contract.
        let out = unsafe { host_bytes_mut(dst, offset, len)? };
        let r = hold(&r);
        Ok(with_region!(&*r, x => e.pool.copy_to_host(x, offset, out))?)
    })
}

/// Copies `len` bytes between two regions of the pool, and waits.
#[no_mangle]
pub extern "C" fn ap_copy(
    pool: u64,
    dst: u64,
    dst_offset: u64,
    src: u64,
    src_offset: u64,
    len: u64,
) -> Status {
    run(|| {
        let e = entry(pool)?;
        e.pair(dst, src, |d, s| {
            Ok(with_region!(d, d => with_region!(s, s =>
                e.pool.copy(d, dst_offset, s, src_offset, len)))?)
        })
    })
}

/// Fills `len` bytes of `dst` from `offset` with `value`, and waits.
#[no_mangle]
pub extern "C" fn ap_memset(pool: u64, dst: u64, offset: u64, value: u8, len: u64) -> Status {
    run(|| {
        let e = entry(pool)?;
        let r = e.region(dst)?;
        let mut r = hold(&r);
        Ok(with_region!(&mut *r, x => e.pool.memset(x, offset, value, len))?)
    })
}

/// Creates a stream on the pool's device.
///
/// # Safety
/// `out` is NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn ap_stream_create(pool: u64, out: *mut u64) -> Status {
    run(|| {
        let out = non_null(out, "out")?;
        let e = entry(pool)?;
        let stream = e.pool.create_stream()?;
        let handle = e.file(&e.streams, next_handle(), Arc::new(stream))?;
        // SAFETY: non-null, and the caller gives a writable u64.
        unsafe { out.as_ptr().write(handle) };
        Ok(())
    })
}

/// Waits for the work queued on `stream` so far.
#[no_mangle]
pub extern "C" fn ap_stream_synchronize(pool: u64, stream: u64) -> Status {
    run(|| Ok(entry(pool)?.stream(stream)?.synchronize()?))
}

/// Orders the work queued on `stream` after this call after the work queued on `other` before
/// it, and returns at once ([`Stream::wait_for`]); both are streams of the pool.
#[no_mangle]
pub extern "C" fn ap_stream_wait(pool: u64, stream: u64, other: u64) -> Status {
    run(|| {
        let e = entry(pool)?;
        let (s, o) = (e.stream(stream)?, e.stream(other)?);
        Ok(s.wait_for(&o)?)
    })
}

/// Waits for the stream's work, then destroys it (at once, or when a call using it in
/// another thread ends); the handle goes even when the wait fails (the runtime's error is
/// returned). A stream the runtime will not wait for when it is destroyed is kept instead, not
/// destroyed under work it may still run: [`ap_pool_synchronize`] and [`ap_pool_trim`] destroy
/// it later ([`Pool::synchronize`], [`Pool::trim`]).
#[no_mangle]
pub extern "C" fn ap_stream_destroy(pool: u64, stream: u64) -> Status {
    run(|| {
        let e = entry(pool)?;
        let found = lock(&e.streams).remove(&stream);
        let s = found.ok_or_else(|| e.gone(Failure::BadStream(stream)))?;
        Ok(s.synchronize()?)
    })
}

/// Queues a copy of `len` bytes between two regions on `stream`; both ends must be 64-byte
/// aligned and not both host memory, and both regions are recorded on the stream
/// ([`Pool::copy_async`]).
#[no_mangle]
pub extern "C" fn ap_copy_async(
    pool: u64,
    dst: u64,
    dst_offset: u64,
    src: u64,
    src_offset: u64,
    len: u64,
    stream: u64,
) -> Status {
    run(|| {
        let e = entry(pool)?;
        let s = e.stream(stream)?;
        e.pair(dst, src, |d, src| {
            Ok(with_region!(d, d => with_region!(src, src =>
                e.pool.copy_async(d, dst_offset, src, src_offset, len, &s)))?)
        })
    })
}

/// Queues a fill of `len` bytes of `dst` from `offset` on `stream`; the region is recorded
/// on the stream.
#[no_mangle]
pub extern "C" fn ap_memset_async(
    pool: u64,
    dst: u64,
    offset: u64,
    value: u8,
    len: u64,
    stream: u64,
) -> Status {
    run(|| {
        let e = entry(pool)?;
        let s = e.stream(stream)?;
        let r = e.region(dst)?;
        let mut r = hold(&r);
        Ok(with_region!(&mut *r, x => e.pool.memset_async(x, offset, value, len, &s))?)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use ascend_pool::align::CarveRuleError;
    use ascend_pool::AclError;

    /// The status of every library error, including those the handle tables keep the pool
    /// from ever returning through this interface (another pool's handle, a freed one).
    #[test]
    fn every_error_has_its_status() {
        let kind = MemKind::Dvpp;
        let code = AclError(207001);
        let cases = [
            (
                Error::Carve(CarveRuleError::ZeroLength),
                Status::InvalidSize,
            ),
            (
                Error::Runtime {
                    func: "aclrtMalloc",
                    code,
                },
                Status::Runtime,
            ),
            (
                Error::OutOfMemory {
                    kind,
                    requested: 1,
                    reserved: 0,
                    in_use: 0,
                    largest_free: 0,
                    source: Some(code),
                    elsewhere: Vec::new(),
                },
                Status::OutOfMemory,
            ),
            (
                Error::LimitExceeded {
                    kind,
                    requested: 1,
                    limit: 0,
                    reserved: 0,
                    in_use: 0,
                    largest_free: 0,
                },
                Status::LimitExceeded,
            ),
            (
                Error::TotalLimitExceeded {
                    kind,
                    requested: 1,
                    limit: 0,
                    reserved: 0,
                    in_use: 0,
                    largest_free: 0,
                    elsewhere: Vec::new(),
                },
                Status::LimitExceeded,
            ),
            (Error::ForeignHandle, Status::BadRegion),
            (Error::AlreadyFreed, Status::BadRegion),
            (
                Error::OutOfBounds {
                    offset: 1,
                    len: 1,
                    capacity: 1,
                    side: None,
                },
                Status::OutOfBounds,
            ),
            (
                Error::Misaligned {
                    addr: 32,
                    required: 64,
                    side: None,
                },
                Status::Misaligned,
            ),
            (
                Error::WrongKind {
                    expected: "host",
                    got: kind,
                },
                Status::WrongKind,
            ),
            (
                Error::NotSupported {
                    func: "aclrtMapMem",
                },
                Status::NotSupported,
            ),
            (
                Error::LibraryLoad {
                    library: "x".into(),
                    reason: "y".into(),
                },
                Status::LibraryLoad,
            ),
            (Error::Config("z".into()), Status::Config),
            (
                Error::Io {
                    op: "write",
                    path: "/dev/full".into(),
                    reason: "no space".into(),
                },
                Status::Io,
            ),
            (
                Error::Corruption {
                    kind,
                    offset: 0,
                    len: 1,
                    first_bad: 40,
                },
                Status::Corruption,
            ),
            (Error::Invalid("w".into()), Status::InvalidState),
            (Error::ShareGone { handle: 5 }, Status::ShareGone),
            (
                Error::ShareRefused { handle: 5, pid: 77 },
                Status::ShareRefused,
            ),
            (
                Error::ShareAccessFixed {
                    handle: 5,
                    any_process: true,
                },
                Status::ShareAccessFixed,
            ),
        ];
        for (e, want) in cases {
            assert_eq!(Status::of(&e), want, "{e}");
            let f = Failure::Lib(e.clone());
            assert_eq!((f.status(), f.message()), (want, e.to_string()));
        }
    }

    /// A shard's handles come in runs of consecutive numbers (one thread's block); the hash
    /// must still spread them over a table's buckets (its low bits) and tags (its top seven
    /// bits), as a random hash would.
    #[test]
    fn one_shards_handles_spread_over_a_tables_buckets() {
        use std::collections::HashSet;
        use std::hash::{BuildHasher, BuildHasherDefault, Hasher};
        let build = BuildHasherDefault::<HandleHasher>::default();
        let block = 3 * HANDLE_BLOCK;
        let hashes: Vec<u64> = (block..block + 1024).map(|h| build.hash_one(h)).collect();
        let buckets: HashSet<u64> = hashes.iter().map(|h| h & 1023).collect();
        let tags: HashSet<u64> = hashes.iter().map(|h| h >> 57).collect();
        // A random hash fills about 647 of 1,024 buckets and all 128 tags.
        assert!(buckets.len() >= 600, "{} buckets", buckets.len());
        assert!(tags.len() >= 120, "{} tags", tags.len());
        let bytes = |b: &[u8]| {
            let mut h = HandleHasher::default();
            h.write(b);
            h.finish()
        };
        assert_ne!(bytes(b"ab"), bytes(b"ba"));
        assert_ne!(bytes(b"a"), bytes(b"b"));
    }

    fn spares() -> usize {
        SPARES.with(|s| s.borrow().len())
    }

    fn live_host(pool: &Pool) -> u64 {
        pool.stats(MemKind::Host).live_regions
    }

    fn sim_pool() -> Pool {
        Pool::new(Arc::new(SimSource::default()), PoolConfig::default()).unwrap()
    }

    /// A cell (a spare, if this thread has one) holding a new host region of `len` bytes.
    fn host_cell(pool: &Pool, len: u64) -> RegionCell {
        spare_cell(AnyRegion::Host(pool.alloc_host(len).unwrap()))
    }

    /// A freed region's cell serves the thread's next allocation; a cell another call still
    /// holds is left to that call, whose drop frees the region.
    #[test]
    fn a_freed_regions_cell_is_reused_unless_a_call_still_holds_it() {
        let pool = sim_pool();
        let before = spares();
        let cell = host_cell(&pool, 100);
        let at = Arc::as_ptr(&cell);
        let r = take_region(cell).expect("the only owner takes the region");
        assert_eq!(spares(), before + 1);
        assert_eq!(
            live_host(&pool),
            1,
            "taking it out of its cell does not free it"
        );
        with_region!(r, x => x.free()).unwrap();
        assert_eq!(live_host(&pool), 0);

        let cell = host_cell(&pool, 200);
        assert_eq!(Arc::as_ptr(&cell), at, "the spare is used again");
        assert_eq!(spares(), before);
        assert_eq!(with_region!(&*hold(&cell), x => x.len()), 200);

        // A copy on another thread still holds the cell when the free takes it out of its table.
        let copy = Arc::clone(&cell);
        assert!(take_region(cell).is_none());
        assert_eq!(spares(), before, "a shared cell is not kept");
        assert_eq!(live_host(&pool), 1);
        drop(copy);
        assert_eq!(
            live_host(&pool),
            0,
            "the last holder's drop frees the region"
        );
    }

    #[test]
    fn a_poisoned_cell_is_not_kept_and_spares_are_bounded() {
        let pool = sim_pool();
        let before = spares();
        let cell = host_cell(&pool, 64);
        let c = Arc::clone(&cell);
        let _ = std::thread::spawn(move || {
            let _g = c.lock().unwrap();
            panic!("a call panics while it holds the region");
        })
        .join();
        assert!(cell.is_poisoned());
        let r = take_region(cell).expect("the region still comes out");
        assert_eq!(spares(), before);
        drop(r);
        assert_eq!(live_host(&pool), 0);

        let cells: Vec<_> = (0..SPARE_CELLS + 10)
            .map(|_| host_cell(&pool, 64))
            .collect();
        for c in cells {
            drop(take_region(c));
        }
        assert_eq!(spares(), SPARE_CELLS);
        assert_eq!(live_host(&pool), 0);
    }

    /// A stream `ap_pool_destroy` could not destroy (its synchronize refused at its drop as
    /// well as before) is kept; the pool's last synchronize in the destroy retries it, so once
    /// the runtime answers again it is destroyed there. No C call could reach it afterwards:
    /// the pool, and its simulator with it, would live on for good.
    #[test]
    fn a_pool_destroy_retries_the_streams_it_kept() {
        use ascend_pool::region::streams_kept_on;
        use ascend_pool::source::sim::{AclFunc, Fault};
        let sim = Arc::new(simulator().unwrap());
        let pool = Pool::new(
            Arc::clone(&sim) as Arc<dyn BlockSource>,
            PoolConfig::default(),
        );
        let handle = file_pool(pool.unwrap(), None);
        let mut stream = 0;
        // SAFETY: a writable u64.
        assert_eq!(unsafe { ap_stream_create(handle, &mut stream) }, Status::Ok);
        // The destroy's wait and the stream's drop are refused; the runtime answers after.
        sim.inject_fault(Fault::next(
            AclFunc::SynchronizeStream,
            AclError::RT_FAILURE,
            2,
        ));
        // SAFETY: NULL asks for no count.
        let status = unsafe { ap_pool_destroy(handle, std::ptr::null_mut()) };
        assert_eq!(status, Status::Runtime, "the refused wait is reported");
        assert_eq!(
            (streams_kept_on(&*sim), sim.stats().live_streams),
            (0, 0),
            "a stream kept by the destroy outlived it"
        );
    }

    #[test]
    fn a_panic_is_a_status_with_its_message() {
        let s = run(|| panic!("no such thing"));
        assert_eq!(s, Status::Panic);
        LAST_ERROR.with(|m| assert_eq!(m.borrow().message, "internal error: no such thing"));
        let s = run(|| std::panic::panic_any(format!("code {}", 7)));
        assert_eq!(s, Status::Panic);
        LAST_ERROR.with(|m| assert_eq!(m.borrow().message, "internal error: code 7"));
        assert_eq!(run(|| Ok(())), Status::Ok);
        LAST_ERROR.with(|m| assert!(m.borrow().message.is_empty()));
    }
}
