#!/usr/bin/env bash
# Tensor parallelism on nvidia-h200-x2 (issue 17): TP GPU tests, the all-reduce per message
# size (NCCL vs the one-shot path), then TP1 vs TP2 in-process benches (step: eager, graphs,
# floor; decode: eager, graph, and the all-reduce share of the step's GPU time and the gaps
# between kernels from a profile; TP2 decode once more with --enable-custom-all-reduce).
# Results under ${OUT:-results}.
source "$(dirname "$0")/device_env.sh"
# the TP GPU tests (whole log in tp_tests.log; the worker-death test's own output in
# tp_death.log: it runs last and alone, so a hang there costs nothing else)
timeout 200 python3 -m pytest -v -m gpu -p no:cacheprovider -rfE --durations=5 tests/test_tp_gpu.py \
  -k "not worker_death" > "$OUT/tp_tests.log" 2>&1
timeout 170 python3 -m pytest -v -m gpu -p no:cacheprovider -rfE tests/test_tp_gpu.py \
  -k worker_death > "$OUT/tp_death.log" 2>&1
grep -h -E "PASSED|FAILED|ERROR|passed|failed" "$OUT/tp_tests.log" "$OUT/tp_death.log" | tee "$OUT/tp.log"
# NCCL against the one-shot all-reduce per message size, both replayed from CUDA graphs
timeout 120 python3 -m breakgraph.bench.allreduce 2>&1 | tee "$OUT/allreduce.log"
bg() { python3 -m breakgraph.cli bench "$@" 2>&1 | grep -v -e Loading -e Capturing -e Warning -e warn; }
# TP2 decode with the one-shot all-reduce (--enable-custom-all-reduce) beside NCCL's below
bg decode --models ${MODELS:-llama-3.1-8b} --batch-sizes 1 8 32 --context 1024 --tp 2 --profile \
  --enable-custom-all-reduce --json "$OUT/decode_tp2_one_shot.json" | tee -a "$OUT/tp.log"
for tp in 1 2; do
  bg step --models ${MODELS:-llama-3.1-8b} -N 256 1024 8192 -P 0 --reps 5 --no-hf --tp "$tp" \
    --json "$OUT/step_tp$tp.json" | tee -a "$OUT/tp.log"
  bg decode --models ${MODELS:-llama-3.1-8b} --batch-sizes 1 8 32 --context 1024 --tp "$tp" --profile \
    --json "$OUT/decode_tp$tp.json" | tee -a "$OUT/tp.log"
done
true
