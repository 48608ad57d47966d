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
    let conf = std::ffi::CString::new(conf).unwrap();
    let mut pool = 0;
    // SAFETY: a NUL-terminated string and a writable handle.
    assert_eq!(
        unsafe { ap_pool_create(SOURCE_SIM, conf.as_ptr(), &mut pool) },
        Status::Ok
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
    ];
    for (name, value) in constants {
        assert!(declared.contains(&(name.to_owned(), value)), "{name}");
    }
    assert_eq!(declared.len(), Status::ALL.len() + constants.len());
    // The kinds are the pool's kind indices (stats and region info report them).
    for (k, kind) in ascend_pool::MemKind::ALL.iter().enumerate() {
        assert_eq!(kind.index(), k);
    }
    for f in [
        "ap_status_name",
        "ap_last_error",
        "ap_pool_create",
        "ap_pool_destroy",
        "ap_pool_stats",
        "ap_pool_validate",
        "ap_pool_trim",
        "ap_pool_synchronize",
        "ap_alloc",
        "ap_alloc_aligned",
        "ap_alloc_model_input",
        "ap_alloc_on",
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
        "ap_copy_async",
        "ap_memset_async",
    ] {
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
    let expect = |what: &str, got: Status, want: Status, says: &str| {
        assert_eq!(got, want, "{what}: {}", last_error());
        assert!(last_error().contains(says), "{what}: {}", last_error());
    };
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
            "4090",
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
            "",
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
            "",
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
        expect(
            "source",
            ap_pool_create(3, null(), &mut r),
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
