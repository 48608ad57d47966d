//! The C functions called from Rust: every kind of bad input gets its status and message and
//! leaves the pool's counters as they were; the header and the library agree on every value;
//! handles stay checked while threads share a pool and while it is destroyed.

use ascend_pool_capi::*;
use std::ffi::{c_void, CStr};
use std::ptr::{null, null_mut};

/// Rounds of the threaded tests, and the largest region they fill: less under Miri, which
/// runs each far slower (and fills byte by byte).
const ROUNDS: u64 = if cfg!(miri) { 60 } else { 3000 };
const MAX_LEN: u64 = if cfg!(miri) { 512 } else { 70_000 };

fn pool_with(conf: &str) -> u64 {
    pool_over(SOURCE_SIM, conf)
}

fn pool_over(source: i32, conf: &str) -> u64 {
    let conf = std::ffi::CString::new(conf).unwrap();
    let mut pool = 0;
    // SAFETY: a NUL-terminated string and a writable handle.
    assert_eq!(
        unsafe { ap_pool_create(source, conf.as_ptr(), &mut pool) },
        Status::Ok,
        "{}",
        last_error()
    );
    assert_ne!(pool, 0);
    pool
}

fn alloc(pool: u64, kind: i32, len: u64) -> Result<u64, Status> {
    let mut r = 0;
    // SAFETY: a writable handle.
    match unsafe { ap_alloc(pool, kind, len, &mut r) } {
        Status::Ok => Ok(r),
        s => Err(s),
    }
}

fn info(pool: u64, region: u64) -> RegionInfo {
    let mut i = RegionInfo::default();
    // SAFETY: a writable RegionInfo.
    assert_eq!(
        unsafe { ap_region_get_info(pool, region, &mut i) },
        Status::Ok
    );
    i
}

fn last_error() -> String {
    let mut buf = [0u8; 512];
    // SAFETY: 512 writable bytes.
    let n = unsafe { ap_last_error(buf.as_mut_ptr().cast(), buf.len()) };
    assert!(n < buf.len());
    CStr::from_bytes_until_nul(&buf)
        .unwrap()
        .to_str()
        .unwrap()
        .to_owned()
}

/// Every kind's counters.
fn stats(pool: u64) -> Vec<Stats> {
    (KIND_DEVICE..=KIND_HOST)
        .map(|k| {
            let mut s = Stats::default();
            // SAFETY: a writable Stats.
            assert_eq!(unsafe { ap_pool_stats(pool, k, &mut s) }, Status::Ok);
            s
        })
        .collect()
}

/// What a refused call must leave as it found: every kind's live, reserved and counted
/// bytes and regions. (A refusal for lack of memory counts an OOM and the source calls it
/// tried, and the retry first empties the thread caches, which moves nothing between live
/// and free.)
fn counters(pool: u64) -> Vec<[u64; 8]> {
    stats(pool)
        .iter()
        .map(|s| {
            [
                s.allocated_bytes,
                s.requested_bytes,
                s.reserved_bytes,
                s.live_regions,
                s.allocations,
                s.frees,
                s.chunks,
                s.source_free_calls,
            ]
        })
        .collect()
}

/// A call's status `got` is `want`, and the message of this thread's last call says `says`.
fn expect(what: &str, got: Status, want: Status, says: &str) {
    assert_eq!(got, want, "{what}: {}", last_error());
    assert!(last_error().contains(says), "{what}: {}", last_error());
}

fn destroy(pool: u64) -> u64 {
    let mut freed = u64::MAX;
    // SAFETY: a writable count.
    assert_eq!(unsafe { ap_pool_destroy(pool, &mut freed) }, Status::Ok);
    freed
}

#[test]
fn the_header_declares_what_the_library_exports() {
    let header = include_str!("../../include/ascend_pool.h");
    // Every `NAME = value` of the three enums, as the header spells them.
    let declared: Vec<(String, i32)> = header
        .lines()
        .filter_map(|l| {
            let (name, rest) = l.trim().split_once(" = ")?;
            let value = rest.split([',', ' ']).next()?.parse().ok()?;
            name.starts_with("AP_").then(|| (name.to_owned(), value))
        })
        .collect();
    let statuses: Vec<_> = declared
        .iter()
        .filter(|(n, _)| n == "AP_OK" || n.starts_with("AP_ERR_"))
        .collect();
    assert_eq!(statuses.len(), Status::ALL.len());
    for (name, value) in statuses {
        let s = Status::ALL[*value as usize];
        assert_eq!(s as i32, *value);
        // SAFETY: ap_status_name returns a static NUL-terminated string.
        let lib = unsafe { CStr::from_ptr(ap_status_name(*value)) };
        assert_eq!(lib.to_str().unwrap(), name);
    }
    let constants = [
        ("AP_KIND_DEVICE", KIND_DEVICE),
        ("AP_KIND_DEVICE_ALIGN32", KIND_DEVICE_ALIGN32),
        ("AP_KIND_CACHED", KIND_CACHED),
        ("AP_KIND_DVPP", KIND_DVPP),
        ("AP_KIND_HOST", KIND_HOST),
        ("AP_SOURCE_SIM", SOURCE_SIM),
        ("AP_SOURCE_ACL", SOURCE_ACL),
        ("AP_SOURCE_VMM_SIM", SOURCE_VMM_SIM),
        ("AP_SOURCE_VMM_ACL", SOURCE_VMM_ACL),
        ("AP_MBUF_NORMAL", MBUF_NORMAL),
        ("AP_MBUF_DVPP", MBUF_DVPP),
        ("AP_FIGURES_NONE", FIGURES_NONE as i32),
        ("AP_FIGURES_OUT_OF_MEMORY", FIGURES_OUT_OF_MEMORY as i32),
        ("AP_FIGURES_LIMIT", FIGURES_LIMIT as i32),
        ("AP_FIGURES_TOTAL_LIMIT", FIGURES_TOTAL_LIMIT as i32),
    ];
    for (name, value) in constants {
        assert!(declared.contains(&(name.to_owned(), value)), "{name}");
    }
    assert_eq!(declared.len(), Status::ALL.len() + constants.len());
    // The kinds are the pool's kind indices (stats and region info report them).
    for (k, kind) in ascend_pool::MemKind::ALL.iter().enumerate() {
        assert_eq!(kind.index(), k);
    }
    let functions = [
        "ap_status_name",
        "ap_last_error",
        "ap_last_error_detail",
        "ap_pool_create",
        "ap_pool_destroy",
        "ap_pool_stats",
        "ap_pool_validate",
        "ap_pool_trim",
        "ap_pool_synchronize",
        "ap_pool_reset_peak_stats",
        "ap_pool_leak_report",
        "ap_pool_take_corruption_reports",
        "ap_pool_snapshot_json",
        "ap_pool_picture_svg",
        "ap_pool_flush_record",
        "ap_alloc",
        "ap_alloc_aligned",
        "ap_alloc_model_input",
        "ap_alloc_on",
        "ap_alloc_model_input_on",
        "ap_free",
        "ap_region_get_info",
        "ap_host_ptr",
        "ap_record_stream",
        "ap_copy_from_host",
        "ap_copy_to_host",
        "ap_copy",
        "ap_memset",
        "ap_stream_create",
        "ap_stream_synchronize",
        "ap_stream_destroy",
        "ap_stream_wait",
        "ap_copy_async",
        "ap_memset_async",
        "ap_share_publish",
        "ap_share_process_id",
        "ap_share_open",
        "ap_mapping_get_info",
        "ap_mapping_read",
        "ap_mapping_write",
        "ap_mapping_close",
        "ap_mbuf_alloc",
        "ap_mbuf_copy_ref",
        "ap_mbuf_free",
        "ap_mbuf_get_info",
        "ap_mbuf_write",
        "ap_mbuf_read",
        "ap_mbuf_record_stream",
        "ap_mbuf_set_data_len",
        "ap_mbuf_set_user_data",
        "ap_mbuf_get_user_data",
        "ap_mbuf_publish",
        "ap_shared_mbuf_open",
        "ap_shared_mbuf_get_info",
        "ap_shared_mbuf_read",
        "ap_shared_mbuf_get_user_data",
        "ap_shared_mbuf_close",
        "ap_stream_native",
        "ap_write_remote",
    ];
    // Every function the library exports is listed, and the header declares no other.
    let exported: usize = [
        include_str!("../src/lib.rs"),
        include_str!("../src/share.rs"),
        include_str!("../src/mbuf.rs"),
        include_str!("../src/comm.rs"),
    ]
    .iter()
    .map(|src| src.matches("#[no_mangle]").count())
    .sum();
    assert_eq!(exported, functions.len());
    let prototypes = header
        .lines()
        .filter(|l| {
            l.starts_with("ap_status ap_")
                || l.starts_with("const char *ap_")
                || l.starts_with("size_t ap_")
        })
        .count();
    assert_eq!(prototypes, functions.len());
    for f in functions {
        let declared = [" ", "*"]
            .iter()
            .any(|pre| header.contains(&format!("{pre}{f}(")));
        assert!(declared, "{f} is not declared");
    }
    // SAFETY: as above.
    let unknown = unsafe { CStr::from_ptr(ap_status_name(-1)) };
    assert_eq!(unknown.to_str().unwrap(), "AP_ERR_UNKNOWN");
}

#[test]
fn refused_calls_leave_the_pool_as_it_was() {
    let pool = pool_with("chunk_size:4m,limit:8m");
    let other = pool_with("");
    let (host, dev) = (
        alloc(pool, KIND_HOST, 4096).unwrap(),
        alloc(pool, KIND_DEVICE, 4096).unwrap(),
    );
    let foreign = alloc(other, KIND_DEVICE, 4096).unwrap();
    let freed = alloc(pool, KIND_DEVICE, 100).unwrap();
    assert_eq!(ap_free(pool, freed), Status::Ok);
    let mut stream = 0;
    // SAFETY: a writable handle.
    assert_eq!(unsafe { ap_stream_create(pool, &mut stream) }, Status::Ok);
    let mut gone = 0;
    // SAFETY: a writable handle.
    assert_eq!(unsafe { ap_stream_create(pool, &mut gone) }, Status::Ok);
    assert_eq!(ap_stream_destroy(pool, gone), Status::Ok);
    let before = counters(pool);
    let buf = [7u8; 64];
    let mut out = [0u8; 64];
    let mut r = 0;
    let mut p: *mut c_void = null_mut();

    // Each call is checked at once: its status, and that its message says `says`.
    // SAFETY (every call below): the pointers are NULL or valid for what they are used for.
    unsafe {
        expect(
            "size 0",
            ap_alloc(pool, KIND_DEVICE, 0, &mut r),
            Status::InvalidSize,
            "0",
        );
        expect(
            "overflow",
            ap_alloc(pool, KIND_DVPP, u64::MAX, &mut r),
            Status::InvalidSize,
            "",
        );
        expect(
            "kind",
            ap_alloc(pool, 5, 64, &mut r),
            Status::InvalidArgument,
            "ap_kind",
        );
        expect(
            "null out",
            ap_alloc(pool, KIND_DEVICE, 64, null_mut()),
            Status::NullArgument,
            "out",
        );
        expect(
            "limit",
            ap_alloc(pool, KIND_DEVICE, 16 << 20, &mut r),
            Status::LimitExceeded,
            "",
        );
        expect(
            "align",
            ap_alloc_aligned(pool, 4096, 48, &mut r),
            Status::InvalidSize,
            "48",
        );
        expect(
            "on host",
            ap_alloc_on(pool, KIND_HOST, 64, stream, &mut r),
            Status::WrongKind,
            "host",
        );
        expect(
            "on gone",
            ap_alloc_on(pool, KIND_DEVICE, 64, gone, &mut r),
            Status::BadStream,
            "",
        );
        expect(
            "no pool",
            ap_alloc(u64::MAX, KIND_DEVICE, 64, &mut r),
            Status::BadPool,
            "",
        );
        expect(
            "no pool to wait for",
            ap_pool_synchronize(u64::MAX),
            Status::BadPool,
            "",
        );
        expect(
            "gone stream to wait for",
            ap_stream_synchronize(pool, gone),
            Status::BadStream,
            "",
        );
        expect(
            "another pool's stream",
            ap_stream_synchronize(other, stream),
            Status::BadStream,
            "",
        );
        expect("freed", ap_free(pool, freed), Status::BadRegion, "");
        expect("zero", ap_free(pool, 0), Status::BadRegion, "");
        expect("foreign", ap_free(pool, foreign), Status::BadRegion, "");
        expect(
            "foreign info",
            ap_region_get_info(pool, foreign, &mut RegionInfo::default()),
            Status::BadRegion,
            "",
        );
        expect(
            "foreign copy",
            ap_copy(pool, dev, 0, foreign, 0, 64),
            Status::BadRegion,
            "",
        );
        expect(
            "past end",
            ap_copy_from_host(pool, dev, 4090, buf.as_ptr().cast(), 64),
            Status::OutOfBounds,
            "destination range 4090..4090+64",
        );
        expect(
            "offset overflow",
            ap_copy_to_host(pool, dev, u64::MAX, out.as_mut_ptr().cast(), 64),
            Status::OutOfBounds,
            "",
        );
        expect(
            "huge host buffer",
            ap_copy_to_host(pool, dev, 0, out.as_mut_ptr().cast(), u64::MAX),
            Status::OutOfBounds,
            "longer than any region",
        );
        expect(
            "empty",
            ap_copy_from_host(pool, dev, 0, buf.as_ptr().cast(), 0),
            Status::OutOfBounds,
            "",
        );
        expect(
            "null host",
            ap_copy_from_host(pool, dev, 0, null(), 64),
            Status::NullArgument,
            "host buffer",
        );
        expect(
            "same region",
            ap_copy(pool, dev, 0, dev, 128, 64),
            Status::InvalidArgument,
            "both ends",
        );
        expect(
            "misaligned",
            ap_copy_async(pool, dev, 0, host, 32, 64, stream),
            Status::Misaligned,
            "source offset 32 is not 64-byte aligned",
        );
        expect(
            "misaligned destination",
            ap_copy_async(pool, dev, 96, host, 0, 64, stream),
            Status::Misaligned,
            "destination offset 96 is not 64-byte aligned",
        );
        expect(
            "gone stream",
            ap_memset_async(pool, dev, 0, 1, 64, gone),
            Status::BadStream,
            "",
        );
        expect(
            "fill past end",
            ap_memset(pool, host, 4000, 1, 97),
            Status::OutOfBounds,
            "",
        );
        expect(
            "device bytes",
            ap_host_ptr(pool, dev, &mut p),
            Status::WrongKind,
            "host",
        );
        expect(
            "record foreign",
            ap_record_stream(other, dev, stream),
            Status::BadRegion,
            "",
        );
        expect(
            "stats kind",
            ap_pool_stats(pool, 99, &mut Stats::default()),
            Status::InvalidArgument,
            "",
        );
        expect(
            "config",
            ap_pool_create(SOURCE_SIM, c"limit:x".as_ptr(), &mut r),
            Status::Config,
            "limit",
        );
        // A padding the carve rule refuses is the configuration's fault too (it was
        // AP_ERR_INVALID_SIZE, a status the header gives sizes and alignments).
        expect(
            "padding",
            ap_pool_create(SOURCE_SIM, c"padding:16".as_ptr(), &mut r),
            Status::Config,
            "padding 16",
        );
        expect(
            "source",
            ap_pool_create(4, null(), &mut r),
            Status::InvalidArgument,
            "ap_source",
        );
    }
    assert_eq!(counters(pool), before, "a refused call changed the pool");
    // Past what the simulated device has (64 GiB): the source refuses, not a limit.
    let other_before = counters(other);
    // SAFETY: a writable handle.
    let got = unsafe { ap_alloc(other, KIND_DEVICE, 1 << 40, &mut r) };
    assert_eq!(got, Status::OutOfMemory, "{}", last_error());
    assert_eq!(counters(other), other_before);
    assert_eq!(
        stats(pool)[0].ooms,
        1,
        "the refusal at the limit is the one OOM"
    );
    assert_eq!(ap_pool_validate(pool), Status::Ok);
    // The message is the last call's: refused, then cleared by a success.
    assert_eq!(ap_free(pool, freed), Status::BadRegion);
    assert!(
        last_error().contains(&format!("region {freed}")),
        "{}",
        last_error()
    );
    assert_eq!(ap_pool_validate(pool), Status::Ok);
    assert_eq!(last_error(), "");
    // SAFETY: a NULL buffer with no room is asked only for the length.
    assert_eq!(unsafe { ap_last_error(null_mut(), 0) }, 0);
    for (h, want) in [(dev, Status::Ok), (host, Status::Ok)] {
        assert_eq!(ap_free(pool, h), want);
    }
    assert_eq!(destroy(pool), 0);
    assert_eq!(destroy(other), 1); // `foreign` was still live
    assert_eq!(ap_free(other, foreign), Status::BadPool);
}

#[test]
fn threads_share_a_pool_through_its_handles() {
    let pool = pool_with("chunk_size:8m");
    let workers: Vec<_> = (0..4u64)
        .map(|t| {
            std::thread::spawn(move || {
                let mut seed = t * 7919 + 1;
                let mut held: Vec<(u64, u8)> = Vec::new();
                for i in 0..ROUNDS {
                    seed = seed
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    if held.len() < 24 && seed >> 62 != 0 {
                        let kind = [KIND_DEVICE, KIND_DVPP, KIND_HOST, KIND_CACHED]
                            [(seed >> 20) as usize % 4];
                        let len = 1 + (seed >> 33) % MAX_LEN;
                        let r = alloc(pool, kind, len).unwrap();
                        let i_ = info(pool, r);
                        assert!(i_.len == len && i_.addr % i_.align == 0);
                        let fill = (i as u8) ^ (t as u8);
                        assert_eq!(ap_memset(pool, r, 0, fill, len), Status::Ok);
                        held.push((r, fill));
                    } else if let Some((r, fill)) = held.pop() {
                        let len = info(pool, r).len;
                        let mut back = vec![0u8; len as usize];
                        // SAFETY: `len` writable bytes.
                        let got =
                            unsafe { ap_copy_to_host(pool, r, 0, back.as_mut_ptr().cast(), len) };
                        assert_eq!(got, Status::Ok);
                        assert!(
                            back.iter().all(|&b| b == fill),
                            "another thread wrote region {r}"
                        );
                        assert_eq!(ap_free(pool, r), Status::Ok);
                        assert_eq!(ap_free(pool, r), Status::BadRegion);
                    }
                }
                held.into_iter()
                    .map(|(r, _)| ap_free(pool, r))
                    .all(|s| s == Status::Ok)
            })
        })
        .collect();
    for w in workers {
        assert!(w.join().unwrap());
    }
    assert_eq!(ap_pool_validate(pool), Status::Ok);
    assert!(stats(pool)
        .iter()
        .all(|s| s.live_regions == 0 && s.pending_frees == 0));
    let mut released = 0;
    // SAFETY: a writable count.
    assert_eq!(unsafe { ap_pool_trim(pool, &mut released) }, Status::Ok);
    assert!(released > 0);
    assert!(stats(pool).iter().all(|s| s.reserved_bytes == 0));
    assert_eq!(destroy(pool), 0);
}

#[test]
fn a_pool_destroyed_under_a_working_thread_answers_bad_pool() {
    let pool = pool_with("");
    let (tx, rx) = std::sync::mpsc::channel();
    let worker = std::thread::spawn(move || {
        let mut seen = std::collections::BTreeSet::new();
        for n in 0u64.. {
            if n == 100 {
                tx.send(()).unwrap();
            }
            let mut r = 0;
            // SAFETY: a writable handle.
            let got = unsafe { ap_alloc(pool, KIND_DEVICE, 4096, &mut r) };
            seen.insert(got as i32);
            if got == Status::BadPool {
                return seen;
            }
            // The pool may be gone between the two calls, or during the free: its regions
            // went with it, and the free says the pool is gone.
            let freed = ap_free(pool, r);
            assert!(matches!(freed, Status::Ok | Status::BadPool), "{freed:?}");
        }
        unreachable!()
    });
    rx.recv().unwrap();
    let mut freed = 0;
    // SAFETY: a writable count.
    assert_eq!(unsafe { ap_pool_destroy(pool, &mut freed) }, Status::Ok);
    assert!(freed <= 1);
    let seen = worker.join().unwrap();
    assert_eq!(seen, [Status::Ok as i32, Status::BadPool as i32].into());
}

/// What a thread-local destructor got from the library, as
/// [`a_thread_local_destructor_can_still_call`] reads it.
#[derive(Debug, Default, PartialEq)]
struct AtExit {
    free: Option<Status>,
    second_free: Option<Status>,
    message_len: usize,
    message: String,
    alloc: Option<Status>,
    free_of_new: Option<Status>,
}

/// A thread-local value whose destructor frees a region through the C functions, and records
/// what it got.
struct FreeAtExit {
    target: std::cell::Cell<(u64, u64)>,
    out: std::cell::RefCell<Option<std::sync::mpsc::Sender<AtExit>>>,
}

impl Drop for FreeAtExit {
    fn drop(&mut self) {
        let (pool, region) = self.target.get();
        let mut got = AtExit {
            free: Some(ap_free(pool, region)),
            second_free: Some(ap_free(pool, region)),
            ..AtExit::default()
        };
        let mut buf = [b'x'; 64];
        // SAFETY: 64 writable bytes.
        got.message_len = unsafe { ap_last_error(buf.as_mut_ptr().cast(), buf.len()) };
        got.message = CStr::from_bytes_until_nul(&buf)
            .map(|m| m.to_string_lossy().into_owned())
            .unwrap_or_else(|_| "(no NUL)".into());
        let mut r = 0;
        // SAFETY: a writable handle.
        got.alloc = Some(unsafe { ap_alloc(pool, KIND_DEVICE, 4096, &mut r) });
        got.free_of_new = Some(ap_free(pool, r));
        if let Some(tx) = self.out.borrow_mut().take() {
            let _ = tx.send(got);
        }
    }
}

thread_local! {
    static FREE_AT_EXIT: FreeAtExit = const {
        FreeAtExit {
            target: std::cell::Cell::new((0, 0)),
            out: std::cell::RefCell::new(None),
        }
    };
}

/// A C++ `thread_local` or a pthread key destructor may free its regions as its thread exits,
/// after the library's own thread-locals have gone (made at the thread's first call, so
/// destroyed before a value made earlier). The calls still answer: the free frees, a second
/// free is refused, and an allocation and its free work, with no message left to read.
#[test]
fn a_thread_local_destructor_can_still_call() {
    let pool = pool_with("");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        // Made before the thread's first call into the library.
        FREE_AT_EXIT.with(|f| *f.out.borrow_mut() = Some(tx));
        let region = alloc(pool, KIND_DEVICE, 4096).unwrap();
        FREE_AT_EXIT.with(|f| f.target.set((pool, region)));
    })
    .join()
    .unwrap();
    let got = rx.recv().unwrap();
    assert_eq!(
        got,
        AtExit {
            free: Some(Status::Ok),
            second_free: Some(Status::BadRegion),
            // The thread's message went with its thread-locals: an empty string, length 0.
            message_len: 0,
            message: String::new(),
            alloc: Some(Status::Ok),
            free_of_new: Some(Status::Ok),
        }
    );
    assert!(stats(pool).iter().all(|s| s.live_regions == 0));
    assert_eq!(destroy(pool), 0);
}

#[test]
fn an_overrun_into_the_padding_is_reported_on_free() {
    let pool = pool_with("debug:1");
    let r = alloc(pool, KIND_HOST, 100).unwrap();
    let mut p: *mut c_void = null_mut();
    // SAFETY: a writable pointer.
    assert_eq!(unsafe { ap_host_ptr(pool, r, &mut p) }, Status::Ok);
    assert_eq!(p as u64, info(pool, r).addr);
    // The 100 bytes `p` was handed out for end before the byte written, so the write goes
    // through the segment's address as the pool holds it, as a stray C pointer would.
    let stray = std::ptr::with_exposed_provenance_mut::<u8>(info(pool, r).addr as usize);
    // SAFETY: the segment's footprint covers the padding past its 100 bytes (carve rule:
    // ALIGN_UP(100, 32) + 32 = 160), in the pool's host block; writing there is the bug debug
    // mode exists to catch.
    unsafe { stray.add(130).write(0xAB) };
    assert_eq!(ap_free(pool, r), Status::Corruption);
    assert!(
        last_error().contains("byte 130 past the start"),
        "{}",
        last_error()
    );
    // Freed all the same: the handle is gone and the pool is whole.
    assert_eq!(ap_free(pool, r), Status::BadRegion);
    assert_eq!(ap_pool_validate(pool), Status::Ok);
    assert_eq!(destroy(pool), 0);
}

/// An overrun in a region the destroy freed was only printed: no call was left to report it.
#[test]
fn an_overrun_in_a_region_the_destroy_frees_is_its_status() {
    let pool = pool_with("debug:1");
    // One overrun freed and left in the list: the destroy's status is not about it.
    let r = alloc(pool, KIND_HOST, 100).unwrap();
    let stray = std::ptr::with_exposed_provenance_mut::<u8>(info(pool, r).addr as usize);
    // SAFETY: inside the segment's footprint (ALIGN_UP(100, 32) + 32 = 160 bytes) in the
    // pool's host block: the padding debug mode watches.
    unsafe { stray.add(140).write(0xAB) };
    assert_eq!(ap_free(pool, r), Status::Corruption);
    assert_eq!(destroy(pool), 0);
    // A live region overrun, and another left whole, when the pool goes.
    let pool = pool_with("debug:1");
    let whole = alloc(pool, KIND_HOST, 64).unwrap();
    let r = alloc(pool, KIND_HOST, 100).unwrap();
    let stray = std::ptr::with_exposed_provenance_mut::<u8>(info(pool, r).addr as usize);
    // SAFETY: as above.
    unsafe { stray.add(130).write(0xAB) };
    let mut freed = 0;
    // SAFETY: a writable count.
    assert_eq!(
        unsafe { ap_pool_destroy(pool, &mut freed) },
        Status::Corruption
    );
    assert!(
        last_error().contains("byte 130 past the start"),
        "{}",
        last_error()
    );
    // Both freed and the pool gone all the same.
    assert_eq!(freed, 2);
    assert_eq!(ap_free(pool, whole), Status::BadPool);
    // SAFETY: a writable count.
    assert_eq!(
        unsafe { ap_pool_destroy(pool, &mut freed) },
        Status::BadPool
    );
}

/// C had no way to read the overruns the pool kept: only `ap_free`'s status told of one, and
/// none told of an overrun found when no call could answer.
#[test]
fn overruns_can_be_taken_as_a_list() {
    let pool = pool_with("debug:1");
    let take = |cap: usize| {
        let mut out = vec![CorruptionInfo::default(); cap];
        let mut count = usize::MAX;
        let buf = if cap == 0 {
            null_mut()
        } else {
            out.as_mut_ptr()
        };
        // SAFETY: `cap` writable entries (or NULL) and a writable count.
        let got = unsafe { ap_pool_take_corruption_reports(pool, buf, cap, &mut count) };
        (got, count, out)
    };
    // None yet: no buffer is needed.
    assert_eq!(take(0).0, Status::Ok);
    assert_eq!(take(0).1, 0);
    let mut offsets = Vec::new();
    for at in [130u64, 159] {
        let r = alloc(pool, KIND_HOST, 100).unwrap();
        let addr = info(pool, r).addr;
        let stray = std::ptr::with_exposed_provenance_mut::<u8>(addr as usize);
        // SAFETY: inside the segment's footprint (ALIGN_UP(100, 32) + 32 = 160 bytes) in the
        // pool's host block: the padding debug mode watches.
        unsafe { stray.add(at as usize).write(0xAB) };
        assert_eq!(ap_free(pool, r), Status::Corruption);
        offsets.push(at);
    }
    // Too small a buffer takes none of them.
    let (got, count, _) = take(1);
    assert_eq!((got, count), (Status::BufferTooSmall, 2));
    let mut count = 0;
    // SAFETY: NULL with a cap takes nothing; a writable count.
    let got = unsafe { ap_pool_take_corruption_reports(pool, null_mut(), 8, &mut count) };
    assert_eq!((got, count), (Status::BufferTooSmall, 2));
    // SAFETY: a NULL count is refused before anything is taken.
    let got = unsafe { ap_pool_take_corruption_reports(pool, null_mut(), 0, null_mut()) };
    assert_ne!(got, Status::Ok);
    let (got, count, out) = take(4);
    assert_eq!((got, count), (Status::Ok, 2), "{}", last_error());
    for (info, at) in out.iter().zip(offsets) {
        assert_eq!(
            (info.len, info.first_bad, info.kind, info.reserved),
            (100, at, KIND_HOST as u32, 0)
        );
    }
    // Taken: the next call has none.
    assert_eq!(take(0).1, 0);
    assert_eq!(ap_pool_validate(pool), Status::Ok);
    assert_eq!(destroy(pool), 0);
    let mut count = 0;
    // SAFETY: a writable count; the pool is gone.
    let got = unsafe { ap_pool_take_corruption_reports(pool, null_mut(), 0, &mut count) };
    assert_eq!(got, Status::BadPool);
}

#[test]
fn stream_ordered_frees_reuse_memory_at_once() {
    let pool = pool_with("");
    let mut stream = 0;
    // SAFETY: a writable handle.
    assert_eq!(unsafe { ap_stream_create(pool, &mut stream) }, Status::Ok);
    let src = alloc(pool, KIND_DEVICE, 1 << 20).unwrap();
    let mut first = None;
    for _ in 0..8 {
        let mut r = 0;
        // SAFETY: a writable handle.
        assert_eq!(
            unsafe { ap_alloc_on(pool, KIND_DVPP, 1 << 20, stream, &mut r) },
            Status::Ok
        );
        assert_eq!(
            ap_copy_async(pool, r, 0, src, 0, 1 << 20, stream),
            Status::Ok
        );
        let addr = info(pool, r).addr;
        assert_eq!(*first.get_or_insert(addr), addr);
        assert_eq!(ap_free(pool, r), Status::Ok);
    }
    assert_eq!(stats(pool)[KIND_DVPP as usize].source_alloc_calls, 1);
    assert_eq!(ap_stream_destroy(pool, stream), Status::Ok);
    assert_eq!(ap_pool_synchronize(pool), Status::Ok);
    assert_eq!(destroy(pool), 1);
}

#[test]
fn stream_ordered_model_input_is_reused_at_once_and_checks_its_handles() {
    let (pool, other) = (pool_with(""), pool_with(""));
    let (mut stream, mut foreign, mut gone) = (0, 0, 0);
    // SAFETY: writable handles.
    unsafe {
        assert_eq!(ap_stream_create(pool, &mut stream), Status::Ok);
        assert_eq!(ap_stream_create(other, &mut foreign), Status::Ok);
        assert_eq!(ap_stream_create(pool, &mut gone), Status::Ok);
    }
    assert_eq!(ap_stream_destroy(pool, gone), Status::Ok);
    let src = alloc(pool, KIND_DEVICE, 1 << 20).unwrap();
    let mut first = None;
    for _ in 0..8 {
        let mut r = 0;
        // SAFETY: a writable handle.
        assert_eq!(
            unsafe { ap_alloc_model_input_on(pool, 1 << 20, stream, &mut r) },
            Status::Ok,
            "{}",
            last_error()
        );
        let i = info(pool, r);
        assert_eq!(
            (i.align, i.kind, i.addr % 128),
            (128, KIND_DEVICE as u32, 0)
        );
        assert_eq!(
            ap_copy_async(pool, r, 0, src, 0, 1 << 20, stream),
            Status::Ok
        );
        // Freed behind the stream's copy, taken over at once by the next round.
        assert_eq!(*first.get_or_insert(i.addr), i.addr);
        assert_eq!(ap_free(pool, r), Status::Ok);
    }
    let before = counters(pool);
    let mut r = 0;
    // Each call is checked at once, its message being this thread's last.
    let call = |what, pool, len, stream, out: *mut u64, want, says| {
        // SAFETY: `out` is NULL or the writable `r`.
        let got = unsafe { ap_alloc_model_input_on(pool, len, stream, out) };
        expect(what, got, want, says);
    };
    let out: *mut u64 = &mut r;
    call("size 0", pool, 0, stream, out, Status::InvalidSize, "0");
    call(
        "overflow",
        pool,
        u64::MAX,
        stream,
        out,
        Status::InvalidSize,
        "",
    );
    call(
        "another pool's stream",
        pool,
        64,
        foreign,
        out,
        Status::BadStream,
        "stream",
    );
    call(
        "destroyed stream",
        pool,
        64,
        gone,
        out,
        Status::BadStream,
        "stream",
    );
    call(
        "no pool",
        u64::MAX,
        64,
        stream,
        out,
        Status::BadPool,
        "pool",
    );
    call(
        "null out",
        pool,
        64,
        stream,
        null_mut(),
        Status::NullArgument,
        "out",
    );
    assert_eq!(r, 0);
    assert_eq!(counters(pool), before);
    assert_eq!(ap_stream_destroy(pool, stream), Status::Ok);
    assert_eq!(ap_stream_destroy(other, foreign), Status::Ok);
    assert_eq!(destroy(other), 0);
    call(
        "destroyed pool",
        other,
        64,
        foreign,
        out,
        Status::BadPool,
        "pool",
    );
    assert_eq!(destroy(pool), 1);
}

#[test]
fn copies_both_ways_between_two_regions_do_not_deadlock() {
    let pool = pool_with("");
    let (a, b) = (
        alloc(pool, KIND_DEVICE, MAX_LEN).unwrap(),
        alloc(pool, KIND_DEVICE, MAX_LEN).unwrap(),
    );
    let (tx, rx) = std::sync::mpsc::channel();
    for (dst, src) in [(a, b), (b, a)] {
        let tx = tx.clone();
        std::thread::spawn(move || {
            let failed = (0..ROUNDS * 7)
                .map(|_| ap_copy(pool, dst, 0, src, 0, MAX_LEN))
                .find(|&s| s != Status::Ok);
            tx.send(failed).unwrap();
        });
    }
    // Each copy locks both regions; taken in opposite orders, two copies would wait forever.
    for _ in 0..2 {
        let failed = rx
            .recv_timeout(std::time::Duration::from_secs(120))
            .expect("the two copiers are stuck on each other's region");
        assert_eq!(failed, None);
    }
    assert_eq!(destroy(pool), 2);
}

/// Calls `f(buf, cap, needed)` twice, as a C caller would: first with no buffer for the size,
/// then with a buffer of that size; returns the text.
fn text_of(f: impl Fn(*mut std::ffi::c_char, usize, *mut usize) -> Status) -> String {
    let mut needed = 0;
    assert_eq!(f(null_mut(), 0, &mut needed), Status::BufferTooSmall);
    assert!(
        last_error().contains(&format!("room for {needed}")),
        "{}",
        last_error()
    );
    // One byte short: nothing written, the same size asked for.
    let mut buf = vec![b'#'; needed];
    let mut again = 0;
    assert_eq!(
        f(buf.as_mut_ptr().cast(), needed - 1, &mut again),
        Status::BufferTooSmall
    );
    assert_eq!(again, needed);
    assert!(buf.iter().all(|&b| b == b'#'), "a refused call wrote");
    assert_eq!(f(buf.as_mut_ptr().cast(), needed, &mut again), Status::Ok);
    assert_eq!(again, needed);
    CStr::from_bytes_with_nul(&buf)
        .unwrap()
        .to_str()
        .unwrap()
        .to_owned()
}

/// A pool with no live region has an empty leak report: the first call, with no buffer,
/// gets the whole answer (none) rather than a buffer too small for zero entries.
#[test]
fn an_empty_leak_report_needs_no_buffer() {
    let pool = pool_with("");
    let r = alloc(pool, KIND_HOST, 100).unwrap();
    assert_eq!(ap_free(pool, r), Status::Ok);
    let mut count = usize::MAX;
    // SAFETY: a writable count; no buffer.
    let got = unsafe { ap_pool_leak_report(pool, null_mut(), 0, &mut count) };
    assert_eq!((got, count), (Status::Ok, 0), "{}", last_error());
    // A live region still needs room.
    let r = alloc(pool, KIND_HOST, 100).unwrap();
    // SAFETY: as above.
    let got = unsafe { ap_pool_leak_report(pool, null_mut(), 0, &mut count) };
    assert_eq!((got, count), (Status::BufferTooSmall, 1));
    assert_eq!(ap_free(pool, r), Status::Ok);
    assert_eq!(destroy(pool), 0);
}

#[test]
fn leak_report_snapshot_and_picture_show_the_live_regions() {
    let pool = pool_with("chunk_size:4m");
    let regions = [
        alloc(pool, KIND_DVPP, 3_110_400).unwrap(),
        alloc(pool, KIND_DEVICE, 100).unwrap(),
        alloc(pool, KIND_HOST, 1).unwrap(),
    ];
    let gone = alloc(pool, KIND_DEVICE, 4096).unwrap();
    assert_eq!(ap_free(pool, gone), Status::Ok);
    let mut stream = 0;
    // SAFETY: a writable handle.
    assert_eq!(unsafe { ap_stream_create(pool, &mut stream) }, Status::Ok);
    // Freed with a fill still queued on it: listed as pending until the stream has run.
    let queued = alloc(pool, KIND_DEVICE, 1 << 20).unwrap();
    assert_eq!(
        ap_memset_async(pool, queued, 0, 9, 1 << 20, stream),
        Status::Ok
    );
    let queued_addr = info(pool, queued).addr;
    assert_eq!(ap_free(pool, queued), Status::Ok);

    let report = |cap: usize| {
        let mut out = vec![SegmentInfo::default(); cap];
        let mut count = usize::MAX;
        // SAFETY: `cap` writable entries and a writable count.
        let got = unsafe { ap_pool_leak_report(pool, out.as_mut_ptr(), cap, &mut count) };
        (got, count, out)
    };
    let (got, count, _) = report(0);
    assert_eq!(got, Status::BufferTooSmall);
    assert!(count == 3 || count == 4, "{count}");
    let (got, n, segs) = report(8);
    assert_eq!(got, Status::Ok);
    let mut want: Vec<SegmentInfo> = regions
        .iter()
        .map(|&r| {
            let i = info(pool, r);
            SegmentInfo {
                addr: i.addr,
                len: i.len,
                kind: i.kind,
                ..SegmentInfo::default()
            }
        })
        .collect();
    let segs: Vec<SegmentInfo> = segs[..n].to_vec();
    // The queued region is listed while its fill may still run, and only as pending.
    let (pending, live): (Vec<&SegmentInfo>, Vec<_>) = segs.iter().partition(|s| s.pending == 1);
    assert!(pending.iter().all(|s| s.addr == queued_addr), "{pending:?}");
    want.sort_by_key(|s| s.addr);
    assert_eq!(live.len(), 3);
    for (s, w) in live.iter().zip(&want) {
        assert_eq!(
            (s.addr, s.len, s.kind, s.pending),
            (w.addr, w.len, w.kind, 0)
        );
        // The carve rule's footprint: 32 bytes of padding after the length rounded to 32.
        assert!(s.footprint >= s.len.div_ceil(32) * 32 + 32, "{s:?}");
    }
    assert!(segs.windows(2).all(|w| w[0].addr < w[1].addr), "by address");
    assert_eq!(ap_stream_synchronize(pool, stream), Status::Ok);
    assert_eq!(ap_pool_synchronize(pool), Status::Ok);
    assert_eq!(report(8).1, 3, "the pending free completed");
    // SAFETY (the closures below): the buffers come from `text_of`, with their sizes.
    let json = text_of(|b, c, n| unsafe { ap_pool_snapshot_json(pool, b, c, n) });
    let snap: serde_json::Value = serde_json::from_str(&json).unwrap();
    let kinds = snap["kinds"].as_array().unwrap();
    let segments = kinds
        .iter()
        .flat_map(|k| k["chunks"].as_array().unwrap())
        .flat_map(|c| c["segments"].as_array().unwrap())
        .filter(|s| s["cached"] == false) // freed, held in this thread's cache for reuse
        .count();
    assert_eq!(segments, 3, "{json}");
    assert_eq!(snap["source"], "sim", "{json}");
    let svg = text_of(|b, c, n| unsafe { ap_pool_picture_svg(pool, b, c, n) });
    assert!(
        svg.starts_with("<svg") && svg.ends_with("</svg>\n"),
        "{svg}"
    );
    assert!(svg.contains(&format!("pool {pool}")));

    // Refused: a NULL size, a pool that is gone; neither writes the buffer.
    let mut buf = [b'#'; 16];
    let mut n = 7;
    // SAFETY: 16 writable bytes, a writable size, or NULL.
    unsafe {
        assert_eq!(
            ap_pool_snapshot_json(pool, buf.as_mut_ptr().cast(), 16, null_mut()),
            Status::NullArgument
        );
        assert_eq!(
            ap_pool_leak_report(pool, null_mut(), 0, null_mut()),
            Status::NullArgument
        );
        // A NULL buffer has no room, whatever its capacity says.
        assert_eq!(
            ap_pool_snapshot_json(pool, null_mut(), 1 << 20, &mut n),
            Status::BufferTooSmall
        );
        assert!(
            last_error().ends_with("the buffer has 0"),
            "{}",
            last_error()
        );
        n = 7;
        assert_eq!(
            ap_pool_picture_svg(0, buf.as_mut_ptr().cast(), 16, &mut n),
            Status::BadPool
        );
    }
    assert_eq!((buf, n), ([b'#'; 16], 7));
    for r in regions {
        assert_eq!(ap_free(pool, r), Status::Ok);
    }
    assert_eq!(report(0), (Status::Ok, 0, vec![]));
    assert_eq!(ap_stream_destroy(pool, stream), Status::Ok);
    assert_eq!(destroy(pool), 0);
    assert_eq!(report(0).0, Status::BadPool);
}

#[test]
fn a_recorded_trace_is_written_out_on_request() {
    let path = std::env::temp_dir().join(format!("capi-record-{}.jsonl", std::process::id()));
    let pool = pool_with(&format!("record:{}", path.display()));
    let r = alloc(pool, KIND_DVPP, 4096).unwrap();
    assert_eq!(ap_free(pool, r), Status::Ok);
    assert_eq!(ap_pool_flush_record(pool), Status::Ok);
    let text = std::fs::read_to_string(&path).unwrap();
    let events: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(events.len(), 2, "{text}");
    assert_eq!(
        (&events[0]["op"], &events[0]["size"], &events[0]["mem"]),
        (&"alloc".into(), &4096.into(), &"dvpp".into())
    );
    assert_eq!(events[1]["op"], "free");
    assert_eq!(events[0]["id"], events[1]["id"]);
    assert_eq!(destroy(pool), 0);
    std::fs::remove_file(&path).unwrap();
    assert_eq!(ap_pool_flush_record(pool), Status::BadPool);

    // A trace that cannot be written: the write error, as an I/O status.
    let full = pool_with("record:/dev/full");
    let r = alloc(full, KIND_DEVICE, 64).unwrap();
    assert_eq!(ap_free(full, r), Status::Ok);
    assert_eq!(ap_pool_flush_record(full), Status::Io);
    assert!(last_error().contains("/dev/full"), "{}", last_error());
    assert_eq!(destroy(full), 0);
    // Without recording, nothing to do.
    let plain = pool_with("");
    assert_eq!(ap_pool_flush_record(plain), Status::Ok);
    assert_eq!(destroy(plain), 0);
}

#[test]
#[cfg_attr(
    miri,
    ignore = "virtual memory reserves addresses with PROT_NONE, which Miri refuses"
)]
fn a_published_region_opens_as_a_mapping_in_the_same_process() {
    let pool = pool_over(SOURCE_VMM_SIM, "chunk_size:4m");
    let len = 1u64 << 20;
    let r = alloc(pool, KIND_DEVICE, len).unwrap();
    let bytes: Vec<u8> = (0..len).map(|i| (i * 7 % 251) as u8).collect();
    // SAFETY: `len` readable bytes.
    let got = unsafe { ap_copy_from_host(pool, r, 0, bytes.as_ptr().cast(), len) };
    assert_eq!(got, Status::Ok);
    let mut me = 0;
    // SAFETY: a writable id.
    assert_eq!(
        unsafe { ap_share_process_id(SOURCE_SIM, &mut me) },
        Status::Ok
    );
    assert_eq!(me, std::process::id() as i32);
    // SAFETY (the closure): one readable id, and the buffers `text_of` gives.
    let desc = text_of(|b, c, n| unsafe { ap_share_publish(pool, r, &me, 1, b, c, n) });
    let desc = std::ffi::CString::new(desc).unwrap();
    let mut m = 0;
    // SAFETY: a NUL-terminated descriptor and a writable handle.
    let got = unsafe { ap_share_open(SOURCE_SIM, 0, desc.as_ptr(), &mut m) };
    assert_eq!(got, Status::Ok, "{}", last_error());
    let mut mi = MappingInfo::default();
    // SAFETY: a writable MappingInfo.
    assert_eq!(unsafe { ap_mapping_get_info(m, &mut mi) }, Status::Ok);
    assert_eq!(
        (mi.exporter_addr, mi.len, mi.exporter),
        (info(pool, r).addr, len, me)
    );
    // The exporter's addresses are taken in its own process: mapped elsewhere here.
    assert_ne!(mi.addr, mi.exporter_addr);
    let mut back = vec![0u8; len as usize];
    // SAFETY: `len` writable bytes.
    let got = unsafe { ap_mapping_read(m, 0, back.as_mut_ptr().cast(), len) };
    assert_eq!(got, Status::Ok, "{}", last_error());
    assert!(back == bytes, "the mapping reads what the pool wrote");
    // SAFETY: 4 readable bytes.
    let got = unsafe { ap_mapping_write(m, 100, [1u8, 2, 3, 4].as_ptr().cast(), 4) };
    assert_eq!(got, Status::Ok);
    let mut four = [0u8; 4];
    // SAFETY: 4 writable bytes.
    let got = unsafe { ap_copy_to_host(pool, r, 100, four.as_mut_ptr().cast(), 4) };
    assert_eq!(
        (got, four),
        (Status::Ok, [1, 2, 3, 4]),
        "the pool reads what it wrote"
    );

    // Bad input, each with its status.
    let plain = pool_with("");
    let dvpp = alloc(pool, KIND_DVPP, 4096).unwrap();
    let freed = alloc(pool, KIND_DEVICE, 4096).unwrap();
    assert_eq!(ap_free(pool, freed), Status::Ok);
    let on_plain = alloc(plain, KIND_DEVICE, 4096).unwrap();
    let mut buf = [0u8; 4096];
    let mut n = 0;
    let b = buf.as_mut_ptr().cast();
    let garbage = c"{\"exporter\": 1}";
    let mut out = 0;
    let not_mapping = format!("mapping {r}");
    // SAFETY (every call below): the pointers are NULL or valid for what they are used for.
    unsafe {
        expect(
            "a pool not over virtual memory",
            ap_share_publish(plain, on_plain, null(), 0, b, 4096, &mut n),
            Status::NotSupported,
            "AP_SOURCE_VMM_SIM",
        );
        expect(
            "a DVPP region",
            ap_share_publish(pool, dvpp, null(), 0, b, 4096, &mut n),
            Status::WrongKind,
            "device",
        );
        expect(
            "an empty list",
            ap_share_publish(pool, r, &me, 0, b, 4096, &mut n),
            Status::InvalidArgument,
            "NULL lets any process in",
        );
        // A count no list can hold (a C caller's -1): it was read as a slice of that many
        // ids, which is undefined behaviour, and answered AP_ERR_PANIC.
        expect(
            "a count longer than any list",
            ap_share_publish(pool, r, &me, usize::MAX, b, 4096, &mut n),
            Status::InvalidArgument,
            "npids",
        );
        expect(
            "a freed region",
            ap_share_publish(pool, freed, null(), 0, b, 4096, &mut n),
            Status::BadRegion,
            "region",
        );
        expect(
            "no size",
            ap_share_publish(pool, r, null(), 0, b, 4096, null_mut()),
            Status::NullArgument,
            "needed",
        );
        expect(
            "listed first, then any process",
            ap_share_publish(pool, r, null(), 0, b, 4096, &mut n),
            Status::ShareAccessFixed,
            "",
        );
        expect(
            "not a descriptor",
            ap_share_open(SOURCE_SIM, 0, garbage.as_ptr(), &mut out),
            Status::Config,
            "share descriptor",
        );
        expect(
            "no descriptor",
            ap_share_open(SOURCE_SIM, 0, null(), &mut out),
            Status::NullArgument,
            "descriptor",
        );
        expect(
            "no source",
            ap_share_open(9, 0, desc.as_ptr(), &mut out),
            Status::InvalidArgument,
            "ap_source",
        );
        expect(
            "no id",
            ap_share_process_id(SOURCE_SIM, null_mut()),
            Status::NullArgument,
            "out",
        );
        expect(
            "past the published bytes",
            ap_mapping_read(m, len - 2, b.cast(), 4),
            Status::OutOfBounds,
            "",
        );
        expect(
            "no buffer",
            ap_mapping_write(m, 0, null(), 4),
            Status::NullArgument,
            "host buffer",
        );
        expect(
            "not a mapping",
            ap_mapping_read(r, 0, b.cast(), 4),
            Status::BadMapping,
            &not_mapping,
        );
    }
    assert_eq!(out, 0, "no handle written");
    assert_eq!(ap_mapping_close(m), Status::Ok);
    assert_eq!(ap_mapping_close(m), Status::BadMapping);
    // SAFETY: 4 writable bytes.
    let got = unsafe { ap_mapping_read(m, 0, buf.as_mut_ptr().cast(), 4) };
    assert_eq!(got, Status::BadMapping, "closed");

    // A process off the list is refused; memory whose exporter let it go is gone.
    let other = alloc(plain, KIND_DEVICE, 64).unwrap();
    let vmm2 = pool_over(SOURCE_VMM_SIM, "chunk_size:4m");
    let r2 = alloc(vmm2, KIND_DEVICE, 4096).unwrap();
    let init = 1; // not this process
                  // SAFETY (the closure): one readable id, and the buffers `text_of` gives.
    let desc2 = text_of(|b, c, n| unsafe { ap_share_publish(vmm2, r2, &init, 1, b, c, n) });
    let desc2 = std::ffi::CString::new(desc2).unwrap();
    // SAFETY: a NUL-terminated descriptor and a writable handle.
    let got = unsafe { ap_share_open(SOURCE_SIM, 0, desc2.as_ptr(), &mut out) };
    assert_eq!(got, Status::ShareRefused, "{}", last_error());
    assert_eq!(ap_free(vmm2, r2), Status::Ok);
    assert_eq!(destroy(vmm2), 0);
    // SAFETY: as above.
    let got = unsafe { ap_share_open(SOURCE_SIM, 0, desc2.as_ptr(), &mut out) };
    assert_eq!(got, Status::ShareGone, "{}", last_error());
    assert_eq!(out, 0);

    for (p, h) in [(pool, r), (pool, dvpp), (plain, on_plain), (plain, other)] {
        assert_eq!(ap_free(p, h), Status::Ok);
    }
    assert_eq!(destroy(pool), 0);
    assert_eq!(destroy(plain), 0);
}

fn mbuf_info(pool: u64, m: u64) -> MbufInfo {
    let mut i = MbufInfo::default();
    // SAFETY: a writable MbufInfo.
    let got = unsafe { ap_mbuf_get_info(pool, m, &mut i) };
    assert_eq!(got, Status::Ok, "{}", last_error());
    i
}

#[test]
#[cfg_attr(
    miri,
    ignore = "virtual memory reserves addresses with PROT_NONE, which Miri refuses"
)]
fn buffers_carry_data_length_and_user_data_and_open_read_only() {
    let pool = pool_over(SOURCE_VMM_SIM, "chunk_size:4m");
    let size = 100_000u64;
    let mut m = 0;
    // SAFETY (every call below): the pointers are NULL or valid for what they are used for.
    unsafe {
        assert_eq!(ap_mbuf_alloc(pool, size, MBUF_NORMAL, &mut m), Status::Ok);
        let i = mbuf_info(pool, m);
        assert_eq!((i.size, i.data_len, i.kind, i.refs), (size, 0, 0, 1));
        assert_eq!(i.data % 128, 0, "the data starts 128-aligned");
        let data: Vec<u8> = (0..size).map(|i| (i % 241) as u8).collect();
        assert_eq!(
            ap_mbuf_write(pool, m, 0, data.as_ptr().cast(), size),
            Status::Ok
        );
        assert_eq!(ap_mbuf_set_data_len(pool, m, 4096), Status::Ok);
        let tag = *b"frame=17";
        assert_eq!(
            ap_mbuf_set_user_data(pool, m, 88, tag.as_ptr().cast(), 8),
            Status::Ok
        );
        let mut copy = 0;
        assert_eq!(ap_mbuf_copy_ref(pool, m, &mut copy), Status::Ok);
        assert_ne!(copy, m);
        assert_eq!(mbuf_info(pool, copy).refs, 2);
        assert_eq!(ap_mbuf_free(pool, m), Status::Ok);
        // The copy still names the buffer, with what was written through the first handle.
        let i = mbuf_info(pool, copy);
        assert_eq!((i.data_len, i.refs), (4096, 1));
        let mut back = vec![0u8; size as usize];
        let got = ap_mbuf_read(pool, copy, 0, back.as_mut_ptr().cast(), size);
        assert_eq!(got, Status::Ok);
        assert!(back == data);
        let mut t = [0u8; 8];
        assert_eq!(
            ap_mbuf_get_user_data(pool, copy, 88, t.as_mut_ptr().cast(), 8),
            Status::Ok
        );
        assert_eq!(t, tag);

        // Opened read-only through a descriptor, in this process.
        let me = std::process::id() as i32;
        let desc = text_of(|b, c, n| ap_mbuf_publish(pool, copy, &me, 1, b, c, n));
        let desc = std::ffi::CString::new(desc).unwrap();
        let mut sh = 0;
        let got = ap_shared_mbuf_open(SOURCE_SIM, 0, desc.as_ptr(), &mut sh);
        assert_eq!(got, Status::Ok, "{}", last_error());
        let mut si = SharedMbufInfo::default();
        assert_eq!(ap_shared_mbuf_get_info(sh, &mut si), Status::Ok);
        assert_eq!((si.size, si.data_len), (size, 4096));
        let mut head = [0u8; 64];
        assert_eq!(
            ap_shared_mbuf_read(sh, 1000, head.as_mut_ptr().cast(), 64),
            Status::Ok
        );
        assert_eq!(&head[..], &data[1000..1064]);
        let mut t2 = [0u8; 8];
        let got = ap_shared_mbuf_get_user_data(sh, 88, t2.as_mut_ptr().cast(), 8);
        assert_eq!((got, t2), (Status::Ok, tag));

        // Bad input, each with its status.
        let plain = pool_with("");
        let mut dv = 0;
        assert_eq!(ap_mbuf_alloc(pool, 64, MBUF_DVPP, &mut dv), Status::Ok);
        let mut on_plain = 0;
        assert_eq!(
            ap_mbuf_alloc(plain, 64, MBUF_NORMAL, &mut on_plain),
            Status::Ok
        );
        let mut r = 0;
        let mut n = 0;
        let mut buf = [0u8; 4096];
        let b = buf.as_mut_ptr();
        let region = alloc(pool, KIND_DEVICE, 4096).unwrap();
        let not_buffer = text_of(|b, c, n| ap_share_publish(pool, region, &me, 1, b, c, n));
        let not_buffer = std::ffi::CString::new(not_buffer).unwrap();
        let gone = format!("buffer {m}");
        let mut stream = 0;
        assert_eq!(ap_stream_create(pool, &mut stream), Status::Ok);
        // Each status in turn (the messages of a few are checked one call at a time below).
        for (what, got, want) in [
            (
                "kind",
                ap_mbuf_alloc(pool, 64, 7, &mut r),
                Status::InvalidArgument,
            ),
            (
                "size 0",
                ap_mbuf_alloc(pool, 0, MBUF_NORMAL, &mut r),
                Status::InvalidSize,
            ),
            (
                "overflow",
                ap_mbuf_alloc(pool, u64::MAX - 64, MBUF_NORMAL, &mut r),
                Status::InvalidSize,
            ),
            (
                "no out",
                ap_mbuf_alloc(pool, 64, MBUF_NORMAL, null_mut()),
                Status::NullArgument,
            ),
            ("freed", ap_mbuf_set_data_len(pool, m, 1), Status::BadBuffer),
            (
                "a freed buffer's stream",
                ap_mbuf_record_stream(pool, m, stream),
                Status::BadBuffer,
            ),
            (
                "another pool's stream",
                ap_mbuf_record_stream(plain, on_plain, stream),
                Status::BadStream,
            ),
            (
                "another pool's",
                ap_mbuf_free(pool, on_plain),
                Status::BadBuffer,
            ),
            (
                "past the size",
                ap_mbuf_set_data_len(pool, copy, size + 1),
                Status::OutOfBounds,
            ),
            (
                "user data past 96",
                ap_mbuf_set_user_data(pool, copy, 90, tag.as_ptr().cast(), 8),
                Status::OutOfBounds,
            ),
            (
                "data past the size",
                ap_mbuf_read(pool, copy, size - 4, head.as_mut_ptr().cast(), 8),
                Status::OutOfBounds,
            ),
            (
                "no source buffer",
                ap_mbuf_write(pool, copy, 0, null(), 8),
                Status::NullArgument,
            ),
            (
                "a count longer than any list",
                ap_mbuf_publish(pool, copy, &me, usize::MAX / 4 + 1, b.cast(), 4096, &mut n),
                Status::InvalidArgument,
            ),
            (
                "a DVPP buffer",
                ap_mbuf_publish(pool, dv, null(), 0, b.cast(), 4096, &mut n),
                Status::WrongKind,
            ),
            (
                "a pool not over virtual memory",
                ap_mbuf_publish(plain, on_plain, null(), 0, b.cast(), 4096, &mut n),
                Status::NotSupported,
            ),
            (
                "memory that is not a buffer",
                ap_shared_mbuf_open(SOURCE_SIM, 0, not_buffer.as_ptr(), &mut r),
                Status::InvalidArgument,
            ),
            (
                "shared past the size",
                ap_shared_mbuf_read(sh, size, head.as_mut_ptr().cast(), 1),
                Status::OutOfBounds,
            ),
            (
                "not an opened buffer",
                ap_shared_mbuf_close(copy),
                Status::BadBuffer,
            ),
        ] {
            assert_eq!(got, want, "{what}");
        }
        assert_eq!(r, 0, "no handle written");
        assert_eq!(ap_mbuf_record_stream(pool, copy, stream), Status::Ok);
        assert_eq!(ap_stream_synchronize(pool, stream), Status::Ok);
        // The messages, one call at a time.
        expect(
            "kind",
            ap_mbuf_alloc(pool, 64, 7, &mut r),
            Status::InvalidArgument,
            "ap_mbuf_kind",
        );
        expect(
            "freed",
            ap_mbuf_set_data_len(pool, m, 1),
            Status::BadBuffer,
            &gone,
        );
        expect(
            "not a buffer",
            ap_shared_mbuf_open(SOURCE_SIM, 0, not_buffer.as_ptr(), &mut r),
            Status::InvalidArgument,
            "not a buffer",
        );
        assert_eq!(ap_shared_mbuf_close(sh), Status::Ok);
        assert_eq!(ap_shared_mbuf_close(sh), Status::BadBuffer);
        assert_eq!(ap_free(pool, region), Status::Ok);
        assert_eq!(ap_mbuf_free(pool, dv), Status::Ok);
        // The pool's destroy frees the buffer handles still live, the copy among them.
        assert_eq!(destroy(pool), 1);
        assert_eq!(destroy(plain), 1);
        assert_eq!(ap_mbuf_free(pool, copy), Status::BadPool);
    }
}

/// A write past a buffer's data into its padding is reported by the `ap_mbuf_free` of its
/// last handle, as `ap_free` reports one for a region: the buffer is freed all the same.
#[test]
fn an_overrun_into_a_buffers_padding_is_reported_by_its_last_free() {
    let pool = pool_with("debug:1");
    for kind in [MBUF_NORMAL, MBUF_DVPP] {
        let (mut m, mut copy) = (0, 0);
        // SAFETY (every call below): the pointers are valid for what they are used for.
        unsafe {
            assert_eq!(ap_mbuf_alloc(pool, 100, kind, &mut m), Status::Ok);
            assert_eq!(ap_mbuf_copy_ref(pool, m, &mut copy), Status::Ok);
            let data = mbuf_info(pool, m).data as usize;
            // The region holds the 128-byte header and 100 bytes of data: its padding starts
            // at ALIGN_UP(228, 32) = 256 bytes, 128 past the data's start.
            let stray = std::ptr::with_exposed_provenance_mut::<u8>(data);
            // SAFETY: inside the segment's padding (carve rule: 256 + 32 bytes of footprint),
            // in the pool's simulated device memory; writing there is the bug debug mode
            // exists to catch.
            stray.add(130).write(0xAB);
            assert_eq!(ap_mbuf_free(pool, m), Status::Ok, "a handle is left");
            assert_eq!(ap_mbuf_free(pool, copy), Status::Corruption, "{kind}");
            assert!(
                last_error().contains("byte 258 past the start"),
                "{}",
                last_error()
            );
            // Freed all the same: the handle is gone and the pool is whole.
            assert_eq!(ap_mbuf_free(pool, copy), Status::BadBuffer);
        }
    }
    assert_eq!(ap_pool_validate(pool), Status::Ok);
    let live: u64 = stats(pool).iter().map(|s| s.live_regions).sum();
    assert_eq!(live, 0, "the buffers went back with their last handles");
    assert_eq!(destroy(pool), 0);
}

/// A valid data length past the buffer's data, written into its header through a mapping of
/// the same descriptor, is refused by both sides' info calls with `AP_ERR_OUT_OF_BOUNDS`.
#[test]
#[cfg_attr(
    miri,
    ignore = "virtual memory reserves addresses with PROT_NONE, which Miri refuses"
)]
fn a_data_length_past_the_buffer_written_through_a_mapping_is_refused() {
    let pool = pool_over(SOURCE_VMM_SIM, "chunk_size:4m");
    let mut m = 0;
    // SAFETY (every call below): the pointers are NULL or valid for what they are used for.
    unsafe {
        assert_eq!(ap_mbuf_alloc(pool, 1000, MBUF_NORMAL, &mut m), Status::Ok);
        assert_eq!(ap_mbuf_set_data_len(pool, m, 900), Status::Ok);
        let desc = text_of(|b, c, n| ap_mbuf_publish(pool, m, null(), 0, b, c, n));
        let desc = std::ffi::CString::new(desc).unwrap();
        let (mut sh, mut raw) = (0, 0);
        let got = ap_shared_mbuf_open(SOURCE_SIM, 0, desc.as_ptr(), &mut sh);
        assert_eq!(got, Status::Ok, "{}", last_error());
        let got = ap_share_open(SOURCE_SIM, 0, desc.as_ptr(), &mut raw);
        assert_eq!(got, Status::Ok, "{}", last_error());
        let hostile = 1001u64.to_le_bytes();
        assert_eq!(
            ap_mapping_write(raw, 16, hostile.as_ptr().cast(), 8),
            Status::Ok
        );
        let mut si = SharedMbufInfo::default();
        expect(
            "opened",
            ap_shared_mbuf_get_info(sh, &mut si),
            Status::OutOfBounds,
            "out of bounds of 1000 bytes",
        );
        assert_eq!(si, SharedMbufInfo::default(), "nothing written");
        let mut mi = MbufInfo::default();
        expect(
            "the publisher's own",
            ap_mbuf_get_info(pool, m, &mut mi),
            Status::OutOfBounds,
            "out of bounds of 1000 bytes",
        );
        assert_eq!(mi, MbufInfo::default(), "nothing written");
        // The publisher sets it right again.
        assert_eq!(ap_mbuf_set_data_len(pool, m, 900), Status::Ok);
        assert_eq!(ap_shared_mbuf_get_info(sh, &mut si), Status::Ok);
        assert_eq!((si.size, si.data_len), (1000, 900));
        assert_eq!(mbuf_info(pool, m).data_len, 900);
        assert_eq!(ap_mapping_close(raw), Status::Ok);
        assert_eq!(ap_shared_mbuf_close(sh), Status::Ok);
        assert_eq!(ap_mbuf_free(pool, m), Status::Ok);
    }
    assert_eq!(destroy(pool), 0);
}

/// Buffers of both kinds on a plain pool (Miri runs this one: no virtual memory).
#[test]
fn buffers_of_both_kinds_on_the_simulator() {
    let pool = pool_with("chunk_size:2m");
    for kind in [MBUF_NORMAL, MBUF_DVPP] {
        let (mut m, mut copy) = (0, 0);
        // SAFETY (every call below): the pointers are valid for what they are used for.
        unsafe {
            assert_eq!(ap_mbuf_alloc(pool, 300, kind, &mut m), Status::Ok);
            assert_eq!(ap_mbuf_copy_ref(pool, m, &mut copy), Status::Ok);
            let data = [kind as u8 + 1; 300];
            assert_eq!(
                ap_mbuf_write(pool, copy, 0, data.as_ptr().cast(), 300),
                Status::Ok
            );
            assert_eq!(ap_mbuf_set_data_len(pool, m, 300), Status::Ok);
            let mut back = [0u8; 300];
            let got = ap_mbuf_read(pool, m, 0, back.as_mut_ptr().cast(), 300);
            assert_eq!((got, back), (Status::Ok, data));
            let tag = [9u8; 96];
            assert_eq!(
                ap_mbuf_set_user_data(pool, m, 0, tag.as_ptr().cast(), 96),
                Status::Ok
            );
            let mut t = [0u8; 96];
            let got = ap_mbuf_get_user_data(pool, copy, 0, t.as_mut_ptr().cast(), 96);
            assert_eq!((got, t), (Status::Ok, tag));
            let i = mbuf_info(pool, copy);
            assert_eq!(
                (i.size, i.data_len, i.kind, i.refs),
                (300, 300, kind as u32, 2)
            );
            let mut n = 0;
            let got = ap_mbuf_publish(pool, m, null(), 0, null_mut(), 0, &mut n);
            assert_eq!(got, Status::NotSupported, "a pool not over virtual memory");
            assert_eq!(ap_mbuf_free(pool, m), Status::Ok);
            assert_eq!(ap_mbuf_free(pool, m), Status::BadBuffer);
            assert_eq!(mbuf_info(pool, copy).refs, 1);
            assert_eq!(ap_mbuf_free(pool, copy), Status::Ok);
        }
    }
    let live: u64 = stats(pool).iter().map(|s| s.live_regions).sum();
    assert_eq!(live, 0, "the buffers went back with their last handles");
    assert_eq!(destroy(pool), 0);
}

#[test]
#[cfg_attr(
    miri,
    ignore = "threads reading 1 MiB in a loop: far too slow under Miri"
)]
fn mbuf_refs_count_handles_not_calls_in_flight() {
    // Every call on a buffer holds it while it runs; `refs` counts only the handles.
    let pool = pool_with("");
    let mut mb = 0;
    // SAFETY: a writable handle.
    assert_eq!(
        unsafe { ap_mbuf_alloc(pool, 1 << 20, MBUF_NORMAL, &mut mb) },
        Status::Ok
    );
    use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
    let stop = AtomicBool::new(false);
    let reads = AtomicU32::new(0);
    let seen = std::thread::scope(|s| {
        s.spawn(|| {
            let mut b = vec![0u8; 1 << 20];
            while !stop.load(Ordering::Relaxed) {
                // SAFETY: `b` is 1 MiB of writable bytes.
                let got = unsafe { ap_mbuf_read(pool, mb, 0, b.as_mut_ptr().cast(), 1 << 20) };
                assert_eq!(got, Status::Ok);
                reads.fetch_add(1, Ordering::Relaxed);
            }
        });
        // Sample while the reads run: at least 200 of them (each takes a while, and is
        // in flight for most of the loop), and at least once (on a loaded machine the
        // reader may do its 200 before this thread first looks).
        let mut seen = std::collections::BTreeSet::new();
        let start = std::time::Instant::now();
        loop {
            seen.insert(mbuf_info(pool, mb).refs);
            if reads.load(Ordering::Relaxed) >= 200 || start.elapsed().as_secs() >= 30 {
                break;
            }
        }
        stop.store(true, Ordering::Relaxed);
        seen
    });
    assert_eq!(seen.into_iter().collect::<Vec<_>>(), [1]);
    let mut copy = 0;
    // SAFETY: a writable handle.
    assert_eq!(unsafe { ap_mbuf_copy_ref(pool, mb, &mut copy) }, Status::Ok);
    assert_eq!(
        (mbuf_info(pool, mb).refs, mbuf_info(pool, copy).refs),
        (2, 2)
    );
    assert_eq!(ap_mbuf_free(pool, mb), Status::Ok);
    assert_eq!(mbuf_info(pool, copy).refs, 1);
    assert_eq!(ap_mbuf_free(pool, copy), Status::Ok);
    assert_eq!(destroy(pool), 0);
}

/// A read racing a close on another thread is refused as the closed handle it reads
/// (`AP_ERR_BAD_MAPPING`, `AP_ERR_BAD_BUFFER`), never with another code: a read that found
/// the handle just before the close took it out of the table waits for the close, then
/// finds the item closed.
#[test]
#[cfg_attr(
    miri,
    ignore = "virtual memory reserves addresses with PROT_NONE, which Miri refuses"
)]
fn a_read_racing_a_close_is_refused_as_closed() {
    use std::sync::atomic::{AtomicBool, Ordering};
    let pool = pool_over(SOURCE_VMM_SIM, "chunk_size:8m");
    let len = 4u64 << 20;
    let r = alloc(pool, KIND_DEVICE, len).unwrap();
    let mut mb = 0;
    // SAFETY: a writable handle.
    let got = unsafe { ap_mbuf_alloc(pool, len, MBUF_NORMAL, &mut mb) };
    assert_eq!(got, Status::Ok);
    // SAFETY (the closures): no list (any process), and the buffers `text_of` gives.
    let desc = text_of(|b, c, n| unsafe { ap_share_publish(pool, r, null(), 0, b, c, n) });
    let desc = std::ffi::CString::new(desc).unwrap();
    let mdesc = text_of(|b, c, n| unsafe { ap_mbuf_publish(pool, mb, null(), 0, b, c, n) });
    let mdesc = std::ffi::CString::new(mdesc).unwrap();
    type Read = unsafe extern "C" fn(u64, u64, *mut c_void, u64) -> Status;
    let cases: [(&std::ffi::CStr, bool, Read, Status); 2] = [
        (&desc, false, ap_mapping_read, Status::BadMapping),
        (&mdesc, true, ap_shared_mbuf_read, Status::BadBuffer),
    ];
    for (desc, is_buffer, read, closed) in cases {
        for _ in 0..20 {
            let mut h = 0;
            // SAFETY: a NUL-terminated descriptor and a writable handle.
            let got = unsafe {
                if is_buffer {
                    ap_shared_mbuf_open(SOURCE_SIM, 0, desc.as_ptr(), &mut h)
                } else {
                    ap_share_open(SOURCE_SIM, 0, desc.as_ptr(), &mut h)
                }
            };
            assert_eq!(got, Status::Ok, "{}", last_error());
            let started = AtomicBool::new(false);
            let refusals = std::thread::scope(|s| {
                // One reader holds the item through long reads, the other queues behind it.
                let readers: Vec<_> = [len, 64]
                    .into_iter()
                    .map(|n| {
                        let started = &started;
                        s.spawn(move || {
                            let mut b = vec![0u8; n as usize];
                            loop {
                                // SAFETY: `n` writable bytes.
                                let got = unsafe { read(h, 0, b.as_mut_ptr().cast(), n) };
                                started.store(true, Ordering::SeqCst);
                                if got != Status::Ok {
                                    return (got, last_error());
                                }
                            }
                        })
                    })
                    .collect();
                while !started.load(Ordering::SeqCst) {
                    std::thread::yield_now();
                }
                std::thread::sleep(std::time::Duration::from_millis(2));
                let got = if is_buffer {
                    ap_shared_mbuf_close(h)
                } else {
                    ap_mapping_close(h)
                };
                assert_eq!(got, Status::Ok, "{}", last_error());
                readers
                    .into_iter()
                    .map(|t| t.join().unwrap())
                    .collect::<Vec<_>>()
            });
            for (got, says) in refusals {
                assert_eq!(got, closed, "{says}");
            }
        }
    }
    assert_eq!(ap_free(pool, r), Status::Ok);
    assert_eq!(ap_mbuf_free(pool, mb), Status::Ok);
    assert_eq!(destroy(pool), 0);
}

/// A publish asked only for its size has published already (the header says so): the process
/// is let in and the access fixed, and the call with room answers the same descriptor.
#[test]
#[cfg_attr(
    miri,
    ignore = "virtual memory reserves addresses with PROT_NONE, which Miri refuses"
)]
fn a_publish_asked_for_its_size_has_published() {
    let pool = pool_over(SOURCE_VMM_SIM, "chunk_size:4m");
    let r = alloc(pool, KIND_DEVICE, 4096).unwrap();
    let init = 1; // not this process
    let mut needed = 0;
    // SAFETY: one readable id, no buffer, a writable size.
    let got = unsafe { ap_share_publish(pool, r, &init, 1, null_mut(), 0, &mut needed) };
    assert_eq!(got, Status::BufferTooSmall);
    let mut buf = vec![0u8; needed];
    let mut again = 0;
    // SAFETY: no list, and `needed` writable bytes.
    let got = unsafe {
        ap_share_publish(
            pool,
            r,
            null(),
            0,
            buf.as_mut_ptr().cast(),
            needed,
            &mut again,
        )
    };
    assert_eq!(
        got,
        Status::ShareAccessFixed,
        "the access was fixed by the size's call"
    );
    // SAFETY: as above, with the same list.
    let got = unsafe {
        ap_share_publish(
            pool,
            r,
            &init,
            1,
            buf.as_mut_ptr().cast(),
            needed,
            &mut again,
        )
    };
    assert_eq!((got, again), (Status::Ok, needed));
    assert_eq!(ap_free(pool, r), Status::Ok);
    assert_eq!(destroy(pool), 0);
}

/// A pool on device 1 over the simulator was created, then refused every allocation and
/// stream (`ACL_ERROR_RT_PARAM_INVALID`): each pool's simulator had one device, so C had no
/// second device to give a pool (over virtual memory, the create itself failed), and a
/// mapping could be opened on device 0 only. Found by a review (session 77). Fixed by
/// simulating the drop-in's default machine: eight devices, 0 to 7.
#[test]
#[cfg_attr(
    miri,
    ignore = "virtual memory reserves addresses with PROT_NONE, which Miri refuses"
)]
fn pools_on_several_devices_of_the_simulator_work_side_by_side() {
    for source in [SOURCE_SIM, SOURCE_VMM_SIM] {
        let pools: Vec<u64> = (0..8)
            .map(|d| pool_over(source, &format!("device:{d}")))
            .collect();
        for &pool in &pools {
            let r = alloc(pool, KIND_DEVICE, 4096)
                .unwrap_or_else(|s| panic!("{s:?}: {}", last_error()));
            let q = alloc(pool, KIND_DEVICE, 4096).unwrap();
            let mut stream = 0;
            // SAFETY: a writable handle.
            let got = unsafe { ap_stream_create(pool, &mut stream) };
            assert_eq!(got, Status::Ok, "{}", last_error());
            assert_eq!(ap_memset_async(pool, r, 0, 7, 4096, stream), Status::Ok);
            assert_eq!(ap_copy_async(pool, q, 0, r, 0, 4096, stream), Status::Ok);
            assert_eq!(ap_stream_synchronize(pool, stream), Status::Ok);
            let mut back = [0u8; 64];
            // SAFETY: 64 writable bytes.
            let got = unsafe { ap_copy_to_host(pool, q, 0, back.as_mut_ptr().cast(), 64) };
            assert_eq!((got, back), (Status::Ok, [7; 64]));
            // A region or stream of the pool on another device is not this pool's.
            let other = pools[(pools.iter().position(|&p| p == pool).unwrap() + 1) % 8];
            assert_eq!(ap_free(other, r), Status::BadRegion);
            assert_eq!(ap_stream_synchronize(other, stream), Status::BadStream);
            assert_eq!(ap_free(pool, r), Status::Ok);
            assert_eq!(ap_free(pool, q), Status::Ok);
        }
        for pool in pools {
            assert_eq!(ap_pool_validate(pool), Status::Ok);
            assert_eq!(destroy(pool), 0);
        }
        // A ninth device the machine does not have: refused when the pool is made (it was
        // made, and refused every allocation with AP_ERR_RUNTIME).
        let conf = std::ffi::CString::new("device:8").unwrap();
        let mut pool = 0;
        // SAFETY: a NUL-terminated string and a writable handle.
        let got = unsafe { ap_pool_create(source, conf.as_ptr(), &mut pool) };
        expect("device 8", got, Status::Config, "device 8");
    }

    // Published on device 3, opened there.
    let pool = pool_over(SOURCE_VMM_SIM, "device:3");
    let r = alloc(pool, KIND_DEVICE, 4096).unwrap();
    // SAFETY: 4 readable bytes.
    let got = unsafe { ap_copy_from_host(pool, r, 0, [9u8, 8, 7, 6].as_ptr().cast(), 4) };
    assert_eq!(got, Status::Ok);
    // SAFETY (the closure): any process, and the buffers `text_of` gives.
    let desc = text_of(|b, c, n| unsafe { ap_share_publish(pool, r, null(), 0, b, c, n) });
    let desc = std::ffi::CString::new(desc).unwrap();
    let mut m = 0;
    // SAFETY: a NUL-terminated descriptor and a writable handle.
    let got = unsafe { ap_share_open(SOURCE_SIM, 3, desc.as_ptr(), &mut m) };
    assert_eq!(got, Status::Ok, "{}", last_error());
    let mut four = [0u8; 4];
    // SAFETY: 4 writable bytes.
    let got = unsafe { ap_mapping_read(m, 0, four.as_mut_ptr().cast(), 4) };
    assert_eq!((got, four), (Status::Ok, [9, 8, 7, 6]));
    assert_eq!(ap_mapping_close(m), Status::Ok);
    assert_eq!(ap_free(pool, r), Status::Ok);
    assert_eq!(destroy(pool), 0);
}

/// `ap_stream_wait`: the model's stream takes the decoder's frame after the decoder's copy;
/// a stream that is not a live one of the pool is refused, and waiting on itself is taken.
#[test]
fn a_stream_waits_for_another() {
    let pool = pool_with("");
    let (mut decode, mut model, mut gone) = (0, 0, 0);
    // SAFETY: writable handles.
    unsafe {
        assert_eq!(ap_stream_create(pool, &mut decode), Status::Ok);
        assert_eq!(ap_stream_create(pool, &mut model), Status::Ok);
        assert_eq!(ap_stream_create(pool, &mut gone), Status::Ok);
    }
    assert_eq!(ap_stream_destroy(pool, gone), Status::Ok);
    let (packet, frame, out) = (
        alloc(pool, KIND_HOST, 1 << 20).unwrap(),
        alloc(pool, KIND_DVPP, 1 << 20).unwrap(),
        alloc(pool, KIND_HOST, 1 << 20).unwrap(),
    );
    let data = vec![0x5Au8; 1 << 20];
    // SAFETY: a host buffer of the length given.
    let put = unsafe { ap_copy_from_host(pool, packet, 0, data.as_ptr().cast(), 1 << 20) };
    assert_eq!(put, Status::Ok);
    assert_eq!(
        ap_copy_async(pool, frame, 0, packet, 0, 1 << 20, decode),
        Status::Ok
    );
    assert_eq!(ap_stream_wait(pool, model, decode), Status::Ok);
    assert_eq!(
        ap_copy_async(pool, out, 0, frame, 0, 1 << 20, model),
        Status::Ok
    );
    assert_eq!(ap_stream_synchronize(pool, model), Status::Ok);
    let mut back = vec![0u8; 1 << 20];
    // SAFETY: a host buffer of the length given.
    let got = unsafe { ap_copy_to_host(pool, out, 0, back.as_mut_ptr().cast(), 1 << 20) };
    assert_eq!(got, Status::Ok);
    assert_eq!(back, data);
    assert_eq!(ap_stream_wait(pool, model, model), Status::Ok);
    expect(
        "gone",
        ap_stream_wait(pool, model, gone),
        Status::BadStream,
        "",
    );
    expect(
        "gone waits",
        ap_stream_wait(pool, gone, model),
        Status::BadStream,
        "",
    );
    expect(
        "no pool",
        ap_stream_wait(0, model, decode),
        Status::BadPool,
        "",
    );
    let other = pool_with("");
    let mut foreign = 0;
    // SAFETY: a writable handle.
    assert_eq!(unsafe { ap_stream_create(other, &mut foreign) }, Status::Ok);
    expect(
        "another pool's",
        ap_stream_wait(pool, model, foreign),
        Status::BadStream,
        "",
    );
    destroy(other);
    destroy(pool);
}

/// `ap_pool_reset_peak_stats` lowers the peaks to the current figures.
#[test]
fn peak_stats_reset_to_the_current_figures() {
    // No thread cache: the freed region's bytes leave the figures at once.
    let pool = pool_with("thread_cache:off");
    let big = alloc(pool, KIND_DEVICE, 8 << 20).unwrap();
    let small = alloc(pool, KIND_DEVICE, 4096).unwrap();
    assert_eq!(ap_free(pool, big), Status::Ok);
    let before = stats(pool)[KIND_DEVICE as usize];
    assert!(before.peak_requested_bytes > before.requested_bytes);
    assert_eq!(ap_pool_reset_peak_stats(pool), Status::Ok);
    for s in stats(pool) {
        assert_eq!(s.peak_allocated_bytes, s.allocated_bytes);
        assert_eq!(s.peak_requested_bytes, s.requested_bytes);
        assert_eq!(s.peak_reserved_bytes, s.reserved_bytes);
    }
    expect("no pool", ap_pool_reset_peak_stats(0), Status::BadPool, "");
    assert_eq!(ap_free(pool, small), Status::Ok);
    destroy(pool);
}

/// A pool of a device the simulator does not have (it has 8) is refused at creation.
#[test]
fn a_pool_of_a_device_the_source_lacks_is_refused() {
    let conf = std::ffi::CString::new("device:8").unwrap();
    let mut pool = 0;
    // SAFETY: a NUL-terminated string and a writable handle.
    let got = unsafe { ap_pool_create(SOURCE_SIM, conf.as_ptr(), &mut pool) };
    expect("device 8", got, Status::Config, "device 8");
    assert_eq!(pool, 0);
    destroy(pool_with("device:7"));
}

#[test]
fn a_total_limit_over_the_device_kinds_comes_through_the_config_string() {
    const MIB: u64 = 1 << 20;
    let pool = pool_with("limit:8m,total_limit:4m,thread_cache:off");
    let dev = alloc(pool, KIND_DEVICE, MIB).unwrap();
    let dvpp = alloc(pool, KIND_DVPP, MIB).unwrap();
    let before = counters(pool);
    let mut r = 0;
    // SAFETY: a writable handle.
    let got = unsafe { ap_alloc(pool, KIND_DEVICE, 3 * MIB / 2, &mut r) };
    expect(
        "past the total",
        got,
        Status::LimitExceeded,
        "total limit 4194304",
    );
    assert!(last_error().contains("dvpp 2097152"), "{}", last_error());
    assert_eq!(counters(pool), before);
    // The snapshot's JSON gives the total and the limit from C.
    // SAFETY: the buffers come from `text_of`, with their sizes.
    let json = text_of(|b, c, n| unsafe { ap_pool_snapshot_json(pool, b, c, n) });
    let snap: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(snap["device_reserved_bytes"], 4 * MIB, "{json}");
    assert_eq!(snap["total_limit"], 4 * MIB, "{json}");
    // Pinned host memory does not count; freed DVPP memory, trimmed, makes room.
    let host = alloc(pool, KIND_HOST, 6 * MIB).unwrap();
    assert_eq!(ap_free(pool, dvpp), Status::Ok);
    // SAFETY: NULL is allowed.
    assert_eq!(unsafe { ap_pool_trim(pool, null_mut()) }, Status::Ok);
    let more = alloc(pool, KIND_DEVICE, 3 * MIB / 2).unwrap();
    for r in [dev, host, more] {
        assert_eq!(ap_free(pool, r), Status::Ok);
    }
    assert_eq!(destroy(pool), 0);
    let conf = c"total_limit:1m";
    let mut refused = 0;
    // SAFETY: a NUL-terminated string and a writable handle.
    let got = unsafe { ap_pool_create(SOURCE_SIM, conf.as_ptr(), &mut refused) };
    expect(
        "a total under a granule",
        got,
        Status::Config,
        "total_limit",
    );
}

/// This thread's last error's figures, as a C caller asks for them.
fn detail() -> ErrorDetail {
    let mut d = ErrorDetail {
        size: std::mem::size_of::<ErrorDetail>() as u32,
        ..ErrorDetail::default()
    };
    // SAFETY: a writable ErrorDetail whose size says so.
    assert_eq!(unsafe { ap_last_error_detail(&mut d) }, Status::Ok);
    d
}

#[test]
fn the_last_errors_figures_say_which_limit_and_what_the_kinds_hold() {
    const MIB: u64 = 1 << 20;
    let pool = pool_with("chunk_size:2m,limit:4m,total_limit:6m,thread_cache:off");
    let dev = alloc(pool, KIND_DEVICE, MIB).unwrap();
    let dvpp = alloc(pool, KIND_DVPP, MIB).unwrap();
    let s = stats(pool);
    // The kind's own limit: device holds 2 MiB of its 4, and asks for 4 more.
    assert_eq!(
        alloc(pool, KIND_DEVICE, 3 * MIB),
        Err(Status::LimitExceeded)
    );
    let d = detail();
    assert_eq!(d.size as usize, std::mem::size_of::<ErrorDetail>());
    assert_eq!(
        (d.status, d.figures, d.kind),
        (
            Status::LimitExceeded as u32,
            FIGURES_LIMIT,
            KIND_DEVICE as u32
        )
    );
    assert_eq!(
        (d.requested, d.limit, d.reserved),
        (3 * MIB, 4 * MIB, 2 * MIB)
    );
    assert_eq!(d.in_use, s[KIND_DEVICE as usize].allocated_bytes);
    assert!(d.largest_free > 0 && d.largest_free < 3 * MIB, "{d:?}");
    assert_eq!((d.source_code, d.elsewhere), (0, [0; 5]));
    // The total: DVPP and device hold 4 MiB of 6, and 4 more are asked for.
    let cached = alloc(pool, KIND_CACHED, MIB).unwrap();
    assert_eq!(
        alloc(pool, KIND_DVPP, 3 * MIB / 2),
        Err(Status::LimitExceeded)
    );
    let d = detail();
    assert_eq!(
        (d.figures, d.kind, d.limit, d.reserved),
        (FIGURES_TOTAL_LIMIT, KIND_DVPP as u32, 6 * MIB, 6 * MIB)
    );
    assert_eq!(d.elsewhere, [2 * MIB, 0, 2 * MIB, 0, 0], "{d:?}");
    // An error without figures zeroes them; a success zeroes all but the size.
    assert_eq!(alloc(pool, KIND_DEVICE, 0), Err(Status::InvalidSize));
    assert_eq!(
        detail(),
        ErrorDetail {
            size: std::mem::size_of::<ErrorDetail>() as u32,
            status: Status::InvalidSize as u32,
            ..ErrorDetail::default()
        }
    );
    assert_eq!(ap_free(pool, cached), Status::Ok);
    assert_eq!(
        detail(),
        ErrorDetail {
            size: std::mem::size_of::<ErrorDetail>() as u32,
            ..ErrorDetail::default()
        }
    );
    // Per thread: another thread's failure is its own.
    std::thread::spawn(move || assert_eq!(alloc(pool, KIND_DEVICE, 0), Err(Status::InvalidSize)))
        .join()
        .unwrap();
    assert_eq!(detail().status, Status::Ok as u32);
    // An older caller's smaller struct gets the fields it knows and nothing past them.
    assert_eq!(
        alloc(pool, KIND_DEVICE, 3 * MIB),
        Err(Status::LimitExceeded)
    );
    #[repr(C, align(8))]
    struct Older([u8; 40]);
    let mut older = Older([0xAA; 40]);
    older.0[..4].copy_from_slice(&24u32.to_ne_bytes());
    // SAFETY: 40 writable bytes, aligned as the struct, whose size field says 24.
    let got = unsafe { ap_last_error_detail((&raw mut older).cast()) };
    assert_eq!(got, Status::Ok);
    let bytes = older.0;
    assert_eq!(u32::from_ne_bytes(bytes[..4].try_into().unwrap()), 24);
    assert_eq!(
        u32::from_ne_bytes(bytes[8..12].try_into().unwrap()),
        FIGURES_LIMIT
    );
    assert!(bytes[24..].iter().all(|&b| b == 0xAA));
    // A newer caller's larger struct gets the library's fields, `size` says how many bytes,
    // and the caller's later fields are left as they were.
    #[repr(C, align(8))]
    struct Newer([u8; 136]);
    let mut newer = Newer([0xAA; 136]);
    newer.0[..4].copy_from_slice(&136u32.to_ne_bytes());
    // SAFETY: 136 writable bytes, aligned as the struct, whose size field says 136.
    let got = unsafe { ap_last_error_detail((&raw mut newer).cast()) };
    assert_eq!(got, Status::Ok);
    let size = std::mem::size_of::<ErrorDetail>();
    assert_eq!(
        u32::from_ne_bytes(newer.0[..4].try_into().unwrap()),
        size as u32
    );
    assert_eq!(
        u32::from_ne_bytes(newer.0[8..12].try_into().unwrap()),
        FIGURES_LIMIT
    );
    assert!(newer.0[size..].iter().all(|&b| b == 0xAA));
    // Too small for the status, or NULL: refused, and the last error stays.
    let mut tiny = ErrorDetail {
        size: 4,
        ..ErrorDetail::default()
    };
    // SAFETY: a writable ErrorDetail; NULL is refused.
    unsafe {
        assert_eq!(ap_last_error_detail(&mut tiny), Status::InvalidArgument);
        assert_eq!(ap_last_error_detail(null_mut()), Status::NullArgument);
    }
    assert_eq!(detail().figures, FIGURES_LIMIT);
    assert!(last_error().contains("limit"), "{}", last_error());
    for r in [dev, dvpp] {
        assert_eq!(ap_free(pool, r), Status::Ok);
    }
    assert_eq!(destroy(pool), 0);
}
