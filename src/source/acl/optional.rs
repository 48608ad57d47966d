//! The optional AscendCL features: virtual memory, shareable handles and shared buffers.
//!
//! Each is an inherent method of [`AclSource`] that answers [`Error::NotSupported`] when the
//! loaded runtime lacks the function. Handles are tracked like blocks: one this source did not
//! hand out, or already released, is refused before it reaches the runtime.

use std::ffi::c_void;
use std::sync::Arc;

use super::{check, refused, sys, to_usize, AclSource, BufInfo, MbufHandle, PhysicalHandle};
use crate::align::CarveRule;
use crate::error::{AclError, Error, Result};
use crate::source::vmm::RESERVE_FLAG_HUGE_PAGE;
use crate::source::DeviceId;

/// Physical memory properties for device `device` as `aclrtMallocPhysical` requires them
/// (handle type NONE, PINNED, huge-page HBM on the device).
fn device_prop(device: DeviceId) -> Result<sys::aclrtPhysicalMemProp> {
    let id = u32::try_from(device)
        .map_err(|_| refused("aclrtMallocPhysical", AclError::INVALID_PARAM))?;
    Ok(sys::aclrtPhysicalMemProp {
        handleType: sys::ACL_MEM_HANDLE_TYPE_NONE,
        allocationType: sys::ACL_MEM_ALLOCATION_TYPE_PINNED,
        memAttr: sys::ACL_HBM_MEM_HUGE,
        location: sys::aclrtMemLocation {
            id,
            type_: sys::ACL_MEM_LOCATION_TYPE_DEVICE,
        },
        reserve: 0,
    })
}

/// Virtual memory management (`aclrtReserveMemAddress` and friends).
impl AclSource {
    /// The granularity of physical device memory on `device`: the minimum, or the
    /// recommended one when `recommended` (`aclrtMemGetAllocationGranularity`).
    pub fn allocation_granularity(&self, device: DeviceId, recommended: bool) -> Result<u64> {
        let f = sym!(self.api()?, aclrtMemGetAllocationGranularity);
        self.use_device(device)?;
        let mut prop = device_prop(device)?;
        let option = if recommended {
            sys::ACL_RT_MEM_ALLOC_GRANULARITY_RECOMMENDED
        } else {
            sys::ACL_RT_MEM_ALLOC_GRANULARITY_MINIMUM
        };
        let mut granularity = 0usize;
        // SAFETY: `prop` and `granularity` are live locals.
        check("aclrtMemGetAllocationGranularity", unsafe {
            f(&mut prop, option, &mut granularity)
        })?;
        Ok(granularity as u64)
    }

    /// Reserves `size` bytes of device virtual address space for the huge-page memory
    /// [`AclSource::malloc_physical`] allocates (`aclrtReserveMemAddress`: alignment 0, the
    /// only value it takes; no address hint; flags [`RESERVE_FLAG_HUGE_PAGE`], as the page
    /// type of the memory mapped into the range must match). Returns the start.
    pub fn reserve_address(&self, device: DeviceId, size: u64) -> Result<usize> {
        let func = "aclrtReserveMemAddress";
        let f = sym!(self.api()?, aclrtReserveMemAddress);
        let size = to_usize(func, size)?;
        self.use_device(device)?;
        let mut va: *mut c_void = std::ptr::null_mut();
        // SAFETY: `va` is a live out-pointer; a null hint asks for any address.
        check(func, unsafe {
            f(
                &mut va,
                size,
                0,
                std::ptr::null_mut(),
                RESERVE_FLAG_HUGE_PAGE,
            )
        })?;
        if va.is_null() {
            return Err(Error::Invalid(format!(
                "{func} returned success and a null address"
            )));
        }
        self.lock().reserved.insert(va as usize, (size, device));
        Ok(va as usize)
    }

    /// Releases a range from [`AclSource::reserve_address`] (`aclrtReleaseMemAddress`).
    pub fn release_address(&self, va: usize) -> Result<()> {
        let func = "aclrtReleaseMemAddress";
        let f = sym!(self.api()?, aclrtReleaseMemAddress);
        let range = self
            .lock()
            .reserved
            .remove(&va)
            .ok_or(refused(func, AclError::INVALID_PARAM))?;
        // SAFETY: `va` starts a range this runtime reserved and that is no longer tracked.
        let result = check(func, unsafe { f(va as *mut c_void) });
        if result.is_err() {
            self.lock().reserved.insert(va, range);
        }
        result
    }

    /// Allocates `size` bytes of physical memory on `device` (`aclrtMallocPhysical`).
    pub fn malloc_physical(&self, device: DeviceId, size: u64) -> Result<PhysicalHandle> {
        let func = "aclrtMallocPhysical";
        let f = sym!(self.api()?, aclrtMallocPhysical);
        let size = to_usize(func, size)?;
        self.use_device(device)?;
        let prop = device_prop(device)?;
        let mut handle: sys::aclrtDrvMemHandle = std::ptr::null_mut();
        // SAFETY: `handle` is a live out-pointer, `prop` a live local.
        check(func, unsafe { f(&mut handle, size, &prop, 0) })?;
        if handle.is_null() {
            return Err(Error::Invalid(format!(
                "{func} returned success and a null handle"
            )));
        }
        self.lock().physical.insert(handle as usize);
        Ok(PhysicalHandle(handle as usize))
    }

    /// Frees physical memory (`aclrtFreePhysical`); it must be unmapped first.
    pub fn free_physical(&self, handle: PhysicalHandle) -> Result<()> {
        let func = "aclrtFreePhysical";
        let f = sym!(self.api()?, aclrtFreePhysical);
        if !self.lock().physical.remove(&handle.0) {
            return Err(refused(func, AclError::RT_INVALID_HANDLE));
        }
        // SAFETY: a live physical allocation of this runtime, no longer tracked.
        let result = check(func, unsafe { f(handle.0 as sys::aclrtDrvMemHandle) });
        if result.is_err() {
            self.lock().physical.insert(handle.0);
        }
        result
    }

    /// Maps `size` bytes of `handle`, from `offset`, at `va` inside a reserved range
    /// (`aclrtMapMem`, flags 0). The runtime takes offset 0 and the whole allocation only.
    pub fn map(&self, va: usize, size: u64, offset: u64, handle: PhysicalHandle) -> Result<()> {
        let func = "aclrtMapMem";
        let f = sym!(self.api()?, aclrtMapMem);
        let (size, offset) = (to_usize(func, size)?, to_usize(func, offset)?);
        self.check_mapping(func, va, size, handle)?;
        // SAFETY: `va..va+size` lies in a range this runtime reserved; `handle` is live.
        check(func, unsafe {
            f(
                va as *mut c_void,
                size,
                offset,
                handle.0 as sys::aclrtDrvMemHandle,
                0,
            )
        })?;
        self.lock().mappings.insert(va, handle);
        Ok(())
    }

    /// Unmaps what [`AclSource::map`] mapped at `va` (`aclrtUnmapMem`). An address where no
    /// mapping of this source starts is refused with `ACL_ERROR_INVALID_PARAM`.
    pub fn unmap(&self, va: usize) -> Result<()> {
        let func = "aclrtUnmapMem";
        let f = sym!(self.api()?, aclrtUnmapMem);
        let handle = self
            .lock()
            .mappings
            .remove(&va)
            .ok_or(refused(func, AclError::INVALID_PARAM))?;
        // SAFETY: a mapping this source made at `va`, no longer tracked.
        let result = check(func, unsafe { f(va as *mut c_void) });
        if result.is_err() {
            self.lock().mappings.insert(va, handle);
        }
        result
    }

    /// Refuses a mapping outside every reserved range, or of a handle not held.
    fn check_mapping(
        &self,
        func: &'static str,
        va: usize,
        size: usize,
        handle: PhysicalHandle,
    ) -> Result<()> {
        let live = self.lock();
        let inside = live
            .reserved
            .range(..=va)
            .next_back()
            .is_some_and(|(start, (len, _))| va - start < *len && size <= len - (va - start));
        if !inside {
            return Err(refused(func, AclError::INVALID_PARAM));
        }
        if !live.physical.contains(&handle.0) {
            return Err(refused(func, AclError::RT_INVALID_HANDLE));
        }
        Ok(())
    }
}

/// Cross-process sharing of physical memory.
impl AclSource {
    /// Exports `handle` as a shareable handle (`aclrtMemExportToShareableHandle`, handle type
    /// NONE). `flags` is 0, or `ACL_RT_VMM_EXPORT_FLAG_DISABLE_PID_VALIDATION` (1).
    pub fn export_shareable(&self, handle: PhysicalHandle, flags: u64) -> Result<u64> {
        let func = "aclrtMemExportToShareableHandle";
        let f = sym!(self.api()?, aclrtMemExportToShareableHandle);
        if !self.lock().physical.contains(&handle.0) {
            return Err(refused(func, AclError::RT_INVALID_HANDLE));
        }
        let mut shareable = 0u64;
        // SAFETY: `handle` is a live physical allocation, `shareable` a live out-pointer.
        check(func, unsafe {
            f(
                handle.0 as sys::aclrtDrvMemHandle,
                sys::ACL_MEM_HANDLE_TYPE_NONE,
                flags,
                &mut shareable,
            )
        })?;
        Ok(shareable)
    }

    /// Imports a shareable handle on `device` (`aclrtMemImportFromShareableHandle`). The result
    /// is freed with [`AclSource::free_physical`] like a local allocation.
    pub fn import_shareable(&self, shareable: u64, device: DeviceId) -> Result<PhysicalHandle> {
        let func = "aclrtMemImportFromShareableHandle";
        let f = sym!(self.api()?, aclrtMemImportFromShareableHandle);
        self.use_device(device)?;
        let mut handle: sys::aclrtDrvMemHandle = std::ptr::null_mut();
        // SAFETY: `handle` is a live out-pointer.
        check(func, unsafe { f(shareable, device, &mut handle) })?;
        if handle.is_null() {
            return Err(Error::Invalid(format!(
                "{func} returned success and a null handle"
            )));
        }
        self.lock().physical.insert(handle as usize);
        Ok(PhysicalHandle(handle as usize))
    }

    /// Allows the processes `pids` (as [`AclSource::bare_tgid`] reports them) to import
    /// `shareable` (`aclrtMemSetPidToShareableHandle`).
    pub fn set_shareable_pids(&self, shareable: u64, pids: &[i32]) -> Result<()> {
        let f = sym!(self.api()?, aclrtMemSetPidToShareableHandle);
        let mut pids = pids.to_vec();
        // SAFETY: `pids` is a live buffer of `pids.len()` ids; the runtime only reads it.
        check("aclrtMemSetPidToShareableHandle", unsafe {
            f(shareable, pids.as_mut_ptr(), pids.len())
        })
    }

    /// This process's id as the device sees it (`aclrtDeviceGetBareTgid`).
    pub fn bare_tgid(&self) -> Result<i32> {
        let f = sym!(self.api()?, aclrtDeviceGetBareTgid);
        let mut pid = 0i32;
        // SAFETY: `pid` is a live out-pointer.
        check("aclrtDeviceGetBareTgid", unsafe { f(&mut pid) })?;
        Ok(pid)
    }
}

/// Shared buffers (mbuf, `acl_tdt_queue.h`).
impl AclSource {
    fn mbuf(&self, func: &'static str, buf: MbufHandle) -> Result<sys::acltdtBuf> {
        self.mbuf_taken(func, buf).map(|(raw, _)| raw)
    }

    /// A live mbuf and what is known of its buffer (shared by its handles).
    fn mbuf_taken(
        &self,
        func: &'static str,
        buf: MbufHandle,
    ) -> Result<(sys::acltdtBuf, Arc<BufInfo>)> {
        match self.lock().mbufs.get(&buf.0) {
            Some(taken) => Ok((buf.0 as sys::acltdtBuf, Arc::clone(taken))),
            None => Err(refused(func, AclError::RT_INVALID_HANDLE)),
        }
    }

    /// Tracks a new handle on the buffer `taken` describes.
    fn track_mbuf(
        &self,
        func: &'static str,
        buf: sys::acltdtBuf,
        taken: Arc<BufInfo>,
    ) -> Result<MbufHandle> {
        if buf.is_null() {
            return Err(Error::Invalid(format!(
                "{func} returned success and a null buffer"
            )));
        }
        self.lock().mbufs.insert(buf as usize, taken);
        Ok(MbufHandle(buf as usize))
    }

    /// Allocates a shared buffer of `size` bytes on `device`, DVPP memory when `dvpp`
    /// (`acltdtAllocBuf`, which allocates on the calling thread's current device: `device` is
    /// made current first, as for a block).
    pub fn alloc_buf(&self, device: DeviceId, size: u64, dvpp: bool) -> Result<MbufHandle> {
        let func = "acltdtAllocBuf";
        let f = sym!(self.api()?, acltdtAllocBuf);
        let size = to_usize(func, size)?;
        self.use_device(device)?;
        let ty = if dvpp {
            sys::ACL_TDT_DVPP_MEM
        } else {
            sys::ACL_TDT_NORMAL_MEM
        } as u32;
        let mut buf: sys::acltdtBuf = std::ptr::null_mut();
        // SAFETY: `buf` is a live out-pointer.
        check(func, unsafe { f(size, ty, &mut buf) })?;
        // DVPP memory takes the process's DVPP space as `acldvppMalloc` does (see `mem_info`).
        let dvpp_bytes = if dvpp {
            let size = size as u64;
            CarveRule::default().runtime_rounded(size).unwrap_or(size)
        } else {
            0
        };
        // Where its data is, so that a copy or fill of it runs on its device (`device_for`).
        // (Not `self.api()?`: the buffer is allocated, and an early return would lose it.)
        let data = match &self.api.acltdtGetBufData {
            Ok(get) if !buf.is_null() => {
                let (mut ptr, mut len): (*mut c_void, usize) = (std::ptr::null_mut(), 0);
                // SAFETY: `buf` is the mbuf just allocated; both out-pointers are live locals.
                let code = unsafe { get(buf, &mut ptr, &mut len) };
                (code == 0 && !ptr.is_null()).then_some((ptr as usize, len))
            }
            _ => None,
        };
        let info = BufInfo {
            device,
            dvpp_bytes,
            data,
        };
        self.track_mbuf(func, buf, Arc::new(info))
    }

    /// Frees a shared buffer (`acltdtFreeBuf`).
    pub fn free_buf(&self, buf: MbufHandle) -> Result<()> {
        let func = "acltdtFreeBuf";
        let f = sym!(self.api()?, acltdtFreeBuf);
        let taken = self
            .lock()
            .mbufs
            .remove(&buf.0)
            .ok_or(refused(func, AclError::RT_INVALID_HANDLE))?;
        // SAFETY: a live mbuf of this runtime, no longer tracked.
        let result = check(func, unsafe { f(buf.0 as sys::acltdtBuf) });
        if result.is_err() {
            self.lock().mbufs.insert(buf.0, taken);
        }
        result
    }

    /// The data area of a shared buffer: address and size (`acltdtGetBufData`).
    pub fn buf_data(&self, buf: MbufHandle) -> Result<(usize, u64)> {
        let func = "acltdtGetBufData";
        let f = sym!(self.api()?, acltdtGetBufData);
        let raw = self.mbuf(func, buf)?;
        let (mut ptr, mut size): (*mut c_void, usize) = (std::ptr::null_mut(), 0);
        // SAFETY: `raw` is a live mbuf; both out-pointers are live locals.
        check(func, unsafe { f(raw, &mut ptr, &mut size) })?;
        Ok((ptr as usize, size as u64))
    }

    /// Sets the valid data length of a shared buffer (`acltdtSetBufDataLen`).
    pub fn set_buf_data_len(&self, buf: MbufHandle, len: u64) -> Result<()> {
        let func = "acltdtSetBufDataLen";
        let f = sym!(self.api()?, acltdtSetBufDataLen);
        let raw = self.mbuf(func, buf)?;
        let len = to_usize(func, len)?;
        // SAFETY: `raw` is a live mbuf.
        check(func, unsafe { f(raw, len) })
    }

    /// The valid data length of a shared buffer (`acltdtGetBufDataLen`).
    pub fn buf_data_len(&self, buf: MbufHandle) -> Result<u64> {
        let func = "acltdtGetBufDataLen";
        let f = sym!(self.api()?, acltdtGetBufDataLen);
        let raw = self.mbuf(func, buf)?;
        let mut len = 0usize;
        // SAFETY: `raw` is a live mbuf, `len` a live out-pointer.
        check(func, unsafe { f(raw, &mut len) })?;
        Ok(len as u64)
    }

    /// Writes `data` into the user-data area of a shared buffer at `offset`
    /// (`acltdtSetBufUserData`; both at most 96 bytes).
    pub fn set_buf_user_data(&self, buf: MbufHandle, data: &[u8], offset: u64) -> Result<()> {
        let func = "acltdtSetBufUserData";
        let f = sym!(self.api()?, acltdtSetBufUserData);
        let raw = self.mbuf(func, buf)?;
        let offset = to_usize(func, offset)?;
        // SAFETY: `raw` is a live mbuf; `data` is valid for `data.len()` bytes of reading.
        check(func, unsafe {
            f(raw, data.as_ptr().cast(), data.len(), offset)
        })
    }

    /// Reads the user-data area of a shared buffer at `offset` into `out`
    /// (`acltdtGetBufUserData`).
    pub fn buf_user_data(&self, buf: MbufHandle, out: &mut [u8], offset: u64) -> Result<()> {
        let func = "acltdtGetBufUserData";
        let f = sym!(self.api()?, acltdtGetBufUserData);
        let raw = self.mbuf(func, buf)?;
        let offset = to_usize(func, offset)?;
        // SAFETY: `raw` is a live mbuf; `out` is valid for `out.len()` bytes of writing.
        check(func, unsafe {
            f(raw, out.as_mut_ptr().cast(), out.len(), offset)
        })
    }

    /// A new reference to the data of a shared buffer (`acltdtCopyBufRef`); free each with
    /// [`AclSource::free_buf`].
    pub fn copy_buf_ref(&self, buf: MbufHandle) -> Result<MbufHandle> {
        let func = "acltdtCopyBufRef";
        let f = sym!(self.api()?, acltdtCopyBufRef);
        let (raw, taken) = self.mbuf_taken(func, buf)?;
        let mut new: sys::acltdtBuf = std::ptr::null_mut();
        // SAFETY: `raw` is a live mbuf, `new` a live out-pointer.
        check(func, unsafe { f(raw, &mut new) })?;
        // The new handle is on the same buffer: its space counts once, until both are freed.
        self.track_mbuf(func, new, taken)
    }
}

impl crate::source::vmm::VmmRuntime for AclSource {
    fn allocation_granularity(&self, device: DeviceId, recommended: bool) -> Result<u64> {
        AclSource::allocation_granularity(self, device, recommended)
    }

    fn reserve_address(&self, device: DeviceId, size: u64) -> Result<usize> {
        AclSource::reserve_address(self, device, size)
    }

    fn release_address(&self, va: usize) -> Result<()> {
        AclSource::release_address(self, va)
    }

    fn malloc_physical(&self, device: DeviceId, size: u64) -> Result<PhysicalHandle> {
        AclSource::malloc_physical(self, device, size)
    }

    fn free_physical(&self, handle: PhysicalHandle) -> Result<()> {
        AclSource::free_physical(self, handle)
    }

    fn map(&self, va: usize, size: u64, offset: u64, handle: PhysicalHandle) -> Result<()> {
        AclSource::map(self, va, size, offset, handle)
    }

    fn unmap(&self, va: usize) -> Result<()> {
        AclSource::unmap(self, va)
    }

    fn export_shareable(&self, handle: PhysicalHandle, flags: u64) -> Result<u64> {
        AclSource::export_shareable(self, handle, flags)
    }

    fn import_shareable(&self, shareable: u64, device: DeviceId) -> Result<PhysicalHandle> {
        AclSource::import_shareable(self, shareable, device)
    }

    fn set_shareable_pids(&self, shareable: u64, pids: &[i32]) -> Result<()> {
        AclSource::set_shareable_pids(self, shareable, pids)
    }

    fn bare_tgid(&self) -> Result<i32> {
        AclSource::bare_tgid(self)
    }
}
