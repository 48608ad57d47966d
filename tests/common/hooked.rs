//! The simulator behind a source that calls a hook before it passes each call on: a test
//! counts the calls, makes one of them panic (as a source whose thread-locals are gone
//! does), or stops a thread inside one while it holds whatever the pool holds around it.

use ascend_pool::source::sim::SimSource;
use ascend_pool::source::{Block, BlockSource, EventHandle, MemcpyKind, StreamHandle};
use ascend_pool::{MemKind, Result};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// A call through [`Hooked`], with what hooks tell calls apart by.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[allow(dead_code)] // each suite matches the calls it needs
pub enum Call {
    AllocBlock,
    /// The kind of the block being freed.
    FreeBlock(MemKind),
    ExtendBlock,
    ShrinkBlock,
    MemInfo,
    CreateStream,
    DestroyStream,
    SynchronizeStream,
    CreateEvent,
    DestroyEvent,
    RecordEvent,
    QueryEvent,
    SynchronizeEvent,
    StreamWaitEvent,
    Memcpy,
    MemcpyAsync,
    Memset,
    MemsetAsync,
}

/// What runs before each call reaches the simulator.
pub trait Hook: Send + Sync + std::fmt::Debug + 'static {
    fn on(&self, call: Call);
}

/// Passes every call on to `sim`, after `hook` has seen it.
#[derive(Debug)]
pub struct Hooked<H> {
    pub sim: Arc<SimSource>,
    pub hook: H,
}

#[allow(dead_code)] // each suite uses what it needs
impl<H: Hook> Hooked<H> {
    pub fn with(sim: Arc<SimSource>, hook: H) -> Self {
        Self { sim, hook }
    }
}

impl<H: Hook> BlockSource for Hooked<H> {
    fn name(&self) -> &str {
        "hooked-sim"
    }
    fn alloc_block(&self, device: i32, kind: MemKind, size: u64) -> Result<Block> {
        self.hook.on(Call::AllocBlock);
        self.sim.alloc_block(device, kind, size)
    }
    fn free_block(&self, block: Block) -> Result<()> {
        self.hook.on(Call::FreeBlock(block.kind));
        self.sim.free_block(block)
    }
    fn extend_block(&self, block: Block, additional: u64) -> Result<Option<Block>> {
        self.hook.on(Call::ExtendBlock);
        self.sim.extend_block(block, additional)
    }
    fn shrink_block(&self, block: Block, new_size: u64) -> Result<Block> {
        self.hook.on(Call::ShrinkBlock);
        self.sim.shrink_block(block, new_size)
    }
    fn mem_info(&self, device: i32, kind: MemKind) -> Result<(u64, u64)> {
        self.hook.on(Call::MemInfo);
        self.sim.mem_info(device, kind)
    }
    fn create_stream(&self, device: i32) -> Result<StreamHandle> {
        self.hook.on(Call::CreateStream);
        self.sim.create_stream(device)
    }
    fn destroy_stream(&self, stream: StreamHandle) -> Result<()> {
        self.hook.on(Call::DestroyStream);
        self.sim.destroy_stream(stream)
    }
    fn synchronize_stream(&self, stream: StreamHandle) -> Result<()> {
        self.hook.on(Call::SynchronizeStream);
        self.sim.synchronize_stream(stream)
    }
    fn create_event(&self, device: i32) -> Result<EventHandle> {
        self.hook.on(Call::CreateEvent);
        self.sim.create_event(device)
    }
    fn destroy_event(&self, event: EventHandle) -> Result<()> {
        self.hook.on(Call::DestroyEvent);
        self.sim.destroy_event(event)
    }
    fn record_event(&self, event: EventHandle, stream: StreamHandle) -> Result<()> {
        self.hook.on(Call::RecordEvent);
        self.sim.record_event(event, stream)
    }
    fn query_event(&self, event: EventHandle) -> Result<bool> {
        self.hook.on(Call::QueryEvent);
        self.sim.query_event(event)
    }
    fn synchronize_event(&self, event: EventHandle) -> Result<()> {
        self.hook.on(Call::SynchronizeEvent);
        self.sim.synchronize_event(event)
    }
    fn stream_wait_event(&self, stream: StreamHandle, event: EventHandle) -> Result<()> {
        self.hook.on(Call::StreamWaitEvent);
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
        self.hook.on(Call::Memcpy);
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
        self.hook.on(Call::MemcpyAsync);
        // SAFETY: the caller's contract, passed on unchanged.
        unsafe {
            self.sim
                .memcpy_async(dst, dst_max, src, count, kind, stream)
        }
    }
    unsafe fn memset(&self, dst: usize, max: u64, value: u8, count: u64) -> Result<()> {
        self.hook.on(Call::Memset);
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
        self.hook.on(Call::MemsetAsync);
        // SAFETY: the caller's contract, passed on unchanged.
        unsafe { self.sim.memset_async(dst, max, value, count, stream) }
    }
    fn device_count(&self) -> Option<u32> {
        self.sim.device_count()
    }
}

/// A hook that counts every call and can make one panic (before it reaches the simulator).
#[derive(Debug, Default)]
pub struct Watch {
    /// Calls made so far.
    calls: AtomicU64,
    /// The next call of this kind panics, once.
    panic_in: Mutex<Option<Call>>,
}

impl Hook for Watch {
    fn on(&self, call: Call) {
        self.calls.fetch_add(1, Ordering::SeqCst);
        let mut armed = self.panic_in.lock().unwrap_or_else(|p| p.into_inner());
        if *armed == Some(call) {
            *armed = None;
            drop(armed);
            panic!("the source panicked in {call:?}");
        }
    }
}

/// The simulator with every call counted, one of them able to panic.
pub type Watched = Hooked<Watch>;

#[allow(dead_code)] // each suite uses what it needs
impl Watched {
    pub fn new(sim: Arc<SimSource>) -> Self {
        Self::with(sim, Watch::default())
    }

    /// Calls made so far.
    pub fn calls(&self) -> u64 {
        self.hook.calls.load(Ordering::SeqCst)
    }

    /// Makes the next call of `call` panic.
    pub fn panic_in(&self, call: Call) {
        *self.hook.panic_in.lock().unwrap() = Some(call);
    }
}
