"""Every model family on the Triton path, run by Triton's interpreter on CPU tensors, against
the same engine on the torch twins (float32): greedy tokens equal, every step's logits within
1e-5. Run as ``TRITON_INTERPRET=1 python -m tests.kernels.interpret_models [family ...]`` (the
variable must be set before Triton is imported: ``test_triton_interpret.py`` starts it so).

The CUDA-only host helpers the launchers call (device properties) are stood in for by an
H200's values; attention, norms, RoPE with the fused KV store, GeGLU/SiLU, MoE routing and
experts, DeepSeek V4's compressed attention and hyper-connections all run their Triton kernels, and "qwen2+skinny" sends every projection of at most
64 rows through the skinny GEMM (as a measured table would; the shipped table may be empty).
"""

from __future__ import annotations

import os
import sys
import tempfile

import torch

from breakgraph.engine.args import EngineArgs
from breakgraph.engine.engine import Engine
from breakgraph.engine.request import SamplingParams
from breakgraph.kernels import extend_attention, launch, ops, skinny_gemm
from tests.support.hf import LogitsTap, make_hf_model

FAMILIES = [
    "llama",
    "qwen2",
    "qwen3",
    "qwen3_moe",
    "gemma4",
    "gemma4_moe",
    "qwen2+skinny",
    "gemma4+skinny",
    "deepseek_v4",
]
# "+skinny": every projection of at most 64 rows through the skinny-GEMM kernel (split K, with
# qwen2's biases; gate/up with its SiLU or GELU in the epilogue), as a measured table would
SKINNY = skinny_gemm.SkinnyConfig(block_n=32, block_k=32, split_k=3)
ATOL = 1e-5


def stand_in_h200_host_helpers() -> None:
    torch.cuda.current_device = lambda: 0
    launch._multiprocessors = lambda index: 132
    extend_attention._capability = lambda index: (9, 0)


def tiny_checkpoint(family: str) -> str:
    path = tempfile.mkdtemp(prefix=f"interp-{family}-")
    if family == "deepseek_v4":
        from tests.support.deepseek_v4 import make_hf_deepseek_v4

        make_hf_deepseek_v4().save_pretrained(path)
    elif family.startswith("gemma4"):
        from tests.support.gemma4 import make_hf_gemma4

        make_hf_gemma4("moe" if family == "gemma4_moe" else "text").save_pretrained(path)
    else:
        make_hf_model(family).save_pretrained(path)
    return path


def _run(path: str, triton: bool):
    ops._use_triton = (lambda x: True) if triton else (lambda x: False)
    engine = Engine(
        EngineArgs(
            model_path=path, device="cpu", dtype="float32", max_total_tokens=2048,
            chunked_prefill_size=64,
        )
    )  # fmt: skip
    tap = LogitsTap(engine)
    sp = SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True)
    shared = list(range(5, 25))
    engine.generate([shared], sp)  # cached, then hit with a ragged batch
    outs = engine.generate([[*shared, 30, 31], list(range(40, 47)), [9]], sp)
    return [r.output_ids for r in outs], tap.steps


def main(families: list[str]) -> int:
    assert os.environ.get("TRITON_INTERPRET") == "1", "set TRITON_INTERPRET=1"
    stand_in_h200_host_helpers()
    table_config = skinny_gemm.table_config
    failed = 0
    for family in families:
        family, _, variant = family.partition("+")
        path = tiny_checkpoint(family)
        tokens, steps = _run(path, triton=False)
        if variant == "skinny":
            skinny_gemm.table_config = lambda m, n, k: SKINNY
        tokens_t, steps_t = _run(path, triton=True)
        skinny_gemm.table_config = table_config
        diff = max((a - b).abs().max().item() for a, b in zip(steps, steps_t, strict=True))
        ok = tokens == tokens_t and len(steps) == len(steps_t) and diff <= ATOL
        failed += not ok
        name = f"{family}+{variant}" if variant else family
        print(f"{'ok' if ok else 'FAIL'} {name}: {len(steps)} steps, max logit diff {diff:.1e}")
    return failed


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:] or FAMILIES))
