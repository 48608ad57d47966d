//! Shared buffers (mbuf, `acl_tdt_queue.h`) in the simulator.
//!
//! A buffer is a block of device memory (`ACL_TDT_NORMAL_MEM`) or DVPP memory
//! (`ACL_TDT_DVPP_MEM`) of the size asked, charged like `aclrtMalloc` / `acldvppMalloc`,
//! with a valid-data length and 96 bytes of user data. `acltdtCopyBufRef` makes another
//! handle on the same data; the memory goes back when the last handle is freed.
//!
//! | situation | code |
//! |---|---|
//! | size 0, a type other than 0 or 1, a data length past the size, user data or offset over 96 bytes or ending past byte 96 | `ACL_ERROR_INVALID_PARAM` (100000) |
//! | an unknown or freed buffer handle | `ACL_ERROR_RT_INVALID_HANDLE` (107017) |
//! | out of device or DVPP memory | `ACL_ERROR_RT_MEMORY_ALLOCATION` (207001) |

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use super::{lock, AclFunc, SimSource};
use crate::error::{AclError, Result};
use crate::kind::MemKind;
use crate::source::{Block, DeviceId};

/// Bytes of user data a buffer carries.
pub const USER_DATA_BYTES: usize = 96;

/// A shared buffer handle (`acltdtBuf`) of the simulator.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct MbufHandle(pub usize);

/// What every handle on one buffer shares.
#[derive(Debug)]
struct BufData {
    block: Block,
    data_len: u64,
    user_data: [u8; USER_DATA_BYTES],
    /// Handles on this buffer in `MbufState::handles`; changed under the memory lock.
    handles: u32,
}

/// Live buffer handles. Invariant: the block of a `BufData` is live while any handle on it is.
#[derive(Debug, Default)]
pub(super) struct MbufState {
    handles: HashMap<usize, Arc<Mutex<BufData>>>,
}

impl MbufState {
    pub(super) fn len(&self) -> usize {
        self.handles.len()
    }
}

/// Shared buffers, with the arguments of the `acltdt*` calls.
impl SimSource {
    fn buf(&self, buf: MbufHandle) -> Result<Arc<Mutex<BufData>>, AclError> {
        lock(&self.mem)
            .mbufs
            .handles
            .get(&buf.0)
            .cloned()
            .ok_or(AclError::RT_INVALID_HANDLE)
    }

    /// `acltdtAllocBuf` on `device`: `ty` 0 for device memory, 1 for DVPP memory.
    pub fn alloc_buf(&self, device: DeviceId, size: u64, ty: u32) -> Result<MbufHandle> {
        self.call(AclFunc::AllocBuf, || {
            let kind = match ty {
                0 => MemKind::DEVICE,
                1 => MemKind::Dvpp,
                _ => return Err(AclError::INVALID_PARAM),
            };
            let block = self.alloc(device, kind, size, true)?;
            let id = self.next_handle.fetch_add(1, Ordering::Relaxed);
            let data = BufData {
                block,
                data_len: 0,
                user_data: [0; USER_DATA_BYTES],
                handles: 1,
            };
            lock(&self.mem)
                .mbufs
                .handles
                .insert(id, Arc::new(Mutex::new(data)));
            Ok(MbufHandle(id))
        })
    }

    /// `acltdtFreeBuf`: drops this handle; the memory goes back with the last one.
    pub fn free_buf(&self, buf: MbufHandle) -> Result<()> {
        self.call(AclFunc::FreeBuf, || {
            let last = {
                let mut mem = lock(&self.mem);
                let data = mem
                    .mbufs
                    .handles
                    .remove(&buf.0)
                    .ok_or(AclError::RT_INVALID_HANDLE)?;
                let mut d = lock(&data);
                d.handles -= 1;
                (d.handles == 0).then_some(d.block)
            };
            match last {
                Some(block) => self.free(block, true),
                None => Ok(()),
            }
        })
    }

    /// `acltdtGetBufData`: address and size of the data area.
    pub fn buf_data(&self, buf: MbufHandle) -> Result<(usize, u64)> {
        self.call(AclFunc::GetBufData, || {
            let b = self.buf(buf)?;
            let b = lock(&b);
            Ok((b.block.addr, b.block.size))
        })
    }

    /// `acltdtSetBufDataLen`: at most the size.
    pub fn set_buf_data_len(&self, buf: MbufHandle, len: u64) -> Result<()> {
        self.call(AclFunc::SetBufDataLen, || {
            let b = self.buf(buf)?;
            let mut b = lock(&b);
            if len > b.block.size {
                return Err(AclError::INVALID_PARAM);
            }
            b.data_len = len;
            Ok(())
        })
    }

    /// `acltdtGetBufDataLen`.
    pub fn buf_data_len(&self, buf: MbufHandle) -> Result<u64> {
        self.call(AclFunc::GetBufDataLen, || {
            let b = self.buf(buf)?;
            let len = lock(&b).data_len;
            Ok(len)
        })
    }

    /// `acltdtSetBufUserData`: `data` at `offset` of the 96 bytes.
    pub fn set_buf_user_data(&self, buf: MbufHandle, data: &[u8], offset: u64) -> Result<()> {
        self.call(AclFunc::SetBufUserData, || {
            let range = user_range(data.len(), offset)?;
            let b = self.buf(buf)?;
            lock(&b).user_data[range].copy_from_slice(data);
            Ok(())
        })
    }

    /// `acltdtGetBufUserData`: fills `out` from `offset` of the 96 bytes.
    pub fn buf_user_data(&self, buf: MbufHandle, out: &mut [u8], offset: u64) -> Result<()> {
        self.call(AclFunc::GetBufUserData, || {
            let range = user_range(out.len(), offset)?;
            let b = self.buf(buf)?;
            out.copy_from_slice(&lock(&b).user_data[range]);
            Ok(())
        })
    }

    /// `acltdtCopyBufRef`: another handle on the same data.
    pub fn copy_buf_ref(&self, buf: MbufHandle) -> Result<MbufHandle> {
        self.call(AclFunc::CopyBufRef, || {
            let mut mem = lock(&self.mem);
            let data = mem
                .mbufs
                .handles
                .get(&buf.0)
                .cloned()
                .ok_or(AclError::RT_INVALID_HANDLE)?;
            lock(&data).handles += 1;
            let id = self.next_handle.fetch_add(1, Ordering::Relaxed);
            mem.mbufs.handles.insert(id, data);
            Ok(MbufHandle(id))
        })
    }
}

/// The user-data bytes `len` bytes at `offset` cover, if they fit in the 96.
fn user_range(len: usize, offset: u64) -> Result<std::ops::Range<usize>, AclError> {
    let offset = usize::try_from(offset).map_err(|_| AclError::INVALID_PARAM)?;
    match offset.checked_add(len) {
        Some(end) if end <= USER_DATA_BYTES && len > 0 => Ok(offset..end),
        _ => Err(AclError::INVALID_PARAM),
    }
}
