#!/usr/bin/env bash
# Decode at the bandwidth floor (issue 19) on one H200.
# With GEMM=1, first the skinny-GEMM sweep against cuBLAS (~5 min; GEMM_TP="1 2" adds each
# TP2 rank's shapes): it prints the SKINNY_TABLE to paste into kernels/skinny_gemm.py and
# writes it to $OUT/skinny_table.json (else the "table" arm reads TABLE, default
# .dev/skinny_table.json). Then decode attention's one launch against the merge kernel's two
# (bench kernels), then `bench decode` (kernels per step and per layer, the floor, --profile)
# in each of ARMS at each of CONTEXTS:
#   default  the code as it is
#   pdl      BREAKGRAPH_PDL=1: programmatic dependent launch of the Triton kernels at every batch
#   nopdl    BREAKGRAPH_PDL=0: at none
#   merge    BREAKGRAPH_DECODE_MERGE=split: decode attention in one launch
#   old      the checkout in OLD (default .dev/old: `git archive REV breakgraph | tar -x -C
#            .dev/old`, carried) for a before/after in one run
#   table    decode attention in one launch and the swept table (BREAKGRAPH_SKINNY=PATH)
#   all      that and every projection on generic skinny configs
# TESTS=1 first runs the kernel tests; PROFILE=1 adds --profile (GPU time by kernel kind:
# under PDL a kernel's time includes its wait for the one before).
#   OUT=$OUT [GEMM=1] [ARMS="default pdl"] [CONTEXTS="1024 8192"] [MODELS=...] \
#     [BATCH_SIZES=...] [PROFILE=1] bash benchmarks/h200_decode.sh
source "$(dirname "$0")/device_env.sh"
if [ "${TESTS:-0}" = 1 ]; then
  timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE tests/test_kernels.py \
    tests/test_gemma4_gpu.py 2>&1 | tail -8 | tee "$OUT/decode_tests.log"
fi
table=${TABLE:-.dev/skinny_table.json}
if [ "${GEMM:-0}" = 1 ]; then
  table=$OUT/skinny_table.json
  timeout 300 python3 -m breakgraph.bench.gemm --tp ${GEMM_TP:-1} --out "$OUT/gemm.json" \
    --table-out "$table" 2>&1 \
    | tee "$OUT/gemm.log" | tail -n 20
fi
timeout 120 python3 -c "
from breakgraph.bench.kernels import bench_decode
for bs, ctx in ((1, 1024), (8, 1024), (32, 8192)):
    for row in bench_decode(bs, ctx, False):
        print(row)" 2>&1 | tee "$OUT/decode_attention.log"
for ctx in ${CONTEXTS:-1024 8192}; do
  for arm in ${ARMS:-default pdl}; do
    dir=.
    case $arm in
      default) env=() ;;
      old) env=() dir=${OLD:-.dev/old} ;;
      pdl) env=(BREAKGRAPH_PDL=1) ;;
      nopdl) env=(BREAKGRAPH_PDL=0) ;;
      merge) env=(BREAKGRAPH_DECODE_MERGE=split) ;;
      table) env=(BREAKGRAPH_DECODE_MERGE=split "BREAKGRAPH_SKINNY=$table") ;;
      all) env=(BREAKGRAPH_DECODE_MERGE=split BREAKGRAPH_SKINNY=all) ;;
    esac
    echo "=== arm $arm, context $ctx: ${env[*]}" | tee -a "$OUT/decode.log"
    (cd "$dir" && env "${env[@]}" python3 -m breakgraph.cli bench decode \
      --models ${MODELS:-qwen3-0.6b llama-3.1-8b} --batch-sizes ${BATCH_SIZES:-1 8 32 64} \
      --context "$ctx" ${PROFILE:+--profile} --json "$OUT/decode_${arm}_$ctx.json") 2>&1 \
      | grep -v -e Loading -e Capturing -e Warning -e warn | tee -a "$OUT/decode.log"
  done
done
true
