#!/usr/bin/env bash
# The fused all-reduce + residual add + RMSNorm on nvidia-h200-x2 (not yet run on two GPUs:
# the x2 was withdrawn before it ran, 2026-12-01): its check and per-row timing against the
# one-shot all-reduce then the norm kernel (bench.allreduce); if that passes, llama-3.1-8b
# decode at TP2 with the norms reducing (BREAKGRAPH_AR_NORM=1) and without, against TP1,
# and the TP GPU tests with it on; then a TP2 server's stop time (the engine process exits
# without tearing the TP group down). Results in $OUT/r.tgz.
source "$(dirname "$0")/device_env.sh"
R=/tmp/r; rm -rf $R; mkdir -p $R
timeout 90 python3 -m breakgraph.bench.allreduce --kib 8 64 512 --norm-rows 1 8 64 2>&1 | grep -v Warn | tee "$R/allreduce.log"
on=1
if [ "$(grep -c -E '^ +(1|8|64) .* True$' "$R/allreduce.log")" != 3 ]; then
  echo "fused all-reduce + norm failed: the rest without it" | tee -a "$R/allreduce.log"; on=0
fi
bg() { local t=$1; shift; timeout "$t" python3 -m breakgraph.cli bench "$@" 2>&1 | grep -v -e Loading -e Capturing -e Warning -e warn; }
for arm in $([ $on = 1 ] && echo 1) 0; do
  echo "=== TP2 BREAKGRAPH_AR_NORM=$arm" | tee -a "$R/decode.log"
  BREAKGRAPH_AR_NORM=$arm bg 100 decode --models llama-3.1-8b --batch-sizes 1 8 32 --context 1024 \
    --profile --tp 2 --json "$R/decode_tp2_arnorm$arm.json" | tee -a "$R/decode.log"
done
echo "=== TP1" | tee -a "$R/decode.log"
bg 90 decode --models llama-3.1-8b --batch-sizes 1 8 32 --context 1024 --profile \
  --json "$R/decode_tp1.json" | tee -a "$R/decode.log"
BREAKGRAPH_AR_NORM=$on timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE tests/test_tp_gpu.py \
  -k "not worker_death" > "$R/tp_tests.log" 2>&1; tail -4 "$R/tp_tests.log"
python3 -m breakgraph.cli serve --model-path llama-3.1-8b --load-format dummy --port 30111 --tp 2 \
  --mem-fraction-static 0.6 --skip-server-warmup > "$R/server_tp2.log" 2>&1 &
S=$!
for _ in $(seq 240); do curl -sf http://127.0.0.1:30111/health >/dev/null && break; sleep 0.5; done
python3 -m breakgraph.cli bench prefill cold 8192 8 --url http://127.0.0.1:30111 2>&1 | grep -v Warn | tee -a "$R/serve.log"
t0=$(date +%s%N); kill -TERM $S; wait $S; rc=$?
echo "TP2 server stopped in $(( ($(date +%s%N) - t0) / 1000000 )) ms, rc $rc" | tee -a "$R/serve.log"
sleep 1; echo "left: $(pgrep -f 'breakgraph' | wc -l) breakgraph processes" | tee -a "$R/serve.log"
tar czf "$OUT/r.tgz" -C /tmp r
true
