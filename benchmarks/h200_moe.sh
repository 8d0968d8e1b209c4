#!/usr/bin/env bash
# Mixture of experts on one H200 (README: "MoE layer"): the fused MoE layer alone per token
# count for MODELS' expert shapes (eager and graph-replayed, against a dense GEMM pair of the
# same FLOPs and the bandwidth floor), its tables' searches on request, then the decode step
# on the grouped path against the GEMV path of a few tokens (`bench decode --variants`).
#   OUT=$OUT [MODELS="qwen3-30b-a3b gemma-4-26b-a4b"] [TOKENS="1 8 64 256 1024 8192"]
#     [SWEEP=1] [BREAKDOWN=1] [AB=half_tail|gate_up=BN,BK,W,S] [GEMV=4] [GEMV_SWEEP=1]
#     [KERNELS=1] [VARIANTS="moegemv0 base"] [BATCH="1 2 4 8"] bash benchmarks/h200_moe.sh
# SWEEP=1: launch configs per M (rows for fused_moe's config table); BREAKDOWN=1: each
# kernel's time; AB: a variant flag off/on or one GEMM's tile against the table's, one
# process; GEMV=N: the layer at M <= N on the GEMV path against the grouped one (GEMV_SWEEP=1
# searches its block sizes first); KERNELS=1: the GEMV path's kernels alone, every config
# (fused_moe.GEMV_TABLE's source; its JSON feeds VARIANTS="base moetable=$OUT/gemv_kernels.json").
# The model steps themselves: MODELS=qwen3-30b-a3b P=0 HF=1 bash benchmarks/h200_step.sh.
source "$(dirname "$0")/device_env.sh"
models=${MODELS:-qwen3-30b-a3b gemma-4-26b-a4b}
moe() { timeout ${LAYER_S:-300} python3 -m breakgraph.cli bench moe --models $models "$@" 2>&1; }
moe --tokens ${TOKENS:-1 8 64 256 1024 8192} ${SWEEP:+--sweep} ${BREAKDOWN:+--breakdown} \
  ${GEMV:+--gemv $GEMV} ${GEMV_SWEEP:+--gemv-sweep} --json "$OUT/moe.json" | tee "$OUT/moe.log"
if [ -n "${AB:-}" ]; then
  moe --tokens ${AB_TOKENS:-2048 4096 8192} --ab "$AB" --rounds 5 | tee "$OUT/moe_ab.log"
fi
if [ -n "${KERNELS:-}" ]; then
  moe --tokens ${GEMV_TOKENS:-1 2 4 8} --gemv-kernels --json "$OUT/gemv_kernels.json" \
    | tee "$OUT/gemv_kernels.log"
fi
for model in $models; do
  timeout ${AB_S:-300} python3 -m breakgraph.cli bench decode --models "$model" \
    --batch-sizes ${BATCH:-1 2 4 8} --context 1024 --variants ${VARIANTS:-moegemv0 base} \
    --json "$OUT/variants_$model.json" 2>&1 | grep -v -e Capturing -e "it/s" \
    | tee "$OUT/variants_$model.log"
done
save_tcache
true
