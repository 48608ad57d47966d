//! The conformance suite on the virtual-memory block source through the AscendCL path:
//! `VmmSource` over `AclSource` over a private copy of the simulator drop-in per test.

#[path = "common/dropin.rs"]
mod common_dropin;
mod conformance;

use ascend_pool::source::vmm::{VmmConfig, VmmSource};

conformance_suite!(|capacity| {
    Arc::new(
        VmmSource::new(
            Arc::new(common_dropin::private_acl_source(capacity)),
            0,
            VmmConfig::default(),
        )
        .unwrap(),
    )
});
