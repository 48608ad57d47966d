//! Typed errors: the runtime's `aclError` codes and the library's own error.

use crate::kind::MemKind;

/// A raw `aclError` code returned by the runtime (or by the simulator, which returns the same codes).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct AclError(pub i32);

impl AclError {
    /// `ACL_SUCCESS`.
    pub const SUCCESS: AclError = AclError(0);
    /// `ACL_ERROR_INVALID_PARAM`: bad argument (null pointer, size 0, bad enum).
    pub const INVALID_PARAM: AclError = AclError(100_000);
    /// `ACL_ERROR_BAD_ALLOC`.
    pub const BAD_ALLOC: AclError = AclError(200_000);
    /// `ACL_ERROR_MEMORY_ADDRESS_UNALIGNED`.
    pub const MEMORY_ADDRESS_UNALIGNED: AclError = AclError(200_003);
    /// `ACL_ERROR_STORAGE_OVER_LIMIT`.
    pub const STORAGE_OVER_LIMIT: AclError = AclError(300_000);
    /// `ACL_ERROR_INTERNAL_ERROR`.
    pub const INTERNAL_ERROR: AclError = AclError(500_000);
    /// `ACL_ERROR_FAILURE`.
    pub const FAILURE: AclError = AclError(500_001);
    /// `ACL_ERROR_RT_FAILURE`.
    pub const RT_FAILURE: AclError = AclError(500_003);
    /// `ACL_ERROR_DRV_FAILURE`.
    pub const DRV_FAILURE: AclError = AclError(500_004);
    /// `ACL_ERROR_RT_PARAM_INVALID`.
    pub const RT_PARAM_INVALID: AclError = AclError(107_000);
    /// `ACL_ERROR_RT_ADDR_UNALIGNED`.
    pub const RT_ADDR_UNALIGNED: AclError = AclError(107_008);
    /// `ACL_ERROR_RT_INVALID_HANDLE`.
    pub const RT_INVALID_HANDLE: AclError = AclError(107_017);
    /// `ACL_ERROR_RT_INVALID_MALLOC_TYPE`.
    pub const RT_INVALID_MALLOC_TYPE: AclError = AclError(107_018);
    /// `ACL_ERROR_RT_FEATURE_NOT_SUPPORT`.
    pub const RT_FEATURE_NOT_SUPPORT: AclError = AclError(207_000);
    /// `ACL_ERROR_RT_MEMORY_ALLOCATION`: out of memory.
    pub const RT_MEMORY_ALLOCATION: AclError = AclError(207_001);
    /// `ACL_ERROR_RT_MEMORY_FREE`.
    pub const RT_MEMORY_FREE: AclError = AclError(207_002);
    /// `ACL_ERROR_RT_DEVICE_OOM`.
    pub const RT_DEVICE_OOM: AclError = AclError(207_018);
    /// `ACL_ERROR_RT_DEVICE_MEM_ERROR`.
    pub const RT_DEVICE_MEM_ERROR: AclError = AclError(507_053);
    /// `HCCL_E_PARA` (an `HcclResult`, which HCCL and HCOMM calls return; AscendCL's own
    /// codes start at 100000, so the two never meet): a parameter the call refuses.
    pub const HCCL_E_PARA: AclError = AclError(1);
    /// `HCCL_E_PTR`: a null pointer.
    pub const HCCL_E_PTR: AclError = AclError(2);
    /// `HCCL_E_NOT_FOUND`: a handle or registration the library does not know.
    pub const HCCL_E_NOT_FOUND: AclError = AclError(6);

    /// The documented name of the code, if it is one the library knows.
    pub const fn name(self) -> Option<&'static str> {
        Some(match self.0 {
            0 => "ACL_SUCCESS",
            1 => "HCCL_E_PARA",
            2 => "HCCL_E_PTR",
            6 => "HCCL_E_NOT_FOUND",
            100_000 => "ACL_ERROR_INVALID_PARAM",
            200_000 => "ACL_ERROR_BAD_ALLOC",
            200_003 => "ACL_ERROR_MEMORY_ADDRESS_UNALIGNED",
            300_000 => "ACL_ERROR_STORAGE_OVER_LIMIT",
            500_000 => "ACL_ERROR_INTERNAL_ERROR",
            500_001 => "ACL_ERROR_FAILURE",
            500_003 => "ACL_ERROR_RT_FAILURE",
            500_004 => "ACL_ERROR_DRV_FAILURE",
            107_000 => "ACL_ERROR_RT_PARAM_INVALID",
            107_008 => "ACL_ERROR_RT_ADDR_UNALIGNED",
            107_017 => "ACL_ERROR_RT_INVALID_HANDLE",
            107_018 => "ACL_ERROR_RT_INVALID_MALLOC_TYPE",
            207_000 => "ACL_ERROR_RT_FEATURE_NOT_SUPPORT",
            207_001 => "ACL_ERROR_RT_MEMORY_ALLOCATION",
            207_002 => "ACL_ERROR_RT_MEMORY_FREE",
            207_018 => "ACL_ERROR_RT_DEVICE_OOM",
            507_053 => "ACL_ERROR_RT_DEVICE_MEM_ERROR",
            _ => return None,
        })
    }

    /// Whether the code means the device (or address space) ran out of memory.
    pub const fn is_out_of_memory(self) -> bool {
        matches!(self.0, 200_000 | 207_001 | 207_018 | 300_000)
    }

    /// `Ok(())` for `ACL_SUCCESS`, the code otherwise.
    pub const fn check(code: i32) -> Result<(), AclError> {
        if code == 0 {
            Ok(())
        } else {
            Err(AclError(code))
        }
    }
}

impl std::fmt::Display for AclError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.name() {
            Some(n) => write!(f, "{n} ({})", self.0),
            None => write!(f, "aclError {}", self.0),
        }
    }
}

impl std::error::Error for AclError {}

/// One end of a copy, named by [`Error::OutOfBounds`] and [`Error::Misaligned`] when that
/// end is at fault.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CopySide {
    /// The region copied from.
    Source,
    /// The region copied into.
    Destination,
}

impl std::fmt::Display for CopySide {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Source => "source",
            Self::Destination => "destination",
        })
    }
}

/// `"source "`, `"destination "` or nothing: the words before a range or offset.
struct SideWords(Option<CopySide>);

impl std::fmt::Display for SideWords {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0 {
            Some(side) => write!(f, "{side} "),
            None => Ok(()),
        }
    }
}

/// Everything that can go wrong in the pool, the regions and the block sources.
///
/// Each variant carries what a caller needs to act on it; none of them leaves a pool inconsistent.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Error {
    /// A length or alignment the carve rule refuses (size 0, overflow, bad alignment).
    Carve(crate::align::CarveRuleError),
    /// A runtime call failed; `func` is the AscendCL function, `code` the raw `aclError`.
    Runtime {
        /// The AscendCL function that failed.
        func: &'static str,
        /// What it returned.
        code: AclError,
    },
    /// The pool could not serve a request even after trimming its cache and retrying.
    OutOfMemory {
        /// The memory kind.
        kind: MemKind,
        /// Bytes asked for.
        requested: u64,
        /// Bytes the pool holds from its block source.
        reserved: u64,
        /// Bytes live in regions (footprints).
        in_use: u64,
        /// Largest free range in any chunk.
        largest_free: u64,
        /// The source's answer, when it was the source that refused.
        source: Option<AclError>,
        /// When the source refused device memory: the bytes each other kind of the pool
        /// holds reserved from the same device (every device kind, DVPP's included, draws on
        /// the device's memory), in [`MemKind::ALL`]'s order; empty otherwise.
        elsewhere: Vec<(MemKind, u64)>,
    },
    /// Growing would pass the configured memory limit.
    LimitExceeded {
        /// The memory kind.
        kind: MemKind,
        /// Bytes asked for.
        requested: u64,
        /// The limit.
        limit: u64,
        /// Bytes reserved at the time.
        reserved: u64,
        /// Bytes live in regions (footprints); `reserved - in_use` is free in the chunks.
        in_use: u64,
        /// Largest free range in any chunk: below the request while `reserved - in_use`
        /// covers it, the free bytes are too fragmented to hold it.
        largest_free: u64,
    },
    /// Growing would pass the configured total limit over the pool's device kinds
    /// ([`PoolConfig::total_limit`](crate::pool::PoolConfig::total_limit)), even after the
    /// other device kinds gave back what they held idle; the kind's own limit, if any, was
    /// not reached.
    TotalLimitExceeded {
        /// The memory kind that asked.
        kind: MemKind,
        /// Bytes asked for.
        requested: u64,
        /// The total limit.
        limit: u64,
        /// Bytes the pool's device kinds held reserved together at the time.
        reserved: u64,
        /// Bytes live in regions of `kind` (footprints).
        in_use: u64,
        /// Largest free range in any chunk of `kind`.
        largest_free: u64,
        /// The bytes each other device kind of the pool holds reserved, in
        /// [`MemKind::ALL`]'s order, once what they held idle was taken back: what freeing
        /// their regions would make room from.
        elsewhere: Vec<(MemKind, u64)>,
    },
    /// A handle or pointer that this pool (or source) did not hand out.
    ForeignHandle,
    /// A handle that was already freed.
    AlreadyFreed,
    /// A copy, fill, read, write or view that reaches past the end of a region or buffer,
    /// or that covers no byte (`len` 0: every such call takes at least one byte); also a
    /// shared buffer's valid data length past its data (offset 0, `len` that length), set
    /// or read from a header another process wrote.
    OutOfBounds {
        /// Offset asked for.
        offset: u64,
        /// Length asked for.
        len: u64,
        /// Bytes available.
        capacity: u64,
        /// The end of a copy the range is in; `None` where there is one region (a fill, a
        /// view, a read or write of one buffer).
        side: Option<CopySide>,
    },
    /// An address that does not have the alignment its use requires.
    Misaligned {
        /// The address at fault; with `side`, the offset the caller passed for that end of
        /// the copy (its region starts aligned).
        addr: u64,
        /// The alignment it needs.
        required: u64,
        /// The end of a copy at fault; `None` where `addr` is an address.
        side: Option<CopySide>,
    },
    /// A kind of memory that this operation does not accept.
    WrongKind {
        /// What the operation needs.
        expected: &'static str,
        /// What it got.
        got: MemKind,
    },
    /// The runtime in use lacks a function (older CANN, or a feature off).
    NotSupported {
        /// The missing function.
        func: &'static str,
    },
    /// The AscendCL library could not be loaded.
    LibraryLoad {
        /// Path or name that was tried.
        library: String,
        /// What the loader said.
        reason: String,
    },
    /// A configuration string or builder value that makes no sense.
    Config(String),
    /// A file the pool writes (the trace [`record`](crate::pool::PoolConfig::record)ed) could
    /// not be created or written: a path that is no file, a full disk.
    Io {
        /// What was done to the file: `"create"` or `"write"`.
        op: &'static str,
        /// The file.
        path: std::path::PathBuf,
        /// What the system said.
        reason: String,
    },
    /// The padding canary of a segment was overwritten (debug mode).
    Corruption {
        /// The memory kind.
        kind: MemKind,
        /// Offset of the segment from its chunk's address.
        offset: u64,
        /// Requested length of the segment.
        len: u64,
        /// First overwritten padding byte, relative to the segment start.
        first_bad: u64,
    },
    /// A structural invariant does not hold (reported by `validate()`).
    Invalid(String),
    /// The exporting process does not let this process import a shareable handle: it is
    /// not on the handle's whitelist (`aclrtMemSetPidToShareableHandle`).
    ShareRefused {
        /// The shareable handle.
        handle: u64,
        /// This process's id as `aclrtDeviceGetBareTgid` gives it.
        pid: i32,
    },
    /// A shareable handle that no process exports (any more): never exported, already
    /// released by its exporter, or its exporter is gone.
    ShareGone {
        /// The shareable handle.
        handle: u64,
    },
    /// Memory asked to be published under the other access than it was first exported
    /// with. Whether importers are checked against a whitelist is fixed when a physical
    /// allocation is first exported, and a handle is exported once, so the access asked for
    /// could not hold.
    ShareAccessFixed {
        /// The shareable handle.
        handle: u64,
        /// How it was exported: to any process (`true`) or to whitelisted ones.
        any_process: bool,
    },
    /// A pool or simulator made by the process this one was forked from: a child made by
    /// `fork` has none of its parent's device context, streams or locks (see
    /// [`fork`](crate::fork)). The child makes its own.
    Forked,
}

/// The figures of a refusal for want of memory, read alike whichever refused: the source
/// ([`Error::OutOfMemory`]), the kind's limit ([`Error::LimitExceeded`]) or the total over the
/// device kinds ([`Error::TotalLimitExceeded`]). A caller deciding whether freeing, trimming or
/// another memory kind would help needs these, not which variant carried them.
///
/// ```
/// use ascend_pool::{Error, MemKind};
///
/// let e = Error::LimitExceeded {
///     kind: MemKind::DEVICE,
///     requested: 4 << 20,
///     limit: 8 << 20,
///     reserved: 8 << 20,
///     in_use: 6 << 20,
///     largest_free: 1 << 20,
/// };
/// let s = e.shortage().unwrap();
/// assert_eq!((s.limit, s.reserved - s.in_use), (Some(8 << 20), 2 << 20));
/// assert!(Error::ForeignHandle.shortage().is_none());
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shortage<'a> {
    /// The memory kind that asked.
    pub kind: MemKind,
    /// Bytes asked for.
    pub requested: u64,
    /// Bytes the kind held reserved; for the total limit, the device kinds together.
    pub reserved: u64,
    /// Bytes of the kind live in regions (footprints).
    pub in_use: u64,
    /// The largest free range in any chunk of the kind.
    pub largest_free: u64,
    /// The limit that would be passed; `None` when the source refused.
    pub limit: Option<u64>,
    /// What each other device kind holds reserved, in [`MemKind::ALL`]'s order; empty for a
    /// kind's own limit and for refusals of host memory.
    pub elsewhere: &'a [(MemKind, u64)],
}

impl Error {
    /// The figures of a refusal for want of memory; `None` for every other error.
    pub fn shortage(&self) -> Option<Shortage<'_>> {
        let (kind, requested, reserved, in_use, largest_free, limit, elsewhere) = match self {
            Self::OutOfMemory {
                kind,
                requested,
                reserved,
                in_use,
                largest_free,
                elsewhere,
                ..
            } => (
                kind,
                requested,
                reserved,
                in_use,
                largest_free,
                None,
                &elsewhere[..],
            ),
            Self::LimitExceeded {
                kind,
                requested,
                limit,
                reserved,
                in_use,
                largest_free,
            } => (
                kind,
                requested,
                reserved,
                in_use,
                largest_free,
                Some(*limit),
                &[][..],
            ),
            Self::TotalLimitExceeded {
                kind,
                requested,
                limit,
                reserved,
                in_use,
                largest_free,
                elsewhere,
            } => (
                kind,
                requested,
                reserved,
                in_use,
                largest_free,
                Some(*limit),
                &elsewhere[..],
            ),
            _ => return None,
        };
        Some(Shortage {
            kind: *kind,
            requested: *requested,
            reserved: *reserved,
            in_use: *in_use,
            largest_free: *largest_free,
            limit,
            elsewhere,
        })
    }
}

impl std::fmt::Display for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Carve(e) => write!(f, "{e}"),
            Self::Runtime { func, code } => write!(f, "{func} failed: {code}"),
            Self::OutOfMemory {
                kind,
                requested,
                reserved,
                in_use,
                largest_free,
                source,
                elsewhere,
            } => {
                write!(
                    f,
                    "out of {kind} memory: requested {requested} bytes, reserved {reserved}, \
                     in use {in_use}, largest free range {largest_free}"
                )?;
                if let Some(code) = source {
                    write!(f, " (source: {code})")?;
                }
                if elsewhere.is_empty() {
                    return Ok(());
                }
                // The kind's own figures cannot explain a device that is full.
                let mut held = elsewhere.iter().filter(|&&(_, bytes)| bytes > 0);
                match held.next() {
                    None => write!(
                        f,
                        "; no other kind of this pool holds any of the device's memory \
                         (another pool or process holds it, or the source caps this kind)"
                    ),
                    Some((k, bytes)) => {
                        write!(
                            f,
                            "; the device's other kinds hold {k} {bytes} bytes reserved"
                        )?;
                        for (k, bytes) in held {
                            write!(f, ", {k} {bytes}")?;
                        }
                        Ok(())
                    }
                }
            }
            Self::LimitExceeded {
                kind,
                requested,
                limit,
                reserved,
                in_use,
                largest_free,
            } => {
                write!(
                    f,
                    "{kind} pool limit {limit} bytes would be passed: requested {requested}, \
                     reserved {reserved}, in use {in_use}, largest free range {largest_free}"
                )?;
                // Enough is free, in pieces: growing is not the only way out.
                let free = reserved.saturating_sub(*in_use);
                if free >= *requested && largest_free < requested {
                    write!(
                        f,
                        "; {free} bytes are free but too fragmented to hold the request \
                         (raise the limit, or free the regions that split the free ranges)"
                    )?;
                }
                Ok(())
            }
            Self::TotalLimitExceeded {
                kind,
                requested,
                limit,
                reserved,
                in_use,
                largest_free,
                elsewhere,
            } => {
                write!(
                    f,
                    "total limit {limit} bytes over the device kinds would be passed by {kind}: \
                     requested {requested}, reserved by the device kinds {reserved}, {kind} in \
                     use {in_use}, largest free range {largest_free}"
                )?;
                let mut held = elsewhere.iter().filter(|&&(_, bytes)| bytes > 0);
                if let Some((k, bytes)) = held.next() {
                    write!(f, "; the other device kinds hold {k} {bytes} bytes")?;
                    for (k, bytes) in held {
                        write!(f, ", {k} {bytes}")?;
                    }
                }
                Ok(())
            }
            Self::ForeignHandle => write!(f, "handle or pointer was not issued by this pool"),
            Self::AlreadyFreed => write!(f, "handle was already freed"),
            // Nothing passes the end of an empty range: say what is refused instead.
            Self::OutOfBounds {
                offset,
                len: 0,
                capacity,
                side,
            } => write!(
                f,
                "empty range at {}offset {offset} of {capacity} bytes: a copy, fill, read, \
                 write or view of 0 bytes is refused",
                SideWords(*side)
            ),
            Self::OutOfBounds {
                offset,
                len,
                capacity,
                side,
            } => write!(
                f,
                "{}range {offset}..{offset}+{len} is out of bounds of {capacity} bytes",
                SideWords(*side)
            ),
            Self::Misaligned {
                addr,
                required,
                side: None,
            } => write!(f, "address {addr:#x} is not {required}-byte aligned"),
            Self::Misaligned {
                addr,
                required,
                side: Some(side),
            } => write!(
                f,
                "{side} offset {addr} is not {required}-byte aligned (a copy queued on a \
                 stream needs both ends {required}-byte aligned)"
            ),
            Self::WrongKind { expected, got } => write!(f, "expected {expected} memory, got {got}"),
            Self::NotSupported { func } => write!(f, "{func} is not supported by this runtime"),
            Self::LibraryLoad { library, reason } => {
                write!(f, "cannot load {library}: {reason}")
            }
            Self::Config(msg) => write!(f, "bad configuration: {msg}"),
            Self::Io { op, path, reason } => {
                write!(f, "cannot {op} {}: {reason}", path.display())
            }
            Self::Corruption {
                kind,
                offset,
                len,
                first_bad,
            } => write!(
                f,
                "padding overrun in {kind} segment at offset {offset} (len {len}): \
                 byte {first_bad} past the start was overwritten"
            ),
            Self::Invalid(msg) => write!(f, "invariant violated: {msg}"),
            Self::ShareRefused { handle, pid } => write!(
                f,
                "process {pid} is not on the whitelist of shareable handle {handle:#x}"
            ),
            Self::ShareGone { handle } => {
                write!(f, "shareable handle {handle:#x} is not exported (any more)")
            }
            Self::ShareAccessFixed {
                handle,
                any_process,
            } => {
                let how = if *any_process {
                    "to any process"
                } else {
                    "to whitelisted processes only"
                };
                write!(
                    f,
                    "shareable handle {handle:#x} was exported {how}; its access cannot change"
                )
            }
            Self::Forked => write!(
                f,
                "made by the process this one was forked from; a forked child makes its own"
            ),
        }
    }
}

impl std::error::Error for Error {}

impl From<crate::align::CarveRuleError> for Error {
    fn from(e: crate::align::CarveRuleError) -> Self {
        Self::Carve(e)
    }
}

/// The library's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_have_names() {
        assert_eq!(
            AclError(207_001).name(),
            Some("ACL_ERROR_RT_MEMORY_ALLOCATION")
        );
        assert!(AclError::RT_MEMORY_ALLOCATION.is_out_of_memory());
        assert!(!AclError::INVALID_PARAM.is_out_of_memory());
        assert_eq!(AclError(42).name(), None);
        assert_eq!(AclError::check(0), Ok(()));
        assert_eq!(AclError::check(100_000), Err(AclError::INVALID_PARAM));
        assert!(format!("{}", AclError(207_018)).contains("DEVICE_OOM"));
    }

    /// Each constant's documented name is `ACL_ERROR_` and the constant's own name, so a
    /// log line names the code the AscendCL documents list under it.
    #[test]
    fn every_constant_has_its_documented_name() {
        macro_rules! named {
            ($($c:ident),+) => {$(
                assert_eq!(
                    AclError::$c.name(),
                    Some(concat!("ACL_ERROR_", stringify!($c))),
                    "{}",
                    AclError::$c.0
                );
                assert_eq!(
                    AclError::$c.to_string(),
                    format!("ACL_ERROR_{} ({})", stringify!($c), AclError::$c.0)
                );
            )+};
        }
        named!(
            INVALID_PARAM,
            BAD_ALLOC,
            MEMORY_ADDRESS_UNALIGNED,
            STORAGE_OVER_LIMIT,
            INTERNAL_ERROR,
            FAILURE,
            RT_FAILURE,
            DRV_FAILURE,
            RT_PARAM_INVALID,
            RT_ADDR_UNALIGNED,
            RT_INVALID_HANDLE,
            RT_INVALID_MALLOC_TYPE,
            RT_FEATURE_NOT_SUPPORT,
            RT_MEMORY_ALLOCATION,
            RT_MEMORY_FREE,
            RT_DEVICE_OOM,
            RT_DEVICE_MEM_ERROR
        );
        assert_eq!(AclError::SUCCESS.name(), Some("ACL_SUCCESS"));
        assert_eq!(AclError(-1).to_string(), "aclError -1");
    }

    /// Every variant says what happened in words and carries its figures into the message.
    #[test]
    fn every_error_reads_with_its_figures() {
        let kind = MemKind::Device(crate::kind::MallocPolicy::HugeFirst);
        let cases: Vec<(Error, &[&str])> = vec![
            (
                Error::Runtime {
                    func: "aclrtMalloc",
                    code: AclError::RT_DEVICE_OOM,
                },
                &["aclrtMalloc failed", "ACL_ERROR_RT_DEVICE_OOM (207018)"],
            ),
            (
                Error::OutOfMemory {
                    kind,
                    requested: 11,
                    reserved: 22,
                    in_use: 33,
                    largest_free: 44,
                    source: Some(AclError::RT_MEMORY_ALLOCATION),
                    elsewhere: vec![
                        (MemKind::Cached(crate::kind::MallocPolicy::HugeFirst), 0),
                        (MemKind::Dvpp, 55),
                        (MemKind::DEVICE, 66),
                    ],
                },
                &[
                    "requested 11",
                    "reserved 22",
                    "in use 33",
                    "range 44",
                    "207001",
                    "other kinds hold dvpp 55 bytes reserved, device 66",
                ],
            ),
            (
                Error::OutOfMemory {
                    kind,
                    requested: 11,
                    reserved: 0,
                    in_use: 0,
                    largest_free: 0,
                    source: Some(AclError::RT_MEMORY_ALLOCATION),
                    elsewhere: vec![(MemKind::Dvpp, 0)],
                },
                &["no other kind of this pool holds any of the device's memory"],
            ),
            (
                Error::LimitExceeded {
                    kind,
                    requested: 5,
                    limit: 6,
                    reserved: 17,
                    in_use: 8,
                    largest_free: 4,
                },
                &[
                    "limit 6",
                    "requested 5",
                    "reserved 17",
                    "in use 8",
                    "range 4",
                    "9 bytes are free but too fragmented",
                ],
            ),
            (
                Error::TotalLimitExceeded {
                    kind,
                    requested: 5,
                    limit: 6,
                    reserved: 17,
                    in_use: 8,
                    largest_free: 4,
                    elsewhere: vec![(MemKind::Dvpp, 9), (MemKind::Host, 0)],
                },
                &[
                    "total limit 6",
                    "requested 5",
                    "device kinds 17",
                    "in use 8",
                    "range 4",
                    "hold dvpp 9 bytes",
                ],
            ),
            (Error::ForeignHandle, &["not issued by this pool"]),
            (Error::AlreadyFreed, &["already freed"]),
            (
                Error::OutOfBounds {
                    offset: 3,
                    len: 4,
                    capacity: 5,
                    side: None,
                },
                &["range 3..3+4", "5 bytes"],
            ),
            (
                Error::OutOfBounds {
                    offset: 3,
                    len: 4,
                    capacity: 5,
                    side: Some(CopySide::Source),
                },
                &["source range 3..3+4", "5 bytes"],
            ),
            (
                Error::OutOfBounds {
                    offset: 3,
                    len: 0,
                    capacity: 5,
                    side: Some(CopySide::Destination),
                },
                &["at destination offset 3 of 5 bytes"],
            ),
            (
                Error::Misaligned {
                    addr: 0x41,
                    required: 64,
                    side: None,
                },
                &["address 0x41", "64-byte"],
            ),
            (
                Error::Misaligned {
                    addr: 32,
                    required: 64,
                    side: Some(CopySide::Destination),
                },
                &["destination offset 32 is not 64-byte aligned"],
            ),
            (
                Error::WrongKind {
                    expected: "DVPP",
                    got: kind,
                },
                &["expected DVPP memory, got"],
            ),
            (
                Error::NotSupported {
                    func: "aclrtMapMem",
                },
                &["aclrtMapMem is not supported"],
            ),
            (Error::Config("x".into()), &["bad configuration: x"]),
            (
                Error::Io {
                    op: "write",
                    path: "/dev/full".into(),
                    reason: "no space".into(),
                },
                &["cannot write /dev/full: no space"],
            ),
            (
                Error::LibraryLoad {
                    library: "libascendcl.so".into(),
                    reason: "not found".into(),
                },
                &["cannot load libascendcl.so: not found"],
            ),
            (
                Error::from(crate::align::CarveRuleError::LengthOverflow { len: 77 }),
                &["77"],
            ),
            (
                Error::Corruption {
                    kind,
                    offset: 128,
                    len: 9,
                    first_bad: 12,
                },
                &["offset 128", "len 9", "byte 12"],
            ),
            (Error::Invalid("y".into()), &["invariant violated: y"]),
            (
                Error::ShareRefused {
                    handle: 0xab,
                    pid: 9,
                },
                &["process 9", "0xab"],
            ),
            (Error::ShareGone { handle: 0xcd }, &["0xcd", "not exported"]),
            (
                Error::ShareAccessFixed {
                    handle: 0xef,
                    any_process: true,
                },
                &["0xef", "to any process"],
            ),
            (
                Error::ShareAccessFixed {
                    handle: 0xef,
                    any_process: false,
                },
                &["whitelisted processes only"],
            ),
        ];
        for (e, parts) in cases {
            let text = e.to_string();
            for part in parts {
                assert!(text.contains(part), "{text:?} lacks {part:?}");
            }
        }
    }
}
