#!/usr/bin/env bash
# Every figure in benchmarks/RESULTS.md, in order; outputs land in build/results/.
# Quality runs first (they need no quiet machine), timed runs last.
set -euo pipefail
cd "$(dirname "$0")/.."
out=build/results
mkdir -p "$out"
run() { local name=$1; shift; echo "== $name: $*"; "$@" > "$out/$name.txt" 2> "$out/$name.err"; tail -n 30 "$out/$name.txt"; }

case "${1:-all}" in
quality|all)
  run model_report python -m expertcache.train.report build/train/train_tokens.npy
  run recall expertcache predict --max-tokens 32768 --plot "$out/recall.png" --json "$out/recall.json"
  run study expertcache study --out "$out/study" --json "$out/study.json"
  run speculative python -c "
import json; from expertcache.lab.speculation import speculative_quality; from expertcache.lab.study import StudyConfig
print(json.dumps(speculative_quality(None, StudyConfig()), indent=1))"
  run trace expertcache trace --out build/eval.ectrace
  run trace16k expertcache trace --max-tokens 16384 --out build/eval16k.ectrace
  run admission python benchmarks/admission.py --trace build/eval16k.ectrace --json "$out/admission.json"
  run bad_inputs python benchmarks/bad_inputs.py --json "$out/bad_inputs.json"
  run checkpoint_sizes python benchmarks/checkpoint_sizes.py --out build/configs
  run quantized python benchmarks/quantized.py --json "$out/quantized.json"
  run tune expertcache tune --cache 0.25 --budget 1% --json "$out/tune.json" --plot "$out/tune.png"
  run tune_int4 expertcache tune --cache-bytes 11796480 --slot-dtypes int4 --budget 1% --json "$out/tune_int4.json" \
      --plot "$out/tune_int4.png"
  ;;&
timed|all)
  run io_probe python benchmarks/io_probe.py
  run io_fork_join python benchmarks/io_probe.py --fork-join --batches 300
  run store_integrity python benchmarks/store_integrity.py --json "$out/store_integrity.json"
  run decode_profile python benchmarks/decode_profile.py
  run families python benchmarks/families.py
  run serve_load python benchmarks/serve_load.py
  run prefill_protection python benchmarks/prefill_protection.py
  run simulator_speed python benchmarks/simulator_speed.py --tokens 4000
  run simulator_speed_decode python benchmarks/simulator_speed.py --tokens 4000 --window 1
  run decode python benchmarks/decode.py --gguf build/model.gguf build/model-f16.gguf --llama-threads 1 2 \
      --json "$out/decode.json"
  run bench expertcache bench --json "$out/bench.json" --policies fetch-all threshold:tau=0.15 first-choice \
      quality-first speed-first substitute-all
  run bench_prefetch expertcache bench --json "$out/bench_prefetch.json" --forced-tokens 512 --policies fetch-all \
      fetch-all+prefetch/router-ahead fetch-all+prefetch/quasi-hidden fetch-all+prefetch/estimator \
      fetch-all+prefetch/hybrid fetch-all+speculative/quasi-hidden fetch-all+speculative/hybrid \
      quality-first quality-first+prefetch/hybrid fetch-all+prefetch/quasi-hidden:budget=4 \
      quality-first+prefetch/quasi-hidden:budget=4
  run prefetch_bound python benchmarks/prefetch_bound.py --predictors lookahead estimator --budgets 8 4 --split \
      --json "$out/prefetch_bound.json"
  run prefetch_bound_estimator python benchmarks/prefetch_bound.py --predictor estimator --budgets 8 6 4 \
      --json "$out/prefetch_bound_estimator.json"
  for c in 0.1 0.25 0.5; do
    run "prefetch_bound_text_c$c" python benchmarks/prefetch_bound.py --predictors lookahead --split --cache "$c" \
        --feed text --json "$out/prefetch_bound_text_c$c.json"
  done
  run bench_threads expertcache bench --io threads --json "$out/bench_threads.json" --policies fetch-all \
      threshold:tau=0.15 quality-first fetch-all+prefetch/quasi-hidden
  run slot_formats python benchmarks/quantized.py --slots --repeats 5 --slot-policies threshold:tau=0.05 \
      threshold:tau=0.1 threshold:tau=0.1,eviction=demand threshold:tau=0.15,beta=0.5,eviction=freq \
      --json "$out/slot_formats.json"
  run make_checkpoint python benchmarks/make_checkpoint.py --out build/qwen3-30b-shape --layers 4
  run calibrate_big expertcache calibrate --model build/qwen3-30b-shape --max-tokens 1024
  run bench_big expertcache bench --model build/qwen3-30b-shape --cache 0.25 --decode-tokens 16 --forced-tokens 64 \
      --repeats 2 --json "$out/bench_big.json" --policies fetch-all threshold:tau=0.15 quality-first \
      threshold:tau=0.07,eviction=demand fetch-all+prefetch/quasi-hidden quality-first+prefetch/quasi-hidden
  run calibrate_hw expertcache calibrate-hw --store disk --mode forced --out "$out/cpu-disk-forced.json"
  run calibrate_hw_decode expertcache calibrate-hw --store disk --mode decode --out "$out/cpu-disk-decode.json"
  run calibrate_hw_decode_int4 expertcache calibrate-hw --store disk --mode decode --slot-dtype int4 --store-dtype int4 \
      --out "$out/cpu-disk-decode-int4.json"
  run tune_int4_profiles expertcache tune --cache-bytes 11796480 --slot-dtypes int4 --profile "$out/cpu-disk-decode.json" \
      "$out/cpu-disk-decode-int4.json" --json "$out/tune_int4_profiles.json"
  run costmodel_check python benchmarks/costmodel_check.py --repeats 3 --json "$out/costmodel_check.json"
  run simulate expertcache simulate build/eval16k.ectrace --cache 0.125 0.25 0.5 --jobs 2 \
      --profile "$out/cpu-disk-forced.json" --plot "$out/frontier.png" --json "$out/simulate.json" \
      --policies fetch-all threshold:tau=0.15 first-choice quality-first moe-infinity llama.cpp conditional:j=2,m=16
  run simulate_3090 expertcache simulate build/eval16k.ectrace --cache 0.25 --profile rtx3090-qwen3-next \
      --policies fetch-all threshold:tau=0.15 first-choice quality-first speed-first
  ;;
esac
