//! Virtual memory: the runtime calls behind expandable pools, and [`VmmSource`], a block
//! source that reserves one big device address range and maps physical memory into it.
//!
//! AscendCL splits an allocation in two: `aclrtReserveMemAddress` reserves device virtual
//! addresses, `aclrtMallocPhysical` allocates physical memory (counted against the device's
//! capacity), and `aclrtMapMem` maps the second into the first. [`VmmRuntime`] is that API
//! (plus the cross-process sharing of physical memory built on it), implemented by the
//! simulator and by [`AclSource`](crate::source::AclSource).
//!
//! [`VmmSource`] turns it into a [`BlockSource`]: device blocks are carved from one
//! reservation made once, backed by physical memory mapped into it, and a block
//! can grow in place ([`BlockSource::extend_block`]) while the addresses after it are free, or
//! give back its tail ([`BlockSource::shrink_block`]). Because the reservation is larger than
//! the device (4x by default), a large request finds contiguous addresses even when the
//! physical memory left is scattered. DVPP and host memory are not virtual-memory managed:
//! those kinds go straight to the runtime.
//!
//! Every growth is one physical allocation (an *extent*) mapped whole by one `aclrtMapMem`:
//! the runtime maps a physical allocation only from offset 0 and only all of it. A failure
//! frees the physical memory again, so the source is as it was before the call.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};

use crate::align::align_up;
use crate::error::{AclError, Error, Result};
use crate::kind::MemKind;
use crate::source::{
    Block, BlockSource, ChannelHandle, CommThreadHandle, DeviceId, EventHandle, MemcpyKind,
    StreamHandle,
};

/// `ACL_MEM_HANDLE_TYPE_NONE`: the only handle type `aclrtMallocPhysical` takes.
pub const HANDLE_TYPE_NONE: u32 = 0;
/// `ACL_MEM_ALLOCATION_TYPE_PINNED`: the only allocation type `aclrtMallocPhysical` takes.
pub const ALLOCATION_TYPE_PINNED: u32 = 0;
/// `ACL_MEM_LOCATION_TYPE_HOST`.
pub const LOCATION_TYPE_HOST: u32 = 0;
/// `ACL_MEM_LOCATION_TYPE_DEVICE`.
pub const LOCATION_TYPE_DEVICE: u32 = 1;
/// `ACL_HBM_MEM_HUGE`: huge-page device memory.
pub const MEM_ATTR_HBM_HUGE: u32 = 4;
/// `aclrtReserveMemAddress` flags for huge pages; the flag must match the page type of the
/// physical memory mapped into the range ([`MEM_ATTR_HBM_HUGE`] here), 0 being normal pages.
pub const RESERVE_FLAG_HUGE_PAGE: u64 = 1;
/// `ACL_RT_MEM_ALLOC_GRANULARITY_MINIMUM`.
pub const GRANULARITY_MINIMUM: u32 = 0;
/// `ACL_RT_MEM_ALLOC_GRANULARITY_RECOMMENDED`.
pub const GRANULARITY_RECOMMENDED: u32 = 1;
/// `ACL_RT_VMM_EXPORT_FLAG_DEFAULT`: importers must be on the whitelist.
pub const EXPORT_FLAG_DEFAULT: u64 = 0;
/// `ACL_RT_VMM_EXPORT_FLAG_DISABLE_PID_VALIDATION`: any process may import.
pub const EXPORT_FLAG_DISABLE_PID_VALIDATION: u64 = 1;

/// A physical memory allocation (`aclrtDrvMemHandle`), local or imported.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PhysicalHandle(pub usize);

/// `aclrtPhysicalMemProp`, flattened.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PhysicalMemProp {
    /// `aclrtMemHandleType`.
    pub handle_type: u32,
    /// `aclrtMemAllocationType`.
    pub allocation_type: u32,
    /// `aclrtMemAttr`.
    pub mem_attr: u32,
    /// Device id of `aclrtMemLocation`.
    pub location_id: u32,
    /// `aclrtMemLocationType`.
    pub location_type: u32,
}

impl PhysicalMemProp {
    /// Pinned huge-page memory on `device`, handle type NONE: what `aclrtMallocPhysical` requires.
    pub const fn device(device: u32) -> Self {
        Self {
            handle_type: HANDLE_TYPE_NONE,
            allocation_type: ALLOCATION_TYPE_PINNED,
            mem_attr: MEM_ATTR_HBM_HUGE,
            location_id: device,
            location_type: LOCATION_TYPE_DEVICE,
        }
    }
}

/// A runtime with virtual memory management and shareable physical memory.
///
/// Errors are [`Error::Runtime`] naming the AscendCL call, as for every [`BlockSource`]
/// method, or [`Error::NotSupported`] when the runtime lacks the call.
pub trait VmmRuntime: BlockSource {
    /// Granularity of physical memory on `device` (`aclrtMemGetAllocationGranularity`):
    /// the minimum, or the recommended one when `recommended`.
    fn allocation_granularity(&self, device: DeviceId, recommended: bool) -> Result<u64>;
    /// Reserves `size` bytes of addresses for huge-page memory, aligned as the runtime
    /// chooses (`aclrtReserveMemAddress` takes no alignment but 0).
    fn reserve_address(&self, device: DeviceId, size: u64) -> Result<usize>;
    /// Releases a reservation; nothing may be mapped in it any more.
    fn release_address(&self, va: usize) -> Result<()>;
    /// Allocates `size` bytes of physical memory on `device`, counted against its capacity.
    fn malloc_physical(&self, device: DeviceId, size: u64) -> Result<PhysicalHandle>;
    /// Frees physical memory (local or imported); it must be unmapped first.
    fn free_physical(&self, handle: PhysicalHandle) -> Result<()>;
    /// Maps `size` bytes of `handle` from `offset` at `va`, inside a reservation. The
    /// runtime takes offset 0 and the whole physical allocation only.
    fn map(&self, va: usize, size: u64, offset: u64, handle: PhysicalHandle) -> Result<()>;
    /// Unmaps the mapping that starts at `va`.
    fn unmap(&self, va: usize) -> Result<()>;
    /// Exports `handle` for other processes (`aclrtMemExportToShareableHandle`); `flags` is
    /// [`EXPORT_FLAG_DEFAULT`] or [`EXPORT_FLAG_DISABLE_PID_VALIDATION`]. Once per handle.
    fn export_shareable(&self, handle: PhysicalHandle, flags: u64) -> Result<u64>;
    /// Imports a shareable handle another process exported (`aclrtMemImportFromShareableHandle`).
    fn import_shareable(&self, shareable: u64, device: DeviceId) -> Result<PhysicalHandle>;
    /// Adds processes (ids from [`VmmRuntime::bare_tgid`]) to the whitelist of an exported handle.
    fn set_shareable_pids(&self, shareable: u64, pids: &[i32]) -> Result<()>;
    /// This process's id as the device knows it (`aclrtDeviceGetBareTgid`).
    fn bare_tgid(&self) -> Result<i32>;
}

/// How a [`VmmSource`] is laid out.
///
/// ```
/// use ascend_pool::source::vmm::VmmConfig;
/// let c = VmmConfig::default().with_reserve(8 << 30).with_granule(2 << 20);
/// assert_eq!(c.reserve, 8 << 30);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct VmmConfig {
    /// Bytes of device addresses reserved once; 0 (default) reserves 4x the device's memory.
    pub reserve: u64,
    /// Bytes per mapped granule, a power-of-two multiple of the runtime's minimum
    /// granularity; 0 (default) uses the recommended granularity.
    pub granule: u64,
}

impl VmmConfig {
    /// Sets the bytes of addresses reserved.
    pub fn with_reserve(mut self, bytes: u64) -> Self {
        self.reserve = bytes;
        self
    }

    /// Sets the granule size.
    pub fn with_granule(mut self, bytes: u64) -> Self {
        self.granule = bytes;
        self
    }
}

/// One physical allocation mapped whole into the reservation.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Extent {
    /// Bytes, a multiple of the granule.
    pub(crate) len: u64,
    pub(crate) handle: PhysicalHandle,
    /// The shareable handle once exported, and its export flags: a handle is exported at
    /// most once, so whether importers are checked against a whitelist never changes after.
    pub(crate) shareable: Option<(u64, u64)>,
}

/// A device block handed out.
#[derive(Debug, Clone, Copy)]
struct VirtualBlock {
    kind: MemKind,
    /// Bytes as handed out (what the pool asked for, after growth and shrinking).
    size: u64,
    /// Bytes mapped from the block start: the extents `addr..addr + mapped` cover it exactly.
    mapped: u64,
}

/// What the source holds.
///
/// Invariants: blocks do not overlap and lie inside the reservation; the extents inside
/// `addr..addr + mapped` of a block tile that range exactly, and no extent lies outside a
/// block; `mapped == align_up(size, granule)`: a shrink keeps as the block's size what
/// stays mapped, up to the old size (an extent straddling the new end, or extents past it
/// that it could not map back), a refused free that lost its tail maps new memory under
/// it, and retires the block when that fails too (its size cut to what it maps); `orphans`
/// hold unmapped physical memory whose free failed.
#[derive(Debug, Default)]
struct VmmState {
    blocks: BTreeMap<usize, VirtualBlock>,
    extents: BTreeMap<usize, Extent>,
    orphans: Vec<PhysicalHandle>,
    /// Blocks freed that the runtime would neither unmap nor map whole again (a free that
    /// lost its tail, refused again, and refused new memory under the tail), by address.
    /// Each stays in `blocks`, so no block is placed over what it still maps, with `size`
    /// cut to `mapped`: no holder's bytes are in it. It is never handed out again (`known`
    /// refuses it as freed), and its release is retried on the next call and at the drop.
    retired: Vec<usize>,
    /// Sum of extent lengths.
    mapped_bytes: u64,
}

/// Counters of a [`VmmSource`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct VmmStats {
    /// Device blocks live.
    pub blocks: u64,
    /// Physical allocations mapped.
    pub extents: u64,
    /// Bytes of physical memory mapped.
    pub mapped_bytes: u64,
    /// Physical allocations unmapped whose free failed, retried on the next call.
    pub orphans: u64,
    /// Blocks freed that the runtime would neither unmap nor map whole again: never handed
    /// out again, their release retried on the next call and at the source's drop.
    pub retired: u64,
}

/// A [`BlockSource`] that maps physical memory into one reservation (see the module docs).
///
/// ```
/// use ascend_pool::source::sim::{SimConfig, SimSource};
/// use ascend_pool::source::vmm::{VmmConfig, VmmSource};
/// use ascend_pool::source::BlockSource;
/// use ascend_pool::MemKind;
/// use std::sync::Arc;
///
/// let sim = Arc::new(SimSource::new(SimConfig::default().with_device_capacity(64 << 20))?);
/// let vmm = VmmSource::new(sim, 0, VmmConfig::default())?;
/// let a = vmm.alloc_block(0, MemKind::DEVICE, 3 << 20)?; // two 2 MiB granules
/// // The addresses after `a` are free, so it grows where it is.
/// let a = vmm.extend_block(a, 4 << 20)?.expect("room after the block");
/// assert_eq!(a.size, 7 << 20);
/// let a = vmm.shrink_block(a, 1 << 20)?; // gives back the extent mapped by the growth
/// assert_eq!(vmm.stats().mapped_bytes, 4 << 20);
/// vmm.free_block(a)?;
/// assert_eq!(vmm.stats().mapped_bytes, 0);
/// # Ok::<(), ascend_pool::Error>(())
/// ```
pub struct VmmSource<R: VmmRuntime> {
    runtime: Arc<R>,
    device: DeviceId,
    name: String,
    /// Start of the reservation.
    base: usize,
    /// Bytes reserved, a multiple of `granule`.
    reserved: u64,
    /// Bytes per mapping, a multiple of the runtime's minimum granularity.
    granule: u64,
    state: Mutex<VmmState>,
    /// The fork generation the reservation was made in: in a child made by `fork` the
    /// source is its parent's, refuses every call before taking `state` (which a parent
    /// thread may have held at the fork), and releases nothing on drop ([`crate::fork`]).
    forks: u64,
}

impl<R: VmmRuntime> std::fmt::Debug for VmmSource<R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VmmSource")
            .field("name", &self.name)
            .field("base", &format_args!("{:#x}", self.base))
            .field("reserved", &self.reserved)
            .field("granule", &self.granule)
            .field("stats", &self.stats())
            .finish()
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // State is updated only after the runtime calls that can fail have succeeded.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn runtime_error(func: &'static str, code: AclError) -> Error {
    Error::Runtime { func, code }
}

/// Whether blocks of `kind` come from the reservation (device memory) or from the runtime.
pub fn is_virtual(kind: MemKind) -> bool {
    matches!(
        kind,
        MemKind::Device(_) | MemKind::DeviceAlign32(_) | MemKind::Cached(_)
    )
}

impl<R: VmmRuntime> VmmSource<R> {
    /// Reserves the address range on `device` (see [`VmmConfig`]).
    ///
    /// Fails with [`Error::Config`] for a granule that is not a power-of-two multiple of the
    /// runtime's minimum granularity or a device the runtime says it lacks
    /// ([`BlockSource::device_count`]), or with the runtime's error.
    pub fn new(runtime: Arc<R>, device: DeviceId, config: VmmConfig) -> Result<Self> {
        super::has_device(&*runtime, device)?;
        let minimum = runtime.allocation_granularity(device, false)?;
        let granule = match config.granule {
            0 => runtime.allocation_granularity(device, true)?,
            g => g,
        };
        // Addresses and sizes are rounded to the granule by masking: a power of two only.
        if minimum == 0 || !granule.is_power_of_two() || granule % minimum != 0 {
            return Err(Error::Config(format!(
                "granule {granule} is not a power-of-two multiple of the runtime's granularity {minimum}"
            )));
        }
        let reserve = match config.reserve {
            0 => runtime
                .mem_info(device, MemKind::DEVICE)?
                .1
                .saturating_mul(4),
            r => r,
        };
        let reserved = align_up(reserve.max(granule), granule)
            .ok_or_else(|| Error::Config(format!("cannot reserve {reserve} bytes")))?;
        let base = runtime.reserve_address(device, reserved)?;
        let name = format!("vmm:{}", runtime.name());
        Ok(Self {
            runtime,
            device,
            name,
            base,
            reserved,
            granule,
            state: Mutex::new(VmmState::default()),
            forks: crate::fork::generation(),
        })
    }

    /// The block and extent maps; refused in a child made by `fork`.
    fn state(&self) -> Result<MutexGuard<'_, VmmState>> {
        crate::fork::check(self.forks)?;
        Ok(lock(&self.state))
    }

    /// The runtime underneath.
    pub fn runtime(&self) -> &Arc<R> {
        &self.runtime
    }

    /// The device whose memory this source maps.
    pub fn device(&self) -> DeviceId {
        self.device
    }

    /// Bytes per mapped granule.
    pub fn granule(&self) -> u64 {
        self.granule
    }

    /// The reservation: start address and bytes.
    pub fn reservation(&self) -> (usize, u64) {
        (self.base, self.reserved)
    }

    /// Current counters.
    pub fn stats(&self) -> VmmStats {
        let Ok(s) = self.state() else {
            return VmmStats::default();
        };
        VmmStats {
            blocks: (s.blocks.len() - s.retired.len()) as u64,
            extents: s.extents.len() as u64,
            mapped_bytes: s.mapped_bytes,
            orphans: s.orphans.len() as u64,
            retired: s.retired.len() as u64,
        }
    }

    /// Checks the invariants of the block and extent maps.
    pub fn validate(&self) -> Result<()> {
        let s = self.state()?;
        let bad = |m: String| Err(Error::Invalid(format!("{}: {m}", self.name)));
        let mut end = self.base;
        let mut covered = 0u64;
        for (&addr, b) in &s.blocks {
            if addr < end || addr + b.mapped as usize > self.base + self.reserved as usize {
                return bad(format!(
                    "block {addr:#x} overlaps or leaves the reservation"
                ));
            }
            if Some(b.mapped) != align_up(b.size, self.granule) {
                return bad(format!(
                    "block {addr:#x}: size {} mapped {}",
                    b.size, b.mapped
                ));
            }
            let mut at = addr;
            for (&va, e) in s.extents.range(addr..addr + b.mapped as usize) {
                if va != at {
                    return bad(format!(
                        "block {addr:#x}: extent {va:#x} does not follow {at:#x}"
                    ));
                }
                at += e.len as usize;
            }
            if at != addr + b.mapped as usize {
                return bad(format!("block {addr:#x}: extents end at {at:#x}"));
            }
            covered += b.mapped;
            end = at;
        }
        for (i, addr) in s.retired.iter().enumerate() {
            if !s.blocks.contains_key(addr) || s.retired[..i].contains(addr) {
                return bad(format!("retired block {addr:#x} is not one block"));
            }
        }
        let total: u64 = s.extents.values().map(|e| e.len).sum();
        if total != covered || total != s.mapped_bytes {
            return bad(format!(
                "{total} bytes of extents, {covered} in blocks, {} counted",
                s.mapped_bytes
            ));
        }
        Ok(())
    }

    /// Where a block of `len` bytes of addresses goes, if anywhere: in the largest free
    /// range that holds it. A range right after a block is split in the middle, so the block
    /// before it and the new one can both grow in place (pools of several kinds grow side
    /// by side); the start of the reservation is taken as it is.
    fn find_gap(&self, s: &VmmState, len: u64) -> Option<usize> {
        let end = self.base + self.reserved as usize;
        let mut cursor = self.base;
        let mut best: Option<(usize, u64)> = None;
        let mut consider = |start: usize, stop: usize| {
            let room = (stop - start) as u64;
            if room >= len && best.is_none_or(|(_, r)| room > r) {
                best = Some((start, room));
            }
        };
        for (&addr, b) in &s.blocks {
            consider(cursor, addr);
            cursor = addr + b.mapped as usize;
        }
        consider(cursor, end);
        let (start, room) = best?;
        if start == self.base {
            return Some(start);
        }
        let slack = (room - len) / 2 / self.granule * self.granule;
        Some(start + slack as usize)
    }

    /// Allocates `len` bytes of physical memory and maps all of it at `va` in one call.
    /// On failure the physical memory is freed again and the error returned.
    fn map_extent(&self, s: &mut VmmState, va: usize, len: u64) -> Result<()> {
        self.retry_releases(s);
        let handle = self.runtime.malloc_physical(self.device, len)?;
        // One call: `aclrtMapMem` takes offset 0 and the whole allocation, so a failed map
        // leaves nothing mapped to undo.
        if let Err(e) = self.runtime.map(va, len, 0, handle) {
            if self.runtime.free_physical(handle).is_err() {
                s.orphans.push(handle);
            }
            return Err(e);
        }
        s.extents.insert(
            va,
            Extent {
                len,
                handle,
                shareable: None,
            },
        );
        s.mapped_bytes += len;
        Ok(())
    }

    /// Releases every extent at or after `from` inside the block at `addr`, which is then
    /// mapped up to `from`: all extents are unmapped first, the last first (mapped again if
    /// one unmap fails, and the error returned), then the physical memory is freed; a free
    /// that fails leaves the handle for a later retry. A map back that fails leaves that extent and those after it unmapped:
    /// they are released all the same and the block is mapped up to them only, so the table
    /// never names a mapping the runtime no longer has (the last-first order keeps what
    /// stays unmapped a tail of the block).
    fn release_from(&self, s: &mut VmmState, addr: usize, from: usize) -> Result<()> {
        let end = addr + s.blocks[&addr].mapped as usize;
        let doomed: Vec<(usize, Extent)> = s
            .extents
            .range(from..end)
            .map(|(&va, &e)| (va, e))
            .collect();
        for (i, &(va, _)) in doomed.iter().enumerate().rev() {
            if let Err(err) = self.runtime.unmap(va) {
                let lost = doomed[i + 1..]
                    .iter()
                    .position(|&(at, e)| self.runtime.map(at, e.len, 0, e.handle).is_err());
                if let Some(k) = lost {
                    let cut = &doomed[i + 1 + k..];
                    self.forget(s, cut);
                    s.blocks.get_mut(&addr).expect("the caller's block").mapped =
                        (cut[0].0 - addr) as u64;
                }
                return Err(err);
            }
        }
        self.forget(s, &doomed);
        s.blocks.get_mut(&addr).expect("the caller's block").mapped = (from - addr) as u64;
        Ok(())
    }

    /// Drops unmapped extents from the table and frees their physical memory.
    fn forget(&self, s: &mut VmmState, extents: &[(usize, Extent)]) {
        for &(va, e) in extents {
            s.extents.remove(&va);
            s.mapped_bytes -= e.len;
            if self.runtime.free_physical(e.handle).is_err() {
                s.orphans.push(e.handle);
            }
        }
    }

    /// Tries again to release the retired blocks, then to free the orphans.
    fn retry_releases(&self, s: &mut VmmState) {
        for addr in std::mem::take(&mut s.retired) {
            if self.release_from(s, addr, addr).is_ok() {
                s.blocks.remove(&addr);
                continue;
            }
            // Refused again, perhaps losing more of its tail: it holds what is still mapped.
            let b = s
                .blocks
                .get_mut(&addr)
                .expect("retired blocks stay in the table");
            b.size = b.mapped;
            s.retired.push(addr);
        }
        s.orphans
            .retain(|&h| self.runtime.free_physical(h).is_err());
    }

    /// The block at `block.addr`, checked against what was handed out.
    fn known(&self, s: &VmmState, func: &'static str, block: Block) -> Result<VirtualBlock> {
        let b = *s
            .blocks
            .get(&block.addr)
            .filter(|_| !s.retired.contains(&block.addr))
            .ok_or(runtime_error(func, AclError::RT_MEMORY_FREE))?;
        if b.kind != block.kind || b.size != block.size || block.device != self.device {
            return Err(runtime_error(func, AclError::INVALID_PARAM));
        }
        Ok(b)
    }

    /// Exports the extents overlapping `addr..addr + len` (every extent of a live block when
    /// `None`; a range over a retired block is refused with [`Error::ForeignHandle`]) and
    /// returns them as (address, bytes, shareable handle). An extent already exported keeps
    /// its handle (a handle is exported once per process); one exported with other `flags`
    /// is refused with [`Error::ShareAccessFixed`], before anything new is exported. So is a
    /// range the extents do not cover without a gap ([`Error::ForeignHandle`]): a refused
    /// publish must leave nothing exported, since an export cannot be taken back.
    pub(crate) fn export_extents(
        &self,
        range: Option<(usize, u64)>,
        flags: u64,
    ) -> Result<Vec<(usize, u64, u64)>> {
        let mut s = self.state()?;
        let (lo, hi) = match range {
            Some((addr, len)) => {
                let end = usize::try_from(len)
                    .ok()
                    .and_then(|l| addr.checked_add(l))
                    .ok_or(Error::ForeignHandle)?;
                (addr, end)
            }
            None => (self.base, self.base + self.reserved as usize),
        };
        // A retired block's memory is no holder's: never published.
        let retired: Vec<(usize, usize)> = s
            .retired
            .iter()
            .map(|&addr| (addr, addr + s.blocks[&addr].mapped as usize))
            .collect();
        let is_retired = |va: usize| retired.iter().any(|&(lo, hi)| (lo..hi).contains(&va));
        let mut overlapping: Vec<usize> = s
            .extents
            .range(..hi)
            .filter(|(&va, e)| va + e.len as usize > lo)
            .map(|(&va, _)| va)
            .collect();
        if range.is_some() && overlapping.iter().any(|&va| is_retired(va)) {
            return Err(Error::ForeignHandle);
        }
        overlapping.retain(|&va| !is_retired(va));
        if range.is_some() {
            // The extents, by address, must cover `lo..hi` without a gap.
            let mut at = lo;
            for va in &overlapping {
                if *va > at {
                    break;
                }
                at = at.max(va + s.extents[va].len as usize);
            }
            if overlapping.is_empty() || at < hi {
                return Err(Error::ForeignHandle);
            }
        }
        for va in &overlapping {
            if let Some((handle, was)) = s.extents[va].shareable {
                if was != flags {
                    return Err(Error::ShareAccessFixed {
                        handle,
                        any_process: was & EXPORT_FLAG_DISABLE_PID_VALIDATION != 0,
                    });
                }
            }
        }
        let mut out = Vec::with_capacity(overlapping.len());
        for va in overlapping {
            let e = s.extents.get_mut(&va).expect("listed above");
            let shareable = match e.shareable {
                Some((h, _)) => h,
                None => {
                    let h = self.runtime.export_shareable(e.handle, flags)?;
                    e.shareable = Some((h, flags));
                    h
                }
            };
            out.push((va, e.len, shareable));
        }
        Ok(out)
    }
}

impl<R: VmmRuntime> Drop for VmmSource<R> {
    fn drop(&mut self) {
        if !crate::fork::ours(self.forks) {
            return;
        }
        let s = self.state.get_mut().unwrap_or_else(|p| p.into_inner());
        for (va, e) in std::mem::take(&mut s.extents) {
            let _ = self.runtime.unmap(va);
            let _ = self.runtime.free_physical(e.handle);
        }
        for h in std::mem::take(&mut s.orphans) {
            let _ = self.runtime.free_physical(h);
        }
        if let Err(e) = self.runtime.release_address(self.base) {
            eprintln!(
                "ascend-pool: {}: releasing the reservation failed: {e}",
                self.name
            );
        }
    }
}

impl<R: VmmRuntime + 'static> BlockSource for VmmSource<R> {
    fn name(&self) -> &str {
        &self.name
    }

    fn alloc_block(&self, device: DeviceId, kind: MemKind, size: u64) -> Result<Block> {
        if !is_virtual(kind) {
            return self.runtime.alloc_block(device, kind, size);
        }
        if device != self.device {
            return Err(runtime_error("aclrtMapMem", AclError::RT_PARAM_INVALID));
        }
        if size == 0 {
            return Err(runtime_error(
                "aclrtMallocPhysical",
                AclError::INVALID_PARAM,
            ));
        }
        let mapped = align_up(size, self.granule).ok_or(runtime_error(
            "aclrtMallocPhysical",
            AclError::RT_MEMORY_ALLOCATION,
        ))?;
        let mut s = self.state()?;
        let va = self.find_gap(&s, mapped).ok_or(runtime_error(
            "aclrtReserveMemAddress",
            AclError::RT_MEMORY_ALLOCATION,
        ))?;
        self.map_extent(&mut s, va, mapped)?;
        s.blocks.insert(va, VirtualBlock { kind, size, mapped });
        Ok(Block {
            addr: va,
            size,
            kind,
            device,
        })
    }

    /// Unmaps the block and frees its memory. A refused unmap leaves the block with the
    /// caller, mapped whole (an error), except when the runtime also refuses to map new
    /// memory under a tail it lost: the block, short of its size, is retired
    /// ([`VmmStats::retired`]). No caller may use it again, so the free counts as done
    /// (`Ok`); the source keeps what is still mapped there and releases it on a later call
    /// or at its drop.
    fn free_block(&self, block: Block) -> Result<()> {
        if !is_virtual(block.kind) {
            return self.runtime.free_block(block);
        }
        let mut s = self.state()?;
        let b = self.known(&s, "aclrtUnmapMem", block)?;
        // A pool that no longer grows frees (trims) still: retired blocks get their retry.
        self.retry_releases(&mut s);
        if let Err(e) = self.release_from(&mut s, block.addr, block.addr) {
            // A tail that could not be mapped back leaves the block short of its size: the
            // free goes on with what is still mapped.
            if s.blocks[&block.addr].mapped == b.mapped {
                return Err(e);
            }
            if let Err(e) = self.release_from(&mut s, block.addr, block.addr) {
                // Refused again, the block stays with the caller, who may use it again (a
                // pool keeps a chunk it could not free): new memory under the lost tail
                // makes it whole; its bytes are of no use, the block was being freed.
                let mapped = s.blocks[&block.addr].mapped;
                let tail = block.addr + mapped as usize;
                if self.map_extent(&mut s, tail, b.mapped - mapped).is_ok() {
                    s.blocks.get_mut(&block.addr).expect("kept above").mapped = b.mapped;
                    return Err(e);
                }
                // Short for good, so no holder may carve it again: the source keeps it.
                let entry = s.blocks.get_mut(&block.addr).expect("kept above");
                entry.size = entry.mapped;
                s.retired.push(block.addr);
                return Ok(());
            }
        }
        s.blocks.remove(&block.addr);
        Ok(())
    }

    fn extend_block(&self, block: Block, additional: u64) -> Result<Option<Block>> {
        if !is_virtual(block.kind) {
            return Ok(None);
        }
        let mut s = self.state()?;
        let b = self.known(&s, "aclrtMapMem", block)?;
        let Some(size) = b.size.checked_add(additional) else {
            return Ok(None);
        };
        let Some(mapped) = align_up(size, self.granule) else {
            return Ok(None);
        };
        if mapped > b.mapped {
            let from = block.addr + b.mapped as usize;
            let limit = s
                .blocks
                .range(block.addr + 1..)
                .next()
                .map_or(self.base + self.reserved as usize, |(&next, _)| next);
            if limit < from || ((limit - from) as u64) < mapped - b.mapped {
                return Ok(None);
            }
            self.map_extent(&mut s, from, mapped - b.mapped)?;
        }
        let entry = s.blocks.get_mut(&block.addr).expect("checked above");
        entry.size = size;
        entry.mapped = entry.mapped.max(mapped);
        Ok(Some(Block { size, ..block }))
    }

    fn shrink_block(&self, block: Block, new_size: u64) -> Result<Block> {
        if !is_virtual(block.kind) {
            return Ok(block);
        }
        let mut s = self.state()?;
        // A block of another source, freed, or of a parent process is refused even when
        // nothing would be cut.
        let b = self.known(&s, "aclrtUnmapMem", block)?;
        if new_size >= block.size {
            return Ok(block);
        }
        if new_size == 0 {
            // A block of 0 bytes is nothing `alloc_block` hands out: freeing is the way.
            return Err(runtime_error("aclrtUnmapMem", AclError::INVALID_PARAM));
        }
        // Keep every extent that starts before the new end (one may straddle it).
        let keep_to = align_up(new_size, self.granule).unwrap_or(b.mapped);
        let cut = block.addr + keep_to as usize;
        let from = s
            .extents
            .range(block.addr..cut)
            .next_back()
            .map_or(block.addr, |(&va, e)| va + e.len as usize);
        if from < block.addr + b.mapped as usize {
            if let Err(e) = self.release_from(&mut s, block.addr, from) {
                // A tail that could not be mapped back is released all the same: the block
                // keeps more than asked past the new end, and the shrink stands.
                if s.blocks[&block.addr].mapped == b.mapped {
                    return Err(e);
                }
            }
        }
        let entry = s.blocks.get_mut(&block.addr).expect("checked above");
        // What stays mapped stays the holder's to use and to count: an extent straddling
        // the new end, or a tail the runtime would not unmap (the pool counted only the
        // bytes it asked to keep, less than the source maps).
        entry.size = new_size.max(entry.mapped.min(block.size));
        Ok(Block {
            size: entry.size,
            ..block
        })
    }

    fn mem_info(&self, device: DeviceId, kind: MemKind) -> Result<(u64, u64)> {
        self.runtime.mem_info(device, kind)
    }

    fn create_stream(&self, device: DeviceId) -> Result<StreamHandle> {
        self.runtime.create_stream(device)
    }

    fn destroy_stream(&self, stream: StreamHandle) -> Result<()> {
        self.runtime.destroy_stream(stream)
    }

    fn synchronize_stream(&self, stream: StreamHandle) -> Result<()> {
        self.runtime.synchronize_stream(stream)
    }

    fn create_event(&self, device: DeviceId) -> Result<EventHandle> {
        self.runtime.create_event(device)
    }

    fn destroy_event(&self, event: EventHandle) -> Result<()> {
        self.runtime.destroy_event(event)
    }

    fn record_event(&self, event: EventHandle, stream: StreamHandle) -> Result<()> {
        self.runtime.record_event(event, stream)
    }

    fn query_event(&self, event: EventHandle) -> Result<bool> {
        self.runtime.query_event(event)
    }

    fn synchronize_event(&self, event: EventHandle) -> Result<()> {
        self.runtime.synchronize_event(event)
    }

    fn stream_wait_event(&self, stream: StreamHandle, event: EventHandle) -> Result<()> {
        self.runtime.stream_wait_event(stream, event)
    }

    unsafe fn memcpy(
        &self,
        dst: usize,
        dst_max: u64,
        src: usize,
        count: u64,
        kind: MemcpyKind,
    ) -> Result<()> {
        // SAFETY: the caller upholds the contract, which is the runtime's.
        unsafe { self.runtime.memcpy(dst, dst_max, src, count, kind) }
    }

    unsafe fn memcpy_async(
        &self,
        dst: usize,
        dst_max: u64,
        src: usize,
        count: u64,
        kind: MemcpyKind,
        stream: StreamHandle,
    ) -> Result<()> {
        // SAFETY: the caller upholds the contract, which is the runtime's.
        unsafe {
            self.runtime
                .memcpy_async(dst, dst_max, src, count, kind, stream)
        }
    }

    unsafe fn memset(&self, dst: usize, max: u64, value: u8, count: u64) -> Result<()> {
        // SAFETY: the caller upholds the contract, which is the runtime's.
        unsafe { self.runtime.memset(dst, max, value, count) }
    }

    unsafe fn memset_async(
        &self,
        dst: usize,
        max: u64,
        value: u8,
        count: u64,
        stream: StreamHandle,
    ) -> Result<()> {
        // SAFETY: the caller upholds the contract, which is the runtime's.
        unsafe { self.runtime.memset_async(dst, max, value, count, stream) }
    }

    fn acquire_comm_thread(&self, stream: StreamHandle) -> Result<CommThreadHandle> {
        self.runtime.acquire_comm_thread(stream)
    }

    unsafe fn register_window(&self, device: DeviceId, addr: usize, len: u64) -> Result<()> {
        // SAFETY: the caller upholds the contract, which is the runtime's: mapped ranges are
        // the runtime's own memory.
        unsafe { self.runtime.register_window(device, addr, len) }
    }

    fn deregister_window(&self, addr: usize) -> Result<()> {
        self.runtime.deregister_window(addr)
    }

    fn simulator_id(&self) -> Option<u64> {
        self.runtime.simulator_id()
    }

    fn only_device(&self) -> Option<DeviceId> {
        Some(self.device)
    }

    unsafe fn write_on_thread(
        &self,
        thread: CommThreadHandle,
        channel: ChannelHandle,
        dst: usize,
        src: usize,
        len: u64,
    ) -> Result<()> {
        // SAFETY: the caller upholds the contract, which is the runtime's: mapped ranges are
        // the runtime's own memory.
        unsafe { self.runtime.write_on_thread(thread, channel, dst, src, len) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::source::sim::{SimConfig, SimSource};

    const MIB: u64 = 1 << 20;
    const G: u64 = 2 * MIB;

    fn source(reserve: u64) -> VmmSource<SimSource> {
        let config = SimConfig::default().with_device_capacity(64 * MIB);
        let sim = Arc::new(SimSource::new(config).unwrap());
        VmmSource::new(sim, 0, VmmConfig::default().with_reserve(reserve)).unwrap()
    }

    /// Runs `corrupt` on the state of a source holding a grown block (two extents) and a
    /// second block, and returns what `validate` says; the state is put back after, so the
    /// source is dropped whole.
    fn validate_after(corrupt: impl FnOnce(&mut VmmState, (usize, u64))) -> String {
        let vmm = source(0);
        let a = vmm.alloc_block(0, MemKind::DEVICE, 3 * MIB).unwrap();
        vmm.extend_block(a, 5 * MIB).unwrap().unwrap();
        vmm.alloc_block(0, MemKind::DEVICE, G).unwrap();
        vmm.validate().unwrap();
        let saved = {
            let mut s = lock(&vmm.state);
            let saved = (s.blocks.clone(), s.extents.clone(), s.mapped_bytes);
            corrupt(&mut s, vmm.reservation());
            saved
        };
        let verdict = vmm.validate();
        let mut s = lock(&vmm.state);
        (s.blocks, s.extents, s.mapped_bytes) = saved;
        drop(s);
        vmm.validate().unwrap();
        match verdict {
            Err(Error::Invalid(m)) => m,
            other => panic!("validate passed a corrupted source: {other:?}"),
        }
    }

    fn first_block(s: &VmmState) -> (usize, VirtualBlock) {
        s.blocks.iter().next().map(|(&a, &b)| (a, b)).unwrap()
    }

    #[test]
    #[cfg_attr(miri, ignore = "reserves addresses with PROT_NONE, which Miri refuses")]
    fn validate_reports_a_block_overlapping_the_one_before() {
        let m = validate_after(|s, _| {
            let (addr, _) = first_block(s);
            let b = VirtualBlock {
                kind: MemKind::DEVICE,
                size: G,
                mapped: G,
            };
            s.blocks.insert(addr + G as usize, b);
        });
        assert!(m.contains("overlaps or leaves the reservation"), "{m}");
    }

    #[test]
    #[cfg_attr(miri, ignore = "reserves addresses with PROT_NONE, which Miri refuses")]
    fn validate_reports_a_block_past_the_reservation() {
        let m = validate_after(|s, (base, reserved)| {
            let b = VirtualBlock {
                kind: MemKind::DEVICE,
                size: 2 * G,
                mapped: 2 * G,
            };
            s.blocks.insert(base + (reserved - G) as usize, b);
        });
        assert!(m.contains("overlaps or leaves the reservation"), "{m}");
    }

    #[test]
    #[cfg_attr(miri, ignore = "reserves addresses with PROT_NONE, which Miri refuses")]
    fn validate_reports_a_block_larger_than_it_is_mapped() {
        let m = validate_after(|s, _| {
            let (addr, b) = first_block(s);
            s.blocks.get_mut(&addr).unwrap().size = b.mapped + 1;
        });
        assert!(m.contains("size"), "{m}");
    }

    #[test]
    #[cfg_attr(miri, ignore = "reserves addresses with PROT_NONE, which Miri refuses")]
    fn validate_reports_a_miscounted_mapping() {
        let m = validate_after(|s, _| s.mapped_bytes += G);
        assert!(m.contains("counted"), "{m}");
    }

    #[test]
    #[cfg_attr(miri, ignore = "reserves addresses with PROT_NONE, which Miri refuses")]
    fn validate_reports_an_extent_outside_every_block() {
        let m = validate_after(|s, (base, reserved)| {
            let (_, e) = s.extents.iter().next().map(|(&a, &e)| (a, e)).unwrap();
            // Counted, but in no block.
            s.extents
                .insert(base + (reserved - G) as usize, Extent { len: G, ..e });
            s.mapped_bytes += G;
        });
        assert!(m.contains("bytes of extents"), "{m}");
    }

    /// Blocks that fill the reservation to its last byte are valid.
    #[test]
    #[cfg_attr(miri, ignore = "reserves addresses with PROT_NONE, which Miri refuses")]
    fn blocks_up_to_the_end_of_the_reservation_are_valid() {
        let vmm = source(8 * MIB);
        let (base, _) = vmm.reservation();
        let a = vmm.alloc_block(0, MemKind::DEVICE, 4 * MIB).unwrap();
        let b = vmm.alloc_block(0, MemKind::DEVICE, 4 * MIB).unwrap();
        assert_eq!(b.addr + b.size as usize, base + 8 * MIB as usize);
        vmm.validate().unwrap();
        let debug = format!("{vmm:?}");
        assert!(
            debug.starts_with("VmmSource") && debug.contains("blocks: 2"),
            "{debug}"
        );
        vmm.free_block(a).unwrap();
        vmm.free_block(b).unwrap();
    }
}
