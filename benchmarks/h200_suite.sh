#!/usr/bin/env bash
# The GPU suite on one H200, in one process, the way it found its bugs: the graph address
# guard and debug mode on, faulthandler dumps after 100 s in a test (each test also waits
# for its GPU work in teardown: tests/conftest.py), nvidia-smi sampled every 10 s.
#   OUT=$OUT [FILES="tests/..."] [T=570] bash benchmarks/h200_suite.sh
# Triton's cache travels between sessions (device_env.sh): this run leaves it in $OUT as
# tcache.tgz.NN parts; copy them to .tcache/ and carry .tcache next time.
source "$(dirname "$0")/device_env.sh"
# The engine, graph and server tests first: a run the time limit cuts (on a cold Triton cache
# the kernel tests' config variants take minutes of compiling) has still covered them.
# (tests/engine/test_memory_gpu.py starts every built-in config: a call of its own; so does
# tests/kernels/test_flashinfer_extend.py, with .fi carried: FlashInfer builds its variants)
FILES=${FILES:-tests/graph/test_graph.py tests/graph/test_graph_memory.py \
  tests/graph/test_shared_outputs_gpu.py tests/cache/test_kv_pool.py \
  tests/engine/test_engine_gpu.py tests/engine/test_speculative_gpu.py \
  tests/engine/test_grammar_gpu.py tests/models/test_gemma4_gpu.py \
  tests/models/test_deepseek_v4_gpu.py tests/models/test_deepseek_v4_graphs_gpu.py \
  tests/engine/test_moe_engine_gpu.py tests/server/test_server_input.py \
  tests/server/test_server_text.py tests/kernels/test_kernels.py tests/kernels/test_fused_moe.py \
  tests/kernels/test_compressed_attention.py tests/kernels/test_hyper_connection.py}
L=$OUT/suite.log
(nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv -l 10 > "$OUT/smi.log" 2>&1 &)
s=$(date +%s)
# XDIST=N (pytest-xdist in .whl: ../shared/device/wheels.sh pytest-xdist execnet): the tests
# spread over N processes, so Triton compiles on N cores (a cold cache's suite takes three
# calls on one); test_graph_memory.py, which reads the device's free memory, runs alone after.
XD=() SERIAL=""
if [ "${XDIST:-0}" -gt 0 ]; then
  XD=(-n "$XDIST" --dist load)
  case " $FILES " in *" tests/graph/test_graph_memory.py "*)
    FILES=${FILES/tests\/graph\/test_graph_memory.py/}; SERIAL=tests/graph/test_graph_memory.py;; esac
fi
BREAKGRAPH_GRAPH_GUARD=1 BREAKGRAPH_GRAPH_DEBUG=1 timeout -k 5 "${T:-570}" python3 -m pytest -v -m gpu \
  -p no:cacheprovider -rfE --durations=40 -o faulthandler_timeout=100 "${XD[@]}" $FILES \
  > "$L" 2>&1
echo "=== rc=$? in $(( $(date +%s) - s )) s" >> "$L"
if [ -n "$SERIAL" ]; then
  BREAKGRAPH_GRAPH_GUARD=1 BREAKGRAPH_GRAPH_DEBUG=1 timeout -k 5 120 python3 -m pytest -v -m gpu \
    -p no:cacheprovider -rfE -o faulthandler_timeout=100 "$SERIAL" >> "$L" 2>&1
  echo "=== serial rc=$? in $(( $(date +%s) - s )) s" >> "$L"
fi
save_tcache
grep -E "FAILED|ERROR|Timeout|rc=|passed|failed" "$L" | tail -n 40 | cut -c1-200
