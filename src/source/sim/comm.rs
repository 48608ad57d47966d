//! One-sided communication between ranks: HCOMM's `HcommWriteOnThread` and the channels'
//! notifications, simulated.
//!
//! Every simulated device is a rank of one communicator, so a pipeline can develop its
//! one-sided writes with all its ranks in one process, a pool per device:
//! - [`SimSource::register_window`] registers device memory that other ranks may write;
//!   like HCCL, it needs the start and the length at multiples of 2 MiB. It is `unsafe`,
//!   since the simulator sees blocks, not a pool's regions: a pool registers a region with
//!   [`Pool::register_window`](crate::Pool::register_window), which holds the region until
//!   [`deregister_window`](SimSource::deregister_window) has returned (after which no write
//!   lands in it);
//! - [`SimSource::acquire_channel`] opens a channel from one rank to another, and
//!   [`SimSource::channel_windows`] lists what the far end registered (what
//!   `HcclChannelGetHcclBuffer` tells a real caller);
//! - [`BlockSource::acquire_comm_thread`] gives a thread whose work runs on a stream;
//! - [`BlockSource::write_on_thread`] queues the write on that stream, checked like the
//!   runtime checks a copy: the whole source range in live device memory of the thread's
//!   device, the whole destination inside one window of the channel's far end;
//! - [`SimSource::notify_record_on_thread`] and [`SimSource::notify_wait_on_thread`] are
//!   the channels' notifications (`HcommChannelNotifyRecordOnThread`,
//!   `HcommChannelNotifyWaitOnThread`), queued on a thread's stream like the writes: the
//!   record sets notification `i` of the far end's channel back to this rank, and a wait on
//!   notification `i` of a channel holds the thread's stream until the far end has recorded
//!   it (each record lets one wait through), or fails the stream's task after the timeout.
//!   A rank writes, then records; the far end waits, then reads what was written.
//!
//! Refusals are [`Error::Runtime`] with an `HcclResult` code: `HCCL_E_PARA` for a range,
//! device, length or notification index the call refuses, `HCCL_E_NOT_FOUND` for an
//! unknown thread, channel or window. A wait that times out makes the stream's next
//! `aclrtSynchronizeStream` fail with `ACL_ERROR_RT_FAILURE`, once.

use std::collections::{BTreeMap, HashMap};

use std::sync::{Arc, Mutex, PoisonError, RwLock, Weak};
use std::time::Duration;

use super::stream::{Notify, Op};
use super::{lock, AclFunc, SimSource};
use crate::error::{AclError, Error, Result};
use crate::source::{ChannelHandle, CommThreadHandle, DeviceId, StreamHandle};

/// The granule HCCL registers memory in: a window's start and length are multiples of it.
pub const WINDOW_GRANULE: u64 = 2 << 20;

/// Notifications each way of a channel [`SimSource::acquire_channel`] opens. HCCL takes the
/// number in each channel's description (`notifyNum`); this is the simulator's choice for a
/// channel opened without one ([`SimSource::acquire_channel_with`] takes one).
pub const CHANNEL_NOTIFIES: u32 = 8;

/// A channel's ends and its notifications each way.
#[derive(Debug, Clone, Copy)]
struct Channel {
    local: DeviceId,
    remote: DeviceId,
    /// Valid notification indices are `0..notifies`.
    notifies: u32,
}

/// A registered window: its rank, its length, and whether it still takes writes.
#[derive(Debug)]
struct Window {
    device: DeviceId,
    len: u64,
    landing: Arc<Landing>,
}

/// Whether one window still takes the writes queued into it. A write looks as it lands,
/// holding the flag shared; deregistration, and a free or unmap of the memory under the
/// window, clear it exclusively, so they wait only for a write landing at that moment,
/// never for one still queued (which may wait for a notification only the deregistering
/// or freeing rank would record): that one is dropped when its turn comes, as the runtime
/// fails a write into memory deregistered or let go of meanwhile. A queued write does not
/// keep the window's memory mapped: the flag, cleared before that memory goes, is what
/// keeps it from landing there after.
#[derive(Debug)]
struct Landing {
    open: RwLock<bool>,
}

/// A write queued into a window, which lands only while the window is registered.
#[derive(Debug)]
pub(super) struct Inbound(Arc<Landing>);

impl Inbound {
    /// Runs `write` unless the window was deregistered since the write was queued; `false`
    /// (the write's task failed) then. Deregistration waits for `write` to end.
    pub(super) fn land(&self, write: impl FnOnce()) -> bool {
        let open = self.0.open.read().unwrap_or_else(PoisonError::into_inner);
        if *open {
            write();
        }
        *open
    }
}

impl Landing {
    /// Takes no more writes: waits for one landing at this moment, none queued.
    fn close(&self) {
        *self.open.write().unwrap_or_else(PoisonError::into_inner) = false;
    }
}

/// Where a notification is kept: its communicator (weakly, as the notification outlives a
/// dropped simulator in the ops of a closing stream) and its two ranks.
#[derive(Debug, Clone)]
pub(super) struct NotifyHome {
    comm: Weak<Mutex<CommState>>,
    ranks: (DeviceId, DeviceId),
}

impl NotifyHome {
    /// Forgets the idle notifications between the two ranks unless a channel joins them.
    /// Takes the `comm` lock: called with no lock held.
    pub(super) fn forget_idle(&self) {
        if let Some(comm) = self.comm.upgrade() {
            lock(&comm).forget_idle(self.ranks);
        }
    }
}

/// Threads, channels and windows of the simulated communicator.
#[derive(Debug, Default)]
pub(super) struct CommState {
    /// Each thread's stream, while the stream lives (destroying it forgets its threads).
    /// Ids are never reused, so a stale handle stays unknown.
    pub(super) threads: HashMap<u64, StreamHandle>,
    /// Each channel, by id.
    channels: HashMap<u64, Channel>,
    /// Notifications by `(receiving rank, sending rank, index)`: a record through a
    /// channel from `a` to `b` and a wait through a channel from `b` to `a` meet at
    /// `(b, a, index)`. Made when first used. Once no channel joins its two ranks, one stays
    /// only while in use ([`Notify::in_use`]): the release of the last such channel and the
    /// end of each op that held it ([`NotifyHome::forget_idle`]) forget it when idle.
    notifies: HashMap<(DeviceId, DeviceId, u32), Arc<Notify>>,
    /// Registered windows by start address. Windows never overlap.
    windows: BTreeMap<usize, Window>,
    /// Last thread or channel id handed out (0 is never one).
    last_id: u64,
}

impl CommState {
    fn next_id(&mut self) -> u64 {
        self.last_id += 1;
        self.last_id
    }

    /// The stream `thread` runs on and the channel `channel` names (`HCCL_E_NOT_FOUND` for
    /// either unknown).
    fn endpoints(
        &self,
        thread: CommThreadHandle,
        channel: ChannelHandle,
    ) -> std::result::Result<(StreamHandle, Channel), AclError> {
        let stream = self.threads.get(&thread.0);
        let channel = self.channels.get(&channel.0);
        stream
            .copied()
            .zip(channel.copied())
            .ok_or(AclError::HCCL_E_NOT_FOUND)
    }

    /// Forgets the notifications between ranks `a` and `b` (either way) that are not in use,
    /// unless a channel still joins the two: a later record or wait makes them afresh.
    fn forget_idle(&mut self, (a, b): (DeviceId, DeviceId)) {
        let between = |x: DeviceId, y: DeviceId| (x == a && y == b) || (x == b && y == a);
        if !self.channels.values().any(|c| between(c.local, c.remote)) {
            self.notifies
                .retain(|&(receiver, sender, _), n| !between(receiver, sender) || n.in_use());
        }
    }

    /// Deregisters every window that overlaps `addr..addr + len`: memory let go of. Writes
    /// queued into them land nowhere (see [`Landing`]); called before that memory goes.
    pub(super) fn drop_windows_in(&mut self, addr: usize, len: u64) {
        let end = (addr as u64).saturating_add(len);
        let gone: Vec<usize> = self
            .windows
            .range(..end as usize)
            .rev()
            .take_while(|(&s, w)| s as u64 + w.len > addr as u64)
            .map(|(&s, _)| s)
            .collect();
        for s in gone {
            if let Some(w) = self.windows.remove(&s) {
                // No lock a landing write takes is held by it (it copies bytes only).
                w.landing.close();
            }
        }
    }

    /// When `addr..addr + len` lies inside one window registered by `device`, a write into
    /// it, which lands only while that window is registered.
    fn write_into(&self, device: DeviceId, addr: usize, len: u64) -> Option<Inbound> {
        let (&start, w) = self.windows.range(..=addr).next_back()?;
        let offset = (addr - start) as u64;
        (w.device == device && offset.checked_add(len).is_some_and(|end| end <= w.len))
            .then(|| Inbound(Arc::clone(&w.landing)))
    }
}

impl SimSource {
    /// Registers `len` bytes at `addr`, device memory of `device`, as a window other ranks
    /// may write with [`BlockSource::write_on_thread`]. The window lasts until
    /// [`deregister_window`](Self::deregister_window), or until the memory under it is
    /// freed or unmapped: later writes are refused, whatever is allocated there next, and
    /// writes queued but not yet run land nowhere (their tasks fail), as on deregistration.
    ///
    /// The simulator sees blocks, not what a pool carves from them: a pool's region is
    /// registered with [`Pool::register_window`](crate::Pool::register_window), which keeps
    /// the region alive while it is registered.
    ///
    /// # Safety
    /// Other ranks write the window's bytes whenever their streams reach a write: until
    /// `deregister_window` has returned, nothing else may use them, and the memory must
    /// not be handed to another use (a pool region over it freed, for one), since the
    /// window outlives the region but not the block.
    ///
    /// # Errors
    /// [`Error::Misaligned`] when `addr` or `len` is not a multiple of 2 MiB (HCCL's rule),
    /// naming `addr`, or for a bad `len` the window's end;
    /// [`Error::Invalid`] when `len` is 0, the range is not live device memory of `device`,
    /// or it overlaps a window already registered.
    ///
    /// [`BlockSource::write_on_thread`]: crate::source::BlockSource::write_on_thread
    pub unsafe fn register_window(&self, device: DeviceId, addr: usize, len: u64) -> Result<()> {
        // In a child made by `fork`, before any lock: a parent's thread may have held one.
        self.ours()?;
        // `Misaligned` names an address: the start, else the end a length off the granule
        // puts off it (the start being on it).
        let start = addr as u64;
        for (value, at) in [(start, start), (len, start.saturating_add(len))] {
            if value % WINDOW_GRANULE != 0 {
                return Err(Error::Misaligned {
                    addr: at,
                    required: WINDOW_GRANULE,
                    side: None,
                });
            }
        }
        if len == 0 {
            return Err(Error::Invalid("a window of 0 bytes".into()));
        }
        let mut keep = Vec::new();
        // Held until the window is in: a free of the block cannot slip in between and
        // leave a window on memory let go of (lock order: `mem`, then `comm`).
        let mem = lock(&self.mem);
        let on_device =
            mem.range(addr, len, true, &mut keep).is_ok() && mem.all_on_device(addr, len, device);
        if !on_device {
            return Err(Error::Invalid(format!(
                "{len} bytes at {addr:#x} are not live device memory of device {device}"
            )));
        }
        let mut comm = lock(&self.comm);
        let end = addr as u64 + len;
        let before = comm.windows.range(..end as usize).next_back();
        if before.is_some_and(|(&s, w)| s as u64 + w.len > addr as u64) {
            return Err(Error::Invalid(format!(
                "the window at {addr:#x} overlaps one already registered"
            )));
        }
        let landing = Arc::new(Landing {
            open: RwLock::new(true),
        });
        comm.windows.insert(
            addr,
            Window {
                device,
                len,
                landing,
            },
        );
        Ok(())
    }

    /// Removes the window registered at `addr`: writes into it are refused from now on, and
    /// those queued but not yet run land nowhere (each fails its stream's task, so that
    /// stream's next synchronize reports `ACL_ERROR_RT_FAILURE`, as the runtime fails a
    /// write into memory deregistered meanwhile). Returns once a write landing at this
    /// moment has ended, so no byte lands after it; it never waits for a queued write,
    /// which may wait for a notification only the caller would record.
    /// Fails with [`Error::Invalid`] when no window starts at `addr`.
    pub fn deregister_window(&self, addr: usize) -> Result<()> {
        self.ours()?;
        let window = lock(&self.comm)
            .windows
            .remove(&addr)
            .ok_or_else(|| Error::Invalid(format!("no window is registered at {addr:#x}")))?;
        // Held by a write while it lands: taken once none is landing, and cleared for the
        // writes still queued. No other lock is held here.
        window.landing.close();
        Ok(())
    }

    /// A channel from rank `local` to rank `remote` (two simulated devices), as
    /// `HcclChannelAcquire` opens one, with [`CHANNEL_NOTIFIES`] notifications each way.
    /// Refused (`HCCL_E_PARA`) for a device the simulator lacks or a channel from a rank to
    /// itself.
    pub fn acquire_channel(&self, local: DeviceId, remote: DeviceId) -> Result<ChannelHandle> {
        self.acquire_channel_with(local, remote, CHANNEL_NOTIFIES)
    }

    /// [`acquire_channel`](Self::acquire_channel) with `notifies` notifications each way
    /// (the `notifyNum` of HCCL's channel description): indices `0..notifies`.
    pub fn acquire_channel_with(
        &self,
        local: DeviceId,
        remote: DeviceId,
        notifies: u32,
    ) -> Result<ChannelHandle> {
        self.call(AclFunc::ChannelAcquire, || {
            if !self.valid_device(local) || !self.valid_device(remote) || local == remote {
                return Err(AclError::HCCL_E_PARA);
            }
            let mut comm = lock(&self.comm);
            let id = comm.next_id();
            let channel = Channel {
                local,
                remote,
                notifies,
            };
            comm.channels.insert(id, channel);
            Ok(ChannelHandle(id))
        })
    }

    /// Closes `channel` (HCCL's channels go with their communicator): its handle is unknown
    /// from then on. Writes and notifications already queued through it still run; the
    /// notifications between its two ranks are forgotten once no channel between them is
    /// left, no queued op uses them and no record waits to be taken (a record is never
    /// lost), so a process that opens and closes channels holds a bounded number of them.
    /// One a queued op kept is forgotten when the last such op has run, if it is idle then.
    /// Refused (`HCCL_E_NOT_FOUND`) for a channel this simulator did not open, or closed.
    pub fn release_channel(&self, channel: ChannelHandle) -> Result<()> {
        self.ours()?;
        let mut comm = lock(&self.comm);
        let c = comm.channels.remove(&channel.0).ok_or(Error::Runtime {
            func: "HcclChannelRelease",
            code: AclError::HCCL_E_NOT_FOUND,
        })?;
        comm.forget_idle((c.local, c.remote));
        Ok(())
    }

    /// What the communicator holds: channels, notifications and threads (for tests).
    #[doc(hidden)]
    pub fn comm_entries(&self) -> (usize, usize, usize) {
        let comm = lock(&self.comm);
        (comm.channels.len(), comm.notifies.len(), comm.threads.len())
    }

    /// The windows the far end of `channel` has registered, as `(start, length)` in address
    /// order: what `HcclChannelGetHcclBuffer` tells a caller of the real library. Refused
    /// (`HCCL_E_NOT_FOUND`) for a channel this simulator did not open.
    pub fn channel_windows(&self, channel: ChannelHandle) -> Result<Vec<(usize, u64)>> {
        self.ours()?;
        let comm = lock(&self.comm);
        let remote = comm
            .channels
            .get(&channel.0)
            .ok_or(Error::Runtime {
                func: "HcclChannelGetHcclBuffer",
                code: AclError::HCCL_E_NOT_FOUND,
            })?
            .remote;
        Ok(comm
            .windows
            .iter()
            .filter(|(_, w)| w.device == remote)
            .map(|(&start, w)| (start, w.len))
            .collect())
    }

    /// [`BlockSource::acquire_comm_thread`](crate::source::BlockSource::acquire_comm_thread).
    pub(super) fn comm_thread(&self, stream: StreamHandle) -> Result<CommThreadHandle> {
        self.call(AclFunc::ThreadAcquireWithStream, || {
            // Checked under the comm lock: a destroy of the stream forgets its threads
            // after it, so no thread of a stream gone is left behind.
            let mut comm = lock(&self.comm);
            self.stream(stream).map_err(|_| AclError::HCCL_E_PARA)?;
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
            let (stream, Channel { local, remote, .. }) =
                lock(&self.comm).endpoints(thread, channel)?;
            // A thread whose stream is gone has nowhere to run.
            let s = self
                .stream(stream)
                .map_err(|_| AclError::HCCL_E_NOT_FOUND)?;
            if len == 0 || s.device() != local {
                return Err(AclError::HCCL_E_PARA);
            }
            let count = usize::try_from(len).map_err(|_| AclError::HCCL_E_PARA)?;
            let mut keep = Vec::with_capacity(2);
            let inbound = {
                let mem = lock(&self.mem);
                // The window is looked up under the memory lock (lock order: `mem`, then
                // `comm`): a free or an unmap drops the windows on its memory under that
                // lock, so the memory found below is the window's, not memory mapped at
                // the same address after the window went. The write lands only while the
                // window is registered: a deregistration before it runs drops it.
                let inbound = lock(&self.comm)
                    .write_into(remote, dst, len)
                    .ok_or(AclError::HCCL_E_PARA)?;
                mem.range(src, len, true, &mut keep)
                    .map_err(|_| AclError::HCCL_E_PARA)?;
                // The window's memory is checked, not kept mapped: a free or unmap of it
                // closes the window first, and would otherwise wait for this write, which
                // may wait for a notification only the freeing rank would record.
                mem.range(dst, len, true, &mut Vec::new())
                    .map_err(|_| AclError::HCCL_E_PARA)?;
                // Every byte on its rank's device, not just the first: a run of mappings
                // may join memory of several devices.
                if !mem.all_on_device(src, len, local) || !mem.all_on_device(dst, len, remote) {
                    return Err(AclError::HCCL_E_PARA);
                }
                inbound
            };
            let op = Op::Copy {
                dst,
                src,
                count,
                cost: self.config.cost(len),
                keep,
                inbound: Some(inbound),
            };
            s.push(op).then_some(()).ok_or(AclError::HCCL_E_NOT_FOUND)
        })
    }

    /// `HcommChannelNotifyRecordOnThread`: queues on `thread`'s stream the record of
    /// notification `index` of the far end of `channel` (what the far end's wait on its
    /// channel back to this rank takes). Returns once queued.
    ///
    /// # Errors
    /// [`Error::Runtime`] with `HCCL_E_NOT_FOUND` for an unknown thread or channel, or a
    /// thread whose stream is gone; `HCCL_E_PARA` for an index not below the channel's
    /// notifications, or a thread on another device than the channel's near end.
    pub fn notify_record_on_thread(
        &self,
        thread: CommThreadHandle,
        channel: ChannelHandle,
        index: u32,
    ) -> Result<()> {
        self.call(AclFunc::ChannelNotifyRecordOnThread, || {
            self.queue_notify(
                thread,
                channel,
                index,
                |c| (c.remote, c.local),
                Op::NotifyRecord,
            )
        })
    }

    /// `HcommChannelNotifyWaitOnThread`: queues on `thread`'s stream a wait for notification
    /// `index` of `channel`, which the far end records through its channel back to this rank.
    /// The stream runs nothing after the wait until the record has come, and each record
    /// lets one wait through. `timeout_ms` is HCCL's: 0 waits for ever; otherwise a wait
    /// still unanswered after that many milliseconds fails, and the stream's next
    /// synchronize reports `ACL_ERROR_RT_FAILURE` (the stream then runs on). A wait that
    /// never ends gives up when its stream is destroyed with
    /// [`destroy_stream`](crate::source::BlockSource::destroy_stream), or the simulator
    /// dropped; a [`Stream`](crate::Stream) waits for its work before it destroys its stream
    /// on drop, as the runtime asks, so it waits for such a wait too. Returns once queued.
    ///
    /// # Errors
    /// As [`notify_record_on_thread`](Self::notify_record_on_thread).
    pub fn notify_wait_on_thread(
        &self,
        thread: CommThreadHandle,
        channel: ChannelHandle,
        index: u32,
        timeout_ms: u32,
    ) -> Result<()> {
        let timeout = (timeout_ms > 0).then(|| Duration::from_millis(u64::from(timeout_ms)));
        self.call(AclFunc::ChannelNotifyWaitOnThread, || {
            self.queue_notify(
                thread,
                channel,
                index,
                |c| (c.local, c.remote),
                |notify| Op::NotifyWait { notify, timeout },
            )
        })
    }

    /// Checks `thread`, `channel` and `index` as both notification calls do, and queues the
    /// op `make` builds for the notification at `(receiver, sender, index)`, the two ranks
    /// `ranks` picks from the channel.
    fn queue_notify(
        &self,
        thread: CommThreadHandle,
        channel: ChannelHandle,
        index: u32,
        ranks: impl FnOnce(&Channel) -> (DeviceId, DeviceId),
        make: impl FnOnce(Arc<Notify>) -> Op,
    ) -> std::result::Result<(), AclError> {
        let (stream, c) = lock(&self.comm).endpoints(thread, channel)?;
        let s = self
            .stream(stream)
            .map_err(|_| AclError::HCCL_E_NOT_FOUND)?;
        if index >= c.notifies || s.device() != c.local {
            return Err(AclError::HCCL_E_PARA);
        }
        let (receiver, sender) = ranks(&c);
        let home = NotifyHome {
            comm: Arc::downgrade(&self.comm),
            ranks: (receiver, sender),
        };
        // One scope from the re-check to the queued op holding the notification: a release
        // since the first look finds the channel gone here, and one after finds the
        // notification held; neither leaves it made for a channel gone, with no op.
        let mut comm = lock(&self.comm);
        if !comm.channels.contains_key(&channel.0) {
            return Err(AclError::HCCL_E_NOT_FOUND);
        }
        let notify = Arc::clone(
            comm.notifies
                .entry((receiver, sender, index))
                .or_insert_with(|| Arc::new(Notify::new(home))),
        );
        // Under `comm` (lock order: `comm`, then a stream's queue).
        s.push(make(notify))
            .then_some(())
            .ok_or(AclError::HCCL_E_NOT_FOUND)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::source::sim::SimConfig;
    use crate::source::BlockSource;

    /// A release of the channel and a destroy of the thread's stream while a notification
    /// call is between its checks and its queueing (`ranks` runs there) leave no
    /// notification behind: the call is refused and the communicator holds nothing (it
    /// used to make the notification for the channel gone, and keep it for good).
    #[test]
    fn a_channel_released_during_a_notification_call_leaves_no_notification() {
        let sim = SimSource::new(SimConfig::default().with_devices(2)).unwrap();
        let stream = sim.create_stream(0).unwrap();
        let thread = sim.acquire_comm_thread(stream).unwrap();
        let channel = sim.acquire_channel(0, 1).unwrap();
        let queued = sim.queue_notify(
            thread,
            channel,
            0,
            |c| {
                sim.release_channel(channel).unwrap();
                sim.destroy_stream(stream).unwrap();
                (c.remote, c.local)
            },
            Op::NotifyRecord,
        );
        assert_eq!(queued, Err(AclError::HCCL_E_NOT_FOUND));
        assert_eq!(sim.comm_entries(), (0, 0, 0), "a notification was left");
    }
}
