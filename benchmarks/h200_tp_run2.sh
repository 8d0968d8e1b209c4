#!/usr/bin/env bash
# session 10, run 2 on nvidia-h200-x2: the all-reduce paths per size (fixed bench), the table
# and all-reduce tests, llama-3.1-8b decode TP1 vs TP2 with the TP2 table (worker trace), a
# py-spy of the TP2 decode bench's processes (where the host time of a step goes)
source "$(dirname "$0")/device_env.sh"
R=/tmp/r; rm -rf $R; mkdir -p $R
[ "${SKIP_AR:-0}" = 1 ] || timeout 60 python3 -m breakgraph.bench.allreduce --kib 8 16 64 512 4096 2>&1 | grep -v Warn | tee "$R/allreduce.log"
[ "${SKIP_AR:-0}" = 1 ] || timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE tests/test_tp_gpu.py tests/test_kernels.py \
  -k "bitwise or skinny_table" > "$R/tests.log" 2>&1; tail -4 "$R/tests.log"
bg() { local t=$1; shift; timeout "$t" python3 -m breakgraph.cli bench "$@" 2>&1 | grep -v -e Loading -e Capturing -e Warning -e warn; }
BREAKGRAPH_TP_TRACE=1 bg 120 decode --models llama-3.1-8b --batch-sizes 1 8 32 --context 1024 \
  --profile --tp 2 --json "$R/decode_tp2.json" | tee -a "$R/decode.log"
bg 100 decode --models llama-3.1-8b --batch-sizes 1 8 32 --context 1024 --profile \
  --json "$R/decode_tp1.json" | tee -a "$R/decode.log"
if [ "${SKIP_AR:-0}" != 1 ] && [ -x /tmp/site/bin/py-spy ]; then
  timeout 150 /tmp/site/bin/py-spy record --subprocesses --nonblocking --rate 500 --format raw \
    -o "$R/pyspy_tp2_decode.txt" -- python3 -m breakgraph.cli bench decode --models llama-3.1-8b \
    --batch-sizes 1 --context 1024 --tp 2 --reps 400 > "$R/pyspy_run.log" 2>&1
  tail -2 "$R/pyspy_run.log"
fi
tar czf "$OUT/r.tgz" -C /tmp r
save_tcache
true
