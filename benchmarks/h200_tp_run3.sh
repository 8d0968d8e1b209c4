#!/usr/bin/env bash
# session 10 on nvidia-h200-x2 (issue 17's measures not taken before), by PART:
#   moe: qwen3-30b-a3b TP1 vs TP2 in-process (step N = 256, 1K, 8K; decode bs 1, 8, 32, TP2
#        profiled: the all-reduce share)
#   serve: llama-3.1-8b behind `breakgraph serve` at TP1 and TP2 (bench prefill cold 8192 8,
#        hit 65536 1)
source "$(dirname "$0")/device_env.sh"
R=/tmp/r; rm -rf $R; mkdir -p $R
bg() { local t=$1; shift; timeout "$t" python3 -m breakgraph.cli bench "$@" 2>&1 | grep -v -e Loading -e Capturing -e Warning -e warn; }
if [ "$PART" = moe ]; then
  for tp in 1 2; do
    bg 150 step --models qwen3-30b-a3b -N 256 1024 8192 -P 0 --reps 3 --no-hf --no-compile --tp $tp \
      --json "$R/step_moe_tp$tp.json" | tee -a "$R/moe.log"
    bg 120 decode --models qwen3-30b-a3b --batch-sizes 1 8 32 --context 1024 --tp $tp \
      $([ $tp = 2 ] && echo --profile) --json "$R/decode_moe_tp$tp.json" | tee -a "$R/moe.log"
  done
fi
if [ "$PART" = serve ]; then
  OUT=$R bash "$(dirname "$0")/h200_serve.sh" tp
fi
tar czf "$OUT/r.tgz" -C /tmp r
true
