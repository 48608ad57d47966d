#!/usr/bin/env bash
# Seeds trace_replay's corpus: the first 60 lines of each trace given (the shared traces by
# default), behind three option bytes, and a file of bad events. Started empty, the fuzzer
# finds well-formed events slowly: seeded, its coverage rises about fourfold in the first
# minutes (docs/benchmarks.md, session 62).
set -euo pipefail
cd "$(dirname "$0")"
traces=("$@")
if [ ${#traces[@]} -eq 0 ]; then
  traces=(../../shared/traces/*.jsonl)
fi
out=corpus/trace_replay
mkdir -p "$out"
for t in "${traces[@]}"; do
  # The first byte picks the device size and the replay options (see the target).
  for option in 00 07 c8; do
    { printf "\x$option"; head -n 60 "$t"; } | head -c 4000 >"$out/seed-$(basename "$t" .jsonl)-$option"
  done
done
{
  printf '\x05'
  printf '%s\n' \
    '{"op":"alloc","id":1,"size":0,"mem":"device"}' \
    '{"op":"alloc","id":2,"size":100,"mem":"hbm"}' \
    '{"op":"free","id":9}' \
    '{"op":"alloc","id":3,"size":64,"mem":"host"}' \
    '{"op":"alloc","id":3,"size":64,"mem":"host"}' \
    '{"op":"free","id":3}' \
    '{"op":"free","id":3}' \
    '{"op":"alloc","id":4,"size":18446744073709551615,"mem":"dvpp"}' \
    'not json'
  printf '\xff\xfe\n'
} >"$out/seed-bad-events"
echo "seeded $out with $(( ${#traces[@]} * 3 + 1 )) inputs"
