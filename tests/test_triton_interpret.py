"""The Triton kernels, wired into every model family, on the CPU: Triton's interpreter runs
them on CPU tensors (``tests/interpret_models.py``), compared with the torch twins in float32.
Skipped where Triton is not installed; bfloat16 is not checked here (the interpreter does not
round like the GPU does)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="needs triton (its interpreter)"
)
ROOT = Path(__file__).resolve().parents[1]


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
    interpret("tests.interpret_models", 8)


def test_kernels_merging_in_their_last_split():
    interpret("tests.interpret_kernels", 24)
