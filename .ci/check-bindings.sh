#!/usr/bin/env bash
# Regenerates the AscendCL bindings from include/ascend_pool_acl.h with bindgen and fails
# if they differ from the committed src/source/acl/bindings.rs.
# Installs libclang-dev when no libclang is found (needs root and apt).
# Usage: .ci/check-bindings.sh [--update]   (--update overwrites the committed file)
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"

# The library bindgen loads: libclang.so or libclang-<version>.so, not libclang-cpp.so, which
# LLVM's own packages install without it.
have_libclang() {
  [ -n "${LIBCLANG_PATH:-}" ] && return 0
  ldconfig -p 2>/dev/null | grep -q 'libclang\(-[0-9][0-9.]*\)\?\.so' && return 0
  for f in /usr/lib/llvm-*/lib/libclang.so* /usr/lib/llvm-*/lib/libclang-[0-9]*.so*; do
    [ -e "$f" ] && return 0
  done
  return 1
}
if ! have_libclang; then
  echo "check-bindings: libclang not found, installing libclang-dev"
  if [ "$(id -u)" -ne 0 ]; then
    echo "check-bindings: need root to apt-get install libclang-dev" >&2
    exit 2
  fi
  apt-get update -qq && apt-get install -y -qq libclang-dev >/dev/null
fi

committed=src/source/acl/bindings.rs
fresh=$(mktemp)
trap 'rm -f "$fresh"' EXIT
# Our header only: a CANN toolkit on this machine must not change the answer.
ASCEND_POOL_REGEN_BINDINGS=1 ASCEND_POOL_BINDINGS_FROM=ours ASCEND_POOL_BINDINGS_OUT="$fresh" \
  cargo build --lib --quiet

if [ "${1:-}" = "--update" ]; then
  cp "$fresh" "$committed"
  echo "check-bindings: $committed updated"
  exit 0
fi
if ! diff -u "$committed" "$fresh"; then
  echo "check-bindings: $committed is stale; run .ci/check-bindings.sh --update" >&2
  exit 1
fi
echo "check-bindings: bindings are up to date"
