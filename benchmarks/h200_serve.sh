#!/usr/bin/env bash
# Server benches on one H200 (dummy weights): prefill cold/hit with and without prefill graphs
# (Qwen3-0.6B shape), and the first 8K requests after ready with and without warm-up on a cold
# Triton cache. Stages: warmup, prefill (default both); gemma: gemma-4-e2b in four arms, graphs
# on/off x KV-sharing fast prefill on/off (issue 12); moe: qwen3-30b-a3b with and without
# prefill graphs (issue 13); tp: llama-3.1-8b at TP1 and TP2 (issue 17); decode: bench serving
# at concurrency 1 and 8, this tree and an older one (issue 19); many: bench serving at
# concurrency 64-256, this tree and an older one; host: the host path around the forward (issue 14), the server's
# workloads beside the in-process steps they should approach, in one run (MODEL picks the
# shape, qwen3-0.6b by default); coldab: cold 256 x1 on this tree and an older one, both up at
# once, in alternating rounds; evictab: TTFT with the prefix cache full, this tree and an older
# one. Results under ${OUT:-results}.
source "$(dirname "$0")/device_env.sh"
PORT=30111; URL=http://127.0.0.1:$PORT
serve() {  # serve NAME [flags]: start, wait for /health, record startup seconds
  local name=$1; shift
  local t0=$(date +%s)
  # PROFILE=1: py-spy (carried in .whl) samples the API and engine processes, collapsed
  # stacks in $OUT/pyspy_NAME.txt (written when the server exits); PROFILE=workloads: see
  # spy_on
  local spy=()
  if [ "${PROFILE:-}" = 1 ] && [ -x /tmp/site/bin/py-spy ]; then
    spy=(/tmp/site/bin/py-spy record --subprocesses --rate 500 --format raw -o "$OUT/pyspy_$name.txt" --)
  fi
  "${spy[@]}" python3 -m breakgraph.cli serve --model-path "${MODEL:-qwen3-0.6b}" --load-format dummy \
    --port $PORT --mem-fraction-static 0.6 ${SERVE_FLAGS:-} "$@" > "$OUT/server_$name.log" 2>&1 &
  SERVER=$!
  for _ in $(seq 1200); do
    curl -sf $URL/health >/dev/null && break
    if ! kill -0 $SERVER 2>/dev/null; then  # died starting: say why, skip the stage's benches
      echo "$name: server exited: $(tail -1 "$OUT/server_$name.log")" | tee -a "$OUT/serve.log"
      return 1
    fi
    sleep 0.5
  done
  echo "$name: ready after $(( $(date +%s) - t0 )) s" | tee -a "$OUT/serve.log"
}
stop() {  # the server itself (under py-spy: its child), then wait for py-spy to write
  local pid; pid=$(pgrep -P $SERVER -f "breakgraph.cli serve" || echo $SERVER)
  kill -TERM $pid 2>/dev/null; wait $SERVER
}
first3() {  # time the first three 8K-token requests after ready (and five more: steady)
  # one client, built before the timing: httpx.post() builds one per call (an SSL context,
  # 25-100 ms), which the earlier runs of this stage timed along with the server
  python3 - "$URL" <<'PY' | tee -a "$OUT/serve.log"
import sys, time, random, statistics, httpx
url = sys.argv[1]
with httpx.Client(timeout=600) as client:
    times = []
    for i in range(8):
        ids = [random.randrange(1000, 120000) for _ in range(8192)]
        body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0, "ignore_eos": True}}
        t = time.perf_counter()
        r = client.post(url + "/generate", json=body)
        times.append(1e3 * (time.perf_counter() - t))
        if i < 3:
            print(f"  8K request {i + 1}: {times[-1]:.0f} ms (status {r.status_code})")
    steady = statistics.median(times[3:])
    print(f"  8K steady (median of requests 4-8): {steady:.0f} ms; first / steady {times[0] / steady:.2f}x")
PY
  compilations
}
bench() { python3 -m breakgraph.cli bench prefill "$@" --url $URL 2>&1 | grep -v -e Warning | tee -a "$OUT/serve.log"; }
SPIES=()
spy_on() {  # spy_on NAME: PROFILE=workloads samples the engine and API processes (py-spy
  # --pid, 1 kHz) during one workload only, into $OUT/pyspy_NAME_{engine,api}.txt (collapsed
  # stacks, written at spy_off); rank them with benchmarks/pyspy_top.py. More than 8 files do
  # not come back from the device: tar them.
  [ "${PROFILE:-}" = workloads ] && [ -x /tmp/site/bin/py-spy ] || return 0
  local name=$1 engine
  engine=$(curl -s $URL/get_server_info | python3 -c "import sys,json; print(json.load(sys.stdin)['engine_pid'])")
  # the API process spawned the engine (SERVER may be a launcher in front of it)
  for who in "engine $engine" "api $(ps -o ppid= -p "$engine" | tr -d ' ')"; do
    set -- $who
    /tmp/site/bin/py-spy record --pid "$2" --rate 1000 --format raw \
      -o "$OUT/pyspy_${name}_$1.txt" > "$OUT/pyspy_log_$1.txt" 2>&1 &
    SPIES+=($!)
  done
  sleep 1  # attached before the workload starts
}
spy_off() {
  [ ${#SPIES[@]} -gt 0 ] || return 0
  kill -INT "${SPIES[@]}" 2>/dev/null; wait "${SPIES[@]}" 2>/dev/null; SPIES=()
}
inproc() { python3 -m breakgraph.cli bench "$@" 2>&1 | grep -v -e Loading -e Capturing -e Warning -e warn | tee -a "$OUT/serve.log"; }
compilations() {
  curl -s $URL/get_server_info | python3 -c "import sys,json; d=json.load(sys.stdin); print('  server info:', {k: v for k, v in d.items() if 'compil' in k or 'warmup' in k or 'gc_' in k})" | tee -a "$OUT/serve.log"
}

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
arms() {  # arms PREFIX "NAME FLAGS" ...: cold 8192 x8 and hit 65536 x1 per server configuration
  local prefix=$1; shift
  for arm in "$@"; do
    set -- $arm; local name=$1; shift
    serve "${prefix}_$name" --context-length 70000 "$@" || continue
    bench cold 8192 8 --json "$OUT/prefill_cold_${prefix}_$name.json"
    bench hit 65536 1 --json "$OUT/prefill_hit_${prefix}_$name.json"
    stop
  done
}
gemma_stage() {
  # the benches' own warm-up waves stand in for the server's warm-up (four starts fit one run)
  MODEL=gemma-4-e2b SERVE_FLAGS=--skip-server-warmup arms gemma "graphs_fast" "graphs_all --no-kv-sharing-fast-prefill" \
    "eager_fast --cuda-graph-backend-prefill disabled" \
    "eager_all --cuda-graph-backend-prefill disabled --no-kv-sharing-fast-prefill"
}
tp_stage() {  # issue 17: llama-3.1-8b at TP1 and TP2 (needs nvidia-h200-x2)
  MODEL=${MODEL:-llama-3.1-8b} arms tp "tp1" "tp2 --tp 2"
}
moe_stage() {
  MODEL=qwen3-30b-a3b arms moe "graphs" "eager --cuda-graph-backend-prefill disabled"
}
serving() {  # serving NAME: concurrency 1 and 8, 8K in / 256 out, one round
  python3 -m breakgraph.cli bench serving --url $URL --concurrency 1 8 --input-len 8192 \
    --output-len 256 --rounds 1 --json "$OUT/$1.json" 2>&1 | tee -a "$OUT/serve.log"
}
host_stage() {  # issue 14's ratios: server workloads against in-process steps of the same run
  local m=${MODEL:-qwen3-0.6b}
  inproc step --models $m -N 256 1024 8192 -P 0 65536 --reps 5 --no-hf --no-compile \
    --json "$OUT/host_step_$m.json"
  inproc decode --models $m --batch-sizes 1 8 --context 8192 --json "$OUT/host_decode_$m.json"
  serve "host_$m" --context-length 70000 || return
  first3
  spy_on cold8k; bench cold 8192 8 --json "$OUT/host_cold8k_$m.json"; spy_off
  spy_on hit64k; bench hit 65536 1 --json "$OUT/host_hit64k_$m.json"; spy_off
  spy_on cold256; bench cold 256 1 --json "$OUT/host_cold256_$m.json"; spy_off
  python3 benchmarks/client_overhead.py --url $URL 2>&1 | tee -a "$OUT/serve.log"  # the client's share
  serving "host_serving_$m"
  compilations
  stop
  [ -n "${SKIP_NO_OVERLAP:-}" ] && return  # SKIP_NO_OVERLAP=1: without the overlap arm
  serve "host_${m}_no_overlap" --context-length 70000 --disable-overlap-schedule || return
  serving "host_serving_${m}_no_overlap"
  stop
}
decode_stage() {  # issue 19: bench serving at concurrency 1 and 8 against this tree, then
  # against an older checkout (OLD, default .dev/old: `git archive REV breakgraph | tar -x -C
  # .dev/old`, carried) when there is one: decode's before and after in one run
  local m=${MODEL:-qwen3-0.6b}
  serve "decode_$m" --context-length 16384 || return
  serving "decode_serving_$m"
  stop
  local old=${OLD:-.dev/old}
  [ -d "$old" ] || return
  pushd "$old" >/dev/null || return
  serve "decode_old_$m" --context-length 16384 && { serving "decode_serving_old_$m"; stop; }
  popd >/dev/null
}
many_stage() {  # the host path at high concurrency (issue 14; the fourteenth session's
  # CPU-measured changes): bench serving at concurrency 64, 128 and 256 (CONC), 128 in / 256
  # out, this tree, then OLD (default .dev/old) when there is one
  local m=${MODEL:-qwen3-0.6b} old=${OLD:-.dev/old} tree name
  for tree in . "$old"; do
    [ -d "$tree" ] || continue
    name=many_$([ "$tree" = . ] && echo this || echo old)_${m##*/}
    pushd "$tree" >/dev/null || continue
    serve "$name" --context-length 4096 --max-running-requests 256
    local up=$?
    popd >/dev/null  # the client is this tree's for both servers
    if [ $up = 0 ]; then
      python3 -m breakgraph.cli bench serving --url $URL --concurrency ${CONC:-64 128 256} \
        --input-len 128 --output-len 256 --rounds 1 --json "$OUT/$name.json" 2>&1 \
        | tee -a "$OUT/serve.log"
      stop
    fi
  done
}
coldab_stage() {  # cold 256 x1 (issue 14's last goal) on this tree and OLD (default .dev/old),
  # both up at once (started in turn: --mem-fraction-static counts the GPU memory in use),
  # ROUNDS rounds of 10 waves alternating which goes first; then the client's share of the
  # TTFT on each (aiohttp, httpx and a raw socket); MODEL default llama-3.1-8b; OLD=. with
  # OLD_FLAGS (e.g. "--idle-spin-ms 0") compares one flag on this tree
  local m=${MODEL:-llama-3.1-8b} old=${OLD:-.dev/old} r p flags
  mkdir -p "$OUT/coldab"  # one tarball at the end: at most 8 files come back from the device
  python3 -m breakgraph.cli bench step --models "$m" -N 256 -P 0 --reps ${STEP_REPS:-5} --no-hf \
    --no-compile 2>&1 | grep -E "graphs|breakable|floor|eager" | tee -a "$OUT/serve.log"
  for arm in ". 30121 this 0.3" "$old 30122 old 0.62"; do
    set -- $arm
    flags=$([ "$3" = old ] && echo "${OLD_FLAGS:-}")
    (cd "$1" && python3 -m breakgraph.cli serve --model-path "$m" --load-format dummy --port $2 \
      --mem-fraction-static $4 --context-length 70000 $flags > "$OUT/server_coldab_$3.log" 2>&1) &
    for _ in $(seq 600); do curl -sf http://127.0.0.1:$2/health >/dev/null && break; sleep 0.5; done
  done
  for r in $(seq ${ROUNDS:-8}); do
    for p in $([ $((r % 2)) = 0 ] && echo "30122 30121" || echo "30121 30122"); do
      echo "== round $r port $p ($([ $p = 30121 ] && echo this || echo old))" | tee -a "$OUT/serve.log"
      python3 -m breakgraph.cli bench prefill cold 256 1 --waves 10 --url http://127.0.0.1:$p \
        --json "$OUT/coldab/cold256_${p}_$r.json" 2>&1 | grep -E "TTFT|timeline" | tee -a "$OUT/serve.log"
    done
  done
  for p in 30121 30122; do
    echo "== client overhead, port $p" | tee -a "$OUT/serve.log"
    python3 benchmarks/client_overhead.py --url http://127.0.0.1:$p --requests 120 --tokens 256 \
      2>&1 | tail -3 | tee -a "$OUT/serve.log"
  done
  pkill -TERM -f "port 3012[12]"; sleep 3
  (cd "$OUT" && tar czf coldab.tgz coldab && rm -rf coldab)
}
evictab_stage() {  # TTFT with the prefix cache full (every prompt evicts; issue 14) on this
  # tree and OLD (default .dev/old), both up at once: benchmarks/evict_serve.py, MODEL default
  # qwen3-0.6b, POOL tokens each (default 262144: about 4,000 cached 64-id prompts)
  local m=${MODEL:-qwen3-0.6b} old=${OLD:-.dev/old}
  for arm in ". 30121 this" "$old 30122 old"; do
    set -- $arm
    (cd "$1" && python3 -m breakgraph.cli serve --model-path "$m" --load-format dummy --port $2 \
      --mem-fraction-static 0.3 --max-total-tokens ${POOL:-262144} > "$OUT/server_evictab_$3.log" 2>&1) &
  done
  for p in 30121 30122; do
    for _ in $(seq 600); do curl -sf http://127.0.0.1:$p/health >/dev/null && break; sleep 0.5; done
  done
  python3 benchmarks/evict_serve.py http://127.0.0.1:30121 http://127.0.0.1:30122 --tokens 64 \
    --requests 25 --rounds ${ROUNDS:-4} 2>&1 | tee -a "$OUT/serve.log"
  pkill -TERM -f "port 3012[12]"; sleep 3
}
stages=${*:-warmup prefill}
for stage in $stages; do "${stage}_stage"; done
