"""Gemma 4's per-layer settings from its text config, resolved as HF's Gemma4TextConfig does.

Layer types (sliding / full) with per-type head_dim and KV heads (``global_head_dim`` and
``num_global_key_value_heads``, or ``per_layer_config`` in configs re-saved by transformers),
and KV sharing: the last ``num_kv_shared_layers`` layers read the KV of the last earlier
layer of their type (HF's ``kv_sharing_modes``).
"""

from __future__ import annotations

from dataclasses import dataclass

from breakgraph.models.config import ModelConfig

SLIDING, FULL = "sliding_attention", "full_attention"
MOE_KEYS = ("num_experts", "top_k_experts", "moe_intermediate_size")
# HF's defaults when a config has no rope_parameters
DEFAULT_ROPE = {
    SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
    FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
}


@dataclass(frozen=True)
class Gemma4Layer:
    """One decoder layer's attention geometry and KV role, resolved from the text config."""

    layer_type: str  # SLIDING or FULL
    head_dim: int
    num_kv_heads: int
    sliding_window: int | None  # None on full layers
    kv_layer: int  # the KV layer it reads: its own index, or its source's if it shares KV
    shares_kv: bool  # no k/v projections, stores no KV
    k_eq_v: bool  # v is k's projection (no v_proj)
    intermediate_size: int


def gemma4_layers(config: ModelConfig) -> list[Gemma4Layer]:
    """Per-layer settings as HF's Gemma4TextConfig resolves them (``per_layer_config`` or
    ``global_head_dim``/``num_global_key_value_heads``, ``kv_sharing_modes``)."""
    raw = config.raw
    n = config.num_hidden_layers
    if raw.get("enable_moe_block"):
        missing = [k for k in MOE_KEYS if not raw.get(k)]
        if missing:
            raise ValueError(f"enable_moe_block needs {', '.join(missing)} in the config")
    if raw.get("use_bidirectional_attention") == "all":
        raise NotImplementedError("Gemma 4 with use_bidirectional_attention='all'")
    if raw.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        raise NotImplementedError(f"hidden_activation {raw['hidden_activation']!r}")
    types = list(raw.get("layer_types") or [SLIDING if (i + 1) % 6 else FULL for i in range(n)])
    if len(types) != n or set(types) - {SLIDING, FULL}:
        raise ValueError(f"layer_types must hold {n} of {SLIDING!r}/{FULL!r}, got {types}")
    types[-1] = FULL  # HF forces it (with a warning)

    if "per_layer_config" in raw:
        overrides = {int(k): dict(v) for k, v in (raw["per_layer_config"] or {}).items()}
    else:
        full = {"head_dim": raw.get("global_head_dim") or 512}
        if raw.get("attention_k_eq_v") and raw.get("num_global_key_value_heads") is not None:
            full["num_key_value_heads"] = raw["num_global_key_value_heads"]
        overrides = {i: full for i, t in enumerate(types) if t == FULL}
    for i, o in overrides.items():
        if set(o) - {"head_dim", "num_key_value_heads"}:
            raise NotImplementedError(f"per_layer_config of layer {i} overrides {sorted(o)}")

    num_shared = raw.get("num_kv_shared_layers") or 0
    first_shared = n - num_shared
    if first_shared <= 0:
        raise NotImplementedError("every layer KV-shared (a draft model): no layer stores KV")
    sources = {
        t: max((i for i in range(first_shared) if types[i] == t), default=None) for t in types
    }
    if None in sources.values():
        raise ValueError("a KV-shared layer type has no earlier layer of its type to read KV from")

    layers = []
    for i, t in enumerate(types):
        o = overrides.get(i, {})
        shares = i >= first_shared
        double = shares and bool(raw.get("use_double_wide_mlp"))
        layers.append(
            Gemma4Layer(
                layer_type=t,
                head_dim=o.get("head_dim", config.head_dim),
                num_kv_heads=o.get("num_key_value_heads", config.num_key_value_heads),
                sliding_window=raw.get("sliding_window", 512) if t == SLIDING else None,
                kv_layer=sources[t] if shares else i,
                shares_kv=shares,
                k_eq_v=bool(raw.get("attention_k_eq_v")) and t == FULL,
                intermediate_size=config.intermediate_size * (2 if double else 1),
            )
        )
    for i, layer in enumerate(layers):
        src = layers[layer.kv_layer]
        if (layer.head_dim, layer.num_kv_heads) != (src.head_dim, src.num_kv_heads):
            raise ValueError(f"layer {i} reads the KV of layer {layer.kv_layer}, of another shape")
    return layers
