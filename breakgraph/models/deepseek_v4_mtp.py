"""DeepSeek V4's multi-token prediction (MTP) layers: the drafts of ``--speculative-algorithm
NEXTN``. HF's twin drops them (``mtp.*`` is ignored on load); the structure is the original
checkpoint's, as vLLM's ``deepseek_v4_mtp.py`` reads it.

MTP row p predicts token p + 2 from the target's residual streams at p (before the hyper
head: ``hc_mult`` streams) and the embedding of token p + 1: each is normed (``hnorm``,
``enorm``), projected (``h_proj`` per stream, ``e_proj`` added to every stream), and the
sum goes through one V4 decoder layer (sliding-window attention: the config's
``compress_ratios`` entry after the last layer is 0), the layer's own hyper head, the
shared norm and LM head. Its output streams are the next draft step's input in place of the
target's. The embedding at position 0 is masked (as vLLM does).

The layer's KV (one K = V head) lives in a pool of its own indexed by the target's slots
(engine/mtp.py); it keeps no per-request state.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from breakgraph.layers.linear import ReplicatedLinear
from breakgraph.models.config import ModelConfig
from breakgraph.models.deepseek_v4_attention import DeepseekV4RMSNorm, DeepseekV4RotaryEmbedding
from breakgraph.models.deepseek_v4_config import SLIDING, V4Layout
from breakgraph.models.deepseek_v4_layers import DeepseekV4DecoderLayer, DeepseekV4HyperHead
from breakgraph.models.deepseek_v4_step import begin_rows


class DeepseekV4MTPLayer(nn.Module):
    """One MTP layer (checkpoint ``mtp.{i}.*``)."""

    def __init__(self, config: ModelConfig, layout: V4Layout):
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.hc_mult = config.raw.get("hc_mult", 4)
        self.hidden_size = h
        self.enorm = DeepseekV4RMSNorm(h, eps)
        self.hnorm = DeepseekV4RMSNorm(h, eps)
        self.e_proj = ReplicatedLinear(h, h)
        self.h_proj = ReplicatedLinear(h, h)
        self.block = DeepseekV4DecoderLayer(config, layout, 0)  # its KV: the pool's layer 0
        self.hc_head = DeepseekV4HyperHead(config)
        self.norm = DeepseekV4RMSNorm(h, eps)  # the shared head's norm

    def forward(self, embeds, positions, streams, rotary, input_ids) -> torch.Tensor:
        """embeds [T, H] (of the next tokens), streams [T, hc_mult * H] -> the same."""
        embeds = torch.where((positions == 0)[:, None], 0, embeds)
        prev = self.hnorm(streams.view(-1, self.hc_mult, self.hidden_size))
        x = self.h_proj(prev) + self.e_proj(self.enorm(embeds)).unsqueeze(1)
        return self.block(x, input_ids, rotary).flatten(1)


def mtp_layout(layout: V4Layout) -> V4Layout:
    """An MTP layer's schedule: one sliding-window layer with a scored (not hashed) MoE."""
    return V4Layout(
        (SLIDING,), ("moe",), layout.compress_rates, layout.rope_dim, layout.rope_main,
        layout.rope_compress,
    )  # fmt: skip


class DeepseekV4MTP(nn.Module):
    """The target's MTP layers, the embedding and LM head shared with it (not registered here:
    loaded and counted once, as the target's). The draft step ``j`` runs layer ``j mod n``."""

    # K is V: the pool holds one buffer for both
    kv_k_is_v = True

    def __init__(self, config: ModelConfig, layout: V4Layout, embed_tokens, lm_head):
        super().__init__()
        n = config.raw.get("num_nextn_predict_layers", 0)
        if n < 1:
            raise ValueError("the model has no MTP layers (num_nextn_predict_layers is 0)")
        self.config = config
        own = mtp_layout(layout)
        self.layers = nn.ModuleList([DeepseekV4MTPLayer(config, own) for _ in range(n)])
        self.rotary_emb = DeepseekV4RotaryEmbedding(own)
        self._shared = (embed_tokens, lm_head)  # a tuple: not submodules

    @property
    def stream_width(self) -> int:
        """Columns of a row of streams (the target's forward output with MTP on)."""
        layer = self.layers[0]
        return layer.hc_mult * layer.hidden_size

    def kv_cache_shapes(self) -> list[tuple[int, int]]:
        """Each layer's K = V head. Every draft step writes the same one pool layer: the KV of
        an MTP position is the last layer's that drafted there (one layer: V4's)."""
        return [(1, self.config.head_dim)]

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, streams: torch.Tensor, step: int
    ) -> torch.Tensor:
        """The next tokens [T], their positions minus one [T] and the streams there
        [T, hc_mult * H] -> the layer's output streams [T, hc_mult * H]."""
        begin_rows(self.rotary_emb, positions)
        embeds = self._shared[0](input_ids)
        layer = self.layers[step % len(self.layers)]
        return layer(embeds, positions, streams, self.rotary_emb, input_ids)

    def compute_logits(self, streams: torch.Tensor, step: int = 0) -> torch.Tensor:
        layer = self.layers[step % len(self.layers)]
        hidden = layer.norm(layer.hc_head(streams.view(-1, layer.hc_mult, layer.hidden_size)))
        return self._shared[1](hidden).float()


# the original checkpoint's names inside ``mtp.{i}.`` -> this module's (the rest is the block,
# named as a decoder layer's); its own copies of the embedding and head are the target's
_OWN = {
    "hc_head_fn": "hc_head.hc_fn",
    "hc_head_base": "hc_head.hc_base",
    "hc_head_scale": "hc_head.hc_scale",
    "norm.weight": "norm.weight",
    "enorm.weight": "enorm.weight",
    "hnorm.weight": "hnorm.weight",
    "e_proj.weight": "e_proj.weight",
    "h_proj.weight": "h_proj.weight",
}
_SHARED_COPIES = ("emb.", "embed.", "embed_tokens.", "head.", "shared_head.head.")
MTP_NAME = re.compile(r"^(?:model\.)?mtp\.(\d+)\.(.+)$")


def mtp_weight_name(name: str, layer_name) -> str | None:
    """A checkpoint tensor ``mtp.{i}.X``'s parameter name under the target's ``mtp`` module
    (``layer_name`` renames a decoder layer's tensor as the target's loader does), or None
    for the MTP's copies of the shared embedding and head."""
    m = MTP_NAME.match(name)
    i, rest = m[1], m[2]
    if rest.startswith(_SHARED_COPIES):
        return None
    if rest in _OWN:
        return f"mtp.layers.{i}.{_OWN[rest]}"
    block = layer_name(f"layers.0.{rest}").removeprefix("model.layers.0.")
    return f"mtp.layers.{i}.block.{block}"
