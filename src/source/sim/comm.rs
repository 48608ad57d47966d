//! One-sided communication between ranks: HCOMM's `HcommWriteOnThread`, simulated.
//!
//! Every simulated device is a rank of one communicator, so a pipeline can develop its
//! one-sided writes with all its ranks in one process, a pool per device:
//! - [`SimSource::register_window`] registers device memory that other ranks may write;
//!   like HCCL, it needs the start and the length at multiples of 2 MiB;
//! - [`SimSource::acquire_channel`] opens a channel from one rank to another, and
//!   [`SimSource::channel_windows`] lists what the far end registered (what
//!   `HcclChannelGetHcclBuffer` tells a real caller);
//! - [`BlockSource::acquire_comm_thread`] gives a thread whose work runs on a stream;
//! - [`BlockSource::write_on_thread`] queues the write on that stream, checked like the
//!   runtime checks a copy: the whole source range in live device memory of the thread's
//!   device, the whole destination inside one window of the channel's far end.
//!
//! Refusals are [`Error::Runtime`] with an `HcclResult` code: `HCCL_E_PARA` for a range,
//! device or length the call refuses, `HCCL_E_NOT_FOUND` for an unknown thread, channel or
//! window. Notifications (`HcommChannelNotifyRecordOnThread` and the waits) are not
//! simulated: ranks in one process order their work with the streams' events.

use std::collections::{BTreeMap, HashMap};

use super::stream::Op;
use super::{lock, AclFunc, SimSource};
use crate::error::{AclError, Error, Result};
use crate::source::{ChannelHandle, CommThreadHandle, DeviceId, StreamHandle};

/// The granule HCCL registers memory in: a window's start and length are multiples of it.
pub const WINDOW_GRANULE: u64 = 2 << 20;

/// Threads, channels and windows of the simulated communicator.
#[derive(Debug, Default)]
pub(super) struct CommState {
    /// Each thread's stream. Ids are never reused, so a stale handle stays unknown.
    threads: HashMap<u64, StreamHandle>,
    /// Each channel's two ranks, `(local, remote)`.
    channels: HashMap<u64, (DeviceId, DeviceId)>,
    /// Registered windows by start address: `(device, len)`. Windows never overlap.
    windows: BTreeMap<usize, (DeviceId, u64)>,
    /// Last thread or channel id handed out (0 is never one).
    last_id: u64,
}

impl CommState {
    fn next_id(&mut self) -> u64 {
        self.last_id += 1;
        self.last_id
    }

    /// Whether `addr..addr + len` lies inside one window registered by `device`.
    fn in_window(&self, device: DeviceId, addr: usize, len: u64) -> bool {
        let Some((&start, &(owner, wlen))) = self.windows.range(..=addr).next_back() else {
            return false;
        };
        let offset = (addr - start) as u64;
        owner == device && offset.checked_add(len).is_some_and(|end| end <= wlen)
    }
}

impl SimSource {
    /// Registers `len` bytes at `addr`, device memory of `device`, as a window other ranks
    /// may write with [`BlockSource::write_on_thread`].
    ///
    /// # Errors
    /// [`Error::Misaligned`] when `addr` or `len` is not a multiple of 2 MiB (HCCL's rule);
    /// [`Error::Invalid`] when `len` is 0, the range is not live device memory of `device`,
    /// or it overlaps a window already registered.
    ///
    /// [`BlockSource::write_on_thread`]: crate::source::BlockSource::write_on_thread
    pub fn register_window(&self, device: DeviceId, addr: usize, len: u64) -> Result<()> {
        for value in [addr as u64, len] {
            if value % WINDOW_GRANULE != 0 {
                return Err(Error::Misaligned {
                    addr: value,
                    required: WINDOW_GRANULE,
                });
            }
        }
        if len == 0 {
            return Err(Error::Invalid("a window of 0 bytes".into()));
        }
        let mut keep = Vec::new();
        let on_device = {
            let mem = lock(&self.mem);
            mem.range(addr, len, true, &mut keep).is_ok()
                && mem
                    .block_containing(addr)
                    .is_some_and(|b| b.device == device)
        };
        if !on_device {
            return Err(Error::Invalid(format!(
                "{len} bytes at {addr:#x} are not live device memory of device {device}"
            )));
        }
        let mut comm = lock(&self.comm);
        let end = addr as u64 + len;
        let before = comm.windows.range(..end as usize).next_back();
        if before.is_some_and(|(&s, &(_, l))| s as u64 + l > addr as u64) {
            return Err(Error::Invalid(format!(
                "the window at {addr:#x} overlaps one already registered"
            )));
        }
        comm.windows.insert(addr, (device, len));
        Ok(())
    }

    /// Removes the window registered at `addr`; writes into it are refused from now on.
    /// Writes already queued still land. Fails with [`Error::Invalid`] when no window
    /// starts at `addr`.
    pub fn deregister_window(&self, addr: usize) -> Result<()> {
        lock(&self.comm)
            .windows
            .remove(&addr)
            .map(|_| ())
            .ok_or_else(|| Error::Invalid(format!("no window is registered at {addr:#x}")))
    }

    /// A channel from rank `local` to rank `remote` (two simulated devices), as
    /// `HcclChannelAcquire` opens one. Refused (`HCCL_E_PARA`) for a device the simulator
    /// lacks or a channel from a rank to itself.
    pub fn acquire_channel(&self, local: DeviceId, remote: DeviceId) -> Result<ChannelHandle> {
        self.call(AclFunc::ChannelAcquire, || {
            if !self.valid_device(local) || !self.valid_device(remote) || local == remote {
                return Err(AclError::HCCL_E_PARA);
            }
            let mut comm = lock(&self.comm);
            let id = comm.next_id();
            comm.channels.insert(id, (local, remote));
            Ok(ChannelHandle(id))
        })
    }

    /// The windows the far end of `channel` has registered, as `(start, length)` in address
    /// order: what `HcclChannelGetHcclBuffer` tells a caller of the real library. Refused
    /// (`HCCL_E_NOT_FOUND`) for a channel this simulator did not open.
    pub fn channel_windows(&self, channel: ChannelHandle) -> Result<Vec<(usize, u64)>> {
        let comm = lock(&self.comm);
        let &(_, remote) = comm.channels.get(&channel.0).ok_or(Error::Runtime {
            func: "HcclChannelGetHcclBuffer",
            code: AclError::HCCL_E_NOT_FOUND,
        })?;
        Ok(comm
            .windows
            .iter()
            .filter(|(_, &(device, _))| device == remote)
            .map(|(&start, &(_, len))| (start, len))
            .collect())
    }

    /// [`BlockSource::acquire_comm_thread`](crate::source::BlockSource::acquire_comm_thread).
    pub(super) fn comm_thread(&self, stream: StreamHandle) -> Result<CommThreadHandle> {
        self.call(AclFunc::ThreadAcquireWithStream, || {
            self.stream(stream).map_err(|_| AclError::HCCL_E_PARA)?;
            let mut comm = lock(&self.comm);
            let id = comm.next_id();
            comm.threads.insert(id, stream);
            Ok(CommThreadHandle(id))
        })
    }

    /// [`BlockSource::write_on_thread`](crate::source::BlockSource::write_on_thread).
    pub(super) fn write_on(
        &self,
        thread: CommThreadHandle,
        channel: ChannelHandle,
        dst: usize,
        src: usize,
        len: u64,
    ) -> Result<()> {
        self.call(AclFunc::WriteOnThread, || {
            if dst == 0 || src == 0 {
                return Err(AclError::HCCL_E_PTR);
            }
            let (stream, (local, remote), in_window) = {
                let comm = lock(&self.comm);
                let stream = *comm
                    .threads
                    .get(&thread.0)
                    .ok_or(AclError::HCCL_E_NOT_FOUND)?;
                let ends = *comm
                    .channels
                    .get(&channel.0)
                    .ok_or(AclError::HCCL_E_NOT_FOUND)?;
                (stream, ends, comm.in_window(ends.1, dst, len))
            };
            // A thread whose stream is gone has nowhere to run.
            let s = self
                .stream(stream)
                .map_err(|_| AclError::HCCL_E_NOT_FOUND)?;
            if len == 0 || !in_window || s.device() != local {
                return Err(AclError::HCCL_E_PARA);
            }
            let count = usize::try_from(len).map_err(|_| AclError::HCCL_E_PARA)?;
            let mut keep = Vec::with_capacity(2);
            {
                let mem = lock(&self.mem);
                mem.range(src, len, true, &mut keep)
                    .map_err(|_| AclError::HCCL_E_PARA)?;
                mem.range(dst, len, true, &mut keep)
                    .map_err(|_| AclError::HCCL_E_PARA)?;
                let device_of = |a| mem.block_containing(a).map(|b| b.device);
                if device_of(src) != Some(local) || device_of(dst) != Some(remote) {
                    return Err(AclError::HCCL_E_PARA);
                }
            }
            let op = Op::Copy {
                dst,
                src,
                count,
                cost: self.config.cost(len),
                keep,
            };
            s.push(op).then_some(()).ok_or(AclError::HCCL_E_NOT_FOUND)
        })
    }
}
