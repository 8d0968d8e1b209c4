"""DeepSeek V4 on the GPU, with CUDA graphs (prefill buckets and decode batch sizes) and
without: a tiny random HF V4 in float32 gives HF ``generate``'s greedy ids over ragged,
prefix-hit and chunked steps, with no host sync inside a step; the clamped SwiGLU experts run
on the fused Triton MoE."""

from __future__ import annotations

import pytest
import torch

from breakgraph.engine.args import EngineArgs
from breakgraph.engine.engine import Engine
from tests.support.deepseek_v4 import make_hf_deepseek_v4
from tests.support.gpu import forbid_host_syncs_in_steps
from tests.support.hf import assert_greedy_equals_hf, prompts

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)


@pytest.fixture(scope="module")
def v4(tmp_path_factory):
    hf = make_hf_deepseek_v4()
    path = tmp_path_factory.mktemp("tiny-deepseek-v4-gpu")
    hf.save_pretrained(path)
    return hf, path


def v4_engine(path, **kw) -> Engine:
    args = EngineArgs(model_path=str(path), device="cuda", dtype="float32", max_total_tokens=4096)
    for k, v in kw.items():
        setattr(args, k, v)
    return Engine(args)


@pytest.mark.parametrize("graphs", [True, False])
@pytest.mark.parametrize("chunk", [8192, 13])
def test_greedy_ids_equal_hf_generate_without_host_syncs(v4, chunk, graphs):
    hf, path = v4
    eng = v4_engine(path, chunked_prefill_size=chunk, disable_cuda_graph=not graphs,
                    cuda_graph_backend_prefill="auto" if graphs else "disabled")  # fmt: skip
    assert (eng.runner.decode_graphs is not None) == graphs
    forbid_host_syncs_in_steps(eng)
    (base,) = prompts(1, [50], seed=2)
    assert_greedy_equals_hf(eng, hf.float(), [base, *prompts(2, [33, 5], seed=3)], 12)
    assert_greedy_equals_hf(eng, hf, [base + [7, 8, 9, 10]], 6)  # resumed at 48
    if graphs:
        assert eng.runner.count("prefill") > 0 and eng.runner.count("decode") > 0
