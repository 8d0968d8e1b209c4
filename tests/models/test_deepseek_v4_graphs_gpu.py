"""DeepSeek V4 under CUDA graphs (``deepseek-v4-tiny``, dummy weights): replay equals eager on
every prefill bucket with ragged requests, for a prompt longer than the largest bucket (an
eager prefill, then decode graphs), a cached prefix past several HCA windows, a chunked
prompt, mixed chunks and decode batches over the largest graph (pieces); no host sync inside
a step; the buffers the graphs read by address never move (the guard on).

Contexts stay under 4 x ``index_topk`` (256 tokens): every CSA entry a row sees is kept, so
which of the indexer's tied scores a top-k keeps never decides (see test_deepseek_v4.py)."""

from __future__ import annotations

import pytest
import torch

from breakgraph.engine.engine import Engine
from breakgraph.engine.graphs.key import DECODE, PREFILL, StepKey
from breakgraph.engine.request import SamplingParams
from tests.support.gpu import BUCKETS, engine, forbid_host_syncs_in_steps
from tests.support.hf import LogitsTap

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)


@pytest.fixture(autouse=True)
def _guarded(knobs):
    """Every replay first checks that no buffer its graph reads by address has moved (the KV,
    the compressed entries, the compressors' per-request state, the weights, the table)."""
    knobs(GRAPH_GUARD="1")


def v4_engine(graphs: bool, dtype: str = "float32", **kw) -> Engine:
    """deepseek-v4-tiny (dummy weights) as the GPU engine tests build theirs, a longer chunk
    and a context of 1,024 (its entries' bound)."""
    kw = {"context_length": 1024, "chunked_prefill_size": 256, **kw}
    return engine("deepseek-v4-tiny", graphs, dtype, **kw)


def rand_prompts(seed: int, *lengths: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, 1000, (n,), generator=g).tolist() for n in lengths]


def waves() -> list[list[list[int]]]:
    """Every bucket (ragged batches), a prompt over the largest bucket, a cached prefix past
    five HCA windows (32 tokens each) resumed at 160, and a decode batch of 20 (> 16)."""
    (base,) = rand_prompts(1, 170)
    return [
        rand_prompts(2, 9), rand_prompts(3, 20), rand_prompts(4, 5, 33, 1, 10),
        rand_prompts(5, 5, 33, 1, 70), rand_prompts(6, 200), [base],
        [base + rand_prompts(7, 30)[0]], [base + rand_prompts(8, 80)[0]],
        rand_prompts(9, *[7] * 20),
    ]  # fmt: skip


def run(eng: Engine, prompts_waves, max_new_tokens: int = 5) -> list[list[list[int]]]:
    sp = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)
    return [[r.output_ids for r in eng.generate(ps, sp)] for ps in prompts_waves]


def assert_steps_close(tap_g: LogitsTap, tap_e: LogitsTap, atol: float, rtol: float) -> None:
    assert len(tap_g.steps) == len(tap_e.steps)
    for g, e in zip(tap_g.steps, tap_e.steps, strict=True):
        torch.testing.assert_close(g, e, atol=atol, rtol=rtol)


def test_graph_replay_equals_eager_without_host_syncs():
    eager, graph = v4_engine(graphs=False), v4_engine(graphs=True)
    assert graph.runner.prefill_graphs.whole is None  # V4 builds no whole prefill graphs
    forbid_host_syncs_in_steps(graph)
    tap_e, tap_g = LogitsTap(eager), LogitsTap(graph)
    assert run(graph, waves()) == run(eager, waves())
    runner = graph.runner
    assert sorted({k.size for k in runner.step_counts if k.bank == PREFILL}) == BUCKETS
    assert StepKey(DECODE, 16, rest=4) in runner.step_counts
    assert [k.reason for k in runner.step_counts if k.eager] == ["over the largest bucket"]
    assert_steps_close(tap_g, tap_e, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("mixed", [False, True])
def test_chunked_and_mixed_prefill_replays_equal_eager(mixed):
    """Chunks of 48 tokens over a 150-token prompt (open windows carried between replays);
    with mixed chunks, three requests decode inside the long prompt's chunks."""
    kw = dict(chunked_prefill_size=48, enable_mixed_chunk=mixed)
    eager, graph = v4_engine(graphs=False, **kw), v4_engine(graphs=True, **kw)
    forbid_host_syncs_in_steps(graph)
    tap_e, tap_g = LogitsTap(eager), LogitsTap(graph)
    sp = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    outputs = []
    for eng in (eager, graph):
        rids = [eng.add_request(p, sp) for p in rand_prompts(10, 10, 4, 7)]
        eng.step()
        rids.append(eng.add_request(rand_prompts(11, 150)[0], sp))
        got: dict[str, list[int]] = {r: [] for r in rids}
        while eng.has_work:
            for o in eng.step():
                got[o.rid].extend(o.token_ids)
        outputs.append([got[r] for r in rids])
    assert outputs[0] == outputs[1]
    assert graph.runner.count(PREFILL) >= 4 and graph.runner.count(DECODE) > 0
    assert_steps_close(tap_g, tap_e, atol=1e-3, rtol=1e-3)


def test_bfloat16_replay_logits_within_bf16_tolerance_of_eager():
    """bfloat16: each prefill bucket's last-row logits within 3% of their scale of eager's
    (the two differ by their GEMMs' row counts, hence rounding)."""
    eager, graph = v4_engine(False, "bfloat16"), v4_engine(True, "bfloat16")
    tap_e, tap_g = LogitsTap(eager), LogitsTap(graph)
    ps_waves = waves()[:4]
    run(graph, ps_waves, max_new_tokens=1)
    run(eager, ps_waves, max_new_tokens=1)
    assert len(tap_g.steps) == len(tap_e.steps) == 4
    for g, e in zip(tap_g.steps, tap_e.steps, strict=True):
        scale = e.abs().amax(dim=-1, keepdim=True)
        assert bool(((g - e).abs() <= 0.03 * scale).all())
