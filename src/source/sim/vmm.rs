//! Virtual memory management on the host, done for real.
//!
//! - `aclrtReserveMemAddress` reserves address space: an inaccessible (`PROT_NONE`)
//!   mapping that costs no memory and that no other mapping can land in.
//! - `aclrtMallocPhysical` creates a shareable memory object (a memfd) of the size rounded
//!   up to the granularity, charged against the device's capacity like `aclrtMalloc`.
//! - `aclrtMapMem` maps (part of) an object over reserved addresses (`MAP_SHARED |
//!   MAP_FIXED`); the mapping is device memory for copies and fills, and mappings that follow
//!   each other without a gap form one range, so a copy may cross granules.
//! - `aclrtUnmapMem` waits until the copies and fills queued on the mapping have run, then
//!   puts the reservation back over it; `aclrtFreePhysical` refuses memory still mapped.
//! - Export, import and the whitelist are in `share.rs`: physical memory exported to other
//!   processes stays charged to this device until every importer has freed it.
//!
//! # Error codes
//!
//! | situation | code |
//! |---|---|
//! | null or zero argument, flags other than documented, a property other than pinned device memory with handle type NONE, an option other than MINIMUM/RECOMMENDED, an address, size or offset not a multiple of the granularity, a mapping outside a reservation, over another mapping or past the end of the physical memory, unmapping where no mapping starts, releasing a reservation that still has mappings or is unknown | `ACL_ERROR_INVALID_PARAM` (100000) |
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
    LOCATION_TYPE_DEVICE,
};
use crate::source::DeviceId;

/// Granularity of simulated physical memory: 2 MiB, the device's huge page.
pub const DEFAULT_GRANULARITY: u64 = 2 << 20;

/// One reserved range.
#[derive(Debug)]
struct Reservation {
    len: usize,
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
    /// Bytes, a multiple of the granularity.
    size: u64,
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

    /// The device a physical memory property names, after checking what the runtime requires.
    fn prop_device(&self, prop: Option<&PhysicalMemProp>) -> Result<DeviceId, AclError> {
        let prop = prop.ok_or(AclError::INVALID_PARAM)?;
        if prop.handle_type != HANDLE_TYPE_NONE
            || prop.allocation_type != ALLOCATION_TYPE_PINNED
            || prop.location_type != LOCATION_TYPE_DEVICE
        {
            return Err(AclError::INVALID_PARAM);
        }
        let device =
            DeviceId::try_from(prop.location_id).map_err(|_| AclError::RT_PARAM_INVALID)?;
        if !self.valid_device(device) {
            return Err(AclError::RT_PARAM_INVALID);
        }
        Ok(device)
    }

    /// `aclrtMemGetAllocationGranularity`: the configured granularity for both options.
    pub fn mem_get_allocation_granularity(
        &self,
        prop: Option<&PhysicalMemProp>,
        option: u32,
    ) -> Result<u64> {
        self.call(AclFunc::MemGetAllocationGranularity, || {
            self.prop_device(prop)?;
            if option > 1 {
                return Err(AclError::INVALID_PARAM);
            }
            Ok(self.granularity())
        })
    }

    /// `aclrtReserveMemAddress`: `size` bytes (a multiple of the granularity) aligned to
    /// `alignment` (0: the granularity; else a power of two), at `expect` when that is free.
    pub fn reserve_mem_address(
        &self,
        size: u64,
        alignment: u64,
        expect: usize,
        flags: u64,
    ) -> Result<usize> {
        self.call(AclFunc::ReserveMemAddress, || {
            let g = self.granularity();
            if size == 0 || size % g != 0 || flags > 1 {
                return Err(AclError::INVALID_PARAM);
            }
            if alignment != 0 && !alignment.is_power_of_two() {
                return Err(AclError::INVALID_PARAM);
            }
            let align = usize::try_from(alignment.max(g)).map_err(|_| AclError::INVALID_PARAM)?;
            let len = usize::try_from(size).map_err(|_| AclError::RT_MEMORY_ALLOCATION)?;
            let va = mapping::reserve(len, align, expect).ok_or(AclError::RT_MEMORY_ALLOCATION)?;
            let reservation = Reservation {
                len,
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

    /// `aclrtMallocPhysical`: `size` bytes rounded up to the granularity on the device
    /// `prop` names; `flags` must be 0.
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
            let device = self.prop_device(prop)?;
            let rounded =
                align_up(size, self.granularity()).ok_or(AclError::RT_MEMORY_ALLOCATION)?;
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
                    device,
                    maps: 0,
                    origin: Origin::Local { exported: None },
                },
            );
            Ok(PhysicalHandle(id))
        })
    }

    /// `aclrtMapMem`: maps `size` bytes of `handle` from `offset` at `va`; `flags` must be 0.
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
            if flags != 0 || size == 0 || va as u64 % g != 0 || size % g != 0 || offset % g != 0 {
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
            if offset.checked_add(size).is_none_or(|end| end > phys.size) {
                return Err(AclError::INVALID_PARAM);
            }
            let (&start, r) = mem
                .vmm
                .reservations
                .range_mut(..=va)
                .next_back()
                .ok_or(AclError::INVALID_PARAM)?;
            let end = va.checked_add(len).ok_or(AclError::INVALID_PARAM)?;
            if end > start + r.len {
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

    fn reserve_address(&self, _device: DeviceId, size: u64, alignment: u64) -> Result<usize> {
        self.reserve_mem_address(size, alignment, 0, 0)
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
