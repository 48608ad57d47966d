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
//! - [`error`]: the typed errors every layer returns.
#![warn(missing_docs, missing_debug_implementations, rust_2018_idioms)]

pub mod align;
pub mod engine;

pub mod error;
pub mod kind;
pub mod source;

pub use align::CarveRule;
pub use error::{AclError, Error, Result};
pub use kind::{MallocPolicy, MemKind};
pub use source::sim::SimSource;
