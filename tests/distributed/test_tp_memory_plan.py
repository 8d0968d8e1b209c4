"""A TP worker whose memory plan refuses to start (``MemoryPlanError``: its device cannot hold
one request of the full context) says so in one line naming the cause, as rank 0 does for its
own, with no traceback; rank 0 fails its startup naming the worker and the same cause."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.support.hf import make_hf_model

# The spawned worker imports the script as ``__mp_main__``: its top level runs there too, and
# puts the worker's KV sizing on an 80 GiB device with 0.5 GiB free (the real arithmetic,
# engine/memory.py's kv_budget_slots, at the point build_rank sizes the pool).
SCRIPT = """
import sys

import breakgraph.engine.rank as rank
from breakgraph.engine.memory import GIB, DeviceMemory, kv_budget_slots

if __name__ == "__mp_main__":  # the worker
    def short_device(args, model, dtype, device, context_len, weights_bytes, *rest, **kw):
        mem = DeviceMemory(free=GIB // 2, total=80 * GIB)
        return kv_budget_slots(mem, args.mem_fraction_static, 1 << 20, context_len,
                               weights_bytes)

    rank.num_kv_slots = short_device

if __name__ == "__main__":
    from breakgraph.engine.args import EngineArgs
    from breakgraph.engine.engine import Engine

    try:
        Engine(EngineArgs(model_path=sys.argv[1], device="cpu", dtype="float32",
                          max_total_tokens=512, tp_size=2))
    except RuntimeError as e:
        print(f"rank 0: {e}", flush=True)
        sys.exit(3)
"""


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tp-plan-llama")
    make_hf_model("llama").save_pretrained(path)
    return path


def test_a_workers_memory_plan_error_is_one_line(llama, tmp_path):
    script = tmp_path / "rank0.py"
    script.write_text(textwrap.dedent(SCRIPT))
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run(
        [sys.executable, str(script), str(llama)],
        capture_output=True, text=True, timeout=180, env=env,
    )  # fmt: skip
    assert out.returncode == 3, out.stderr[-3000:]
    worker = [line for line in out.stderr.splitlines() if line.startswith("[tp1]")]
    assert len(worker) == 1, out.stderr[-3000:]
    (line,) = worker
    assert line.startswith("[tp1] ERROR TP worker rank 1 failed: MemoryPlanError: ")
    for part in ("the KV cache for one", "--mem-fraction-static", "0.50 GiB free"):
        assert part in line, line
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    # rank 0 names the worker and its cause
    assert "rank 0: TP worker rank 1 failed during model load: MemoryPlanError: " in out.stdout
