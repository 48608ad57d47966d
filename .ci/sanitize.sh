#!/usr/bin/env bash
# The test suites under a sanitizer: `thread` (ThreadSanitizer) or `address` (AddressSanitizer,
# with LeakSanitizer). Any report fails the run.
#
# std is rebuilt with the sanitizer (-Zbuild-std, needs nightly's rust-src): uninstrumented
# locks inside std would read as races, and its allocations would go unchecked. The drop-in
# library gets the same build, and the test binaries export the sanitizer's symbols so the
# library can resolve them when it is loaded. The loom models are left out of both (loom runs
# its own threads on stacks of its own).
#
# thread: the unit tests and the 20 suites that run threads (stream workers, thread caches,
#   shape slots, biased locks, deferred frees, sharing between processes, the drop-in); the
#   engine's and the replay's suites run one thread and have no unsafe code.
# address: the unit tests and every suite but loom's. Leaks are checked except in the suites
#   that unload the drop-in: it keeps the simulator it builds on first use for the life of
#   the process, as a runtime keeps its process-wide state, and unloading it loses that.
# Usage: .ci/sanitize.sh thread|address   (about 4.5 and 3.5 minutes on 2 cores)
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
kind=${1:?usage: .ci/sanitize.sh thread|address}
case $kind in thread | address) ;; *) echo "unknown sanitizer: $kind" >&2; exit 2 ;; esac
rustup component add --toolchain nightly rust-src
target=x86_64-unknown-linux-gnu
export RUSTFLAGS="-Zsanitizer=$kind -Clink-arg=-Wl,--export-dynamic"
export RUSTDOCFLAGS="-Zsanitizer=$kind"
export CARGO_TARGET_DIR=target/sanitize-$kind
cargo +nightly build -Zbuild-std --target "$target" -p acl-sim
export ASCEND_POOL_SIM_LIB="$PWD/$CARGO_TARGET_DIR/$target/debug/libascendcl.so"
test_suites() { cargo +nightly test -Zbuild-std --target "$target" -p ascend-pool "$@"; }
dropin=(acl_sim_dropin acl_vmm_dropin conformance_acl conformance_vmm_acl share_processes)
threaded=(acl_fake aligned bad_input_audit conformance_sim conformance_vmm mbuf pool_cache
  pool_fuzz_regressions pool_growth pool_props record sim_source stream_order stress vmm_source)
single=(buddy_placement engine_props trace_replay)
if [ "$kind" = thread ]; then
  TSAN_OPTIONS="halt_on_error=0 ${TSAN_OPTIONS:-}" \
    test_suites --lib "${threaded[@]/#/--test=}" "${dropin[@]/#/--test=}"
else
  ASAN_OPTIONS="detect_leaks=1 ${ASAN_OPTIONS:-}" \
    test_suites --lib "${threaded[@]/#/--test=}" "${single[@]/#/--test=}"
  ASAN_OPTIONS="detect_leaks=0 ${ASAN_OPTIONS:-}" test_suites "${dropin[@]/#/--test=}"
fi
