#!/usr/bin/env bash
# Tensor parallelism on nvidia-h200-x2 (issue 17), in two parts that each fit one device call:
#   PART=tests: the TP GPU tests (whole log in tp_tests.log; the worker-death test alone, last,
#     its output in tp_death.log, so a hang there costs nothing else), then the all-reduce per
#     message size (NCCL vs the one-shot path, both replayed from CUDA graphs);
#   PART=bench: TP1 vs TP2 in-process benches (step: eager, graphs, floor; decode: eager, graph,
#     and from a profile the all-reduce share of the step's GPU time and the gaps between
#     kernels; each worker's host time per step: BREAKGRAPH_TP_TRACE), TP2 once more with
#     --disable-custom-all-reduce (NCCL only).
# No PART: both. Results under ${OUT:-results}.
source "$(dirname "$0")/device_env.sh"
if [ "${PART:-tests}" = tests ]; then  # PART unset: both parts
  timeout 200 python3 -m pytest -v -m gpu -p no:cacheprovider -rfE --durations=5 tests/test_tp_gpu.py \
    -k "not worker_death" > "$OUT/tp_tests.log" 2>&1
  timeout 170 python3 -m pytest -v -m gpu -p no:cacheprovider -rfE tests/test_tp_gpu.py \
    -k worker_death > "$OUT/tp_death.log" 2>&1
  grep -h -E "PASSED|FAILED|ERROR|passed|failed" "$OUT/tp_tests.log" "$OUT/tp_death.log" | tee "$OUT/tp.log"
  timeout 120 python3 -m breakgraph.bench.allreduce 2>&1 | tee "$OUT/allreduce.log"
fi
if [ "${PART:-bench}" = bench ]; then
  bg() { BREAKGRAPH_TP_TRACE=1 python3 -m breakgraph.cli bench "$@" 2>&1 \
    | grep -v -e Loading -e Capturing -e Warning -e warn; }
  m=${MODELS:-llama-3.1-8b}
  for arm in "1" "2" "2 --disable-custom-all-reduce"; do
    tag=tp${arm// --disable-custom-all-reduce/_nccl}
    bg step --models $m -N 256 1024 8192 -P 0 --reps 5 --no-hf --tp $arm \
      --json "$OUT/step_$tag.json" | tee -a "$OUT/tp_bench.log"
    bg decode --models $m --batch-sizes 1 8 32 --context 1024 --profile --tp $arm \
      --json "$OUT/decode_$tag.json" | tee -a "$OUT/tp_bench.log"
  done
fi
true
