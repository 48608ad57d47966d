//! The conformance suite on the virtual-memory block source through the AscendCL path:
//! `VmmSource` over `AclSource` over a private copy of the simulator drop-in per test.

#[path = "common/dropin.rs"]
mod common_dropin;
mod conformance;

use ascend_pool::source::acl::AclSource;
use ascend_pool::source::vmm::{VmmConfig, VmmSource};
use std::sync::Mutex;

static ENV_LOCK: Mutex<u32> = Mutex::new(0);

conformance_suite!(|capacity| {
    let mut n = ENV_LOCK.lock().unwrap_or_else(|p| p.into_inner());
    *n += 1;
    let copy = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("conformance-vmm-{}-{}", std::process::id(), *n))
        .join("libascendcl.so");
    std::fs::create_dir_all(copy.parent().unwrap()).unwrap();
    std::fs::copy(common_dropin::dropin(), &copy).unwrap();
    for (key, value) in [
        ("ASCEND_POOL_SIM_DEVICE_CAPACITY", capacity),
        ("ASCEND_POOL_SIM_HOST_CAPACITY", capacity),
        ("ASCEND_POOL_SIM_DVPP_LIMIT", capacity),
        ("ASCEND_POOL_SIM_COPY_BANDWIDTH", 2_000_000_000),
    ] {
        // SAFETY (of the environment): every test of this binary sets these only here,
        // under ENV_LOCK, and the drop-in reads them while the lock is held (aclInit in open).
        unsafe { std::env::set_var(key, value.to_string()) };
    }
    let acl = AclSource::open(&copy).expect("the drop-in loads");
    let _ = std::fs::remove_dir_all(copy.parent().unwrap());
    Arc::new(VmmSource::new(Arc::new(acl), 0, VmmConfig::default()).unwrap())
});
