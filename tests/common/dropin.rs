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
