#!/usr/bin/env bash
# GPU suite + in-process benches (step, decode) on one H200; results under ${OUT:-results}.
source "$(dirname "$0")/device_env.sh"
timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider -rs -k "${GPU_TESTS:-}" 2>&1 | tee "$OUT/gpu_suite.log" | tail -15
bg() { python3 -m breakgraph.cli bench "$@" 2>&1 | grep -v -e Loading -e Capturing -e Warning -e warn; }
bg step --models qwen3-0.6b llama-3.1-8b -N 256 1024 8192 -P 0 32768 --reps 5 --no-compile \
  --json "$OUT/step.json" | tee "$OUT/step.log"
bg decode --models qwen3-0.6b llama-3.1-8b --batch-sizes 1 2 4 8 16 32 64 --context 1024 \
  --json "$OUT/decode.json" | tee "$OUT/decode.log"
[ -n "${COMPILE:-}" ] && bg step --models qwen3-0.6b -N $COMPILE -P 0 --reps 5 --compile-timeout 150 \
  --json "$OUT/step_compile.json" | tee "$OUT/step_compile.log"
true
