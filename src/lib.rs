//! # ascend-pool
//!
//! A sub-allocator for Huawei Ascend NPU memory. Big blocks come from `aclrtMalloc`,
//! `aclrtMallocAlign32`, `aclrtMallocCached`, `acldvppMalloc` or `aclrtMallocHost`;
//! the library carves them following the AscendCL rule for sub-allocation (every
//! segment `m = ALIGN_UP(len, 32) + 32`, its start 64-aligned, 128 for DVPP output
//! that feeds a model) and hands them out as typed regions.
//!
//! The layers, bottom to top, one module each:
//! - [`align`]: the carve rule, pure arithmetic;
//! - [`kind`]: memory kinds and the rule each implies;
//! - [`engine`]: carving engines over offsets (buddy, TLSF, slab), no memory, no `unsafe`;
//! - [`source`]: block sources, the only code that talks to a runtime;
//! - [`pool`]: one pool per memory kind, chunks from a source, statistics, snapshots;
//! - [`region`]: typed regions and validated copies, the public face;
//! - [`share`]: device memory published by one process and opened by another, over the
//!   virtual-memory source ([`source::vmm`]); [`mbuf`]: shared buffers on top;
//! - [`comm`]: one-sided writes of a region into another rank's registered window;
//! - [`trace`] and [`peers`]: tools — allocation traces, a validating reader, a replay driver
//!   (the whole pool on the simulator, or one range per kind), and other range allocators
//!   behind the same replay trait for comparison; [`svg`]: pictures of a pool and a replay;
//! - [`error`]: the typed errors every layer returns; [`fork`]: what a child made by `fork`
//!   may use of its parent's.
#![warn(missing_docs, missing_debug_implementations, rust_2018_idioms)]

pub mod align;
pub mod comm;
pub mod engine;
pub mod error;
pub mod fork;
pub mod kind;
pub mod mbuf;
pub mod peers;
pub mod pool;
pub mod region;
pub mod share;
pub mod source;
pub mod svg;
pub mod trace;

pub use align::CarveRule;
pub use error::{AclError, CopySide, Error, Result, Shortage};
pub use kind::{MallocPolicy, MemKind};
pub use pool::{Pool, PoolConfig};
pub use region::{DeviceRegion, DvppRegion, HostRegion, Region, Stream};
pub use source::sim::SimSource;
