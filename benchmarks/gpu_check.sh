#!/usr/bin/env bash
# The CUDA path's checks, for a machine with a GPU (none of them runs without one):
#   1. the tests that skip without CUDA (exact fetch-all and prefetch through the copy stream, CPU parity);
#   2. the verbs on the built-in model with --device cuda: decode from each store, sampled decode, a JSON
#      schema, perplexity, a short bench, a chat turn, and the server answering two requests at once;
#   3. bench on Qwen3-30B-A3B's expert shape (benchmarks/make_checkpoint.py, 4 layers): every expert
#      resident against a quarter cache fed from pinned host memory and from the disk store; then where a
#      decode token's time goes there and on the built-in model (benchmarks/decode_profile.py: host stages,
#      device kernel time, launches, copies and syncs per token); then the prefetch bound on the built-in model
#      from pinned memory (benchmarks/prefetch_bound.py: on-demand copies, the predictors' prefetches, an oracle).
# 1 and 2 run side by side (their first run compiles the decision kernel); 3 runs alone after them, so its
# timings share the machine with nothing. Every output lands under $OUT (default build/gpu_check), the
# bench figures as JSON; the exit status is the number of checks that failed.
#
#     OUT=/tmp/gpu benchmarks/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
out=$(realpath -m "${OUT:-build/gpu_check}")
py=${PYTHON:-python3}
mkdir -p "$out"
q30=${Q30:-/tmp/expertcache-q30}  # the real-shape checkpoint: ~4.7 GB
schema='{"type":"object","properties":{"x":{"type":"boolean"}},"required":["x"],"additionalProperties":false}'
export EXPERTCACHE_HOME=${EXPERTCACHE_HOME:-/tmp/expertcache-home} PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export out py schema

check() {  # check NAME SECONDS COMMAND...: one line of verdict, the output in $out/NAME.txt and .err
  local name=$1 limit=$2; shift 2
  local start=$SECONDS
  if timeout "$limit" "$@" > "$out/$name.txt" 2> "$out/$name.err"; then
    echo "ok     $name ($((SECONDS - start)) s)" >> "$out/verdicts"
  else
    echo "FAILED $name (exit $?, $((SECONDS - start)) s): $(tail -n 1 "$out/$name.err")" >> "$out/verdicts"
  fi
}

serve_two() {  # the server on CUDA: two chat requests at once, then one with a JSON schema
  local port=8071
  $py -m expertcache.cli serve --device cuda --store pinned --cache 0.5 --port $port &
  local pid=$!
  for _ in $(seq 120); do curl -sf localhost:$port/health > /dev/null && break; sleep 1; done
  local body='{"messages":[{"role":"user","content":"What does a cache hold?"}],"max_tokens":24}'
  curl -sf localhost:$port/v1/chat/completions -H 'content-type: application/json' -d "$body" > "$out/serve_a.json" &
  local a=$!
  curl -sf localhost:$port/v1/chat/completions -H 'content-type: application/json' -d "$body" > "$out/serve_b.json"
  local rc=$?
  wait $a || rc=1
  curl -sf localhost:$port/v1/chat/completions -H 'content-type: application/json' -d '{"messages":[{"role":"user",
    "content":"A point"}],"max_tokens":40,"response_format":{"type":"json_schema","json_schema":{"name":"p",
    "schema":'"$schema"'}}}' \
    > "$out/serve_schema.json" || rc=1
  kill $pid; wait $pid
  $py -c "import json, sys; [print(json.load(open(f))['choices'][0]['message']['content'][:80]) for f in sys.argv[1:]]
json.loads(json.load(open(sys.argv[3]))['choices'][0]['message']['content'])" \
    "$out/serve_a.json" "$out/serve_b.json" "$out/serve_schema.json" || rc=1
  return $rc
}
export -f serve_two

chat_turn() {  # one message and /exit through chat's stdin
  printf "Who goes there?\n/exit\n" | $py -m expertcache.cli chat --device cuda --store pinned -n 16
}
export -f chat_turn

builtin_checks() {
  check decode_ram 300 $py -m expertcache.cli generate --device cuda --store ram -n 16 "The expert cache"
  check decode_pinned 300 $py -m expertcache.cli generate --device cuda --store pinned --policy quality-first -n 16 \
    "The expert cache"
  check decode_sampled 300 $py -m expertcache.cli generate --device cuda --store disk --temperature 0.8 --seed 1 \
    -n 16 "The expert cache"
  check decode_schema 300 $py -m expertcache.cli generate --device cuda --store disk -n 40 \
    --json-schema "$schema" "A point"
  check ppl 300 $py -m expertcache.cli ppl --device cuda --store disk --max-tokens 256
  check bench_builtin 300 $py -m expertcache.cli bench --device cuda --store pinned \
    --policies fetch-all quality-first quality-first+prefetch/estimator --decode-tokens 16 --forced-tokens 128 \
    --repeats 2 --json "$out/bench_builtin.json"
  check chat 300 bash -c chat_turn
  check serve 300 bash -c serve_two
}

{ nvidia-smi; $py -c "import torch, numba; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name(),
numba.__version__)"; nproc; free -g; } > "$out/machine.txt" 2>&1
: > "$out/verdicts"
check tests 300 $py -m pytest -q -rs -p no:cacheprovider tests/test_devices.py -k cuda &
builtin_checks &
[ -d "$q30" ] || check make_checkpoint 300 $py benchmarks/make_checkpoint.py --out "$q30" --layers 4
wait
# from pinned host memory every miss is a copy over PCIe; from disk an O_DIRECT read first, so fewer tokens
check bench_q30_pinned 300 $py -m expertcache.cli bench --model "$q30" --device cuda --store pinned --cache 0.25 \
  --policies fetch-all quality-first --decode-tokens 32 --forced-tokens 128 --repeats 3 \
  --json "$out/bench_q30_pinned.json"
check bench_q30_disk 300 $py -m expertcache.cli bench --model "$q30" --device cuda --store disk --cache 0.25 \
  --policies fetch-all quality-first --decode-tokens 16 --forced-tokens 64 --repeats 2 --json "$out/bench_q30_disk.json"
check profile_q30 300 $py benchmarks/decode_profile.py --model "$q30" --device cuda --tokens 32 --trials 3 \
  --json "$out/profile_q30.json"
check profile_builtin 300 $py benchmarks/decode_profile.py --device cuda --tokens 32 --trials 3 \
  --json "$out/profile_builtin.json"
# the prefetch bound where a prediction costs kernel launches and a miss a copy over the bus (built-in model: the
# real-shape checkpoint has no trained predictors here)
check prefetch_bound_pinned 300 $py benchmarks/prefetch_bound.py --device cuda --store pinned \
  --predictors lookahead estimator --split --tokens 64 --repeats 8 --json "$out/prefetch_bound_pinned.json"
cat "$out/verdicts"
failed=$(grep -c ^FAILED "$out/verdicts")
echo "$failed check(s) failed; outputs in $out"
exit "$failed"
