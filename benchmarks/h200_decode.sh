#!/usr/bin/env bash
# Decode at the bandwidth floor on one H200: `bench decode` (kernels per step and per layer,
# the floor, PROFILE=1: GPU time by kernel kind) in each of ARMS at each of CONTEXTS, then
# the decode graphs under table variants in one process (`bench decode --variants`, VARIANTS).
#   OUT=$OUT [ARMS="default pdl"] [CONTEXTS="1024 8192"] [MODELS=...] [BATCH_SIZES=...]
#     [PROFILE=1] [GEMM=1] [VARIANTS="base nogemv"] [TESTS=1] bash benchmarks/h200_decode.sh
# Arms (separate processes: expect up to 10% spread at batch 1 between runs):
#   default  the code as it is
#   pdl      BREAKGRAPH_PDL=1: programmatic dependent launch of the Triton kernels at every batch
#   nopdl    BREAKGRAPH_PDL=0: at none
#   skinny   BREAKGRAPH_SKINNY=all: every projection of a few rows on the skinny GEMM
#   old      the checkout in OLD (default .dev/old: `git archive REV | tar -x -C .dev/old`,
#            carried) for a before/after in one run
# GEMM=1 first sweeps the skinny GEMM (`bench gemm`) and the batch-1 GEMV (`bench gemm --gemv`)
# and times the swept tables inside the decode graph (variants skinny=...). TESTS=1 first runs
# the kernel tests.
source "$(dirname "$0")/device_env.sh"
models=${MODELS:-qwen3-0.6b llama-3.1-8b}
bg() { python3 -m breakgraph.cli bench "$@" 2>&1 | grep -v -e Loading -e Capturing -e Warning -e warn; }
if [ "${TESTS:-0}" = 1 ]; then
  timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE tests/kernels/test_kernels.py \
    tests/models/test_gemma4_gpu.py 2>&1 | tail -8 | tee "$OUT/decode_tests.log"
fi
variants=${VARIANTS:-}
if [ "${GEMM:-0}" = 1 ]; then
  timeout 300 python3 -m breakgraph.cli bench gemm --models $models --tp ${GEMM_TP:-1} \
    --json "$OUT/gemm.json" --table-out "$OUT/skinny_table.json" 2>&1 | tee "$OUT/gemm.log" | tail -n 20
  timeout 300 python3 -m breakgraph.cli bench gemm --gemv --models $models \
    --json "$OUT/gemv.json" --table-out "$OUT/gemv_table.json" 2>&1 | tee "$OUT/gemv.log" | tail -n 20
  variants=${variants:-base skinny=$OUT/skinny_table.json skinny=$OUT/gemv_table.json}
fi
for ctx in ${CONTEXTS:-1024 8192}; do
  for arm in ${ARMS:-default pdl}; do
    dir=.
    case $arm in
      default) env=() ;;
      old) env=() dir=${OLD:-.dev/old} ;;
      pdl) env=(BREAKGRAPH_PDL=1) ;;
      nopdl) env=(BREAKGRAPH_PDL=0) ;;
      skinny) env=(BREAKGRAPH_SKINNY=all) ;;
      *) echo "unknown arm $arm"; continue ;;
    esac
    echo "=== arm $arm, context $ctx: ${env[*]}" | tee -a "$OUT/decode.log"
    (cd "$dir" && env "${env[@]}" python3 -m breakgraph.cli bench decode --models $models \
      --batch-sizes ${BATCH_SIZES:-1 8 32 64} --context "$ctx" ${PROFILE:+--profile} \
      --json "$OUT/decode_${arm}_$ctx.json") 2>&1 \
      | grep -v -e Loading -e Capturing -e Warning -e warn | tee -a "$OUT/decode.log"
  done
  if [ -n "$variants" ]; then
    bg decode --models $models --batch-sizes ${VARIANT_BATCH_SIZES:-1 2 4 8} --context "$ctx" \
      --variants $variants --json "$OUT/variants_$ctx.json" | tee -a "$OUT/variants.log"
  fi
done
save_tcache
true
