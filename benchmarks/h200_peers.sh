#!/usr/bin/env bash
# breakgraph beside vLLM 0.25.1 (`bench peers`) on one GPU machine, in calls that each fit a
# transfer: the vLLM tree's parts (../shared/peers/vllm/build.sh .dev/peer) travel a few per
# call, carried by path, and wait in /tmp/peer-parts while the machine is kept (back to back
# calls); once every part of the tree is there it is unpacked and, with MODELS set, measured.
#   call 1: carry .dev/peer/vllm-site.tar.xz.part0 .dev/peer/vllm-site.tar.xz.part1
#           bash benchmarks/h200_peers.sh                       (about 62 MB: no .whl)
#   call 2: carry .whl .dev/peer/vllm-site.tar.xz.part2 .dev/peer/vllm-site.tar.xz.part3
#           OUT=$OUT MODELS=qwen3-0.6b bash benchmarks/h200_peers.sh
#   MoE models first bring the MoE library: carry .dev/peer/moe_C.so.xz.part0 and part1
#   (39 MB, with .whl in a later call). ARGS adds flags to `bench peers` (README: one model per
#   call; `--concurrency` with no value skips the serving table, `--rounds 1`); PROFILE="cold
#   8192 8" profiles one more wave of it on each engine (--profile; the traces stay in /tmp/peers).
#   Gemma 4: vLLM 0.25.1 reads its config under transformers 5.14.1 and tokenizers 0.22.2 (5.15
#   on refuse it), first on its path: carry .peer-tf too, made by `pip download --no-deps
#   --only-binary=:all: --python-version 3.12 transformers==5.14.1 tokenizers==0.22.2 -d
#   .peer-tf`. Its FA4 kernels for Gemma 4 need the CUTLASS DSL, not in the tree: bench peers
#   then runs vLLM's Triton attention (--attention-backend TRITON_ATTN, printed with the command).
#   breakgraph's prefill attention on FlashInfer (its default where installed): carry .fi in a
#   call of its own or beside parts 2 and 3 (without .whl); what a call carries is unpacked
#   (device_env.sh) and stays in /tmp while the machine is kept. Untried: vLLM's PYTHONPATH then
#   has the pruned FlashInfer too, after its own tree.
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
mkdir -p /tmp/peer-parts
cp -n .dev/peer/*.part* /tmp/peer-parts/ 2>/dev/null
ls /tmp/peer-parts
site=/tmp/vllm-site
need=4  # vllm-site.tar.xz.part0..3 (build.sh of vLLM 0.25.1)
have=$(ls /tmp/peer-parts/vllm-site.tar.xz.part* 2>/dev/null | wc -l)
if [ ! -d "$site/site/vllm" ]; then
  if [ "$have" -lt "$need" ]; then
    echo "h200_peers: $have of $need parts of the vLLM tree here; carry the rest next call"
    exit 0
  fi
  mkdir -p "$site" && cat /tmp/peer-parts/vllm-site.tar.xz.part* | xz -dc | tar -x -C "$site" \
    || { echo "h200_peers: the vLLM tree did not unpack"; rm -rf "$site"; exit 1; }
fi
moe=$site/site/vllm/_moe_C_stable_libtorch.abi3.so
if [ ! -f "$moe" ] && [ "$(ls /tmp/peer-parts/moe_C.so.xz.part* 2>/dev/null | wc -l)" -ge 2 ]; then
  cat /tmp/peer-parts/moe_C.so.xz.part* | xz -dc > "$moe" || rm -f "$moe"
fi
[ -z "${MODELS:-}" ] && { echo "h200_peers: the vLLM tree is ready; set MODELS to measure"; exit 0; }
# Gemma 4 under vLLM 0.25.1 needs transformers 5.14.1 and tokenizers 0.22.2 first on its path:
# carry .peer-tf (their wheels) in the call that measures it
if compgen -G ".peer-tf/*.whl" > /dev/null && [ ! -d /tmp/vllm-tf/transformers ]; then
  python3 -m pip install -q --no-deps --no-index --target /tmp/vllm-tf .peer-tf/*.whl
fi
for m in $MODELS; do
  extra=()
  case $m in gemma-4*) [ -d /tmp/vllm-tf/transformers ] && extra=(--vllm-extra-path /tmp/vllm-tf);; esac
  python3 -m breakgraph.cli bench peers --models "$m" --log-dir /tmp/peers ${ARGS:-} "${extra[@]}" \
    ${PROFILE:+--profile "$PROFILE"} \
    --json "$OUT/peers-$m.json" --plot "$OUT/peers-$m.png" 2>&1 \
    | grep -v -e Loading -e Capturing -e "it/s" | tee -a "$OUT/peers.log"
done
grep -h -E "ERROR|Error" /tmp/peers/*.log 2>/dev/null | tail -n 5 | cut -c1-300
