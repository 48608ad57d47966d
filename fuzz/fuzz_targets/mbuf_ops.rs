//! Shared buffers (`Mbuf`) driven the way a pipeline drives them, with the pool recording.
//! Buffers of any size and kind are made, cloned, written, read, given a data length and user
//! data, dropped handle by handle, published and opened read-only as another process would,
//! while runtime calls fail now and then. Every call answers with a typed error or does what
//! it says: a shadow of each buffer's data, data length and user data is checked on every
//! read, through the buffer and through every opened copy. A refused call changes nothing.
//!
//! At the end, with every buffer and opened copy gone, the pool is valid and the simulator
//! holds no memory, and the trace the pool recorded reads back without a rejected line: each
//! buffer made is an allocation of its size plus the header, each one is freed, and the
//! successful ones come in the order they were made.
//!
//! Run it with `-detect_leaks=0`, like `share_open`: the simulator's exporter watches each
//! import from a thread of its own.
#![no_main]

#[path = "common/sharing.rs"]
mod sharing;

use arbitrary::Arbitrary;
use ascend_pool::align::CarveRuleError;
use ascend_pool::mbuf::{Mbuf, MbufKind, SharedMbuf, HEADER_LEN, USER_DATA_LEN};
use ascend_pool::source::sim::{AclFunc, Fault, SimConfig, SimSource};
use ascend_pool::source::vmm::{VmmConfig, VmmRuntime, VmmSource};
use ascend_pool::trace::{TraceConfig, TraceItem, TraceOp, TraceReader};
use ascend_pool::{AclError, Error, MemKind, Pool, PoolConfig};
use libfuzzer_sys::fuzz_target;
use sharing::{wind_down, Who, NOTHING_HELD};
use std::collections::HashMap;
use std::sync::Arc;

const MIB: u64 = 1 << 20;
/// Buffers alive at once, at most.
const BUFS: usize = 8;
/// Operations per input, at most.
const MAX_OPS: usize = 128;

/// A data size: small, up to 3 MiB (past the 2 MiB chunk: a dedicated one), or bad.
#[derive(Arbitrary, Debug, Clone, Copy)]
enum Size {
    Small(u16),
    Big(u32),
    Zero,
    /// Within a few bytes of `u64::MAX`: the header no longer fits.
    NearMax(u8),
    Raw(u64),
}

impl Size {
    fn get(self) -> u64 {
        match self {
            Self::Small(n) => u64::from(n),
            Self::Big(n) => u64::from(n) % (3 * MIB) + 1,
            Self::Zero => 0,
            Self::NearMax(n) => u64::MAX - u64::from(n),
            Self::Raw(v) => v,
        }
    }
}

/// An offset into `size` bytes: the edges are where bounds checks go wrong.
#[derive(Arbitrary, Debug, Clone, Copy)]
enum At {
    Start,
    Inside(u32),
    FromEnd(u16),
    Raw(u64),
}

impl At {
    fn get(self, size: u64) -> u64 {
        match self {
            Self::Start => 0,
            Self::Inside(v) => u64::from(v) % (size + 1),
            Self::FromEnd(k) => size.saturating_sub(u64::from(k)),
            Self::Raw(v) => v,
        }
    }
}

/// The runtime calls a buffer's life makes.
#[derive(Arbitrary, Debug, Clone, Copy)]
enum FaultOn {
    Memcpy,
    MallocPhysical,
    MapMem,
    DvppMalloc,
    UnmapMem,
    FreePhysical,
    DvppFree,
    Export,
    Import,
    SetPid,
    Reserve,
    Release,
}

impl FaultOn {
    fn func(self) -> AclFunc {
        match self {
            Self::Memcpy => AclFunc::Memcpy,
            Self::MallocPhysical => AclFunc::MallocPhysical,
            Self::MapMem => AclFunc::MapMem,
            Self::DvppMalloc => AclFunc::DvppMalloc,
            Self::UnmapMem => AclFunc::UnmapMem,
            Self::FreePhysical => AclFunc::FreePhysical,
            Self::DvppFree => AclFunc::DvppFree,
            Self::Export => AclFunc::MemExportToShareableHandle,
            Self::Import => AclFunc::MemImportFromShareableHandle,
            Self::SetPid => AclFunc::MemSetPidToShareableHandle,
            Self::Reserve => AclFunc::ReserveMemAddress,
            Self::Release => AclFunc::ReleaseMemAddress,
        }
    }
}

/// The calls that let go of an opened copy.
#[derive(Arbitrary, Debug, Clone, Copy)]
enum Letting {
    Unmap,
    Free,
    Release,
}

impl Letting {
    fn func(self) -> AclFunc {
        match self {
            Self::Unmap => AclFunc::UnmapMem,
            Self::Free => AclFunc::FreePhysical,
            Self::Release => AclFunc::ReleaseMemAddress,
        }
    }
}

#[derive(Arbitrary, Debug, Clone, Copy)]
enum Op {
    Alloc {
        size: Size,
        dvpp: bool,
    },
    Clone(u8),
    /// Drops one handle; the buffer goes back to the pool with its last one.
    Drop(u8),
    Write {
        buf: u8,
        at: At,
        len: u16,
        seed: u8,
    },
    Read {
        buf: u8,
        at: At,
        len: u16,
    },
    SetDataLen {
        buf: u8,
        len: At,
    },
    DataLen(u8),
    SetUserData {
        buf: u8,
        off: u8,
        len: u8,
        seed: u8,
    },
    UserData {
        buf: u8,
        off: u8,
        len: u8,
    },
    /// Publishes a buffer and opens it as another process would.
    Share {
        buf: u8,
        who: Who,
    },
    SharedRead {
        copy: u8,
        at: At,
        len: u16,
    },
    SharedDataLen(u8),
    SharedUserData {
        copy: u8,
        off: u8,
        len: u8,
    },
    /// Closes an opened copy, with one call of a function that lets go of it failing
    /// (closes are rare behind a fault otherwise).
    Close {
        copy: u8,
        fail: Option<Letting>,
    },
    /// The next `n` (1 to 3) calls of a function fail, during the operation that follows.
    Fault {
        on: FaultOn,
        n: u8,
    },
    Trim,
}

#[derive(Arbitrary, Debug)]
struct Input {
    debug: bool,
    ops: Vec<Op>,
}

fn bytes(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| seed.wrapping_add((i % 251) as u8).wrapping_mul(13))
        .collect()
}

/// One buffer, every handle on it, and what it holds.
struct Buf {
    /// Never reused within an input: opened copies name their buffer by it.
    id: u64,
    handles: Vec<Mbuf>,
    size: u64,
    /// Each data byte written so far (`None`: never written, contents unknown).
    data: Vec<Option<u8>>,
    data_len: u64,
    /// Zeroed when the buffer is made.
    user: [u8; USER_DATA_LEN],
}

/// A buffer opened read-only, and the id of the buffer it shows while that is alive.
struct Opened {
    mbuf: SharedMbuf<SimSource>,
    of: Option<u64>,
    /// A close was refused: reads are refused, what is held stays until a close goes through.
    closed: bool,
}

struct Harness {
    sim: Arc<SimSource>,
    vmm: Arc<VmmSource<SimSource>>,
    pool: Arc<Pool>,
    bufs: Vec<Buf>,
    copies: Vec<Opened>,
    next_id: u64,
    /// A fault is armed for the operation running now: it may fail with the runtime's error.
    armed: bool,
    /// (total bytes, kind) of each buffer made, in order.
    made: Vec<(u64, MbufKind)>,
    /// Allocations refused by a failing call, which may have been recorded with their free.
    refused: usize,
    /// Each shareable handle published: exported to any process, and whether this process
    /// is on its whitelist.
    exports: HashMap<u64, (bool, bool)>,
    /// A publish failed half-way under a fault: which allocations it exported or
    /// whitelisted is not known, so neither are the outcomes of later publishes and opens.
    unsure: bool,
    /// A function that lets go of imported memory is failing now (unmap, free, release).
    armed_cleanup: bool,
    /// Opens refused while letting go was failing too: a refused open cleans up, its drop
    /// tries once more, and what the runtime refused both times stays held (printed). The
    /// simulator may end with at most this many reservations left.
    stuck_opens: u64,
}

/// Checks a call's outcome: `Ok`, or the one typed error `bad` names when the input was
/// bad, or the runtime's error while a fault is armed. True when it went through.
fn outcome<T: std::fmt::Debug>(
    r: &ascend_pool::Result<T>,
    bad: Option<fn(&Error) -> bool>,
    armed: bool,
    what: &str,
) -> bool {
    match (r, bad) {
        (Ok(_), None) => true,
        (Err(e), Some(is)) if is(e) => false,
        (Err(Error::Runtime { .. }), None) if armed => false,
        _ => panic!("{what}: {r:?} (bad input: {})", bad.is_some()),
    }
}

fn out_of_bounds(e: &Error) -> bool {
    matches!(e, Error::OutOfBounds { .. })
}

fn already_freed(e: &Error) -> bool {
    matches!(e, Error::AlreadyFreed)
}

/// The error a read of an opened copy must give: out of bounds first, then closed.
fn copy_refusal(inside: bool, closed: bool) -> Option<fn(&Error) -> bool> {
    match (inside, closed) {
        (false, _) => Some(out_of_bounds),
        (true, true) => Some(already_freed),
        (true, false) => None,
    }
}

/// `n` bytes at `off` fit in `cap` (and are not none).
fn fits(off: u64, n: u64, cap: u64) -> bool {
    n > 0 && off.checked_add(n).is_some_and(|end| end <= cap)
}

impl Harness {
    fn buf(&self, i: u8) -> Option<usize> {
        (!self.bufs.is_empty()).then(|| usize::from(i) % self.bufs.len())
    }

    fn copy(&self, i: u8) -> Option<usize> {
        (!self.copies.is_empty()).then(|| usize::from(i) % self.copies.len())
    }

    /// A handle on buffer `b`, any of them: they are all the same buffer.
    fn handle(&self, b: usize, pick: u8) -> &Mbuf {
        let h = &self.bufs[b].handles;
        &h[usize::from(pick) % h.len()]
    }

    /// Whether a buffer of `size` bytes must fit: no opened copy holds memory, and the
    /// live buffers and this one, each rounded up to whole 2 MiB chunks (a chunk holding at
    /// least one of them, or a dedicated one), take at most half the 32 MiB device.
    fn must_fit(&self, size: u64) -> bool {
        let chunks = |n: u64| (n + HEADER_LEN).div_ceil(2 * MIB) * 2 * MIB;
        let live: u64 = self.bufs.iter().map(|b| chunks(b.size)).sum();
        size <= 3 * MIB
            && self.copies.is_empty()
            && self.stuck_opens == 0
            && live + chunks(size) <= 16 * MIB
    }

    fn alloc(&mut self, size: u64, dvpp: bool) {
        let kind = if dvpp {
            MbufKind::Dvpp
        } else {
            MbufKind::Normal
        };
        let r = Mbuf::alloc(&self.pool, size, kind);
        let total = size.checked_add(HEADER_LEN);
        let buf = match r {
            Ok(b) => b,
            Err(e) => {
                let typed = match &e {
                    Error::Carve(CarveRuleError::ZeroLength) => size == 0,
                    Error::Carve(CarveRuleError::LengthOverflow { .. }) => size > u64::MAX / 2,
                    Error::OutOfMemory { requested, .. }
                    | Error::LimitExceeded { requested, .. } => {
                        self.armed || (Some(*requested) == total && !self.must_fit(size))
                    }
                    Error::Runtime { .. } => self.armed,
                    _ => false,
                };
                assert!(typed, "Mbuf::alloc({size}, {kind:?}) gave {e:?}");
                if self.armed {
                    self.refused += 1;
                }
                return;
            }
        };
        assert!(size > 0 && size < 64 * MIB, "a buffer of {size} bytes");
        assert_eq!((buf.kind(), buf.refs()), (kind, 1));
        let (addr, len) = buf.data();
        assert_eq!(len, size);
        assert!(addr % 128 == 0, "data at {addr:#x} not 128-aligned");
        assert_eq!(buf.data_len().unwrap(), 0);
        let mut user = [0xffu8; USER_DATA_LEN];
        buf.user_data(&mut user, 0).unwrap();
        assert_eq!(user, [0u8; USER_DATA_LEN], "user data of a new buffer");
        for b in &self.bufs {
            let (other, n) = b.handles[0].data();
            let (lo, hi) = (addr - HEADER_LEN as usize, addr + size as usize);
            let (olo, ohi) = (other - HEADER_LEN as usize, other + n as usize);
            assert!(
                hi <= olo || ohi <= lo,
                "new buffer overlaps buffer {}",
                b.id
            );
        }
        self.made.push((size + HEADER_LEN, kind));
        let id = self.next_id;
        self.next_id += 1;
        if self.bufs.len() == BUFS {
            let old = self.bufs.swap_remove(0);
            self.forget(old.id);
        }
        self.bufs.push(Buf {
            id,
            handles: vec![buf],
            size,
            data: vec![None; size as usize],
            data_len: 0,
            user: [0; USER_DATA_LEN],
        });
    }

    /// Buffer `id` went back to the pool: what its opened copies show is no longer known
    /// (the memory stays mapped for them, but the pool may hand it out again).
    fn forget(&mut self, id: u64) {
        for c in &mut self.copies {
            if c.of == Some(id) {
                c.of = None;
            }
        }
    }

    fn read_data(&self, b: usize, pick: u8, at: At, len: u16) {
        let buf = &self.bufs[b];
        let off = at.get(buf.size);
        let mut out = vec![0u8; usize::from(len)];
        let r = self.handle(b, pick).read(off, &mut out);
        let ok = fits(off, len.into(), buf.size);
        if outcome(&r, (!ok).then_some(out_of_bounds), self.armed, "read") {
            check_bytes(&buf.data, off, &out, "read");
        }
    }

    /// Reads the data through every opened copy of buffer `b`: what the primary wrote is
    /// what another process sees.
    fn read_copy(&self, c: usize, at: At, len: u16) {
        let copy = &self.copies[c];
        let size = copy.mbuf.size();
        let off = at.get(size);
        let mut out = vec![0u8; usize::from(len)];
        let r = copy.mbuf.read(off, &mut out);
        let ok = fits(off, len.into(), size);
        if outcome(&r, copy_refusal(ok, copy.closed), self.armed, "shared read") {
            if let Some(b) = self.bufs.iter().find(|b| Some(b.id) == copy.of) {
                check_bytes(&b.data, off, &out, "shared read");
            }
        }
    }

    fn run(&mut self, op: Op) {
        match op {
            Op::Alloc { size, dvpp } => self.alloc(size.get(), dvpp),
            Op::Clone(i) => {
                if let Some(b) = self.buf(i) {
                    let h = self.handle(b, i).clone();
                    self.bufs[b].handles.push(h);
                    let n = self.bufs[b].handles.len();
                    assert_eq!(self.bufs[b].handles[0].refs(), n);
                }
            }
            Op::Drop(i) => {
                if let Some(b) = self.buf(i) {
                    let h = &mut self.bufs[b].handles;
                    h.swap_remove(usize::from(i) % h.len());
                    if h.is_empty() {
                        let old = self.bufs.swap_remove(b);
                        self.forget(old.id);
                    } else {
                        assert_eq!(h[0].refs(), h.len());
                    }
                }
            }
            Op::Write { buf, at, len, seed } => {
                let Some(b) = self.buf(buf) else { return };
                let size = self.bufs[b].size;
                let off = at.get(size);
                let data = bytes(seed, usize::from(len));
                let r = self.handle(b, seed).write(off, &data);
                let ok = fits(off, len.into(), size);
                if outcome(&r, (!ok).then_some(out_of_bounds), self.armed, "write") {
                    let shadow = &mut self.bufs[b].data[off as usize..][..data.len()];
                    for (s, &d) in shadow.iter_mut().zip(&data) {
                        *s = Some(d);
                    }
                }
                self.read_data(b, seed.wrapping_add(1), At::Raw(off), len);
            }
            Op::Read { buf, at, len } => {
                if let Some(b) = self.buf(buf) {
                    self.read_data(b, buf, at, len);
                }
            }
            Op::SetDataLen { buf, len } => {
                let Some(b) = self.buf(buf) else { return };
                let size = self.bufs[b].size;
                let n = len.get(size);
                let r = self.handle(b, buf).set_data_len(n);
                let bad = (n > size).then_some(out_of_bounds as fn(&Error) -> bool);
                if outcome(&r, bad, self.armed, "set_data_len") {
                    self.bufs[b].data_len = n;
                }
            }
            Op::DataLen(i) => {
                if let Some(b) = self.buf(i) {
                    let r = self.handle(b, i).data_len();
                    if outcome(&r, None, self.armed, "data_len") {
                        assert_eq!(r.unwrap(), self.bufs[b].data_len);
                    }
                }
            }
            Op::SetUserData {
                buf,
                off,
                len,
                seed,
            } => {
                let Some(b) = self.buf(buf) else { return };
                let data = bytes(seed, usize::from(len));
                let r = self.handle(b, seed).set_user_data(&data, off.into());
                let ok = fits(off.into(), len.into(), USER_DATA_LEN as u64);
                if outcome(
                    &r,
                    (!ok).then_some(out_of_bounds),
                    self.armed,
                    "set_user_data",
                ) {
                    self.bufs[b].user[usize::from(off)..][..data.len()].copy_from_slice(&data);
                }
            }
            Op::UserData { buf, off, len } => {
                let Some(b) = self.buf(buf) else { return };
                let mut out = vec![0u8; usize::from(len)];
                let r = self.handle(b, len).user_data(&mut out, off.into());
                let ok = fits(off.into(), len.into(), USER_DATA_LEN as u64);
                if outcome(&r, (!ok).then_some(out_of_bounds), self.armed, "user_data") {
                    assert_eq!(out, self.bufs[b].user[usize::from(off)..][..out.len()]);
                }
            }
            Op::Share { buf, who } => self.share(buf, who),
            Op::SharedRead { copy, at, len } => {
                if let Some(c) = self.copy(copy) {
                    self.read_copy(c, at, len);
                }
            }
            Op::SharedDataLen(i) => {
                let Some(c) = self.copy(i) else { return };
                let r = self.copies[c].mbuf.data_len();
                if !outcome(
                    &r,
                    copy_refusal(true, self.copies[c].closed),
                    self.armed,
                    "shared data_len",
                ) {
                    return;
                }
                let got = r.unwrap();
                if let Some(b) = self.bufs.iter().find(|b| Some(b.id) == self.copies[c].of) {
                    assert_eq!(got, b.data_len, "data length another process sees");
                }
            }
            Op::SharedUserData { copy, off, len } => {
                let Some(c) = self.copy(copy) else { return };
                let mut out = vec![0u8; usize::from(len)];
                let r = self.copies[c].mbuf.user_data(&mut out, off.into());
                let ok = fits(off.into(), len.into(), USER_DATA_LEN as u64);
                if outcome(
                    &r,
                    copy_refusal(ok, self.copies[c].closed),
                    self.armed,
                    "shared user_data",
                ) {
                    if let Some(b) = self.bufs.iter().find(|b| Some(b.id) == self.copies[c].of) {
                        assert_eq!(out, b.user[usize::from(off)..][..out.len()]);
                    }
                }
            }
            Op::Close { copy, fail } => {
                if let Some(c) = self.copy(copy) {
                    if let Some(f) = fail {
                        let func = f.func();
                        self.sim
                            .inject_fault(Fault::next(func, AclError::RT_MEMORY_ALLOCATION, 1));
                        self.armed = true;
                    }
                    // A close refused under a fault keeps what it could not let go; this
                    // close (of a copy closed before, too) tries again.
                    let r = self.copies[c].mbuf.try_close();
                    if outcome(&r, None, self.armed, "close") {
                        self.copies.swap_remove(c);
                    } else {
                        self.copies[c].closed = true;
                    }
                }
            }
            Op::Fault { .. } => unreachable!("armed by the loop"),
            Op::Trim => {
                self.pool.trim();
            }
        }
    }

    fn share(&mut self, buf: u8, who: Who) {
        let Some(b) = self.buf(buf) else { return };
        let me = self.sim.bare_tgid().unwrap();
        let any = matches!(who, Who::Anyone);
        let access = who.access(me);
        let handle = self.handle(b, buf);
        let r = handle.publish(&self.vmm, &access);
        let desc = match (r, handle.kind()) {
            (Ok(d), MbufKind::Normal) => d,
            (Err(Error::WrongKind { .. }), MbufKind::Dvpp) => return,
            (
                Err(Error::ShareAccessFixed {
                    handle,
                    any_process,
                }),
                MbufKind::Normal,
            ) => {
                // Refused only for an allocation exported before under the other choice.
                assert_ne!(any_process, any);
                let known = self.exports.get(&handle).map(|e| e.0);
                assert!(
                    known == Some(any_process) || self.unsure,
                    "{handle:#x} refused as exported to any process: {any_process}, known {known:?}"
                );
                return;
            }
            (Err(Error::Runtime { .. }), _) if self.armed => {
                // Some extents may be exported or whitelisted by now, unknown which.
                self.unsure = true;
                return;
            }
            (r, kind) => panic!("publishing a {kind:?} buffer gave {r:?}"),
        };
        // What the runtime will let this process import, allocation by allocation.
        let mut open_to_me = true;
        for p in &desc.pieces {
            let e = self.exports.entry(p.handle).or_insert((any, false));
            assert!(
                e.0 == any || self.unsure,
                "{:#x} published under both choices",
                p.handle
            );
            e.1 |= matches!(who, Who::Me);
            open_to_me &= e.0 || e.1;
        }
        let opened = SharedMbuf::open(Arc::clone(&self.sim), 0, &desc);
        let mbuf = match opened {
            Ok(m) if open_to_me || self.unsure => m,
            Err(Error::ShareRefused { .. }) if !open_to_me || self.unsure => {
                self.stuck_opens += u64::from(self.armed_cleanup);
                return;
            }
            Err(Error::Runtime { .. } | Error::OutOfMemory { .. }) if self.armed => {
                self.stuck_opens += u64::from(self.armed_cleanup);
                return;
            }
            r => panic!("opening a buffer open to me: {open_to_me} gave {r:?}"),
        };
        assert_eq!(mbuf.size(), self.bufs[b].size);
        self.copies.push(Opened {
            mbuf,
            of: Some(self.bufs[b].id),
            closed: false,
        });
    }
}

/// Every byte of `out` (read from `off`) that the shadow knows is what it says.
fn check_bytes(shadow: &[Option<u8>], off: u64, out: &[u8], what: &str) {
    for (k, (&got, want)) in out.iter().zip(&shadow[off as usize..]).enumerate() {
        if let Some(want) = *want {
            assert_eq!(got, want, "{what}: data byte {}", off + k as u64);
        }
    }
}

/// The trace the pool recorded: every line valid, every allocation freed, one allocation of
/// each buffer's size plus header in the order they were made, and no more than the refused
/// ones besides.
fn check_record(path: &std::path::Path, made: &[(u64, MbufKind)], refused: usize) {
    let file = std::fs::File::open(path).unwrap();
    let mut reader = TraceReader::new(std::io::BufReader::new(file), TraceConfig::default());
    let mut allocs = Vec::new();
    let mut frees = 0;
    while let Some(item) = reader.next_item() {
        match item.unwrap() {
            TraceItem::Op(TraceOp::Alloc {
                len, kind, rule, ..
            }) => {
                let want = if kind == MemKind::Dvpp {
                    MbufKind::Dvpp
                } else {
                    assert!(kind.is_device(), "a buffer recorded as {kind:?}");
                    MbufKind::Normal
                };
                assert_eq!(rule.align(), 128, "a buffer's alignment as recorded");
                allocs.push((len, want));
            }
            TraceItem::Op(TraceOp::Free { .. }) => frees += 1,
            TraceItem::Rejected(r) => panic!("recorded line {r:?}"),
        }
    }
    assert_eq!(reader.live_count(), 0, "recorded allocations never freed");
    assert_eq!(allocs.len(), frees);
    assert!(
        allocs.len() <= made.len() + refused,
        "{allocs:?} for {made:?}"
    );
    let mut rest = allocs.iter();
    for m in made {
        assert!(
            rest.any(|a| a == m),
            "buffer {m:?} not recorded in order: {allocs:?}"
        );
    }
}

fuzz_target!(|input: Input| {
    let sim = SimConfig::default().with_device_capacity(32 * MIB);
    let sim = Arc::new(SimSource::new(sim).unwrap());
    let vmm = Arc::new(VmmSource::new(Arc::clone(&sim), 0, VmmConfig::default()).unwrap());
    let path = std::env::temp_dir().join(format!(
        "ascend-pool-fuzz-mbuf-{}.jsonl",
        std::process::id()
    ));
    let config = PoolConfig::default()
        .with_chunk_size(2 * MIB)
        .with_debug(input.debug)
        .with_record(&path);
    let pool = Arc::new(Pool::new(vmm.clone(), config).unwrap());
    let mut h = Harness {
        sim,
        vmm,
        pool,
        bufs: Vec::new(),
        copies: Vec::new(),
        next_id: 0,
        armed: false,
        made: Vec::new(),
        refused: 0,
        exports: HashMap::new(),
        unsure: false,
        armed_cleanup: false,
        stuck_opens: 0,
    };
    for &op in input.ops.iter().take(MAX_OPS) {
        if let Op::Fault { on, n } = op {
            let n = u64::from(n % 3) + 1;
            h.sim
                .inject_fault(Fault::next(on.func(), AclError::RT_MEMORY_ALLOCATION, n));
            h.armed = true;
            h.armed_cleanup |= matches!(
                on,
                FaultOn::UnmapMem | FaultOn::FreePhysical | FaultOn::Release
            );
            continue;
        }
        h.run(op);
        if h.armed {
            h.sim.clear_faults();
            h.armed = false;
            h.armed_cleanup = false;
        }
        h.pool.validate().unwrap();
    }
    // A fault armed by the last operation has nothing to fail.
    h.sim.clear_faults();
    h.armed = false;
    // Everything the buffers hold reads back, through each handle and each opened copy.
    for b in 0..h.bufs.len() {
        let size = h.bufs[b].size.min(u64::from(u16::MAX)) as u16;
        h.read_data(b, 0, At::Start, size);
    }
    for c in 0..h.copies.len() {
        let size = h.copies[c].mbuf.size().min(u64::from(u16::MAX)) as u16;
        h.read_copy(c, At::Start, size);
    }
    let Harness {
        sim,
        vmm,
        pool,
        bufs,
        copies,
        made,
        refused,
        stuck_opens,
        ..
    } = h;
    drop(bufs);
    for mut c in copies {
        c.mbuf.try_close().unwrap();
    }
    let held = wind_down(pool, vmm, &sim);
    if stuck_opens == 0 {
        assert_eq!(
            held, NOTHING_HELD,
            "blocks, reservations, physical memory, mappings left at the simulator"
        );
    } else {
        let (blocks, reservations, _, _) = held;
        assert!(
            blocks == 0 && reservations <= stuck_opens,
            "{held:?} left after {stuck_opens} opens refused while letting go failed"
        );
    }
    // The pool's last handle is gone: the recorder has flushed.
    check_record(&path, &made, refused);
});
