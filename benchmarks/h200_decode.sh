#!/usr/bin/env bash
# Decode at the bandwidth floor (issue 19) on one H200: the skinny-GEMM sweep against cuBLAS
# (prints the SKINNY_TABLE to paste into kernels/skinny_gemm.py; GEMM=0 skips it), decode
# attention's one launch against the merge kernel's two (bench kernels), then `bench decode`
# (kernels per step and per layer, the floor, --profile) for each tree in TREES (default: this
# one; add an older checkout, e.g. TREES=". .dev/old", for before/after in one run). TESTS=1
# first runs the kernel tests. Results under ${OUT:-results}.
source "$(dirname "$0")/device_env.sh"
if [ "${TESTS:-0}" = 1 ]; then
  timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE tests/test_kernels.py \
    tests/test_gemma4_gpu.py 2>&1 | tail -8 | tee "$OUT/decode_tests.log"
fi
if [ "${GEMM:-1}" = 1 ]; then
  timeout 300 python3 -m breakgraph.bench.gemm --out "$OUT/gemm.json" 2>&1 | tee "$OUT/gemm.log" | tail -n 20
fi
timeout 120 python3 -c "
from breakgraph.bench.kernels import bench_decode
for bs, ctx in ((1, 1024), (8, 1024), (32, 8192)):
    for row in bench_decode(bs, ctx, False):
        print(row)" 2>&1 | tee "$OUT/decode_attention.log"
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
# every projection of <= 64 rows on the skinny GEMM (generic configs; the norms in front and
# gate/up's SiLU fused) and decode attention in one launch: the whole step's answer to the
# defaults (cuBLAS, the merge kernel), before the table is filled and the merge is switched
BREAKGRAPH_SKINNY=all BREAKGRAPH_DECODE_MERGE=split python3 -m breakgraph.cli bench decode --models qwen3-0.6b llama-3.1-8b \
  --batch-sizes 1 8 32 64 --context 1024 --profile --json "$OUT/decode_skinny_1024.json" 2>&1 \
  | grep -v -e Loading -e Capturing -e Warning -e warn | tee -a "$OUT/decode.log"
true
