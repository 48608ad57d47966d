//! What the simulator has been asked to do: a snapshot for tests and reports.

use std::collections::{BTreeMap, HashMap};

use super::fault::AclFunc;
use crate::kind::MemKind;
use crate::source::DeviceId;

/// Bytes and blocks live in one (device, kind) pair.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct KindUsage {
    /// Live blocks.
    pub blocks: u64,
    /// Bytes as the runtime accounts them (`ALIGN_UP(size, 32) + padding`).
    pub rounded_bytes: u64,
    /// Bytes the callers asked for.
    pub requested_bytes: u64,
}

/// A snapshot of the simulator's counters, from [`SimSource::stats`](super::SimSource::stats).
///
/// ```
/// use ascend_pool::source::sim::{AclFunc, SimSource};
/// use ascend_pool::source::BlockSource;
/// use ascend_pool::MemKind;
/// let sim = SimSource::default();
/// let b = sim.alloc_block(0, MemKind::DEVICE, 100).unwrap();
/// let s = sim.stats();
/// assert_eq!(s.calls(AclFunc::Malloc), 1);
/// assert_eq!(s.usage(0, MemKind::DEVICE).rounded_bytes, 160);
/// assert_eq!(s.live_blocks, 1);
/// sim.free_block(b).unwrap();
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SimStats {
    /// Calls per function, failed ones included.
    pub calls: BTreeMap<AclFunc, u64>,
    /// Failed calls per function (refused input, exhaustion or injected faults).
    pub failures: BTreeMap<AclFunc, u64>,
    /// Live usage per device and kind (host blocks under the device they were asked on).
    pub usage: HashMap<(DeviceId, MemKind), KindUsage>,
    /// Live blocks over every device and kind.
    pub live_blocks: u64,
    /// Streams created and not destroyed.
    pub live_streams: u64,
    /// Events created and not destroyed.
    pub live_events: u64,
    /// Reserved address ranges (`aclrtReserveMemAddress`) not released.
    pub reservations: u64,
    /// Physical allocations, local or imported, not freed.
    pub physical_handles: u64,
    /// Live `aclrtMapMem` mappings.
    pub mappings: u64,
    /// Live shared-buffer handles (`acltdtAllocBuf`, `acltdtCopyBufRef`).
    pub mbuf_handles: u64,
}

impl SimStats {
    /// Calls of `func`, failed ones included.
    pub fn calls(&self, func: AclFunc) -> u64 {
        self.calls.get(&func).copied().unwrap_or(0)
    }

    /// Failed calls of `func`.
    pub fn failures(&self, func: AclFunc) -> u64 {
        self.failures.get(&func).copied().unwrap_or(0)
    }

    /// Allocation calls for `kind` (every kind sharing its function, e.g. all `aclrtMalloc` policies).
    pub fn alloc_calls(&self, kind: MemKind) -> u64 {
        self.calls(AclFunc::alloc_for(kind))
    }

    /// Free calls for `kind` (`aclrtFree` counts for the three `aclrtMalloc*` kinds together).
    pub fn free_calls(&self, kind: MemKind) -> u64 {
        self.calls(AclFunc::free_for(kind))
    }

    /// Live usage of `kind` on `device` (zero when none).
    pub fn usage(&self, device: DeviceId, kind: MemKind) -> KindUsage {
        self.usage.get(&(device, kind)).copied().unwrap_or_default()
    }

    /// Rounded bytes live on `device` over every kind.
    pub fn rounded_bytes_on(&self, device: DeviceId) -> u64 {
        self.usage
            .iter()
            .filter(|((d, _), _)| *d == device)
            .map(|(_, u)| u.rounded_bytes)
            .sum()
    }
}
