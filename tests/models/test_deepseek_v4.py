"""DeepSeek V4 against HF transformers (float32, a tiny random config with every attention
kind, hash and routed MoE): logits of whole, ragged, prefix-cached and chunked steps over
prompts longer than the sliding window and several compressed windows, greedy decoding, and
the config's legacy fields folded as HF folds them.

``index_topk`` is at least every compressed entry a prompt here has: on random weights many
indexer scores tie at exactly 0 (a ReLU), and which of the tied entries a top-k keeps
depends on the order of the sums (HF's own cached and uncached paths differ then); the
selection itself is tested in tests/kernels/test_compressed_attention.py."""

from __future__ import annotations

import pytest
import torch

from breakgraph.models.config import ModelConfig
from breakgraph.models.deepseek_v4_config import CSA, HCA, SLIDING, v4_layout
from tests.support.deepseek_v4 import TINY_V4, make_hf_deepseek_v4
from tests.support.engines import assert_no_leak, make_engine
from tests.support.hf import (
    ATOL,
    LogitsTap,
    assert_greedy_equals_hf,
    assert_last_logits_hf,
    hf_last_logits,
    one_token,
    prompts,
)


@pytest.fixture(scope="module")
def v4_checkpoint(tmp_path_factory):
    model = make_hf_deepseek_v4()
    path = tmp_path_factory.mktemp("tiny-deepseek-v4")
    model.save_pretrained(path)  # the original checkpoint's names, as HF writes them
    return model, path


def test_whole_request_over_several_windows_matches_hf(v4_checkpoint):
    hf, path = v4_checkpoint
    engine = make_engine(path)
    tap = LogitsTap(engine)
    (p,) = prompts(1, [70])  # 8-token window, 17 CSA and 4 HCA entries
    engine.generate([p], one_token())
    assert_last_logits_hf(tap.steps[0][0], hf, p)


def test_ragged_batch_matches_hf(v4_checkpoint):
    hf, path = v4_checkpoint
    engine = make_engine(path)
    tap = LogitsTap(engine)
    ps = prompts(4, [5, 33, 1, 70])
    engine.generate(ps, one_token())
    assert len(tap.steps) == 1, "all four prompts fit one prefill step"
    for row, p in enumerate(ps):
        assert_last_logits_hf(tap.steps[0][row], hf, p)


@pytest.mark.parametrize("base_len", [48, 53])
def test_cached_prefix_resumes_on_a_window_boundary(v4_checkpoint, base_len):
    """A hit resumes at a multiple of the largest window (16 here) and computes the 4 tokens
    before it again (the CSA compressors' state): logits as HF's, nothing leaked."""
    hf, path = v4_checkpoint
    engine = make_engine(path)
    assert (engine.model.prefix_align, engine.model.prefix_recompute) == (16, 4)
    tap = LogitsTap(engine)
    (base,) = prompts(1, [base_len])
    engine.generate([base], one_token())
    for extra in ([7, 8, 9, 10, 11], [12], list(range(20, 41))):
        extended = base + extra
        (res,) = engine.generate([extended], one_token())
        assert res.cached_tokens == 48
        assert_last_logits_hf(tap.steps[-1][0], hf, extended)
    assert_no_leak(engine)


def test_chunked_prefill_matches_hf(v4_checkpoint):
    """Chunks of 13 tokens: every chunk ends inside a window, so the compressors carry their
    open windows from one step to the next."""
    hf, path = v4_checkpoint
    engine = make_engine(path, chunked_prefill_size=13)
    tap = LogitsTap(engine)
    ps = prompts(2, [50, 9])
    engine.generate(ps, one_token())
    assert len(tap.steps) >= 5
    for p in ps:
        ref = hf_last_logits(hf, p)
        assert any(torch.allclose(s, ref, atol=ATOL, rtol=1e-4) for st in tap.steps for s in st), (
            f"no step produced the logits of the {len(p)}-token prompt"
        )


def test_greedy_decode_matches_hf_generate(v4_checkpoint):
    """Decode steps close windows one token at a time (state carried per request)."""
    hf, path = v4_checkpoint
    engine = make_engine(path)
    assert_greedy_equals_hf(engine, hf, prompts(3, [30, 13, 3], seed=4), 20)
    assert_no_leak(engine)


def test_the_pool_stores_k_once_and_the_compressed_entries_per_slot(v4_checkpoint):
    _, path = v4_checkpoint
    engine = make_engine(path)
    pool = engine.kv_pool
    assert pool.k_is_v and pool.v_buffers is pool.k_buffers
    # layers 1 and 3 are CSA (entries and indexer keys), layer 2 HCA (entries)
    assert sorted(pool.slot_buffers) == ["comp.1", "comp.2", "comp.3", "index.1", "index.3"]
    assert pool.request_states["comp.1_state"].shape[1:] == (2, 3, 32)
    assert pool.request_states["comp.2_state"].shape[1:] == (1, 3, 32)
    per_slot = 4 * 32 + 3 * 32 + 2 * 16  # K = V per layer, entries, indexer keys (float32)
    assert pool.model_slot_bytes(engine.model, torch.float32) == per_slot * 4


def test_legacy_config_fields_fold_as_hf_does():
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "DeepseekV4Config"):
        pytest.skip("transformers has no DeepseekV4Config")
    legacy = {k: v for k, v in TINY_V4.items() if k not in ("layer_types", "mlp_layer_types")}
    legacy.pop("compress_rates")
    legacy.pop("partial_rotary_factor")
    legacy.update(
        compress_ratios=[0, 4, 128, 4],
        num_hash_layers=2,
        qk_rope_head_dim=16,
        compress_rope_theta=40000.0,
    )
    hf = transformers.DeepseekV4Config(**legacy)
    raw = {"architectures": ["DeepseekV4ForCausalLM"], **legacy}
    layout = v4_layout(ModelConfig.from_dict(raw))
    assert list(layout.layer_types) == hf.layer_types == [SLIDING, CSA, HCA, CSA]
    assert list(layout.mlp_layer_types) == hf.mlp_layer_types
    assert layout.compress_rates == hf.compress_rates
    assert layout.rope_dim == hf.qk_rope_head_dim == 16
    assert layout.rope_compress["rope_theta"] == hf.rope_parameters["compress"]["rope_theta"]
    assert layout.rope_compress["rope_type"] == "yarn"
    assert layout.prefix_align == 128 and layout.prefix_recompute == 4


@pytest.mark.parametrize("name", ["deepseek-v4-flash", "deepseek-v4-flash-e32"])
def test_builtin_configs_have_v4_flash_layer_schedule(name):
    """Two sliding layers, then CSA and HCA alternating (the released compress_ratios, whose
    44th entry is the MTP layer's), hash routing on the first three layers."""
    from breakgraph.models.registry import check_tp_support
    from breakgraph.models.sources import CONFIG_DIR

    config = ModelConfig.from_file(CONFIG_DIR / f"{name}.json")
    layout = v4_layout(config)
    types = list(layout.layer_types)
    assert len(types) == config.num_hidden_layers == 43
    assert types[:4] == [SLIDING, SLIDING, CSA, HCA] and types[-1] == CSA
    assert (types.count(CSA), types.count(HCA)) == (21, 20)
    assert layout.mlp_layer_types[:4] == ("hash_moe",) * 3 + ("moe",)
    assert (layout.prefix_align, layout.prefix_recompute, layout.rope_dim) == (128, 4, 64)
    check_tp_support(config, 8)


def test_prompt_logprobs_match_hf(v4_checkpoint):
    """Prompt logprob rows over two chunks (the compressors' state carried between them), and
    from logprob_start_len over a cached prefix (no rows recomputed there: the hit is given
    up or rounded so that the logprob rows stay whole)."""
    from tests.support.logprobs import check_prompt, greedy, hf_logprobs

    hf, path = v4_checkpoint
    engine = make_engine(path, chunked_prefill_size=24)
    p, other = prompts(2, [40, 11], seed=9)
    ref = hf_logprobs(hf, p)
    res, res_other = engine.generate([p, other], greedy(1), return_logprob=True,
                                     logprob_start_len=0, top_logprobs_num=3)  # fmt: skip
    check_prompt(res, ref, p, 0, 3)
    check_prompt(res_other, hf_logprobs(hf, other), other, 0, 3)
    (hit,) = engine.generate([p], greedy(1), return_logprob=True,
                             logprob_start_len=25, top_logprobs_num=0)  # fmt: skip
    check_prompt(hit, ref, p, 25, 0)
    assert_no_leak(engine)


def test_tiny_builtin_runs_on_dummy_weights():
    """``deepseek-v4-tiny``: every attention kind in 4 layers, for tests and smoke runs
    without a checkpoint; a prompt past its 32-token HCA window and a cached hit."""
    from breakgraph.engine.args import EngineArgs
    from breakgraph.engine.engine import Engine
    from breakgraph.engine.request import SamplingParams

    engine = Engine(
        EngineArgs(
            model_path="deepseek-v4-tiny",
            load_format="dummy",
            device="cpu",
            dtype="float32",
            max_total_tokens=2048,
        )  # fmt: skip
    )
    assert (engine.model.prefix_align, engine.model.prefix_recompute) == (32, 4)
    (p,) = prompts(1, [70], seed=8)
    sp = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    (first,) = engine.generate([p], sp)
    (again,) = engine.generate([p], sp)
    assert again.output_ids == first.output_ids and len(first.output_ids) == 6
    assert again.cached_tokens == 64
    assert_no_leak(engine)
