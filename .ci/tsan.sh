#!/usr/bin/env bash
# ThreadSanitizer over the suites that run threads: the simulator's stream workers, the thread
# caches and shape slots, the biased locks, deferred frees, sharing between processes, and the
# drop-in libascendcl.so. Any report fails the run (TSan's exit code 66).
#
# std is rebuilt with the sanitizer (-Zbuild-std, needs nightly's rust-src); uninstrumented
# locks inside std would otherwise read as races. The drop-in library gets the same build, and
# the test binaries export the sanitizer's symbols so the library can resolve them when it is
# loaded. Left out: the engine's and the trace replay's suites (one thread, no unsafe code)
# and the loom models (loom runs its own threads).
# Usage: .ci/tsan.sh   (about 8 minutes on 2 cores, most of it building)
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
rustup component add --toolchain nightly rust-src
target=x86_64-unknown-linux-gnu
export RUSTFLAGS="-Zsanitizer=thread -Clink-arg=-Wl,--export-dynamic"
export RUSTDOCFLAGS="-Zsanitizer=thread"
export CARGO_TARGET_DIR=target/tsan
export TSAN_OPTIONS="halt_on_error=0 ${TSAN_OPTIONS:-}"
cargo +nightly build -Zbuild-std --target "$target" -p acl-sim
export ASCEND_POOL_SIM_LIB="$PWD/$CARGO_TARGET_DIR/$target/debug/libascendcl.so"
suites=(acl_fake acl_sim_dropin acl_vmm_dropin aligned bad_input_audit conformance_acl
  conformance_sim conformance_vmm conformance_vmm_acl mbuf pool_cache pool_fuzz_regressions
  pool_growth pool_props record share_processes sim_source stream_order stress vmm_source)
cargo +nightly test -Zbuild-std --target "$target" -p ascend-pool --lib \
  "${suites[@]/#/--test=}"
