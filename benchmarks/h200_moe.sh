#!/usr/bin/env bash
# Mixture of experts on one H200 (issue 13), qwen3-30b-a3b with dummy weights (~61 GB): the
# MoE layer alone (eager and graph-replayed, against a dense GEMM and the bandwidth floor;
# SWEEP=1 adds the launch-config search, BREAKDOWN=1 each kernel's time, TOKENS the M list), then the model's `bench step` with INFO logs and
# timestamps (engine start phases: load, KV, graph capture, warm-up) and `bench decode`.
# Results under ${OUT:-results}.
source "$(dirname "$0")/device_env.sh"
L="$OUT/moe.log"
stamp() { while IFS= read -r line; do printf '[%(%H:%M:%S)T] %s\n' -1 "$line"; done; }
timeout ${LAYER_S:-150} python3 -m breakgraph.bench.moe --model qwen3-30b-a3b \
  --tokens ${TOKENS:-1 8 32 64 256 1024 8192} ${SWEEP:+--sweep} ${BREAKDOWN:+--breakdown} 2>&1 | stamp | tee -a "$L"
timeout ${STEP_S:-300} python3 -m breakgraph.cli --log-level info bench step \
  --models qwen3-30b-a3b -N 256 1024 8192 -P 0 --reps 5 --no-hf \
  --json "$OUT/step_moe.json" 2>&1 | grep -v -e Capturing -e "it/s" | stamp | tee -a "$L"
timeout ${DECODE_S:-150} python3 -m breakgraph.cli bench decode --models qwen3-30b-a3b \
  --batch-sizes 1 8 32 64 --context 1024 --json "$OUT/decode_moe.json" 2>&1 \
  | grep -v -e Capturing -e "it/s" | stamp | tee -a "$L"
save_tcache
true
