"""The Triton kernels, wired into every model family, on the CPU: Triton's interpreter runs
them on CPU tensors (``tests/kernels/interpret_models.py``), compared with the torch twins in
float32. Skipped where Triton is not installed; bfloat16 is not checked here (the interpreter
does not round like the GPU does)."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="needs triton (its interpreter)"
)
ROOT = Path(__file__).resolve().parents[2]


def interpret(module: str, expected: int) -> None:
    """Run ``python -m module`` under the interpreter: ``expected`` lines, each "ok"."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    out = subprocess.run(
        [sys.executable, "-m", module], capture_output=True, text=True, timeout=900, env=env,
        cwd=ROOT,
    )  # fmt: skip
    lines = [line for line in out.stdout.splitlines() if line.startswith(("ok", "FAIL"))]
    assert out.returncode == 0 and len(lines) == expected, out.stdout + out.stderr[-3000:]


def test_every_family_on_the_triton_path_equals_the_twins():
    interpret("tests.kernels.interpret_models", 9)


def test_split_kernels_equal_the_twins():
    interpret("tests.kernels.interpret_kernels", 85)


def test_compressed_attention_kernels_equal_the_torch_versions():
    interpret("tests.kernels.interpret_compressed", 37)


def test_hyper_connection_kernels_equal_the_twins():
    interpret("tests.kernels.interpret_hyper", 9)


def test_fused_moe_launch_variants():
    interpret("tests.kernels.interpret_moe", 62)


@pytest.mark.parametrize(("skinny", "most"), [("off", 26), ("all", 20)])
def test_decode_step_kernel_count_does_not_grow(skinny, most):
    """Kernels one Qwen3 decode step launches on the Triton path (tiny model, 2 layers; the
    interpreter counts them, ``decode_kernel_count.py``): 26 on cuBLAS, 20 with every
    projection on the skinny GEMM (the norms and gate/up's SiLU fused into it). A change that
    adds launches to the decode graph fails here first."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "BREAKGRAPH_SKINNY": skinny}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    out = subprocess.run(
        [sys.executable, "-m", "tests.kernels.decode_kernel_count", "qwen3"], capture_output=True,
        text=True, timeout=600, env=env, cwd=ROOT,
    )  # fmt: skip
    found = re.search(r"qwen3 +2 layers: (\d+) kernels per decode step", out.stdout)
    assert out.returncode == 0 and found, out.stdout + out.stderr[-3000:]
    assert int(found.group(1)) <= most, out.stdout


def test_deepseek_v4_decode_step_kernel_count_does_not_grow():
    """DeepSeek V4's decode step on the Triton path (tiny model, 4 layers): 192 kernels, 48
    a layer (150 before its norms, its interleaved RoPE, its clamped SwiGLU and a
    compressor's logits became one kernel each, a norm + RoPE + store one kernel, and its
    routed experts took the MoE GEMV path; at 43 layers a step's launches pace its graph).
    Counted in float32, where casts to the model's dtype are no kernels: in bfloat16 the
    pooled entries' cast (in the store kernel) and the indexer weights' cast and scale (in
    the scores kernel) are three fewer a CSA layer and one an HCA layer besides, and each
    hyper-connection site's mixes (a kernel and its split's sum, counted here) replaced the
    streams' float32 copy and a GEMM (one kernel here: the copy is none in float32)."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    out = subprocess.run(
        [sys.executable, "-m", "tests.kernels.decode_kernel_count", "deepseek_v4"],
        capture_output=True, text=True, timeout=900, env=env, cwd=ROOT,
    )  # fmt: skip
    found = re.search(r"deepseek_v4 +4 layers: (\d+) kernels per decode step", out.stdout)
    assert out.returncode == 0 and found, out.stdout + out.stderr[-3000:]
    assert int(found.group(1)) <= 192, out.stdout
