"""DeepSeek V4's layer schedule and rope settings from its config, folded as HF's
DeepseekV4Config does.

Checkpoints ship either the modern fields (``layer_types``, ``mlp_layer_types``,
``compress_rates``, nested ``rope_parameters`` with ``main`` / ``compress``) or the legacy
ones HF folds in: ``compress_ratios`` (per layer 0 / 4 / 128), ``compress_rate_csa`` /
``compress_rate_hca``, ``num_hash_layers``, ``qk_rope_head_dim`` and a flat ``rope_scaling``
(YaRN, applied to the compressed layers only).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from breakgraph.models.config import ModelConfig

SLIDING = "sliding_attention"
CSA = "compressed_sparse_attention"  # one entry per 4 tokens from two overlapping series
HCA = "heavily_compressed_attention"  # one entry per 128 tokens, all attended
LAYER_TYPES = (SLIDING, CSA, HCA)
_RATIO_TO_TYPE = {0: SLIDING, 4: CSA, 128: HCA}
DEFAULT_COMPRESS_RATES = {CSA: 4, HCA: 128}
DEFAULT_NUM_HASH_LAYERS = 3


@dataclass(frozen=True)
class V4Layout:
    """The resolved per-layer schedule and the two rope settings."""

    layer_types: tuple[str, ...]
    mlp_layer_types: tuple[str, ...]  # "hash_moe" or "moe"
    compress_rates: dict[str, int]
    rope_dim: int  # the trailing slice of each head that rotates
    rope_main: dict[str, Any]  # sliding layers: plain theta
    rope_compress: dict[str, Any]  # compressed layers and their compressors: YaRN'd theta

    def ratio(self, layer_id: int) -> int:
        """Tokens per compressed entry of a layer (0: a sliding layer, no compressor)."""
        t = self.layer_types[layer_id]
        return 0 if t == SLIDING else self.compress_rates[t]

    @property
    def prefix_align(self) -> int:
        """A cached prefix the compressors can resume from ends on a multiple of every
        compression rate in use (no window open; see ``DeepseekV4ForCausalLM``)."""
        rates = {self.compress_rates[t] for t in self.layer_types if t != SLIDING}
        align = 1
        for r in rates:
            align = align * r // _gcd(align, r)
        return align

    @property
    def prefix_recompute(self) -> int:
        """Tokens before a resumed prefix that are computed again: a CSA entry also pools
        the window before its own, so its compressor's state is rebuilt from that window."""
        return self.compress_rates[CSA] if CSA in self.layer_types else 0


def _gcd(a: int, b: int) -> int:
    while b:
        a, b = b, a % b
    return a


def v4_layout(config: ModelConfig) -> V4Layout:
    """HF's ``DeepseekV4Config.__post_init__`` folding, on the raw config dict."""
    raw = config.raw
    n = config.num_hidden_layers
    rates = dict(raw.get("compress_rates") or DEFAULT_COMPRESS_RATES)
    if raw.get("compress_rate_csa") is not None:
        rates[CSA] = raw["compress_rate_csa"]
    if raw.get("compress_rate_hca") is not None:
        rates[HCA] = raw["compress_rate_hca"]
    layer_types = raw.get("layer_types")
    if layer_types is None and raw.get("compress_ratios") is not None:
        layer_types = [_RATIO_TO_TYPE[r] for r in raw["compress_ratios"]]
    if layer_types is None:  # HF's default: 2 HCA, then CSA / HCA interleaved
        layer_types = [HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
    layer_types = tuple(layer_types[:n])
    bad = sorted(set(layer_types) - set(LAYER_TYPES))
    if bad or len(layer_types) != n:
        raise ValueError(f"DeepSeek V4 layer_types: {n} of {LAYER_TYPES} expected, got {bad}")
    mlp_types = raw.get("mlp_layer_types")
    if mlp_types is None:
        n_hash = raw.get("num_hash_layers")
        n_hash = DEFAULT_NUM_HASH_LAYERS if n_hash is None else n_hash
        mlp_types = ["hash_moe"] * min(n, n_hash) + ["moe"] * max(0, n - n_hash)
    partial = raw.get("partial_rotary_factor")
    if partial is None:
        rope_head = raw.get("qk_rope_head_dim")
        partial = rope_head / config.head_dim if rope_head is not None else 64 / 512
    rope_dim = int(config.head_dim * partial)
    main, compress = _rope_settings(raw)
    return V4Layout(layer_types, tuple(mlp_types[:n]), rates, rope_dim, main, compress)


def _rope_settings(raw: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(main, compress) rope parameters: nested as HF saves them, or built from the flat
    fields (``rope_theta``, ``compress_rope_theta``, ``rope_scaling``) as HF folds them.
    A YaRN'd compress rope has attention factor 1 (V4 does not scale cos/sin)."""
    rp = raw.get("rope_parameters") or {}
    if isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict):
        main, compress = dict(rp["main"]), dict(rp["compress"])
    else:
        flat = {**(raw.get("rope_scaling") or {}), **rp}
        if "type" in flat and "rope_type" not in flat:
            flat["rope_type"] = flat.pop("type")
        yarn = {k: v for k, v in flat.items() if k not in ("main", "compress", "rope_theta")}
        main = {"rope_type": "default", "rope_theta": raw.get("rope_theta", 10000.0)}
        compress = {**yarn, "rope_theta": raw.get("compress_rope_theta", 160000.0)}
        compress.setdefault("rope_type", "default")
    for params in (main, compress):
        params.setdefault("rope_type", params.pop("type", "default"))
        params.pop("partial_rotary_factor", None)  # the rope dim is passed whole
    if compress["rope_type"] == "yarn":
        compress.setdefault("attention_factor", 1.0)
        compress.setdefault(
            "original_max_position_embeddings", raw.get("max_position_embeddings", 4096)
        )
    return main, compress
