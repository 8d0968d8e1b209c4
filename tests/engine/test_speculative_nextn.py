"""NEXTN speculative decoding: DeepSeek V4's own MTP layer drafts (engine/mtp.py).

HF's twin has no MTP layers, so the checks are the engine's own, in float32 on the tiny V4
(sliding, CSA and HCA layers, windows closing inside verify steps): greedy tokens equal plain
decoding's; every MTP row computed from the target's true streams (a step's mirror, the rows
over kept drafts, each round's first draft) has the logits one forward of the MTP over the
whole final sequence gives (so its KV is right at every position it attends: prefill, plain
steps, verify steps with rejections, a radix hit); the ``mtp.{i}.*`` tensors of an original
checkpoint load; the refusals in one line."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from breakgraph.engine.graphs.base import GraphTarget
from breakgraph.engine.graphs.key import DECODE, EAGER, PREFILL
from breakgraph.engine.graphs.mtp import MtpGraphs
from breakgraph.engine.request import SamplingParams
from breakgraph.models.loader import load_model
from tests.support.engines import assert_no_leak, make_engine
from tests.support.hf import prompts


@pytest.fixture(scope="module")
def v4_dir(tmp_path_factory):
    from tests.support.deepseek_v4 import make_hf_deepseek_v4

    path = tmp_path_factory.mktemp("v4")
    make_hf_deepseek_v4(num_nextn_predict_layers=1).save_pretrained(path)
    return path


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True, **kw)


def nextn(path, k: int = 3, **kw):
    return make_engine(
        path, load_format="dummy", speculative_algorithm="NEXTN",
        speculative_num_draft_tokens=k, **kw,
    )  # fmt: skip


PROMPTS = [prompts(1, [37], seed=5)[0], prompts(1, [21], seed=6)[0], prompts(1, [52], seed=7)[0]]


@pytest.mark.parametrize("overlap", [False, True])
def test_greedy_tokens_equal_plain_decoding(v4_dir, overlap):
    plain_engine = make_engine(v4_dir, load_format="dummy")
    plain = plain_engine.generate(PROMPTS, greedy(24))
    engine = nextn(v4_dir, overlap_schedule=overlap)
    spec = engine.generate(PROMPTS, greedy(24))
    assert [r.output_ids for r in spec] == [r.output_ids for r in plain]
    stats = engine.scheduler.spec_stats
    assert stats.steps > 0 and stats.drafted > 0
    # a penalized request takes plain steps (mirrored) beside speculating ones
    params = [greedy(12, repetition_penalty=1.3), greedy(12)]
    mixed = engine.generate(PROMPTS[:2], params)
    want = plain_engine.generate(PROMPTS[:2], params)
    assert [r.output_ids for r in mixed] == [r.output_ids for r in want]
    assert_no_leak(engine)


def _true_rows(engine) -> list[tuple[list[int], torch.Tensor]]:
    """Every MTP forward from the target's streams (layer step 0: a mirror, the rows over kept
    drafts, a round's first draft): its positions and logits, recorded."""
    drafter = engine.scheduler.spec.drafter
    forward, seen = drafter._forward, []

    def record(batch, streams, step, logits=True):
        out, computed = forward(batch, streams, step)  # the logits, wanted or not
        if step == 0:
            seen.append((batch.positions.tolist(), computed.clone()))
        return out, computed if logits else None

    drafter._forward = record
    return seen


def _reference(path, seq: list[int]) -> torch.Tensor:
    """The MTP's logits at every position of ``seq`` from one prefill of it (a fresh engine:
    its mirror is one forward over all rows)."""
    engine = nextn(path)
    seen = _true_rows(engine)
    engine.generate([seq], greedy(1))
    ((positions, logits),) = seen
    assert positions == list(range(len(seq) - 1))
    return logits


@pytest.mark.parametrize("synthetic", [None, 2.5])
def test_mtp_rows_from_true_streams_equal_one_forward_over_the_sequence(
    v4_dir, synthetic, monkeypatch
):
    """A request decoded with NEXTN, then one with a radix hit on it (its recomputed rows
    rebuild the row before the hit). With synthetic acceptance (a benchmark aid: drafts kept
    whatever the target says) more of each round's drafts are kept, so more rows over kept
    drafts and fewer rejections are checked."""
    kw = {}
    if synthetic is not None:
        monkeypatch.setenv("BREAKGRAPH_BENCH", "1")
        kw["bench_synthetic_accept_length"] = synthetic
    engine = nextn(v4_dir, **kw)
    seen = _true_rows(engine)
    first = PROMPTS[2]
    hit = first[:40] + prompts(1, [9], seed=8)[0]
    # the hit resumes at 32 (the tiny V4 resumes at multiples of 16), 4 rows recomputed
    for prompt, start in ((first, 0), (hit, 28)):
        seen.clear()
        (out,) = engine.generate([prompt], greedy(20))
        seq = prompt + out.output_ids
        want = _reference(v4_dir, seq)
        covered = set()
        for positions, logits in seen:
            torch.testing.assert_close(logits, want[positions], atol=2e-4, rtol=2e-4)
            covered.update(positions)
        # every row but the last round's (a finished request's kept drafts get no MTP rows)
        assert covered >= set(range(start, len(seq) - 2 - 3)), sorted(covered)
    assert engine.scheduler.spec_stats.accepted > 0 or synthetic is None
    assert_no_leak(engine)


def test_target_graph_steps_give_the_mtp_their_streams(v4_dir):
    """The target's prefill and decode banks replayed (the CPU graph harness) with the
    streams an output, and the MTP's draft steps its own decode bank: the MTP's rows from
    the target's streams equal the reference, and greedy tokens (a penalized request's plain
    steps beside) equal plain decoding's."""
    from tests.support.cpu_graphs import capture_on_cpu, install_cpu_graphs

    engine = nextn(v4_dir)
    install_cpu_graphs(engine, [16, 32, 64, 128], 4)
    drafter = engine.scheduler.spec.drafter
    pad = engine.runner.prefill_graphs.pad_req_idx
    target = GraphTarget(drafter.mtp, drafter.kv_pool, engine.runner.req_to_token, pad, "cpu",
                         check_addresses=True)  # fmt: skip
    drafter.graphs = MtpGraphs(target, 4, drafter.mtp.stream_width, torch.float32)
    capture_on_cpu(drafter.graphs.bank)
    replays = []
    replay = drafter.graphs.replay_streams
    drafter.graphs.replay_streams = lambda *a: replays.append(1) or replay(*a)
    seen = _true_rows(engine)
    (out,) = engine.generate([PROMPTS[0]], greedy(16))
    want = _reference(v4_dir, PROMPTS[0] + out.output_ids)
    for positions, logits in seen:
        torch.testing.assert_close(logits, want[positions], atol=2e-4, rtol=2e-4)
    params = [greedy(16, repetition_penalty=1.3), greedy(16)]
    got = engine.generate(PROMPTS[:2], params)
    plain = make_engine(v4_dir, load_format="dummy").generate(PROMPTS[:2], params)
    assert [r.output_ids for r in got] == [r.output_ids for r in plain]
    runner = engine.runner
    assert runner.count(PREFILL) and runner.count(DECODE), runner.step_counts
    assert not runner.count(EAGER), runner.step_counts
    assert replays, "the MTP's draft steps replay its graphs"
    alloc = engine.allocator  # (the harness holds the padding row of the request table)
    assert alloc.available + engine.tree.total_size() == alloc.capacity


def _mtp_checkpoint(path, dest) -> dict[str, torch.Tensor]:
    """``path``'s checkpoint plus an MTP layer in the original checkpoint's names (its own
    copies of the embedding and head too, as DeepSeek's ship them) -> the MTP's tensors by
    this engine's parameter names."""
    dest.mkdir()
    for f in path.iterdir():
        (dest / f.name).write_bytes(f.read_bytes())
    model = load_model(str(path), "dummy", "float32", seed=3, with_mtp=True).model
    own = {"hc_head.hc_fn": "hc_head_fn", "hc_head.hc_base": "hc_head_base",
           "hc_head.hc_scale": "hc_head_scale"}  # fmt: skip
    tensors, want = {}, {}
    for name, t in [*model.mtp.named_parameters(), *model.mtp.named_buffers()]:
        rest = name.removeprefix("layers.0.")
        if rest.startswith("block."):
            rest = rest.removeprefix("block.")
            if rest.endswith("shared_experts.gate_up_proj.weight"):  # as two tensors
                gate, up = t.chunk(2)
                stem = rest.removesuffix("gate_up_proj.weight")
                tensors[f"mtp.0.{stem}w1.weight"], tensors[f"mtp.0.{stem}w3.weight"] = gate, up
                want["mtp.layers.0." + name.removeprefix("layers.0.")] = t
                continue
        elif rest.startswith("rotary_emb"):
            continue
        tensors[f"mtp.0.{own.get(rest, rest)}"] = t.contiguous()
        want[f"mtp.{name}"] = t
    tensors["mtp.0.emb.tok_emb.weight"] = torch.zeros(256, 64)
    tensors["mtp.0.head.weight"] = torch.zeros(256, 64)
    save_file(tensors, str(dest / "mtp.safetensors"))
    index = dest / "model.safetensors.index.json"
    if index.is_file():
        data = json.loads(index.read_text())
        data["weight_map"].update({n: "mtp.safetensors" for n in tensors})
        index.write_text(json.dumps(data))
    return want


def test_an_original_checkpoints_mtp_tensors_load(v4_dir, tmp_path):
    want = _mtp_checkpoint(v4_dir, tmp_path / "ckpt")
    model = load_model(str(tmp_path / "ckpt"), dtype="float32", with_mtp=True).model
    got = dict(model.named_parameters()) | dict(model.named_buffers())
    for name, t in want.items():
        assert torch.equal(got[name], t), name
    # the shared embedding and head are the target's (the copies are not loaded)
    assert model.mtp._shared[0] is model.model.embed_tokens
    assert not torch.equal(model.model.embed_tokens.weight, torch.zeros(256, 64))
    # served: the same tokens as plain decoding of the checkpoint
    plain = make_engine(v4_dir).generate(PROMPTS[:2], greedy(12))
    engine = make_engine(tmp_path / "ckpt", speculative_algorithm="NEXTN")
    spec = engine.generate(PROMPTS[:2], greedy(12))
    assert [r.output_ids for r in spec] == [r.output_ids for r in plain]
    assert_no_leak(engine)


def test_refusals_name_the_cause(v4_dir, tmp_path):
    with pytest.raises(ValueError, match=r"lacks .* tensors \(the MTP layers NEXTN drafts"):
        make_engine(v4_dir, speculative_algorithm="NEXTN")  # HF's checkpoint has none
    with pytest.raises(ValueError, match="no MTP layers"):
        from tests.support.hf import make_hf_model

        make_hf_model("llama").save_pretrained(tmp_path)
        make_engine(tmp_path, speculative_algorithm="NEXTN")
    cfg = json.loads((v4_dir / "config.json").read_text())
    cfg["num_nextn_predict_layers"] = 0
    none = tmp_path / "none"
    none.mkdir()
    (none / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="num_nextn_predict_layers is 0"):
        nextn(none)
