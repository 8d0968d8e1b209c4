#!/usr/bin/env bash
# session 10, final run on nvidia-h200-x2: the fused all-reduce + add + RMSNorm (check and
# per-row timing; if it fails, the rest runs with BREAKGRAPH_AR_NORM=0), llama-3.1-8b decode
# TP2 with it and without against TP1, the TP GPU tests, a TP2 server's stop time
source "$(dirname "$0")/device_env.sh"
R=/tmp/r; rm -rf $R; mkdir -p $R
timeout 90 python3 -m breakgraph.bench.allreduce --kib 8 64 512 --norm-rows 1 8 64 2>&1 | grep -v Warn | tee "$R/allreduce.log"
if [ "$(grep -c -E '^ +(1|8|64) .* True$' "$R/allreduce.log")" != 3 ]; then
  echo "fused all-reduce + norm failed: the rest without it" | tee -a "$R/allreduce.log"; export BREAKGRAPH_AR_NORM=0
fi
bg() { local t=$1; shift; timeout "$t" python3 -m breakgraph.cli bench "$@" 2>&1 | grep -v -e Loading -e Capturing -e Warning -e warn; }
for arm in ${BREAKGRAPH_AR_NORM:-1} 0; do
  echo "=== TP2 BREAKGRAPH_AR_NORM=$arm" | tee -a "$R/decode.log"
  BREAKGRAPH_AR_NORM=$arm bg 100 decode --models llama-3.1-8b --batch-sizes 1 8 32 --context 1024 \
    --profile --tp 2 --json "$R/decode_tp2_arnorm$arm.json" | tee -a "$R/decode.log"
done
echo "=== TP1" | tee -a "$R/decode.log"
bg 90 decode --models llama-3.1-8b --batch-sizes 1 8 32 --context 1024 --profile \
  --json "$R/decode_tp1.json" | tee -a "$R/decode.log"
timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE tests/test_tp_gpu.py \
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
