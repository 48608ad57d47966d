//! The AscendCL functions the simulator answers, and fault injection on them.

use crate::error::AclError;
use crate::kind::MemKind;

/// An AscendCL function the simulator implements: the key of call counters and faults.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum AclFunc {
    /// `aclrtMalloc`.
    Malloc,
    /// `aclrtMallocAlign32`.
    MallocAlign32,
    /// `aclrtMallocCached`.
    MallocCached,
    /// `acldvppMalloc`.
    DvppMalloc,
    /// `aclrtMallocHost`.
    MallocHost,
    /// `aclrtFree` (frees `aclrtMalloc`, `aclrtMallocAlign32` and `aclrtMallocCached` memory).
    Free,
    /// `acldvppFree`.
    DvppFree,
    /// `aclrtFreeHost`.
    FreeHost,
    /// `aclrtGetMemInfo`.
    GetMemInfo,
    /// `aclrtCreateStream`.
    CreateStream,
    /// `aclrtDestroyStream`.
    DestroyStream,
    /// `aclrtSynchronizeStream`.
    SynchronizeStream,
    /// `aclrtCreateEvent`.
    CreateEvent,
    /// `aclrtDestroyEvent`.
    DestroyEvent,
    /// `aclrtRecordEvent`.
    RecordEvent,
    /// `aclrtQueryEventStatus`.
    QueryEventStatus,
    /// `aclrtSynchronizeEvent`.
    SynchronizeEvent,
    /// `aclrtStreamWaitEvent`.
    StreamWaitEvent,
    /// `aclrtMemcpy`.
    Memcpy,
    /// `aclrtMemcpyAsync`.
    MemcpyAsync,
    /// `aclrtMemset`.
    Memset,
    /// `aclrtMemsetAsync`.
    MemsetAsync,
    /// `aclrtMemGetAllocationGranularity`.
    MemGetAllocationGranularity,
    /// `aclrtReserveMemAddress`.
    ReserveMemAddress,
    /// `aclrtReleaseMemAddress`.
    ReleaseMemAddress,
    /// `aclrtMallocPhysical`.
    MallocPhysical,
    /// `aclrtFreePhysical`.
    FreePhysical,
    /// `aclrtMapMem`.
    MapMem,
    /// `aclrtUnmapMem`.
    UnmapMem,
    /// `aclrtMemExportToShareableHandle`.
    MemExportToShareableHandle,
    /// `aclrtMemImportFromShareableHandle`.
    MemImportFromShareableHandle,
    /// `aclrtMemSetPidToShareableHandle`.
    MemSetPidToShareableHandle,
    /// `aclrtDeviceGetBareTgid`.
    DeviceGetBareTgid,
    /// `acltdtAllocBuf`.
    AllocBuf,
    /// `acltdtFreeBuf`.
    FreeBuf,
    /// `acltdtGetBufData`.
    GetBufData,
    /// `acltdtSetBufDataLen`.
    SetBufDataLen,
    /// `acltdtGetBufDataLen`.
    GetBufDataLen,
    /// `acltdtSetBufUserData`.
    SetBufUserData,
    /// `acltdtGetBufUserData`.
    GetBufUserData,
    /// `acltdtCopyBufRef`.
    CopyBufRef,
    /// `HcclThreadAcquireWithStream`.
    ThreadAcquireWithStream,
    /// `HcclChannelAcquire`.
    ChannelAcquire,
    /// `HcommWriteOnThread`.
    WriteOnThread,
    /// `HcommChannelNotifyRecordOnThread`.
    ChannelNotifyRecordOnThread,
    /// `HcommChannelNotifyWaitOnThread`.
    ChannelNotifyWaitOnThread,
}

impl AclFunc {
    /// The C name, as it appears in [`Error::Runtime`](crate::Error::Runtime).
    pub const fn name(self) -> &'static str {
        match self {
            Self::Malloc => "aclrtMalloc",
            Self::MallocAlign32 => "aclrtMallocAlign32",
            Self::MallocCached => "aclrtMallocCached",
            Self::DvppMalloc => "acldvppMalloc",
            Self::MallocHost => "aclrtMallocHost",
            Self::Free => "aclrtFree",
            Self::DvppFree => "acldvppFree",
            Self::FreeHost => "aclrtFreeHost",
            Self::GetMemInfo => "aclrtGetMemInfo",
            Self::CreateStream => "aclrtCreateStream",
            Self::DestroyStream => "aclrtDestroyStream",
            Self::SynchronizeStream => "aclrtSynchronizeStream",
            Self::CreateEvent => "aclrtCreateEvent",
            Self::DestroyEvent => "aclrtDestroyEvent",
            Self::RecordEvent => "aclrtRecordEvent",
            Self::QueryEventStatus => "aclrtQueryEventStatus",
            Self::SynchronizeEvent => "aclrtSynchronizeEvent",
            Self::StreamWaitEvent => "aclrtStreamWaitEvent",
            Self::Memcpy => "aclrtMemcpy",
            Self::MemcpyAsync => "aclrtMemcpyAsync",
            Self::Memset => "aclrtMemset",
            Self::MemsetAsync => "aclrtMemsetAsync",
            Self::MemGetAllocationGranularity => "aclrtMemGetAllocationGranularity",
            Self::ReserveMemAddress => "aclrtReserveMemAddress",
            Self::ReleaseMemAddress => "aclrtReleaseMemAddress",
            Self::MallocPhysical => "aclrtMallocPhysical",
            Self::FreePhysical => "aclrtFreePhysical",
            Self::MapMem => "aclrtMapMem",
            Self::UnmapMem => "aclrtUnmapMem",
            Self::MemExportToShareableHandle => "aclrtMemExportToShareableHandle",
            Self::MemImportFromShareableHandle => "aclrtMemImportFromShareableHandle",
            Self::MemSetPidToShareableHandle => "aclrtMemSetPidToShareableHandle",
            Self::DeviceGetBareTgid => "aclrtDeviceGetBareTgid",
            Self::AllocBuf => "acltdtAllocBuf",
            Self::FreeBuf => "acltdtFreeBuf",
            Self::GetBufData => "acltdtGetBufData",
            Self::SetBufDataLen => "acltdtSetBufDataLen",
            Self::GetBufDataLen => "acltdtGetBufDataLen",
            Self::SetBufUserData => "acltdtSetBufUserData",
            Self::GetBufUserData => "acltdtGetBufUserData",
            Self::CopyBufRef => "acltdtCopyBufRef",
            Self::ThreadAcquireWithStream => "HcclThreadAcquireWithStream",
            Self::ChannelAcquire => "HcclChannelAcquire",
            Self::WriteOnThread => "HcommWriteOnThread",
            Self::ChannelNotifyRecordOnThread => "HcommChannelNotifyRecordOnThread",
            Self::ChannelNotifyWaitOnThread => "HcommChannelNotifyWaitOnThread",
        }
    }

    /// The allocation function for `kind`.
    pub const fn alloc_for(kind: MemKind) -> Self {
        match kind {
            MemKind::Device(_) => Self::Malloc,
            MemKind::DeviceAlign32(_) => Self::MallocAlign32,
            MemKind::Cached(_) => Self::MallocCached,
            MemKind::Dvpp => Self::DvppMalloc,
            MemKind::Host => Self::MallocHost,
        }
    }

    /// The function that frees memory of `kind`.
    pub const fn free_for(kind: MemKind) -> Self {
        match kind {
            MemKind::Device(_) | MemKind::DeviceAlign32(_) | MemKind::Cached(_) => Self::Free,
            MemKind::Dvpp => Self::DvppFree,
            MemKind::Host => Self::FreeHost,
        }
    }
}

impl std::fmt::Display for AclFunc {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// How many calls a [`Fault`] hits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultTimes {
    /// The next `n` calls of the function, then the fault is spent.
    Next(u64),
    /// Every call until [`SimSource::clear_faults`](super::SimSource::clear_faults).
    Always,
    /// The first `skip` calls run, the `n` after them fail: a failure half-way through.
    After {
        /// Calls that run before the first failure.
        skip: u64,
        /// Calls that fail.
        n: u64,
    },
}

/// A planned failure: calls of `func` fail with `code` instead of running.
///
/// The call is counted in the statistics (as a call and as a failure) but has no other
/// effect: an injected allocation failure maps nothing and accounts nothing.
///
/// ```
/// use ascend_pool::source::sim::{AclFunc, Fault};
/// use ascend_pool::AclError;
/// let f = Fault::next(AclFunc::Malloc, AclError::RT_MEMORY_ALLOCATION, 2);
/// assert_eq!(f.func, AclFunc::Malloc);
/// let oom = Fault::out_of_memory(AclFunc::DvppMalloc);
/// assert_eq!(oom.code, AclError::RT_MEMORY_ALLOCATION);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fault {
    /// The function that fails.
    pub func: AclFunc,
    /// The code it returns.
    pub code: AclError,
    /// How many calls fail.
    pub times: FaultTimes,
}

impl Fault {
    /// The next `n` calls of `func` fail with `code`.
    pub const fn next(func: AclFunc, code: AclError, n: u64) -> Self {
        Self {
            func,
            code,
            times: FaultTimes::Next(n),
        }
    }

    /// Every call of `func` fails with `code`.
    pub const fn always(func: AclFunc, code: AclError) -> Self {
        Self {
            func,
            code,
            times: FaultTimes::Always,
        }
    }

    /// The next `skip` calls of `func` run, the one after fails with `code`.
    ///
    /// ```
    /// use ascend_pool::source::sim::{AclFunc, Fault, FaultTimes};
    /// use ascend_pool::AclError;
    /// let f = Fault::after(AclFunc::MapMem, AclError::RT_MEMORY_ALLOCATION, 2);
    /// assert_eq!(f.times, FaultTimes::After { skip: 2, n: 1 });
    /// ```
    pub const fn after(func: AclFunc, code: AclError, skip: u64) -> Self {
        Self {
            func,
            code,
            times: FaultTimes::After { skip, n: 1 },
        }
    }

    /// The next call of `func` fails with `ACL_ERROR_RT_MEMORY_ALLOCATION` (207001).
    pub const fn out_of_memory(func: AclFunc) -> Self {
        Self::next(func, AclError::RT_MEMORY_ALLOCATION, 1)
    }
}

/// The pending faults, in injection order; the first one matching a call fires.
#[derive(Debug, Default)]
pub(super) struct FaultPlan {
    faults: Vec<Fault>,
}

impl FaultPlan {
    pub(super) fn push(&mut self, fault: Fault) {
        if !matches!(
            fault.times,
            FaultTimes::Next(0) | FaultTimes::After { n: 0, .. }
        ) {
            self.faults.push(fault);
        }
    }

    pub(super) fn clear(&mut self) {
        self.faults.clear();
    }

    pub(super) fn is_empty(&self) -> bool {
        self.faults.is_empty()
    }

    /// The code a call of `func` must fail with, if a fault is planned; spends one shot.
    pub(super) fn fire(&mut self, func: AclFunc) -> Option<AclError> {
        let i = self.faults.iter().position(|f| f.func == func)?;
        let code = self.faults[i].code;
        match &mut self.faults[i].times {
            FaultTimes::Next(n) | FaultTimes::After { skip: 0, n } => {
                *n -= 1;
                if *n == 0 {
                    self.faults.remove(i);
                }
            }
            FaultTimes::After { skip, .. } => {
                *skip -= 1;
                return None;
            }
            FaultTimes::Always => {}
        }
        Some(code)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kind::MallocPolicy;

    #[test]
    fn plan_spends_shots_in_order() {
        let mut p = FaultPlan::default();
        p.push(Fault::next(
            AclFunc::Malloc,
            AclError::RT_MEMORY_ALLOCATION,
            2,
        ));
        p.push(Fault::always(AclFunc::Malloc, AclError::RT_DEVICE_OOM));
        p.push(Fault::next(AclFunc::Free, AclError::RT_MEMORY_FREE, 0));
        assert_eq!(p.fire(AclFunc::Free), None);
        assert_eq!(
            p.fire(AclFunc::Malloc),
            Some(AclError::RT_MEMORY_ALLOCATION)
        );
        assert_eq!(
            p.fire(AclFunc::Malloc),
            Some(AclError::RT_MEMORY_ALLOCATION)
        );
        for _ in 0..3 {
            assert_eq!(p.fire(AclFunc::Malloc), Some(AclError::RT_DEVICE_OOM));
        }
        p.clear();
        assert!(p.is_empty());
        assert_eq!(p.fire(AclFunc::Malloc), None);
    }

    #[test]
    fn a_delayed_fault_lets_its_calls_run_then_fires_once() {
        let mut p = FaultPlan::default();
        p.push(Fault::after(AclFunc::MapMem, AclError::RT_DEVICE_OOM, 2));
        assert_eq!(p.fire(AclFunc::MapMem), None);
        assert_eq!(p.fire(AclFunc::Malloc), None);
        assert_eq!(p.fire(AclFunc::MapMem), None);
        assert_eq!(p.fire(AclFunc::MapMem), Some(AclError::RT_DEVICE_OOM));
        assert!(p.is_empty());
        assert_eq!(p.fire(AclFunc::MapMem), None);
    }

    #[test]
    fn functions_per_kind() {
        let p = MallocPolicy::Huge1gOnly;
        assert_eq!(
            AclFunc::alloc_for(MemKind::Cached(p)).name(),
            "aclrtMallocCached"
        );
        assert_eq!(AclFunc::free_for(MemKind::Cached(p)), AclFunc::Free);
        assert_eq!(AclFunc::free_for(MemKind::Dvpp).name(), "acldvppFree");
        assert_eq!(
            AclFunc::alloc_for(MemKind::Host).to_string(),
            "aclrtMallocHost"
        );
    }
}
