#!/usr/bin/env bash
# Decode at the bandwidth floor (issue 19) and Gemma 4's fused kernels on one H200: the kernel
# tests against their twins, then `bench decode` (kernels per step and per layer, the floor)
# for each tree in TREES (default: this one; add an older checkout, e.g. TREES=". .dev/old",
# for before/after in one run). Results under ${OUT:-results}.
source "$(dirname "$0")/device_env.sh"
timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE tests/test_kernels.py \
  tests/test_gemma4_gpu.py 2>&1 | tail -8 | tee "$OUT/decode_tests.log"
for tree in ${TREES:-.}; do
  tag=$(basename "$(cd "$tree" && pwd)")
  extra=$([ "$tree" = . ] && echo --profile)  # an older checkout may not have it
  for ctx in ${CONTEXTS:-1024 8192}; do
    PYTHONPATH=$tree:${PYTHONPATH:-} python3 -m breakgraph.cli bench decode \
      --models ${MODELS:-qwen3-0.6b llama-3.1-8b gemma-4-e2b} --batch-sizes 1 8 32 64 \
      --context "$ctx" $extra --json "$OUT/decode_${tag}_$ctx.json" 2>&1 \
      | grep -v -e Loading -e Capturing -e Warning -e warn | tee -a "$OUT/decode.log"
  done
done
true
