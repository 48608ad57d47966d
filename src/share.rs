//! Device memory shared between processes.
//!
//! A process whose pool runs over a [`VmmSource`] publishes memory: one region
//! ([`VmmSource::publish_region`]) or everything the source has mapped
//! ([`VmmSource::publish_all`]). Publishing exports the physical memory behind it
//! (`aclrtMemExportToShareableHandle`, once per allocation) and whitelists the processes
//! [`Access`] names (`aclrtMemSetPidToShareableHandle`, ids from `aclrtDeviceGetBareTgid`),
//! and gives a [`ShareDescriptor`]: plain data (JSON) to hand to the other process by any
//! means. There, [`SharedMapping::open`] imports every piece, maps them into one reserved
//! range in the same layout, and reads and writes the published bytes.
//!
//! The rules of the runtime hold: a process off the whitelist is refused
//! ([`Error::ShareRefused`]); a handle whose exporter has freed the memory (or exited) cannot
//! be imported any more ([`Error::ShareGone`]), but memory already imported stays valid until
//! the importer closes its mapping; the exporter's device keeps it charged until then.
//!
//! ```
//! use ascend_pool::share::{Access, SharedMapping};
//! use ascend_pool::source::sim::{SimConfig, SimSource};
//! use ascend_pool::source::vmm::{VmmConfig, VmmSource, VmmRuntime};
//! use ascend_pool::{Pool, PoolConfig};
//! use std::sync::Arc;
//!
//! let sim = Arc::new(SimSource::new(SimConfig::default().with_device_capacity(256 << 20))?);
//! let vmm = Arc::new(VmmSource::new(Arc::clone(&sim), 0, VmmConfig::default())?);
//! let pool = Pool::new(vmm.clone(), PoolConfig::default())?;
//! let mut tensor = pool.alloc_device(4096)?;
//! pool.copy_from_host(&mut tensor, 0, b"hello from the scheduler")?;
//!
//! // Here the reader is this very process; normally it is another one, given the JSON.
//! let me = sim.bare_tgid()?;
//! let desc = vmm.publish_region(&tensor, &Access::Processes(vec![me]))?;
//! let json = desc.to_json();
//!
//! let reader = SharedMapping::open(Arc::clone(&sim), 0, &serde_json::from_str(&json).unwrap())?;
//! let mut got = [0u8; 24];
//! reader.read(0, &mut got)?;
//! assert_eq!(&got, b"hello from the scheduler");
//! reader.close()?;
//! # Ok::<(), ascend_pool::Error>(())
//! ```

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::{Arc, LazyLock, Mutex, MutexGuard, PoisonError};

use crate::error::{AclError, Error, Result};
use crate::region::Region;
use crate::source::vmm::{
    PhysicalHandle, VmmRuntime, VmmSource, EXPORT_FLAG_DEFAULT, EXPORT_FLAG_DISABLE_PID_VALIDATION,
};
use crate::source::{DeviceId, MemcpyKind};

/// Which processes may open what is published.
///
/// The runtime grants access per physical allocation, not per published range: a process
/// let in by one publish may import the whole allocation behind it (a chunk's granules), so
/// every region published from the same allocation is open to it too, and whitelists only
/// grow. Whether importers are checked at all is fixed by the first publish of an
/// allocation, once it has exported it: publishing it later under the other kind of access
/// is refused with [`Error::ShareAccessFixed`]. The runtime cannot take an export back, so
/// a publish that fails after exporting (a whitelist the runtime refused) fixes it too:
/// retry with the same kind of access. Keep memory for different readers in different
/// pools.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Access {
    /// Only these processes (ids from [`VmmRuntime::bare_tgid`] in each of them); at least
    /// one ([`Error::Config`] otherwise, and nothing is exported).
    Processes(Vec<i32>),
    /// Any process: pid validation is disabled when the memory is first exported.
    AnyProcess,
}

/// One exported physical allocation in a [`ShareDescriptor`].
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SharedPiece {
    /// Offset from [`ShareDescriptor::base`].
    pub offset: u64,
    /// Bytes.
    pub len: u64,
    /// The shareable handle.
    pub handle: u64,
}

/// What another process needs to open published memory.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ShareDescriptor {
    /// The exporter's process id.
    pub exporter: i32,
    /// The exporter's address of the first piece.
    pub base: usize,
    /// Bytes from `base` to the end of the last piece.
    pub span: u64,
    /// The pieces, by offset; they do not overlap.
    pub pieces: Vec<SharedPiece>,
    /// Offset of the published bytes from `base`.
    pub offset: u64,
    /// Bytes published.
    pub len: u64,
    /// The id of the shared buffer published ([`Mbuf::publish`](crate::mbuf::Mbuf::publish)),
    /// which [`SharedMbuf::open`](crate::mbuf::SharedMbuf::open) finds in its header only
    /// while that buffer lives; 0 for memory published as a range or region.
    #[serde(default)]
    pub buffer: u64,
}

impl ShareDescriptor {
    /// The descriptor as JSON.
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).expect("plain data serializes")
    }

    /// A descriptor from [`ShareDescriptor::to_json`].
    pub fn from_json(json: &str) -> Result<Self> {
        serde_json::from_str(json).map_err(|e| Error::Config(format!("share descriptor: {e}")))
    }
}

/// Publishing (the exporting side).
impl<R: VmmRuntime + 'static> VmmSource<R> {
    /// Publishes the bytes of `region`, which must come from a pool over this source.
    ///
    /// A region whose memory was taken over from one freed behind its stream's work
    /// ([`Pool::alloc_device_on`](crate::Pool::alloc_device_on)) is published once that work
    /// has run (the call waits for it): another process's reads and writes are ordered
    /// after no stream of this one. [`Error::Runtime`] when the runtime cannot wait; nothing
    /// is exported then. In a child made by `fork`, a region of the parent's pool is
    /// refused with [`Error::Forked`] before anything waits ([`crate::fork`]).
    pub fn publish_region(&self, region: &impl Region, access: &Access) -> Result<ShareDescriptor> {
        region.segment().settle_for_host()?;
        self.publish_range(region.addr(), region.len(), access)
    }

    /// Publishes `len` bytes at `addr`, which must lie in device memory this source mapped
    /// for blocks it handed out ([`Error::ForeignHandle`] otherwise, also over a block it
    /// retired: [`VmmStats::retired`](crate::source::vmm::VmmStats::retired)).
    ///
    /// It waits for nothing: for a region [`Pool::alloc_device_on`](crate::Pool::alloc_device_on)
    /// took over behind its stream's work, use [`publish_region`](Self::publish_region), or
    /// synchronize that stream first.
    pub fn publish_range(&self, addr: usize, len: u64, access: &Access) -> Result<ShareDescriptor> {
        if len == 0 {
            return Err(Error::OutOfBounds {
                offset: 0,
                len,
                capacity: 0,
                side: None,
            });
        }
        // Asked before anything is exported: nothing after the export may fail but the
        // whitelist (see `Access`).
        let exporter = self.runtime().bare_tgid()?;
        // Refused before anything is exported if the pieces do not cover the range.
        let pieces = self.export_extents(Some((addr, len)), flags(access)?)?;
        self.describe(exporter, pieces, Some((addr, len)), access)
    }

    /// Publishes every byte this source has mapped (every chunk of the pool over it), but
    /// a retired block's, which no one holds.
    ///
    /// It waits for nothing, as [`publish_range`](Self::publish_range): bytes streams still
    /// write are published as they are.
    pub fn publish_all(&self, access: &Access) -> Result<ShareDescriptor> {
        let exporter = self.runtime().bare_tgid()?;
        let pieces = self.export_extents(None, flags(access)?)?;
        if pieces.is_empty() {
            return Err(Error::OutOfBounds {
                offset: 0,
                len: 0,
                capacity: 0,
                side: None,
            });
        }
        self.describe(exporter, pieces, None, access)
    }

    fn describe(
        &self,
        exporter: i32,
        pieces: Vec<(usize, u64, u64)>,
        window: Option<(usize, u64)>,
        access: &Access,
    ) -> Result<ShareDescriptor> {
        if let Access::Processes(pids) = access {
            for &(_, _, handle) in &pieces {
                self.runtime().set_shareable_pids(handle, pids)?;
            }
        }
        let base = pieces[0].0;
        let (last_va, last_len, _) = *pieces.last().expect("not empty");
        let span = (last_va - base) as u64 + last_len;
        let (offset, len) = match window {
            Some((addr, len)) => ((addr - base) as u64, len),
            None => (0, span),
        };
        Ok(ShareDescriptor {
            exporter,
            base,
            span,
            pieces: pieces
                .into_iter()
                .map(|(va, len, handle)| SharedPiece {
                    offset: (va - base) as u64,
                    len,
                    handle,
                })
                .collect(),
            offset,
            len,
            buffer: 0,
        })
    }
}

/// The export flags for `access`; an empty whitelist is refused before anything is
/// exported: it would fix the memory's access to whitelisted processes and let none in.
fn flags(access: &Access) -> Result<u64> {
    match access {
        Access::AnyProcess => Ok(EXPORT_FLAG_DISABLE_PID_VALIDATION),
        Access::Processes(pids) if pids.is_empty() => Err(Error::Config(
            "Access::Processes names no process (Access::AnyProcess lets any in)".into(),
        )),
        Access::Processes(_) => Ok(EXPORT_FLAG_DEFAULT),
    }
}

/// Published memory opened in this process: imported and mapped in the exporter's layout.
///
/// Closing it (or dropping it) unmaps and frees the imported memory; the exporter's memory
/// is released once every process sharing it has done so. What the runtime refuses to let
/// go stays held, and [`try_close`](Self::try_close) tries it again.
pub struct SharedMapping<R: VmmRuntime> {
    runtime: Arc<R>,
    desc: ShareDescriptor,
    /// Start of the local reservation (the exporter's `base`).
    va: usize,
    /// Imported pieces still held: local address, shareable handle, and whether it is still
    /// mapped there (a close that could unmap a piece but not let go of its import keeps it
    /// unmapped). Each holds one use of the process's import of the handle ([`IMPORTS`]).
    pieces: Vec<(usize, u64, bool)>,
    /// The reservation at `va` is held: until every piece is freed and it is released.
    reserved: bool,
    /// False from the first close on: reads and writes are refused.
    open: bool,
    /// The fork generation it was opened in: a child's close is refused with
    /// [`Error::Forked`] (the imports it would let go are the parent's).
    forks: u64,
}

impl<R: VmmRuntime> std::fmt::Debug for SharedMapping<R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedMapping")
            .field("va", &format_args!("{:#x}", self.va))
            .field("desc", &self.desc)
            .finish()
    }
}

/// One import this process holds of a shareable handle.
struct Import {
    handle: PhysicalHandle,
    device: DeviceId,
    /// Pieces of open mappings that map it (or hold it unmapped); more than 0.
    users: usize,
}

/// The imports this process holds, by process, runtime and shareable handle.
///
/// The runtime maps handles and shareable handles one to one within a process: a second
/// import of the same shareable handle is refused. Mappings of memory from one allocation
/// (two regions published from one chunk, or a buffer and a region) share its import here.
///
/// Invariant: an entry lives while `users > 0`; its handle is freed when the last user lets
/// go. The runtime is alive while it has entries (each user's mapping holds an `Arc` of it),
/// so its address names it. The process id keeps a child made by `fork` off its parent's.
static IMPORTS: LazyLock<Mutex<ImportTable>> = LazyLock::new(Default::default);

/// Process id, runtime address, shareable handle.
type ImportKey = (u32, usize, u64);
type ImportTable = HashMap<ImportKey, Import>;

fn imports() -> MutexGuard<'static, ImportTable> {
    // Every entry is updated in one step; a panic elsewhere leaves the table consistent.
    IMPORTS.lock().unwrap_or_else(PoisonError::into_inner)
}

thread_local! {
    /// The import table's lock, taken by [`hold_for_fork`] for the same thread to let go.
    static HELD_FOR_FORK: RefCell<Option<MutexGuard<'static, ImportTable>>> =
        const { RefCell::new(None) };
}

/// Takes the import table's lock just before a fork (before the simulator's locks, the
/// order an import takes them in), so that the child does not inherit it held by a thread
/// it does not have. The child's entries are none of the parent's: keys carry the process.
pub(crate) fn hold_for_fork() {
    let guard = imports();
    // A fork from a thread whose thread-locals are gone: the lock goes back at once.
    let _ = HELD_FOR_FORK.try_with(|h| *h.borrow_mut() = Some(guard));
}

/// Lets go of the lock [`hold_for_fork`] took, in the parent and in the child.
pub(crate) fn release_after_fork() {
    let _ = HELD_FOR_FORK.try_with(|h| drop(h.borrow_mut().take()));
}

fn import_key<R: VmmRuntime>(runtime: &Arc<R>, shareable: u64) -> ImportKey {
    (
        std::process::id(),
        Arc::as_ptr(runtime) as *const () as usize,
        shareable,
    )
}

/// This process's handle of `shareable` on `device`: imported on first use, shared after.
fn acquire_import<R: VmmRuntime>(
    runtime: &Arc<R>,
    shareable: u64,
    device: DeviceId,
) -> Result<PhysicalHandle> {
    let key = import_key(runtime, shareable);
    // Held across the import, so two threads opening the same memory import it once.
    let mut table = imports();
    if let Some(i) = table.get_mut(&key) {
        if i.device != device {
            return Err(Error::Config(format!(
                "shareable handle {shareable:#x} is imported here for device {}: a process \
                 holds one import of it, so open it on that device",
                i.device
            )));
        }
        i.users += 1;
        return Ok(i.handle);
    }
    let handle = runtime
        .import_shareable(shareable, device)
        .map_err(|e| import_error(&**runtime, shareable, e))?;
    table.insert(
        key,
        Import {
            handle,
            device,
            users: 1,
        },
    );
    Ok(handle)
}

/// Lets go of one use of `shareable`'s import; the last frees the handle. A free the runtime
/// refuses keeps the use, to be let go again.
fn release_import<R: VmmRuntime>(runtime: &Arc<R>, shareable: u64) -> Result<()> {
    let key = import_key(runtime, shareable);
    let mut table = imports();
    let Some(i) = table.get_mut(&key) else {
        return Err(Error::ForeignHandle);
    };
    if i.users > 1 {
        i.users -= 1;
        return Ok(());
    }
    runtime.free_physical(i.handle)?;
    table.remove(&key);
    Ok(())
}

/// The typed error for a failed import of `handle`.
fn import_error<R: VmmRuntime>(runtime: &R, handle: u64, e: Error) -> Error {
    match e {
        Error::Runtime { code, .. } if code == AclError::RT_INVALID_HANDLE => {
            Error::ShareGone { handle }
        }
        Error::Runtime { code, .. } if code == crate::source::sim::NOT_WHITELISTED => {
            Error::ShareRefused {
                handle,
                pid: runtime.bare_tgid().unwrap_or(-1),
            }
        }
        other => other,
    }
}

impl<R: VmmRuntime> SharedMapping<R> {
    /// Imports and maps what `desc` describes on `device`. On failure what was imported,
    /// mapped or reserved is let go again (what the runtime refuses to let go twice stays
    /// held, and is printed); a process off the whitelist gets [`Error::ShareRefused`], a
    /// handle no longer exported [`Error::ShareGone`], a descriptor that publishes no bytes
    /// or does not add up [`Error::Config`].
    pub fn open(runtime: Arc<R>, device: DeviceId, desc: &ShareDescriptor) -> Result<Self> {
        let bad = |m: &str| Error::Config(format!("share descriptor: {m}"));
        // `publish_*` never publish 0 bytes; a mapping of nothing could only refuse copies.
        if desc.len == 0 {
            return Err(bad("no bytes published"));
        }
        if desc.pieces.is_empty()
            || desc
                .offset
                .checked_add(desc.len)
                .is_none_or(|e| e > desc.span)
        {
            return Err(bad("published bytes outside the pieces"));
        }
        let granule = runtime.allocation_granularity(device, false)?;
        let mut end = 0;
        for p in &desc.pieces {
            if p.offset < end || p.len == 0 || p.offset % granule != 0 || p.len % granule != 0 {
                return Err(bad("pieces overlap or are not whole granules"));
            }
            // The descriptor comes from another process: its numbers are not trusted.
            end = p
                .offset
                .checked_add(p.len)
                .ok_or_else(|| bad("a piece ends past the address space"))?;
        }
        if end != desc.span {
            return Err(bad("span disagrees with the pieces"));
        }
        let va = runtime.reserve_address(device, desc.span)?;
        let mut mapping = Self {
            runtime,
            desc: desc.clone(),
            va,
            pieces: Vec::with_capacity(desc.pieces.len()),
            reserved: true,
            open: true,
            forks: crate::fork::generation(),
        };
        for p in &desc.pieces {
            let handle = match acquire_import(&mapping.runtime, p.handle, device) {
                Ok(h) => h,
                Err(e) => {
                    let _ = mapping.try_close();
                    return Err(e);
                }
            };
            let at = va + p.offset as usize;
            if let Err(e) = mapping.runtime.map(at, p.len, 0, handle) {
                mapping.pieces.push((at, p.handle, false));
                let _ = mapping.try_close();
                return Err(e);
            }
            mapping.pieces.push((at, p.handle, true));
        }
        Ok(mapping)
    }

    /// Local address of the first published byte.
    pub fn addr(&self) -> usize {
        self.va + self.desc.offset as usize
    }

    /// Bytes published.
    pub fn len(&self) -> u64 {
        self.desc.len
    }

    /// Whether nothing was published (never true for an opened mapping).
    pub fn is_empty(&self) -> bool {
        self.desc.len == 0
    }

    /// The descriptor this mapping was opened from.
    pub fn descriptor(&self) -> &ShareDescriptor {
        &self.desc
    }

    /// The local address of what the exporter sees at `exporter_addr`, if it is published.
    pub fn translate(&self, exporter_addr: usize) -> Option<usize> {
        let start = self.desc.base.checked_add(self.desc.offset as usize)?;
        let off = exporter_addr.checked_sub(start)?;
        ((off as u64) < self.desc.len).then(|| self.addr() + off)
    }

    /// The local address of `len` published bytes at `offset`, if they are all mapped:
    /// inside the published window, and on pieces with no hole between them (what
    /// [`VmmSource::publish_all`] publishes may span unmapped addresses between chunks).
    fn check(&self, offset: u64, len: usize) -> Result<usize> {
        if !self.open {
            return Err(Error::AlreadyFreed);
        }
        let len = len as u64;
        let out = Error::OutOfBounds {
            offset,
            len,
            capacity: self.desc.len,
            side: None,
        };
        match offset.checked_add(len) {
            Some(end) if end <= self.desc.len && len > 0 => {
                // `open` checked that the window lies within the span.
                let from = self.desc.offset + offset;
                if !self.mapped(from, from + len) {
                    return Err(out);
                }
                Ok(self.addr() + offset as usize)
            }
            _ => Err(out),
        }
    }

    /// Whether `from..to` (offsets from `base`) lies on pieces that follow each other
    /// without a hole. Pieces are sorted, do not overlap and do not overflow (see `open`).
    fn mapped(&self, from: u64, to: u64) -> bool {
        let mut at = from;
        for p in &self.desc.pieces {
            if p.offset > at {
                return false;
            }
            at = at.max(p.offset + p.len);
            if at >= to {
                return true;
            }
        }
        false
    }

    /// Copies published bytes from `offset` into `out`. A range past the published bytes,
    /// or reaching addresses between two pieces, is refused with [`Error::OutOfBounds`].
    pub fn read(&self, offset: u64, out: &mut [u8]) -> Result<()> {
        let src = self.check(offset, out.len())?;
        let n = out.len() as u64;
        // SAFETY: `check` found `src..src + n` on pieces this mapping keeps mapped, with no
        // hole; `out` is n bytes.
        unsafe {
            self.runtime.memcpy(
                out.as_mut_ptr() as usize,
                n,
                src,
                n,
                MemcpyKind::DeviceToHost,
            )
        }
    }

    /// Copies `data` into the published bytes at `offset`; refused as [`read`](Self::read) is.
    pub fn write(&self, offset: u64, data: &[u8]) -> Result<()> {
        let dst = self.check(offset, data.len())?;
        let n = data.len() as u64;
        // SAFETY: `check` found `dst..dst + n` on pieces this mapping keeps mapped, with no
        // hole; `data` is n bytes.
        unsafe {
            self.runtime
                .memcpy(dst, n, data.as_ptr() as usize, n, MemcpyKind::HostToDevice)
        }
    }

    /// Unmaps and frees the imported memory and releases the reservation. If the runtime
    /// refuses a step, the drop right after tries what is left once more, then prints the
    /// error and leaves it held; to keep trying, use [`try_close`](Self::try_close).
    pub fn close(mut self) -> Result<()> {
        self.try_close()
    }

    /// Closes the mapping and keeps it: unmaps and frees every imported piece, then releases
    /// the reservation. Reads and writes are refused ([`Error::AlreadyFreed`]) from the
    /// first call on. A step the runtime refuses leaves what it had to let go held, and the
    /// first error is returned; call again to retry. `Ok` once nothing is held. In a child
    /// made by `fork`, a mapping its parent opened is refused with [`Error::Forked`] and left
    /// as it is (the parent still holds it).
    pub fn try_close(&mut self) -> Result<()> {
        crate::fork::check(self.forks)?;
        self.open = false;
        let mut first = Ok(());
        let runtime = &self.runtime;
        self.pieces.retain_mut(|(at, shareable, mapped)| {
            let r = if *mapped {
                runtime.unmap(*at).inspect(|()| *mapped = false)
            } else {
                Ok(())
            };
            let r = r.and_then(|()| release_import(runtime, *shareable));
            let kept = r.is_err();
            if first.is_ok() {
                first = r;
            }
            kept
        });
        // Addresses with memory still mapped cannot be released.
        if self.reserved && self.pieces.is_empty() {
            let r = runtime.release_address(self.va);
            self.reserved = r.is_err();
            first = first.and(r);
        }
        first
    }

    /// Whether the mapping still holds imported memory or its reservation.
    pub fn holds_memory(&self) -> bool {
        self.reserved || !self.pieces.is_empty()
    }
}

impl<R: VmmRuntime> Drop for SharedMapping<R> {
    fn drop(&mut self) {
        if self.holds_memory() {
            match self.try_close() {
                // The parent's mapping, in a child made by `fork`: nothing to close here.
                Ok(()) | Err(Error::Forked) => {}
                Err(e) => {
                    eprintln!("ascend-pool: closing a shared mapping failed, memory left held: {e}")
                }
            }
        }
    }
}
