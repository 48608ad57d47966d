//! Sharing device memory between real processes on the simulator.
//!
//! The test binary re-executes itself as the other process: `child_process` does nothing
//! unless `ASCEND_POOL_SHARE_ROLE` names a role. Parent and child talk in lines over the
//! child's stdin and stdout; the child's protocol lines start with `@@`.

#[path = "common/device.rs"]
mod common_device;

#[path = "common/memfd.rs"]
mod common_memfd;

#[path = "common/dropin.rs"]
mod common_dropin;

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use ascend_pool::mbuf::{Mbuf, MbufKind, SharedMbuf};
use ascend_pool::share::{Access, ShareDescriptor, SharedMapping, SharedPiece};
use ascend_pool::source::acl::AclSource;
use ascend_pool::source::sim::{AclFunc, Fault, SimConfig, SimSource};
use ascend_pool::source::vmm::{VmmConfig, VmmRuntime, VmmSource};
use ascend_pool::source::BlockSource;
use ascend_pool::{AclError, Error, MemKind, Pool, PoolConfig, Region};

const ROLE: &str = "ASCEND_POOL_SHARE_ROLE";
const PEER: &str = "ASCEND_POOL_SHARE_PEER";
const MIB: u64 = 1 << 20;

use common_memfd::{memory_objects, serial};

fn pattern(i: usize) -> u8 {
    (i * 7 + 3) as u8 % 251
}

/// Whether `data` holds the pattern's bytes from index `from` on.
fn patterned(data: &[u8], from: usize) -> bool {
    data.iter()
        .enumerate()
        .all(|(i, &b)| b == pattern(from + i))
}

fn sim() -> Arc<SimSource> {
    Arc::new(SimSource::new(SimConfig::default().with_device_capacity(256 * MIB)).unwrap())
}

fn used(sim: &SimSource) -> u64 {
    let (free, total) = sim.mem_info(0, MemKind::DEVICE).unwrap();
    total - free
}

/// A child process playing `role`, and the two ends of its line protocol.
struct Peer {
    child: Child,
    input: Option<ChildStdin>,
    /// Protocol lines, read by a thread so that a silent child fails the test, not hangs it.
    lines: mpsc::Receiver<String>,
}

impl Peer {
    fn spawn(role: &str, env: &[(&str, String)]) -> Self {
        let mut cmd = Command::new(std::env::current_exe().unwrap());
        cmd.args([
            "child_process",
            "--exact",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(ROLE, role)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped());
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().expect("re-run the test binary");
        let input = child.stdin.take();
        let output = BufReader::new(child.stdout.take().unwrap());
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for l in output.lines().map_while(Result::ok) {
                // libtest may print its own words before ours on the same line.
                if let Some(i) = l.find("@@") {
                    if tx.send(l[i + 2..].to_owned()).is_err() {
                        break;
                    }
                }
            }
        });
        Self {
            child,
            input,
            lines,
        }
    }

    /// The next protocol line, without its `@@`.
    fn line(&mut self) -> String {
        self.lines
            .recv_timeout(Duration::from_secs(60))
            .expect("the child ended or went silent")
    }

    fn send(&mut self, line: &str) {
        let input = self.input.as_mut().unwrap();
        writeln!(input, "{line}").unwrap();
        input.flush().unwrap();
    }

    fn finish(mut self) {
        drop(self.input.take());
        assert!(self.child.wait().unwrap().success(), "the child failed");
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        // A failed test must not leave the child waiting for a line.
        if self.input.is_some() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// Waits up to 5 s for `cond`; `what` names what it waited for if it times out.
fn eventually<S: std::fmt::Display>(what: impl FnOnce() -> S, mut cond: impl FnMut() -> bool) {
    let start = Instant::now();
    while !cond() {
        if start.elapsed() >= Duration::from_secs(5) {
            panic!("timed out waiting: {}", what());
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// One memory-counting test at a time, and the memory objects this process held when it
/// began.
///
/// The exporter's service thread holds a duplicate of each memory object it sends, from just
/// before the send until just after, and an importer may be done with it (and, in another
/// process, reaped) inside that window. So when the test ends (without a panic), the guard
/// waits until the count is back where it began before it lets the next test count: a
/// duplicate still open then would be counted by the next test as its own, and the count
/// would end one short of where that test began. A test takes it first, so that it drops
/// last, after everything else the test made.
struct Counted {
    start: usize,
    _serial: std::sync::MutexGuard<'static, ()>,
}

impl Counted {
    fn begin() -> Self {
        let serial = serial();
        Self {
            start: memory_objects(),
            _serial: serial,
        }
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        if std::thread::panicking() {
            return;
        }
        let start = self.start;
        let now = std::cell::Cell::new(start);
        eventually(
            || {
                format!(
                    "the {start} memory objects the test began with, not {}",
                    now.get()
                )
            },
            || {
                now.set(memory_objects());
                now.get() == start
            },
        );
    }
}

/// An exporter: a pool over the VMM source over the simulator.
fn exporter() -> (Arc<SimSource>, Arc<VmmSource<SimSource>>, Pool) {
    let sim = sim();
    let vmm = Arc::new(VmmSource::new(Arc::clone(&sim), 0, VmmConfig::default()).unwrap());
    let pool = Pool::new(vmm.clone(), PoolConfig::default()).unwrap();
    (sim, vmm, pool)
}

fn filled(pool: &Pool, len: u64) -> ascend_pool::DeviceRegion {
    let mut r = pool.alloc_device(len).unwrap();
    let data: Vec<u8> = (0..len as usize).map(pattern).collect();
    pool.copy_from_host(&mut r, 0, &data).unwrap();
    r
}

#[test]
fn a_whitelisted_process_reads_answers_and_keeps_the_memory_after_the_exporter_frees_it() {
    let _objects = Counted::begin();
    let (sim, vmm, pool) = exporter();
    // 3 MiB: the published range crosses granules.
    let region = filled(&pool, 3 * MIB);
    let mapped = vmm.stats().mapped_bytes;
    assert!(mapped >= 4 * MIB);
    let mut reader = Peer::spawn("reader", &[]);
    let tgid: i32 = reader
        .line()
        .strip_prefix("tgid ")
        .unwrap()
        .parse()
        .unwrap();
    let desc = vmm
        .publish_region(&region, &Access::Processes(vec![tgid]))
        .unwrap();
    assert_eq!(desc.len, 3 * MIB);
    reader.send(&desc.to_json());
    assert_eq!(reader.line(), "read ok");
    assert_eq!(reader.line(), "wrote");
    // The answer, written by the other process into our device memory.
    let mut answer = [0u8; 32];
    pool.copy_to_host(&region, 3 * MIB - 32, &mut answer)
        .unwrap();
    let expected = format!("answer from {tgid:>20}");
    assert_eq!(&answer[..expected.len()], expected.as_bytes());

    // The exporter frees everything: the region, then the chunk (its physical memory).
    drop(region);
    pool.trim();
    assert_eq!(vmm.stats().mapped_bytes, 0);
    // The importer still holds it: still charged to the device, and not importable again.
    assert_eq!(used(&sim), mapped);
    match SharedMapping::open(Arc::clone(&sim), 0, &desc) {
        Err(Error::ShareGone { handle }) => assert_eq!(handle, desc.pieces[0].handle),
        other => panic!("expected ShareGone, got {other:?}"),
    }
    reader.send("close");
    assert_eq!(reader.line(), "reread ok");
    assert_eq!(reader.line(), "closed 0");
    reader.finish();
    eventually(
        || "the importer's free reaches the exporter",
        || used(&sim) == 0,
    );
}

#[test]
fn a_process_off_the_whitelist_is_refused_and_any_process_opens_without_validation() {
    let _objects = Counted::begin();
    let (sim, vmm, pool) = exporter();
    let region = filled(&pool, MIB);
    let me = sim.bare_tgid().unwrap();
    let mut outsider = Peer::spawn("reader", &[]);
    let tgid: i32 = outsider
        .line()
        .strip_prefix("tgid ")
        .unwrap()
        .parse()
        .unwrap();
    assert_ne!(tgid, me);
    let desc = vmm
        .publish_region(&region, &Access::Processes(vec![me]))
        .unwrap();
    outsider.send(&desc.to_json());
    assert_eq!(outsider.line(), format!("err refused {tgid}"));
    outsider.finish();
    drop((region, pool, vmm, sim));

    // A whole pool published to any process (pid validation off), opened through the
    // AscendCL path: AclSource over the drop-in library in the child.
    let (_sim, vmm, pool) = exporter();
    let region = filled(&pool, MIB);
    let _other = pool.alloc_device(40 * MIB).unwrap(); // a dedicated chunk: a second extent
    let all = vmm.publish_all(&Access::AnyProcess).unwrap();
    assert!(all.pieces.len() >= 2, "{all:?}");
    let lib = common_dropin::dropin().to_string_lossy().into_owned();
    let mut reader = Peer::spawn("acl-reader", &[("ASCEND_POOL_SIM_LIB", lib)]);
    let _ = reader.line(); // tgid: not needed
    let window = format!("{} {} {}", region.addr(), MIB, all.to_json());
    reader.send(&window);
    assert_eq!(reader.line(), "read ok");
    reader.finish();
}

#[test]
fn the_first_publish_of_an_allocation_fixes_whether_importers_are_checked() {
    let _objects = Counted::begin();
    let (sim, vmm, pool) = exporter();
    let me = sim.bare_tgid().unwrap();
    let to_me = Access::Processes(vec![me]);
    // Two regions of one chunk: one physical allocation.
    let a = filled(&pool, MIB);
    let b = filled(&pool, 256 << 10);
    let desc_a = vmm.publish_region(&a, &to_me).unwrap();
    let handle = desc_a.pieces[0].handle;
    match vmm.publish_region(&b, &Access::AnyProcess) {
        Err(Error::ShareAccessFixed {
            handle: h,
            any_process: false,
        }) => assert_eq!(h, handle),
        other => panic!("publishing to any process after a whitelist gave {other:?}"),
    }
    let desc_b = vmm.publish_region(&b, &to_me).unwrap();
    assert_eq!(desc_b.pieces, desc_a.pieces, "one allocation, one handle");

    // The chunk grows in place with other allocations, not exported yet. A region past the
    // first granule lies on them alone: publishing everything to any process is refused
    // before they are exported, so they can still go to any process.
    let _across = pool.alloc_device(MIB).unwrap();
    let c = pool.alloc_device(8 * MIB).unwrap();
    assert!(c.addr() >= desc_a.base + desc_a.span as usize);
    assert!(matches!(
        vmm.publish_all(&Access::AnyProcess),
        Err(Error::ShareAccessFixed {
            any_process: false,
            ..
        })
    ));
    let desc_c = vmm.publish_region(&c, &Access::AnyProcess).unwrap();
    assert_ne!(desc_c.pieces[0].handle, handle);
    match vmm.publish_region(&c, &to_me) {
        Err(Error::ShareAccessFixed {
            handle: h,
            any_process: true,
        }) => assert_eq!(h, desc_c.pieces[0].handle),
        other => panic!("a whitelist after publishing to any process gave {other:?}"),
    }
    for d in [&desc_a, &desc_b, &desc_c] {
        SharedMapping::open(Arc::clone(&sim), 0, d)
            .unwrap()
            .close()
            .unwrap();
    }
}

#[test]
fn a_close_the_runtime_refuses_keeps_what_it_holds_until_tried_again() {
    let _objects = Counted::begin();
    let (sim, vmm, pool) = exporter();
    let region = filled(&pool, MIB);
    let me = sim.bare_tgid().unwrap();
    let desc = vmm
        .publish_region(&region, &Access::Processes(vec![me]))
        .unwrap();
    let held = |sim: &SimSource| {
        let s = sim.stats();
        (s.reservations, s.physical_handles, s.mappings)
    };
    let exporter_holds = held(&sim);
    for func in [
        AclFunc::UnmapMem,
        AclFunc::FreePhysical,
        AclFunc::ReleaseMemAddress,
    ] {
        let mut m = SharedMapping::open(Arc::clone(&sim), 0, &desc).unwrap();
        sim.inject_fault(Fault::always(func, AclError::RT_MEMORY_ALLOCATION));
        assert!(
            matches!(m.try_close(), Err(Error::Runtime { .. })),
            "{func}"
        );
        assert!(m.holds_memory(), "{func}");
        assert_ne!(
            held(&sim),
            exporter_holds,
            "{func}: let go of what it could not"
        );
        let mut byte = [0u8; 1];
        assert_eq!(m.read(0, &mut byte), Err(Error::AlreadyFreed));
        assert_eq!(m.write(0, &byte), Err(Error::AlreadyFreed));
        assert!(m.try_close().is_err(), "{func}: still refused");
        sim.clear_faults();
        m.try_close().unwrap();
        assert!(!m.holds_memory());
        assert_eq!(
            held(&sim),
            exporter_holds,
            "{func}: all let go on the retry"
        );
        m.try_close().unwrap();

        // `close` consumes the mapping: its drop tries once more.
        let m = SharedMapping::open(Arc::clone(&sim), 0, &desc).unwrap();
        sim.inject_fault(Fault::next(func, AclError::RT_MEMORY_ALLOCATION, 1));
        assert!(m.close().is_err(), "{func}");
        sim.clear_faults();
        assert_eq!(held(&sim), exporter_holds, "{func}: the drop let go");
    }
}

#[test]
fn memory_outlives_the_exporting_process_until_the_importer_frees_it() {
    let objects = Counted::begin();
    let sim = sim();
    let me = sim.bare_tgid().unwrap();
    let mut exporter = Peer::spawn("exporter", &[(PEER, me.to_string())]);
    let desc = ShareDescriptor::from_json(exporter.line().strip_prefix("desc ").unwrap()).unwrap();
    let mapping = SharedMapping::open(Arc::clone(&sim), 0, &desc).unwrap();
    assert_eq!(memory_objects(), objects.start + desc.pieces.len());
    exporter.send("imported");
    exporter.finish(); // the exporting process is gone

    let mut back = vec![0u8; desc.len as usize];
    mapping.read(0, &mut back).unwrap();
    assert!(patterned(&back, 0));
    mapping.write(0, b"still writable").unwrap();
    assert_eq!(used(&sim), 0, "imported memory is charged to its exporter");
    mapping.close().unwrap();
    assert_eq!(memory_objects(), objects.start);
    let s = sim.stats();
    assert_eq!((s.reservations, s.physical_handles, s.mappings), (0, 0, 0));
    // Its exporter has exited: nothing to import any more.
    assert!(matches!(
        SharedMapping::open(Arc::clone(&sim), 0, &desc),
        Err(Error::ShareGone { .. })
    ));
}

#[test]
fn a_secondary_process_reads_a_buffer_the_primary_authorised() {
    let _objects = Counted::begin();
    let (_sim, vmm, pool) = exporter();
    let pool = Arc::new(pool);
    let buf = Mbuf::alloc(&pool, 64 << 10, MbufKind::Normal).unwrap();
    buf.write(0, b"decoded frame 42").unwrap();
    buf.set_data_len(16).unwrap();
    buf.set_user_data(b"stream=3", 8).unwrap();
    let mut secondary = Peer::spawn("mbuf-reader", &[]);
    let tgid: i32 = secondary
        .line()
        .strip_prefix("tgid ")
        .unwrap()
        .parse()
        .unwrap();
    let desc = buf.publish(&vmm, &Access::Processes(vec![tgid])).unwrap();
    secondary.send(&desc.to_json());
    assert_eq!(secondary.line(), "mbuf 65536 16 stream=3 decoded frame 42");
    secondary.finish();
}

/// A buffer opened in the process that published it: its header, data and bounds read as the
/// primary wrote them, and closing gives back what was imported. Memory that is not a buffer
/// is refused, and nothing stays imported.
#[test]
fn an_opened_buffer_reads_only_what_its_header_describes() {
    let _objects = Counted::begin();
    let (sim, vmm, pool) = exporter();
    let pool = Arc::new(pool);
    let held = |sim: &SimSource| {
        let s = sim.stats();
        (s.reservations, s.physical_handles, s.mappings)
    };
    let buf = Mbuf::alloc(&pool, 1000, MbufKind::Normal).unwrap();
    let data: Vec<u8> = (0..1000).map(pattern).collect();
    buf.write(0, &data).unwrap();
    buf.set_data_len(900).unwrap();
    buf.set_user_data(b"stream=3", 8).unwrap();
    let desc = buf.publish(&vmm, &Access::AnyProcess).unwrap();
    let exporter_holds = held(&sim);

    // The raw mapping shows the header the module documents, then the data.
    let raw = SharedMapping::open(Arc::clone(&sim), 0, &desc).unwrap();
    assert_eq!(raw.translate(buf.data().0), Some(raw.addr() + 128));
    let mut head = [0u8; 48];
    raw.read(0, &mut head).unwrap();
    assert_eq!(&head[..8], b"APMBUF01");
    assert_eq!(head[8..16], 1000u64.to_le_bytes());
    assert_eq!(head[16..24], 900u64.to_le_bytes());
    assert_eq!(head[24..28], [0; 4], "kind: device memory");
    assert_eq!(&head[40..48], b"stream=3");
    raw.close().unwrap();

    let opened = SharedMbuf::open(Arc::clone(&sim), 0, &desc).unwrap();
    assert_eq!(opened.size(), 1000);
    assert_eq!(opened.data_len().unwrap(), 900);
    let mut user = [0u8; 8];
    opened.user_data(&mut user, 8).unwrap();
    assert_eq!(&user, b"stream=3");
    let mut eight = [0u8; 8];
    for at in [0, 100, 992] {
        opened.read(at, &mut eight).unwrap();
        assert!(patterned(&eight, at as usize), "data at {at}");
    }
    let past = |offset, len, capacity| {
        Err(Error::OutOfBounds {
            offset,
            len,
            capacity,
            side: None,
        })
    };
    assert_eq!(opened.read(996, &mut eight), past(996, 8, 1000));
    assert_eq!(opened.read(u64::MAX, &mut eight), past(u64::MAX, 8, 1000));
    assert_eq!(opened.read(0, &mut []), past(0, 0, 1000));
    assert_eq!(opened.user_data(&mut eight, 89), past(89, 8, 96));
    opened.close().unwrap();
    assert_eq!(held(&sim), exporter_holds, "close gave back the import");

    // A close the runtime refuses is reported; `try_close` gives back at once.
    let opened = SharedMbuf::open(Arc::clone(&sim), 0, &desc).unwrap();
    sim.inject_fault(Fault::next(AclFunc::UnmapMem, AclError::RT_FAILURE, 1));
    assert_eq!(
        opened.close(),
        Err(Error::Runtime {
            func: "aclrtUnmapMem",
            code: AclError::RT_FAILURE
        })
    );
    assert_eq!(held(&sim), exporter_holds, "the drop let go");
    let mut opened = SharedMbuf::open(Arc::clone(&sim), 0, &desc).unwrap();
    sim.inject_fault(Fault::next(AclFunc::FreePhysical, AclError::RT_FAILURE, 1));
    assert!(opened.try_close().is_err());
    assert_ne!(held(&sim), exporter_holds);
    opened.try_close().unwrap();
    assert_eq!(held(&sim), exporter_holds, "given back before the drop");
    assert_eq!(opened.read(0, &mut eight), Err(Error::AlreadyFreed));
    drop(opened);

    // Memory that is not a buffer: each case breaks one rule alone.
    let header = |magic: &[u8; 8], size: u64| {
        let mut h = [0u8; 16];
        h[..8].copy_from_slice(magic);
        h[8..].copy_from_slice(&size.to_le_bytes());
        h
    };
    let cases: [(&str, u64, Option<[u8; 16]>); 5] = [
        ("no header", 1128, None),
        (
            "a size that does not match",
            1128,
            Some(header(b"APMBUF01", 999)),
        ),
        ("another magic", 1128, Some(header(b"APMBUF02", 1000))),
        ("a header and no data", 128, Some(header(b"APMBUF01", 0))),
        ("shorter than a header's first fields", 8, None),
    ];
    for (what, len, head) in cases {
        let mut region = filled(&pool, len);
        if let Some(h) = head {
            pool.copy_from_host(&mut region, 0, &h).unwrap();
        }
        let desc = vmm.publish_region(&region, &Access::AnyProcess).unwrap();
        let before = held(&sim);
        assert!(
            matches!(
                SharedMbuf::open(Arc::clone(&sim), 0, &desc),
                Err(Error::ForeignHandle)
            ),
            "{what}"
        );
        assert_eq!(held(&sim), before, "{what}: nothing stays imported");
    }
    drop((buf, pool, vmm));
}

/// A descriptor names a buffer, not its memory: once the buffer is freed it is refused,
/// before the memory is reused and after a buffer of the same size is allocated there
/// (which it used to open, reading the new owner's data).
#[test]
#[cfg_attr(
    miri,
    ignore = "virtual memory reserves addresses with PROT_NONE, which Miri refuses"
)]
fn a_descriptor_of_a_freed_buffer_is_refused() {
    let _objects = Counted::begin();
    let (sim, vmm, pool) = exporter();
    let pool = Arc::new(pool);
    let refused = |desc: &ascend_pool::share::ShareDescriptor| {
        matches!(
            SharedMbuf::open(Arc::clone(&sim), 0, desc),
            Err(Error::ForeignHandle)
        )
    };
    // Freed, through `free` or a drop, and nothing allocated there since.
    for by_free in [true, false] {
        let buf = Mbuf::alloc(&pool, 1000, MbufKind::Normal).unwrap();
        let desc = buf.publish(&vmm, &Access::AnyProcess).unwrap();
        SharedMbuf::open(Arc::clone(&sim), 0, &desc).unwrap();
        if by_free {
            buf.free().unwrap();
        } else {
            drop(buf);
        }
        assert!(
            refused(&desc),
            "freed by {}",
            ["drop", "free"][usize::from(by_free)]
        );
    }
    // Another buffer of the same size at the same address.
    let old = Mbuf::alloc(&pool, 1000, MbufKind::Normal).unwrap();
    let (addr, _) = old.data();
    let desc = old.publish(&vmm, &Access::AnyProcess).unwrap();
    drop(old);
    let new = Mbuf::alloc(&pool, 1000, MbufKind::Normal).unwrap();
    assert_eq!(new.data().0, addr, "the memory was reused");
    new.set_user_data(b"owner=B", 0).unwrap();
    assert!(refused(&desc));
    let fresh = new.publish(&vmm, &Access::AnyProcess).unwrap();
    let mut tag = [0u8; 7];
    let opened = SharedMbuf::open(Arc::clone(&sim), 0, &fresh).unwrap();
    opened.user_data(&mut tag, 0).unwrap();
    assert_eq!(&tag, b"owner=B");
    drop((opened, new));
    assert_eq!(pool.stats(MemKind::DEVICE).live_regions, 0);
    pool.validate().unwrap();
}

/// A publish whose process id the runtime will not give exports nothing, so the access is
/// not fixed by it: it used to export first, and the next publish under the other access
/// was refused with `ShareAccessFixed`.
#[test]
#[cfg_attr(
    miri,
    ignore = "virtual memory reserves addresses with PROT_NONE, which Miri refuses"
)]
fn a_publish_refused_its_process_id_fixes_no_access() {
    let _objects = Counted::begin();
    let (sim, vmm, pool) = exporter();
    let region = pool.alloc_device(4096).unwrap();
    let me = sim.bare_tgid().unwrap();
    sim.inject_fault(Fault::next(
        AclFunc::DeviceGetBareTgid,
        AclError::RT_FAILURE,
        1,
    ));
    assert!(vmm.publish_region(&region, &Access::AnyProcess).is_err());
    let desc = vmm
        .publish_region(&region, &Access::Processes(vec![me]))
        .unwrap();
    assert_eq!(desc.exporter, me);
    drop((region, pool, vmm));
}

/// The header lives in device memory any holder of the descriptor can write (a
/// `SharedMapping` of it): a valid data length past the buffer's data is refused, on either
/// side, as setting it is, and never reaches a caller as a length it could size a read by.
#[test]
#[cfg_attr(
    miri,
    ignore = "virtual memory reserves addresses with PROT_NONE, which Miri refuses"
)]
fn a_data_length_past_the_buffer_written_through_a_mapping_is_refused() {
    let _objects = Counted::begin();
    let (sim, vmm, pool) = exporter();
    let pool = Arc::new(pool);
    let buf = Mbuf::alloc(&pool, 1000, MbufKind::Normal).unwrap();
    buf.set_data_len(900).unwrap();
    let desc = buf.publish(&vmm, &Access::AnyProcess).unwrap();
    let opened = SharedMbuf::open(Arc::clone(&sim), 0, &desc).unwrap();
    let raw = SharedMapping::open(Arc::clone(&sim), 0, &desc).unwrap();
    for len in [1001, 1 << 40, u64::MAX] {
        raw.write(16, &len.to_le_bytes()).unwrap();
        let past = Err(Error::OutOfBounds {
            offset: 0,
            len,
            capacity: 1000,
            side: None,
        });
        assert_eq!(opened.data_len(), past, "opened: {len}");
        assert_eq!(buf.data_len(), past, "the publisher's own: {len}");
    }
    // The whole data is a valid length; the publisher can set it right again.
    raw.write(16, &1000u64.to_le_bytes()).unwrap();
    assert_eq!(opened.data_len(), Ok(1000));
    buf.set_data_len(900).unwrap();
    assert_eq!((opened.data_len(), buf.data_len()), (Ok(900), Ok(900)));
    raw.close().unwrap();
    opened.close().unwrap();
    drop((buf, pool, vmm));
}

/// The other process. Does nothing in a normal test run.
#[test]
fn child_process() {
    let Ok(role) = std::env::var(ROLE) else {
        return;
    };
    let mut stdin = std::io::stdin().lock();
    let mut line = String::new();
    let mut next_line = move || {
        line.clear();
        stdin.read_line(&mut line).unwrap();
        line.trim_end().to_owned()
    };
    match role.as_str() {
        "reader" => {
            let sim = sim();
            let tgid = sim.bare_tgid().unwrap();
            println!("@@tgid {tgid}");
            let desc = ShareDescriptor::from_json(&next_line()).unwrap();
            let mapping = match SharedMapping::open(Arc::clone(&sim), 0, &desc) {
                Ok(m) => m,
                Err(Error::ShareRefused { pid, .. }) => return println!("@@err refused {pid}"),
                Err(e) => return println!("@@err {e}"),
            };
            let check = |m: &SharedMapping<SimSource>| {
                let mut data = vec![0u8; m.len() as usize - 32];
                m.read(0, &mut data).unwrap();
                patterned(&data, 0)
            };
            println!("@@read {}", if check(&mapping) { "ok" } else { "bad" });
            let answer = format!("answer from {tgid:>20}");
            mapping
                .write(mapping.len() - 32, answer.as_bytes())
                .unwrap();
            println!("@@wrote");
            assert_eq!(next_line(), "close");
            // By now the exporter has freed its memory: ours is intact.
            println!("@@reread {}", if check(&mapping) { "ok" } else { "bad" });
            mapping.close().unwrap();
            println!("@@closed {}", memory_objects());
        }
        "acl-reader" => {
            let acl = Arc::new(AclSource::open(common_dropin::dropin()).unwrap());
            println!("@@tgid {}", acl.bare_tgid().unwrap());
            let l = next_line();
            let mut parts = l.splitn(3, ' ');
            let addr: usize = parts.next().unwrap().parse().unwrap();
            let len: usize = parts.next().unwrap().parse().unwrap();
            let desc = ShareDescriptor::from_json(parts.next().unwrap()).unwrap();
            let mapping = SharedMapping::open(Arc::clone(&acl), 0, &desc).unwrap();
            let local = mapping.translate(addr).unwrap();
            // `local..local + len` lies in the mapping, which is open.
            let data = common_device::read(&*acl, local, len);
            let ok = patterned(&data, 0);
            println!("@@read {}", if ok { "ok" } else { "bad" });
            mapping.close().unwrap();
        }
        "mbuf-reader" => {
            let sim = sim();
            println!("@@tgid {}", sim.bare_tgid().unwrap());
            let desc = ShareDescriptor::from_json(&next_line()).unwrap();
            let buf = SharedMbuf::open(Arc::clone(&sim), 0, &desc).unwrap();
            let len = buf.data_len().unwrap();
            let mut user = [0u8; 8];
            buf.user_data(&mut user, 8).unwrap();
            let mut data = vec![0u8; len as usize];
            buf.read(0, &mut data).unwrap();
            println!(
                "@@mbuf {} {len} {} {}",
                buf.size(),
                String::from_utf8_lossy(&user),
                String::from_utf8_lossy(&data)
            );
            buf.close().unwrap();
        }
        "exporter" => {
            let peer: i32 = std::env::var(PEER).unwrap().parse().unwrap();
            let (_sim, vmm, pool) = exporter();
            let region = filled(&pool, 5 * MIB);
            let desc = vmm
                .publish_region(&region, &Access::Processes(vec![peer]))
                .unwrap();
            println!("@@desc {}", desc.to_json());
            assert_eq!(next_line(), "imported");
            // Exit holding everything: the process's end releases it.
            std::process::exit(0);
        }
        "forking-exporter" => {
            let (_sim, vmm, pool) = exporter();
            let region = filled(&pool, MIB);
            let desc = vmm.publish_region(&region, &Access::AnyProcess).unwrap();
            println!("@@desc {}", desc.to_json());
            let mut ready = [0i32; 2];
            // SAFETY: `ready` holds two descriptors.
            assert_eq!(unsafe { libc::pipe(ready.as_mut_ptr()) }, 0);
            // SAFETY: the child only says it runs and waits for its alarm: it calls nothing
            // that is not async-signal-safe and never returns into the test harness.
            let pid = unsafe { libc::fork() };
            if pid == 0 {
                // SAFETY: plain calls on the pipe above; the alarm ends the child if no one
                // kills it.
                unsafe {
                    // fork's child handlers have run (the parent's listener is let go):
                    // only now may the exporter exit and the test import.
                    libc::write(ready[1], [1u8].as_ptr().cast(), 1);
                    libc::alarm(30);
                    loop {
                        libc::pause();
                    }
                }
            }
            let mut byte = [0u8];
            // SAFETY: reads one byte into `byte` from the pipe above.
            assert_eq!(
                unsafe { libc::read(ready[0], byte.as_mut_ptr().cast(), 1) },
                1
            );
            println!("@@forked {pid}");
            // Exit holding everything, leaving the child behind.
            std::process::exit(0);
        }
        other => panic!("unknown role {other}"),
    }
}

/// An exporter that forked a child and exited: its handles are gone at once, though the
/// child lives on. The child used to keep its copy of the exporter's listening socket, so an
/// import connected, waited 5 s for an answer no thread would give, and failed with
/// ACL_ERROR_RT_FAILURE rather than ShareGone.
#[test]
fn an_exited_exporters_handles_are_gone_while_its_forked_child_lives() {
    let sim = sim();
    let mut exporter = Peer::spawn("forking-exporter", &[]);
    let desc = ShareDescriptor::from_json(exporter.line().strip_prefix("desc ").unwrap()).unwrap();
    let child: i32 = exporter
        .line()
        .strip_prefix("forked ")
        .unwrap()
        .parse()
        .unwrap();
    assert!(child > 0);
    exporter.finish();
    let start = Instant::now();
    let r = SharedMapping::open(Arc::clone(&sim), 0, &desc);
    let took = start.elapsed();
    // SAFETY: ends the exporter's child, which only waits.
    unsafe { libc::kill(child, libc::SIGKILL) };
    assert!(
        matches!(r, Err(Error::ShareGone { .. })),
        "{r:?} after {took:?}"
    );
    assert!(took < Duration::from_secs(2), "took {took:?}");
    let s = sim.stats();
    assert_eq!((s.reservations, s.physical_handles, s.mappings), (0, 0, 0));
}

/// A descriptor comes from another process: one that publishes nothing, or whose pieces and
/// span do not add up, is refused as a bad descriptor before anything is reserved. Each case
/// breaks one rule alone.
#[test]
fn descriptors_that_do_not_add_up_are_refused_before_anything_is_reserved() {
    let _objects = Counted::begin();
    let sim = sim();
    let g = 2 * MIB;
    let piece = |offset, len| SharedPiece {
        offset,
        len,
        handle: 0x5eed,
    };
    let desc = |pieces, span, offset, len| ShareDescriptor {
        exporter: 1,
        base: 0x1000_0000,
        span,
        pieces,
        offset,
        len,
        buffer: 0,
    };
    let cases = [
        ("no bytes", desc(vec![piece(0, g)], g, 0, 0)),
        ("no pieces", desc(vec![], g, 0, g)),
        ("bytes past the span", desc(vec![piece(0, g)], g, 8, g)),
        (
            "overlapping pieces",
            desc(vec![piece(0, 2 * g), piece(g, 2 * g)], 3 * g, 0, g),
        ),
        (
            "an empty piece",
            desc(vec![piece(0, g), piece(g, 0)], g, 0, g),
        ),
        (
            "a piece off a granule",
            desc(vec![piece(4096, g)], 4096 + g, 4096, 8),
        ),
        (
            "a piece of part of a granule",
            desc(vec![piece(0, g + 4096)], g + 4096, 0, g),
        ),
        (
            "a span past the pieces",
            desc(vec![piece(0, g)], 2 * g, 0, g),
        ),
    ];
    for (what, d) in cases {
        match SharedMapping::open(Arc::clone(&sim), 0, &d) {
            Err(Error::Config(_)) => {}
            other => panic!("{what}: {other:?}"),
        }
    }
    let st = sim.stats();
    assert_eq!((st.reservations, st.physical_handles), (0, 0));
    assert_eq!(st.calls(AclFunc::ReserveMemAddress), 0);
}

/// An opened mapping of a region that starts inside a granule: its address holds the
/// region's bytes, `translate` maps exactly the published window, and copies of nothing or
/// past the window are refused.
#[test]
fn a_mapping_translates_and_copies_only_inside_its_window() {
    let _objects = Counted::begin();
    let (sim, vmm, pool) = exporter();
    let _before = pool.alloc_device(4096).unwrap();
    let region = filled(&pool, 1000);
    let desc = vmm.publish_region(&region, &Access::AnyProcess).unwrap();
    assert!(
        desc.offset > 0,
        "the region starts inside a granule: {desc:?}"
    );
    let m = SharedMapping::open(Arc::clone(&sim), 0, &desc).unwrap();
    assert!(!m.is_empty());
    assert_eq!(m.len(), 1000);
    assert!(format!("{m:?}").starts_with("SharedMapping"));
    // The runtime reads the region's first bytes at the mapping's address.
    let first = common_device::read(&*sim, m.addr(), 16);
    assert!(patterned(&first, 0));
    assert_eq!(m.translate(region.addr()), Some(m.addr()));
    assert_eq!(m.translate(region.addr() + 999), Some(m.addr() + 999));
    assert_eq!(m.translate(region.addr() + 1000), None);
    assert_eq!(m.translate(region.addr() - 1), None);
    let refused = |r: ascend_pool::Result<()>| matches!(r, Err(Error::OutOfBounds { .. }));
    let mut buf = [0u8; 8];
    assert!(refused(m.read(996, &mut buf)), "a read past the window");
    assert!(refused(m.write(996, &buf)), "a write past the window");
    assert!(refused(m.read(0, &mut [])), "a read of nothing");
    assert!(refused(m.write(1000, &[])), "a write of nothing");
    m.read(992, &mut buf).unwrap();
    assert!(patterned(&buf, 992));
    m.close().unwrap();
    drop((region, pool, vmm));
}

/// An import refused by the whitelist names this process (-1 when its id cannot be had);
/// one that fails for another reason reports the runtime's error as it is. Nothing stays
/// reserved or imported either way.
#[test]
fn import_failures_are_reported_as_what_they_are() {
    let _objects = Counted::begin();
    let (sim, vmm, pool) = exporter();
    let region = filled(&pool, 1000);
    let me = sim.bare_tgid().unwrap();
    let others = vmm
        .publish_region(&region, &Access::Processes(vec![me + 1]))
        .unwrap();
    let open = |d: &ShareDescriptor| SharedMapping::open(Arc::clone(&sim), 0, d);
    match open(&others) {
        Err(Error::ShareRefused { pid, .. }) => assert_eq!(pid, me),
        other => panic!("{other:?}"),
    }
    sim.inject_fault(Fault::next(
        AclFunc::DeviceGetBareTgid,
        AclError::RT_FAILURE,
        1,
    ));
    match open(&others) {
        Err(Error::ShareRefused { pid, .. }) => assert_eq!(pid, -1),
        other => panic!("{other:?}"),
    }
    // The same allocation, this process let in: the import itself fails.
    let second = filled(&pool, 1000);
    let mine = vmm
        .publish_region(&second, &Access::Processes(vec![me]))
        .unwrap();
    sim.inject_fault(Fault::next(
        AclFunc::MemImportFromShareableHandle,
        AclError::RT_FAILURE,
        1,
    ));
    match open(&mine) {
        Err(Error::Runtime { func, code }) => {
            assert_eq!(
                (func, code),
                ("aclrtMemImportFromShareableHandle", AclError::RT_FAILURE)
            )
        }
        other => panic!("{other:?}"),
    }
    let m = open(&mine).unwrap();
    m.close().unwrap();
    drop((region, second, pool, vmm));
    let st = sim.stats();
    assert_eq!(
        (st.reservations, st.physical_handles, st.mappings),
        (0, 0, 0)
    );
}

/// Publishing a range some of which this source never mapped is refused.
#[test]
fn a_range_reaching_past_what_was_mapped_is_not_published() {
    let _objects = Counted::begin();
    let (_sim, vmm, pool) = exporter();
    let region = filled(&pool, 1000);
    let (base, _) = vmm.reservation();
    let mapped = vmm.stats().mapped_bytes;
    assert!(matches!(
        vmm.publish_range(base, mapped + 1, &Access::AnyProcess),
        Err(Error::ForeignHandle)
    ));
    vmm.publish_range(base, mapped, &Access::AnyProcess)
        .unwrap();
    drop((region, pool));
}

/// Two simulators in one process, the crate's and the drop-in library's, run an export
/// service each (their handles differ in the instance bits): memory exported by either is
/// imported through the other.
#[test]
fn two_simulators_in_one_process_import_each_others_memory() {
    let _objects = Counted::begin();
    let (sim, vmm, pool) = exporter();
    let region = filled(&pool, 1000);
    let from_sim = vmm.publish_region(&region, &Access::AnyProcess).unwrap();
    let acl = Arc::new(AclSource::open(common_dropin::dropin()).unwrap());
    let acl_vmm = Arc::new(VmmSource::new(Arc::clone(&acl), 0, VmmConfig::default()).unwrap());
    let acl_pool = Pool::new(acl_vmm.clone(), PoolConfig::default()).unwrap();
    let acl_region = filled(&acl_pool, 1000);
    let from_acl = acl_vmm
        .publish_region(&acl_region, &Access::AnyProcess)
        .unwrap();
    let pieces = |d: &ShareDescriptor| d.pieces.iter().map(|p| p.handle).collect::<Vec<_>>();
    assert_ne!(pieces(&from_sim), pieces(&from_acl));
    let mut back = vec![0u8; 1000];
    let into_sim = SharedMapping::open(Arc::clone(&sim), 0, &from_acl).unwrap();
    into_sim.read(0, &mut back).unwrap();
    assert!(patterned(&back, 0));
    into_sim.close().unwrap();
    back.fill(0);
    let into_acl = SharedMapping::open(Arc::clone(&acl), 0, &from_sim).unwrap();
    into_acl.read(0, &mut back).unwrap();
    assert!(patterned(&back, 0));
    into_acl.close().unwrap();
    drop((acl_region, acl_pool, acl_vmm, region, pool, vmm));
}

#[test]
fn a_process_imports_a_shareable_handle_once_and_its_mappings_share_that_import() {
    let _objects = Counted::begin();
    let (exp, vmm, pool) = exporter();
    // Two regions of one chunk: both descriptors name the same physical allocation.
    let a = filled(&pool, 1000);
    let b = filled(&pool, 3000);
    let da = vmm.publish_region(&a, &Access::AnyProcess).unwrap();
    let db = vmm.publish_region(&b, &Access::AnyProcess).unwrap();
    let handle = da.pieces[0].handle;
    assert!(
        db.pieces.iter().any(|p| p.handle == handle),
        "one allocation"
    );

    // The runtime maps handles and shareable handles one to one within a process: a
    // second raw import of the same handle is refused, by any copy of the runtime here.
    let reader = sim();
    let first = reader.import_shareable(handle, 0).unwrap();
    for other in [&reader, &sim()] {
        let e = other.import_shareable(handle, 0).unwrap_err();
        assert!(
            matches!(e, Error::Runtime { func: "aclrtMemImportFromShareableHandle", code }
                if code == AclError::RT_PARAM_INVALID),
            "{e:?}"
        );
    }
    reader.free_physical(first).unwrap();
    let again = reader.import_shareable(handle, 0).unwrap();
    reader.free_physical(again).unwrap();

    // So mappings of the same allocation share one import, and each reads its own bytes.
    let ma = SharedMapping::open(Arc::clone(&reader), 0, &da).unwrap();
    let mb = SharedMapping::open(Arc::clone(&reader), 0, &db).unwrap();
    let imports = reader.stats().calls(AclFunc::MemImportFromShareableHandle);
    let mut back = vec![0u8; 3000];
    mb.read(0, &mut back).unwrap();
    assert!(patterned(&back, 0));
    // One closes; the other keeps the import and still reads.
    ma.close().unwrap();
    back.fill(0);
    mb.read(0, &mut back).unwrap();
    assert!(patterned(&back, 0));
    mb.close().unwrap();
    assert_eq!(
        reader.stats().calls(AclFunc::MemImportFromShareableHandle),
        imports,
        "no import since the two opens"
    );
    assert_eq!(used(&reader), 0);

    // Another device would be a second import: refused with a typed error, nothing held.
    let two = Arc::new(
        SimSource::new(
            SimConfig::default()
                .with_devices(2)
                .with_device_capacity(256 * MIB),
        )
        .unwrap(),
    );
    let m0 = SharedMapping::open(Arc::clone(&two), 0, &da).unwrap();
    let e = SharedMapping::open(Arc::clone(&two), 1, &db).unwrap_err();
    assert!(
        matches!(e, Error::Config(ref m) if m.contains("device 0")),
        "{e:?}"
    );
    m0.close().unwrap();
    let m1 = SharedMapping::open(Arc::clone(&two), 1, &db).unwrap();
    m1.close().unwrap();
    assert_eq!(used(&two), 0);
    drop((a, b));
    pool.trim();
    eventually(|| "the exporter's memory released", || used(&exp) == 0);
    drop((pool, vmm));
}
