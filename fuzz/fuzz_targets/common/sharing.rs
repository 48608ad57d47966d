//! What the targets that publish memory share: whom the exporter publishes to, and the
//! wind-down that checks the simulator holds nothing afterwards.

use std::borrow::Borrow;
use std::sync::Arc;

use arbitrary::Arbitrary;
use ascend_pool::share::Access;
use ascend_pool::source::sim::SimSource;
use ascend_pool::source::vmm::VmmSource;
use ascend_pool::Pool;

/// Which processes the exporter lets open what it publishes.
#[derive(Arbitrary, Debug, Clone, Copy, PartialEq, Eq)]
pub enum Who {
    /// This process, by id: its import goes through.
    Me,
    /// Another process only: this one's import is refused, unless an earlier publish of the
    /// same physical allocation let it in (whitelists are per allocation, and only grow).
    Other,
    /// Any process, without validation.
    Anyone,
}

impl Who {
    /// The access for this process, whose id is `me`.
    pub fn access(self, me: i32) -> Access {
        match self {
            Self::Me => Access::Processes(vec![me]),
            Self::Other => Access::Processes(vec![if me == 1 { 2 } else { 1 }]),
            Self::Anyone => Access::AnyProcess,
        }
    }
}

/// Trims and validates the pool and its source, drops both, and gives what the simulator
/// still holds: blocks, reservations, physical allocations and mappings.
pub fn wind_down(
    pool: impl Borrow<Pool>,
    vmm: Arc<VmmSource<SimSource>>,
    sim: &SimSource,
) -> (u64, u64, u64, u64) {
    pool.borrow().trim();
    pool.borrow().validate().unwrap();
    vmm.validate().unwrap();
    drop(pool);
    drop(vmm);
    let s = sim.stats();
    (
        s.live_blocks,
        s.reservations,
        s.physical_handles,
        s.mappings,
    )
}

/// What [`wind_down`] must give once everything was let go.
pub const NOTHING_HELD: (u64, u64, u64, u64) = (0, 0, 0, 0);
