//! Block sources: the one seam between the pool and a runtime.
//!
//! A [`BlockSource`] hands out big blocks of one memory kind and runs the few
//! runtime operations the pool and its regions need (streams, events, copies,
//! fills). Two sources exist:
//! - [`SimSource`], the default: a faithful AscendCL simulator on host memory;
//! - [`AclSource`], the real runtime loaded at run time;
//!
//! and one that composes over either: [`VmmSource`], device blocks mapped into one
//! reserved address range, which can grow in place.
//!
//! Addresses are plain `usize` values: device addresses are never dereferenced
//! by the pool, only passed back to the source.

pub mod acl;
pub mod sim;
pub mod vmm;

pub use acl::AclSource;
pub use sim::SimSource;
pub use vmm::{VmmRuntime, VmmSource};

use crate::error::Result;
use crate::kind::MemKind;

/// A device ordinal as `aclrtSetDevice` takes it.
pub type DeviceId = i32;

/// `Ok` unless `source` tells how many devices it has ([`BlockSource::device_count`]) and
/// `device` is not one of them: [`Error::Config`](crate::Error::Config) then, for a pool or
/// a reservation made for it would be refused every call with `ACL_ERROR_RT_PARAM_INVALID`.
pub(crate) fn has_device(source: &dyn BlockSource, device: DeviceId) -> Result<()> {
    match source.device_count() {
        Some(n) if u32::try_from(device).map_or(true, |d| d >= n) => {
            Err(crate::Error::Config(format!(
                "device {device} is not one of the {n} devices (0..{n}) of the source {}",
                source.name()
            )))
        }
        _ => Ok(()),
    }
}

/// A big block handed out by a source.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Block {
    /// Start address (64-aligned, 128 for DVPP).
    pub addr: usize,
    /// Usable bytes: what was asked for, not the runtime's rounding.
    pub size: u64,
    /// Kind of memory.
    pub kind: MemKind,
    /// Device the block lives on (ignored for host memory).
    pub device: DeviceId,
}

/// An opaque stream handle (`aclrtStream`, or the simulator's id).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct StreamHandle(pub usize);

/// An opaque event handle (`aclrtEvent`, or the simulator's id).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct EventHandle(pub usize);

/// A communication thread (HCOMM's `ThreadHandle`): work queued on it runs in order on the
/// stream it was acquired with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct CommThreadHandle(pub u64);

/// A communication channel to one remote rank (HCOMM's `ChannelHandle`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ChannelHandle(pub u64);

/// `aclrtMemcpyKind`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum MemcpyKind {
    /// `ACL_MEMCPY_HOST_TO_HOST`.
    HostToHost = 0,
    /// `ACL_MEMCPY_HOST_TO_DEVICE`.
    HostToDevice = 1,
    /// `ACL_MEMCPY_DEVICE_TO_HOST`.
    DeviceToHost = 2,
    /// `ACL_MEMCPY_DEVICE_TO_DEVICE`.
    DeviceToDevice = 3,
    /// `ACL_MEMCPY_DEFAULT`: the runtime infers the direction.
    Default = 4,
}

impl MemcpyKind {
    /// The kind for a copy from memory of kind `src` to memory of kind `dst`.
    pub fn between(dst: MemKind, src: MemKind) -> Self {
        match (dst.is_device(), src.is_device()) {
            (true, true) => Self::DeviceToDevice,
            (true, false) => Self::HostToDevice,
            (false, true) => Self::DeviceToHost,
            (false, false) => Self::HostToHost,
        }
    }
}

/// A runtime that hands out big blocks and runs copies on streams.
///
/// Every method answers bad input (size 0, an unknown address, a destroyed
/// handle) with an [`Error::Runtime`](crate::Error::Runtime) carrying the
/// AscendCL function name and the `aclError` code the real runtime returns.
pub trait BlockSource: Send + Sync + std::fmt::Debug {
    /// A short name for reports (`"sim"`, `"acl:/usr/local/Ascend/..."`).
    fn name(&self) -> &str;

    /// Allocates a block of `size` usable bytes of `kind` on `device`.
    fn alloc_block(&self, device: DeviceId, kind: MemKind, size: u64) -> Result<Block>;

    /// Frees a block this source handed out. A block it does not know is refused.
    fn free_block(&self, block: Block) -> Result<()>;

    /// Grows `block` where it is to `block.size + additional` bytes, keeping its address.
    ///
    /// `Ok(None)` when the source cannot (the default, and when the addresses after the
    /// block are taken): the caller takes a new block instead. On an error nothing changed.
    fn extend_block(&self, block: Block, additional: u64) -> Result<Option<Block>> {
        let _ = (block, additional);
        Ok(None)
    }

    /// Gives back memory past the first `new_size` bytes of `block` where the source can
    /// (whole granules) and returns the block as kept: at least `new_size` bytes, more where
    /// memory past them stays mapped (a granule straddling the new end), unchanged when it
    /// cannot shrink (the default). A `new_size` of 0 is refused where the source can shrink
    /// (free the block instead). On an error nothing changed.
    fn shrink_block(&self, block: Block, new_size: u64) -> Result<Block> {
        let _ = new_size;
        Ok(block)
    }

    /// Free and total bytes of `kind` on `device` (`aclrtGetMemInfo`).
    fn mem_info(&self, device: DeviceId, kind: MemKind) -> Result<(u64, u64)>;

    /// Creates a stream on `device`.
    fn create_stream(&self, device: DeviceId) -> Result<StreamHandle>;
    /// Destroys a stream after its queued work has run.
    fn destroy_stream(&self, stream: StreamHandle) -> Result<()>;
    /// Blocks until all work queued on `stream` has run.
    fn synchronize_stream(&self, stream: StreamHandle) -> Result<()>;

    /// Creates an event on `device`.
    fn create_event(&self, device: DeviceId) -> Result<EventHandle>;
    /// Destroys an event.
    fn destroy_event(&self, event: EventHandle) -> Result<()>;
    /// Records `event` on `stream`: it completes when the work queued before it has run.
    fn record_event(&self, event: EventHandle, stream: StreamHandle) -> Result<()>;
    /// Whether `event` has completed (`aclrtQueryEventStatus`). An event never recorded counts as complete.
    fn query_event(&self, event: EventHandle) -> Result<bool>;
    /// Blocks until `event` has completed.
    fn synchronize_event(&self, event: EventHandle) -> Result<()>;
    /// Makes work queued on `stream` after this call wait for `event`.
    fn stream_wait_event(&self, stream: StreamHandle, event: EventHandle) -> Result<()>;

    /// Copies `count` bytes from `src` to `dst` and waits for the copy (`aclrtMemcpy`).
    ///
    /// Between device memory of two devices the runtime copies only once peer access is
    /// enabled between them, which no source here does: the simulator and its drop-in refuse
    /// such a pair with `ACL_ERROR_INVALID_PARAM`, and so does `memcpy_async`.
    ///
    /// # Safety
    /// `dst` must be valid for `dst_max` bytes and `src` for `count` bytes in the memory
    /// `kind` names, and the ranges must not be in use by anything else during the copy.
    unsafe fn memcpy(
        &self,
        dst: usize,
        dst_max: u64,
        src: usize,
        count: u64,
        kind: MemcpyKind,
    ) -> Result<()>;

    /// Queues a copy on `stream` and returns at once (`aclrtMemcpyAsync`).
    ///
    /// # Safety
    /// As [`BlockSource::memcpy`], and both ranges must stay valid and untouched by the
    /// host until the stream has passed the copy.
    unsafe fn memcpy_async(
        &self,
        dst: usize,
        dst_max: u64,
        src: usize,
        count: u64,
        kind: MemcpyKind,
        stream: StreamHandle,
    ) -> Result<()>;

    /// Fills `count` bytes at `dst` with `value` and waits (`aclrtMemset`).
    ///
    /// # Safety
    /// `dst` must be valid for `max` bytes of device or host memory from this source.
    unsafe fn memset(&self, dst: usize, max: u64, value: u8, count: u64) -> Result<()>;

    /// Queues a fill on `stream` (`aclrtMemsetAsync`).
    ///
    /// # Safety
    /// As [`BlockSource::memset`], and the range must stay valid until the stream has passed it.
    unsafe fn memset_async(
        &self,
        dst: usize,
        max: u64,
        value: u8,
        count: u64,
        stream: StreamHandle,
    ) -> Result<()>;

    /// The one device whose device memory this source gives, when it serves only one (a
    /// [`VmmSource`] maps the memory of its own device); `None` (the default) for a source of
    /// every device. A pool of another device is refused ([`Pool::new`](crate::Pool::new)).
    #[doc(hidden)]
    fn only_device(&self) -> Option<DeviceId> {
        None
    }

    /// How many devices the source has (ids `0..n`), when it can tell; `None` (the default)
    /// when it cannot. A pool of a device outside them is refused
    /// ([`Pool::new`](crate::Pool::new)). [`AclSource`] asks `aclrtGetDeviceCount`, and
    /// answers `None` from a runtime without it.
    fn device_count(&self) -> Option<u32> {
        None
    }

    /// The simulator this source runs on (a [`SimSource`], or a source over one), by an id
    /// unique in the process; `None` for the real runtime (the default). A handle read from
    /// one simulator, such as a window ([`RemoteWindow::of_sim`](crate::comm::RemoteWindow::of_sim)),
    /// is checked by that simulator alone, so the pool gives it to no other source.
    #[doc(hidden)]
    fn simulator_id(&self) -> Option<u64> {
        None
    }

    /// A communication thread whose work runs on `stream`, as a communicator's
    /// `HcclThreadAcquireWithStream` gives one. Only the simulator acquires threads itself;
    /// on the real runtime the application's communicator does, and the handle comes in
    /// through [`CommThread::from_raw`](crate::comm::CommThread::from_raw). The default
    /// answers [`Error::NotSupported`](crate::Error::NotSupported).
    fn acquire_comm_thread(&self, stream: StreamHandle) -> Result<CommThreadHandle> {
        let _ = stream;
        Err(crate::Error::NotSupported {
            func: "HcclThreadAcquireWithStream",
        })
    }

    /// Registers `len` bytes at `addr`, device memory of `device`, as a window other ranks
    /// write one-sided. Only the simulator registers windows itself; on the real runtime the
    /// application's communicator does. The default answers
    /// [`Error::NotSupported`](crate::Error::NotSupported).
    ///
    /// # Safety
    /// Nothing else may use the bytes until [`deregister_window`](Self::deregister_window)
    /// has returned (see [`SimSource::register_window`](sim::SimSource::register_window)).
    #[doc(hidden)]
    unsafe fn register_window(&self, device: DeviceId, addr: usize, len: u64) -> Result<()> {
        let _ = (device, addr, len);
        Err(crate::Error::NotSupported {
            func: "ascendSimRegisterWindow",
        })
    }

    /// Deregisters the window registered at `addr`: no write lands in it once this has
    /// returned. The default answers [`Error::NotSupported`](crate::Error::NotSupported).
    #[doc(hidden)]
    fn deregister_window(&self, addr: usize) -> Result<()> {
        let _ = addr;
        Err(crate::Error::NotSupported {
            func: "ascendSimDeregisterWindow",
        })
    }

    /// Queues a one-sided write of `len` bytes from `src`, memory of this process, to `dst`,
    /// memory of the remote rank `channel` leads to, on the stream `thread` runs on
    /// (`HcommWriteOnThread`). Returns once queued. The default answers
    /// [`Error::NotSupported`](crate::Error::NotSupported).
    ///
    /// # Safety
    /// `src` must be valid for `len` bytes of this source's memory and stay untouched by the
    /// host and valid until the thread's stream has passed the write; `dst..dst + len` must
    /// lie in memory the remote rank registered for one-sided access and nothing else may use
    /// meanwhile.
    unsafe fn write_on_thread(
        &self,
        thread: CommThreadHandle,
        channel: ChannelHandle,
        dst: usize,
        src: usize,
        len: u64,
    ) -> Result<()> {
        let _ = (thread, channel, dst, src, len);
        Err(crate::Error::NotSupported {
            func: "HcommWriteOnThread",
        })
    }
}
