//! Locates (or builds) the simulator drop-in `libascendcl.so` from `acl-sim/`.
//!
//! The library is `$ASCEND_POOL_SIM_LIB` when set, otherwise it is built with
//! `cargo build -p acl-sim` into a target directory of its own (a nested build in the
//! test's target directory would wait on cargo's lock).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

/// Path of the drop-in library, built once per test binary.
pub fn dropin() -> &'static Path {
    static LIB: OnceLock<PathBuf> = OnceLock::new();
    LIB.get_or_init(|| {
        if let Some(path) = std::env::var_os("ASCEND_POOL_SIM_LIB") {
            return PathBuf::from(path);
        }
        let target = Path::new(env!("CARGO_TARGET_TMPDIR")).join("acl-sim-target");
        let status = Command::new(env!("CARGO"))
            .args(["build", "--quiet", "-p", "acl-sim", "--target-dir"])
            .arg(&target)
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .status()
            .expect("run cargo to build acl-sim");
        assert!(status.success(), "building the acl-sim drop-in failed");
        target.join("debug").join("libascendcl.so")
    })
}

/// An `AclSource` over a private copy of the drop-in, so that each caller gets a simulator of
/// its own, configured with `capacity` bytes of device and host memory (and the runtime's
/// 16 GiB of DVPP address space) through the drop-in's environment variables. Calls are
/// serialized: the variables are read while the library initializes.
#[allow(dead_code)] // only the conformance binaries open private copies
pub fn private_acl_source(capacity: u64) -> ascend_pool::source::acl::AclSource {
    static ENV_LOCK: std::sync::Mutex<u32> = std::sync::Mutex::new(0);
    let mut n = ENV_LOCK.lock().unwrap_or_else(|p| p.into_inner());
    *n += 1;
    let copy = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("dropin-copy-{}-{}", std::process::id(), *n))
        .join("libascendcl.so");
    std::fs::create_dir_all(copy.parent().unwrap()).unwrap();
    std::fs::copy(dropin(), &copy).unwrap();
    for (key, value) in [
        ("ASCEND_POOL_SIM_DEVICE_CAPACITY", capacity),
        ("ASCEND_POOL_SIM_HOST_CAPACITY", capacity),
        ("ASCEND_POOL_SIM_COPY_BANDWIDTH", 2_000_000_000),
    ] {
        // SAFETY (of the environment): a test binary sets these only here, under ENV_LOCK,
        // and the drop-in reads them while the lock is held (aclInit in open).
        unsafe { std::env::set_var(key, value.to_string()) };
    }
    let acl = ascend_pool::source::acl::AclSource::open(&copy).expect("the drop-in loads");
    // The simulator inside is configured now; the copy can go.
    let _ = std::fs::remove_dir_all(copy.parent().unwrap());
    acl
}
