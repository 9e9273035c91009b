#!/usr/bin/env bash
# The CUDA path's checks, for a machine with a GPU (none of them runs without one): the tests that skip
# without CUDA, a decode and a perplexity run on the built-in model with --device cuda, and a short
# `bench --store pinned`. Every output lands under $OUT (default build/gpu_check); the exit status is
# the number of checks that failed.
#
#     OUT=/tmp/gpu benchmarks/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-build/gpu_check}
mkdir -p "$out"
failed=0
check() {
  local name=$1; shift
  echo "== $name: $*"
  if timeout 300 "$@" > "$out/$name.txt" 2> "$out/$name.err"; then echo "   ok"; else echo "   FAILED ($?)"; failed=$((failed + 1)); fi
  tail -n 5 "$out/$name.txt" "$out/$name.err"
}
{ nvidia-smi; python -c "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name())"; } \
  > "$out/machine.txt" 2>&1
check tests python -m pytest -q -rs tests/test_devices.py -k cuda
check decode python -m expertcache.cli generate --device cuda --store ram -n 16 "The expert cache"
check decode_pinned python -m expertcache.cli generate --device cuda --store pinned --policy quality-first -n 16 \
  "The expert cache"
check decode_sampled python -m expertcache.cli generate --device cuda --store disk --temperature 0.8 --seed 1 -n 16 \
  "The expert cache"
check ppl python -m expertcache.cli ppl --device cuda --store disk --max-tokens 256
check bench python -m expertcache.cli bench --device cuda --store pinned --policies fetch-all quality-first \
  --decode-tokens 8 --forced-tokens 64 --repeats 1 --json "$out/bench.json"
echo "$failed check(s) failed; outputs in $out"
exit "$failed"
