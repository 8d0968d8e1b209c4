#!/usr/bin/env bash
# The MoE GEMV path of a few tokens on one H200 (issue 13): per model, the MoE layer alone at
# M = 1..16 on the GEMV path against the grouped one and the floor, same process (bench.moe
# --gemv; SWEEP=1 first searches the path's block sizes at each M and the decode A/B takes
# the config found at the least M, else fused_moe.GEMV_TABLE's), then the decode step at
# batch 1..8 on the grouped path against the GEMV path up to 1..16 tokens (decode_ab.py,
# moegemv<N>; PROFILE=1 adds each variant's kernel time by name). ROUTER=1 also sweeps
# Qwen3-MoE's router shape (gemv_sweep.py --only router); KERNELS=1 times the path's
# kernels alone at each of TOKENS, every config (moe_gemv_kernels.py: GEMV_TABLE's source);
# LAYER=0 skips the layer lines.
# Results under ${OUT:-results}.
#   OUT=$OUT [MODELS="qwen3-30b-a3b gemma-4-26b-a4b"] [SWEEP=1] [VARIANTS="base moegemv4"] \
#     bash benchmarks/h200_moe_gemv.sh
source "$(dirname "$0")/device_env.sh"
for model in ${MODELS:-qwen3-30b-a3b gemma-4-26b-a4b}; do
  [ "${LAYER:-1}" = 1 ] || break  # LAYER=0: no layer lines
  timeout ${LAYER_S:-150} python3 -m breakgraph.bench.moe --model "$model" \
    --tokens ${TOKENS:-1 2 4 8 16} --gemv ${GEMV:-16} ${SWEEP:+--gemv-sweep} \
    --gemv-json "$OUT/moe_gemv_$model.json" 2>&1 | tee "$OUT/moe_gemv_$model.log"
done
if [ -n "${KERNELS:-}" ]; then
  timeout ${KERNELS_S:-150} python3 benchmarks/moe_gemv_kernels.py --models ${MODELS:-qwen3-30b-a3b gemma-4-26b-a4b} \
    --tokens ${TOKENS:-1 2 4 8} --json "$OUT/moe_gemv_kernels.json" 2>&1 | tee "$OUT/moe_gemv_kernels.log"
fi
if [ -n "${ROUTER:-}" ]; then
  timeout 120 python3 benchmarks/gemv_sweep.py --models qwen3-30b-a3b --only router \
    --json "$OUT/router.json" 2>&1 | tee "$OUT/router.log"
fi
for model in ${MODELS:-qwen3-30b-a3b gemma-4-26b-a4b}; do
  MOE_GEMV_SWEEP=${SWEEP:+$OUT/moe_gemv_$model.json} timeout ${AB_S:-200} python3 benchmarks/decode_ab.py \
    --models "$model" --batch-sizes ${BATCH:-1 2 4 8} --context 1024 \
    --variants ${VARIANTS:-base moegemv${GEMV:-16}} --rounds 7 ${PROFILE:+--profile} 2>&1 \
    | tr '\r' '\n' \
    | grep -v -e Capturing -e "it/s" \
    | tee "$OUT/ab_$model.log"
done
true
