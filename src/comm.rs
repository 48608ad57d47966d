//! One-sided writes into another rank's memory (HCOMM's `HcommWriteOnThread`), checked.
//!
//! A rank writes bytes of one of its regions straight into a window another rank registered,
//! with no call on the far side. The communicator (HCCL) opens the channels and threads;
//! this module makes the write itself safe to issue from a pool:
//! - the source range is checked against a live region of the pool, and the region is
//!   recorded on the thread's stream, so freeing it right after the call is safe: its memory
//!   is reused only once the stream has passed the write;
//! - the destination range is checked against the far end's window ([`RemoteWindow`]);
//! - a thread of another source is refused, and a thread cannot outlive its stream.
//!
//! Windows are device memory with start and length at multiples of 2 MiB, as HCCL
//! registers it: [`Pool::alloc_device_aligned`] with [`WINDOW_GRANULE`] gives one, and on
//! the simulator [`Pool::register_window`] registers it for as long as it keeps the region
//! ([`RegisteredWindow`]): the region cannot be freed, and its memory reused, while other
//! ranks may still write it.
//! Telling the far end that its window has been written (HCCL's notifications,
//! `HcommChannelNotifyRecordOnThread` and `HcommChannelNotifyWaitOnThread`) stays with the
//! communicator; on the simulator, [`SimSource::notify_record_on_thread`] and
//! [`SimSource::notify_wait_on_thread`] stand in for it.
//!
//! On the simulator every device is a rank, so all ranks can run in one process. Here rank
//! 0 writes and then records a notification; rank 1's stream waits for it before it copies
//! what was written:
//!
//! ```
//! use std::sync::Arc;
//! use ascend_pool::comm::{RemoteWindow, WINDOW_GRANULE};
//! use ascend_pool::source::sim::{SimConfig, SimSource};
//! use ascend_pool::{Pool, PoolConfig, Region};
//!
//! let sim = Arc::new(SimSource::new(SimConfig::default().with_devices(2))?);
//! let rank0 = Pool::new(sim.clone(), PoolConfig::default().with_device(0))?;
//! let rank1 = Pool::new(sim.clone(), PoolConfig::default().with_device(1))?;
//!
//! // Rank 1 registers a window; rank 0 opens a channel to it.
//! let window = rank1.register_window(rank1.alloc_device_aligned(WINDOW_GRANULE, WINDOW_GRANULE)?)?;
//! let channel = sim.acquire_channel(0, 1)?;
//! let far = RemoteWindow::of_sim(&sim, channel)?.remove(0);
//!
//! // Rank 0 writes 4 KiB of a region into the window, at offset 64 KiB, then records
//! // notification 0 of the channel's far end.
//! let stream = rank0.create_stream()?;
//! let thread = rank0.acquire_comm_thread(&stream)?;
//! let mut src = rank0.alloc_device(4096)?;
//! rank0.copy_from_host(&mut src, 0, &[7u8; 4096])?;
//! rank0.write_remote(&thread, &far, 64 << 10, &src, 0, 4096)?;
//! drop(src); // safe: its memory is reused only after the stream has passed the write
//! sim.notify_record_on_thread(thread.handle(), channel, 0)?;
//!
//! // Rank 1's stream waits for the notification (0 ms: for ever), then copies.
//! let stream1 = rank1.create_stream()?;
//! let thread1 = rank1.acquire_comm_thread(&stream1)?;
//! let back = sim.acquire_channel(1, 0)?;
//! sim.notify_wait_on_thread(thread1.handle(), back, 0, 0)?;
//! let mut copy = rank1.alloc_device(4096)?;
//! rank1.copy_async(&mut copy, 0, window.region(), 64 << 10, 4096, &stream1)?;
//! stream1.synchronize()?;
//!
//! let mut seen = [0u8; 4096];
//! rank1.copy_to_host(&copy, 0, &mut seen)?;
//! assert_eq!(seen, [7u8; 4096]);
//! # Ok::<(), ascend_pool::Error>(())
//! ```

use crate::error::{CopySide, Error, Result};
use crate::pool::Pool;
use crate::region::{check_bounds, AsyncCopySafe, Region, Stream};
use crate::source::sim::SimSource;
use crate::source::{BlockSource, ChannelHandle, CommThreadHandle};

pub use crate::source::sim::WINDOW_GRANULE;

/// A communication thread: one-sided writes queued on it run in order on its stream.
///
/// It borrows the stream, so the stream outlives it.
#[derive(Debug, Clone, Copy)]
pub struct CommThread<'s> {
    raw: CommThreadHandle,
    stream: &'s Stream,
}

impl<'s> CommThread<'s> {
    /// A thread the application's communicator acquired on `stream`
    /// (`HcclThreadAcquireWithStream`).
    ///
    /// # Safety
    /// `raw` must be a live thread of the communicator whose work runs on `stream`, and stay
    /// live while this value exists: the pool reuses a source region once `stream` has
    /// passed the write, so a write running elsewhere could read memory already reused.
    pub unsafe fn from_raw(raw: CommThreadHandle, stream: &'s Stream) -> Self {
        Self { raw, stream }
    }

    /// The raw handle.
    pub fn handle(&self) -> CommThreadHandle {
        self.raw
    }

    /// The stream its writes run on.
    pub fn stream(&self) -> &'s Stream {
        self.stream
    }
}

/// A window of a remote rank, reached through a channel: the far end of a one-sided write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RemoteWindow {
    channel: ChannelHandle,
    addr: usize,
    len: u64,
    /// The simulator the window was read from ([`of_sim`](Self::of_sim)), which alone checks
    /// writes into it and knows its channel; `None` for a window the caller vouches for.
    sim: Option<u64>,
}

impl RemoteWindow {
    /// The window of `len` bytes at `addr` that the rank at the far end of `channel`
    /// registered (`HcclChannelGetHcclBuffer` tells a caller where it is).
    ///
    /// # Safety
    /// `addr..addr + len` must be memory the far end registered for one-sided writes and
    /// keeps registered, with nothing else using the bytes a write targets until the write
    /// has run: the pool checks writes against this range and nothing else.
    pub unsafe fn from_raw(channel: ChannelHandle, addr: usize, len: u64) -> Self {
        Self {
            channel,
            addr,
            len,
            sim: None,
        }
    }

    /// The windows the far end of `channel` registered with the simulator, in address
    /// order. Safe: the simulator checks every write against the windows and blocks live
    /// when it runs. Only a pool whose source runs on `sim` writes into them (another
    /// source, which would not check the write, refuses them with [`Error::ForeignHandle`]).
    pub fn of_sim(sim: &SimSource, channel: ChannelHandle) -> Result<Vec<Self>> {
        let id = sim.simulator_id();
        Ok(sim
            .channel_windows(channel)?
            .into_iter()
            .map(|(addr, len)| Self {
                channel,
                addr,
                len,
                sim: id,
            })
            .collect())
    }

    /// The channel that leads to it.
    pub fn channel(&self) -> ChannelHandle {
        self.channel
    }

    /// Its start in the far end's memory.
    pub fn addr(&self) -> usize {
        self.addr
    }

    /// Its length in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether it has no bytes (no write fits in it).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// A region registered as a window other ranks write one-sided ([`Pool::register_window`]).
///
/// It owns the region, so the region's memory goes back to its pool only after the window
/// is deregistered, when this is dropped or [`into_region`](Self::into_region) is called.
/// Deregistration waits for a write landing at that moment only: a write still queued lands
/// nowhere and fails its stream's task (it may wait for a notification only this rank would
/// record, so waiting for it could wait for ever). A window forgotten
/// (`std::mem::forget`) keeps its region for ever, which leaks but never lets a late write
/// land in memory another region was given.
///
/// So the region cannot be a borrow: forgetting the window would end the borrow, and the
/// region it borrowed could go back to the pool while the window stays registered.
///
/// ```compile_fail
/// use std::sync::Arc;
/// use ascend_pool::comm::{RemoteWindow, WINDOW_GRANULE};
/// use ascend_pool::region::SubRegion;
/// use ascend_pool::source::sim::{SimConfig, SimSource};
/// use ascend_pool::{Pool, PoolConfig, Region};
///
/// let sim = Arc::new(SimSource::new(SimConfig::default().with_devices(2))?);
/// let rank0 = Pool::new(sim.clone(), PoolConfig::default().with_device(0))?;
/// let rank1 = Pool::new(sim.clone(), PoolConfig::default().with_device(1))?;
/// let g = WINDOW_GRANULE;
/// let mut region = rank1.alloc_device_aligned(g, g)?;
/// std::mem::forget(rank1.register_window(SubRegion::new(&mut region, 0, g)?)?);
/// drop(region); // back to the pool, still registered
/// let mut victim = rank1.alloc_device_aligned(g, g)?;
/// rank1.copy_from_host(&mut victim, 0, &[0; 64])?;
///
/// let far = RemoteWindow::of_sim(&sim, sim.acquire_channel(0, 1)?)?.remove(0);
/// let stream = rank0.create_stream()?;
/// let thread = rank0.acquire_comm_thread(&stream)?;
/// let mut src = rank0.alloc_device(64)?;
/// rank0.copy_from_host(&mut src, 0, &[7; 64])?;
/// rank0.write_remote(&thread, &far, 0, &src, 0, 64)?;
/// stream.synchronize()?;
/// let mut seen = [0; 64];
/// rank1.copy_to_host(&victim, 0, &mut seen)?;
/// assert_eq!(far.addr(), victim.addr());
/// assert_eq!(seen, [7; 64]); // another region, written by rank 0
/// # Ok::<(), ascend_pool::Error>(())
/// ```
#[derive(Debug)]
pub struct RegisteredWindow<R: Region> {
    /// `None` only while [`into_region`](Self::into_region) takes it out.
    region: Option<R>,
}

impl<R: Region> RegisteredWindow<R> {
    /// The region under the window. What other ranks wrote can be read from it once their
    /// notifications say it has landed.
    pub fn region(&self) -> &R {
        self.region.as_ref().expect("held until into_region")
    }

    /// Deregisters the window and gives the region back: no write lands in it afterwards
    /// (those still queued fail their streams' tasks). Let the writers' notifications say
    /// their writes have landed first.
    ///
    /// # Errors
    /// The source's refusal to deregister. The region is not given back then: the window
    /// drops with it, and its drop asks the source once more. If that deregisters, the region
    /// goes back to its pool (freed); if the source refuses again, the region may still be
    /// registered, so it is kept from the pool for good (leaked), as for a window whose drop
    /// is refused.
    pub fn into_region(mut self) -> Result<R> {
        self.deregister()?;
        Ok(self.region.take().expect("held until into_region"))
    }

    fn deregister(&mut self) -> Result<()> {
        let r = self.region();
        r.segment().source().deregister_window(r.addr())
    }
}

impl<R: Region> Drop for RegisteredWindow<R> {
    fn drop(&mut self) {
        if self.region.is_none() {
            return;
        }
        if let Err(e) = self.deregister() {
            // Other ranks may still write the memory: keep it from the pool for good.
            eprintln!("ascend-pool: a window stays registered, its region is kept: {e}");
            std::mem::forget(self.region.take());
        }
    }
}

/// A region [`Pool::register_window`] could not register, given back with the reason.
#[derive(Debug)]
pub struct WindowRefused<R> {
    /// Why the window was refused.
    pub error: Error,
    /// The region, unregistered and still the caller's.
    pub region: R,
}

impl<R> From<WindowRefused<R>> for Error {
    /// The reason alone; the region is dropped (freed).
    fn from(refused: WindowRefused<R>) -> Self {
        refused.error
    }
}

impl Pool {
    /// Registers `region` as a window that other ranks write one-sided (HCCL's registration;
    /// on the simulator, [`SimSource::register_window`]): its start and length must be
    /// multiples of [`WINDOW_GRANULE`] (allocate it with [`Pool::alloc_device_aligned`]).
    /// The returned window keeps the region until it is deregistered, so the region's
    /// memory is never reused while a write may still land in it. The region is owned
    /// (`'static`), not a [`SubRegion`](crate::region::SubRegion) borrowing one: forgetting
    /// the window would end the borrow and free the region under it. A region whose memory
    /// was taken over from one freed behind its stream's work ([`Pool::alloc_device_on`]) is
    /// registered once that work has run (the call waits for it): other ranks' writes are
    /// ordered after no stream of this rank's, and that work would write over them.
    ///
    /// # Errors
    /// The region comes back in [`WindowRefused`] (`?` turns that into its error, freeing the
    /// region) with:
    /// - [`Error::ForeignHandle`] for a region of another source;
    /// - [`Error::WrongKind`] for host memory;
    /// - [`Error::Misaligned`] for a start or length off the 2 MiB granule, and
    ///   [`Error::Invalid`] for memory of another device than this pool's or a window that
    ///   overlaps one registered;
    /// - [`Error::NotSupported`] on the real runtime, where the application's communicator
    ///   registers windows;
    /// - [`Error::Runtime`] when the runtime fails to wait for the previous owner's work.
    pub fn register_window<R: Region + 'static>(
        &self,
        region: R,
    ) -> std::result::Result<RegisteredWindow<R>, WindowRefused<R>> {
        let checked = self.same_source(&region).and_then(|()| {
            if region.kind().is_device() {
                Ok(())
            } else {
                Err(Error::WrongKind {
                    expected: "device",
                    got: region.kind(),
                })
            }
        });
        // Memory taken over from a region freed behind its stream's work
        // (`Pool::alloc_device_on`): other ranks' writes are ordered after no stream of
        // this one, so that work must have run before they may land.
        let checked = checked.and_then(|()| region.segment().settle_for_host());
        // SAFETY: the window takes the region, and gives it back (or lets the pool have its
        // memory) only once deregistered, which no write lands after; until then nothing but
        // reads through the window's `region()` touches the bytes.
        let registered = checked.and_then(|()| unsafe {
            self.source()
                .register_window(self.config().device, region.addr(), region.len())
        });
        match registered {
            Ok(()) => Ok(RegisteredWindow {
                region: Some(region),
            }),
            Err(error) => Err(WindowRefused { error, region }),
        }
    }

    /// A communication thread whose writes run on `stream`, acquired from the block source.
    /// Only the simulator acquires threads; with the real runtime, the communicator does
    /// (see [`CommThread::from_raw`]), and this answers [`Error::NotSupported`].
    pub fn acquire_comm_thread<'s>(&self, stream: &'s Stream) -> Result<CommThread<'s>> {
        self.own_stream(stream)?;
        let raw = self.source().acquire_comm_thread(stream.handle())?;
        Ok(CommThread { raw, stream })
    }

    /// Queues a one-sided write of `len` bytes of `src` from `src_offset` into `dst` at
    /// `dst_offset`, on `thread` (`HcommWriteOnThread`), and returns at once.
    ///
    /// `src` is recorded on the thread's stream, so dropping it before the write has run
    /// is safe. The far end learns of the write through the communicator's notifications
    /// (on the simulator, [`SimSource::notify_record_on_thread`]).
    ///
    /// # Errors
    /// - [`Error::OutOfBounds`] when either range leaves its region or window (or the
    ///   address space), or `len` is 0;
    /// - [`Error::WrongKind`] when `src` is host memory;
    /// - [`Error::ForeignHandle`] when `src` or the thread's stream belongs to another source,
    ///   or the stream to another device than this pool's or `src`'s pool's, or `dst` was
    ///   read from a simulator this pool's source does not run on;
    /// - [`Error::Runtime`] (`HcommWriteOnThread` and its `HcclResult`) when the
    ///   communication library refuses, and [`Error::NotSupported`] when there is none.
    pub fn write_remote(
        &self,
        thread: &CommThread<'_>,
        dst: &RemoteWindow,
        dst_offset: u64,
        src: &impl AsyncCopySafe,
        src_offset: u64,
        len: u64,
    ) -> Result<()> {
        let stream = thread.stream;
        self.own_stream(stream)?;
        self.same_source(src)?;
        // As for `copy_async`: the source's pool fences its free with an event on the
        // stream, which it cannot record on a stream of another device (it would wait for
        // the stream instead, under its lock).
        src.segment().takes_stream(stream)?;
        // A window read from a simulator is checked by that simulator only: another source
        // would take its channel handle for one of its own, or write unchecked.
        if dst.sim.is_some() && dst.sim != self.source().simulator_id() {
            return Err(Error::ForeignHandle);
        }
        // A window given by address (`from_raw`, or an address from C) may run past the end
        // of the address space; the bytes before that end are all it can hold.
        let room = (usize::MAX - dst.addr) as u64;
        check_bounds(
            Some(CopySide::Destination),
            dst_offset,
            len,
            dst.len.min(room),
        )?;
        check_bounds(Some(CopySide::Source), src_offset, len, src.len())?;
        if !src.kind().is_device() {
            return Err(Error::WrongKind {
                expected: "device",
                got: src.kind(),
            });
        }
        let seg = src.segment();
        seg.settle_for_stream(stream.handle())?;
        seg.note_stream(stream);
        // SAFETY: the source range was checked against a live region of this pool's source,
        // recorded on the thread's stream, so its memory is not reused before the stream
        // passes the write; `from_raw`'s callers vouch that the thread runs on that stream
        // and that the checked destination range is the far end's registered window (the
        // simulator's windows are checked by the simulator itself).
        unsafe {
            self.source().write_on_thread(
                thread.raw,
                dst.channel,
                dst.addr + dst_offset as usize,
                src.addr() + src_offset as usize,
                len,
            )
        }
    }
}
