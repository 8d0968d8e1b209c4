#!/usr/bin/env bash
# Tensor parallelism on nvidia-h200-x2 (README: "Tensor parallel"), by PART (default: tests
# then bench), each fitting one device call; results under ${OUT:-results}.
#   tests: the TP GPU tests (the worker-death test alone, last, in tp_death.log, so a hang
#     there costs nothing else), then the all-reduce per message size, NCCL against the
#     one-shot path, and the fused all-reduce + residual add + RMSNorm per row count;
#   bench: MODELS (default llama-3.1-8b) at TP1 and TP2, and TP2 once more with every
#     all-reduce on NCCL: `bench step` (eager, graphs) and `bench decode --profile` (the
#     all-reduce share of the step's GPU time, the gaps between kernels), each worker's host
#     time per step logged at exit (BREAKGRAPH_TP_TRACE); AR_NORM=1 adds a TP2 arm with the
#     fused all-reduce + norm (BREAKGRAPH_AR_NORM=1);
#   serve: the server at TP1 and TP2 (h200_serve.sh's tp stage).
#   OUT=$OUT [PART="tests bench serve"] [MODELS=...] [AR_NORM=1] bash benchmarks/h200_tp.sh
source "$(dirname "$0")/device_env.sh"
parts=${PART:-tests bench}
if [[ " $parts " == *" tests "* ]]; then
  timeout 200 python3 -m pytest -v -m gpu -p no:cacheprovider -rfE --durations=5 \
    tests/distributed/test_tp_gpu.py -k "not worker_death" > "$OUT/tp_tests.log" 2>&1
  timeout 170 python3 -m pytest -v -m gpu -p no:cacheprovider -rfE \
    tests/distributed/test_tp_gpu.py -k worker_death > "$OUT/tp_death.log" 2>&1
  grep -h -E "PASSED|FAILED|ERROR|passed|failed" "$OUT/tp_tests.log" "$OUT/tp_death.log" | tee "$OUT/tp.log"
  timeout 120 python3 -m breakgraph.cli bench allreduce --norm-rows 1 8 64 2>&1 | grep -v Warn \
    | tee "$OUT/allreduce.log"
fi
if [[ " $parts " == *" bench "* ]]; then
  models=${MODELS:-llama-3.1-8b}
  arms=("1" "2" "2 nccl")
  [ -n "${AR_NORM:-}" ] && arms+=("2 arnorm")
  for arm in "${arms[@]}"; do
    set -- $arm
    tp=$1 tag=tp$1${2:+_$2} flags="" env=()
    [ "${2:-}" = nccl ] && flags=--disable-custom-all-reduce
    [ "${2:-}" = arnorm ] && env=(BREAKGRAPH_AR_NORM=1)
    echo "=== $tag" | tee -a "$OUT/tp_bench.log"
    for cmd in "step --models $models -N 256 1024 8192 -P 0 --reps 5 --no-hf --no-compile" \
               "decode --models $models --batch-sizes 1 8 32 --context 1024 --profile"; do
      env BREAKGRAPH_TP_TRACE=1 "${env[@]}" timeout 300 python3 -m breakgraph.cli bench $cmd \
        --tp "$tp" $flags --json "$OUT/${cmd%% *}_$tag.json" 2>&1 \
        | grep -v -e Loading -e Capturing -e Warning -e warn | tee -a "$OUT/tp_bench.log"
    done
  done
fi
if [[ " $parts " == *" serve "* ]]; then
  OUT=$OUT bash "$(dirname "$0")/h200_serve.sh" tp
fi
save_tcache
true
