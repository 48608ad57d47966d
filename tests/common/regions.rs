//! What the multi-threaded suites share: a region of any kind, a seeded generator, and the
//! check that a pool's threads gave everything back.

use ascend_pool::region::{DeviceRegion, DvppRegion, HostRegion};
use ascend_pool::Pool;

/// A region of one of the three typed kinds, as threads hand them to each other.
pub enum Any {
    Device(DeviceRegion),
    Dvpp(DvppRegion),
    Host(HostRegion),
}

/// Runs `$body` with `$r` bound to the typed region inside `$any`.
macro_rules! with_region {
    ($any:expr, $r:ident => $body:expr) => {
        match $any {
            $crate::common_regions::Any::Device($r) => $body,
            $crate::common_regions::Any::Dvpp($r) => $body,
            $crate::common_regions::Any::Host($r) => $body,
        }
    };
}
pub(crate) use with_region;

/// xorshift64*: deterministic per thread, no dependency.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// Every kind holds nothing live, pending or cached, and counted a free for each allocation.
pub fn assert_all_freed(pool: &Pool) {
    for s in pool.all_stats() {
        assert_eq!(
            (
                s.live_regions,
                s.allocated_bytes,
                s.requested_bytes,
                s.pending_frees
            ),
            (0, 0, 0, 0),
            "{s:?}"
        );
        assert_eq!((s.cached_regions, s.cached_bytes), (0, 0), "{s:?}");
        assert_eq!(s.allocations, s.frees, "{s:?}");
    }
}
