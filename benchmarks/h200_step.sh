#!/usr/bin/env bash
# The in-process tables on one H200 (README: "Prefill step", "Decode step"): `bench step` and
# `bench decode` for MODELS (dummy weights); results under ${OUT:-results}.
#   OUT=$OUT [MODELS="qwen3-0.6b llama-3.1-8b"] [N="256 1024 8192"] [P="0 32768"] [HF=1]
#     [COMPILE="256 1024"] [BATCH_SIZES="1 8 32 64"] [CONTEXTS="1024 8192"] [PROFILE=1]
#     bash benchmarks/h200_step.sh
# HF=1 adds the HF eager arm; COMPILE adds HF torch.compile at those N (~45 s of compiling
# each); PROFILE=1 adds --profile to both benches. A MoE model (about 61 GB of bf16 weights)
# runs the same: MODELS=qwen3-30b-a3b P=0 HF=1 (its HF twin fits beside it).
source "$(dirname "$0")/device_env.sh"
bg() { python3 -m breakgraph.cli bench "$@" 2>&1 \
  | grep -v -e Loading -e Capturing -e Warning -e warn -e "it/s"; }
models=${MODELS:-qwen3-0.6b llama-3.1-8b}
bg step --models $models -N ${N:-256 1024 8192} -P ${P:-0 32768} --reps 10 \
  $([ -n "${HF:-}" ] || echo --no-hf) --no-compile ${PROFILE:+--profile} \
  --json "$OUT/step.json" | tee "$OUT/step.log"
for ctx in ${CONTEXTS:-1024 8192}; do
  bg decode --models $models --batch-sizes ${BATCH_SIZES:-1 8 32 64} --context "$ctx" \
    ${PROFILE:+--profile} --json "$OUT/decode_$ctx.json" | tee -a "$OUT/decode.log"
done
if [ -n "${COMPILE:-}" ]; then
  bg step --models ${COMPILE_MODEL:-qwen3-0.6b} -N $COMPILE -P 0 --reps 5 --compile-timeout 150 \
    --json "$OUT/step_compile.json" | tee "$OUT/step_compile.log"
fi
save_tcache
true
