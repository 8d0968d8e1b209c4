#!/usr/bin/env bash
# Server benches on one H200 (Qwen3-0.6B shape, dummy weights): prefill cold/hit with and
# without prefill graphs, and the first 8K requests after ready with and without warm-up on a
# cold Triton cache. Stages: warmup, prefill (default both). Results under ${OUT:-results}.
source "$(dirname "$0")/device_env.sh"
PORT=30111; URL=http://127.0.0.1:$PORT
serve() {  # serve NAME [flags]: start, wait for /health, record startup seconds
  local name=$1; shift
  local t0=$(date +%s)
  python3 -m breakgraph.cli serve --model-path qwen3-0.6b --load-format dummy --port $PORT \
    --mem-fraction-static 0.6 "$@" > "$OUT/server_$name.log" 2>&1 &
  SERVER=$!
  for _ in $(seq 600); do curl -sf $URL/health >/dev/null && break; sleep 0.5; done
  echo "$name: ready after $(( $(date +%s) - t0 )) s" | tee -a "$OUT/serve.log"
}
stop() { kill -TERM $SERVER; wait $SERVER; }
first3() {  # time the first three 8K-token requests after ready
  for i in 1 2 3; do
    python3 - "$URL" "$i" <<'PY' | tee -a "$OUT/serve.log"
import sys, time, random, httpx
url, i = sys.argv[1], sys.argv[2]
ids = [random.randrange(1000, 120000) for _ in range(8192)]
t = time.perf_counter()
r = httpx.post(url + "/generate", json={"input_ids": ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0, "ignore_eos": True}}, timeout=600)
print(f"  8K request {i}: {1e3 * (time.perf_counter() - t):.0f} ms (status {r.status_code})")
PY
  done
  curl -s $URL/get_server_info | python3 -c "import sys,json; d=json.load(sys.stdin); print('  server info:', {k: v for k, v in d.items() if 'compil' in k or 'warmup' in k})" | tee -a "$OUT/serve.log"
}
bench() { python3 -m breakgraph.cli bench prefill "$@" --url $URL 2>&1 | grep -v -e Warning | tee -a "$OUT/serve.log"; }

warmup_stage() {  # first 8K requests after ready, cold Triton cache, without and with warm-up
  export TRITON_CACHE_DIR=/tmp/triton_cold_a
  serve no_warmup --skip-server-warmup; first3; stop
  export TRITON_CACHE_DIR=/tmp/triton_cold_b
  serve warmup; first3; stop
}
prefill_stage() {  # prefill cold/hit, with prefill graphs and without
  serve graphs --context-length 70000
  bench cold 8192 8 --json "$OUT/prefill_cold_graphs.json"
  bench hit 65536 1 --json "$OUT/prefill_hit_graphs.json"
  stop
  serve disabled --context-length 70000 --cuda-graph-backend-prefill disabled
  bench cold 8192 8 --json "$OUT/prefill_cold_disabled.json"
  bench hit 65536 1 --json "$OUT/prefill_hit_disabled.json"
  stop
}
stages=${*:-warmup prefill}
for stage in $stages; do "${stage}_stage"; done
