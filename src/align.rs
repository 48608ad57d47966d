//! Alignment policy: the AscendCL rule for carving segments out of a big block.
//!
//! AscendCL documents one rule for every block that a user sub-allocates
//! (`aclrtMalloc`, `aclrtMallocAlign32`, `aclrtMallocCached`, `acldvppMalloc`,
//! `aclrtMallocHost`): a segment of `len` bytes occupies
//! `m = ALIGN_UP(len, 32) + padding` bytes and starts at an address aligned to
//! 64 bytes (128 when DVPP output feeds a model). The padding exists because
//! hardware engines overrun the end of their buffers; it is 32 bytes by default
//! and 0 under the `HUGE1G` policies and on newer SoCs.
//!
//! This module is pure arithmetic: no memory, no `unsafe`, every step
//! overflow-checked.

use static_assertions::const_assert_eq;

/// `ALIGN_UP(len, k) = ((len - 1) / k + 1) * k` as documented, for a power of two `k`.
///
/// Returns `None` on overflow, and for a `k` that is not a power of two (0 included).
/// `align_up(0, k)` is 0.
///
/// ```
/// assert_eq!(ascend_pool::align::align_up(33, 32), Some(64));
/// assert_eq!(ascend_pool::align::align_up(u64::MAX, 64), None);
/// assert_eq!(ascend_pool::align::align_up(33, 48), None);
/// ```
#[inline]
pub const fn align_up(value: u64, align: u64) -> Option<u64> {
    // Rounding by a mask is only right for a power of two; a constant alignment folds
    // the test away.
    if !align.is_power_of_two() {
        return None;
    }
    align_up_pow2(value, align)
}

/// [`align_up`] for an alignment known to be a power of two (a [`CarveRule`]'s, by its
/// invariant): no test of it on the allocation path.
#[inline]
const fn align_up_pow2(value: u64, align: u64) -> Option<u64> {
    debug_assert!(align.is_power_of_two());
    let mask = align - 1;
    match value.checked_add(mask) {
        Some(v) => Some(v & !mask),
        None => None,
    }
}

/// The carve rule's footprint for `len` bytes: `ALIGN_UP(ALIGN_UP(len, 32) + padding, align)`,
/// never below `align` (`align` a power of two). `None` on overflow. No check of the rule's
/// own limits: [`CarveRule::footprint`] is this after them, and the pool's thread-cache path
/// calls it before building a rule (a cached segment of the very shape proves them).
#[inline]
pub(crate) const fn footprint_of(len: u64, padding: u64, align: u64) -> Option<u64> {
    let Some(m) = segment_of(len, padding) else {
        return None;
    };
    // Only an empty segment (len 0, padding 0, which the thread-cache path may pass
    // before the rule's checks) is below `align` after rounding: it still takes one slot.
    align_up_pow2(if m < align { align } else { m }, align)
}

/// `ALIGN_UP(len, 32) + padding`, the runtime's segment before start alignment; `None` on
/// overflow.
#[inline]
const fn segment_of(len: u64, padding: u64) -> Option<u64> {
    match align_up_pow2(len, LEN_GRANULE) {
        Some(m) => m.checked_add(padding),
        None => None,
    }
}

/// Compile-time form of [`align_up`] for constants (panics at compile time on overflow).
const fn align_up_const(value: u64, align: u64) -> u64 {
    (value + align - 1) & !(align - 1)
}

/// The granule every length is first rounded to.
pub const LEN_GRANULE: u64 = 32;
/// Padding AscendCL adds after each segment unless the policy says otherwise.
pub const DEFAULT_PADDING: u64 = 32;
/// Start alignment every segment needs (and what `aclrtMemcpyAsync` checks).
pub const DEFAULT_ALIGN: u64 = 64;
/// Start alignment for DVPP output that feeds model inference.
pub const MODEL_INPUT_ALIGN: u64 = 128;
/// Largest start alignment a rule accepts (1 GiB, the largest huge page).
pub const MAX_ALIGN: u64 = 1 << 30;

// The documented arithmetic, pinned at compile time.
const_assert_eq!(align_up_const(align_up_const(1, 32) + 32, 64), 64);
const_assert_eq!(align_up_const(align_up_const(33, 32) + 32, 64), 128);
const_assert_eq!(
    align_up_const(align_up_const(3_110_400, 32) + 32, 64),
    3_110_464
);
const_assert_eq!(
    align_up_const(align_up_const(3_110_400, 32) + 32, 128),
    3_110_528
);

/// Why a length or a rule was refused. Never a panic, never a wrap.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CarveRuleError {
    /// A segment of zero bytes: every AscendCL allocation call rejects it.
    ZeroLength,
    /// The footprint of `len` does not fit in a `u64`.
    LengthOverflow {
        /// The length that was asked for.
        len: u64,
    },
    /// An alignment that is not a power of two, is below 64 or above [`MAX_ALIGN`].
    BadAlignment {
        /// The alignment that was asked for.
        align: u64,
    },
    /// A padding that is not a multiple of 32 or is absurdly large (over 1 MiB).
    BadPadding {
        /// The padding that was asked for.
        padding: u64,
    },
}

impl std::fmt::Display for CarveRuleError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match *self {
            Self::ZeroLength => write!(f, "a segment of 0 bytes cannot be carved"),
            Self::LengthOverflow { len } => {
                write!(f, "the footprint of a {len}-byte segment overflows u64")
            }
            Self::BadAlignment { align } => write!(
                f,
                "alignment {align} is not a power of two between 64 and {MAX_ALIGN}"
            ),
            Self::BadPadding { padding } => {
                write!(f, "padding {padding} is not a multiple of 32 up to 1 MiB")
            }
        }
    }
}

impl std::error::Error for CarveRuleError {}

/// How a segment is carved: padding after the rounded length, and start alignment.
///
/// Invariants (checked by [`CarveRule::new`]):
/// - `padding` is a multiple of [`LEN_GRANULE`] and at most 1 MiB;
/// - `align` is a power of two in `DEFAULT_ALIGN..=MAX_ALIGN`.
///
/// ```
/// use ascend_pool::align::CarveRule;
/// let rule = CarveRule::default(); // 32 bytes of padding, 64-byte starts
/// assert_eq!(rule.footprint(1).unwrap(), 64);
/// assert_eq!(rule.footprint(33).unwrap(), 128);
/// let nv12 = 1920 * 1080 * 3 / 2;
/// assert_eq!(rule.footprint(nv12).unwrap(), 3_110_464);
/// assert_eq!(CarveRule::model_input().footprint(nv12).unwrap(), 3_110_528);
/// assert!(rule.footprint(0).is_err());
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(try_from = "RuleFields")]
pub struct CarveRule {
    /// Bytes added after `ALIGN_UP(len, 32)`; a multiple of 32.
    padding: u64,
    /// Start alignment of every segment; a power of two >= 64.
    align: u64,
}

/// A [`CarveRule`] as serialized, checked by [`CarveRule::new`] when deserialized: the
/// invariants hold for every rule, read or built.
#[derive(serde::Deserialize)]
struct RuleFields {
    padding: u64,
    align: u64,
}

impl TryFrom<RuleFields> for CarveRule {
    type Error = CarveRuleError;

    fn try_from(f: RuleFields) -> Result<Self, CarveRuleError> {
        Self::new(f.padding, f.align)
    }
}

impl Default for CarveRule {
    fn default() -> Self {
        Self {
            padding: DEFAULT_PADDING,
            align: DEFAULT_ALIGN,
        }
    }
}

impl CarveRule {
    /// A rule with the given padding and start alignment.
    pub const fn new(padding: u64, align: u64) -> Result<Self, CarveRuleError> {
        if padding % LEN_GRANULE != 0 || padding > (1 << 20) {
            return Err(CarveRuleError::BadPadding { padding });
        }
        if !align.is_power_of_two() || align < DEFAULT_ALIGN || align > MAX_ALIGN {
            return Err(CarveRuleError::BadAlignment { align });
        }
        Ok(Self { padding, align })
    }

    /// The rule for DVPP output that feeds a model: 32 bytes of padding, 128-byte starts.
    pub const fn model_input() -> Self {
        Self {
            padding: DEFAULT_PADDING,
            align: MODEL_INPUT_ALIGN,
        }
    }

    /// The same padding with another start alignment.
    pub const fn with_align(self, align: u64) -> Result<Self, CarveRuleError> {
        Self::new(self.padding, align)
    }

    /// The same alignment with another padding.
    pub const fn with_padding(self, padding: u64) -> Result<Self, CarveRuleError> {
        Self::new(padding, self.align)
    }

    /// Padding after each segment.
    pub const fn padding(&self) -> u64 {
        self.padding
    }

    /// Start alignment of each segment.
    #[inline]
    pub const fn align(&self) -> u64 {
        self.align
    }

    /// `ALIGN_UP(len, 32) + padding`: the bytes the segment may touch (data and padding).
    pub const fn segment_len(&self, len: u64) -> Result<u64, CarveRuleError> {
        if len == 0 {
            return Err(CarveRuleError::ZeroLength);
        }
        match segment_of(len, self.padding) {
            Some(m) => Ok(m),
            None => Err(CarveRuleError::LengthOverflow { len }),
        }
    }

    /// `ALIGN_UP(ALIGN_UP(len, 32) + padding, align)`: the bytes one segment takes out of
    /// a block, so that the next segment's start is aligned too. Never below `align`.
    #[inline]
    pub const fn footprint(&self, len: u64) -> Result<u64, CarveRuleError> {
        if len == 0 {
            return Err(CarveRuleError::ZeroLength);
        }
        match footprint_of(len, self.padding, self.align) {
            Some(f) => Ok(f),
            None => Err(CarveRuleError::LengthOverflow { len }),
        }
    }

    /// The AscendCL runtime's own rounding for a direct allocation of `size`:
    /// `(size + 32 + padding - 1) / 32 * 32`.
    pub const fn runtime_rounded(&self, size: u64) -> Result<u64, CarveRuleError> {
        if size == 0 {
            return Err(CarveRuleError::ZeroLength);
        }
        match size.checked_add(LEN_GRANULE + self.padding - 1) {
            Some(v) => Ok(v / LEN_GRANULE * LEN_GRANULE),
            None => Err(CarveRuleError::LengthOverflow { len: size }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn documented_examples() {
        let r = CarveRule::default();
        assert_eq!(r.segment_len(1), Ok(64));
        assert_eq!(r.footprint(1), Ok(64));
        assert_eq!(r.footprint(32), Ok(64));
        assert_eq!(r.footprint(33), Ok(128));
        assert_eq!(r.footprint(96), Ok(128));
        assert_eq!(r.footprint(97), Ok(192));
        assert_eq!(r.footprint(3_110_400), Ok(3_110_464));
        assert_eq!(CarveRule::model_input().footprint(3_110_400), Ok(3_110_528));
        assert_eq!(CarveRule::model_input().footprint(1), Ok(128));
    }

    #[test]
    fn zero_padding_policies() {
        let r = CarveRule::new(0, 64).unwrap();
        assert_eq!(r.segment_len(1), Ok(32));
        assert_eq!(r.footprint(1), Ok(64));
        assert_eq!(r.footprint(64), Ok(64));
        assert_eq!(r.footprint(65), Ok(128));
    }

    #[test]
    fn larger_alignment() {
        let r = CarveRule::default().with_align(4096).unwrap();
        assert_eq!(r.footprint(1), Ok(4096));
        assert_eq!(r.footprint(4064), Ok(4096));
        assert_eq!(r.footprint(4065), Ok(8192));
    }

    #[test]
    fn bad_input_is_typed() {
        let r = CarveRule::default();
        assert_eq!(r.footprint(0), Err(CarveRuleError::ZeroLength));
        assert!(matches!(
            r.footprint(u64::MAX),
            Err(CarveRuleError::LengthOverflow { .. })
        ));
        assert!(matches!(
            r.footprint(u64::MAX - 40),
            Err(CarveRuleError::LengthOverflow { .. })
        ));
        // Near the top but still representable: 2^64 - 200 -> 2^64 - 192 + 32 -> 2^64 - 128.
        assert_eq!(r.footprint(u64::MAX - 199), Ok(u64::MAX - 127));
        assert!(CarveRule::new(32, 48).is_err());
        assert!(CarveRule::new(32, 32).is_err());
        assert!(CarveRule::new(16, 64).is_err());
        assert!(CarveRule::new(32, 1 << 31).is_err());
        assert_eq!(r.runtime_rounded(0), Err(CarveRuleError::ZeroLength));
    }

    #[test]
    fn runtime_rounding_matches_reference() {
        let r = CarveRule::default();
        // aclrtMalloc: round up to 32, plus 32.
        assert_eq!(r.runtime_rounded(1), Ok(64));
        assert_eq!(r.runtime_rounded(32), Ok(64));
        assert_eq!(r.runtime_rounded(33), Ok(96));
        assert_eq!(CarveRule::new(0, 64).unwrap().runtime_rounded(33), Ok(64));
    }

    #[test]
    fn footprint_is_aligned_and_covers_segment() {
        for align in [64u64, 128, 256, 2 << 20] {
            for padding in [0u64, 32, 64] {
                let r = CarveRule::new(padding, align).unwrap();
                for len in (1..5000u64).chain([u64::MAX / 4, (1 << 40) + 1]) {
                    let f = r.footprint(len).unwrap();
                    assert_eq!(f % align, 0);
                    assert!(f >= r.segment_len(len).unwrap());
                    assert!(f - r.segment_len(len).unwrap() < align);
                }
            }
        }
    }

    #[test]
    fn an_empty_segment_still_takes_one_aligned_slot() {
        // The thread-cache path computes this before the rule rejects len 0; a footprint
        // of 0 would name no bin.
        assert_eq!(footprint_of(0, 0, 64), Some(64));
        assert_eq!(footprint_of(0, 0, 4096), Some(4096));
        assert_eq!(footprint_of(0, 32, 64), Some(64));
    }

    #[test]
    fn errors_say_what_was_asked() {
        let cases = [
            (CarveRuleError::ZeroLength, "0 bytes"),
            (CarveRuleError::LengthOverflow { len: 123_456 }, "123456"),
            (CarveRuleError::BadAlignment { align: 48 }, "alignment 48"),
            (CarveRuleError::BadPadding { padding: 16 }, "padding 16"),
        ];
        for (e, said) in cases {
            assert!(e.to_string().contains(said), "{e:?} printed {e}");
        }
    }

    #[test]
    fn the_limits_themselves_are_accepted() {
        // 1 MiB of padding and 1 GiB starts are the documented largest, not past it.
        let widest = CarveRule::new(1 << 20, MAX_ALIGN).unwrap();
        assert_eq!(widest.footprint(1), Ok(MAX_ALIGN));
        assert_eq!(widest.segment_len(1), Ok(32 + (1 << 20)));
        assert_eq!(
            CarveRule::default()
                .with_padding(1 << 20)
                .map(|r| r.padding()),
            Ok(1 << 20)
        );
        assert_eq!(
            CarveRule::new((1 << 20) + 32, 64),
            Err(CarveRuleError::BadPadding {
                padding: (1 << 20) + 32
            })
        );
        assert_eq!(
            CarveRule::new(32, MAX_ALIGN * 2),
            Err(CarveRuleError::BadAlignment {
                align: MAX_ALIGN * 2
            })
        );
    }
}
