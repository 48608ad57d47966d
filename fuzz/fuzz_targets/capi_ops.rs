//! Arbitrary call sequences through the C interface (`ascend-pool-capi`), as a C program
//! could make them: live, freed, foreign and made-up region and stream handles, kinds outside
//! the enum, sizes of 0 and near `u64::MAX`, copies and fills in and out of bounds and off
//! alignment, a second pool destroyed and made again under its live regions. The main pool
//! is over the simulator or over its virtual memory, whose device regions are published and
//! opened again as mappings in this process: a mapping reads and writes the region's bytes.
//! Each call's status must be the one the header promises for its input; after every call
//! the pool validates, its live regions are exactly the handles the model holds, and the
//! first bytes of every region read back as the model says. Shared buffers (mbuf) are
//! allocated, referenced again and freed by handle, and their data, valid length and user
//! data read back as the model says.
#![no_main]

use arbitrary::Arbitrary;
use ascend_pool_capi::*;
use libfuzzer_sys::fuzz_target;
use std::collections::HashMap;
use std::ffi::c_void;

const MAX_OPS: usize = 200;
/// Leading bytes of each region the model tracks.
const HEAD: u64 = 256;
const MIB: u64 = 1 << 20;

#[derive(Arbitrary, Debug, Clone, Copy)]
enum Len {
    Small(u16),
    Mib(u8),
    Zero,
    Raw(u64),
}

impl Len {
    fn get(self) -> u64 {
        match self {
            Len::Small(n) => u64::from(n),
            Len::Mib(n) => u64::from(n % 48) * MIB + u64::from(n),
            Len::Zero => 0,
            Len::Raw(n) => n,
        }
    }
}

/// A region handle as a C program might pass one.
#[derive(Arbitrary, Debug, Clone, Copy)]
enum Handle {
    Live(u8),
    Freed(u8),
    /// A live region of the second pool.
    Other(u8),
    Raw(u64),
}

#[derive(Arbitrary, Debug, Clone, Copy)]
enum Off {
    Small(u8),
    Any(u64),
}

impl Off {
    fn get(self) -> u64 {
        match self {
            Off::Small(n) => u64::from(n) * 32,
            Off::Any(n) => n,
        }
    }
}

#[derive(Arbitrary, Debug)]
enum Op {
    Alloc {
        kind: i8,
        len: Len,
    },
    Aligned {
        len: Len,
        align_log: u8,
    },
    Model {
        len: Len,
    },
    AllocOn {
        kind: i8,
        len: Len,
        stream: u8,
    },
    AllocOther {
        len: u16,
    },
    Free(Handle),
    FromHost {
        dst: Handle,
        off: Off,
        len: u16,
        byte: u8,
    },
    ToHost {
        src: Handle,
        off: Off,
        len: u16,
    },
    /// `ap_copy`, or `ap_copy_async` on the stream picked by `stream`.
    Copy {
        dst: Handle,
        dst_off: Off,
        src: Handle,
        src_off: Off,
        len: u16,
        stream: Option<u8>,
    },
    /// `ap_memset`, or `ap_memset_async` on the stream picked by `stream`.
    Memset {
        dst: Handle,
        off: Off,
        value: u8,
        len: u16,
        stream: Option<u8>,
    },
    HostWrite {
        dst: Handle,
        at: u8,
        byte: u8,
    },
    Record {
        region: Handle,
        stream: u8,
    },
    StreamCreate,
    StreamDestroy(u8),
    StreamSync(u8),
    Trim,
    Synchronize,
    RemakeOther,
    /// `ap_pool_leak_report` into a buffer of `cap` entries.
    LeakReport {
        cap: u8,
    },
    /// `ap_share_publish` of a region to this process, and `ap_share_open` of what it gives.
    Publish(Handle),
    /// `ap_mapping_read` of a mapping's first bytes; mappings open and closed are picked.
    MapRead(u8),
    /// `ap_mapping_write` of one byte.
    MapWrite {
        mapping: u8,
        at: u8,
        byte: u8,
    },
    MapClose(u8),
    /// `ap_mbuf_alloc`; `kind` outside the enum is refused.
    MbufAlloc {
        size: Len,
        kind: i8,
    },
    MbufCopyRef(BufHandle),
    MbufFree(BufHandle),
    /// One byte of data (`user` false) or of user data, at `at` modulo a bound a little past
    /// the end, so that some writes are out of bounds.
    MbufWrite {
        buf: BufHandle,
        user: bool,
        at: u16,
        byte: u8,
    },
    MbufSetLen {
        buf: BufHandle,
        len: u32,
    },
    /// Reads a buffer's info, head of data and user data back.
    MbufRead(BufHandle),
}

/// A buffer handle as a C program might pass one.
#[derive(Arbitrary, Debug, Clone, Copy)]
enum BufHandle {
    Live(u8),
    Freed(u8),
    Raw(u64),
}

/// What the model knows of one buffer (any number of handles name it).
struct BufShadow {
    size: u64,
    data_len: u64,
    kind: i32,
    /// The data's leading bytes, and the user data; 0 where never written (the pool writes
    /// the header, and the data is whatever the memory held).
    head: Vec<Option<u8>>,
    user: [u8; 96],
    /// Where its segment starts (the header), for leak reports.
    addr: u64,
}

/// What the model knows of one live region.
struct Shadow {
    len: u64,
    addr: u64,
    kind: u32,
    /// The leading bytes, where known.
    head: Vec<Option<u8>>,
    /// Streams that may still have work queued on the region. Work on two streams is not
    /// ordered, so bytes written while another stream may touch the region are unknown.
    busy: Vec<u64>,
}

/// A region published and opened again.
struct Mapped {
    handle: u64,
    /// The region it maps: while that is live, the two are the same bytes.
    region: u64,
}

struct Model {
    /// Live buffer handles, and the buffer each names.
    mbufs: Vec<(u64, usize)>,
    freed_mbufs: Vec<u64>,
    /// Buffers by number; `None` once their last handle went.
    buffers: Vec<Option<BufShadow>>,
    pool: u64,
    /// Whether `pool` is over virtual memory (and publishes).
    vmm: bool,
    /// This process's id, to publish to.
    me: i32,
    mappings: Vec<Mapped>,
    closed_mappings: Vec<u64>,
    other: u64,
    dead_pools: Vec<u64>,
    live: HashMap<u64, Shadow>,
    order: Vec<u64>,
    freed: Vec<u64>,
    other_live: Vec<u64>,
    streams: Vec<u64>,
    dead_streams: Vec<u64>,
}

fn create(conf: &std::ffi::CStr) -> u64 {
    create_over(SOURCE_SIM, conf)
}

fn create_over(source: i32, conf: &std::ffi::CStr) -> u64 {
    let mut p = 0;
    // SAFETY: a NUL-terminated configuration and a writable handle.
    assert_eq!(
        unsafe { ap_pool_create(source, conf.as_ptr(), &mut p) },
        Status::Ok
    );
    p
}

impl Model {
    /// The handle a `BufHandle` names, and its place in `mbufs` if it is live.
    fn resolve_buf(&self, h: BufHandle) -> (u64, Option<usize>) {
        let handle = match h {
            BufHandle::Live(i) if !self.mbufs.is_empty() => {
                self.mbufs[usize::from(i) % self.mbufs.len()].0
            }
            BufHandle::Freed(i) if !self.freed_mbufs.is_empty() => {
                self.freed_mbufs[usize::from(i) % self.freed_mbufs.len()]
            }
            BufHandle::Raw(n) => n,
            _ => 0,
        };
        (handle, self.mbufs.iter().position(|&(h, _)| h == handle))
    }

    fn buffer(&self, at: usize) -> &BufShadow {
        self.buffers[self.mbufs[at].1].as_ref().unwrap()
    }

    /// The handle a `Handle` names, and whether it is a live region of the main pool.
    fn resolve(&self, h: Handle) -> (u64, bool) {
        let pick = |v: &[u64], i: u8| (!v.is_empty()).then(|| v[usize::from(i) % v.len()]);
        let handle = match h {
            Handle::Live(i) => pick(&self.order, i).unwrap_or(0),
            Handle::Freed(i) => pick(&self.freed, i).unwrap_or(u64::MAX),
            Handle::Other(i) => pick(&self.other_live, i).unwrap_or(1),
            Handle::Raw(n) => n,
        };
        (handle, self.live.contains_key(&handle))
    }

    fn stream(&self, i: u8) -> u64 {
        let all: Vec<u64> = self
            .streams
            .iter()
            .chain(&self.dead_streams)
            .copied()
            .collect();
        if all.is_empty() {
            0
        } else {
            all[usize::from(i) % all.len()]
        }
    }

    /// The mapping `i` picks among the open and the closed ones, and whether it is open.
    fn mapping(&self, i: u8) -> (u64, Option<usize>) {
        let n = self.mappings.len() + self.closed_mappings.len();
        if n == 0 {
            return (0, None);
        }
        let i = usize::from(i) % n;
        match self.mappings.get(i) {
            Some(m) => (m.handle, Some(i)),
            None => (self.closed_mappings[i - self.mappings.len()], None),
        }
    }

    /// Whether the bytes of the region mapping `i` maps are this model's to know: the region
    /// is live and no stream may be working on it.
    fn mapped_region(&self, i: usize) -> Option<u64> {
        let r = self.mappings[i].region;
        self.live
            .get(&r)
            .is_some_and(|s| s.busy.is_empty())
            .then_some(r)
    }

    /// What a call on stream `s` alone answers.
    fn stream_status(&self, s: u64) -> Status {
        if self.stream_live(s) {
            Status::Ok
        } else {
            Status::BadStream
        }
    }

    fn stream_live(&self, s: u64) -> bool {
        self.streams.contains(&s)
    }

    fn add(&mut self, handle: u64) {
        let mut i = RegionInfo::default();
        // SAFETY: a writable RegionInfo.
        assert_eq!(
            unsafe { ap_region_get_info(self.pool, handle, &mut i) },
            Status::Ok
        );
        assert!(i.align >= 64 && i.addr % i.align == 0, "{i:?}");
        if i.kind == KIND_DVPP as u32 {
            assert_eq!(i.addr % 128, 0);
        }
        let head = vec![None; i.len.min(HEAD) as usize];
        let busy = Vec::new();
        self.live.insert(
            handle,
            Shadow {
                len: i.len,
                addr: i.addr,
                kind: i.kind,
                head,
                busy,
            },
        );
        self.order.push(handle);
    }

    /// Whether `(offset, len)` is a span the pool copies or fills in a region of `cap` bytes.
    fn bounds(offset: u64, len: u64, cap: u64) -> bool {
        len > 0 && offset.checked_add(len).is_some_and(|e| e <= cap)
    }

    /// The status of a copy or fill on `(offset, len)` of region `h` (live or not).
    fn span_status(&self, h: u64, live: bool, offset: u64, len: u64) -> Status {
        if !live {
            Status::BadRegion
        } else if !Model::bounds(offset, len, self.live[&h].len) {
            Status::OutOfBounds
        } else {
            Status::Ok
        }
    }

    fn alloc_result(&mut self, got: Status, handle: u64, len: u64, what: &str, small_align: bool) {
        match got {
            Status::Ok => {
                assert_ne!(len, 0, "{what}: size 0 served");
                self.add(handle);
                assert_eq!(self.live[&handle].len, len);
            }
            // The carve rule refuses 0 and lengths whose footprint overflows, nothing else.
            Status::InvalidSize => assert!(len == 0 || len > u64::MAX / 2, "{what} of {len}"),
            Status::OutOfMemory | Status::LimitExceeded => {
                assert!(len > 0, "{what}");
                // With nothing live in the pool (no region, buffer or opened mapping) a
                // small request fits: a refusal trims, flushes and waits for streams first,
                // and the pool's limit is many chunks. Alignment past 4 KiB may need slack
                // a chunk lacks, so aligned requests are left out.
                let idle =
                    self.live.is_empty() && self.mbufs.is_empty() && self.mappings.is_empty();
                assert!(
                    !(idle && small_align && len <= 1 << 20),
                    "{what} of {len} refused with nothing live: {got:?}"
                );
            }
            other => panic!("{what} of {len}: {other:?}"),
        }
        if len == 0 {
            assert_eq!(got, Status::InvalidSize, "{what} of 0");
        }
    }

    /// A synchronous access to `h` waits for every stream with work on it: all their work
    /// has run, on every region.
    fn settle(&mut self, h: u64) {
        let done = std::mem::take(&mut self.live.get_mut(&h).unwrap().busy);
        for s in self.live.values_mut() {
            s.busy.retain(|b| !done.contains(b));
        }
    }

    fn stream_done(&mut self, stream: u64) {
        for s in self.live.values_mut() {
            s.busy.retain(|&b| b != stream);
        }
    }

    /// Queues work on `stream` touching `regions`: whether it is ordered with all work on
    /// them so far.
    fn queue(&mut self, stream: u64, regions: &[u64]) -> bool {
        let mut ordered = true;
        for h in regions {
            let s = self.live.get_mut(h).unwrap();
            ordered &= s.busy.iter().all(|&b| b == stream);
            if !s.busy.contains(&stream) {
                s.busy.push(stream);
            }
        }
        ordered
    }

    fn write_shadow(&mut self, h: u64, off: u64, len: u64, byte: Option<u8>) {
        let s = self.live.get_mut(&h).unwrap();
        for i in off..(off + len).min(s.head.len() as u64) {
            s.head[i as usize] = byte;
        }
    }

    fn check_head(&self, h: u64) {
        let s = &self.live[&h];
        let mut back = vec![0u8; s.head.len()];
        if back.is_empty() {
            return;
        }
        // SAFETY: `back` is writable for its length.
        let got = unsafe {
            ap_copy_to_host(self.pool, h, 0, back.as_mut_ptr().cast(), back.len() as u64)
        };
        assert_eq!(got, Status::Ok);
        for (i, (b, want)) in back.iter().zip(&s.head).enumerate() {
            if let Some(w) = want {
                assert_eq!(b, w, "region {h} byte {i}");
            }
        }
    }

    fn check(&self) {
        assert_eq!(ap_pool_validate(self.pool), Status::Ok);
        let (mut live, mut pending) = (0, 0);
        for k in KIND_DEVICE..=KIND_HOST {
            let mut s = Stats::default();
            // SAFETY: a writable Stats.
            assert_eq!(unsafe { ap_pool_stats(self.pool, k, &mut s) }, Status::Ok);
            live += s.live_regions;
            pending += s.pending_frees;
        }
        // Frees waiting on a stream still count as live in the pool until they complete.
        let buffers = self.buffers.iter().flatten().count();
        assert_eq!(live - pending, (self.live.len() + buffers) as u64);
    }
}

fn run(vmm: bool, ops: Vec<Op>) {
    let source = if vmm { SOURCE_VMM_SIM } else { SOURCE_SIM };
    let mut me = 0;
    // SAFETY: a writable id.
    assert_eq!(
        unsafe { ap_share_process_id(SOURCE_SIM, &mut me) },
        Status::Ok
    );
    let mut m = Model {
        pool: create_over(source, c"chunk_size:8m,limit:96m,debug:1"),
        vmm,
        me,
        mappings: Vec::new(),
        closed_mappings: Vec::new(),
        other: create(c"chunk_size:2m"),
        dead_pools: Vec::new(),
        live: HashMap::new(),
        order: Vec::new(),
        freed: Vec::new(),
        other_live: Vec::new(),
        mbufs: Vec::new(),
        freed_mbufs: Vec::new(),
        buffers: Vec::new(),
        streams: Vec::new(),
        dead_streams: Vec::new(),
    };
    let pool = m.pool;
    for op in ops.into_iter().take(MAX_OPS) {
        let mut r = 0u64;
        match op {
            Op::Alloc { kind, len } => {
                let len = len.get();
                // SAFETY: a writable handle.
                let got = unsafe { ap_alloc(pool, kind.into(), len, &mut r) };
                if !(0..=4).contains(&kind) {
                    assert_eq!(got, Status::InvalidArgument);
                } else {
                    m.alloc_result(got, r, len, "ap_alloc", true);
                }
            }
            Op::Aligned { len, align_log } => {
                let (len, align) = (len.get(), 1u64 << (align_log % 34));
                // SAFETY: a writable handle.
                let got = unsafe { ap_alloc_aligned(pool, len, align, &mut r) };
                if !(64..=1 << 30).contains(&align) {
                    assert_eq!(got, Status::InvalidSize, "alignment {align}");
                } else {
                    m.alloc_result(got, r, len, "ap_alloc_aligned", align <= 4096);
                }
                if got == Status::Ok {
                    assert_eq!(m.live[&r].addr % align, 0);
                }
            }
            Op::Model { len } => {
                let len = len.get();
                // SAFETY: a writable handle.
                let got = unsafe { ap_alloc_model_input(pool, len, &mut r) };
                m.alloc_result(got, r, len, "ap_alloc_model_input", true);
                if got == Status::Ok {
                    assert_eq!(m.live[&r].addr % 128, 0);
                }
            }
            Op::AllocOn { kind, len, stream } => {
                let (len, s) = (len.get(), m.stream(stream));
                // SAFETY: a writable handle.
                let got = unsafe { ap_alloc_on(pool, kind.into(), len, s, &mut r) };
                if !(0..=4).contains(&kind) {
                    assert_eq!(got, Status::InvalidArgument);
                } else if !m.stream_live(s) {
                    assert_eq!(got, Status::BadStream);
                } else if matches!(
                    i32::from(kind),
                    KIND_DEVICE_ALIGN32 | KIND_CACHED | KIND_HOST
                ) {
                    assert_eq!(got, Status::WrongKind);
                } else {
                    m.alloc_result(got, r, len, "ap_alloc_on", true);
                }
            }
            Op::AllocOther { len } => {
                // SAFETY: a writable handle.
                let got = unsafe { ap_alloc(m.other, KIND_DEVICE, u64::from(len) + 1, &mut r) };
                assert_eq!(got, Status::Ok);
                m.other_live.push(r);
            }
            Op::Free(h) => {
                let (h, live) = m.resolve(h);
                let got = ap_free(pool, h);
                if live {
                    assert_eq!(got, Status::Ok);
                    m.live.remove(&h);
                    m.order.retain(|&x| x != h);
                    m.freed.push(h);
                } else {
                    assert_eq!(got, Status::BadRegion);
                }
            }
            Op::FromHost {
                dst,
                off,
                len,
                byte,
            } => {
                let (h, live) = m.resolve(dst);
                let (off, len) = (off.get(), u64::from(len));
                let buf = vec![byte; len as usize];
                // SAFETY: `buf` holds `len` bytes.
                let got = unsafe { ap_copy_from_host(pool, h, off, buf.as_ptr().cast(), len) };
                assert_eq!(got, m.span_status(h, live, off, len));
                if got == Status::Ok {
                    m.settle(h);
                    m.write_shadow(h, off, len, Some(byte));
                }
            }
            Op::ToHost { src, off, len } => {
                let (h, live) = m.resolve(src);
                let (off, len) = (off.get(), u64::from(len));
                let mut buf = vec![0u8; len as usize];
                // SAFETY: `buf` holds `len` writable bytes.
                let got = unsafe { ap_copy_to_host(pool, h, off, buf.as_mut_ptr().cast(), len) };
                assert_eq!(got, m.span_status(h, live, off, len));
                if got == Status::Ok {
                    m.settle(h);
                    for (i, b) in buf.iter().enumerate() {
                        let at = off as usize + i;
                        if let Some(Some(w)) = m.live[&h].head.get(at) {
                            assert_eq!(b, w, "region {h} byte {at}");
                        }
                    }
                }
            }
            Op::Copy {
                dst,
                dst_off,
                src,
                src_off,
                len,
                stream,
            } => {
                let stream = stream.map(|i| m.stream(i));
                let ((d, dl), (s, sl)) = (m.resolve(dst), m.resolve(src));
                let (doff, soff, len) = (dst_off.get(), src_off.get(), u64::from(len));
                let got = match stream {
                    Some(st) => ap_copy_async(pool, d, doff, s, soff, len, st),
                    None => ap_copy(pool, d, doff, s, soff, len),
                };
                let aligned = |h: u64, off: u64| (m.live[&h].addr.wrapping_add(off)) % 64 == 0;
                let want = if stream.is_some_and(|st| !m.stream_live(st)) {
                    Status::BadStream
                } else if d == s {
                    Status::InvalidArgument
                } else if !dl || !sl {
                    Status::BadRegion
                } else if !Model::bounds(doff, len, m.live[&d].len)
                    || !Model::bounds(soff, len, m.live[&s].len)
                {
                    Status::OutOfBounds
                } else if stream.is_some()
                    && m.live[&d].kind == KIND_HOST as u32
                    && m.live[&s].kind == KIND_HOST as u32
                {
                    // The runtime does no async copy within the host.
                    Status::WrongKind
                } else if stream.is_some() && !(aligned(d, doff) && aligned(s, soff)) {
                    Status::Misaligned
                } else {
                    Status::Ok
                };
                assert_eq!(got, want, "copy {d}+{doff} <- {s}+{soff}, {len}");
                if got == Status::Ok {
                    let ordered = match stream {
                        Some(st) => m.queue(st, &[d, s]),
                        None => {
                            m.settle(d);
                            m.settle(s);
                            true
                        }
                    };
                    let from: Vec<Option<u8>> = (soff..soff + len)
                        .map(|i| m.live[&s].head.get(i as usize).copied().flatten())
                        .map(|b| b.filter(|_| ordered))
                        .collect();
                    let t = m.live.get_mut(&d).unwrap();
                    for (i, b) in from.into_iter().enumerate() {
                        if let Some(slot) = t.head.get_mut(doff as usize + i) {
                            *slot = b;
                        }
                    }
                }
            }
            Op::Memset {
                dst,
                off,
                value,
                len,
                stream,
            } => {
                let stream = stream.map(|i| m.stream(i));
                let (h, live) = m.resolve(dst);
                let (off, len) = (off.get(), u64::from(len));
                let got = match stream {
                    Some(st) => ap_memset_async(pool, h, off, value, len, st),
                    None => ap_memset(pool, h, off, value, len),
                };
                let want = if stream.is_some_and(|st| !m.stream_live(st)) {
                    Status::BadStream
                } else {
                    m.span_status(h, live, off, len)
                };
                assert_eq!(got, want);
                if got == Status::Ok {
                    let ordered = match stream {
                        Some(st) => m.queue(st, &[h]),
                        None => {
                            m.settle(h);
                            true
                        }
                    };
                    m.write_shadow(h, off, len, Some(value).filter(|_| ordered));
                }
            }
            Op::HostWrite { dst, at, byte } => {
                let (h, live) = m.resolve(dst);
                let mut p: *mut c_void = std::ptr::null_mut();
                // SAFETY: a writable pointer.
                let got = unsafe { ap_host_ptr(pool, h, &mut p) };
                if !live {
                    assert_eq!(got, Status::BadRegion);
                } else if m.live[&h].kind != KIND_HOST as u32 {
                    assert_eq!(got, Status::WrongKind);
                } else {
                    assert_eq!(got, Status::Ok);
                    m.settle(h);
                    assert_eq!(p as u64, m.live[&h].addr);
                    let at = u64::from(at) % m.live[&h].len;
                    // SAFETY: `at` is inside the region's length, which `p` covers.
                    unsafe { p.cast::<u8>().add(at as usize).write(byte) };
                    m.write_shadow(h, at, 1, Some(byte));
                }
            }
            Op::Record { region, stream } => {
                let (h, live) = m.resolve(region);
                let s = m.stream(stream);
                let got = ap_record_stream(pool, h, s);
                let want = if !live {
                    Status::BadRegion
                } else if !m.stream_live(s) {
                    Status::BadStream
                } else {
                    Status::Ok
                };
                assert_eq!(got, want);
                if got == Status::Ok {
                    m.queue(s, &[h]);
                }
            }
            Op::StreamCreate => {
                if m.streams.len() < 3 {
                    // SAFETY: a writable handle.
                    assert_eq!(unsafe { ap_stream_create(pool, &mut r) }, Status::Ok);
                    m.streams.push(r);
                }
            }
            Op::StreamDestroy(i) => {
                let s = m.stream(i);
                let want = m.stream_status(s);
                assert_eq!(ap_stream_destroy(pool, s), want);
                if want == Status::Ok {
                    m.streams.retain(|&x| x != s);
                    m.dead_streams.push(s);
                    m.stream_done(s);
                }
            }
            Op::StreamSync(i) => {
                let s = m.stream(i);
                let want = m.stream_status(s);
                assert_eq!(ap_stream_synchronize(pool, s), want);
                m.stream_done(s);
            }
            Op::Trim => {
                // SAFETY: NULL asks for no count.
                assert_eq!(
                    unsafe { ap_pool_trim(pool, std::ptr::null_mut()) },
                    Status::Ok
                );
            }
            Op::Synchronize => assert_eq!(ap_pool_synchronize(pool), Status::Ok),
            Op::Publish(region) => {
                let (h, live) = m.resolve(region);
                let mut desc = vec![0u8; 1 << 16];
                let mut n = 0;
                // SAFETY: one readable id, `desc.len()` writable bytes and a writable size.
                let got = unsafe {
                    ap_share_publish(
                        pool,
                        h,
                        &m.me,
                        1,
                        desc.as_mut_ptr().cast(),
                        desc.len(),
                        &mut n,
                    )
                };
                let want = if !m.vmm {
                    Status::NotSupported
                } else if !live {
                    Status::BadRegion
                } else if matches!(m.live[&h].kind as i32, KIND_DVPP | KIND_HOST) {
                    Status::WrongKind
                } else {
                    Status::Ok
                };
                assert_eq!(got, want);
                if got == Status::Ok {
                    let mut handle = 0;
                    // SAFETY: the descriptor is NUL-terminated (`n` bytes with the NUL).
                    let got =
                        unsafe { ap_share_open(SOURCE_SIM, 0, desc.as_ptr().cast(), &mut handle) };
                    assert_eq!(got, Status::Ok);
                    let mut info = MappingInfo::default();
                    // SAFETY: a writable MappingInfo.
                    assert_eq!(
                        unsafe { ap_mapping_get_info(handle, &mut info) },
                        Status::Ok
                    );
                    let s = &m.live[&h];
                    assert_eq!((info.exporter_addr, info.len), (s.addr, s.len));
                    m.mappings.push(Mapped { handle, region: h });
                }
            }
            Op::MapRead(i) => {
                let (handle, open) = m.mapping(i);
                let mut back = vec![0u8; HEAD as usize];
                let Some(i) = open else {
                    // SAFETY: `back` is writable for its length.
                    let got = unsafe { ap_mapping_read(handle, 0, back.as_mut_ptr().cast(), 1) };
                    assert_eq!(got, Status::BadMapping);
                    continue;
                };
                match m.mapped_region(i) {
                    Some(r) => {
                        let head = &m.live[&r].head;
                        // SAFETY: as above; the head is at most `HEAD` bytes.
                        let got = unsafe {
                            ap_mapping_read(handle, 0, back.as_mut_ptr().cast(), head.len() as u64)
                        };
                        assert_eq!(got, Status::Ok);
                        for (j, (b, want)) in back.iter().zip(head).enumerate() {
                            if let Some(w) = want {
                                assert_eq!(b, w, "mapping of region {r}, byte {j}");
                            }
                        }
                    }
                    // Freed, or under a stream's work: readable, the bytes unknown.
                    None => {
                        // SAFETY: as above.
                        let got =
                            unsafe { ap_mapping_read(handle, 0, back.as_mut_ptr().cast(), 1) };
                        assert_eq!(got, Status::Ok);
                    }
                }
            }
            Op::MapWrite { mapping, at, byte } => {
                let (handle, open) = m.mapping(mapping);
                let b = [byte];
                match open.map(|i| (i, m.mapped_region(i))) {
                    None => {
                        // SAFETY: one readable byte.
                        let got = unsafe { ap_mapping_write(handle, 0, b.as_ptr().cast(), 1) };
                        assert_eq!(got, Status::BadMapping);
                    }
                    Some((_, Some(r))) => {
                        let at = u64::from(at) % m.live[&r].head.len() as u64;
                        // SAFETY: as above.
                        let got = unsafe { ap_mapping_write(handle, at, b.as_ptr().cast(), 1) };
                        assert_eq!(got, Status::Ok);
                        m.write_shadow(r, at, 1, Some(byte));
                    }
                    // Memory the model does not own now: only a write just past the end, refused.
                    Some((_, None)) => {
                        let mut info = MappingInfo::default();
                        // SAFETY: a writable MappingInfo.
                        assert_eq!(
                            unsafe { ap_mapping_get_info(handle, &mut info) },
                            Status::Ok
                        );
                        // SAFETY: as above.
                        let got =
                            unsafe { ap_mapping_write(handle, info.len, b.as_ptr().cast(), 1) };
                        assert_eq!(got, Status::OutOfBounds);
                    }
                }
            }
            Op::MapClose(i) => {
                let (handle, open) = m.mapping(i);
                let got = ap_mapping_close(handle);
                match open {
                    Some(i) => {
                        assert_eq!(got, Status::Ok);
                        m.mappings.remove(i);
                        m.closed_mappings.push(handle);
                    }
                    None => assert_eq!(got, Status::BadMapping),
                }
            }
            Op::MbufAlloc { size, kind } => {
                let size = size.get();
                // SAFETY: a writable handle.
                let got = unsafe { ap_mbuf_alloc(pool, size, kind.into(), &mut r) };
                if !(0..=1).contains(&kind) {
                    assert_eq!(got, Status::InvalidArgument);
                    continue;
                }
                match got {
                    Status::Ok => {
                        let mut i = MbufInfo::default();
                        // SAFETY: a writable MbufInfo.
                        assert_eq!(unsafe { ap_mbuf_get_info(pool, r, &mut i) }, Status::Ok);
                        assert_eq!(
                            (i.size, i.data_len, i.kind, i.refs),
                            (size, 0, kind as u32, 1)
                        );
                        assert_eq!(i.data % 128, 0);
                        m.mbufs.push((r, m.buffers.len()));
                        m.buffers.push(Some(BufShadow {
                            size,
                            data_len: 0,
                            kind: kind.into(),
                            head: vec![None; size.min(HEAD) as usize],
                            user: [0; 96],
                            addr: i.data - 128,
                        }));
                    }
                    Status::InvalidSize => assert!(size == 0 || size > u64::MAX / 2, "{size}"),
                    Status::OutOfMemory | Status::LimitExceeded => assert_ne!(size, 0),
                    other => panic!("ap_mbuf_alloc of {size}: {other:?}"),
                }
                if size == 0 {
                    assert_eq!(got, Status::InvalidSize);
                }
            }
            Op::MbufCopyRef(h) => {
                let (h, live) = m.resolve_buf(h);
                // SAFETY: a writable handle.
                let got = unsafe { ap_mbuf_copy_ref(pool, h, &mut r) };
                match live {
                    Some(at) => {
                        assert_eq!(got, Status::Ok);
                        m.mbufs.push((r, m.mbufs[at].1));
                    }
                    None => assert_eq!(got, Status::BadBuffer),
                }
            }
            Op::MbufFree(h) => {
                let (h, live) = m.resolve_buf(h);
                let got = ap_mbuf_free(pool, h);
                match live {
                    Some(at) => {
                        assert_eq!(got, Status::Ok);
                        let (_, b) = m.mbufs.remove(at);
                        if !m.mbufs.iter().any(|&(_, x)| x == b) {
                            m.buffers[b] = None;
                        }
                        m.freed_mbufs.push(h);
                    }
                    None => assert_eq!(got, Status::BadBuffer),
                }
            }
            Op::MbufWrite {
                buf,
                user,
                at,
                byte,
            } => {
                let (h, live) = m.resolve_buf(buf);
                let Some(i) = live else {
                    // SAFETY: one readable byte.
                    let got = unsafe { ap_mbuf_write(pool, h, 0, [byte].as_ptr().cast(), 1) };
                    assert_eq!(got, Status::BadBuffer);
                    continue;
                };
                let b = m.buffer(i);
                let cap = if user { 96 } else { b.size };
                // Some offsets a little past the end.
                let at = u64::from(at) % cap.saturating_add(8).min(1 << 16);
                let one = [byte];
                // SAFETY: one readable byte.
                let got = unsafe {
                    if user {
                        ap_mbuf_set_user_data(pool, h, at, one.as_ptr().cast(), 1)
                    } else {
                        ap_mbuf_write(pool, h, at, one.as_ptr().cast(), 1)
                    }
                };
                if at >= cap {
                    assert_eq!(got, Status::OutOfBounds);
                    continue;
                }
                assert_eq!(got, Status::Ok);
                let idx = m.mbufs[i].1;
                let b = m.buffers[idx].as_mut().unwrap();
                if user {
                    b.user[at as usize] = byte;
                } else if let Some(x) = b.head.get_mut(at as usize) {
                    *x = Some(byte);
                }
            }
            Op::MbufSetLen { buf, len } => {
                let (h, live) = m.resolve_buf(buf);
                let len = u64::from(len);
                let got = ap_mbuf_set_data_len(pool, h, len);
                match live {
                    None => assert_eq!(got, Status::BadBuffer),
                    Some(i) if len > m.buffer(i).size => assert_eq!(got, Status::OutOfBounds),
                    Some(i) => {
                        assert_eq!(got, Status::Ok);
                        let idx = m.mbufs[i].1;
                        m.buffers[idx].as_mut().unwrap().data_len = len;
                    }
                }
            }
            Op::MbufRead(h) => {
                let (h, live) = m.resolve_buf(h);
                let mut info = MbufInfo::default();
                // SAFETY: a writable MbufInfo.
                let got = unsafe { ap_mbuf_get_info(pool, h, &mut info) };
                let Some(i) = live else {
                    assert_eq!(got, Status::BadBuffer);
                    continue;
                };
                assert_eq!(got, Status::Ok);
                let idx = m.mbufs[i].1;
                let refs = m.mbufs.iter().filter(|&&(_, x)| x == idx).count();
                let b = m.buffer(i);
                assert_eq!(
                    (info.size, info.data_len, info.refs),
                    (b.size, b.data_len, refs as u32)
                );
                let mut head = vec![0u8; b.head.len()];
                let mut user = [0u8; 96];
                // SAFETY: `head` and `user` are writable for their lengths.
                unsafe {
                    let n = head.len() as u64;
                    assert_eq!(
                        ap_mbuf_read(pool, h, 0, head.as_mut_ptr().cast(), n),
                        Status::Ok
                    );
                    let got = ap_mbuf_get_user_data(pool, h, 0, user.as_mut_ptr().cast(), 96);
                    assert_eq!(got, Status::Ok);
                }
                for (j, (got, want)) in head.iter().zip(&b.head).enumerate() {
                    if let Some(w) = want {
                        assert_eq!(got, w, "buffer {h} byte {j}");
                    }
                }
                assert_eq!(user, b.user, "buffer {h}'s user data");
            }
            Op::LeakReport { cap } => {
                let mut out = vec![SegmentInfo::default(); usize::from(cap)];
                let mut n = usize::MAX;
                // SAFETY: `cap` writable entries and a writable count.
                let got = unsafe { ap_pool_leak_report(pool, out.as_mut_ptr(), out.len(), &mut n) };
                // Every live region, and the freed ones whose memory waits for a stream.
                assert!(n >= m.live.len(), "{n} listed, {} live", m.live.len());
                if n > out.len() {
                    assert_eq!(got, Status::BufferTooSmall);
                    assert!(out.iter().all(|s| *s == SegmentInfo::default()), "written");
                } else {
                    assert_eq!(got, Status::Ok);
                    let out = &out[..n];
                    assert!(out.windows(2).all(|w| w[0].addr < w[1].addr), "{out:?}");
                    let mut listed: Vec<(u64, u64, u32)> = out
                        .iter()
                        .filter(|s| s.pending == 0)
                        .map(|s| (s.addr, s.len, s.kind))
                        .collect();
                    let mut want: Vec<(u64, u64, u32)> =
                        m.live.values().map(|s| (s.addr, s.len, s.kind)).collect();
                    // A buffer is one segment: its 128-byte header, then its data.
                    want.extend(m.buffers.iter().flatten().map(|b| {
                        let kind = if b.kind == MBUF_DVPP {
                            KIND_DVPP
                        } else {
                            KIND_DEVICE
                        };
                        (b.addr, b.size + 128, kind as u32)
                    }));
                    listed.sort_unstable();
                    want.sort_unstable();
                    assert_eq!(listed, want);
                }
            }
            Op::RemakeOther => {
                let mut freed = 0;
                // SAFETY: a writable count.
                assert_eq!(unsafe { ap_pool_destroy(m.other, &mut freed) }, Status::Ok);
                assert_eq!(freed, m.other_live.len() as u64);
                m.dead_pools.push(m.other);
                m.other = create(c"chunk_size:2m");
                // Its regions' handles are gone with it; they stay foreign to the main pool.
                for &dead in &m.dead_pools {
                    assert_eq!(ap_pool_validate(dead), Status::BadPool);
                    if let Some(&h) = m.other_live.first() {
                        assert_eq!(ap_free(dead, h), Status::BadPool);
                    }
                }
                m.other_live.clear();
            }
        }
        m.check();
    }
    for &h in &m.order {
        m.check_head(h);
    }
    for mapped in std::mem::take(&mut m.mappings) {
        assert_eq!(ap_mapping_close(mapped.handle), Status::Ok);
    }
    for (h, _) in std::mem::take(&mut m.mbufs) {
        assert_eq!(ap_mbuf_free(pool, h), Status::Ok);
    }
    m.buffers.clear();
    for h in std::mem::take(&mut m.order) {
        assert_eq!(ap_free(pool, h), Status::Ok);
        m.live.remove(&h);
    }
    m.check();
    // No sequence writes past a region's length: no overrun was found, none is kept.
    let mut found = usize::MAX;
    // SAFETY: no buffer, a writable count.
    let got = unsafe { ap_pool_take_corruption_reports(pool, std::ptr::null_mut(), 0, &mut found) };
    assert_eq!((got, found), (Status::Ok, 0));
    // No live region left: the destroy frees nothing, and every padding stayed whole
    // (debug mode reports an overrun on free).
    let mut freed = u64::MAX;
    // SAFETY: a writable count.
    assert_eq!(unsafe { ap_pool_destroy(pool, &mut freed) }, Status::Ok);
    assert_eq!(freed, 0);
    // SAFETY: no count asked for.
    assert_eq!(
        unsafe { ap_pool_destroy(m.other, std::ptr::null_mut()) },
        Status::Ok
    );
}

fuzz_target!(|input: (bool, Vec<Op>)| run(input.0, input.1));
