//! Device memory shared between processes: a pool over virtual memory publishes a region
//! ([`ap_share_publish`]) as a descriptor, a text another process passes to
//! [`ap_share_open`] to map the same physical memory and read or write it.
//!
//! Mappings are handles from the same counter as pools, regions and streams, in one table for
//! the process: they belong to no pool, since the exporter's pool lives in another process.

use super::*;
use ascend_pool::share::{Access, ShareDescriptor, SharedMapping};
use ascend_pool::source::vmm::{is_virtual, VmmConfig, VmmRuntime, VmmSource};
use std::ffi::c_void;

/// What a pool over virtual memory adds: publishing its regions.
pub(crate) trait Publish: std::fmt::Debug + Send + Sync {
    /// Publishes a region, once the work its memory was freed behind has run
    /// ([`VmmSource::publish_region`]).
    fn publish(&self, region: &AnyRegion, access: &Access) -> Result<ShareDescriptor, Error>;
    fn publish_mbuf(
        &self,
        m: &ascend_pool::mbuf::Mbuf,
        access: &Access,
    ) -> Result<ShareDescriptor, Error>;
}

impl<R: VmmRuntime + 'static> Publish for VmmSource<R> {
    fn publish(&self, region: &AnyRegion, access: &Access) -> Result<ShareDescriptor, Error> {
        with_region!(region, x => self.publish_region(x, access))
    }

    fn publish_mbuf(
        &self,
        m: &ascend_pool::mbuf::Mbuf,
        access: &Access,
    ) -> Result<ShareDescriptor, Error> {
        m.publish(self, access)
    }
}

/// A pool's block source, and its publishing side if it has one.
pub(crate) type Sources = (Arc<dyn BlockSource>, Option<Arc<dyn Publish>>);

/// A block source over virtual memory on `runtime`, and its publishing side.
pub(crate) fn vmm_source<R: VmmRuntime + 'static>(
    runtime: Arc<R>,
    device: i32,
) -> Result<Sources, Failure> {
    let vmm = Arc::new(VmmSource::new(runtime, device, VmmConfig::default())?);
    Ok((vmm.clone(), Some(vmm)))
}

/// Memory another process published, opened here.
#[derive(Debug)]
enum AnyMapping {
    Sim(SharedMapping<SimSource>),
    Acl(SharedMapping<AclSource>),
}

macro_rules! with_mapping {
    ($m:expr, $x:ident => $body:expr) => {
        match $m {
            AnyMapping::Sim($x) => $body,
            AnyMapping::Acl($x) => $body,
        }
    };
}

/// What this process opened of another's memory, by handle, for the whole process. Each is
/// locked while a call uses it, so a close waits for a read under way on another thread.
pub(crate) struct Opened<T> {
    table: LazyLock<Mutex<Handles<Filed<T>>>>,
    /// The failure for a handle not in the table.
    missing: fn(u64) -> Failure,
}

/// One opened item, and the fork generation it was opened in (see `crate::fork`). A close
/// takes the item out: a call that found the handle just before waits for the close, then
/// finds nothing, and is refused as for a closed handle.
struct Filed<T> {
    generation: u64,
    item: Shared<Option<T>>,
}

impl<T> Opened<T> {
    pub(crate) const fn new(missing: fn(u64) -> Failure) -> Self {
        Self {
            table: LazyLock::new(Default::default),
            missing,
        }
    }

    /// Files `value` under a new handle and writes the handle to `out`.
    pub(crate) fn file(&self, value: T, out: NonNull<u64>) -> Result<(), Failure> {
        let handle = next_handle();
        let filed = Filed {
            generation: crate::fork::generation(),
            item: Arc::new(Mutex::new(Some(value))),
        };
        lock(&self.table).insert(handle, filed);
        // SAFETY: the callers checked `out`, a writable u64 of the caller's.
        unsafe { out.as_ptr().write(handle) };
        Ok(())
    }

    /// Runs `f` on what `handle` names, locked.
    pub(crate) fn with<R>(
        &self,
        handle: u64,
        f: impl FnOnce(&mut T) -> Result<R, Failure>,
    ) -> Result<R, Failure> {
        let found = lock(&self.table)
            .get(&handle)
            .map(|f| (f.generation, Arc::clone(&f.item)));
        let (generation, item) = found.ok_or((self.missing)(handle))?;
        // Opened by the process this one was forked from: its lock may be held for good.
        if !crate::fork::ours(generation) {
            return Err(Failure::Forked(handle));
        }
        let mut item = lock(&item);
        // Closed by another thread since the lookup.
        let item = item.as_mut().ok_or((self.missing)(handle))?;
        f(item)
    }

    /// Takes `handle` out of the table and runs `close` on what it named, once no other call
    /// uses it. What the process this one was forked from opened is only forgotten: it is
    /// that process's to close.
    pub(crate) fn close(
        &self,
        handle: u64,
        close: impl FnOnce(&mut T) -> Result<(), Failure>,
    ) -> Result<(), Failure> {
        let found = lock(&self.table).remove(&handle);
        let filed = found.ok_or((self.missing)(handle))?;
        if !crate::fork::ours(filed.generation) {
            std::mem::forget(filed.item);
            return Ok(());
        }
        // Taken out under the lock: a call under way finishes first, and later ones find
        // it closed. Only this close reaches it then; it drops when the close is done.
        let item = lock(&filed.item).take();
        let mut item = item.ok_or((self.missing)(handle))?;
        close(&mut item)
    }

    /// The guard of the table's lock, for `crate::fork`.
    pub(crate) fn fork_guard(&'static self) -> Box<dyn std::any::Any>
    where
        T: 'static,
    {
        Box::new(lock(&self.table))
    }
}

/// Open mappings.
static MAPPINGS: Opened<AnyMapping> = Opened::new(Failure::BadMapping);

/// The guards of the mappings' table and of the runtimes, for `crate::fork`.
pub(crate) fn fork_guards() -> [Box<dyn std::any::Any>; 3] {
    [
        MAPPINGS.fork_guard(),
        Box::new(lock(&SIM_RUNTIME)),
        Box::new(lock(&ACL_RUNTIME)),
    ]
}

/// The runtime this process opens mappings with, one per kind of source for the process
/// (the library is loaded once; a failed load is tried again on the next call), with the
/// fork generation it was made in: a child made by `fork` makes its own.
static SIM_RUNTIME: Mutex<Option<(u64, Arc<SimSource>)>> = Mutex::new(None);
static ACL_RUNTIME: Mutex<Option<(u64, Arc<AclSource>)>> = Mutex::new(None);

pub(crate) enum Runtime {
    Sim(Arc<SimSource>),
    Acl(Arc<AclSource>),
}

/// The runtime in `slot`, made with `make` when there is none of this process's yet.
fn this_process<T>(
    slot: &Mutex<Option<(u64, Arc<T>)>>,
    make: impl FnOnce() -> Result<T, Failure>,
) -> Result<Arc<T>, Failure> {
    let mut slot = lock(slot);
    let generation = crate::fork::generation();
    match &*slot {
        Some((made_in, runtime)) if *made_in == generation => Ok(Arc::clone(runtime)),
        _ => {
            // A runtime of the parent's refuses every call here, and frees nothing as it drops.
            let runtime = Arc::new(make()?);
            *slot = Some((generation, Arc::clone(&runtime)));
            Ok(runtime)
        }
    }
}

pub(crate) fn runtime(source: c_int) -> Result<Runtime, Failure> {
    match source {
        SOURCE_SIM | SOURCE_VMM_SIM => this_process(&SIM_RUNTIME, simulator).map(Runtime::Sim),
        SOURCE_ACL | SOURCE_VMM_ACL => {
            this_process(&ACL_RUNTIME, || Ok(AclSource::load()?)).map(Runtime::Acl)
        }
        other => Err(Failure::Invalid(format!("{other} is not an ap_source"))),
    }
}

/// Publishes the bytes of a device region of a pool created over virtual memory
/// ([`SOURCE_VMM_SIM`], [`SOURCE_VMM_ACL`]) and writes its descriptor, a NUL-terminated text,
/// into `buf` as [`ap_pool_snapshot_json`] does. `pids` lists the `npids` processes let in
/// (their ids from [`ap_share_process_id`]); NULL lets any process in. Whether importers are
/// checked is fixed by the first publish of the memory behind a region
/// ([`Status::ShareAccessFixed`]). A call refused with [`Status::BufferTooSmall`] has
/// published already (an export cannot be taken back); the same call with room gets the same
/// descriptor. A region [`ap_alloc_on`] took over behind its stream's work is published once
/// that work has run (the call waits for it; [`Status::Runtime`], nothing exported, when the
/// runtime cannot wait): the other process's reads and writes follow no stream here.
///
/// # Safety
/// `pids` is NULL or valid for reads of `npids` ids; `buf` is NULL or valid for writes of
/// `cap` bytes; `needed` is NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn ap_share_publish(
    pool: u64,
    region: u64,
    pids: *const i32,
    npids: usize,
    buf: *mut c_char,
    cap: usize,
    needed: *mut usize,
) -> Status {
    // SAFETY: as this function's contract.
    unsafe {
        publish_with(
            pool,
            pids,
            npids,
            buf,
            cap,
            needed,
            |e, publisher, access| {
                let r = e.region(region)?;
                let r = hold(&r);
                let kind = with_region!(&*r, x => x.kind());
                if !is_virtual(kind) {
                    return Err(Error::WrongKind {
                        expected: "device",
                        got: kind,
                    }
                    .into());
                }
                Ok(publisher.publish(&r, access)?)
            },
        )
    }
}

/// Publishes what `publish` names in `pool` to the processes `pids` lists, and hands the
/// descriptor over as text.
///
/// # Safety
/// As [`ap_share_publish`].
pub(crate) unsafe fn publish_with(
    pool: u64,
    pids: *const i32,
    npids: usize,
    buf: *mut c_char,
    cap: usize,
    needed: *mut usize,
    publish: impl FnOnce(&Entry, &dyn Publish, &Access) -> Result<ShareDescriptor, Failure>,
) -> Status {
    run(|| {
        let needed = non_null(needed, "needed")?;
        let access = if pids.is_null() {
            Access::AnyProcess
        } else if npids == 0 {
            return Err(Failure::Invalid(
                "no process to let in (NULL lets any process in)".into(),
            ));
        } else if npids > isize::MAX as usize / std::mem::size_of::<i32>() {
            // More ids than any buffer holds (a C caller's -1, say): no slice can have them.
            return Err(Failure::Invalid(format!(
                "npids {npids} is more process ids than any list holds"
            )));
        } else {
            // SAFETY: the caller gives `npids` readable ids at `pids`, checked non-null, and
            // `npids` ids fit in `isize::MAX` bytes (checked above).
            Access::Processes(unsafe { std::slice::from_raw_parts(pids, npids) }.to_vec())
        };
        let e = entry(pool)?;
        let publisher = e.publisher.as_deref().ok_or(Failure::NotShared(pool))?;
        let desc = publish(&e, publisher, &access)?;
        // SAFETY: as the caller's contract.
        unsafe { hand_over_text(desc.to_json(), buf, cap, needed) }
    })
}

/// The descriptor in a caller's NUL-terminated text.
///
/// # Safety
/// `text` is NULL or a NUL-terminated string.
pub(crate) unsafe fn descriptor(text: *const c_char) -> Result<ShareDescriptor, Failure> {
    let text = non_null(text.cast_mut(), "descriptor")?;
    // SAFETY: the caller passes a NUL-terminated string, checked non-null.
    let text = unsafe { CStr::from_ptr(text.as_ptr()) };
    let text = text
        .to_str()
        .map_err(|_| Error::Config("share descriptor: not UTF-8".into()))?;
    Ok(ShareDescriptor::from_json(text)?)
}

/// This process's id as the runtime behind `source` gives it (`aclrtDeviceGetBareTgid`):
/// what an exporting process lists in [`ap_share_publish`] to let this one in.
///
/// # Safety
/// `out` is NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn ap_share_process_id(source: c_int, out: *mut i32) -> Status {
    run(|| {
        let out = non_null(out, "out")?;
        let id = match runtime(source)? {
            Runtime::Sim(r) => r.bare_tgid()?,
            Runtime::Acl(r) => r.bare_tgid()?,
        };
        // SAFETY: non-null, and the caller gives a writable int32_t.
        unsafe { out.as_ptr().write(id) };
        Ok(())
    })
}

/// Opens memory another process published: imports it through the runtime behind `source`
/// and maps it on `device`, in a reservation of this process's own. A process the exporter
/// did not let in gets [`Status::ShareRefused`], memory no longer exported
/// [`Status::ShareGone`], a text that is not a descriptor [`Status::Config`].
///
/// # Safety
/// `descriptor` is NULL or a NUL-terminated string; `out` is NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn ap_share_open(
    source: c_int,
    device: i32,
    descriptor: *const c_char,
    out: *mut u64,
) -> Status {
    run(|| {
        let out = non_null(out, "out")?;
        // SAFETY: as this function's contract.
        let desc = unsafe { self::descriptor(descriptor)? };
        let m = match runtime(source)? {
            Runtime::Sim(r) => AnyMapping::Sim(SharedMapping::open(r, device, &desc)?),
            Runtime::Acl(r) => AnyMapping::Acl(SharedMapping::open(r, device, &desc)?),
        };
        MAPPINGS.file(m, out)
    })
}

/// `ap_mapping_info`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MappingInfo {
    /// Where the published bytes start in this process.
    pub addr: u64,
    /// Bytes published.
    pub len: u64,
    /// Where they start in the exporting process (to translate addresses it hands over).
    pub exporter_addr: u64,
    /// The exporting process's id.
    pub exporter: i32,
    /// Zero.
    pub reserved: u32,
}

const_assert_eq!(std::mem::size_of::<MappingInfo>(), 32);

/// Where an open mapping's bytes lie, how many, and who published them.
///
/// # Safety
/// `out` is NULL or valid for a write of an [`MappingInfo`].
#[no_mangle]
pub unsafe extern "C" fn ap_mapping_get_info(mapping: u64, out: *mut MappingInfo) -> Status {
    run(|| {
        let out = non_null(out, "out")?;
        let info = MAPPINGS.with(mapping, |m| {
            Ok(with_mapping!(m, x => MappingInfo {
                addr: x.addr() as u64,
                len: x.len(),
                exporter_addr: (x.descriptor().base as u64).wrapping_add(x.descriptor().offset),
                exporter: x.descriptor().exporter,
                reserved: 0,
            }))
        })?;
        // SAFETY: non-null, and the caller gives a writable ap_mapping_info.
        unsafe { out.as_ptr().write(info) };
        Ok(())
    })
}

/// Copies `len` published bytes from `offset` into host memory at `dst`.
///
/// # Safety
/// `dst` is valid for writes of `len` bytes (NULL only if `len` is 0), which nothing else
/// uses during the call: the bytes the call reads may not overlap them.
#[no_mangle]
pub unsafe extern "C" fn ap_mapping_read(
    mapping: u64,
    offset: u64,
    dst: *mut c_void,
    len: u64,
) -> Status {
    run(|| {
        MAPPINGS.with(mapping, |m| {
            // SAFETY: as this function's contract.
            let out = unsafe { host_bytes_mut(dst, offset, len)? };
            Ok(with_mapping!(m, x => x.read(offset, out))?)
        })
    })
}

/// Copies `len` bytes from host memory at `src` into the published bytes at `offset`.
///
/// # Safety
/// `src` is valid for reads of `len` bytes (NULL only if `len` is 0), which nothing writes
/// during the call: the bytes the call writes may not overlap them.
#[no_mangle]
pub unsafe extern "C" fn ap_mapping_write(
    mapping: u64,
    offset: u64,
    src: *const c_void,
    len: u64,
) -> Status {
    run(|| {
        MAPPINGS.with(mapping, |m| {
            // SAFETY: as this function's contract.
            let data = unsafe { host_bytes(src, offset, len)? };
            Ok(with_mapping!(m, x => x.write(offset, data))?)
        })
    })
}

/// Unmaps and frees the imported memory; the exporter's memory goes once every process
/// sharing it has let go. The handle is gone even when the runtime refuses a step (the
/// status says which): what it would not let go stays held until the process ends.
#[no_mangle]
pub extern "C" fn ap_mapping_close(mapping: u64) -> Status {
    run(|| MAPPINGS.close(mapping, |m| Ok(with_mapping!(m, x => x.try_close())?)))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// In the process that opened an item, `with` reaches it and a close runs its closer
    /// (in a child made by `fork` the close only forgets it: `tests/c/fork.c`).
    #[test]
    fn a_close_in_the_opening_process_closes() {
        static OPENED: Opened<u32> = Opened::new(Failure::BadMapping);
        let mut handle = 0u64;
        OPENED.file(7, NonNull::from(&mut handle)).unwrap();
        assert_eq!(OPENED.with(handle, |v| Ok(*v)).unwrap(), 7);
        let mut closed = None;
        OPENED
            .close(handle, |v| {
                closed = Some(*v);
                Ok(())
            })
            .unwrap();
        assert_eq!(closed, Some(7));
        let gone = OPENED.with(handle, |v| Ok(*v));
        assert!(matches!(gone, Err(Failure::BadMapping(h)) if h == handle));
    }

    // A region `ap_alloc_on` took over from one freed behind its stream's queued work was
    // published at once: another process's reads and writes, ordered after no stream of
    // this one, could then meet that work still running.
    #[test]
    #[cfg_attr(
        miri,
        ignore = "virtual memory reserves addresses with PROT_NONE, which Miri refuses"
    )]
    fn a_region_freed_behind_queued_work_is_published_once_that_work_ran() {
        use ascend_pool::source::sim::{AclFunc, Fault};
        use ascend_pool::AclError;
        use std::sync::atomic::{AtomicBool, Ordering};
        const MIB: u64 = 1 << 20;
        let sim = Arc::new(simulator().unwrap());
        let vmm = Arc::new(VmmSource::new(Arc::clone(&sim), 0, VmmConfig::default()).unwrap());
        let pool = Pool::new(vmm.clone(), PoolConfig::default()).unwrap();
        let pool = file_pool(pool, Some(vmm));
        let alloc = |on: Option<u64>| {
            let mut r = 0;
            // SAFETY: a writable handle.
            let got = unsafe {
                match on {
                    Some(s) => ap_alloc_on(pool, KIND_DEVICE, MIB, s, &mut r),
                    None => ap_alloc(pool, KIND_DEVICE, MIB, &mut r),
                }
            };
            assert_eq!(got, Status::Ok);
            r
        };
        // Each lookup held for its own statement: a call holds one entry at a time.
        let addr = |r: u64| {
            let e = entry(pool).unwrap();
            let r = e.region(r).unwrap();
            let r = hold(&r);
            with_region!(&*r, x => x.addr())
        };
        let publish = |r: u64| {
            let mut needed = 0;
            // SAFETY: no pids, no buffer (the size is asked for), a writable `needed`.
            unsafe {
                ap_share_publish(
                    pool,
                    r,
                    std::ptr::null(),
                    0,
                    std::ptr::null_mut(),
                    0,
                    &mut needed,
                )
            }
        };
        let mut s = 0;
        // SAFETY: a writable handle.
        assert_eq!(unsafe { ap_stream_create(pool, &mut s) }, Status::Ok);
        let stale = alloc(None);
        // The old owner's copy stays queued until the hold goes.
        let native = entry(pool).unwrap().stream(s).unwrap().handle();
        let held = sim.hold_stream(native).unwrap();
        let old = alloc(None);
        assert_eq!(ap_copy_async(pool, old, 0, stale, 0, MIB, s), Status::Ok);
        let at = addr(old);
        assert_eq!(ap_free(pool, old), Status::Ok);
        let taken = alloc(Some(s));
        assert_eq!(addr(taken), at, "taken over at once on its stream");
        // A runtime that will not wait for that work: refused before anything is exported.
        sim.inject_fault(Fault::next(
            AclFunc::SynchronizeEvent,
            AclError::RT_FAILURE,
            1,
        ));
        assert_eq!(publish(taken), Status::Runtime);
        assert_eq!(sim.stats().calls(AclFunc::MemExportToShareableHandle), 0);
        // Released from another thread: the publish waits for that work.
        let released = AtomicBool::new(false);
        std::thread::scope(|scope| {
            scope.spawn(|| {
                std::thread::sleep(std::time::Duration::from_millis(100));
                released.store(true, Ordering::SeqCst);
                held.release();
            });
            assert_eq!(publish(taken), Status::BufferTooSmall);
            assert!(
                released.load(Ordering::SeqCst),
                "published while the old owner's copy was still queued"
            );
        });
        for r in [taken, stale] {
            assert_eq!(ap_free(pool, r), Status::Ok);
        }
        assert_eq!(ap_stream_destroy(pool, s), Status::Ok);
        let mut freed = 0;
        // SAFETY: a writable count.
        assert_eq!(unsafe { ap_pool_destroy(pool, &mut freed) }, Status::Ok);
        assert_eq!(freed, 0);
    }
}
