#!/usr/bin/env bash
# session 10, run 1 on nvidia-h200-x2: the fused-copy one-shot all-reduce (tests, per size, in
# the TP2 decode step), TP2's skinny-GEMM shapes swept against cuBLAS
source "$(dirname "$0")/device_env.sh"
python3 -c "import torch; print(torch.__version__, 'copy_out', hasattr(torch.ops.symm_mem, 'one_shot_all_reduce_copy_out'))" | tee "$OUT/env.log"
timeout 100 python3 -m breakgraph.bench.allreduce --kib 8 16 64 512 4096 2>&1 | grep -v Warn | tee "$OUT/allreduce.log"
timeout 230 python3 -m pytest -v -m gpu -p no:cacheprovider -rfE --durations=5 tests/test_tp_gpu.py \
  -k "not worker_death" > "$OUT/tp_tests.log" 2>&1; tail -12 "$OUT/tp_tests.log"
bg() { python3 -m breakgraph.cli bench "$@" 2>&1 | grep -v -e Loading -e Capturing -e Warning -e warn; }
for arm in 1 0; do
  echo "=== BREAKGRAPH_AR_COPY=$arm" | tee -a "$OUT/decode.log"
  BREAKGRAPH_AR_COPY=$arm timeout 120 python3 -m breakgraph.cli bench decode --models llama-3.1-8b \
    --batch-sizes 1 8 --context 1024 --profile --tp 2 --json "$OUT/decode_tp2_copy$arm.json" 2>&1 \
    | grep -v -e Loading -e Capturing -e Warning -e warn | tee -a "$OUT/decode.log"
done
timeout 100 python3 -m breakgraph.cli bench decode --models llama-3.1-8b --batch-sizes 1 8 --context 1024 \
  --profile --json "$OUT/decode_tp1.json" 2>&1 | grep -v -e Loading -e Capturing -e Warning -e warn | tee -a "$OUT/decode.log"
timeout 150 python3 -m breakgraph.bench.gemm --models llama-3.1-8b --tp 2 --out "$OUT/gemm_tp2.json" \
  --table-out "$OUT/skinny_tp2.json" > "$OUT/gemm_tp2.log" 2>&1; tail -12 "$OUT/gemm_tp2.log"
save_tcache
true
