//! A child made by `fork` and what it inherits from its parent (`ascend_pool::fork`).
//!
//! Each test forks children while other threads of the parent work the same pool or
//! simulator, so that some children inherit a lock or a stream in use. A child reports
//! through its exit status; an alarm turns a hang into a failure.

#[path = "common/dropin.rs"]
mod common_dropin;
#[path = "common/hooked.rs"]
mod common_hooked;

use std::ffi::c_void;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Barrier};

use ascend_pool::mbuf::{Mbuf, MbufKind};
use ascend_pool::region::{retry_kept_streams, streams_kept_on};
use ascend_pool::share::{Access, SharedMapping};
use ascend_pool::source::acl::{sys, AclSource};
use ascend_pool::source::sim::{AclFunc, Fault, SimSource};
use ascend_pool::source::vmm::{VmmConfig, VmmSource};
use ascend_pool::source::{BlockSource, MemcpyKind};
use ascend_pool::{AclError, Error, MemKind, Pool, PoolConfig, Region};
use libloading::Library;

/// Children forked per test.
const CHILDREN: usize = 12;

/// Runs `body` in a child made by `fork`, which has 30 seconds; the child's failure (an
/// error, a panic, a hang) fails the caller. Only the child's own writes to stderr show:
/// the test harness's capture is the parent's.
fn in_child(body: impl FnOnce() -> Result<(), String>) {
    // SAFETY: the child runs only `body` and then `_exit`s: it never returns into the test
    // harness, whose other threads it does not have.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork failed");
    if pid == 0 {
        // SAFETY: plain calls; `alarm` ends a child that hangs with SIGALRM.
        unsafe { libc::alarm(30) };
        let status = match catch_unwind(AssertUnwindSafe(body)) {
            Ok(Ok(())) => 0,
            Ok(Err(why)) => {
                let line = format!("forked child: {why}\n");
                // SAFETY: writes `line`'s bytes to stderr.
                unsafe { libc::write(2, line.as_ptr().cast(), line.len()) };
                1
            }
            Err(_) => 2,
        };
        // SAFETY: ends the child without running the parent's exit handlers.
        unsafe { libc::_exit(status) };
    }
    let mut status = 0;
    // SAFETY: `status` is a live out-pointer; `pid` is this process's child.
    let waited = unsafe { libc::waitpid(pid, &mut status, 0) };
    assert_eq!(waited, pid);
    assert!(
        libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
        "the child failed (wait status {status:#x}; 0x100 an error, 0x200 a panic, 0xe SIGALRM: a hang)"
    );
}

/// Runs `wait` on a thread of the parent until the simulator counts a call of `func` (the
/// thread then waits inside it, under the lock the test is about), forks a child running
/// `child` meanwhile, and then lets `hold`'s stream go. Returns what `wait` returned. The
/// waiting thread is let go whatever the child did, so a failure fails the test instead of
/// leaving the scope waiting for the thread.
fn fork_while_waiting<T: Send>(
    sim: &SimSource,
    func: AclFunc,
    hold: ascend_pool::source::sim::StreamHold<'_>,
    child: impl Fn() -> Result<(), String>,
    wait: impl FnOnce() -> T + Send,
) -> T {
    std::thread::scope(|s| {
        let before = sim.stats().calls(func);
        let waiting = s.spawn(wait);
        while sim.stats().calls(func) == before {
            std::thread::yield_now();
        }
        let forked = catch_unwind(AssertUnwindSafe(|| in_child(child)));
        hold.release();
        let got = waiting.join().unwrap();
        if let Err(failed) = forked {
            std::panic::resume_unwind(failed);
        }
        got
    })
}

/// A pool with the default configuration over `source`.
fn pool_over<S: BlockSource + 'static>(source: &Arc<S>) -> ascend_pool::Result<Pool> {
    Pool::new(
        Arc::clone(source) as Arc<dyn BlockSource>,
        PoolConfig::default(),
    )
}

/// `Ok` when `r` is [`Error::Forked`].
fn forked<T: std::fmt::Debug>(what: &str, r: ascend_pool::Result<T>) -> Result<(), String> {
    match r {
        Err(Error::Forked) => Ok(()),
        other => Err(format!("{what}: expected Error::Forked, got {other:?}")),
    }
}

fn check(what: &str, ok: bool) -> Result<(), String> {
    ok.then_some(())
        .ok_or_else(|| format!("{what} does not hold"))
}

/// Threads that allocate and free on `pool` until dropped.
struct Busy {
    stop: Arc<AtomicBool>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl Busy {
    fn on(pool: &Arc<Pool>) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let threads = (0..2u64)
            .map(|t| {
                let (pool, stop) = (Arc::clone(pool), Arc::clone(&stop));
                std::thread::spawn(move || {
                    let mut i = 0u64;
                    while !stop.load(Ordering::Relaxed) {
                        // Sizes for the thread caches, the shape slots and the kind lock.
                        let len = [512, 96 << 10, (1 << 20) + 4096 * (i % 64)][(i % 3) as usize];
                        let a = pool.alloc_device(len + t * 64).unwrap();
                        let b = pool.alloc_host(256).unwrap();
                        drop((a, b));
                        if i % 97 == 0 {
                            pool.trim();
                        }
                        i += 1;
                    }
                })
            })
            .collect();
        Self { stop, threads }
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            t.join().unwrap();
        }
    }
}

/// What a child makes itself works as in any process: a pool over a simulator of its own,
/// streams included.
fn a_pool_of_its_own() -> Result<(), String> {
    let e = |e: Error| e.to_string();
    let sim = Arc::new(SimSource::default());
    let pool = Pool::new(sim, PoolConfig::default()).map_err(e)?;
    let stream = pool.create_stream().map_err(e)?;
    let mut r = pool.alloc_device_on(1 << 20, &stream).map_err(e)?;
    let data: Vec<u8> = (0..4096u32).map(|i| (i % 251) as u8).collect();
    pool.copy_from_host(&mut r, 4096, &data).map_err(e)?;
    let mut back = vec![0u8; data.len()];
    pool.copy_to_host(&r, 4096, &mut back).map_err(e)?;
    check("the copy back", back == data)?;
    drop(r);
    stream.synchronize().map_err(e)?;
    for len in [512, 96 << 10, 3 << 20] {
        drop(pool.alloc_device(len).map_err(e)?);
    }
    pool.validate().map_err(e)?;
    drop(stream);
    check("no region left", pool.leak_report().is_empty())
}

/// One test, so that the harness starts no thread while a test forks: a child forked while
/// a thread of its parent starts or ends cannot start threads of its own (the standard
/// library's thread bookkeeping takes a lock that is not fork-safe), and the children here
/// start streams and an export service.
#[test]
fn forked_children() {
    a_child_refuses_its_parents_pool_and_simulator_and_makes_its_own();
    a_child_shares_memory_of_its_own_and_opens_its_parents();
    a_child_refuses_the_runtime_library_its_parent_loaded();
    a_child_does_not_keep_its_parents_imports();
    a_child_retries_only_its_own_kept_streams();
    a_child_drops_its_parents_stream_without_calling_the_runtime();
    a_child_refuses_to_wait_on_its_parents_streams();
    a_child_refuses_the_runtime_library_s_handles_without_taking_the_source_s_lock();
    a_child_refuses_a_region_a_parent_thread_waits_on();
    a_child_refuses_a_buffer_a_parent_thread_reads();
    a_child_refuses_to_close_its_parents_shared_mapping();
}

/// A mapping the parent opened is refused with `Error::Forked` when a child closes it, even
/// once a close the runtime refused has left a piece unmapped but imported: the import table
/// is the parent's, so the child's close of that piece answered `ForeignHandle`.
fn a_child_refuses_to_close_its_parents_shared_mapping() {
    const LEN: u64 = 2 << 20;
    let sim = Arc::new(SimSource::default());
    let vmm = VmmSource::new(Arc::clone(&sim), 0, VmmConfig::default()).unwrap();
    let block = vmm.alloc_block(0, MemKind::DEVICE, LEN).unwrap();
    let desc = vmm
        .publish_range(block.addr, LEN, &Access::AnyProcess)
        .unwrap();
    let mut m = SharedMapping::open(Arc::clone(&sim), 0, &desc).unwrap();
    sim.inject_fault(Fault::always(
        AclFunc::FreePhysical,
        AclError::RT_MEMORY_ALLOCATION,
    ));
    assert!(m.try_close().is_err());
    assert!(m.holds_memory());
    in_child(|| forked("a close of the parent's mapping", m.try_close()));
    sim.clear_faults();
    m.try_close().unwrap();
    assert!(!m.holds_memory());
    vmm.free_block(block).unwrap();
}

/// Counts every call, and stops the next `aclrtRecordEvent` once armed until the test lets
/// it go: a parent thread inside `Stream::wait_for` then holds the stream's wait list.
#[derive(Debug)]
struct CountAndPause {
    calls: AtomicU64,
    armed: AtomicBool,
    paused: Barrier,
    resume: Barrier,
}

impl common_hooked::Hook for CountAndPause {
    fn on(&self, call: common_hooked::Call) {
        self.calls.fetch_add(1, Ordering::SeqCst);
        if call == common_hooked::Call::RecordEvent && self.armed.swap(false, Ordering::SeqCst) {
            self.paused.wait();
            self.resume.wait();
        }
    }
}

/// `Stream::synchronize` and `Stream::wait_for` on a stream of the parent's answer
/// `Error::Forked` in a child without calling the runtime, over a source that would not
/// refuse them, and without taking the stream's wait list, which a parent thread inside
/// `wait_for` held across the fork (the child would wait for it for good).
fn a_child_refuses_to_wait_on_its_parents_streams() {
    let sim = Arc::new(SimSource::default());
    let hooked = Arc::new(common_hooked::Hooked::with(
        Arc::clone(&sim),
        CountAndPause {
            calls: AtomicU64::new(0),
            armed: AtomicBool::new(false),
            paused: Barrier::new(2),
            resume: Barrier::new(2),
        },
    ));
    let pool = pool_over(&hooked).unwrap();
    let (a, b) = (pool.create_stream().unwrap(), pool.create_stream().unwrap());
    let in_child_refused = || {
        let before = hooked.hook.calls.load(Ordering::SeqCst);
        forked("synchronize", a.synchronize())?;
        forked("wait_for", a.wait_for(&b))?;
        forked("wait_for the other way", b.wait_for(&a))?;
        check(
            "no runtime call",
            hooked.hook.calls.load(Ordering::SeqCst) == before,
        )
    };
    for _ in 0..CHILDREN {
        in_child(in_child_refused);
    }
    // One child forked while a thread of the parent is inside `a.wait_for`.
    std::thread::scope(|s| {
        hooked.hook.armed.store(true, Ordering::SeqCst);
        let waiting = s.spawn(|| a.wait_for(&b));
        hooked.hook.paused.wait();
        // The paused thread is let go whatever the child did, so a failure fails the test
        // instead of leaving the scope waiting for the thread.
        let child = catch_unwind(AssertUnwindSafe(|| in_child(in_child_refused)));
        hooked.hook.resume.wait();
        waiting.join().unwrap().unwrap();
        if let Err(failed) = child {
            std::panic::resume_unwind(failed);
        }
    });
    a.wait_for(&b).unwrap();
    a.synchronize().unwrap();
    drop((a, b, pool));
    assert_eq!(streams_kept_on(&*hooked), 0);
    assert_eq!((sim.stats().live_streams, sim.stats().live_events), (0, 0));
}

/// A `Stream` of the parent's dropped in a child makes no call at all (no wait, no destroy
/// of the stream or its events), over a source that would not refuse them: the stream is
/// the parent's, and counts as kept in the child. The parent's stream is untouched.
fn a_child_drops_its_parents_stream_without_calling_the_runtime() {
    let sim = Arc::new(SimSource::default());
    let watched = Arc::new(common_hooked::Watched::new(Arc::clone(&sim)));
    let pool = pool_over(&watched).unwrap();
    let other = pool.create_stream().unwrap();
    let mut stream = Some(pool.create_stream().unwrap());
    stream.as_ref().unwrap().wait_for(&other).unwrap();
    for _ in 0..CHILDREN {
        in_child(|| {
            let before = watched.calls();
            drop(stream.take());
            check("no runtime call", watched.calls() == before)?;
            check("kept", streams_kept_on(&*watched) == 1)
        });
    }
    let stream = stream.unwrap();
    stream.synchronize().unwrap();
    drop((stream, other));
    assert_eq!(streams_kept_on(&*watched), 0);
    assert_eq!((sim.stats().live_streams, sim.stats().live_events), (0, 0));
}

/// The parent imports memory another simulator exported, forks an idle child, and lets go
/// of the import: the exporter is released at once, not when the child exits (its copy of
/// the import's link would otherwise tell the exporter an importer still holds it).
fn a_child_does_not_keep_its_parents_imports() {
    let exporter = Arc::new(SimSource::default());
    let vmm = Arc::new(VmmSource::new(Arc::clone(&exporter), 0, VmmConfig::default()).unwrap());
    let free = || exporter.mem_info(0, MemKind::DEVICE).unwrap().0;
    let full = free();
    let block = vmm.alloc_block(0, MemKind::DEVICE, 4096).unwrap();
    let desc = vmm
        .publish_range(block.addr, 4096, &Access::AnyProcess)
        .unwrap();
    let mapping = SharedMapping::open(Arc::new(SimSource::default()), 0, &desc).unwrap();
    let mut fds = [0; 2];
    // SAFETY: `fds` is a live array of two descriptors.
    assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
    // SAFETY: the child only reads the pipe and `_exit`s.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork failed");
    if pid == 0 {
        // SAFETY: plain calls on the child's copies of the pipe; the read waits for its end.
        unsafe {
            libc::alarm(30);
            libc::close(fds[1]);
            let mut b = 0u8;
            libc::read(fds[0], (&mut b as *mut u8).cast(), 1);
            libc::_exit(0);
        }
    }
    // SAFETY: the parent's read end, used by no one else.
    unsafe { libc::close(fds[0]) };
    mapping.close().unwrap();
    vmm.free_block(block).unwrap();
    drop(vmm);
    let start = std::time::Instant::now();
    let released = loop {
        if free() == full {
            break true;
        }
        if start.elapsed() > std::time::Duration::from_secs(5) {
            break false;
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    };
    // SAFETY: ends the child's wait, then reaps it.
    unsafe {
        libc::close(fds[1]);
        libc::waitpid(pid, std::ptr::null_mut(), 0);
    }
    assert!(
        released,
        "the exporter stayed charged while an idle child lived"
    );
}

/// The parent's pool and simulator refuse every call in a child, and dropping them (and
/// their regions, streams, and a free still waiting on a held stream) returns at once and
/// frees nothing. The child's own pool works. The parent's pool is intact after.
fn a_child_refuses_its_parents_pool_and_simulator_and_makes_its_own() {
    let sim = Arc::new(SimSource::default());
    let pool = Arc::new(pool_over(&sim).unwrap());
    let mut frame = Some(pool.alloc_device(1 << 20).unwrap());
    let mut host = Some(pool.alloc_host(256).unwrap());
    let mut stream = Some(pool.create_stream().unwrap());
    // A second pool, whose drop would wait for a free queued behind a held stream.
    let held_sim = Arc::new(SimSource::default());
    let mut held_pool = Some(pool_over(&held_sim).unwrap());
    let mut held_stream = Some(held_pool.as_ref().unwrap().create_stream().unwrap());
    let s = held_stream.as_ref().unwrap();
    // Declared after the stream, so that a failure drops it (opening the stream) first.
    let hold = held_sim.hold_stream(s.handle()).unwrap();
    drop(
        held_pool
            .as_ref()
            .unwrap()
            .alloc_device_on(1 << 20, s)
            .unwrap(),
    );
    // A simulator with a stream, whose drop would join the stream's worker thread.
    let lone = Arc::new(SimSource::default());
    let lone_stream = lone.create_stream(0).unwrap();
    let mut lone = Some(lone);
    let busy = Busy::on(&pool);
    // This thread's cache, the last it used, holds a 512-byte segment: without the fork
    // check, the child's allocation of that shape would be a cache hit.
    drop(pool.alloc_device(512).unwrap());
    for _ in 0..CHILDREN {
        in_child(|| {
            forked("a cached shape", pool.alloc_device(512))?;
            forked("a shape-slot size", pool.alloc_device(96 << 10))?;
            forked("a carve", pool.alloc_device(5 << 20))?;
            forked("host memory", pool.alloc_host(256))?;
            let s = stream.as_ref().unwrap();
            forked("a stream-ordered allocation", pool.alloc_device_on(4096, s))?;
            forked("a stream", pool.create_stream())?;
            let f = frame.as_mut().unwrap();
            forked("a copy", pool.copy_from_host(f, 0, &[7; 64]))?;
            forked("synchronize", pool.synchronize())?;
            forked("validate", pool.validate())?;
            forked("the stream's synchronize", s.synchronize())?;
            forked(
                "the simulator's allocation",
                sim.alloc_block(0, MemKind::DEVICE, 1 << 20),
            )?;
            forked("the simulator's stream", sim.create_stream(0))?;
            // SAFETY: refused in the child before anything is registered.
            forked("a window", unsafe { sim.register_window(0, 0, 2 << 20) })?;
            forked("a channel", sim.acquire_channel(0, 0))?;
            let f = frame.as_ref().unwrap();
            check("no block found", sim.block_containing(f.addr()).is_none())?;
            check(
                "empty simulator statistics",
                sim.stats() == Default::default(),
            )?;
            check(
                "a description",
                format!("{pool:?}").contains("forked: true"),
            )?;
            // A new pool over the parent's simulator: made, but it cannot grow.
            let over_parents = pool_over(&sim).map_err(|e| e.to_string())?;
            forked("a new pool's allocation", over_parents.alloc_device(4096))?;
            forked("a new pool's stream", over_parents.create_stream())?;
            drop(over_parents);
            check(
                "zero statistics",
                pool.stats(MemKind::DEVICE).live_regions == 0,
            )?;
            check("an empty snapshot", pool.snapshot().kinds.is_empty())?;
            check("an empty leak report", pool.leak_report().is_empty())?;
            check(
                "nothing trimmed",
                pool.trim() == 0 && pool.flush_thread_caches() == 0,
            )?;
            // Drops that would free, wait for a stream or join its thread: all forget.
            drop((frame.take(), host.take(), stream.take()));
            drop((held_pool.take(), held_stream.take(), lone.take()));
            a_pool_of_its_own()
        });
    }
    drop(busy);
    hold.release();
    // The parent's pool lost nothing to its children.
    let mut frame = frame.unwrap();
    pool.copy_from_host(&mut frame, 0, &[9; 64]).unwrap();
    let mut back = [0u8; 64];
    pool.copy_to_host(&frame, 0, &mut back).unwrap();
    assert_eq!(back, [9; 64]);
    drop((frame, host, stream));
    pool.synchronize().unwrap();
    pool.validate().unwrap();
    assert_eq!(pool.stats(MemKind::DEVICE).live_regions, 0);
    let held_pool = held_pool.unwrap();
    drop(held_stream);
    held_pool.synchronize().unwrap();
    held_pool.validate().unwrap();
    lone.unwrap().destroy_stream(lone_stream).unwrap();
}

/// A child exports and imports memory of its own, and imports its parent's, while a
/// parent thread exports and frees all the time: the child has its own export service (its
/// parent's service thread is not in it), and the table of exports is never inherited
/// locked.
fn a_child_shares_memory_of_its_own_and_opens_its_parents() {
    const LEN: u64 = 2 << 20;
    let vmm = |sim: &Arc<SimSource>| VmmSource::new(Arc::clone(sim), 0, VmmConfig::default());
    let pattern = |seed: u8| -> Vec<u8> { (0..LEN as usize).map(|i| (i as u8) ^ seed).collect() };
    let sim = Arc::new(SimSource::default());
    let parent = Arc::new(vmm(&sim).unwrap());
    let block = parent.alloc_block(0, MemKind::DEVICE, LEN).unwrap();
    let desc = parent
        .publish_range(block.addr, LEN, &Access::AnyProcess)
        .unwrap();
    let bytes = pattern(0x5a);
    // Written with a copy, not through a mapping: an import here would start a thread of the
    // service (below), and end it when closed.
    // SAFETY: `block` is LEN bytes of live device memory, `bytes` LEN bytes of host memory.
    unsafe {
        let src = bytes.as_ptr() as usize;
        parent
            .memcpy(block.addr, LEN, src, LEN, MemcpyKind::HostToDevice)
            .unwrap();
    }
    let stop = Arc::new(AtomicBool::new(false));
    let churn = {
        let (parent, stop) = (Arc::clone(&parent), Arc::clone(&stop));
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                // Exports and their ends only: an import here would start a thread in the
                // parent, and a child forked while one starts or ends cannot start threads
                // of its own (the standard library's thread bookkeeping is not fork-safe).
                let b = parent.alloc_block(0, MemKind::DEVICE, LEN).unwrap();
                parent
                    .publish_range(b.addr, LEN, &Access::AnyProcess)
                    .unwrap();
                parent.free_block(b).unwrap();
            }
        })
    };
    for child in 0..CHILDREN {
        in_child(|| {
            let e = |e: Error| e.to_string();
            forked(
                "the parent's source",
                parent.alloc_block(0, MemKind::DEVICE, LEN),
            )?;
            // Memory of its own, exported and imported again.
            let own = Arc::new(SimSource::default());
            let source = vmm(&own).map_err(e)?;
            let b = source.alloc_block(0, MemKind::DEVICE, LEN).map_err(e)?;
            let d = source
                .publish_range(b.addr, LEN, &Access::AnyProcess)
                .map_err(e)?;
            let m = SharedMapping::open(Arc::clone(&own), 0, &d).map_err(e)?;
            m.write(0, &pattern(0x33)).map_err(e)?;
            let mut got = vec![0u8; LEN as usize];
            m.read(0, &mut got).map_err(e)?;
            check("its own bytes", got == pattern(0x33))?;
            m.close().map_err(e)?;
            source.free_block(b).map_err(e)?;
            // The parent's memory, imported from the parent's service like any process's: by
            // the last child only, since the parent's service starts a thread for each import
            // and ends it when the importer lets go, which a later fork could catch.
            if child + 1 == CHILDREN {
                let theirs = SharedMapping::open(Arc::clone(&own), 0, &desc).map_err(e)?;
                theirs.read(0, &mut got).map_err(e)?;
                check("the parent's bytes", got == bytes)?;
                theirs.close().map_err(e)?;
            }
            Ok(())
        });
    }
    stop.store(true, Ordering::Relaxed);
    churn.join().unwrap();
    parent.free_block(block).unwrap();
}

/// The AscendCL library the parent loaded (here the simulator's drop-in) is refused in a
/// child before any of its functions is called: on hardware the child has none of the
/// parent's device context. A pool over it refuses too. The parent's are untouched.
fn a_child_refuses_the_runtime_library_its_parent_loaded() {
    let acl = Arc::new(AclSource::open(common_dropin::dropin()).unwrap());
    let pool = pool_over(&acl).unwrap();
    let mut region = Some(pool.alloc_device(1 << 20).unwrap());
    let block = acl.alloc_block(0, MemKind::DEVICE, 1 << 20).unwrap();
    let stream = acl.create_stream(0).unwrap();
    // The drop-in's own functions, called by the child directly (loaded by the parent).
    // SAFETY: the drop-in's initialisers have no preconditions; resolving symbols only.
    let raw = unsafe { sys::AclApi::from_library(Library::new(common_dropin::dropin()).unwrap()) }
        .unwrap();
    for _ in 0..CHILDREN / 4 {
        in_child(|| {
            // Refused as the simulator refuses a child (RT_FAILURE), before any lock of the
            // drop-in's own: aclrtFree used to look the parent's block up, find nothing and
            // call it an unknown address (RT_MEMORY_FREE).
            // SAFETY: a live block of the parent and a null (default) stream; both refused.
            let (free, sync) = unsafe {
                (
                    (raw.aclrtFree.as_ref().unwrap())(block.addr as *mut c_void),
                    (raw.aclrtSynchronizeStream.as_ref().unwrap())(std::ptr::null_mut()),
                )
            };
            check(
                "aclrtFree is refused with RT_FAILURE",
                free == sys::ACL_ERROR_RT_FAILURE,
            )?;
            check(
                "aclrtSynchronizeStream is refused with RT_FAILURE",
                sync == sys::ACL_ERROR_RT_FAILURE,
            )?;
            forked("aclrtMalloc", acl.alloc_block(0, MemKind::DEVICE, 1 << 20))?;
            forked("aclrtFree", acl.free_block(block))?;
            forked("aclrtGetMemInfo", acl.mem_info(0, MemKind::DEVICE))?;
            forked("aclrtCreateStream", acl.create_stream(0))?;
            forked("aclrtSynchronizeStream", acl.synchronize_stream(stream))?;
            forked("aclrtSetDevice", acl.use_device(0))?;
            forked("the pool", pool.alloc_device(4096))?;
            let r = region.as_mut().unwrap();
            forked("a copy", pool.copy_from_host(r, 0, &[1; 64]))?;
            drop(region.take());
            Ok(())
        });
    }
    // The parent's block, region and stream are as they were.
    let r = region.unwrap();
    let mut back = [0u8; 64];
    pool.copy_to_host(&r, 0, &mut back).unwrap();
    drop(r);
    acl.synchronize_stream(stream).unwrap();
    acl.destroy_stream(stream).unwrap();
    acl.free_block(block).unwrap();
    pool.validate().unwrap();
}

/// A stream the runtime would not synchronize at its drop, kept: its next `n` synchronizes
/// are refused (`None`: every one, until the faults are cleared).
fn keep_a_stream(pool: &Pool, sim: &SimSource, n: Option<u64>) -> Result<(), String> {
    let s = pool.create_stream().map_err(|e| e.to_string())?;
    let (func, code) = (AclFunc::SynchronizeStream, AclError::RT_FAILURE);
    sim.inject_fault(n.map_or(Fault::always(func, code), |n| Fault::next(func, code, n)));
    drop(s);
    Ok(())
}

/// Streams kept at their drop (`region::retry_kept_streams`). A child retries none of its
/// parent's (they are not its to wait for or destroy), and never finds the list of kept
/// streams locked, though a thread of the parent takes its lock all the time (retrying a
/// stream the runtime keeps refusing); streams the child keeps itself, it destroys. The
/// parent's kept streams are the parent's to destroy afterwards.
fn a_child_retries_only_its_own_kept_streams() {
    let sim = Arc::new(SimSource::default());
    let pool = pool_over(&sim).unwrap();
    keep_a_stream(&pool, &sim, Some(1)).unwrap();
    assert_eq!(streams_kept_on(&*sim), 1);
    // A stream whose every synchronize is refused, retried all the time.
    let churn_sim = Arc::new(SimSource::default());
    let churn_pool = pool_over(&churn_sim).unwrap();
    keep_a_stream(&churn_pool, &churn_sim, None).unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let churn = {
        let (stop, churn_sim) = (Arc::clone(&stop), Arc::clone(&churn_sim));
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                churn_pool.synchronize().unwrap();
                churn_pool.trim();
                assert_eq!(streams_kept_on(&*churn_sim), 1);
            }
        })
    };
    for _ in 0..CHILDREN {
        in_child(|| {
            let e = |e: Error| e.to_string();
            check(
                "the parent's kept streams listed",
                streams_kept_on(&*sim) == 1,
            )?;
            check("none of the parent's retried", retry_kept_streams() == 0)?;
            check(
                "the parent's kept streams still listed",
                streams_kept_on(&*sim) == 1,
            )?;
            let own = Arc::new(SimSource::default());
            let pool = pool_over(&own).map_err(e)?;
            keep_a_stream(&pool, &own, Some(1))?;
            check("its own stream kept", streams_kept_on(&*own) == 1)?;
            check("its own stream destroyed", retry_kept_streams() == 1)?;
            check(
                "nothing of its own left",
                streams_kept_on(&*own) == 0 && own.stats().live_streams == 0,
            )
        });
    }
    stop.store(true, Ordering::Relaxed);
    churn.join().unwrap();
    assert_eq!(retry_kept_streams(), 1, "the parent's own kept stream");
    assert_eq!((streams_kept_on(&*sim), sim.stats().live_streams), (0, 0));
    churn_sim.clear_faults();
    assert_eq!(retry_kept_streams(), 1, "the stream refused until now");
    assert_eq!(
        (streams_kept_on(&*churn_sim), churn_sim.stats().live_streams),
        (0, 0)
    );
}

/// Every call of an `AclSource` the parent made is refused in a child before the source takes
/// its lock, as the module promises: a parent's thread may have held the lock at the fork.
/// Handle calls and copies looked their handle or address up first, under the lock, so a
/// child answered a query of an event never recorded with "complete" (the runtime never
/// asked), and one forked while a parent's thread held the lock hung.
fn a_child_refuses_the_runtime_library_s_handles_without_taking_the_source_s_lock() {
    let acl = Arc::new(AclSource::open(common_dropin::dropin()).unwrap());
    let block = acl.alloc_block(0, MemKind::DEVICE, 4096).unwrap();
    let stream = acl.create_stream(0).unwrap();
    let event = acl.create_event(0).unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    // A parent's thread takes the source's lock over and over.
    let busy = {
        let (acl, stop) = (Arc::clone(&acl), Arc::clone(&stop));
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                assert!(acl.query_event(event).unwrap());
            }
        })
    };
    for _ in 0..CHILDREN {
        in_child(|| {
            forked("aclrtQueryEventStatus", acl.query_event(event))?;
            forked("aclrtSynchronizeEvent", acl.synchronize_event(event))?;
            forked("aclrtRecordEvent", acl.record_event(event, stream))?;
            forked("aclrtStreamWaitEvent", acl.stream_wait_event(stream, event))?;
            forked("aclrtDestroyEvent", acl.destroy_event(event))?;
            forked("aclrtDestroyStream", acl.destroy_stream(stream))?;
            forked("aclrtFree", acl.free_block(block))?;
            let mut out = [0u8; 16];
            // SAFETY: `out` is a live 16-byte buffer and the source 16 bytes of `block`;
            // refused before anything is copied.
            let copy = unsafe {
                acl.memcpy(
                    out.as_mut_ptr() as usize,
                    16,
                    block.addr,
                    16,
                    MemcpyKind::DeviceToHost,
                )
            };
            forked("aclrtMemcpy", copy)?;
            // SAFETY: 16 bytes of `block`; refused before anything is written.
            forked("aclrtMemset", unsafe { acl.memset(block.addr, 16, 0, 16) })?;
            Ok(())
        });
    }
    stop.store(true, Ordering::Relaxed);
    busy.join().unwrap();
    // The parent's are as they were.
    assert!(acl.query_event(event).unwrap());
    acl.destroy_event(event).unwrap();
    acl.destroy_stream(stream).unwrap();
    acl.free_block(block).unwrap();
}

/// A region of the parent's pool is refused with `Error::Forked` in a child before its
/// lock is taken: a parent thread waiting for the work of the region's previous owner (a
/// publish here, as a copy to the host would) held that lock across the fork, and the
/// child would wait for it for good, whether it publishes the region, copies it to the
/// host or queues work on it.
fn a_child_refuses_a_region_a_parent_thread_waits_on() {
    const LEN: u64 = 1 << 20;
    let sim = Arc::new(SimSource::default());
    let vmm = Arc::new(VmmSource::new(Arc::clone(&sim), 0, VmmConfig::default()).unwrap());
    let pool = pool_over(&vmm).unwrap();
    let stream = pool.create_stream().unwrap();
    let stale = pool.alloc_device(LEN).unwrap();
    // A region freed behind a copy its stream cannot run yet, taken over on that stream:
    // host-side access to it waits for the copy.
    let hold = sim.hold_stream(stream.handle()).unwrap();
    let mut old = pool.alloc_device(LEN).unwrap();
    pool.copy_async(&mut old, 0, &stale, 0, LEN, &stream)
        .unwrap();
    drop(old);
    let taken = pool.alloc_device_on(LEN, &stream).unwrap();
    let other = pool.create_stream().unwrap();
    let in_child_refused = || {
        forked(
            "publish_region",
            vmm.publish_region(&taken, &Access::AnyProcess),
        )?;
        let mut buf = [0u8; 8];
        forked("copy_to_host", pool.copy_to_host(&taken, 0, &mut buf))?;
        forked("record_stream", taken.segment().record_stream(&other))
    };
    in_child(in_child_refused);
    // One child forked while a thread of the parent waits inside `publish_region` (its
    // synchronize is counted as it starts, with the region's lock taken before it).
    fork_while_waiting(
        &sim,
        AclFunc::SynchronizeEvent,
        hold,
        in_child_refused,
        || vmm.publish_region(&taken, &Access::AnyProcess),
    )
    .unwrap();
    drop((taken, stale, stream, other));
    pool.validate().unwrap();
}

/// A shared buffer of the parent's pool is refused with `Error::Forked` in a child before
/// its lock is taken, and `data` takes none: a parent thread reading it, waiting for the
/// stream its data was recorded on, held that lock across the fork (the child would wait
/// for it for good).
fn a_child_refuses_a_buffer_a_parent_thread_reads() {
    let sim = Arc::new(SimSource::default());
    let pool = Arc::new(pool_over(&sim).unwrap());
    let stream = pool.create_stream().unwrap();
    let buf = Mbuf::alloc(&pool, 4096, MbufKind::Normal).unwrap();
    buf.record_stream(&stream).unwrap();
    // Its data recorded on a stream that cannot run yet: a read waits for it.
    let hold = sim.hold_stream(stream.handle()).unwrap();
    let data = buf.data();
    let in_child_refused = || {
        // Where the data lies is no call: it answers as in the parent.
        check("data", buf.data() == data)?;
        let mut out = [0u8; 8];
        forked("read", buf.read(0, &mut out))?;
        forked("write", buf.write(0, &out))?;
        forked("data_len", buf.data_len())?;
        forked("record_stream", buf.record_stream(&stream))
    };
    in_child(in_child_refused);
    fork_while_waiting(
        &sim,
        AclFunc::SynchronizeStream,
        hold,
        in_child_refused,
        || {
            let mut out = [0u8; 8];
            buf.read(0, &mut out)
        },
    )
    .unwrap();
    drop((buf, stream));
    pool.validate().unwrap();
}
