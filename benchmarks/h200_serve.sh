#!/usr/bin/env bash
# Server benches on one H200 (dummy weights; README: "Through the server"), by stage
# (default: warmup prefill); results under ${OUT:-results}. MODEL picks the shape
# (default qwen3-0.6b unless a stage says otherwise); OLD names an older checkout
# (default .dev/old: `git archive REV | tar -x -C .dev/old`, carried) for before/after arms.
#   warmup   the first 8K requests after ready on a cold Triton cache, without and with warm-up
#   prefill  cold 8192 x8 and hit 65536 x1, with prefill graphs and without
#   gemma    gemma-4-e2b: graphs on/off x KV-sharing fast prefill on/off
#   flashinfer  cold 8192 x8 and hit 65536 x1, Triton's extend attention then FlashInfer's
#   moe      qwen3-30b-a3b with and without prefill graphs
#   tp       llama-3.1-8b at TP1 and TP2 (nvidia-h200-x2)
#   serving  bench serving at CONC (default 1 8; 8K in / 256 out) on this tree, then on OLD
#   many     bench serving at CONC (default 64 128 256; 128 in / 256 out), this tree then OLD
#   host     the host path: each server workload beside the in-process step it should approach
#   coldab   cold 256 x1 on this tree and OLD, both up at once, ROUNDS alternating rounds
#            (OLD=. OLD_FLAGS="..." compares one flag on this tree)
#   spec     speculative decoding, 3.51 tokens kept a step (synthetic): in process (STANDALONE
#            with verify steps chained and not), then bench serving (8K in / SPEC_OUT out,
#            CONC) without it and per SPEC_ALGOS (MODEL default qwen3-8b, DRAFT qwen3-0.6b)
#   nextn    DeepSeek V4's MTP drafts in process (deepseek-v4-flash-e32, synthetic 3.51)
#   v4       deepseek-v4-flash-e32, prefill graphs and eager (V4_ARMS): the latency table at
#            P = 0 and 155,648, cold 8192 x8, hit 65536 x1; CONC adds the serving table;
#            V4_CUT=20 serves its first 20 layers instead (benchmarks/v4_cut.py: an H100);
#            V4_PARTS picks among latency, prefill (default both) and first8k (the warmup
#            stage on V4)
#   OUT=$OUT [MODEL=...] [OLD=...] bash benchmarks/h200_serve.sh [STAGE ...]
source "$(dirname "$0")/device_env.sh"
PORT=30111; URL=http://127.0.0.1:$PORT
log() { grep -v -e Loading -e Capturing -e Warning -e warn | tee -a "$OUT/serve.log"; }
serve() {  # serve NAME [flags]: start TREE's server (default this one), wait for /health
  local name=$1; shift
  local t0=$(date +%s)
  (cd "${TREE:-.}" && exec python3 -m breakgraph.cli serve --model-path "${MODEL:-qwen3-0.6b}" \
    --load-format dummy --port $PORT --mem-fraction-static 0.6 ${SERVE_FLAGS:-} "$@") \
    > "$OUT/server_$name.log" 2>&1 &
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
stop() { kill -TERM $SERVER 2>/dev/null; wait $SERVER; }
prefill() { python3 -m breakgraph.cli bench prefill "$@" --url $URL 2>&1 | log; }
inproc() { python3 -m breakgraph.cli bench "$@" 2>&1 | log; }
serving() {  # serving NAME IN OUT CONCURRENCY...: one round (SERVING_REQS requests a level,
  # default 4 x its concurrency)
  local name=$1 input=$2 output=$3; shift 3
  python3 -m breakgraph.cli bench serving --url $URL --concurrency "$@" --input-len "$input" \
    --output-len "$output" --rounds 1 ${SERVING_REQS:+--requests-per-level $SERVING_REQS} \
    --json "$OUT/$name.json" 2>&1 | log
}
compilations() {
  curl -s $URL/get_server_info | python3 -c "import sys,json; d=json.load(sys.stdin); print('  server info:', {k: v for k, v in d.items() if 'compil' in k or 'warmup' in k})" | log
}
first8k() {  # the first eight 8K-token prompts after ready, one at a time (a wave each)
  prefill cold 8192 1 --warmup-waves 0 --waves 8 --json "$OUT/$1.json"
  python3 -c "import json,sys; w=json.load(open(sys.argv[1]))['waves']; t=[x['ttft_ms'][0] for x in w]; \
print('  first three:', [round(x) for x in t[:3]], 'ms; first / steady (median of 4-8): %.2fx' \
% (t[0] / sorted(t[3:])[2]))" "$OUT/$1.json" | log
  compilations
}
arms() {  # arms PREFIX "NAME FLAGS" ...: cold 8192 x8 and hit 65536 x1 per server configuration
  local prefix=$1; shift
  for arm in "$@"; do
    set -- $arm; local name=$1; shift
    serve "${prefix}_$name" --context-length 70000 "$@" || continue
    prefill cold 8192 8 --json "$OUT/prefill_cold_${prefix}_$name.json"
    prefill hit 65536 1 --json "$OUT/prefill_hit_${prefix}_$name.json"
    stop
  done
}
this_and_old() {  # this_and_old FN: FN's server from this tree, then from OLD if there is
  # one (the client is this tree's for both)
  local old=${OLD:-.dev/old}
  TREE=. "$1" this
  [ -d "$old" ] && TREE=$old "$1" old
  true
}

warmup_stage() {
  export TRITON_CACHE_DIR=/tmp/triton_cold_a
  serve no_warmup --skip-server-warmup && { first8k first8k_no_warmup; stop; }
  export TRITON_CACHE_DIR=/tmp/triton_cold_b
  serve warmup && { first8k first8k_warmup; stop; }
}
prefill_stage() { arms prefill "graphs" "disabled --cuda-graph-backend-prefill disabled"; }
gemma_stage() {  # the benches' own warm-up waves stand in for the server's (four starts)
  MODEL=gemma-4-e2b SERVE_FLAGS=--skip-server-warmup arms gemma "graphs_fast" \
    "graphs_all --no-kv-sharing-fast-prefill" "eager_fast --cuda-graph-backend-prefill disabled" \
    "eager_all --cuda-graph-backend-prefill disabled --no-kv-sharing-fast-prefill"
}
flashinfer_stage() {  # the extend attention: Triton's, then FlashInfer's (carry .fi); ARMS
  # picks (default both)
  case " ${ARMS:-triton flashinfer} " in *" triton "*)
    BREAKGRAPH_EXTEND_ATTENTION=triton arms extend "triton";; esac
  case " ${ARMS:-triton flashinfer} " in *" flashinfer "*)
    BREAKGRAPH_EXTEND_ATTENTION=flashinfer arms extend "flashinfer";; esac
  save_fi_ws
}
moe_stage() { MODEL=qwen3-30b-a3b arms moe "graphs" "eager --cuda-graph-backend-prefill disabled"; }
tp_stage() { MODEL=${MODEL:-llama-3.1-8b} arms tp "tp1" "tp2 --tp 2"; }
serving_arm() {
  serve "serving_$1" --context-length 16384 || return
  serving "serving_$1_${MODEL:-qwen3-0.6b}" 8192 256 ${CONC:-1 8}
  stop
}
serving_stage() { this_and_old serving_arm; }
many_arm() {
  serve "many_$1" --context-length 4096 --max-running-requests 256 || return
  serving "many_$1_${MODEL:-qwen3-0.6b}" 128 256 ${CONC:-64 128 256}
  stop
}
many_stage() { this_and_old many_arm; }
host_stage() {  # each workload beside the in-process step of the same run
  local m=${MODEL:-qwen3-0.6b}
  inproc step --models $m -N 256 1024 8192 -P 0 65536 --reps 5 --no-hf --no-compile \
    --json "$OUT/host_step_$m.json"
  inproc decode --models $m --batch-sizes 1 8 --context 8192 --json "$OUT/host_decode_$m.json"
  serve "host_$m" --context-length 70000 || return
  first8k "host_first8k_$m"
  prefill cold 8192 8 --json "$OUT/host_cold8k_$m.json"
  prefill hit 65536 1 --json "$OUT/host_hit64k_$m.json"
  prefill cold 256 1 --json "$OUT/host_cold256_$m.json"
  serving "host_serving_$m" 8192 256 1 8
  compilations
  stop
}
coldab_stage() {  # both servers up at once (started in turn: --mem-fraction-static counts the
  # GPU memory in use), ROUNDS rounds of 10 waves alternating which goes first
  local m=${MODEL:-llama-3.1-8b} old=${OLD:-.dev/old} r p flags
  mkdir -p "$OUT/coldab"  # one tarball at the end: at most 8 files come back from the device
  inproc step --models "$m" -N 256 -P 0 --reps ${STEP_REPS:-5} --no-hf --no-compile
  local pids=()
  for arm in ". 30121 this 0.3" "$old 30122 old 0.62"; do
    set -- $arm
    flags=$([ "$3" = old ] && echo "${OLD_FLAGS:-}")
    (cd "$1" && exec python3 -m breakgraph.cli serve --model-path "$m" --load-format dummy \
      --port $2 --mem-fraction-static $4 --context-length 70000 $flags) \
      > "$OUT/server_coldab_$3.log" 2>&1 &
    pids+=($!)
    for _ in $(seq 600); do curl -sf http://127.0.0.1:$2/health >/dev/null && break; sleep 0.5; done
  done
  for r in $(seq ${ROUNDS:-8}); do
    for p in $([ $((r % 2)) = 0 ] && echo "30122 30121" || echo "30121 30122"); do
      echo "== round $r port $p ($([ $p = 30121 ] && echo this || echo old))" | tee -a "$OUT/serve.log"
      python3 -m breakgraph.cli bench prefill cold 256 1 --waves 10 --url http://127.0.0.1:$p \
        --json "$OUT/coldab/cold256_${p}_$r.json" 2>&1 | grep -E "TTFT|timeline" | tee -a "$OUT/serve.log"
    done
  done
  kill -TERM "${pids[@]}"; wait "${pids[@]}"
  (cd "$OUT" && tar czf coldab.tgz coldab && rm -rf coldab)
}
spec_stage() {  # SPEC_ALGOS picks the served arms (default STANDALONE; NGRAM too), INPROC=0
  # skips the in-process bench
  local m=${MODEL:-qwen3-8b} d=${DRAFT:-qwen3-0.6b} out=${SPEC_OUT:-1024} algo spec
  [ "${INPROC:-1}" = 0 ] || inproc spec --model-path "$m" --algorithm STANDALONE \
    --draft-model-path "$d" --input-len 8192 --output-len "$out" --draft-tokens 3 \
    --synthetic-accept-length 3.51 --unchained --device cuda --json "$OUT/spec_inproc_$m.json"
  MODEL=$m serve "spec_off_$m" --context-length 16384 \
    && { serving "spec_off_$m" 8192 "$out" ${CONC:-1 8}; stop; }
  for algo in ${SPEC_ALGOS:-STANDALONE}; do
    spec="--speculative-algorithm $algo"
    [ "$algo" = STANDALONE ] && spec="$spec --speculative-draft-model-path $d"
    BREAKGRAPH_BENCH=1 MODEL=$m serve "spec_${algo,,}_$m" --context-length 16384 $spec \
      --speculative-num-steps 3 --bench-synthetic-accept-length 3.51 \
      && { serving "spec_${algo,,}_$m" 8192 "$out" ${CONC:-1 8}; stop; }
  done
}
v4_stage() {  # deepseek-v4-flash-e32 per arm of V4_ARMS (default: prefill graphs, eager):
  # seed 003's latency table (one request, max_new_tokens 1, median of 3 after 2 warm: P = 0
  # and P = 155,648 with N = V4_N), cold 8192 x8, hit 65536 x1, and with CONC set the serving
  # table (8K in / 1K out); the arm `default` starts it at default flags (the memory test)
  local a name flags n model=deepseek-v4-flash-e32 parts=" ${V4_PARTS:-latency prefill} "
  [ -n "${V4_CUT:-}" ] && model=$(python3 benchmarks/v4_cut.py "$V4_CUT" /tmp/v4-cut-$V4_CUT)
  if [[ "$parts" == *" first8k "* ]]; then  # the warm-up stage's two cold starts, on V4
    MODEL=$model SERVE_FLAGS="--context-length 70000 --mem-fraction-static 0.9" warmup_stage
  fi
  [[ "$parts" == *" latency "* || "$parts" == *" prefill "* || -n "${CONC:-}" ]] || return 0
  for a in ${V4_ARMS:-graphs eager}; do
    if [ "$a" = default ]; then  # started at default flags, one request, the memory split
      MEMORY_TEST_MODELS=deepseek-v4-flash-e32 python3 -m pytest -s -q -m gpu \
        -p no:cacheprovider tests/engine/test_memory_gpu.py -k every_builtin 2>&1 | tail -n 4 | log
      continue
    fi
    case $a in graphs) flags="" ;; eager) flags="--cuda-graph-backend-prefill disabled" ;; esac
    MODEL=$model serve "v4_$a" --context-length 170000 \
      --mem-fraction-static 0.9 $flags || continue
    if [[ "$parts" == *" latency "* ]]; then
      for n in ${V4_N:-256 1024 8000}; do  # the 155,648-token prefix is prefilled once
        prefill hit 155648 1 --hit-new-tokens $n --keep-cache --warmup-waves 2 --waves 3 \
          --json "$OUT/v4_${a}_hit155648_$n.json"
      done
      for n in ${V4_N:-256 1024 8000}; do
        prefill cold $n 1 --warmup-waves 2 --waves 3 --json "$OUT/v4_${a}_cold_$n.json"
      done
    fi
    if [[ "$parts" == *" prefill "* ]]; then
      prefill cold 8192 8 --json "$OUT/v4_${a}_cold8192x8.json"
      prefill hit 65536 1 --json "$OUT/v4_${a}_hit65536.json"
    fi
    [ -n "${CONC:-}" ] && serving "v4_serving_$a" 8192 1024 $CONC
    compilations
    stop
  done
}
nextn_stage() {
  inproc spec --model-path deepseek-v4-flash-e32 --algorithm NEXTN --input-len 8192 \
    --output-len ${SPEC_OUT:-1024} --draft-tokens 3 --synthetic-accept-length 3.51 \
    --device cuda --json "$OUT/spec_inproc_nextn.json"
}
stages=${*:-warmup prefill}
for stage in $stages; do "${stage}_stage"; done
save_tcache
true
