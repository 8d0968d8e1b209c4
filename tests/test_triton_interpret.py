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


def test_every_family_on_the_triton_path_equals_the_twins():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    out = subprocess.run(
        [sys.executable, "-m", "tests.interpret_models"],
        capture_output=True, text=True, timeout=900, env=env, cwd=ROOT,
    )  # fmt: skip
    lines = [line for line in out.stdout.splitlines() if line.startswith(("ok", "FAIL"))]
    assert out.returncode == 0 and len(lines) == 6, out.stdout + out.stderr[-3000:]
