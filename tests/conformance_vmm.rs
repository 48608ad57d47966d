//! The conformance suite on the virtual-memory block source over the simulator: device
//! chunks are physical granules mapped into one reserved range.

mod conformance;

use ascend_pool::source::sim::{SimConfig, SimSource};
use ascend_pool::source::vmm::{VmmConfig, VmmSource};

conformance_suite!(|capacity| {
    let config = SimConfig::default()
        .with_device_capacity(capacity)
        .with_host_capacity(capacity)
        // Copies take real time (2 GB/s), so a reuse-before-the-stream-passes bug corrupts data.
        .with_copy_bandwidth(2_000_000_000);
    let sim = Arc::new(SimSource::new(config).unwrap());
    Arc::new(VmmSource::new(sim, 0, VmmConfig::default()).unwrap())
});
