//! Virtual memory management on the host, done for real.
//!
//! - `aclrtReserveMemAddress` reserves address space: an inaccessible (`PROT_NONE`)
//!   mapping that costs no memory and that no other mapping can land in. Its alignment
//!   argument must be 0: a range is aligned to the granularity, or to 1 GiB from 1 GiB up.
//!   Its flags say whether huge (1) or normal (0) pages will be mapped into it.
//! - `aclrtMallocPhysical` creates a shareable memory object (a memfd) of the size rounded
//!   up to the granularity of its memory attribute (1 GiB for the `HUGE1G` ones), charged
//!   against the device's capacity like `aclrtMalloc`.
//! - `aclrtMapMem` maps a whole object, from offset 0, over reserved addresses of its page
//!   type (`MAP_SHARED | MAP_FIXED`); the mapping is device memory for copies and fills, and
//!   mappings that follow each other without a gap form one range, so a copy may cross them.
//! - `aclrtUnmapMem` waits until the copies and fills queued on the mapping have run, then
//!   puts the reservation back over it; `aclrtFreePhysical` refuses memory still mapped.
//! - Export, import and the whitelist are in `share.rs`: physical memory exported to other
//!   processes stays charged to this device until every importer has freed it.
//!
//! # Error codes
//!
//! | situation | code |
//! |---|---|
//! | null or zero argument, flags other than documented, a reservation's alignment other than 0, a property other than pinned device memory with handle type NONE or with a memory attribute outside `aclrtMemAttr`, an option other than MINIMUM/RECOMMENDED, an address or size not a multiple of the granularity, a mapping at an offset other than 0, of part of the physical memory, outside a reservation, over another mapping or into a reservation for the other page type, unmapping where no mapping starts, releasing a reservation that still has mappings or is unknown | `ACL_ERROR_INVALID_PARAM` (100000) |
//! | a device id out of range | `ACL_ERROR_RT_PARAM_INVALID` (107000) |
//! | physical memory past the device's capacity, or the host refuses the object or the reservation | `ACL_ERROR_RT_MEMORY_ALLOCATION` (207001) |
//! | an unknown or freed physical handle | `ACL_ERROR_RT_INVALID_HANDLE` (107017) |
//! | freeing physical memory that is still mapped | `ACL_ERROR_RT_MEMORY_FREE` (207002) |

use std::collections::{BTreeMap, HashMap};
use std::os::fd::OwnedFd;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use super::mapping::{self, Mapping};
use super::{lock, share, AclFunc, BlockRecord, SimSource};
use crate::align::align_up;
use crate::error::{AclError, Result};
use crate::kind::MemKind;
use crate::source::vmm::{
    PhysicalHandle, PhysicalMemProp, VmmRuntime, ALLOCATION_TYPE_PINNED, HANDLE_TYPE_NONE,
    LOCATION_TYPE_DEVICE, RESERVE_FLAG_HUGE_PAGE,
};
use crate::source::DeviceId;

/// Granularity of simulated physical memory: 2 MiB, the device's huge page.
pub const DEFAULT_GRANULARITY: u64 = 2 << 20;

/// Granularity of the `HUGE1G` memory attributes, and the alignment of reservations of at
/// least that size (where the runtime places a range it chooses).
pub const HUGE1G_GRANULARITY: u64 = 1 << 30;

/// The page type of memory: what a reservation's flags and a memory attribute name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Pages {
    Normal,
    Huge,
    /// `ACL_DDR_MEM` and `ACL_HBM_MEM` (huge and normal pages), and imported memory,
    /// whose attribute stays with the exporter: mapped into either kind of range.
    Either,
}

impl Pages {
    /// The page type and granularity (`base` or 1 GiB) of an `aclrtMemAttr`, `None` for a
    /// value outside the enum (0 to 17).
    fn of_attr(attr: u32, base: u64) -> Option<(Pages, u64)> {
        let huge1g = base.max(HUGE1G_GRANULARITY);
        Some(match attr {
            0 | 1 => (Pages::Either, base),
            3 | 5 | 7 | 9 | 12 | 15 => (Pages::Normal, base),
            2 | 4 | 6 | 8 | 13 | 16 => (Pages::Huge, base),
            10 | 11 | 14 | 17 => (Pages::Huge, huge1g),
            _ => return None,
        })
    }

    fn fits(self, range: Pages) -> bool {
        self == Pages::Either || range == Pages::Either || self == range
    }
}

/// One reserved range.
#[derive(Debug)]
struct Reservation {
    len: usize,
    /// The page type its flags named.
    pages: Pages,
    /// Mappings by start: (bytes, physical handle). They do not overlap and lie inside.
    mappings: BTreeMap<usize, (usize, usize)>,
}

/// Where physical memory came from.
#[derive(Debug)]
enum Origin {
    /// `aclrtMallocPhysical` here; the shareable handle once exported.
    Local { exported: Option<u64> },
    /// `aclrtMemImportFromShareableHandle`; the link tells the exporter while it is open
    /// that this process still holds the memory.
    Imported {
        /// Dropped first: the import table forgets the link's descriptor before it closes,
        /// so a fork in between never points a reused descriptor at /dev/null.
        _claim: share::ImportClaim,
        _link: std::os::unix::net::UnixStream,
    },
}

/// One physical allocation.
#[derive(Debug)]
struct Physical {
    fd: OwnedFd,
    /// Bytes, a multiple of `granularity`.
    size: u64,
    /// Of its memory attribute; where it may be mapped is a multiple of it.
    granularity: u64,
    pages: Pages,
    device: DeviceId,
    /// Live mappings of it.
    maps: u32,
    origin: Origin,
}

/// Reservations and physical memory of one simulator.
///
/// Invariants: local physical memory is charged to `device_used` of its device from
/// `aclrtMallocPhysical` until `aclrtFreePhysical`, or until the last importer lets go
/// when it was exported; imported memory is not charged; `maps` counts the mappings of a
/// handle over every reservation; every mapping has a `vmm` record in `MemState::blocks`.
#[derive(Debug, Default)]
pub(super) struct VmmState {
    reservations: BTreeMap<usize, Reservation>,
    physical: HashMap<usize, Physical>,
}

impl VmmState {
    /// Whether `addr..addr + count` (at least the byte at `addr`) touches a reservation.
    pub(super) fn overlaps_reservation(&self, addr: usize, count: u64) -> bool {
        let end = usize::try_from(count)
            .ok()
            .and_then(|n| addr.checked_add(n.max(1)))
            .unwrap_or(usize::MAX);
        self.reservations
            .range(..end)
            .next_back()
            .is_some_and(|(&start, r)| start.saturating_add(r.len) > addr)
    }

    /// (reservations, physical handles, mappings).
    pub(super) fn counts(&self) -> (u64, u64, u64) {
        let maps = self
            .reservations
            .values()
            .map(|r| r.mappings.len())
            .sum::<usize>();
        (
            self.reservations.len() as u64,
            self.physical.len() as u64,
            maps as u64,
        )
    }
}

/// Virtual memory management and sharing, with the AscendCL calls' arguments.
impl SimSource {
    fn granularity(&self) -> u64 {
        self.config.vmm_granularity
    }

    /// The device a physical memory property names, with the page type and granularity of
    /// its memory attribute, after checking what the runtime requires.
    fn prop_device(
        &self,
        prop: Option<&PhysicalMemProp>,
    ) -> Result<(DeviceId, Pages, u64), AclError> {
        let prop = prop.ok_or(AclError::INVALID_PARAM)?;
        if prop.handle_type != HANDLE_TYPE_NONE
            || prop.allocation_type != ALLOCATION_TYPE_PINNED
            || prop.location_type != LOCATION_TYPE_DEVICE
        {
            return Err(AclError::INVALID_PARAM);
        }
        let (pages, granularity) =
            Pages::of_attr(prop.mem_attr, self.granularity()).ok_or(AclError::INVALID_PARAM)?;
        let device =
            DeviceId::try_from(prop.location_id).map_err(|_| AclError::RT_PARAM_INVALID)?;
        if !self.valid_device(device) {
            return Err(AclError::RT_PARAM_INVALID);
        }
        Ok((device, pages, granularity))
    }

    /// `aclrtMemGetAllocationGranularity`: the granularity of the property's memory
    /// attribute (the configured one, 1 GiB for `HUGE1G`) for both options.
    pub fn mem_get_allocation_granularity(
        &self,
        prop: Option<&PhysicalMemProp>,
        option: u32,
    ) -> Result<u64> {
        self.call(AclFunc::MemGetAllocationGranularity, || {
            let (_, _, granularity) = self.prop_device(prop)?;
            if option > 1 {
                return Err(AclError::INVALID_PARAM);
            }
            Ok(granularity)
        })
    }

    /// `aclrtReserveMemAddress`: `size` bytes (a multiple of the granularity) for huge
    /// (`flags` 1) or normal (0) pages, at `expect` when that is free and aligned. `alignment`
    /// is reserved and must be 0; the range is aligned to the granularity, or to 1 GiB when
    /// it is at least that long (so that `HUGE1G` memory maps into it).
    pub fn reserve_mem_address(
        &self,
        size: u64,
        alignment: u64,
        expect: usize,
        flags: u64,
    ) -> Result<usize> {
        self.call(AclFunc::ReserveMemAddress, || {
            let g = self.granularity();
            if size == 0 || size % g != 0 || flags > 1 || alignment != 0 {
                return Err(AclError::INVALID_PARAM);
            }
            let align = if size >= HUGE1G_GRANULARITY {
                g.max(HUGE1G_GRANULARITY)
            } else {
                g
            };
            let align = usize::try_from(align).map_err(|_| AclError::INVALID_PARAM)?;
            let len = usize::try_from(size).map_err(|_| AclError::RT_MEMORY_ALLOCATION)?;
            let va = mapping::reserve(len, align, expect).ok_or(AclError::RT_MEMORY_ALLOCATION)?;
            let reservation = Reservation {
                len,
                pages: if flags == 1 {
                    Pages::Huge
                } else {
                    Pages::Normal
                },
                mappings: BTreeMap::new(),
            };
            lock(&self.mem).vmm.reservations.insert(va, reservation);
            Ok(va)
        })
    }

    /// `aclrtReleaseMemAddress`: `va` must start a reservation with nothing mapped in it.
    pub fn release_mem_address(&self, va: usize) -> Result<()> {
        self.call(AclFunc::ReleaseMemAddress, || {
            let mut mem = lock(&self.mem);
            match mem.vmm.reservations.get(&va) {
                Some(r) if r.mappings.is_empty() => {}
                _ => return Err(AclError::INVALID_PARAM),
            }
            let r = mem.vmm.reservations.remove(&va).expect("found above");
            // SAFETY: the whole reservation, with no mapping left in it, no longer tracked.
            let released = unsafe { mapping::release(va, r.len) };
            debug_assert!(released, "munmap of a reservation failed");
            Ok(())
        })
    }

    /// `aclrtMallocPhysical`: `size` bytes rounded up to the granularity of the memory
    /// attribute, on the device `prop` names; `flags` must be 0.
    pub fn malloc_physical_with(
        &self,
        size: u64,
        prop: Option<&PhysicalMemProp>,
        flags: u64,
    ) -> Result<PhysicalHandle> {
        self.call(AclFunc::MallocPhysical, || {
            if size == 0 || flags != 0 {
                return Err(AclError::INVALID_PARAM);
            }
            let (device, pages, granularity) = self.prop_device(prop)?;
            let rounded = align_up(size, granularity).ok_or(AclError::RT_MEMORY_ALLOCATION)?;
            let mut mem = lock(&self.mem);
            let used = mem.device_used[device as usize];
            if used
                .checked_add(rounded)
                .is_none_or(|u| u > self.config.device_capacity)
            {
                return Err(AclError::RT_MEMORY_ALLOCATION);
            }
            let fd = mapping::memory_object(rounded).ok_or(AclError::RT_MEMORY_ALLOCATION)?;
            mem.device_used[device as usize] += rounded;
            let id = self.next_handle.fetch_add(1, Ordering::Relaxed);
            mem.vmm.physical.insert(
                id,
                Physical {
                    fd,
                    size: rounded,
                    granularity,
                    pages,
                    device,
                    maps: 0,
                    origin: Origin::Local { exported: None },
                },
            );
            Ok(PhysicalHandle(id))
        })
    }

    /// `aclrtMapMem`: maps all of `handle` at `va`, inside a reservation for its page type:
    /// `offset` must be 0, `size` the physical memory's and `flags` 0.
    pub fn map_mem(
        &self,
        va: usize,
        size: u64,
        offset: u64,
        handle: PhysicalHandle,
        flags: u64,
    ) -> Result<()> {
        self.call(AclFunc::MapMem, || {
            let g = self.granularity();
            if flags != 0 || offset != 0 || size == 0 || va as u64 % g != 0 || size % g != 0 {
                return Err(AclError::INVALID_PARAM);
            }
            let len = usize::try_from(size).map_err(|_| AclError::INVALID_PARAM)?;
            let mut guard = lock(&self.mem);
            let mem = &mut *guard;
            let phys = mem
                .vmm
                .physical
                .get_mut(&handle.0)
                .ok_or(AclError::RT_INVALID_HANDLE)?;
            // All of it, where its pages can go.
            if size != phys.size || va as u64 % phys.granularity != 0 {
                return Err(AclError::INVALID_PARAM);
            }
            let (&start, r) = mem
                .vmm
                .reservations
                .range_mut(..=va)
                .next_back()
                .ok_or(AclError::INVALID_PARAM)?;
            let end = va.checked_add(len).ok_or(AclError::INVALID_PARAM)?;
            if end > start + r.len || !phys.pages.fits(r.pages) {
                return Err(AclError::INVALID_PARAM);
            }
            let overlaps = r
                .mappings
                .range(..end)
                .next_back()
                .is_some_and(|(&m, &(l, _))| m + l > va);
            if overlaps {
                return Err(AclError::INVALID_PARAM);
            }
            // SAFETY: `va..end` lies in our reservation and nothing is mapped there.
            if !unsafe { mapping::map_object(va, len, &phys.fd, offset) } {
                // A failed MAP_FIXED may have dropped the reserved pages: put them back.
                // SAFETY: the range is ours and nothing uses it.
                unsafe { mapping::unmap_object(va, len) };
                return Err(AclError::RT_MEMORY_ALLOCATION);
            }
            r.mappings.insert(va, (len, handle.0));
            phys.maps += 1;
            let view = Mapping::view(va, len).expect("a non-null, non-empty range");
            let previous = mem.blocks.insert(
                va,
                BlockRecord {
                    mapping: Arc::new(view),
                    kind: MemKind::DEVICE,
                    device: phys.device,
                    size,
                    rounded: size,
                    vmm: true,
                    buffer: false,
                },
            );
            debug_assert!(previous.is_none(), "a mapping over a live block");
            Ok(())
        })
    }

    /// `aclrtUnmapMem`: unmaps the mapping that starts at `va`, once the copies and fills
    /// already queued on it have run.
    pub fn unmap_mem(&self, va: usize) -> Result<()> {
        self.call(AclFunc::UnmapMem, || {
            let (rec, len) = {
                let mut mem = lock(&self.mem);
                let len = mem
                    .vmm
                    .reservations
                    .range(..=va)
                    .next_back()
                    .and_then(|(_, r)| r.mappings.get(&va))
                    .map(|&(len, _)| len)
                    .ok_or(AclError::INVALID_PARAM)?;
                // Gone from `blocks`: no new copy can reach it. Absent: another unmap runs.
                match mem.blocks.get(&va) {
                    Some(rec) if rec.vmm => {}
                    _ => return Err(AclError::INVALID_PARAM),
                }
                // Windows on it go with it, as on a free (lock order: `mem`, then `comm`).
                lock(&self.comm).drop_windows_in(va, len as u64);
                (mem.blocks.remove(&va).expect("found above"), len)
            };
            // Queued copies and fills hold the view: wait until they have run.
            while Arc::strong_count(&rec.mapping) > 1 {
                std::thread::sleep(Duration::from_micros(50));
            }
            drop(rec);
            // SAFETY: our own mapping, which nothing reads or writes any more.
            let restored = unsafe { mapping::unmap_object(va, len) };
            debug_assert!(restored, "restoring a reservation failed");
            let mut guard = lock(&self.mem);
            let mem = &mut *guard;
            if let Some((_, r)) = mem.vmm.reservations.range_mut(..=va).next_back() {
                if let Some((_, handle)) = r.mappings.remove(&va) {
                    if let Some(p) = mem.vmm.physical.get_mut(&handle) {
                        p.maps -= 1;
                    }
                }
            }
            Ok(())
        })
    }

    /// `aclrtFreePhysical`: frees local or imported physical memory that is no longer mapped.
    pub fn free_physical_handle(&self, handle: PhysicalHandle) -> Result<()> {
        self.call(AclFunc::FreePhysical, || {
            let mut mem = lock(&self.mem);
            match mem.vmm.physical.get(&handle.0) {
                None => return Err(AclError::RT_INVALID_HANDLE),
                Some(p) if p.maps > 0 => return Err(AclError::RT_MEMORY_FREE),
                Some(_) => {}
            }
            let p = mem.vmm.physical.remove(&handle.0).expect("found above");
            if let Origin::Local { exported } = p.origin {
                let (device, size) = (p.device as usize, p.size);
                let charged_now = match exported {
                    None => true,
                    Some(shareable) => {
                        // Importers still hold it: the last one to let go releases the charge.
                        let weak = Arc::downgrade(&self.mem);
                        let release = Box::new(move || {
                            if let Some(mem) = weak.upgrade() {
                                lock(&mem).device_used[device] -= size;
                            }
                        });
                        share::close_export(shareable, release).is_err()
                    }
                };
                if charged_now {
                    mem.device_used[device] -= size;
                }
            }
            // Closing the descriptor (and an import's link) happens here.
            drop(p.fd);
            Ok(())
        })
    }

    /// `aclrtMemExportToShareableHandle`: `handle_type` must be NONE; `flags` 0, or 1 to let
    /// any process import. A handle is exported once; imported memory is not exported again.
    pub fn export_to_shareable_handle(
        &self,
        handle: PhysicalHandle,
        handle_type: u32,
        flags: u64,
    ) -> Result<u64> {
        self.call(AclFunc::MemExportToShareableHandle, || {
            if handle_type != HANDLE_TYPE_NONE || flags > 1 {
                return Err(AclError::INVALID_PARAM);
            }
            let mut mem = lock(&self.mem);
            let p = mem
                .vmm
                .physical
                .get_mut(&handle.0)
                .ok_or(AclError::RT_INVALID_HANDLE)?;
            match p.origin {
                Origin::Local { exported: None } => {}
                _ => return Err(AclError::RT_PARAM_INVALID),
            }
            let fd = p.fd.try_clone().map_err(|_| AclError::RT_FAILURE)?;
            let shareable = share::export(fd, p.size, flags == 0)?;
            p.origin = Origin::Local {
                exported: Some(shareable),
            };
            Ok(shareable)
        })
    }

    /// `aclrtMemImportFromShareableHandle`: asks the exporting process for the memory; it
    /// answers only if this process is on the whitelist or validation is off.
    pub fn import_from_shareable_handle(
        &self,
        shareable: u64,
        device: DeviceId,
    ) -> Result<PhysicalHandle> {
        self.call(AclFunc::MemImportFromShareableHandle, || {
            if !self.valid_device(device) {
                return Err(AclError::RT_PARAM_INVALID);
            }
            let claim = share::claim_import(shareable)?;
            let (fd, size, link) = share::import(shareable)?;
            claim.link(&link);
            let id = self.next_handle.fetch_add(1, Ordering::Relaxed);
            lock(&self.mem).vmm.physical.insert(
                id,
                Physical {
                    fd,
                    size,
                    granularity: self.granularity(),
                    pages: Pages::Either,
                    device,
                    maps: 0,
                    origin: Origin::Imported {
                        _claim: claim,
                        _link: link,
                    },
                },
            );
            Ok(PhysicalHandle(id))
        })
    }

    /// `aclrtMemSetPidToShareableHandle`: adds `pids` to the whitelist of a handle this
    /// process exported and has not freed.
    pub fn set_pid_to_shareable_handle(&self, shareable: u64, pids: &[i32]) -> Result<()> {
        self.call(AclFunc::MemSetPidToShareableHandle, || {
            if pids.is_empty() {
                return Err(AclError::INVALID_PARAM);
            }
            share::allow(shareable, pids)
        })
    }

    /// `aclrtDeviceGetBareTgid`: the process id (the simulator runs no containers of its own).
    pub fn device_get_bare_tgid(&self) -> Result<i32> {
        self.call(AclFunc::DeviceGetBareTgid, || {
            i32::try_from(std::process::id()).map_err(|_| AclError::RT_FAILURE)
        })
    }

    /// Gives every reservation back and closes every export (on drop).
    pub(super) fn drop_vmm(&mut self) {
        let mut mem = lock(&self.mem);
        for (_, p) in mem.vmm.physical.drain() {
            if let Origin::Local {
                exported: Some(shareable),
            } = p.origin
            {
                let _ = share::close_export(shareable, Box::new(|| {}));
            }
        }
        for (va, r) in std::mem::take(&mut mem.vmm.reservations) {
            for m in r.mappings.keys() {
                mem.blocks.remove(m);
            }
            // SAFETY: the simulator is being dropped: no op is left and no one can reach
            // the range through it any more.
            unsafe { mapping::release(va, r.len) };
        }
    }
}

impl VmmRuntime for SimSource {
    fn allocation_granularity(&self, device: DeviceId, recommended: bool) -> Result<u64> {
        let id = u32::try_from(device).unwrap_or(u32::MAX);
        self.mem_get_allocation_granularity(
            Some(&PhysicalMemProp::device(id)),
            u32::from(recommended),
        )
    }

    fn reserve_address(&self, device: DeviceId, size: u64) -> Result<usize> {
        // aclrtReserveMemAddress reserves in the current device's context: `AclSource`
        // sets `device` first, which the runtime refuses for a device it lacks.
        self.ours()?;
        if !self.valid_device(device) {
            return Err(crate::Error::Runtime {
                func: "aclrtSetDevice",
                code: AclError::RT_PARAM_INVALID,
            });
        }
        self.reserve_mem_address(size, 0, 0, RESERVE_FLAG_HUGE_PAGE)
    }

    fn release_address(&self, va: usize) -> Result<()> {
        self.release_mem_address(va)
    }

    fn malloc_physical(&self, device: DeviceId, size: u64) -> Result<PhysicalHandle> {
        let id = u32::try_from(device).unwrap_or(u32::MAX);
        self.malloc_physical_with(size, Some(&PhysicalMemProp::device(id)), 0)
    }

    fn free_physical(&self, handle: PhysicalHandle) -> Result<()> {
        self.free_physical_handle(handle)
    }

    fn map(&self, va: usize, size: u64, offset: u64, handle: PhysicalHandle) -> Result<()> {
        self.map_mem(va, size, offset, handle, 0)
    }

    fn unmap(&self, va: usize) -> Result<()> {
        self.unmap_mem(va)
    }

    fn export_shareable(&self, handle: PhysicalHandle, flags: u64) -> Result<u64> {
        self.export_to_shareable_handle(handle, HANDLE_TYPE_NONE, flags)
    }

    fn import_shareable(&self, shareable: u64, device: DeviceId) -> Result<PhysicalHandle> {
        self.import_from_shareable_handle(shareable, device)
    }

    fn set_shareable_pids(&self, shareable: u64, pids: &[i32]) -> Result<()> {
        self.set_pid_to_shareable_handle(shareable, pids)
    }

    fn bare_tgid(&self) -> Result<i32> {
        self.device_get_bare_tgid()
    }
}
