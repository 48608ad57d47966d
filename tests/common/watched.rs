//! The simulator behind a source that counts the runtime calls made through it, and can be
//! made to panic in one of them (as a source whose thread-locals are gone does).

use ascend_pool::source::sim::SimSource;
use ascend_pool::source::{Block, BlockSource, EventHandle, MemcpyKind, StreamHandle};
use ascend_pool::{MemKind, Result};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// A call [`Watched`] can be made to panic in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[allow(dead_code)] // each suite arms the calls it needs
pub enum Call {
    SynchronizeStream,
    DestroyStream,
    CreateEvent,
    DestroyEvent,
    RecordEvent,
}

/// Passes every call on to `sim`, counting the stream and event calls.
#[derive(Debug)]
pub struct Watched {
    pub sim: Arc<SimSource>,
    /// Stream and event calls made so far.
    calls: AtomicU64,
    /// The next call of this kind panics (before reaching the simulator), once.
    panic_in: Mutex<Option<Call>>,
}

#[allow(dead_code)] // each suite uses what it needs
impl Watched {
    pub fn new(sim: Arc<SimSource>) -> Self {
        Self {
            sim,
            calls: AtomicU64::new(0),
            panic_in: Mutex::new(None),
        }
    }

    /// Stream and event calls made so far.
    pub fn calls(&self) -> u64 {
        self.calls.load(Ordering::SeqCst)
    }

    /// Makes the next call of `call` panic.
    pub fn panic_in(&self, call: Call) {
        *self.panic_in.lock().unwrap() = Some(call);
    }

    fn enter(&self, call: Call) {
        self.calls.fetch_add(1, Ordering::SeqCst);
        let mut armed = self.panic_in.lock().unwrap_or_else(|p| p.into_inner());
        if *armed == Some(call) {
            *armed = None;
            drop(armed);
            panic!("the source panicked in {call:?}");
        }
    }

    fn count(&self) {
        self.calls.fetch_add(1, Ordering::SeqCst);
    }
}

impl BlockSource for Watched {
    fn name(&self) -> &str {
        "watched-sim"
    }
    fn alloc_block(&self, device: i32, kind: MemKind, size: u64) -> Result<Block> {
        self.sim.alloc_block(device, kind, size)
    }
    fn free_block(&self, block: Block) -> Result<()> {
        self.sim.free_block(block)
    }
    fn mem_info(&self, device: i32, kind: MemKind) -> Result<(u64, u64)> {
        self.sim.mem_info(device, kind)
    }
    fn create_stream(&self, device: i32) -> Result<StreamHandle> {
        self.count();
        self.sim.create_stream(device)
    }
    fn destroy_stream(&self, stream: StreamHandle) -> Result<()> {
        self.enter(Call::DestroyStream);
        self.sim.destroy_stream(stream)
    }
    fn synchronize_stream(&self, stream: StreamHandle) -> Result<()> {
        self.enter(Call::SynchronizeStream);
        self.sim.synchronize_stream(stream)
    }
    fn create_event(&self, device: i32) -> Result<EventHandle> {
        self.enter(Call::CreateEvent);
        self.sim.create_event(device)
    }
    fn destroy_event(&self, event: EventHandle) -> Result<()> {
        self.enter(Call::DestroyEvent);
        self.sim.destroy_event(event)
    }
    fn record_event(&self, event: EventHandle, stream: StreamHandle) -> Result<()> {
        self.enter(Call::RecordEvent);
        self.sim.record_event(event, stream)
    }
    fn query_event(&self, event: EventHandle) -> Result<bool> {
        self.count();
        self.sim.query_event(event)
    }
    fn synchronize_event(&self, event: EventHandle) -> Result<()> {
        self.count();
        self.sim.synchronize_event(event)
    }
    fn stream_wait_event(&self, stream: StreamHandle, event: EventHandle) -> Result<()> {
        self.count();
        self.sim.stream_wait_event(stream, event)
    }
    unsafe fn memcpy(
        &self,
        dst: usize,
        dst_max: u64,
        src: usize,
        count: u64,
        kind: MemcpyKind,
    ) -> Result<()> {
        // SAFETY: the caller's contract, passed on unchanged.
        unsafe { self.sim.memcpy(dst, dst_max, src, count, kind) }
    }
    unsafe fn memcpy_async(
        &self,
        dst: usize,
        dst_max: u64,
        src: usize,
        count: u64,
        kind: MemcpyKind,
        stream: StreamHandle,
    ) -> Result<()> {
        self.count();
        // SAFETY: the caller's contract, passed on unchanged.
        unsafe {
            self.sim
                .memcpy_async(dst, dst_max, src, count, kind, stream)
        }
    }
    unsafe fn memset(&self, dst: usize, max: u64, value: u8, count: u64) -> Result<()> {
        // SAFETY: the caller's contract, passed on unchanged.
        unsafe { self.sim.memset(dst, max, value, count) }
    }
    unsafe fn memset_async(
        &self,
        dst: usize,
        max: u64,
        value: u8,
        count: u64,
        stream: StreamHandle,
    ) -> Result<()> {
        self.count();
        // SAFETY: the caller's contract, passed on unchanged.
        unsafe { self.sim.memset_async(dst, max, value, count, stream) }
    }
    fn device_count(&self) -> Option<u32> {
        self.sim.device_count()
    }
}
