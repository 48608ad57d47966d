//! Shared buffers (mbuf) carved from a pool, in the manner of `acltdtAllocBuf`.
//!
//! An [`Mbuf`] is one region of device memory (128-aligned, fit to feed a model) or DVPP
//! memory holding a 128-byte header and then the data. The header lives in device memory
//! itself, so a secondary process that opens the buffer sees what the primary set:
//!
//! | bytes | content |
//! |---|---|
//! | 0..8 | magic `APMBUF01` |
//! | 8..16 | data size (little-endian `u64`) |
//! | 16..24 | valid data length (`acltdtSetBufDataLen`) |
//! | 24..28 | kind: 0 normal, 1 DVPP |
//! | 28..32 | the buffer's id (little-endian `u32`, never 0) |
//! | 32..128 | user data, 96 bytes (`acltdtSetBufUserData`) |
//!
//! Cloning an [`Mbuf`] is `acltdtCopyBufRef`: another handle on the same data; the region goes
//! back to the pool when the last handle is dropped or freed (`acltdtFreeBuf`). In debug mode
//! a write past the data into the padding is reported then, as for a region:
//! [`Mbuf::free`] of the last handle returns it, and the pool keeps it for
//! [`Pool::take_corruption_reports`] either way. A primary process
//! authorises secondaries with [`Mbuf::publish`] (the pool must run over a
//! [`VmmSource`]); they open it read-only with [`SharedMbuf::open`]. Read-only is the type's
//! promise, not the memory's: the same descriptor opened as a [`SharedMapping`] can be
//! written. DVPP memory cannot be shared between processes, so publishing a DVPP buffer is
//! refused.
//!
//! The header is only as trustworthy as the memory: any process holding the descriptor can
//! write it. So a valid data length past the buffer's size, on either side, is refused with
//! [`Error::OutOfBounds`] (as [`Mbuf::set_data_len`] refuses it), and [`SharedMbuf::open`]
//! takes the size only when it matches what was published.
//!
//! A descriptor names one buffer, not its memory: [`Mbuf::publish`] puts the buffer's id
//! in it, and [`SharedMbuf::open`] refuses memory whose header does not carry that id (a
//! buffer allocated since at the same address). When the last handle goes, the magic is
//! cleared before the memory goes back, so a descriptor of a buffer freed is refused
//! before that memory is reused too. Ids repeat after 2^32 buffers of a process. A buffer
//! already opened reads whatever its memory holds, freed or not: the primary keeps a
//! buffer for as long as its secondaries read it.
//!
//! ```
//! use ascend_pool::mbuf::{Mbuf, MbufKind};
//! use ascend_pool::{Pool, PoolConfig, SimSource};
//! use std::sync::Arc;
//!
//! let pool = Arc::new(Pool::new(Arc::new(SimSource::default()), PoolConfig::default())?);
//! let buf = Mbuf::alloc(&pool, 1024, MbufKind::Normal)?;
//! buf.write(0, b"tensor bytes")?;
//! buf.set_data_len(12)?;
//! buf.set_user_data(b"seq=7", 0)?;
//! let copy = buf.clone(); // acltdtCopyBufRef
//! drop(buf);
//! assert_eq!(copy.data_len()?, 12);
//! let mut tag = [0u8; 5];
//! copy.user_data(&mut tag, 0)?;
//! assert_eq!(&tag, b"seq=7");
//! # Ok::<(), ascend_pool::Error>(())
//! ```

use std::sync::{Arc, Mutex, MutexGuard};

use crate::error::{Error, Result};
use crate::pool::Pool;
use crate::region::{Align128, DeviceRegion, DvppRegion, Region, Stream};
use crate::share::{Access, ShareDescriptor, SharedMapping};
use crate::source::vmm::{VmmRuntime, VmmSource};
use crate::source::DeviceId;

/// Bytes of user data a buffer carries.
pub const USER_DATA_LEN: usize = 96;
/// Bytes of header before the data (keeps the data 128-aligned).
pub const HEADER_LEN: u64 = 128;
const MAGIC: &[u8; 8] = b"APMBUF01";
const ID_AT: usize = 28;
const USER_DATA_AT: u64 = 32;

/// The next buffer's id (see the module docs); 0 is never one.
static NEXT_ID: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(1);

fn next_id() -> u32 {
    loop {
        let id = NEXT_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        if id != 0 {
            return id;
        }
    }
}

/// Which memory a buffer is made of (`acltdtAllocBuf`'s type).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MbufKind {
    /// `ACL_TDT_NORMAL_MEM`: device memory.
    Normal,
    /// `ACL_TDT_DVPP_MEM`: DVPP memory (not shareable between processes).
    Dvpp,
}

#[derive(Debug)]
enum MbufRegion {
    Normal(DeviceRegion<Align128>),
    Dvpp(DvppRegion),
}

/// Why a handle finds the region: only the last handle's drop or free takes it out.
const HELD: &str = "a buffer's region stays until its last handle goes";

impl MbufRegion {
    fn addr(&self) -> usize {
        match self {
            MbufRegion::Normal(r) => r.addr(),
            MbufRegion::Dvpp(r) => r.addr(),
        }
    }
}

#[derive(Debug)]
struct MbufInner {
    /// Header then `size` bytes of data; locked for each copy (the region API takes `&mut`).
    /// Given back before the pool handle goes (the pool's last handle would otherwise
    /// report it as a live region): by the drop, or by [`Mbuf::free`], which takes it out.
    /// `None` only then, when no handle is left.
    region: Mutex<Option<MbufRegion>>,
    /// The region's address, fixed while the buffer lives: [`Mbuf::data`] takes no lock.
    addr: usize,
    pool: Arc<Pool>,
    kind: MbufKind,
    /// Written in the header at alloc, and in the descriptors the buffer publishes.
    id: u32,
    /// Bytes of data, as written in the header at alloc: the bound every length is checked
    /// against, never read back from the header (which other processes can write).
    size: u64,
}

impl MbufInner {
    /// The region, for the pool, with the header's magic cleared first: a descriptor of
    /// this buffer is refused from then on (see the module docs).
    fn take_region(&self) -> Option<MbufRegion> {
        let region = self
            .region
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()?;
        let zeros = [0u8; MAGIC.len()];
        // Not through the region's copy, which would wait for the streams the buffer was
        // recorded on, and so hold its free up. A failure leaves the id check alone to
        // refuse stale descriptors.
        // SAFETY: the region is live (taken here, given back after), and its first 8 bytes
        // are the header's, which no stream work writes or reads: `record_stream` covers
        // the data area, after the header, and no handle is left to touch the header.
        let _ = unsafe {
            self.pool.source().memcpy(
                region.addr(),
                zeros.len() as u64,
                zeros.as_ptr() as usize,
                zeros.len() as u64,
                crate::source::MemcpyKind::HostToDevice,
            )
        };
        Some(region)
    }
}

impl Drop for MbufInner {
    fn drop(&mut self) {
        // The region goes back here, before the pool handle (a field, dropped after).
        drop(self.take_region());
    }
}

/// A shared buffer; clones are references to the same data (see the module docs).
#[derive(Debug, Clone)]
pub struct Mbuf {
    inner: Arc<MbufInner>,
}

fn out_of_bounds(offset: u64, len: u64, capacity: u64) -> Error {
    Error::OutOfBounds {
        offset,
        len,
        capacity,
        side: None,
    }
}

/// `len`, a valid data length read from a header, if it lies within `size` bytes of data.
fn checked_data_len(len: u64, size: u64) -> Result<u64> {
    if len > size {
        return Err(out_of_bounds(0, len, size));
    }
    Ok(len)
}

/// The header bytes `len` bytes at `offset` of the user data cover, if they fit in the 96.
fn user_range(offset: u64, len: usize) -> Result<u64> {
    let cap = USER_DATA_LEN as u64;
    match offset.checked_add(len as u64) {
        Some(end) if end <= cap && len > 0 => Ok(USER_DATA_AT + offset),
        _ => Err(out_of_bounds(offset, len as u64, cap)),
    }
}

impl Mbuf {
    /// Allocates a buffer of `size` data bytes of `kind` from `pool` (`acltdtAllocBuf`).
    pub fn alloc(pool: &Arc<Pool>, size: u64, kind: MbufKind) -> Result<Self> {
        if size == 0 {
            return Err(Error::Carve(crate::align::CarveRuleError::ZeroLength));
        }
        let total = size.checked_add(HEADER_LEN).ok_or(Error::Carve(
            crate::align::CarveRuleError::LengthOverflow { len: size },
        ))?;
        let region = match kind {
            MbufKind::Normal => MbufRegion::Normal(pool.alloc_model_input(total)?),
            MbufKind::Dvpp => MbufRegion::Dvpp(pool.alloc_dvpp(total)?),
        };
        let addr = region.addr();
        let buf = Self {
            inner: Arc::new(MbufInner {
                region: Mutex::new(Some(region)),
                addr,
                pool: Arc::clone(pool),
                kind,
                size,
                id: next_id(),
            }),
        };
        let mut header = [0u8; HEADER_LEN as usize];
        header[..8].copy_from_slice(MAGIC);
        header[8..16].copy_from_slice(&size.to_le_bytes());
        header[24..28].copy_from_slice(&u32::from(kind == MbufKind::Dvpp).to_le_bytes());
        header[ID_AT..ID_AT + 4].copy_from_slice(&buf.inner.id.to_le_bytes());
        buf.put(0, &header)?;
        Ok(buf)
    }

    /// The region, locked; in a child made by `fork`, a buffer of the parent's pool is
    /// refused with [`Error::Forked`] before the lock is taken: a parent thread inside a
    /// copy, waiting for a stream, held it across the fork, for good.
    fn region(&self) -> Result<MutexGuard<'_, Option<MbufRegion>>> {
        self.inner.pool.inner.ours()?;
        Ok(self.inner.region.lock().unwrap_or_else(|p| p.into_inner()))
    }

    fn put(&self, at: u64, data: &[u8]) -> Result<()> {
        let pool = &self.inner.pool;
        match self.region()?.as_mut().expect(HELD) {
            MbufRegion::Normal(r) => pool.copy_from_host(r, at, data),
            MbufRegion::Dvpp(r) => pool.copy_from_host(r, at, data),
        }
    }

    fn get(&self, at: u64, out: &mut [u8]) -> Result<()> {
        let pool = &self.inner.pool;
        match self.region()?.as_ref().expect(HELD) {
            MbufRegion::Normal(r) => pool.copy_to_host(r, at, out),
            MbufRegion::Dvpp(r) => pool.copy_to_host(r, at, out),
        }
    }

    fn data_range(&self, offset: u64, len: usize) -> Result<u64> {
        match offset.checked_add(len as u64) {
            Some(end) if end <= self.inner.size && len > 0 => Ok(HEADER_LEN + offset),
            _ => Err(out_of_bounds(offset, len as u64, self.inner.size)),
        }
    }

    /// The kind of memory.
    pub fn kind(&self) -> MbufKind {
        self.inner.kind
    }

    /// The data area: device address and size (`acltdtGetBufData`).
    pub fn data(&self) -> (usize, u64) {
        (self.inner.addr + HEADER_LEN as usize, self.inner.size)
    }

    /// Copies `data` into the data area at `offset`.
    pub fn write(&self, offset: u64, data: &[u8]) -> Result<()> {
        self.put(self.data_range(offset, data.len())?, data)
    }

    /// Copies data from `offset` into `out`.
    pub fn read(&self, offset: u64, out: &mut [u8]) -> Result<()> {
        self.get(self.data_range(offset, out.len())?, out)
    }

    /// Sets the valid data length, at most the size (`acltdtSetBufDataLen`).
    pub fn set_data_len(&self, len: u64) -> Result<()> {
        if len > self.inner.size {
            return Err(out_of_bounds(0, len, self.inner.size));
        }
        self.put(16, &len.to_le_bytes())
    }

    /// The valid data length (`acltdtGetBufDataLen`). A length past the size, which another
    /// process wrote into the header through a mapping of it, is refused with
    /// [`Error::OutOfBounds`] (offset 0, that length, the size), as setting it is.
    pub fn data_len(&self) -> Result<u64> {
        let mut b = [0u8; 8];
        self.get(16, &mut b)?;
        checked_data_len(u64::from_le_bytes(b), self.inner.size)
    }

    /// Writes user data at `offset` of the 96 bytes (`acltdtSetBufUserData`).
    pub fn set_user_data(&self, data: &[u8], offset: u64) -> Result<()> {
        self.put(user_range(offset, data.len())?, data)
    }

    /// Reads user data from `offset` of the 96 bytes (`acltdtGetBufUserData`).
    pub fn user_data(&self, out: &mut [u8], offset: u64) -> Result<()> {
        self.get(user_range(offset, out.len())?, out)
    }

    /// Marks the buffer as used by work queued on `stream` on its [`data`](Self::data) area
    /// (a model's input, a DVPP call): the memory goes back to the pool, with the last
    /// handle, only once that work has run, and the buffer's own reads and writes wait for
    /// it. Call it before queuing the work. A stream of another source or device is refused
    /// with [`Error::ForeignHandle`], as for a region.
    pub fn record_stream(&self, stream: &Stream) -> Result<()> {
        match self.region()?.as_ref().expect(HELD) {
            MbufRegion::Normal(r) => r.record_stream(stream),
            MbufRegion::Dvpp(r) => r.record_stream(stream),
        }
    }

    /// Lets go of this handle (`acltdtFreeBuf`), as dropping it does. With the last handle
    /// the region goes back to the pool now, and in debug mode a padding overrun is returned
    /// as [`Error::Corruption`], as [`DeviceRegion::free`] returns one: the buffer is freed all
    /// the same, and the report is also kept for [`Pool::take_corruption_reports`], the only
    /// place a dropped last handle can leave it. With other handles alive this is `Ok`.
    ///
    /// ```
    /// use ascend_pool::mbuf::{Mbuf, MbufKind};
    /// use ascend_pool::{Pool, PoolConfig, SimSource};
    /// use std::sync::Arc;
    ///
    /// let pool = Arc::new(Pool::new(Arc::new(SimSource::default()), PoolConfig::default())?);
    /// let buf = Mbuf::alloc(&pool, 64, MbufKind::Normal)?;
    /// let copy = buf.clone();
    /// buf.free()?;
    /// assert_eq!(copy.refs(), 1);
    /// copy.free()?; // the last handle: the region goes back
    /// assert_eq!(pool.stats(ascend_pool::MemKind::DEVICE).live_regions, 0);
    /// # Ok::<(), ascend_pool::Error>(())
    /// ```
    pub fn free(self) -> Result<()> {
        // Of handles let go through `free` at once, exactly one gets the buffer; a handle
        // dropped meanwhile may be the last instead, and its drop reports to the pool.
        let Some(inner) = Arc::into_inner(self.inner) else {
            return Ok(());
        };
        let region = inner.take_region().expect(HELD);
        let freed = match region {
            MbufRegion::Normal(r) => r.free(),
            MbufRegion::Dvpp(r) => r.free(),
        };
        // The pool handle goes after the region, as in a drop (see `MbufInner::region`).
        drop(inner);
        freed
    }

    /// Handles on this buffer alive (this one included).
    pub fn refs(&self) -> usize {
        Arc::strong_count(&self.inner)
    }

    /// Whether `other` is a handle on this buffer (a clone of this one, or of one it was
    /// cloned from). Locks nothing: a handle busy with a copy does not hold it up.
    pub fn same_buffer(&self, other: &Mbuf) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }

    /// Authorises other processes to read the buffer: `vmm` must be the source of the pool
    /// the buffer came from. DVPP buffers are refused ([`Error::WrongKind`]).
    pub fn publish<R: VmmRuntime + 'static>(
        &self,
        vmm: &VmmSource<R>,
        access: &Access,
    ) -> Result<ShareDescriptor> {
        match self.region()?.as_ref().expect(HELD) {
            MbufRegion::Normal(r) => vmm.publish_region(r, access).map(|d| ShareDescriptor {
                buffer: u64::from(self.inner.id),
                ..d
            }),
            // DVPP memory cannot be shared between processes.
            MbufRegion::Dvpp(r) => Err(Error::WrongKind {
                expected: "device",
                got: r.kind(),
            }),
        }
    }
}

/// A buffer another process published, opened read-only.
#[derive(Debug)]
pub struct SharedMbuf<R: VmmRuntime> {
    mapping: SharedMapping<R>,
    /// Bytes of data: the header's size as [`open`](Self::open) checked it against the
    /// published length, never read again (the header stays writable by other processes).
    size: u64,
}

impl<R: VmmRuntime> SharedMbuf<R> {
    /// Opens what [`Mbuf::publish`] described. Memory that is not a buffer (no header, or a
    /// header whose size does not match what was published), or not the buffer published
    /// (freed since, or another allocated there since: the header's id is not the
    /// descriptor's), is refused with [`Error::ForeignHandle`], and nothing stays imported.
    pub fn open(runtime: Arc<R>, device: DeviceId, desc: &ShareDescriptor) -> Result<Self> {
        let mapping = SharedMapping::open(runtime, device, desc)?;
        let mut head = [0u8; ID_AT + 4];
        // A buffer holds at least one byte of data after its header.
        if mapping.len() <= HEADER_LEN {
            return Err(Error::ForeignHandle);
        }
        mapping.read(0, &mut head)?;
        let size = u64::from_le_bytes(head[8..16].try_into().expect("8 bytes"));
        let id = u32::from_le_bytes(head[ID_AT..].try_into().expect("4 bytes"));
        if &head[..8] != MAGIC
            || size.checked_add(HEADER_LEN) != Some(mapping.len())
            || desc.buffer == 0
            || u64::from(id) != desc.buffer
        {
            return Err(Error::ForeignHandle);
        }
        Ok(Self { mapping, size })
    }

    /// Bytes of data.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// The valid data length the primary set. The header can be written by any process
    /// holding the descriptor, so a length past [`size`](Self::size) is refused with
    /// [`Error::OutOfBounds`] (offset 0, that length, the size), as the primary's
    /// [`Mbuf::set_data_len`] refuses it.
    pub fn data_len(&self) -> Result<u64> {
        let mut b = [0u8; 8];
        self.mapping.read(16, &mut b)?;
        checked_data_len(u64::from_le_bytes(b), self.size)
    }

    /// Reads user data from `offset` of the 96 bytes.
    pub fn user_data(&self, out: &mut [u8], offset: u64) -> Result<()> {
        self.mapping.read(user_range(offset, out.len())?, out)
    }

    /// Reads data from `offset`.
    pub fn read(&self, offset: u64, out: &mut [u8]) -> Result<()> {
        match offset.checked_add(out.len() as u64) {
            Some(end) if end <= self.size && !out.is_empty() => {
                self.mapping.read(HEADER_LEN + offset, out)
            }
            _ => Err(out_of_bounds(offset, out.len() as u64, self.size)),
        }
    }

    /// Unmaps the buffer and frees what was imported (see [`SharedMapping::close`]).
    pub fn close(self) -> Result<()> {
        self.mapping.close()
    }

    /// Closes the buffer and keeps it, so that a close the runtime refused can be tried
    /// again (see [`SharedMapping::try_close`]).
    pub fn try_close(&mut self) -> Result<()> {
        self.mapping.try_close()
    }
}
