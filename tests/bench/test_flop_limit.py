"""``bench step``'s FLOP limit: the step's matrix FLOPs counted from the model as built
(meta device: no weights), against the count by hand from the config."""

from __future__ import annotations

import torch

from breakgraph.bench.flop_limit import _window_keys, flop_limit_ms, step_flops


def _built(name: str):
    from breakgraph.models.config import ModelConfig
    from breakgraph.models.loader import build_model
    from breakgraph.models.sources import CONFIG_DIR

    config = ModelConfig.from_file(CONFIG_DIR / f"{name}.json")
    return build_model(config, torch.bfloat16, torch.device("meta"), None)


def _causal_keys(p: int, n: int) -> int:
    return n * p + n * (n + 1) // 2


def test_dense_step_counts_projections_attention_and_the_last_rows_logits():
    n, p = 512, 1024
    hidden, layers, heads, kv, hd, inter, vocab = 1024, 28, 16, 8, 128, 3072, 151936
    per_layer = (heads + 2 * kv) * hd * hidden + hidden * heads * hd + 2 * inter * hidden
    per_layer += hidden * inter
    expect = 2 * n * layers * per_layer + 2 * vocab * hidden
    expect += layers * 4 * heads * hd * _causal_keys(p, n)
    assert step_flops(_built("qwen3-0.6b"), n, p) == expect


def test_moe_step_counts_top_k_experts_per_token():
    n = 256
    hidden, layers, heads, kv, hd, inter, top_k = 2048, 48, 32, 4, 128, 768, 8
    attn = (heads + 2 * kv) * hd * hidden + hidden * heads * hd
    experts = top_k * 3 * inter * hidden
    router = 128 * hidden
    expect = 2 * n * layers * (attn + experts + router) + 2 * 151936 * hidden
    expect += layers * 4 * heads * hd * _causal_keys(0, n)
    assert step_flops(_built("qwen3-30b-a3b"), n, 0) == expect


def test_a_sliding_window_caps_the_keys_each_row_sees():
    assert _window_keys(2, 3, None) == 3 + 4 + 5
    assert _window_keys(2, 3, 4) == 3 + 4 + 4
    assert _window_keys(0, 8192, None) == _causal_keys(0, 8192)


def test_the_limit_is_flops_over_the_rate():
    assert flop_limit_ms(700e12 * 0.025, 700.0) == 25.0


def test_a_model_whose_attention_is_its_own_is_not_counted():
    assert step_flops(_built("deepseek-v4-flash-e32"), 256, 0) is None


def test_the_step_bench_arm_counts_only_what_it_can():
    from breakgraph.bench.step import flop_limit_arm

    dense = flop_limit_arm("FLOP limit", _built("qwen3-0.6b"), "", 512, 0, 700.0)
    assert dense.ms == flop_limit_ms(step_flops(_built("qwen3-0.6b"), 512, 0), 700.0)
    assert "at 700 TFLOP/s" in dense.note
    bounded = flop_limit_arm("FLOP limit bounded", _built("gemma-4-e2b"), "bounded", 512, 0, 700.0)
    v4 = flop_limit_arm("FLOP limit", _built("deepseek-v4-flash-e32"), "", 512, 0, 700.0)
    assert bounded.ms is None and v4.ms is None and "own" in v4.note
