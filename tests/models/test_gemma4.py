"""Gemma 4 against HF transformers (float32, tiny random configs): logits of whole, ragged,
prefix-cached and chunked steps, prompts longer than the sliding window, fast prefill on and
off, greedy generation; the KV pool holds the layers that store KV only."""

from __future__ import annotations

import pytest
import torch

from breakgraph.cache.kv_pool import KVPool
from breakgraph.models.config import ModelConfig
from breakgraph.models.gemma4_config import gemma4_layers
from breakgraph.models.loader import build_model
from breakgraph.models.sources import CONFIG_DIR
from tests.support.engines import make_engine
from tests.support.gemma4 import make_hf_gemma4
from tests.support.hf import (
    ATOL,
    LogitsTap,
    assert_greedy_equals_hf,
    assert_last_logits_hf,
    hf_last_logits,
    one_token,
    prompts,
)

gemma4 = pytest.importorskip("transformers.models.gemma4")


@pytest.fixture(scope="module", params=["text", "multimodal", "dense", "moe"])
def gemma4_checkpoint(request, tmp_path_factory):
    model = make_hf_gemma4(request.param)
    path = tmp_path_factory.mktemp(f"tiny-gemma4-{request.param}")
    model.save_pretrained(path)
    return model, path


@pytest.fixture(scope="module")
def gemma4_text_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-gemma4-engine")
    make_hf_gemma4("text").save_pretrained(path)
    return path


@pytest.mark.parametrize("fast_prefill", [True, False])
def test_whole_request_longer_than_window_matches_hf(gemma4_checkpoint, fast_prefill):
    hf, path = gemma4_checkpoint
    engine = make_engine(path)
    engine.model.kv_sharing_fast_prefill = fast_prefill
    tap = LogitsTap(engine)
    (p,) = prompts(1, [37])
    engine.generate([p], one_token())
    assert_last_logits_hf(tap.steps[0][0], hf, p)


def test_ragged_batch_matches_hf(gemma4_checkpoint):
    hf, path = gemma4_checkpoint
    engine = make_engine(path)
    tap = LogitsTap(engine)
    ps = prompts(4, [5, 33, 1, 70])
    engine.generate(ps, one_token())
    assert len(tap.steps) == 1, "all four prompts fit one prefill step"
    for row, p in enumerate(ps):
        assert_last_logits_hf(tap.steps[0][row], hf, p)


def test_cached_prefix_matches_hf(gemma4_checkpoint):
    """The prefix (longer than the window) was written by an earlier step; the shared layers
    read it through their source layers' KV."""
    hf, path = gemma4_checkpoint
    engine = make_engine(path)
    tap = LogitsTap(engine)
    (base,) = prompts(1, [48])
    engine.generate([base], one_token())
    for extra in ([7, 8, 9, 10, 11], [12]):
        extended = base + extra
        (res,) = engine.generate([extended], one_token())
        assert res.cached_tokens == len(base)
        assert_last_logits_hf(tap.steps[-1][0], hf, extended)


def test_chunked_prefill_matches_hf(gemma4_checkpoint):
    hf, path = gemma4_checkpoint
    engine = make_engine(path, chunked_prefill_size=16)
    tap = LogitsTap(engine)
    ps = prompts(2, [50, 9])
    engine.generate(ps, one_token())
    assert len(tap.steps) >= 4  # 59 tokens in 16-token steps
    for p in ps:
        ref = hf_last_logits(hf, p)
        assert any(torch.allclose(s, ref, atol=ATOL, rtol=1e-4) for st in tap.steps for s in st), (
            f"no step produced the logits of the {len(p)}-token prompt"
        )


def test_fast_prefill_on_and_off_give_the_same_logits(gemma4_text_dir):
    """Shared layers on each request's last row only, or on every row as HF: same last-row
    logits, over ragged, prefix-cached and chunked steps."""

    def run(fast: bool) -> list[torch.Tensor]:
        engine = make_engine(gemma4_text_dir, chunked_prefill_size=24)
        assert engine.model.kv_sharing_fast_prefill  # on by default with KV-shared layers
        engine.model.kv_sharing_fast_prefill = fast
        tap = LogitsTap(engine)
        ps = prompts(3, [30, 3, 17], seed=3)
        engine.generate(ps, one_token())
        engine.generate([ps[0] + [5, 6, 7], ps[2][:10]], one_token())
        return tap.steps

    on, off = run(True), run(False)
    assert len(on) == len(off) >= 3
    for a, b in zip(on, off, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_prompt_logprobs_with_fast_prefill_match_hf(gemma4_text_dir):
    """A step with prompt logprobs takes the full path (the KV-shared layers on every prompt
    row): the logprobs equal HF's, whole and chunked in a ragged batch, and from
    logprob_start_len over a cached prefix, with fast prefill on."""
    from transformers import AutoModelForCausalLM

    from tests.support.logprobs import check_prompt, greedy, hf_logprobs

    hf = AutoModelForCausalLM.from_pretrained(gemma4_text_dir, dtype=torch.float32).eval()
    engine = make_engine(gemma4_text_dir, chunked_prefill_size=24)
    assert engine.model.kv_sharing_fast_prefill
    p, other = prompts(2, [40, 11], seed=9)
    ref = hf_logprobs(hf, p)
    res, res_other = engine.generate([p, other], greedy(1), return_logprob=True,
                                     logprob_start_len=0, top_logprobs_num=3)  # fmt: skip
    check_prompt(res, ref, p, 0, 3)  # 40 rows over two chunks of 24
    check_prompt(res_other, hf_logprobs(hf, other), other, 0, 3)
    (hit,) = engine.generate([p], greedy(1), return_logprob=True,
                             logprob_start_len=25, top_logprobs_num=0)  # fmt: skip
    assert hit.cached_tokens > 0
    check_prompt(hit, ref, p, 25, 0)


@pytest.mark.parametrize("mixed", [False, True])
def test_greedy_decode_matches_hf_generate(gemma4_text_dir, mixed):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(gemma4_text_dir, dtype=torch.float32).eval()
    engine = make_engine(gemma4_text_dir, chunked_prefill_size=32, enable_mixed_chunk=mixed)
    ps = prompts(3, [20, 45, 6], seed=5)
    ps[2] = ps[0][:12] + ps[2]  # shares a prefix (longer than the window) with the first
    assert_greedy_equals_hf(engine, hf, ps, 12)


def test_kv_pool_holds_only_the_layers_that_store_kv(gemma4_text_dir):
    engine = make_engine(gemma4_text_dir)
    model, pool = engine.model, engine.kv_pool
    assert model.num_kv_layers == 4
    assert [model.kv_layer_of(i) for i in range(6)] == [0, 1, 2, 3, 3, 2]
    assert pool.layer_shapes == [(1, 16), (1, 16), (1, 32), (1, 16)]
    assert len(pool.k_buffers) == len(pool.v_buffers) == 4
    assert pool.size_bytes == pool.num_slots * KVPool.slot_bytes(pool.layer_shapes, torch.float32)
    names = {n for n, _ in model.named_parameters()}
    for i in (4, 5):  # shared layers: q only, no k/v projections or norms
        assert f"model.layers.{i}.self_attn.q_proj.weight" in names
        assert not any(n.startswith(f"model.layers.{i}.self_attn.qkv_proj") for n in names)
        assert f"model.layers.{i}.self_attn.k_norm.weight" not in names
    # a step writes the storing layers' KV only: every buffer the pool has is written
    engine.generate(prompts(1, [12]), one_token())
    assert all(bool(b[1:].abs().sum() > 0) for b in pool.k_buffers + pool.v_buffers)


@pytest.mark.parametrize(
    ("name", "layers", "kv_layers", "sources", "full_every"),
    [("gemma-4-e2b", 35, 15, (13, 14), 5), ("gemma-4-e4b", 42, 24, (22, 23), 6)],
)
def test_builtin_configs(name, layers, kv_layers, sources, full_every):
    """The built-in configs resolve as HF resolves the checkpoints' (built on the meta device)."""
    config = ModelConfig.from_file(CONFIG_DIR / f"{name}.json")
    specs = gemma4_layers(config)
    assert len(specs) == layers
    for i, s in enumerate(specs):
        full = (i + 1) % full_every == 0
        assert (s.head_dim, s.sliding_window) == ((512, None) if full else (256, 512))
        assert s.kv_layer == (sources[full] if i >= kv_layers else i)
    # HF's own resolution of the same config agrees
    fields = {k: v for k, v in config.raw.items() if k not in ("architectures", "torch_dtype")}
    hf = gemma4.Gemma4TextConfig(**fields)
    assert [m == "reuse" for m in hf.kv_sharing_modes] == [s.shares_kv for s in specs]
    hf_dims = [(c.head_dim, c.num_key_value_heads) for c in hf.per_layer_config]
    assert hf_dims == [(s.head_dim, s.num_kv_heads) for s in specs]
    model = build_model(config, torch.bfloat16, torch.device("meta"))
    shapes = model.kv_cache_shapes()
    assert len(shapes) == kv_layers
    stored = KVPool.slot_bytes(shapes, torch.bfloat16)
    every_layer = KVPool.slot_bytes([(s.num_kv_heads, s.head_dim) for s in specs], torch.bfloat16)
    assert stored < 0.6 * every_layer
    assert config.vocab_size == 262_144 and model.final_logit_softcapping == 30.0
    assert model.lm_head.weight is model.model.embed_tokens.weight
