#!/usr/bin/env bash
# Tensor parallelism on nvidia-h200-x2 (issue 17): TP GPU tests, then TP1 vs TP2 in-process
# benches (step: eager, graphs, floor; decode: eager, graph, and the all-reduce share of the
# step's GPU time from a profile). Results under ${OUT:-results}.
source "$(dirname "$0")/device_env.sh"
timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE tests/test_tp_gpu.py 2>&1 | tail -15 | tee "$OUT/tp.log"
bg() { python3 -m breakgraph.cli bench "$@" 2>&1 | grep -v -e Loading -e Capturing -e Warning -e warn; }
for tp in 1 2; do
  bg step --models ${MODELS:-llama-3.1-8b} -N 256 1024 8192 -P 0 --reps 5 --no-hf --tp "$tp" \
    --json "$OUT/step_tp$tp.json" | tee -a "$OUT/tp.log"
  bg decode --models ${MODELS:-llama-3.1-8b} --batch-sizes 1 8 32 --context 1024 --tp "$tp" --profile \
    --json "$OUT/decode_tp$tp.json" | tee -a "$OUT/tp.log"
done
true
