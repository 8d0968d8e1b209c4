"""A tiny random DeepSeek V4 served end to end on the CPU: greedy ids through /generate equal
the engine's in-process ones (HF's, tests/models/test_deepseek_v4.py), a repeated prompt
resumes from the cache on a window boundary, and /get_server_info reports the KV per token
(the one K = V head per layer and the compressed entries beside it)."""

from __future__ import annotations

import pytest

from breakgraph.engine.request import SamplingParams
from tests.support.deepseek_v4 import make_hf_deepseek_v4
from tests.support.engines import make_engine
from tests.support.hf import prompts
from tests.support.server import ServerProcess, info, post


@pytest.fixture(scope="module")
def v4_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("served-deepseek-v4")
    make_hf_deepseek_v4().save_pretrained(path)
    return path


def test_served_greedy_ids_equal_in_process_and_resume_from_cache(v4_dir, tmp_path):
    (p,) = prompts(1, [40], seed=6)
    sp = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    (want,) = make_engine(v4_dir).generate([p], sp)
    srv = ServerProcess(
        ["--model-path", str(v4_dir), "--dtype", "float32"], tmp_path / "v4.log"
    ).wait_ready()
    try:
        body = {
            "input_ids": p,
            "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True},
        }
        first = post(srv, "/generate", body).json()
        again = post(srv, "/generate", body).json()
        assert first["output_ids"] == again["output_ids"] == want.output_ids
        assert again["meta_info"]["cached_tokens"] == 32  # 39 matched, resumed at 2 x 16
        memory = info(srv)["memory"]
        per_token = memory["kv_bytes"] / memory["kv_tokens"]
        assert per_token >= (4 * 32 + 3 * 32 + 2 * 16) * 4  # float32 slots, state rows beside
    finally:
        srv.stop()
