//! Typed regions: what the pool hands out, safe by construction for their uses.
//!
//! Each memory kind has its own region type, and capability traits say what a region may
//! be given to:
//! - [`AsyncCopySafe`]: start 64-aligned, so `aclrtMemcpyAsync` accepts it;
//! - [`DvppInput`] / [`DvppOutput`]: DVPP memory (128-aligned, so async-copy safe too);
//! - [`ModelInput`]: start 128-aligned (DVPP output feeding a model, or device memory
//!   allocated as model input).
//!
//! So passing host memory to DVPP, or a 64-aligned buffer to a model, does not compile:
//!
//! ```compile_fail
//! use ascend_pool::region::{DvppInput, HostRegion};
//! fn decode(_input: &impl DvppInput) {}
//! fn give(host: &HostRegion) { decode(host) } // HostRegion is not DVPP memory
//! ```
//!
//! ```compile_fail
//! use ascend_pool::region::{DeviceRegion, ModelInput};
//! fn infer(_input: &impl ModelInput) {}
//! fn give(buf: &DeviceRegion) { infer(buf) } // only 64-aligned
//! ```
//!
//! Device memory is never exposed as a Rust slice; host regions are. A region hands its
//! memory back when dropped; if a stream still uses it, only once the stream has passed.

use crate::error::CopySide::{self, Destination, Source};
use crate::error::{Error, Result};
use crate::kind::MemKind;
use crate::pool::{Owner, Pool, PoolInner, RawSegment};
use crate::source::{BlockSource, DeviceId, EventHandle, MemcpyKind, StreamHandle};
use smallvec::SmallVec;
use std::cell::RefCell;
use std::marker::PhantomData;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, TryLockError, Weak};

/// Keeps [`Region`] to this crate's types: the pool's unsafe copies trust what a region says
/// about its address and length.
mod sealed {
    pub trait Sealed {}
}

/// What every region tells about itself.
///
/// Only this crate's regions implement it (the pool writes where a region says it lies),
/// so a look-alike made elsewhere does not compile:
///
/// ```compile_fail
/// use ascend_pool::kind::MemKind;
/// use ascend_pool::region::{HostRegion, Region, Segment};
/// struct Anywhere<'a>(&'a HostRegion);
/// impl Region for Anywhere<'_> {
///     fn addr(&self) -> usize { 0x1000 }
///     fn len(&self) -> u64 { u64::MAX }
///     fn kind(&self) -> MemKind { MemKind::Host }
///     fn align(&self) -> u64 { 64 }
///     fn segment(&self) -> &Segment { self.0.segment() }
/// }
/// ```
pub trait Region: sealed::Sealed {
    /// Start address (a device address for device kinds).
    ///
    /// Work given the address directly (a kernel, a DVPP call, another library) is ordered
    /// by its caller, not by the pool. Memory [`Pool::alloc_device_on`] took over from a
    /// region freed behind its stream's work may still have that work to run: work queued on
    /// the same stream runs after it; on another stream, call
    /// [`record_stream`](Segment::record_stream) with that stream first (the stream then
    /// waits for it); for a use by the host or by no stream of this process, synchronize the
    /// stream the region was allocated on first. The pool's own calls do all this themselves.
    fn addr(&self) -> usize;
    /// Usable bytes (the requested length).
    fn len(&self) -> u64;
    /// Whether the region is empty (never, for pool regions).
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Memory kind.
    fn kind(&self) -> MemKind;
    /// Guaranteed start alignment.
    fn align(&self) -> u64;
    /// The segment behind the region (its pool and stream record).
    #[doc(hidden)]
    fn segment(&self) -> &Segment;
}

/// A region whose start is 64-aligned: `aclrtMemcpyAsync` accepts it.
pub trait AsyncCopySafe: Region {}
/// A region DVPP may read. DVPP memory starts 128-aligned, so an asynchronous copy takes it.
pub trait DvppInput: AsyncCopySafe {}
/// A region DVPP may write; an asynchronous copy or fill takes it too, so a stand-in for a
/// decoder needs no other bound:
///
/// ```
/// use ascend_pool::region::{DvppInput, DvppOutput};
/// use ascend_pool::{Pool, PoolConfig, Result, SimSource, Stream};
/// use std::sync::Arc;
///
/// fn decode(pool: &Pool, packet: &impl DvppInput, frame: &mut impl DvppOutput, s: &Stream) -> Result<()> {
///     pool.copy_async(frame, 0, packet, 0, 4096, s)?;
///     pool.memset_async(frame, 4096, 0x80, 4096, s)
/// }
///
/// let pool = Pool::new(Arc::new(SimSource::default()), PoolConfig::default())?;
/// let stream = pool.create_stream()?;
/// let (packet, mut frame) = (pool.alloc_dvpp(4096)?, pool.alloc_dvpp(8192)?);
/// decode(&pool, &packet, &mut frame, &stream)?;
/// stream.synchronize()?;
/// # Ok::<(), ascend_pool::Error>(())
/// ```
pub trait DvppOutput: AsyncCopySafe {}
/// A region a model may take as input: start 128-aligned.
pub trait ModelInput: AsyncCopySafe {}

/// Start-alignment markers for [`DeviceRegion`].
pub trait AlignMarker: Send + Sync + 'static + std::fmt::Debug {
    /// The alignment in bytes.
    const ALIGN: u64;
}
/// 64-byte starts: the AscendCL default.
#[derive(Debug)]
pub struct Align64;
/// 128-byte starts: model input.
#[derive(Debug)]
pub struct Align128;
impl AlignMarker for Align64 {
    const ALIGN: u64 = 64;
}
impl AlignMarker for Align128 {
    const ALIGN: u64 = 128;
}

/// A stream a segment has noted, and its [`Stream`]'s token (dead once the stream is gone).
type NotedStream = (StreamHandle, Weak<()>);

/// A live segment of a pool, shared by the typed regions.
#[derive(Debug)]
pub struct Segment {
    /// The pool, until the segment is freed: the free hands this handle on (a thread
    /// cache keeps it for the next region of the same shape). `None` only once freed.
    pool: Option<Owner>,
    raw: RawSegment,
    /// Streams that have queued work on this segment (`record_stream`), each with a token
    /// of its [`Stream`]'s that dies once the stream has been waited for and destroyed: such
    /// a stream has run its work, and is forgotten (a region that lives for the whole run,
    /// used by a stream made per request, would otherwise note one more per request).
    streams: Mutex<SmallVec<[NotedStream; 2]>>,
    /// Set when the memory was taken over from a region freed on this stream while its
    /// work was still queued (see [`Pool::alloc_device_on`]): the event marks the end of
    /// that work. Work on the same stream needs nothing; host-side access waits for the
    /// event first (and clears it), work on other streams is queued after it.
    after: Mutex<Option<(StreamHandle, EventHandle)>>,
}

impl Segment {
    fn new(pool: Owner, raw: RawSegment) -> Self {
        Self {
            pool: Some(pool),
            raw,
            streams: Mutex::new(SmallVec::new()),
            after: Mutex::new(None),
        }
    }

    /// Before host-side access, or access ordered after no stream of this process (another
    /// rank's writes into a window): waits until work left by the memory's previous owner
    /// has run.
    ///
    /// In a child made by `fork`, a segment of the parent's pool is refused with
    /// [`Error::Forked`] before the lock is taken: a thread of the parent waiting here held
    /// it across the fork, for good.
    pub(crate) fn settle_for_host(&self) -> Result<()> {
        self.pool().ours()?;
        let mut after = self.after.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((_, ev)) = *after {
            self.source().synchronize_event(ev)?;
            *after = None;
            self.pool().put_event(ev);
        }
        Ok(())
    }

    /// Before the host reads or writes the bytes (a host region's slices, the synchronous
    /// copies and fills): waits for the previous owner's work and for every stream with work
    /// queued on the segment, so no stream touches the bytes meanwhile. A stream destroyed
    /// since it was recorded has run its work already (a `Stream` waits before it is destroyed).
    fn settle_streams_for_host(&self) -> Result<()> {
        self.settle_for_host()?;
        let queued = self.live_streams();
        for s in queued {
            crate::pool::wait_for_stream(&**self.source(), s)?;
        }
        Ok(())
    }

    /// Before queuing work on `stream`: orders it after the previous owner's work. Refused
    /// in a child made by `fork` as [`settle_for_host`](Self::settle_for_host) is.
    pub(crate) fn settle_for_stream(&self, stream: StreamHandle) -> Result<()> {
        self.pool().ours()?;
        let after = self.after.lock().unwrap_or_else(|p| p.into_inner());
        match *after {
            Some((origin, ev)) if origin != stream => self.source().stream_wait_event(stream, ev),
            _ => Ok(()),
        }
    }

    fn pool(&self) -> &Arc<PoolInner> {
        // Only `free` takes the handle, and nothing uses a segment after it.
        &self
            .pool
            .as_ref()
            .expect("a live segment has its pool")
            .pool
    }

    /// Marks the segment as used by work queued on `stream`: its memory is reused only
    /// after that work has run. Call it before queuing that work: memory taken over from a
    /// region freed on another stream while its work was still queued
    /// ([`Pool::alloc_device_on`]) has `stream` wait for that work first, as the pool's
    /// own copies and fills do (the runtime's error if it cannot, and nothing noted). A
    /// stream of another source is refused with [`Error::ForeignHandle`]: its handle would
    /// name another stream here, or none, and the free would wait on the wrong work. So is
    /// a stream of another device: the pool could not record the end of its work (events
    /// live on one device).
    pub fn record_stream(&self, stream: &Stream) -> Result<()> {
        self.takes_stream(stream)?;
        self.settle_for_stream(stream.handle)?;
        self.note_stream(stream);
        Ok(())
    }

    /// Whether work on `stream` may use the segment: a stream of this source and of the
    /// pool's device ([`Error::ForeignHandle`] otherwise, see
    /// [`record_stream`](Self::record_stream)).
    pub(crate) fn takes_stream(&self, stream: &Stream) -> Result<()> {
        stream.belongs_to(self.source(), self.device())
    }

    /// The device of the pool the segment came from (for host memory, the device it was
    /// pinned for).
    fn device(&self) -> DeviceId {
        self.pool().config.device
    }

    /// [`record_stream`](Self::record_stream) for a stream already checked to be this
    /// source's.
    pub(crate) fn note_stream(&self, stream: &Stream) {
        let mut s = self.streams.lock().unwrap_or_else(|p| p.into_inner());
        s.retain(|(_, alive)| alive.strong_count() > 0);
        if !s.iter().any(|&(h, _)| h == stream.handle) {
            s.push((stream.handle, Arc::downgrade(&stream.alive)));
        }
    }

    /// The noted streams not yet gone (see `streams`).
    fn live_streams(&self) -> SmallVec<[StreamHandle; 2]> {
        let s = self.streams.lock().unwrap_or_else(|p| p.into_inner());
        s.iter()
            .filter(|(_, alive)| alive.strong_count() > 0)
            .map(|&(h, _)| h)
            .collect()
    }

    pub(crate) fn source(&self) -> &Arc<dyn BlockSource> {
        &self.pool().source
    }

    fn free(&mut self) -> Result<()> {
        let Some(pool) = self.pool.take() else {
            return Err(Error::AlreadyFreed);
        };
        if let Some((_, ev)) = self
            .after
            .get_mut()
            .unwrap_or_else(|p| p.into_inner())
            .take()
        {
            // Any wait on it was captured when queued, so the event may be recorded again.
            pool.put_event(ev);
        }
        let streams = self.live_streams();
        PoolInner::release(pool, &self.raw, &streams)
    }
}

impl Drop for Segment {
    fn drop(&mut self) {
        if self.pool.is_some() {
            // Errors (a padding overrun in debug mode) are kept in the pool's report.
            let _ = self.free();
        }
    }
}

macro_rules! region_common {
    ($ty:ident $(<$a:ident>)?) => {
        impl$(<$a: AlignMarker>)? sealed::Sealed for $ty$(<$a>)? {}
        impl$(<$a: AlignMarker>)? Region for $ty$(<$a>)? {
            fn addr(&self) -> usize { self.seg.raw.addr }
            fn len(&self) -> u64 { self.seg.raw.len() }
            fn kind(&self) -> MemKind { self.seg.raw.kind }
            fn align(&self) -> u64 { self.seg.raw.align() }
            fn segment(&self) -> &Segment { &self.seg }
        }
        impl$(<$a: AlignMarker>)? AsyncCopySafe for $ty$(<$a>)? {}
        impl$(<$a: AlignMarker>)? $ty$(<$a>)? {
            /// Frees the region now, reporting a padding overrun (debug mode) as an error.
            pub fn free(mut self) -> Result<()> { self.seg.free() }
            /// Marks the region as used by work queued on `stream`; a stream of another
            /// source is refused (see [`Segment::record_stream`]).
            pub fn record_stream(&self, stream: &Stream) -> Result<()> {
                self.seg.record_stream(stream)
            }
        }
    };
}

/// Device memory (`aclrtMalloc`, `aclrtMallocAlign32`, `aclrtMallocCached`); never a slice.
#[derive(Debug)]
pub struct DeviceRegion<A: AlignMarker = Align64> {
    seg: Segment,
    _align: PhantomData<A>,
}
region_common!(DeviceRegion<A>);
impl ModelInput for DeviceRegion<Align128> {}

/// DVPP memory (`acldvppMalloc`): 128-aligned, readable and writable by DVPP, model input.
#[derive(Debug)]
pub struct DvppRegion {
    seg: Segment,
}
region_common!(DvppRegion);
impl DvppInput for DvppRegion {}
impl DvppOutput for DvppRegion {}
impl ModelInput for DvppRegion {}

/// Pinned host memory (`aclrtMallocHost`): a Rust slice, and a copy endpoint for streams.
#[derive(Debug)]
pub struct HostRegion {
    seg: Segment,
}
region_common!(HostRegion);

impl HostRegion {
    /// The bytes of the region, once every stream with work queued on it has run that work
    /// (see [`try_as_slice`](Self::try_as_slice)).
    ///
    /// # Panics
    /// If the runtime fails to synchronize such a stream (a device fault): handing out the
    /// bytes while a stream may still write them would be a data race. Also in a child made
    /// by `fork`, for a region of the parent's pool ([`Error::Forked`] from
    /// [`try_as_slice`](Self::try_as_slice)).
    pub fn as_slice(&self) -> &[u8] {
        self.try_as_slice()
            .expect("a stream using the host region could not be synchronized")
    }

    /// The bytes of the region, writable, once every stream with work queued on it has run
    /// that work (see [`try_as_mut_slice`](Self::try_as_mut_slice)).
    ///
    /// # Panics
    /// As [`as_slice`](Self::as_slice).
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        self.try_as_mut_slice()
            .expect("a stream using the host region could not be synchronized")
    }

    /// The bytes of the region. Streams that have work queued on it (an async copy into or
    /// out of it, recorded by the pool) are synchronized first, so no stream writes the
    /// bytes while the slice lives; the error is the runtime's if that fails, and
    /// [`Error::Forked`] in a child made by `fork` for a region of the parent's pool.
    pub fn try_as_slice(&self) -> Result<&[u8]> {
        self.seg.settle_streams_for_host()?;
        // SAFETY: host regions are page-locked host memory of `len` bytes owned by this
        // region until it drops. No stream has work on it now (settled above), and queuing
        // a stream write needs `&mut self`, which the returned borrow excludes; the shared
        // borrow also forbids `as_mut_slice`.
        Ok(unsafe { std::slice::from_raw_parts(self.addr() as *const u8, self.len() as usize) })
    }

    /// The bytes of the region, writable; streams with work queued on it are synchronized
    /// first, as for [`try_as_slice`](Self::try_as_slice).
    pub fn try_as_mut_slice(&mut self) -> Result<&mut [u8]> {
        self.seg.settle_streams_for_host()?;
        // SAFETY: as `try_as_slice`; the exclusive borrow makes this the only access, and
        // no stream reads or writes the bytes meanwhile (queuing work needs a borrow).
        Ok(unsafe { std::slice::from_raw_parts_mut(self.addr() as *mut u8, self.len() as usize) })
    }
}

/// A stream of the pool's source; destroyed (after its work has run) on drop.
///
/// When the runtime will not wait for it then (or will not destroy it), the stream is kept
/// instead, its handle live at the runtime and its work maybe still queued: the regions
/// whose work it may still run keep waiting for it. A later retry destroys it once the
/// runtime waits for it again: [`Pool::synchronize`] (which waits for it), [`Pool::trim`]
/// (once it has run its work), or [`retry_kept_streams`].
#[derive(Debug)]
pub struct Stream {
    source: Arc<dyn BlockSource>,
    handle: StreamHandle,
    /// The device it was created on: only pools of that device queue work on it.
    device: DeviceId,
    /// The fork generation it was made in ([`crate::fork`]).
    made_in: u64,
    /// Dropped with the stream, after its work has run: segments that noted the stream hold
    /// a `Weak` of it, and forget the stream once it is gone. Kept alive, with the stream,
    /// when the runtime refuses to wait for or destroy the stream at the drop (its work may
    /// still run), until a retry destroys it ([`retry_kept_streams`]).
    alive: Arc<()>,
    /// The events [`wait_for`](Self::wait_for) has this stream wait on, all of this
    /// stream's device.
    waits: Mutex<WaitEvents>,
}

/// Events a [`Stream`] waits on ([`Stream::wait_for`]), and what it may do with them.
///
/// Invariants: an event is in at most one of `queued` and `idle`, and is never `marker`;
/// no queued wait of the stream names an event of `idle`, so one may be recorded again or
/// destroyed (the reference says neither whether a queued wait survives a new record of
/// its event nor whether the event may be destroyed under it); `queued` holds at most
/// [`WAIT_EVENTS_MAX`] events; when `fenced`, `marker` was recorded on the stream after the
/// waits on every event of `queued`.
#[derive(Debug, Default)]
struct WaitEvents {
    /// Events a wait queued on the stream may still name.
    queued: SmallVec<[EventHandle; 4]>,
    /// Events no queued wait names.
    idle: SmallVec<[EventHandle; 4]>,
    /// Recorded on the stream after each wait, never waited on: once it has completed, the
    /// stream has passed every wait on `queued`.
    marker: Option<EventHandle>,
    fenced: bool,
}

/// Events whose waits a [`Stream`] may have queued at once: past them,
/// [`Stream::wait_for`] first waits for the stream to pass its earlier waits.
const WAIT_EVENTS_MAX: usize = 8;

impl Stream {
    /// The raw handle.
    pub fn handle(&self) -> StreamHandle {
        self.handle
    }
    /// The device whose work it runs.
    pub fn device(&self) -> DeviceId {
        self.device
    }
    /// Waits for all work queued so far.
    ///
    /// In a child made by `fork`, a stream of the parent's is refused with
    /// [`Error::Forked`] before any runtime call ([`crate::fork`]).
    pub fn synchronize(&self) -> Result<()> {
        crate::fork::check(self.made_in)?;
        self.source.synchronize_stream(self.handle)
    }

    /// Orders the work queued on this stream after this call after the work queued on
    /// `other` before it (`aclrtRecordEvent` on `other`, `aclrtStreamWaitEvent` on this
    /// one), and returns at once: a pipeline decoding on one stream and running its model on
    /// another makes the model's stream wait for the decoder's.
    ///
    /// ```
    /// use ascend_pool::{Pool, PoolConfig, SimSource};
    /// use std::sync::Arc;
    /// let pool = Pool::new(Arc::new(SimSource::default()), PoolConfig::default())?;
    /// let (decode, model) = (pool.create_stream()?, pool.create_stream()?);
    /// let packet = pool.alloc_dvpp(4096)?;
    /// let mut frame = pool.alloc_dvpp(4096)?;
    /// pool.copy_async(&mut frame, 0, &packet, 0, 4096, &decode)?;
    /// model.wait_for(&decode)?; // the model's work from here runs after the decode
    /// let mut input = pool.alloc_model_input(4096)?;
    /// pool.copy_async(&mut input, 0, &frame, 0, 4096, &model)?;
    /// model.synchronize()?;
    /// # Ok::<(), ascend_pool::Error>(())
    /// ```
    ///
    /// The events it takes belong to this stream, which records one again only once it has
    /// passed the wait on it, and destroys them when dropped (after its work has run). With
    /// 8 of its waits still queued, a call first waits on the host for the stream to pass
    /// them: so a stream that is never let run (one waiting for work the calling thread has
    /// yet to queue) blocks the ninth call.
    ///
    /// Waiting on itself does nothing. A stream of another source, or of another device, is
    /// refused with [`Error::ForeignHandle`]: its handle names nothing here, and waits
    /// between devices are not known to be allowed. In a child made by `fork`, streams of
    /// the parent's are refused with [`Error::Forked`] before the stream's wait list is
    /// taken (a thread of the parent may have held it across the fork) or the runtime called.
    pub fn wait_for(&self, other: &Stream) -> Result<()> {
        crate::fork::check(self.made_in)?;
        crate::fork::check(other.made_in)?;
        other.belongs_to(&self.source, self.device)?;
        if other.handle == self.handle {
            return Ok(());
        }
        let mut w = self.waits.lock().unwrap_or_else(|p| p.into_inner());
        self.reclaim(&mut w, false)?;
        if w.idle.is_empty() && w.queued.len() >= WAIT_EVENTS_MAX {
            self.reclaim(&mut w, true)?;
        }
        let ev = match w.idle.pop() {
            Some(ev) => ev,
            None => self.source.create_event(self.device)?,
        };
        let queued = self
            .source
            .record_event(ev, other.handle)
            .and_then(|()| self.source.stream_wait_event(self.handle, ev));
        if let Err(e) = queued {
            // No wait names it: a record alone may be made again.
            w.idle.push(ev);
            return Err(e);
        }
        w.queued.push(ev);
        // The marker is bookkeeping: the wait is queued whether or not it is recorded.
        let marker = match w.marker {
            Some(m) => Ok(m),
            None => self.source.create_event(self.device),
        };
        w.fenced = match marker {
            Ok(m) => {
                w.marker = Some(m);
                self.source.record_event(m, self.handle).is_ok()
            }
            Err(_) => false,
        };
        Ok(())
    }

    /// Moves the events of `w.queued` to `w.idle` once the stream has passed the waits on
    /// them: when the marker says so, or (if `block`) after waiting for the marker, or for
    /// the whole stream when no marker covers them. A failed query leaves them queued.
    fn reclaim(&self, w: &mut WaitEvents, block: bool) -> Result<()> {
        if w.queued.is_empty() {
            return Ok(());
        }
        let passed = match (w.marker.filter(|_| w.fenced), block) {
            (Some(m), false) => self.source.query_event(m).unwrap_or(false),
            (Some(m), true) => self.source.synchronize_event(m).map(|()| true)?,
            (None, false) => false,
            (None, true) => self.source.synchronize_stream(self.handle).map(|()| true)?,
        };
        if passed {
            let done = std::mem::take(&mut w.queued);
            w.idle.extend(done);
        }
        Ok(())
    }

    /// `Ok` when a pool of `device` on `source` may queue work on this stream: a handle is
    /// only meaningful to the runtime that made it, and on the device it was made for.
    pub(crate) fn belongs_to(&self, source: &Arc<dyn BlockSource>, device: DeviceId) -> Result<()> {
        if Arc::ptr_eq(&self.source, source) && self.device == device {
            Ok(())
        } else {
            Err(Error::ForeignHandle)
        }
    }
}

/// A stream the runtime would not synchronize (or destroy) when its [`Stream`] dropped: its
/// handle lives on at the runtime, its work maybe still queued, so the segments that noted
/// it keep waiting for it (its token lives). A retry ([`retry_kept_streams`],
/// [`Pool::synchronize`], [`Pool::trim`]) destroys it once the runtime waits for it.
#[derive(Debug)]
struct KeptStream {
    /// Held, as the [`Stream`] held it, until the stream is destroyed: it is the one way to
    /// reach the handle (a source layered on a runtime, such as a `VmmSource` over the
    /// simulator, leaves the handle live at the runtime when it drops), and its drop would
    /// tear down what the stream's work may still use (the simulator and `AclSource` destroy
    /// the streams they still have, `AclSource` and `VmmSource` free or unmap memory). No
    /// cycle: a source holds nothing of the list. So a source with a kept stream lives on
    /// (reachable, for a leak checker) until a retry destroys the stream.
    source: Arc<dyn BlockSource>,
    handle: StreamHandle,
    device: DeviceId,
    /// The fork generation the stream was made in: a child never calls the runtime for its
    /// parent's streams (they are not its to wait for or destroy).
    made_in: u64,
    /// The [`Stream`]'s token, dropped once the stream is destroyed: the segments that noted
    /// the stream forget it then, and the pool's frees and host accesses stop waiting for it.
    alive: Arc<()>,
    /// The stream's wait events ([`Stream::wait_for`]) a wait still queued on it may name
    /// (and a probe whose record the source panicked in): destroyed once the stream has
    /// been waited for.
    events: SmallVec<[EventHandle; 4]>,
    /// An event [`Retry::Poll`] recorded on the stream, to learn without waiting whether it
    /// has run its work; recorded once, so a stream that never runs does not pile up records.
    probe: Option<EventHandle>,
    /// Taken by a retry, which calls the runtime without the list's lock: another retry
    /// leaves the entry alone meanwhile.
    busy: bool,
    /// Names the entry across the retry's two turns under the lock.
    id: u64,
}

/// The kept streams. Held here rather than leaked, so a leak checker finds them reachable;
/// an entry comes with a failed `aclrtSynchronizeStream` or `aclrtDestroyStream` at a
/// [`Stream`]'s drop, and goes once a retry has destroyed the stream (or found its handle
/// gone at the runtime).
///
/// The lock is held only to read or change the list, never across a runtime call nor while
/// a source drops (a retry
/// takes its entries out, marked busy, and settles them under the lock again), so a retry
/// waiting for a stream never holds up another thread's drop. The fork handlers hold it
/// across a `fork` ([`hold_for_fork`]), so a child does not inherit it locked.
static UNDESTROYED: Mutex<Vec<KeptStream>> = Mutex::new(Vec::new());

/// Entries of [`UNDESTROYED`], so a retry with none to do takes no lock (updated under it).
static LISTED: AtomicUsize = AtomicUsize::new(0);

/// Kept streams whose token was leaked instead of listed: in a child made by `fork` that
/// found the list locked (the fork handlers did not hold it across the fork), where a drop
/// must not wait for a lock a thread of the parent may hold for good. Never retried.
static LEAKED: AtomicUsize = AtomicUsize::new(0);

/// Ids of [`KeptStream`]s.
static NEXT_KEPT_ID: AtomicU64 = AtomicU64::new(0);

thread_local! {
    /// The list's lock, taken by [`hold_for_fork`] for the same thread to let go.
    static HELD_FOR_FORK: RefCell<Option<MutexGuard<'static, Vec<KeptStream>>>> =
        const { RefCell::new(None) };
}

/// The fork generation in which [`UNDESTROYED`]'s lock is known to be held by none but this
/// process's threads: the one that registered the fork handlers (0), or a child whose
/// parent held the lock across the fork ([`hold_for_fork`]). Written only by
/// [`release_after_fork`] in a child, while it has one thread.
static LIST_OURS_IN: AtomicU64 = AtomicU64::new(0);

/// Takes the kept streams' lock just before a fork, so that the child does not inherit it
/// held by a thread it does not have. The child keeps its parent's entries, never retried
/// there (see [`KeptStream::made_in`]).
pub(crate) fn hold_for_fork() {
    let guard = UNDESTROYED.lock().unwrap_or_else(PoisonError::into_inner);
    // A fork from a thread whose thread-locals are gone: the lock goes back at once, and
    // the child only tries it (see `kept_list`).
    let _ = HELD_FOR_FORK.try_with(|h| *h.borrow_mut() = Some(guard));
}

/// Lets go of the lock [`hold_for_fork`] took, in the parent and in the child (called after
/// the child's generation has been counted).
pub(crate) fn release_after_fork(in_child: bool) {
    let _ = HELD_FOR_FORK.try_with(|h| {
        if h.borrow_mut().take().is_some() && in_child {
            // Relaxed: the child has one thread.
            LIST_OURS_IN.store(crate::fork::generation(), Ordering::Relaxed);
        }
    });
}

/// The kept streams' list, locked. Nothing holds the lock long (see [`UNDESTROYED`]), so a
/// process waits for it, unless it is a child made by `fork` whose parent could not hold it
/// across the fork: there a thread of the parent may hold it for good, and `None` says the
/// lock was taken.
fn kept_list() -> Option<MutexGuard<'static, Vec<KeptStream>>> {
    if crate::fork::generation() == LIST_OURS_IN.load(Ordering::Relaxed) {
        return Some(UNDESTROYED.lock().unwrap_or_else(PoisonError::into_inner));
    }
    match UNDESTROYED.try_lock() {
        Ok(list) => Some(list),
        Err(TryLockError::Poisoned(p)) => Some(p.into_inner()),
        Err(TryLockError::WouldBlock) => None,
    }
}

/// How many [`Stream`]s are kept now: dropped while the runtime would not synchronize or
/// destroy them, so their handles are still live at the runtime, and not destroyed since by
/// a retry ([`retry_kept_streams`], [`Pool::synchronize`], [`Pool::trim`]). In a child made
/// by `fork`, the streams its parent kept before the fork count too, and so do those of its
/// parent's it drops (the child never destroys either).
///
/// A leak check that counts the runtime's live streams allows these (see
/// [`streams_kept_on`] for one source's).
#[doc(hidden)]
pub fn streams_kept() -> usize {
    LISTED.load(Ordering::Acquire) + LEAKED.load(Ordering::Relaxed)
}

/// How many streams of `source` are kept now (see [`streams_kept`]): the live streams a
/// leak check of that source allows. `source` is the one the streams' pool was made over: a
/// pool over a `VmmSource` keeps its streams on that, not on the runtime below it. Streams
/// whose token was leaked (in a child made by `fork` that found the list locked) are not
/// counted, nor is anything while such a child finds the list locked.
///
/// ```
/// use ascend_pool::region::streams_kept_on;
/// use ascend_pool::source::sim::SimSource;
/// assert_eq!(streams_kept_on(&SimSource::default()), 0);
/// ```
#[doc(hidden)]
pub fn streams_kept_on(source: &dyn BlockSource) -> usize {
    if LISTED.load(Ordering::Acquire) == 0 {
        return 0;
    }
    kept_list().map_or(0, |list| {
        list.iter()
            .filter(|k| std::ptr::addr_eq(Arc::as_ptr(&k.source), source))
            .count()
    })
}

/// Tries again to destroy every kept [`Stream`] (see [`streams_kept`]): each is waited for
/// (`aclrtSynchronizeStream`), which blocks until it has run its work; once the runtime
/// succeeds, its remaining wait events and the stream are destroyed, and the segments that
/// noted it stop waiting for it, so the frees deferred behind it complete by the pool's
/// usual paths (at once, or at the next [`Pool::synchronize`] or [`Pool::trim`]). A stream
/// the runtime still refuses stays kept, for a later retry; one whose handle the runtime no
/// longer knows is taken as destroyed. Returns how many were destroyed (or found gone at the
/// runtime).
///
/// A kept stream holds its source, as its `Stream` did: a source lives on, though every
/// handle of the application's has gone, until its kept streams are destroyed (and the last
/// handle of a source may go in this call, which then drops it).
///
/// Streams another thread is retrying meanwhile are left to it. In a child made by `fork`,
/// the parent's kept streams are left alone: they are not the child's to wait for.
///
/// [`Pool::synchronize`] retries the kept streams of its source and device the same way, and
/// [`Pool::trim`] those of them that have run their work, without waiting.
///
/// ```
/// use ascend_pool::region::{retry_kept_streams, streams_kept_on};
/// use ascend_pool::source::sim::{AclFunc, Fault, SimSource};
/// use ascend_pool::{AclError, Pool, PoolConfig};
/// use std::sync::Arc;
///
/// let sim = Arc::new(SimSource::default());
/// let pool = Pool::new(sim.clone(), PoolConfig::default())?;
/// let stream = pool.create_stream()?;
/// // The runtime refuses the wait at the drop: the stream is kept, not destroyed.
/// sim.inject_fault(Fault::next(AclFunc::SynchronizeStream, AclError::RT_FAILURE, 1));
/// drop(stream);
/// assert_eq!((streams_kept_on(&*sim), sim.stats().live_streams), (1, 1));
/// // It answers again: a retry destroys the stream.
/// assert!(retry_kept_streams() >= 1);
/// assert_eq!((streams_kept_on(&*sim), sim.stats().live_streams), (0, 0));
/// # Ok::<(), ascend_pool::Error>(())
/// ```
pub fn retry_kept_streams() -> usize {
    retry_kept(|_| true, Retry::Wait)
}

/// Retries the kept streams of `source` on `device` ([`Pool::synchronize`] waits for them,
/// [`Pool::trim`] polls them); no lock is taken when none is kept.
#[inline]
pub(crate) fn retry_kept_on(source: &Arc<dyn BlockSource>, device: DeviceId, how: Retry) -> usize {
    if LISTED.load(Ordering::Acquire) == 0 {
        return 0;
    }
    retry_kept(
        |k| k.device == device && Arc::ptr_eq(&k.source, source),
        how,
    )
}

/// How a retry learns that a kept stream has run its work.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Retry {
    /// Waits for it (`aclrtSynchronizeStream`).
    Wait,
    /// Asks without waiting: an event recorded on the stream once, queried on each retry;
    /// the stream is waited for (briefly) only once the event has completed.
    Poll,
}

/// A kept stream a retry has taken out of the list (its entry stays, busy).
struct Retrying {
    id: u64,
    source: Arc<dyn BlockSource>,
    handle: StreamHandle,
    device: DeviceId,
    events: SmallVec<[EventHandle; 4]>,
    probe: Option<EventHandle>,
    destroyed: bool,
}

/// The streams one retry has taken: settled back into the list when dropped (after the
/// runtime calls, or when one of them panics), so no entry stays busy.
struct RetryBatch(Vec<Retrying>);

impl Drop for RetryBatch {
    fn drop(&mut self) {
        if self.0.is_empty() {
            return;
        }
        let mut gone = Vec::new();
        // A blocking lock even in a child made by `fork` that only tries it (`kept_list`):
        // this retry took the lock to fill the batch, so no thread the child lacks holds it,
        // and a failed try here would leave the entries busy for good.
        {
            let mut list = UNDESTROYED.lock().unwrap_or_else(PoisonError::into_inner);
            for r in &mut self.0 {
                let Some(i) = list.iter().position(|k| k.id == r.id) else {
                    continue;
                };
                if r.destroyed {
                    // The token drops after the lock goes: segments may then forget it.
                    gone.push(list.swap_remove(i));
                } else {
                    let k = &mut list[i];
                    k.events = std::mem::take(&mut r.events);
                    k.probe = r.probe.take();
                    k.busy = false;
                }
            }
            LISTED.store(list.len(), Ordering::Release);
        }
        drop(gone);
        // The sources go last, and without the lock: one may be the last handle.
    }
}

fn retry_kept(take: impl Fn(&KeptStream) -> bool, how: Retry) -> usize {
    if LISTED.load(Ordering::Acquire) == 0 {
        return 0;
    }
    let mut batch = RetryBatch(Vec::new());
    {
        let Some(mut list) = kept_list() else {
            return 0;
        };
        for k in list.iter_mut() {
            if k.busy || !crate::fork::ours(k.made_in) || !take(k) {
                continue;
            }
            k.busy = true;
            batch.0.push(Retrying {
                id: k.id,
                source: Arc::clone(&k.source),
                handle: k.handle,
                device: k.device,
                events: std::mem::take(&mut k.events),
                probe: k.probe.take(),
                destroyed: false,
            });
        }
    }
    for r in &mut batch.0 {
        r.destroyed = r.destroy(how);
    }
    batch.0.iter().filter(|r| r.destroyed).count()
}

impl Retrying {
    /// Waits for the stream (or finds it has passed its work, for [`Retry::Poll`]), then
    /// destroys its events and the stream. Returns whether the stream is gone at the runtime.
    fn destroy(&mut self, how: Retry) -> bool {
        if how == Retry::Poll && !self.passed() {
            return false;
        }
        let src = &*self.source;
        match src.synchronize_stream(self.handle) {
            Ok(()) => {}
            // Gone already: its handle was destroyed behind the pool's back. What it waited
            // on is passed for the pool too (`pool::wait_for_stream`).
            Err(e) if crate::pool::stream_gone(&e) => {}
            Err(_) => return false,
        }
        // Run: no wait queued on the stream names an event any more. Each event leaves the
        // list just before its call: if the source panics there, the others stay listed for
        // a later retry, and that one is not destroyed twice (the runtime may have done it).
        while let Some(ev) = self.events.pop().or_else(|| self.probe.take()) {
            let _ = src.destroy_event(ev);
        }
        match src.destroy_stream(self.handle) {
            Ok(()) => true,
            Err(e) => crate::pool::stream_gone(&e),
        }
    }

    /// Whether the stream has run the work queued on it before its probe event, recording
    /// the probe if it has none. A failed call says nothing: not yet. A handle the runtime
    /// no longer knows has nothing left to run.
    fn passed(&mut self) -> bool {
        let src = &*self.source;
        let ev = match self.probe {
            Some(ev) => ev,
            None => {
                let Ok(ev) = src.create_event(self.device) else {
                    return false;
                };
                // Listed with the wait events while it is recorded: if the source panics
                // there, the event is destroyed with them, once the stream has been waited for.
                self.events.push(ev);
                let recorded = src.record_event(ev, self.handle);
                self.events.pop();
                if let Err(e) = recorded {
                    let _ = src.destroy_event(ev);
                    return crate::pool::stream_gone(&e);
                }
                self.probe = Some(ev);
                ev
            }
        };
        src.query_event(ev).unwrap_or(false)
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        // A stream that could not be waited for is kept, as one the runtime would not
        // destroy: its work may still run, and the pool takes a destroyed handle for a
        // stream whose work has run (`pool::wait_for_stream`). In a child made by `fork`,
        // the parent's stream and its events are not this process's to wait for or destroy
        // ([`crate::fork`]): no call is made for them, and the stream is kept (never retried
        // there), whether or not the source would refuse the calls.
        let ours = crate::fork::ours(self.made_in);
        let synced = ours && self.source.synchronize_stream(self.handle).is_ok();
        let w = self.waits.get_mut().unwrap_or_else(|p| p.into_inner());
        // Once the stream has run its work, no wait of it names an event of `queued`; if it
        // could not be synchronized they are kept with the stream (at most
        // `WAIT_EVENTS_MAX`), for a retry to destroy.
        let done = synced.then(|| std::mem::take(&mut w.queued));
        if ours {
            for ev in w
                .idle
                .drain(..)
                .chain(w.marker.take())
                .chain(done.into_iter().flatten())
            {
                let _ = self.source.destroy_event(ev);
            }
        }
        if synced && self.source.destroy_stream(self.handle).is_ok() {
            return;
        }
        let kept = KeptStream {
            source: Arc::clone(&self.source),
            handle: self.handle,
            device: self.device,
            made_in: self.made_in,
            alive: Arc::clone(&self.alive),
            events: std::mem::take(&mut w.queued),
            probe: None,
            busy: false,
            id: NEXT_KEPT_ID.fetch_add(1, Ordering::Relaxed),
        };
        match kept_list() {
            Some(mut list) => {
                list.push(kept);
                LISTED.store(list.len(), Ordering::Release);
            }
            // In a child made by `fork`, held for good by a thread of the parent: the
            // token is leaked instead, which keeps it alive as well (never retried).
            None => {
                LEAKED.fetch_add(1, Ordering::Relaxed);
                std::mem::forget(kept.alive);
            }
        }
    }
}

/// Checks `offset + len <= capacity` without overflow, and `len > 0`; `side` is the end of
/// a copy the range is in, for the error to name.
pub(crate) fn check_bounds(
    side: Option<CopySide>,
    offset: u64,
    len: u64,
    capacity: u64,
) -> Result<()> {
    match offset.checked_add(len) {
        Some(end) if end <= capacity && len > 0 => Ok(()),
        _ => Err(Error::OutOfBounds {
            offset,
            len,
            capacity,
            side,
        }),
    }
}

fn copy_kind(dst: MemKind, src: MemKind) -> MemcpyKind {
    MemcpyKind::between(dst, src)
}

impl Pool {
    fn typed<T>(
        &self,
        kind: MemKind,
        len: u64,
        align: u64,
        wrap: impl FnOnce(Segment) -> T,
    ) -> Result<T> {
        let crate::pool::OwnedSegment { raw, owner } = self.alloc_raw(kind, len, align)?;
        Ok(wrap(Segment::new(owner, raw)))
    }

    /// Device memory (`aclrtMalloc` with the pool's policy), 64-aligned.
    pub fn alloc_device(&self, len: u64) -> Result<DeviceRegion> {
        self.typed(MemKind::Device(self.config().policy), len, 64, |seg| {
            DeviceRegion {
                seg,
                _align: PhantomData,
            }
        })
    }

    /// Device memory of one of the device kinds (`Device`, `DeviceAlign32`, `Cached`).
    ///
    /// The allocation policy is the pool's ([`PoolConfig::policy`](crate::PoolConfig::policy)),
    /// whatever `kind` names: every chunk of a kind comes from the source under it, and so
    /// does the carve rule (the 32 bytes of padding, or none under the 1 GiB-page
    /// policies); the region's [`kind`](Region::kind) says so.
    pub fn alloc_device_kind(&self, kind: MemKind, len: u64) -> Result<DeviceRegion> {
        if matches!(kind, MemKind::Dvpp | MemKind::Host) {
            return Err(Error::WrongKind {
                expected: "device, device_align32 or cached",
                got: kind,
            });
        }
        self.typed(kind, len, 64, |seg| DeviceRegion {
            seg,
            _align: PhantomData,
        })
    }

    /// Device memory (the pool's policy) starting at a multiple of `align`, a power of two
    /// from 64 to [`MAX_ALIGN`](crate::align::MAX_ALIGN): page-aligned buffers, or a window
    /// a communication library registers (HCCL wants its start and length at multiples of
    /// 2 MiB; ask for such a length too). Any other `align` is refused with
    /// [`CarveRuleError::BadAlignment`](crate::align::CarveRuleError::BadAlignment).
    /// Requests sharing an alignment share chunks; a chunk whose start does not have it is
    /// skipped, so a large alignment may take a chunk of its own. The carve rule rounds a
    /// segment's footprint up to a multiple of its alignment, so large alignments cost
    /// memory: with the default 32-byte padding a 2 MiB window takes 4 MiB (exactly 2 MiB in
    /// a pool without padding), and 100 bytes at a 1 MiB start take 1 MiB.
    ///
    /// ```
    /// # use ascend_pool::{Pool, PoolConfig, SimSource, Region};
    /// # use std::sync::Arc;
    /// let pool = Pool::new(Arc::new(SimSource::default()), PoolConfig::default())?;
    /// let window = pool.alloc_device_aligned(4 << 20, 2 << 20)?;
    /// assert_eq!(window.addr() % (2 << 20), 0);
    /// assert!(pool.alloc_device_aligned(4096, 96).is_err());
    /// # Ok::<(), ascend_pool::Error>(())
    /// ```
    pub fn alloc_device_aligned(&self, len: u64, align: u64) -> Result<DeviceRegion> {
        self.typed(MemKind::Device(self.config().policy), len, align, |seg| {
            DeviceRegion {
                seg,
                _align: PhantomData,
            }
        })
    }

    /// Device memory with 128-byte starts, fit for model input.
    pub fn alloc_model_input(&self, len: u64) -> Result<DeviceRegion<Align128>> {
        self.typed(MemKind::Device(self.config().policy), len, 128, |seg| {
            DeviceRegion {
                seg,
                _align: PhantomData,
            }
        })
    }

    /// DVPP memory (`acldvppMalloc`), 128-aligned.
    pub fn alloc_dvpp(&self, len: u64) -> Result<DvppRegion> {
        self.typed(MemKind::Dvpp, len, 128, |seg| DvppRegion { seg })
    }

    /// Pinned host memory (`aclrtMallocHost`), 64-aligned.
    pub fn alloc_host(&self, len: u64) -> Result<HostRegion> {
        self.typed(MemKind::Host, len, 64, |seg| HostRegion { seg })
    }

    /// Device memory for work ordered on `stream`, 64-aligned, recorded on `stream`.
    ///
    /// Memory freed while work queued on this one stream still used it is reused at once
    /// (no event is queried or waited for): work queued on `stream` runs after that work.
    /// Host-side access to the region (the synchronous copies, [`Pool::memset`]) first waits
    /// for that work, and work queued on other streams is ordered after it, so the region
    /// is safe to use every way.
    ///
    /// ```
    /// use ascend_pool::{Pool, PoolConfig, SimSource, region::Region};
    /// use std::sync::Arc;
    /// let pool = Pool::new(Arc::new(SimSource::default()), PoolConfig::default()).unwrap();
    /// let stream = pool.create_stream().unwrap();
    /// let (mut a, src) = (pool.alloc_device_on(1 << 20, &stream).unwrap(), pool.alloc_device(1 << 20).unwrap());
    /// pool.copy_async(&mut a, 0, &src, 0, 1 << 20, &stream).unwrap();
    /// let addr = a.addr();
    /// drop(a); // the copy may still be queued
    /// let b = pool.alloc_device_on(1 << 20, &stream).unwrap();
    /// assert_eq!(b.addr(), addr); // same stream: reused at once
    /// ```
    pub fn alloc_device_on(&self, len: u64, stream: &Stream) -> Result<DeviceRegion> {
        let kind = MemKind::Device(self.config().policy);
        let seg = self.segment_on(kind, len, 64, stream)?;
        Ok(DeviceRegion {
            seg,
            _align: PhantomData,
        })
    }

    /// Model input (128-byte starts) for work ordered on `stream`, as
    /// [`alloc_device_on`](Self::alloc_device_on): a segment freed behind `stream`'s work is
    /// taken over at once only when it has the length asked for and a 128-aligned start.
    pub fn alloc_model_input_on(
        &self,
        len: u64,
        stream: &Stream,
    ) -> Result<DeviceRegion<Align128>> {
        let kind = MemKind::Device(self.config().policy);
        let seg = self.segment_on(kind, len, 128, stream)?;
        Ok(DeviceRegion {
            seg,
            _align: PhantomData,
        })
    }

    /// DVPP memory for work ordered on `stream` (see [`alloc_device_on`](Self::alloc_device_on)).
    pub fn alloc_dvpp_on(&self, len: u64, stream: &Stream) -> Result<DvppRegion> {
        let seg = self.segment_on(MemKind::Dvpp, len, 128, stream)?;
        Ok(DvppRegion { seg })
    }

    fn segment_on(&self, kind: MemKind, len: u64, align: u64, stream: &Stream) -> Result<Segment> {
        self.own_stream(stream)?;
        let (raw, pool, after) =
            self.inner
                .allocate_on(self.anchor(kind), kind, len, align, stream.handle)?;
        let seg = Segment::new(pool, raw);
        *seg.after.lock().unwrap_or_else(|p| p.into_inner()) = after.map(|ev| (stream.handle, ev));
        seg.note_stream(stream);
        Ok(seg)
    }

    /// A new stream on the pool's device.
    pub fn create_stream(&self) -> Result<Stream> {
        let device = self.config().device;
        let handle = self.source().create_stream(device)?;
        Ok(Stream {
            source: Arc::clone(self.source()),
            handle,
            device,
            made_in: crate::fork::generation(),
            alive: Arc::new(()),
            waits: Mutex::default(),
        })
    }

    /// A stream of another source: its handle means nothing to this one (or names another
    /// stream of this one), so work must not be queued under it. A stream of another device
    /// of this source runs that device's work, not this pool's.
    pub(crate) fn own_stream(&self, stream: &Stream) -> Result<()> {
        stream.belongs_to(self.source(), self.config().device)
    }

    pub(crate) fn same_source(&self, r: &impl Region) -> Result<()> {
        if Arc::ptr_eq(r.segment().pool(), &self.inner)
            || Arc::ptr_eq(r.segment().source(), self.source())
        {
            Ok(())
        } else {
            Err(Error::ForeignHandle)
        }
    }

    /// Copies `src` into `dst` at `offset` and waits.
    ///
    /// Like every synchronous copy and fill here, it first waits for the streams with work
    /// queued on the regions it touches (see [`Pool::copy_async`]): that work was queued
    /// first, and the bytes are not touched under it.
    pub fn copy_from_host(&self, dst: &mut impl Region, offset: u64, src: &[u8]) -> Result<()> {
        self.same_source(dst)?;
        check_bounds(Some(Destination), offset, src.len() as u64, dst.len())?;
        dst.segment().settle_streams_for_host()?;
        let kind = copy_kind(dst.kind(), MemKind::Host);
        // SAFETY: bounds checked above; `dst` is a live region of this source, exclusively
        // borrowed, with no stream work left on it (settled above); `src` is a live host
        // slice of `src.len()` bytes.
        unsafe {
            self.source().memcpy(
                dst.addr() + offset as usize,
                dst.len() - offset,
                src.as_ptr() as usize,
                src.len() as u64,
                kind,
            )
        }
    }

    /// Copies `dst.len()` bytes of `src` from `offset` into `dst` and waits.
    pub fn copy_to_host(&self, src: &impl Region, offset: u64, dst: &mut [u8]) -> Result<()> {
        self.same_source(src)?;
        check_bounds(Some(Source), offset, dst.len() as u64, src.len())?;
        src.segment().settle_streams_for_host()?;
        let kind = copy_kind(MemKind::Host, src.kind());
        // SAFETY: bounds checked; `src` is a live region of this source that no stream
        // writes any more (settled above); `dst` a live slice.
        unsafe {
            self.source().memcpy(
                dst.as_mut_ptr() as usize,
                dst.len() as u64,
                src.addr() + src_offset(offset),
                dst.len() as u64,
                kind,
            )
        }
    }

    /// Copies `len` bytes between regions and waits.
    ///
    /// Device memory of two devices (regions of pools of one source for two devices) is
    /// refused with [`Error::ForeignHandle`], as [`Pool::copy_async`] refuses it: the runtime
    /// copies between two devices only once peer access is enabled between them, which the
    /// pool never does. Either side may be host memory of any pool of the source.
    pub fn copy(
        &self,
        dst: &mut impl Region,
        dst_offset: u64,
        src: &impl Region,
        src_off: u64,
        len: u64,
    ) -> Result<()> {
        self.same_source(dst)?;
        self.same_source(src)?;
        if dst.kind().is_device()
            && src.kind().is_device()
            && dst.segment().device() != src.segment().device()
        {
            return Err(Error::ForeignHandle);
        }
        check_bounds(Some(Destination), dst_offset, len, dst.len())?;
        check_bounds(Some(Source), src_off, len, src.len())?;
        dst.segment().settle_streams_for_host()?;
        src.segment().settle_streams_for_host()?;
        // SAFETY: both ranges checked against live regions of this source, with no stream
        // work left on either (settled above); `dst` is exclusively borrowed, so the two do
        // not alias.
        unsafe {
            self.source().memcpy(
                dst.addr() + dst_offset as usize,
                dst.len() - dst_offset,
                src.addr() + src_off as usize,
                len,
                copy_kind(dst.kind(), src.kind()),
            )
        }
    }

    /// Queues a copy of `len` bytes between regions on `stream`.
    ///
    /// Both offsets must keep 64-byte alignment, as `aclrtMemcpyAsync` requires, and one end
    /// at least must be device memory: the runtime does no asynchronous copy within the host
    /// (two host regions: [`Error::WrongKind`]; use [`Pool::copy`]). Both regions
    /// are recorded on the stream, so dropping either before the copy has run is safe: its
    /// memory is reused only after the stream passes the copy. A stream or a region of
    /// another source, or of another device, is refused with [`Error::ForeignHandle`].
    pub fn copy_async(
        &self,
        dst: &mut impl AsyncCopySafe,
        dst_offset: u64,
        src: &impl AsyncCopySafe,
        src_off: u64,
        len: u64,
        stream: &Stream,
    ) -> Result<()> {
        self.own_stream(stream)?;
        dst.segment().takes_stream(stream)?;
        src.segment().takes_stream(stream)?;
        check_bounds(Some(Destination), dst_offset, len, dst.len())?;
        check_bounds(Some(Source), src_off, len, src.len())?;
        if !dst.kind().is_device() && !src.kind().is_device() {
            return Err(Error::WrongKind {
                expected: "device",
                got: src.kind(),
            });
        }
        for (side, addr, off) in [
            (Destination, dst.addr(), dst_offset),
            (Source, src.addr(), src_off),
        ] {
            // The region starts 64-aligned (`AsyncCopySafe`): the caller's offset is at fault.
            if (addr as u64 + off) % 64 != 0 {
                return Err(Error::Misaligned {
                    addr: off,
                    required: 64,
                    side: Some(side),
                });
            }
        }
        dst.segment().settle_for_stream(stream.handle)?;
        src.segment().settle_for_stream(stream.handle)?;
        dst.segment().note_stream(stream);
        src.segment().note_stream(stream);
        // SAFETY: ranges checked against live regions; both are recorded on the stream, so
        // their memory stays reserved until the stream has passed the copy.
        unsafe {
            self.source().memcpy_async(
                dst.addr() + dst_offset as usize,
                dst.len() - dst_offset,
                src.addr() + src_off as usize,
                len,
                copy_kind(dst.kind(), src.kind()),
                stream.handle,
            )
        }
    }

    /// Fills `len` bytes of `dst` from `offset` with `value` and waits.
    pub fn memset(&self, dst: &mut impl Region, offset: u64, value: u8, len: u64) -> Result<()> {
        self.same_source(dst)?;
        check_bounds(None, offset, len, dst.len())?;
        dst.segment().settle_streams_for_host()?;
        // SAFETY: range checked against a live, exclusively borrowed region of this source
        // with no stream work left on it (settled above).
        unsafe {
            self.source()
                .memset(dst.addr() + offset as usize, dst.len() - offset, value, len)
        }
    }

    /// Queues a fill on `stream`; the region is recorded on the stream. A stream or a region
    /// of another source, or of another device, is refused with [`Error::ForeignHandle`].
    pub fn memset_async(
        &self,
        dst: &mut impl AsyncCopySafe,
        offset: u64,
        value: u8,
        len: u64,
        stream: &Stream,
    ) -> Result<()> {
        self.own_stream(stream)?;
        dst.segment().takes_stream(stream)?;
        check_bounds(None, offset, len, dst.len())?;
        dst.segment().settle_for_stream(stream.handle)?;
        dst.segment().note_stream(stream);
        // SAFETY: range checked; the region is recorded on the stream so it outlives the fill.
        unsafe {
            self.source().memset_async(
                dst.addr() + offset as usize,
                dst.len() - offset,
                value,
                len,
                stream.handle,
            )
        }
    }
}

fn src_offset(offset: u64) -> usize {
    offset as usize
}

/// A view of part of a region that keeps the region's guarantees.
///
/// It borrows its parent exclusively, like the parent's own `&mut`: the pool may write
/// through the view, so nothing else may read or write the parent's bytes meanwhile.
///
/// ```compile_fail
/// # fn f(pool: &ascend_pool::Pool) -> ascend_pool::Result<()> {
/// use ascend_pool::region::SubRegion;
/// let mut host = pool.alloc_host(256)?;
/// let seen = host.as_slice(); // a shared borrow of the bytes...
/// let mut head = SubRegion::new(&mut host, 0, 64)?; // ...so no writable view now
/// pool.memset(&mut head, 0, 1, 64)?;
/// assert_eq!(seen[0], 1);
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct SubRegion<'a, R: Region> {
    /// Exclusive: writes through the view must not alias any other borrow of the parent.
    parent: &'a mut R,
    offset: u64,
    len: u64,
}

impl<'a, R: Region> SubRegion<'a, R> {
    /// `len` bytes of `parent` from `offset`; the offset must keep the parent's alignment.
    pub fn new(parent: &'a mut R, offset: u64, len: u64) -> Result<Self> {
        check_bounds(None, offset, len, parent.len())?;
        if offset % parent.align() != 0 {
            return Err(Error::Misaligned {
                addr: parent.addr() as u64 + offset,
                required: parent.align(),
                side: None,
            });
        }
        Ok(Self {
            parent,
            offset,
            len,
        })
    }

    /// Offset in the parent.
    pub fn offset(&self) -> u64 {
        self.offset
    }
}

impl<R: Region> sealed::Sealed for SubRegion<'_, R> {}
impl<R: Region> Region for SubRegion<'_, R> {
    fn addr(&self) -> usize {
        self.parent.addr() + self.offset as usize
    }
    fn len(&self) -> u64 {
        self.len
    }
    fn kind(&self) -> MemKind {
        self.parent.kind()
    }
    fn align(&self) -> u64 {
        self.parent.align()
    }
    fn segment(&self) -> &Segment {
        self.parent.segment()
    }
}
impl<R: AsyncCopySafe> AsyncCopySafe for SubRegion<'_, R> {}
impl<R: DvppInput> DvppInput for SubRegion<'_, R> {}
impl<R: DvppOutput> DvppOutput for SubRegion<'_, R> {}
impl<R: ModelInput> ModelInput for SubRegion<'_, R> {}
