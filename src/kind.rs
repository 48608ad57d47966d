//! Memory kinds: which AscendCL call a big block comes from, and the carve rule it implies.

use crate::align::{CarveRule, DEFAULT_ALIGN, MODEL_INPUT_ALIGN};

/// `aclrtMemMallocPolicy` values (ACL 1.15/1.17), low byte; or-able flags are separate.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, Default, serde::Serialize, serde::Deserialize,
)]
#[repr(u32)]
pub enum MallocPolicy {
    /// `ACL_MEM_MALLOC_HUGE_FIRST`: huge pages when available, normal pages otherwise.
    #[default]
    HugeFirst = 0,
    /// `ACL_MEM_MALLOC_HUGE_ONLY`.
    HugeOnly = 1,
    /// `ACL_MEM_MALLOC_NORMAL_ONLY`.
    NormalOnly = 2,
    /// `ACL_MEM_MALLOC_HUGE_FIRST_P2P`.
    HugeFirstP2p = 3,
    /// `ACL_MEM_MALLOC_HUGE_ONLY_P2P`.
    HugeOnlyP2p = 4,
    /// `ACL_MEM_MALLOC_NORMAL_ONLY_P2P`.
    NormalOnlyP2p = 5,
    /// `ACL_MEM_MALLOC_HUGE1G_ONLY`: 1 GiB pages, no padding.
    Huge1gOnly = 6,
    /// `ACL_MEM_MALLOC_HUGE1G_ONLY_P2P`: 1 GiB pages, no padding.
    Huge1gOnlyP2p = 7,
}

impl MallocPolicy {
    /// Whether the runtime adds no padding under this policy.
    pub const fn has_no_padding(self) -> bool {
        matches!(self, Self::Huge1gOnly | Self::Huge1gOnlyP2p)
    }

    /// The raw `aclrtMemMallocPolicy` value.
    pub const fn raw(self) -> u32 {
        self as u32
    }
}

/// Where a big block comes from. Each kind is its own resource with its own pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MemKind {
    /// `aclrtMalloc` with a policy: rounded to 32 plus padding, 64-aligned.
    Device(MallocPolicy),
    /// `aclrtMallocAlign32`: rounded to 32, no padding added by the runtime.
    DeviceAlign32(MallocPolicy),
    /// `aclrtMallocCached`: like `aclrtMalloc`, cacheable.
    Cached(MallocPolicy),
    /// `acldvppMalloc` / `hi_mpi_dvpp_malloc`: huge pages, 128-aligned, 16 GB per process.
    Dvpp,
    /// `aclrtMallocHost`: page-locked host memory, 64-aligned.
    Host,
}

impl MemKind {
    /// Every kind with the default policy, in a stable order.
    pub const ALL: [MemKind; 5] = [
        MemKind::Device(MallocPolicy::HugeFirst),
        MemKind::DeviceAlign32(MallocPolicy::HugeFirst),
        MemKind::Cached(MallocPolicy::HugeFirst),
        MemKind::Dvpp,
        MemKind::Host,
    ];

    /// Position of the kind in [`MemKind::ALL`] (the policy does not matter).
    pub const fn index(self) -> usize {
        match self {
            Self::Device(_) => 0,
            Self::DeviceAlign32(_) => 1,
            Self::Cached(_) => 2,
            Self::Dvpp => 3,
            Self::Host => 4,
        }
    }

    /// `aclrtMalloc` with the default policy.
    pub const DEVICE: MemKind = MemKind::Device(MallocPolicy::HugeFirst);

    /// The short name used in traces: `device`, `device_align32`, `cached`, `dvpp`, `host`.
    pub const fn trace_name(self) -> &'static str {
        match self {
            Self::Device(_) => "device",
            Self::DeviceAlign32(_) => "device_align32",
            Self::Cached(_) => "cached",
            Self::Dvpp => "dvpp",
            Self::Host => "host",
        }
    }

    /// Parses a trace name (default policy).
    pub fn from_trace_name(name: &str) -> Option<Self> {
        Some(match name {
            "device" => Self::Device(MallocPolicy::HugeFirst),
            "device_align32" => Self::DeviceAlign32(MallocPolicy::HugeFirst),
            "cached" => Self::Cached(MallocPolicy::HugeFirst),
            "dvpp" => Self::Dvpp,
            "host" => Self::Host,
            _ => return None,
        })
    }

    /// The start alignment a segment of this kind gets unless the use asks for more.
    pub const fn default_align(self) -> u64 {
        match self {
            Self::Dvpp => MODEL_INPUT_ALIGN,
            _ => DEFAULT_ALIGN,
        }
    }

    /// Whether the memory lives on the device (everything but `Host`).
    pub const fn is_device(self) -> bool {
        !matches!(self, Self::Host)
    }

    /// The malloc policy, for the kinds that take one.
    pub const fn policy(self) -> Option<MallocPolicy> {
        match self {
            Self::Device(p) | Self::DeviceAlign32(p) | Self::Cached(p) => Some(p),
            Self::Dvpp | Self::Host => None,
        }
    }

    /// The carve rule for segments of this kind with the default padding (32, or 0 under HUGE1G).
    pub fn carve_rule(self) -> CarveRule {
        let padding = match self.policy() {
            Some(p) if p.has_no_padding() => 0,
            _ => crate::align::DEFAULT_PADDING,
        };
        CarveRule::new(padding, self.default_align()).expect("built-in rules are valid")
    }
}

impl std::fmt::Display for MemKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.policy() {
            Some(p) if p != MallocPolicy::HugeFirst => write!(f, "{}({p:?})", self.trace_name()),
            _ => f.write_str(self.trace_name()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for (i, k) in MemKind::ALL.into_iter().enumerate() {
            assert_eq!(k.index(), i);
            assert_eq!(MemKind::from_trace_name(k.trace_name()), Some(k));
        }
        assert_eq!(MemKind::from_trace_name("hbm"), None);
    }

    #[test]
    fn display_names_the_policy_only_when_it_is_not_the_default() {
        assert_eq!(MemKind::DEVICE.to_string(), "device");
        assert_eq!(MemKind::Dvpp.to_string(), "dvpp");
        assert_eq!(MemKind::Host.to_string(), "host");
        assert_eq!(
            MemKind::Cached(MallocPolicy::HugeOnly).to_string(),
            "cached(HugeOnly)"
        );
        assert_eq!(
            MemKind::DeviceAlign32(MallocPolicy::Huge1gOnlyP2p).to_string(),
            "device_align32(Huge1gOnlyP2p)"
        );
    }

    #[test]
    fn rules_per_kind() {
        assert_eq!(MemKind::Dvpp.carve_rule().align(), 128);
        assert_eq!(MemKind::Host.carve_rule().align(), 64);
        assert_eq!(
            MemKind::Device(MallocPolicy::Huge1gOnly)
                .carve_rule()
                .padding(),
            0
        );
        assert_eq!(MemKind::DEVICE.carve_rule().padding(), 32);
    }
}
