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
# thread: the unit tests and the suites that run threads (stream workers, thread caches,
#   shape slots, biased locks, deferred frees, sharing between processes, the drop-in): all
#   but the engine's and the replay's, which run one thread and have no unsafe code.
# address: the unit tests and every suite but loom's. Leaks are checked except in the suites
#   that unload the drop-in: it keeps the simulator it builds on first use for the life of
#   the process, as a runtime keeps its process-wide state, and unloading it loses that.
# Both also run the C interface's unit tests, `c_api` (its functions called from Rust, on
# threads, with a pool destroyed under a working thread) and `c_program` (the C programs, one
# pair of them as two processes). A sanitized library needs the sanitizer's runtime in the
# executable that loads it, so each C program is compiled with the same sanitizer by cc and
# linked with the runtime archive rustc links into its own executables
# (ASCEND_POOL_C_SANITIZER_RT); a probe program proves the reports reach the tests.
# Usage: .ci/sanitize.sh thread|address   (about 5 and 4 minutes on 2 cores)
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
export ASCEND_POOL_C_SANITIZER=$kind
ASCEND_POOL_C_SANITIZER_RT="$(rustc +nightly --print sysroot)/lib/rustlib/$target/lib/librustc-nightly_rt.${kind:0:1}san.a"
export ASCEND_POOL_C_SANITIZER_RT
capi_suites() {
  cargo +nightly test -Zbuild-std --target "$target" -p ascend-pool-capi --lib --test c_api --test c_program
}
# Every suite but loom's, so a new one is covered without an edit here; those that load the
# drop-in are the ones that include its helper.
suites=$(basename -s .rs tests/*.rs | grep -v '^loom_')
dropin=$(grep -l 'common/dropin.rs' tests/*.rs | xargs basename -s .rs)
single="buddy_placement engine_props trace_replay"
args() { for t in "$@"; do echo "--test=$t"; done; }
without() { grep -vxF -f <(printf '%s\n' $2) <<<"$1" || true; }
if [ "$kind" = thread ]; then
  # die_after_fork=0: the forked children of `tests/fork.rs` and `fork.c` start threads of
  # their own (streams, the export service), which ThreadSanitizer otherwise ends at once.
  tsan="halt_on_error=0 die_after_fork=0 suppressions=$PWD/.ci/tsan.supp ${TSAN_OPTIONS:-}"
  # shellcheck disable=SC2046 # one suite name per word
  TSAN_OPTIONS="$tsan" test_suites --lib $(args $(without "$suites" "$single"))
  TSAN_OPTIONS="$tsan" capi_suites
else
  # shellcheck disable=SC2046
  ASAN_OPTIONS="detect_leaks=1 ${ASAN_OPTIONS:-}" \
    test_suites --lib $(args $(without "$suites" "$dropin"))
  # shellcheck disable=SC2046
  ASAN_OPTIONS="detect_leaks=0 ${ASAN_OPTIONS:-}" test_suites $(args $dropin)
  ASAN_OPTIONS="detect_leaks=1 ${ASAN_OPTIONS:-}" capi_suites
fi
