//! Arbitrary operation sequences against the public pool API on the simulator: every typed
//! region, the stream-ordered allocations, copies and fills in and out of bounds, sub-regions,
//! foreign handles, on a small machine so memory runs out often, over the simulator itself or
//! over virtual memory mapped from it, with runtime calls failing on demand. After every
//! operation the pool validates, every refusal is the typed error the contract names, the
//! counters agree with the regions alive, and the first bytes of every region match a shadow
//! copy; at the end nothing is lost.
#![no_main]

use arbitrary::Arbitrary;
use ascend_pool::align::{CarveRule, CarveRuleError};
use ascend_pool::engine::{EngineConfig, RangeTier};
use ascend_pool::region::{
    Align128, AsyncCopySafe, DeviceRegion, DvppRegion, HostRegion, Region, SubRegion,
};
use ascend_pool::source::sim::{AclFunc, Fault, FaultTimes, SimConfig, SimSource};
use ascend_pool::source::vmm::{VmmConfig, VmmSource};
use ascend_pool::source::BlockSource;
use ascend_pool::{AclError, Error, MallocPolicy, MemKind, Pool, PoolConfig, Stream};
use libfuzzer_sys::fuzz_target;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Operations run per input: enough to fill and drain a small machine, few enough that an
/// input runs in milliseconds.
const MAX_OPS: usize = 300;
/// Leading bytes of each region whose contents the shadow tracks.
const HEAD: u64 = 4096;
/// Longest host buffer a copy uses (longer requests are cut to this).
const HOST_BUF_MAX: u64 = 256 << 10;
/// Longest span read back to check a copy or fill.
const CHECK_MAX: u64 = 64 << 10;
const STREAMS: usize = 2;
const MIB: u64 = 1 << 20;

/// A length for an allocation.
#[derive(Arbitrary, Debug, Clone, Copy)]
enum Len {
    Small(u16),
    Big(u32),
    Mib(u8),
    NearMax(u16),
    Zero,
    Raw(u64),
}

impl Len {
    fn get(self) -> u64 {
        match self {
            Len::Small(n) => u64::from(n),
            Len::Big(n) => u64::from(n) % (40 * MIB),
            Len::Mib(n) => (u64::from(n % 24) + 1) * MIB - u64::from(n / 24),
            Len::NearMax(d) => u64::MAX - u64::from(d),
            Len::Zero => 0,
            Len::Raw(n) => n,
        }
    }
}

/// An offset into a region of `cap` bytes.
#[derive(Arbitrary, Debug, Clone, Copy)]
enum Off {
    Start,
    Inside(u32),
    Aligned(u32),
    FromEnd(u16),
    Raw(u64),
}

impl Off {
    fn get(self, cap: u64) -> u64 {
        match self {
            Off::Start => 0,
            Off::Inside(x) => u64::from(x) % cap.max(1),
            Off::Aligned(x) => u64::from(x) % cap.max(1) / 64 * 64,
            Off::FromEnd(b) => cap.saturating_sub(u64::from(b)),
            Off::Raw(x) => x,
        }
    }
}

/// A byte count from offset `off` in a region of `cap` bytes.
#[derive(Arbitrary, Debug, Clone, Copy)]
enum Count {
    Small(u16),
    /// The rest of the region, at most `CHECK_MAX`.
    Rest,
    /// One byte more than the rest.
    PastEnd,
    Zero,
    Raw(u64),
}

impl Count {
    fn get(self, cap: u64, off: u64) -> u64 {
        let rest = cap.saturating_sub(off);
        match self {
            Count::Small(n) => u64::from(n),
            Count::Rest => rest.min(CHECK_MAX),
            Count::PastEnd => rest + 1,
            Count::Zero => 0,
            Count::Raw(n) => n,
        }
    }
}

#[derive(Arbitrary, Debug, Clone, Copy)]
enum AllocWhat {
    Device,
    DeviceKind {
        kind: u8,
        policy: u8,
    },
    ModelInput,
    Dvpp,
    Host,
    DeviceOn {
        stream: u8,
    },
    DvppOn {
        stream: u8,
    },
    /// Device memory at a start of `1 << (log % 34)`: below 64 and above 1 GiB refused.
    DeviceAligned {
        log: u8,
    },
}

/// What to do with a sub-region of a live region.
#[derive(Arbitrary, Debug, Clone, Copy)]
enum SubOp {
    Write {
        off: Off,
        count: Count,
        seed: u8,
    },
    Read {
        off: Off,
        count: Count,
    },
    Fill {
        off: Off,
        count: Count,
        value: u8,
    },
    FillAsync {
        off: Off,
        count: Count,
        value: u8,
        stream: u8,
    },
    /// A queued copy into the sub-region from another live region.
    AsyncFrom {
        src: u8,
        dst_off: Off,
        src_off: Off,
        count: Count,
        stream: u8,
    },
}

/// Uses of another pool's region or stream, each of which must be refused.
#[derive(Arbitrary, Debug, Clone, Copy)]
enum ForeignOp {
    CopyFromHost,
    CopyToHost,
    CopyInto { idx: u8 },
    CopyFrom { idx: u8 },
    Memset,
    AllocOn { len: Len, dvpp: bool },
    CopyAsyncOn { dst: u8, src: u8 },
    MemsetAsyncOn { idx: u8 },
    RecordStreamOn { idx: u8 },
}

/// A runtime function the pool calls to get, map, give back or fence memory: the ones a
/// failure of which must leave the pool intact. The copies are not faulted, since the
/// harness needs them to check contents; the waits are, and the harness's own checks
/// retry them (see [`retry`]).
#[derive(Arbitrary, Debug, Clone, Copy)]
enum FaultOn {
    Malloc,
    MallocAlign32,
    MallocCached,
    DvppMalloc,
    MallocHost,
    MallocPhysical,
    MapMem,
    Free,
    DvppFree,
    FreeHost,
    UnmapMem,
    FreePhysical,
    CreateEvent,
    RecordEvent,
    QueryEventStatus,
    SynchronizeEvent,
    SynchronizeStream,
    StreamWaitEvent,
}

impl FaultOn {
    fn func(self) -> AclFunc {
        match self {
            Self::Malloc => AclFunc::Malloc,
            Self::MallocAlign32 => AclFunc::MallocAlign32,
            Self::MallocCached => AclFunc::MallocCached,
            Self::DvppMalloc => AclFunc::DvppMalloc,
            Self::MallocHost => AclFunc::MallocHost,
            Self::MallocPhysical => AclFunc::MallocPhysical,
            Self::MapMem => AclFunc::MapMem,
            Self::Free => AclFunc::Free,
            Self::DvppFree => AclFunc::DvppFree,
            Self::FreeHost => AclFunc::FreeHost,
            Self::UnmapMem => AclFunc::UnmapMem,
            Self::FreePhysical => AclFunc::FreePhysical,
            Self::CreateEvent => AclFunc::CreateEvent,
            Self::RecordEvent => AclFunc::RecordEvent,
            Self::QueryEventStatus => AclFunc::QueryEventStatus,
            Self::SynchronizeEvent => AclFunc::SynchronizeEvent,
            Self::SynchronizeStream => AclFunc::SynchronizeStream,
            Self::StreamWaitEvent => AclFunc::StreamWaitEvent,
        }
    }

    /// A wait or an ordering call: any operation that touches a region's bytes or queues
    /// work on it may make one.
    fn is_wait(self) -> bool {
        matches!(
            self,
            Self::SynchronizeEvent | Self::SynchronizeStream | Self::StreamWaitEvent
        )
    }
}

/// A wait was made to fail since the last clear: an operation on a region may be refused
/// with the runtime's error, and must then have changed nothing. A static rather than a
/// harness field, since the outcome checks below are free functions over the pool.
static WAITS_FAULTED: AtomicBool = AtomicBool::new(false);

fn waits_faulted() -> bool {
    WAITS_FAULTED.load(Ordering::Relaxed)
}

/// A call the harness makes to check contents, retried while it fails with the runtime's
/// error under a faulted wait: each fault fails a few calls only, then the call goes through.
fn retry<T: std::fmt::Debug>(what: &str, mut f: impl FnMut() -> ascend_pool::Result<T>) -> T {
    let mut tries = 0;
    loop {
        match f() {
            Ok(v) => return v,
            Err(Error::Runtime { .. }) if waits_faulted() && tries < 32 => tries += 1,
            Err(e) => panic!("{what}: {e:?} after {tries} retries"),
        }
    }
}

/// What runs right after a fault is armed, so the failing call meets the pool often.
#[derive(Arbitrary, Debug, Clone, Copy)]
enum AfterFault {
    Nothing,
    /// Gives chunks back: a refused free or unmap.
    Trim,
    /// Waits for the deferred frees: a refused wait.
    Synchronize,
}

#[derive(Arbitrary, Debug, Clone, Copy)]
enum Op {
    Alloc {
        what: AllocWhat,
        len: Len,
        init: bool,
    },
    Drop {
        idx: u8,
    },
    Free {
        idx: u8,
    },
    RecordStream {
        idx: u8,
        stream: u8,
        then_drop: bool,
    },
    CopyFromHost {
        idx: u8,
        off: Off,
        count: Count,
        seed: u8,
    },
    CopyToHost {
        idx: u8,
        off: Off,
        count: Count,
    },
    HostWrite {
        idx: u8,
        off: Off,
        count: Count,
        seed: u8,
    },
    Copy {
        dst: u8,
        dst_off: Off,
        src: u8,
        src_off: Off,
        count: Count,
    },
    CopyAsync {
        dst: u8,
        dst_off: Off,
        src: u8,
        src_off: Off,
        count: Count,
        stream: u8,
        check: bool,
    },
    Memset {
        idx: u8,
        off: Off,
        count: Count,
        value: u8,
    },
    MemsetAsync {
        idx: u8,
        off: Off,
        count: Count,
        value: u8,
        stream: u8,
        check: bool,
    },
    Sub {
        idx: u8,
        off: Off,
        count: Count,
        then: SubOp,
    },
    Foreign(ForeignOp),
    Check {
        idx: u8,
    },
    SyncStream {
        stream: u8,
    },
    RecreateStream {
        stream: u8,
    },
    Trim,
    Synchronize,
    FlushThreadCaches,
    Snapshot,
    /// The next calls of a function fail: out of memory or a plain runtime failure, at
    /// once or after a few calls run (a failure half-way through a growth); then maybe the
    /// pool call most likely to meet it.
    Fault {
        on: FaultOn,
        oom: bool,
        skip: u8,
        n: u8,
        then: AfterFault,
    },
    ClearFaults,
    /// Busy time on a stream (`ticks` of 4 µs, about a millisecond at most), as a kernel
    /// would queue: work queued behind it, and the frees waiting on it, stay outstanding.
    Delay {
        stream: u8,
        ticks: u8,
    },
}

#[derive(Arbitrary, Debug)]
struct Input {
    device_mib: u8,
    host_mib: u8,
    dvpp_mib: u8,
    chunk_mib: u8,
    thread_cache: u8,
    debug: bool,
    limit_mib: u8,
    buddy: bool,
    no_padding: bool,
    release: u8,
    /// Device memory from a virtual-memory source over the simulator: chunks are granules
    /// mapped into one reservation and grow and shrink in place.
    vmm: bool,
    /// End by dropping the pool handle first, with regions still live and frees queued.
    abandon: bool,
    ops: Vec<Op>,
}

enum Any {
    Device(DeviceRegion),
    Model(DeviceRegion<Align128>),
    Dvpp(DvppRegion),
    Host(HostRegion),
}

/// Runs `$body` with `$r` bound to the typed region inside an `Any` (or a reference to it).
macro_rules! with {
    ($any:expr, $r:ident => $body:expr) => {
        match $any {
            Any::Device($r) => $body,
            Any::Model($r) => $body,
            Any::Dvpp($r) => $body,
            Any::Host($r) => $body,
        }
    };
}

/// A live region and what the harness knows of it.
struct Tracked {
    region: Any,
    len: u64,
    /// The footprint the carve rule gives this region.
    footprint: u64,
    /// Expected bytes of `[0, min(len, HEAD))`; `None` where unknown.
    head: Vec<Option<u8>>,
    /// Streams with work queued on the region that the host has not waited for since.
    dirty: [bool; STREAMS],
}

/// The outcome the contract prescribes for an operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Expect {
    Ok,
    OutOfBounds,
    Misaligned,
    Foreign,
    /// An async copy with host memory at both ends.
    WrongKind,
}

fn out_of_bounds(off: u64, len: u64, cap: u64) -> bool {
    len == 0 || off.checked_add(len).is_none_or(|end| end > cap)
}

fn bounds(off: u64, len: u64, cap: u64) -> Expect {
    if out_of_bounds(off, len, cap) {
        Expect::OutOfBounds
    } else {
        Expect::Ok
    }
}

/// Panics unless `r` is the outcome `want` names.
fn expect<T: std::fmt::Debug>(r: &ascend_pool::Result<T>, want: Expect, what: &str) -> bool {
    // A faulted wait may refuse an operation the contract lets through.
    let waited_in_vain =
        want == Expect::Ok && waits_faulted() && matches!(r, Err(Error::Runtime { .. }));
    let fits = waited_in_vain
        || matches!(
            (r, want),
            (Ok(_), Expect::Ok)
                | (Err(Error::OutOfBounds { .. }), Expect::OutOfBounds)
                | (Err(Error::Misaligned { .. }), Expect::Misaligned)
                | (Err(Error::ForeignHandle), Expect::Foreign)
                | (Err(Error::WrongKind { .. }), Expect::WrongKind)
        );
    assert!(fits, "{what}: expected {want:?}, got {r:?}");
    r.is_ok()
}

fn pattern(seed: u8, len: u64) -> Vec<u8> {
    (0..len)
        .map(|i| seed.wrapping_add((i % 251) as u8).wrapping_mul(7))
        .collect()
}

/// Writes a pattern at `off` from a host buffer, then reads it back; the bytes written on success.
fn write_host<R: Region>(pool: &Pool, r: &mut R, off: u64, len: u64, seed: u8) -> Option<Vec<u8>> {
    let len = len.min(HOST_BUF_MAX);
    let data = pattern(seed, len);
    let res = pool.copy_from_host(r, off, &data);
    if !expect(&res, bounds(off, len, r.len()), "copy_from_host") {
        return None;
    }
    let mut back = vec![0u8; len as usize];
    retry("read back", || pool.copy_to_host(r, off, &mut back));
    assert!(back == data, "copy_from_host did not round-trip");
    Some(data)
}

/// Reads `len` bytes at `off` into a host buffer; the bytes on success.
fn read_host<R: Region>(pool: &Pool, r: &R, off: u64, len: u64) -> Option<Vec<u8>> {
    let len = len.min(HOST_BUF_MAX);
    let mut back = vec![0u8; len as usize];
    let res = pool.copy_to_host(r, off, &mut back);
    expect(&res, bounds(off, len, r.len()), "copy_to_host").then_some(back)
}

/// Fills and checks the start of the filled span.
fn fill<R: Region>(pool: &Pool, r: &mut R, off: u64, len: u64, value: u8) -> bool {
    let res = pool.memset(r, off, value, len);
    if !expect(&res, bounds(off, len, r.len()), "memset") {
        return false;
    }
    let mut back = vec![0u8; len.min(CHECK_MAX) as usize];
    retry("read back", || pool.copy_to_host(r, off, &mut back));
    assert!(back.iter().all(|&b| b == value), "memset did not fill");
    true
}

fn fill_async<R: AsyncCopySafe>(
    pool: &Pool,
    r: &mut R,
    off: u64,
    len: u64,
    value: u8,
    stream: &Stream,
) -> bool {
    let res = pool.memset_async(r, off, value, len, stream);
    expect(&res, bounds(off, len, r.len()), "memset_async")
}

/// A synchronous copy between regions; on success the copied span is compared.
fn copy<D: Region, S: Region>(
    pool: &Pool,
    dst: &mut D,
    dst_off: u64,
    src: &S,
    src_off: u64,
    len: u64,
    compare: bool,
) -> bool {
    let want = match bounds(dst_off, len, dst.len()) {
        Expect::Ok => bounds(src_off, len, src.len()),
        e => e,
    };
    let res = pool.copy(dst, dst_off, src, src_off, len);
    if !expect(&res, want, "copy") {
        return false;
    }
    if compare {
        let n = len.min(CHECK_MAX) as usize;
        let (mut a, mut b) = (vec![0u8; n], vec![0u8; n]);
        retry("read back", || pool.copy_to_host(dst, dst_off, &mut a));
        retry("read back", || pool.copy_to_host(src, src_off, &mut b));
        assert!(a == b, "copy did not copy");
    }
    true
}

fn async_expect(dst_off: u64, dst_len: u64, src_off: u64, src_len: u64, len: u64) -> Expect {
    match bounds(dst_off, len, dst_len) {
        Expect::Ok => match bounds(src_off, len, src_len) {
            // Regions start 64-aligned, so the offsets decide.
            Expect::Ok if !dst_off.is_multiple_of(64) || !src_off.is_multiple_of(64) => {
                Expect::Misaligned
            }
            e => e,
        },
        e => e,
    }
}

#[allow(clippy::too_many_arguments)]
fn copy_async<D: AsyncCopySafe, S: AsyncCopySafe>(
    pool: &Pool,
    dst: &mut D,
    dst_off: u64,
    src: &S,
    src_off: u64,
    len: u64,
    stream: &Stream,
) -> bool {
    let want = match async_expect(dst_off, dst.len(), src_off, src.len(), len) {
        // The runtime does no async copy within the host; bounds are checked first.
        Expect::Ok | Expect::Misaligned if !dst.kind().is_device() && !src.kind().is_device() => {
            Expect::WrongKind
        }
        e => e,
    };
    let res = pool.copy_async(dst, dst_off, src, src_off, len, stream);
    expect(&res, want, "copy_async")
}

/// Two distinct elements of `v`, both writable.
fn pair_mut<T>(v: &mut [T], i: usize, j: usize) -> (&mut T, &mut T) {
    assert_ne!(i, j);
    if i < j {
        let (a, b) = v.split_at_mut(j);
        (&mut a[i], &mut b[0])
    } else {
        let (a, b) = v.split_at_mut(i);
        (&mut b[0], &mut a[j])
    }
}

struct Harness {
    pool: Pool,
    sim: Arc<SimSource>,
    vmm: Option<Arc<VmmSource<SimSource>>>,
    /// A fault was injected since the last clear: a source call may fail, so an allocation
    /// may be refused with the runtime's error.
    faults: bool,
    streams: Vec<Stream>,
    live: Vec<Tracked>,
    padding: u64,
    limit: u64,
    /// The simulator's device capacity, pinned host capacity and DVPP limit.
    capacities: (u64, u64, u64),
    /// A region and a stream of another pool over another simulator (the region drops
    /// before its pool: fields drop in order).
    foreign_region: DeviceRegion,
    foreign_stream: Stream,
    _foreign_pool: Pool,
}

impl Harness {
    /// Whether a request of `len` bytes of `kind` must be served: nothing else is live in
    /// the pool (a refusal frees caches, waits for streams and trims empty chunks before it
    /// gives up), no fault is injected, and the segment is small against everything that
    /// bounds it (a 1 MiB footprint fits in any chunk, even a buddy range's power of two, and
    /// in any limit, which is at least one chunk). Not for large alignments: a chunk holds
    /// an address aligned past what the source aligns its blocks to only with slack beside
    /// it, which a limit of one chunk may not leave.
    fn must_fit(&self, kind: MemKind, len: u64, align: u64) -> bool {
        let (device, host, dvpp) = self.capacities;
        let room = match kind {
            MemKind::Host => host,
            MemKind::Dvpp => device.min(dvpp),
            _ => device,
        };
        self.live.is_empty() && !self.faults && len <= MIB - 256 && align <= 4096 && room >= 4 * MIB
    }

    fn index(&self, i: u8) -> Option<usize> {
        (!self.live.is_empty()).then(|| usize::from(i) % self.live.len())
    }

    /// Destination and source indices and the offsets and length of a copy between two
    /// live regions; `None` without two distinct ones (the destination is borrowed
    /// exclusively, so one region cannot be both).
    fn copy_operands(
        &self,
        dst: u8,
        dst_off: Off,
        src: u8,
        src_off: Off,
        count: Count,
    ) -> Option<(usize, usize, u64, u64, u64)> {
        let (d, s) = (self.index(dst)?, self.index(src)?);
        if d == s {
            return None;
        }
        let (dl, sl) = (self.live[d].len, self.live[s].len);
        let (doff, soff) = (dst_off.get(dl), src_off.get(sl));
        Some((d, s, doff, soff, count.get(dl, doff)))
    }

    fn stream_index(s: u8) -> usize {
        usize::from(s) % STREAMS
    }

    /// Waits for stream `s`: nothing queued on it is outstanding any more.
    fn sync_stream(&mut self, s: usize) {
        retry("synchronize a stream", || self.streams[s].synchronize());
        for t in &mut self.live {
            t.dirty[s] = false;
        }
    }

    /// Before the host touches region `i`: waits for the streams with work on it.
    fn settle_host(&mut self, i: usize) {
        for s in 0..STREAMS {
            if self.live[i].dirty[s] {
                self.sync_stream(s);
            }
        }
    }

    /// Before work on stream `s` touches region `i`: waits for the other streams' work on it.
    fn settle_for(&mut self, i: usize, s: usize) {
        for t in 0..STREAMS {
            if t != s && self.live[i].dirty[t] {
                self.sync_stream(t);
            }
        }
    }

    /// Records bytes written at `off` of region `i` in its shadow.
    fn shadow_write(&mut self, i: usize, off: u64, bytes: impl Fn(u64) -> Option<u8>, len: u64) {
        let head = &mut self.live[i].head;
        let end = off.saturating_add(len).min(head.len() as u64);
        for p in off..end {
            head[p as usize] = bytes(p - off);
        }
    }

    /// Records a copy of `len` bytes from `src_off` of region `src` to `dst_off` of `dst`.
    fn shadow_copy(&mut self, dst: usize, dst_off: u64, src: usize, src_off: u64, len: u64) {
        let from = self.live[src].head.clone();
        self.shadow_write(
            dst,
            dst_off,
            |p| {
                src_off
                    .checked_add(p)
                    .and_then(|q| from.get(q as usize).copied().flatten())
            },
            len,
        );
    }

    /// Reads the tracked head of region `i` back and compares it with the shadow.
    fn check_head(&mut self, i: usize) {
        self.settle_host(i);
        let t = &self.live[i];
        let n = t.head.len() as u64;
        let mut back = vec![0u8; n as usize];
        with!(&t.region, r => retry("read back", || self.pool.copy_to_host(r, 0, &mut back)));
        if let Any::Host(h) = &t.region {
            let bytes = retry("a host slice", || h.try_as_slice());
            assert!(
                bytes[..n as usize] == back[..],
                "host slice and copy differ"
            );
        }
        for (p, (want, got)) in t.head.iter().zip(&back).enumerate() {
            if let Some(w) = want {
                assert_eq!(
                    w,
                    got,
                    "byte {p} of a {:?} region of {} bytes",
                    kind_of(&t.region),
                    t.len
                );
            }
        }
    }

    fn alloc(&mut self, what: AllocWhat, len: u64, init: bool) {
        let pool = &self.pool;
        let policy = pool.config().policy;
        let (res, kind, align): (ascend_pool::Result<Any>, MemKind, u64) = match what {
            AllocWhat::Device => (
                pool.alloc_device(len).map(Any::Device),
                MemKind::Device(policy),
                64,
            ),
            AllocWhat::DeviceKind { kind, policy: p } => {
                // A policy without padding (1 GiB pages) carves its requests without padding
                // from the pool's chunks too (see tests/pool_cache.rs).
                let p = match p % 4 {
                    0 => policy,
                    1 => MallocPolicy::NormalOnly,
                    2 => MallocPolicy::HugeOnly,
                    _ => MallocPolicy::Huge1gOnly,
                };
                let kind = match kind % 5 {
                    0 => MemKind::Device(p),
                    1 => MemKind::DeviceAlign32(p),
                    2 => MemKind::Cached(p),
                    3 => MemKind::Dvpp,
                    _ => MemKind::Host,
                };
                let res = pool.alloc_device_kind(kind, len);
                if !kind.is_device() || kind == MemKind::Dvpp {
                    assert!(
                        matches!(res, Err(Error::WrongKind { got, .. }) if got == kind),
                        "alloc_device_kind({kind:?}) gave {res:?}"
                    );
                    return;
                }
                (res.map(Any::Device), kind, 64)
            }
            AllocWhat::ModelInput => (
                pool.alloc_model_input(len).map(Any::Model),
                MemKind::Device(policy),
                128,
            ),
            AllocWhat::Dvpp => (pool.alloc_dvpp(len).map(Any::Dvpp), MemKind::Dvpp, 128),
            AllocWhat::Host => (pool.alloc_host(len).map(Any::Host), MemKind::Host, 64),
            AllocWhat::DeviceOn { stream } => {
                let s = &self.streams[Self::stream_index(stream)];
                (
                    pool.alloc_device_on(len, s).map(Any::Device),
                    MemKind::Device(policy),
                    64,
                )
            }
            AllocWhat::DvppOn { stream } => {
                let s = &self.streams[Self::stream_index(stream)];
                (
                    pool.alloc_dvpp_on(len, s).map(Any::Dvpp),
                    MemKind::Dvpp,
                    128,
                )
            }
            AllocWhat::DeviceAligned { log } => {
                let align = 1u64 << (log % 34);
                let res = pool.alloc_device_aligned(len, align);
                if !(64..=ascend_pool::align::MAX_ALIGN).contains(&align) {
                    let refused = matches!(
                        res,
                        Err(Error::Carve(CarveRuleError::BadAlignment { align: a })) if a == align
                    ) || (len == 0
                        && matches!(res, Err(Error::Carve(CarveRuleError::ZeroLength))));
                    assert!(refused, "alloc_device_aligned({len}, {align}) gave {res:?}");
                    return;
                }
                (res.map(Any::Device), MemKind::Device(policy), align)
            }
        };
        let region = match res {
            Ok(r) => r,
            Err(e) => {
                let ok = match &e {
                    Error::Carve(CarveRuleError::ZeroLength) => len == 0,
                    Error::Carve(CarveRuleError::LengthOverflow { len: l }) => {
                        *l == len && len > u64::MAX / 2
                    }
                    Error::OutOfMemory { requested, .. }
                    | Error::LimitExceeded { requested, .. } => {
                        *requested == len && len > 0 && !self.must_fit(kind, len, align)
                    }
                    Error::Runtime { .. } => self.faults && len > 0,
                    _ => false,
                };
                assert!(ok, "allocating {len} bytes of {kind:?} gave {e:?}");
                return;
            }
        };
        assert!(len > 0, "a region of 0 bytes of {kind:?}");
        let (addr, rlen, rkind, ralign) =
            with!(&region, r => (r.addr(), r.len(), r.kind(), r.align()));
        assert_eq!(rlen, len);
        assert_eq!(rkind.index(), kind.index());
        assert!(
            ralign >= align && (addr as u64).is_multiple_of(align),
            "{addr:#x} not {align}-aligned"
        );
        for t in &self.live {
            let other = with!(&t.region, r => r.addr());
            assert!(
                addr + len as usize <= other || other + t.len as usize <= addr,
                "new region {addr:#x}+{len} overlaps {other:#x}+{}",
                t.len
            );
        }
        let padding = match kind.policy() {
            Some(p) if p.has_no_padding() => 0,
            _ => self.padding,
        };
        let footprint = CarveRule::new(padding, align)
            .unwrap()
            .footprint(len)
            .unwrap();
        let head_len = len.min(HEAD);
        self.live.push(Tracked {
            region,
            len,
            footprint,
            head: vec![None; head_len as usize],
            dirty: [false; STREAMS],
        });
        let i = self.live.len() - 1;
        if init {
            let data = pattern(len as u8, head_len);
            let t = &mut self.live[i];
            match &mut t.region {
                Any::Host(h) => retry("a host slice", || {
                    h.try_as_mut_slice()
                        .map(|b| b[..head_len as usize].copy_from_slice(&data))
                }),
                region => {
                    with!(region, r => retry("initialize", || self.pool.copy_from_host(r, 0, &data)))
                }
            }
            t.head = data.into_iter().map(Some).collect();
        }
    }

    fn foreign(&mut self, op: ForeignOp) {
        let pool = &self.pool;
        let what = format!("{op:?}");
        match op {
            ForeignOp::CopyFromHost => {
                let r = pool.copy_from_host(&mut self.foreign_region, 0, &[1, 2, 3]);
                expect(&r, Expect::Foreign, &what);
            }
            ForeignOp::CopyToHost => {
                let r = pool.copy_to_host(&self.foreign_region, 0, &mut [0u8; 3]);
                expect(&r, Expect::Foreign, &what);
            }
            ForeignOp::Memset => {
                let r = pool.memset(&mut self.foreign_region, 0, 1, 1);
                expect(&r, Expect::Foreign, &what);
            }
            ForeignOp::AllocOn { len, dvpp } => {
                let len = len.get();
                let r = if dvpp {
                    pool.alloc_dvpp_on(len, &self.foreign_stream).map(drop)
                } else {
                    pool.alloc_device_on(len, &self.foreign_stream).map(drop)
                };
                expect(&r, Expect::Foreign, &what);
            }
            ForeignOp::CopyInto { idx } => {
                let Some(i) = self.index(idx) else { return };
                let t = &self.live[i];
                let r = with!(&t.region, src => pool.copy(&mut self.foreign_region, 0, src, 0, 1));
                expect(&r, Expect::Foreign, &what);
            }
            ForeignOp::CopyFrom { idx } => {
                let Some(i) = self.index(idx) else { return };
                let t = &mut self.live[i];
                let r = with!(&mut t.region, dst => pool.copy(dst, 0, &self.foreign_region, 0, 1));
                expect(&r, Expect::Foreign, &what);
            }
            ForeignOp::CopyAsyncOn { dst, src } => {
                let (Some(d), Some(s)) = (self.index(dst), self.index(src)) else {
                    return;
                };
                if d == s {
                    return;
                }
                let (a, b) = pair_mut(&mut self.live, d, s);
                let len = a.len.min(b.len).min(64);
                let stream = &self.foreign_stream;
                let r = with!(&mut a.region, dr => with!(&b.region, sr =>
                    pool.copy_async(dr, 0, sr, 0, len, stream)));
                expect(&r, Expect::Foreign, &what);
            }
            ForeignOp::MemsetAsyncOn { idx } => {
                let Some(i) = self.index(idx) else { return };
                let t = &mut self.live[i];
                let stream = &self.foreign_stream;
                let r = with!(&mut t.region, dr => pool.memset_async(dr, 0, 0xAA, 1, stream));
                expect(&r, Expect::Foreign, &what);
            }
            ForeignOp::RecordStreamOn { idx } => {
                let Some(i) = self.index(idx) else { return };
                let r = with!(&self.live[i].region, r => r.record_stream(&self.foreign_stream));
                expect(&r, Expect::Foreign, &what);
            }
        }
    }

    fn sub(&mut self, idx: u8, off: Off, count: Count, then: SubOp) {
        let Some(i) = self.index(idx) else { return };
        // Everything a sub-region operation may touch is settled first, so the borrow of
        // the parent below needs no harness calls.
        let src_i = match then {
            SubOp::AsyncFrom { src, .. } => self.index(src).filter(|&s| s != i),
            _ => None,
        };
        let stream_i = match then {
            SubOp::FillAsync { stream, .. } | SubOp::AsyncFrom { stream, .. } => {
                Self::stream_index(stream)
            }
            _ => 0,
        };
        match then {
            SubOp::FillAsync { .. } => self.settle_for(i, stream_i),
            SubOp::AsyncFrom { .. } => {
                let Some(s) = src_i else { return };
                self.settle_for(i, stream_i);
                self.settle_for(s, stream_i);
            }
            _ => self.settle_host(i),
        }
        let parent_len = self.live[i].len;
        let sub_off = off.get(parent_len);
        let sub_len = count.get(parent_len, sub_off);
        let pool = &self.pool;
        let stream = &self.streams[stream_i];
        // The shadow change the operation made, in parent offsets.
        enum Effect {
            None,
            Bytes(u64, Vec<u8>),
            Fill(u64, u64, u8),
            Copy {
                dst_off: u64,
                src: usize,
                src_off: u64,
                len: u64,
            },
        }
        let (t, src_t) = match src_i {
            Some(s) => {
                let (a, b) = pair_mut(&mut self.live, i, s);
                (a, Some(b))
            }
            None => (&mut self.live[i], None),
        };
        let mut queued = false;
        // A sub-region borrows its parent exclusively: nothing else reaches the parent
        // while it lives, so copies between the two cannot be written.
        let effect = with!(&mut t.region, parent => {
            let (parent_addr, parent_align) = (parent.addr(), parent.align());
            let res = SubRegion::new(parent, sub_off, sub_len);
            let want = match bounds(sub_off, sub_len, parent_len) {
                Expect::Ok if !sub_off.is_multiple_of(parent_align) => Expect::Misaligned,
                e => e,
            };
            if !expect(&res, want, "SubRegion::new") {
                return;
            }
            let mut sub = res.unwrap();
            assert_eq!((sub.len(), sub.offset()), (sub_len, sub_off));
            assert_eq!(sub.addr(), parent_addr + sub_off as usize);
            match then {
                SubOp::Write { off, count, seed } => {
                    let o = off.get(sub_len);
                    match write_host(pool, &mut sub, o, count.get(sub_len, o), seed) {
                        Some(d) => Effect::Bytes(sub_off + o, d),
                        None => Effect::None,
                    }
                }
                SubOp::Read { off, count } => {
                    let o = off.get(sub_len);
                    match read_host(pool, &sub, o, count.get(sub_len, o)) {
                        Some(d) => {
                            // Compare with the shadow below, as a write of the same bytes.
                            Effect::Bytes(sub_off + o, d)
                        }
                        None => Effect::None,
                    }
                }
                SubOp::Fill { off, count, value } => {
                    let o = off.get(sub_len);
                    let n = count.get(sub_len, o);
                    if fill(pool, &mut sub, o, n, value) {
                        Effect::Fill(sub_off + o, n, value)
                    } else {
                        Effect::None
                    }
                }
                SubOp::FillAsync { off, count, value, .. } => {
                    let o = off.get(sub_len);
                    let n = count.get(sub_len, o);
                    if fill_async(pool, &mut sub, o, n, value, stream) {
                        queued = true;
                        Effect::Fill(sub_off + o, n, value)
                    } else {
                        Effect::None
                    }
                }
                SubOp::AsyncFrom { dst_off, src_off, count, .. } => {
                    let src_t = src_t.expect("settled above");
                    let d = dst_off.get(sub_len);
                    let s = src_off.get(src_t.len);
                    let n = count.get(sub_len, d);
                    let ok = with!(&src_t.region, sr => copy_async(pool, &mut sub, d, sr, s, n, stream));
                    if ok {
                        queued = true;
                        src_t.dirty[stream_i] = true;
                        Effect::Copy { dst_off: sub_off + d, src: src_i.unwrap(), src_off: s, len: n }
                    } else {
                        Effect::None
                    }
                }
            }
        });
        if queued {
            self.live[i].dirty[stream_i] = true;
        }
        match effect {
            Effect::None => {}
            Effect::Bytes(at, d) => {
                if matches!(then, SubOp::Read { .. }) {
                    let head = &self.live[i].head;
                    for (k, b) in d.iter().enumerate() {
                        if let Some(Some(w)) = head.get(at as usize + k) {
                            assert_eq!(w, b, "sub-region read differs at {}", at as usize + k);
                        }
                    }
                } else {
                    self.shadow_write(i, at, |p| Some(d[p as usize]), d.len() as u64);
                }
            }
            Effect::Fill(at, n, v) => self.shadow_write(i, at, |_| Some(v), n),
            Effect::Copy {
                dst_off,
                src,
                src_off,
                len,
            } => self.shadow_copy(i, dst_off, src, src_off, len),
        }
    }

    fn run(&mut self, op: Op) {
        match op {
            Op::Alloc { what, len, init } => self.alloc(what, len.get(), init),
            Op::Drop { idx } => {
                if let Some(i) = self.index(idx) {
                    self.live.swap_remove(i);
                }
            }
            Op::Free { idx } => {
                if let Some(i) = self.index(idx) {
                    let t = self.live.swap_remove(i);
                    // Nothing can write past a region through the safe API, so even in
                    // debug mode the canary holds.
                    with!(t.region, r => r.free()).unwrap();
                }
            }
            Op::RecordStream {
                idx,
                stream,
                then_drop,
            } => {
                if let Some(i) = self.index(idx) {
                    let s = &self.streams[Self::stream_index(stream)];
                    with!(&self.live[i].region, r => r.record_stream(s)).unwrap();
                    if then_drop {
                        self.live.swap_remove(i);
                    }
                }
            }
            Op::CopyFromHost {
                idx,
                off,
                count,
                seed,
            } => {
                let Some(i) = self.index(idx) else { return };
                self.settle_host(i);
                let len = self.live[i].len;
                let (o, n) = (off.get(len), count.get(len, off.get(len)));
                let t = &mut self.live[i];
                if let Some(d) = with!(&mut t.region, r => write_host(&self.pool, r, o, n, seed)) {
                    self.shadow_write(i, o, |p| Some(d[p as usize]), d.len() as u64);
                }
            }
            Op::CopyToHost { idx, off, count } => {
                let Some(i) = self.index(idx) else { return };
                self.settle_host(i);
                let t = &self.live[i];
                let o = off.get(t.len);
                if let Some(d) =
                    with!(&t.region, r => read_host(&self.pool, r, o, count.get(t.len, o)))
                {
                    for (k, b) in d.iter().enumerate() {
                        if let Some(Some(w)) = t.head.get(o as usize + k) {
                            assert_eq!(w, b, "copy_to_host differs at {}", o as usize + k);
                        }
                    }
                }
            }
            Op::HostWrite {
                idx,
                off,
                count,
                seed,
            } => {
                let Some(i) = self.index(idx) else { return };
                if !matches!(self.live[i].region, Any::Host(_)) {
                    return;
                }
                self.settle_host(i);
                let t = &mut self.live[i];
                let o = off.get(t.len);
                let n = count.get(t.len, o);
                if out_of_bounds(o, n, t.len) {
                    return; // a slice index, not a pool call
                }
                let n = n.min(HOST_BUF_MAX);
                let data = pattern(seed, n);
                if let Any::Host(h) = &mut t.region {
                    match h.try_as_mut_slice() {
                        Ok(b) => b[o as usize..(o + n) as usize].copy_from_slice(&data),
                        Err(e) => {
                            let ok = waits_faulted() && matches!(e, Error::Runtime { .. });
                            assert!(ok, "a host slice: {e:?}");
                            return;
                        }
                    }
                }
                self.shadow_write(i, o, |p| Some(data[p as usize]), n);
            }
            Op::Copy {
                dst,
                dst_off,
                src,
                src_off,
                count,
            } => {
                let Some((d, s, doff, soff, n)) =
                    self.copy_operands(dst, dst_off, src, src_off, count)
                else {
                    return;
                };
                self.settle_host(d);
                self.settle_host(s);
                let pool = &self.pool;
                let ok = {
                    let (a, b) = pair_mut(&mut self.live, d, s);
                    with!(&mut a.region, dr => with!(&b.region, sr =>
                        copy(pool, dr, doff, sr, soff, n, true)))
                };
                if ok {
                    self.shadow_copy(d, doff, s, soff, n);
                }
            }
            Op::CopyAsync {
                dst,
                dst_off,
                src,
                src_off,
                count,
                stream,
                check,
            } => {
                let Some((d, s, doff, soff, n)) =
                    self.copy_operands(dst, dst_off, src, src_off, count)
                else {
                    return;
                };
                let si = Self::stream_index(stream);
                self.settle_for(d, si);
                self.settle_for(s, si);
                let pool = &self.pool;
                let st = &self.streams[si];
                let ok = {
                    let (a, b) = pair_mut(&mut self.live, d, s);
                    with!(&mut a.region, dr => with!(&b.region, sr =>
                        copy_async(pool, dr, doff, sr, soff, n, st)))
                };
                if ok {
                    self.live[d].dirty[si] = true;
                    self.live[s].dirty[si] = true;
                    self.shadow_copy(d, doff, s, soff, n);
                    if check {
                        self.check_head(d);
                    }
                }
            }
            Op::Memset {
                idx,
                off,
                count,
                value,
            } => {
                let Some(i) = self.index(idx) else { return };
                self.settle_host(i);
                let len = self.live[i].len;
                let o = off.get(len);
                let n = count.get(len, o);
                let t = &mut self.live[i];
                if with!(&mut t.region, r => fill(&self.pool, r, o, n, value)) {
                    self.shadow_write(i, o, |_| Some(value), n);
                }
            }
            Op::MemsetAsync {
                idx,
                off,
                count,
                value,
                stream,
                check,
            } => {
                let Some(i) = self.index(idx) else { return };
                let si = Self::stream_index(stream);
                self.settle_for(i, si);
                let len = self.live[i].len;
                let o = off.get(len);
                let n = count.get(len, o);
                let t = &mut self.live[i];
                let st = &self.streams[si];
                if with!(&mut t.region, r => fill_async(&self.pool, r, o, n, value, st)) {
                    t.dirty[si] = true;
                    self.shadow_write(i, o, |_| Some(value), n);
                    if check {
                        self.check_head(i);
                    }
                }
            }
            Op::Sub {
                idx,
                off,
                count,
                then,
            } => self.sub(idx, off, count, then),
            Op::Foreign(f) => self.foreign(f),
            Op::Check { idx } => {
                if let Some(i) = self.index(idx) {
                    self.check_head(i);
                }
            }
            Op::SyncStream { stream } => self.sync_stream(Self::stream_index(stream)),
            Op::RecreateStream { stream } => {
                let s = Self::stream_index(stream);
                // Dropping a stream waits for its work, then destroys it; regions recorded
                // on it are freed at once.
                self.streams[s] = self.pool.create_stream().unwrap();
                for t in &mut self.live {
                    t.dirty[s] = false;
                }
            }
            Op::Trim => {
                self.pool.trim();
            }
            Op::Synchronize => self.synchronize(),
            Op::FlushThreadCaches => {
                self.pool.flush_thread_caches();
                for k in MemKind::ALL {
                    let s = self.pool.stats(k);
                    assert_eq!(
                        (s.cached_bytes, s.cached_regions),
                        (0, 0),
                        "{k:?} after a flush"
                    );
                }
            }
            Op::Snapshot => {
                let snap = self.pool.snapshot();
                for k in &snap.kinds {
                    let segs = k.chunks.iter().flat_map(|c| &c.segments);
                    let listed = segs.clone().filter(|s| !s.cached).count() as u64;
                    let cached = segs.filter(|s| s.cached).count() as u64;
                    assert_eq!(listed, k.stats.live_regions, "{:?} snapshot", k.stats.kind);
                    assert_eq!(
                        cached, k.stats.cached_regions,
                        "{:?} snapshot",
                        k.stats.kind
                    );
                    let reserved: u64 = k.chunks.iter().map(|c| c.size).sum();
                    assert_eq!(reserved, k.stats.reserved_bytes);
                }
            }
            Op::Fault {
                on,
                oom,
                skip,
                n,
                then,
            } => {
                let code = if oom {
                    AclError::RT_MEMORY_ALLOCATION
                } else {
                    AclError::RT_FAILURE
                };
                self.sim.inject_fault(Fault {
                    func: on.func(),
                    code,
                    times: FaultTimes::After {
                        skip: u64::from(skip % 4),
                        n: 1 + u64::from(n % 3),
                    },
                });
                self.faults = true;
                if on.is_wait() {
                    WAITS_FAULTED.store(true, Ordering::Relaxed);
                }
                match then {
                    AfterFault::Nothing => {}
                    AfterFault::Trim => {
                        self.pool.trim();
                    }
                    AfterFault::Synchronize => self.synchronize(),
                }
            }
            Op::ClearFaults => {
                self.sim.clear_faults();
                self.faults = false;
                WAITS_FAULTED.store(false, Ordering::Relaxed);
            }
            Op::Delay { stream, ticks } => {
                let s = &self.streams[Self::stream_index(stream)];
                let busy = Duration::from_micros(4 * u64::from(ticks));
                self.sim.enqueue_delay(s.handle(), busy).unwrap();
            }
        }
    }

    /// Waits for every deferred free; under a faulted wait, a refused one stays pending
    /// and a later call completes it.
    fn synchronize(&self) {
        match self.pool.synchronize() {
            Err(Error::Runtime { .. }) if waits_faulted() => {}
            r => r.unwrap(),
        }
    }

    /// What holds after every operation: the pool validates and its counters agree with
    /// the regions alive.
    fn check_invariants(&self) {
        self.pool.validate().unwrap();
        for kind in MemKind::ALL {
            let s = self.pool.stats(kind);
            let mine = self
                .live
                .iter()
                .filter(|t| kind_of(&t.region).index() == kind.index());
            let count = mine.clone().count() as u64;
            let requested: u64 = mine.clone().map(|t| t.len).sum();
            let footprint: u64 = mine.map(|t| t.footprint).sum();
            assert_eq!(
                s.live_regions,
                count + s.pending_frees,
                "{kind:?} live regions: {s:?}"
            );
            assert!(s.requested_bytes >= requested, "{kind:?}: {s:?}");
            assert!(s.allocated_bytes >= footprint, "{kind:?}: {s:?}");
            if s.pending_frees == 0 {
                assert_eq!(s.requested_bytes, requested, "{kind:?}: {s:?}");
            }
            assert!(
                s.reserved_bytes >= s.allocated_bytes + s.cached_bytes,
                "{kind:?}: {s:?}"
            );
            if self.limit > 0 {
                assert!(
                    s.reserved_bytes <= self.limit,
                    "{kind:?} past the limit: {s:?}"
                );
            }
        }
    }
}

fn kind_of(a: &Any) -> MemKind {
    with!(a, r => r.kind())
}

fn build(input: &Input) -> Harness {
    let mib = |n: u8, lo: u64| (lo + u64::from(n) % 30) * MIB;
    let sim = SimConfig::default()
        .with_device_capacity(mib(input.device_mib, 2))
        .with_host_capacity(mib(input.host_mib, 2))
        .with_dvpp_limit(mib(input.dvpp_mib, 2));
    let sim = Arc::new(SimSource::new(sim).unwrap());
    let vmm = input
        .vmm
        .then(|| Arc::new(VmmSource::new(sim.clone(), 0, VmmConfig::default()).unwrap()));
    let source: Arc<dyn BlockSource> = match &vmm {
        Some(v) => v.clone(),
        None => sim.clone(),
    };
    let chunk = 2 * MIB * (1 + u64::from(input.chunk_mib % 4));
    let padding = if input.no_padding { 0 } else { 32 };
    let limit = match input.limit_mib % 4 {
        0 => 0,
        n => chunk * u64::from(n) + u64::from(input.limit_mib / 4 % 3) * MIB,
    };
    let thread_cache = match input.thread_cache % 4 {
        0 => 0,
        1 => 4 << 10,
        2 => 256 << 10,
        _ => 2 * MIB,
    };
    let release = match input.release % 3 {
        0 => 0,
        1 => chunk,
        _ => 128 * MIB,
    };
    let config = PoolConfig::default()
        .with_chunk_size(chunk)
        .with_padding(padding)
        .with_limit(limit)
        .with_debug(input.debug)
        .with_thread_cache(thread_cache)
        .with_release_threshold(release)
        .with_engine(EngineConfig {
            range: if input.buddy {
                RangeTier::Buddy
            } else {
                RangeTier::Tlsf
            },
            slab_max: 1024,
        });
    let pool = Pool::new(source, config).unwrap();
    let streams = (0..STREAMS)
        .map(|_| pool.create_stream().unwrap())
        .collect();
    let other = Pool::new(Arc::new(SimSource::default()), PoolConfig::default()).unwrap();
    let foreign_stream = other.create_stream().unwrap();
    let foreign_region = other.alloc_device(256).unwrap();
    Harness {
        pool,
        sim,
        vmm,
        faults: false,
        streams,
        live: Vec::new(),
        padding,
        limit,
        capacities: (
            mib(input.device_mib, 2),
            mib(input.host_mib, 2),
            mib(input.dvpp_mib, 2),
        ),
        foreign_region,
        foreign_stream,
        _foreign_pool: other,
    }
}

fuzz_target!(|input: Input| {
    WAITS_FAULTED.store(false, Ordering::Relaxed);
    let mut h = build(&input);
    for &op in input.ops.iter().take(MAX_OPS) {
        h.run(op);
        h.check_invariants();
    }
    for i in 0..h.live.len() {
        h.check_head(i);
    }
    // What is left goes back with every call working again.
    h.sim.clear_faults();
    let Harness {
        pool,
        sim,
        vmm,
        streams,
        live,
        ..
    } = h;
    if input.abandon {
        // The regions keep what they need; the rest goes back when the last of them does.
        drop(pool);
        drop(live);
    } else {
        // Drop everything, possibly with work still queued on it.
        drop(live);
        pool.synchronize().unwrap();
        pool.flush_thread_caches();
        pool.trim();
        pool.validate().unwrap();
        assert!(pool.leak_report().is_empty(), "{:?}", pool.leak_report());
        for s in pool.all_stats() {
            let counts = (s.live_regions, s.allocated_bytes, s.requested_bytes);
            assert_eq!((counts, s.pending_frees), ((0, 0, 0), 0), "{s:?}");
            assert_eq!((s.cached_regions, s.cached_bytes), (0, 0), "{s:?}");
            assert_eq!((s.reserved_bytes, s.chunks), (0, 0), "{s:?}");
        }
        assert_eq!(sim.stats().live_blocks, 0, "blocks still held after trim");
        if let Some(v) = &vmm {
            v.validate().unwrap();
            assert_eq!(v.stats().blocks, 0, "virtual blocks still held after trim");
        }
        drop(pool);
    }
    drop(streams);
    // A `Stream` whose synchronize failed on drop (an injected fault) is kept, with its
    // queued wait events, since its work may still run: those are the only streams and
    // events allowed to stay (the pool's synchronize destroyed those it found, but a pool
    // abandoned, or a stream dropped after it, leaves them). A kept stream holds the pool's
    // source (the virtual-memory source, when there is one) until it is destroyed.
    let kept = ascend_pool::region::streams_kept_on(&*sim)
        + vmm
            .as_deref()
            .map_or(0, |v| ascend_pool::region::streams_kept_on(v));
    drop(vmm);
    let s = sim.stats();
    if kept == 0 {
        let held = (s.live_blocks, s.live_events, s.live_streams);
        assert_eq!(
            held,
            (0, 0, 0),
            "blocks, events, streams left at the simulator"
        );
    } else {
        assert_eq!(s.live_blocks, 0, "blocks left at the simulator");
        assert_eq!(
            s.live_streams, kept as u64,
            "streams left beyond the kept ones"
        );
    }
    // Every call works again: a retry destroys them and the events they kept, and lets their
    // source go.
    assert_eq!(
        ascend_pool::region::retry_kept_streams(),
        kept,
        "a kept stream outlived a retry with every call working"
    );
    let s = sim.stats();
    assert_eq!(
        (s.live_events, s.live_streams),
        (0, 0),
        "events or streams left after the kept streams' retry"
    );
    let mapped = (s.reservations, s.physical_handles, s.mappings);
    assert_eq!(
        mapped,
        (0, 0, 0),
        "reservations, physical memory, mappings left at the simulator"
    );
});
