//! The conformance suite on the simulator, used directly.

mod conformance;

use ascend_pool::source::sim::{SimConfig, SimSource};

conformance_suite!(|capacity| {
    let config = SimConfig::default()
        // A second device, for the rules on copies between two devices of one source.
        .with_devices(2)
        .with_device_capacity(capacity)
        .with_host_capacity(capacity)
        // Copies take real time (2 GB/s), so a reuse-before-the-stream-passes bug corrupts data.
        .with_copy_bandwidth(2_000_000_000);
    Arc::new(SimSource::new(config).unwrap())
});
