"""Mixture-of-experts layer: E gated MLPs stacked into ``[E, ...]`` tensors (HF 5's layout).

``FusedMoE`` holds the experts as HF's ``*Experts`` modules do (``gate_up_proj`` [E, 2I, H],
gate rows first, ``down_proj`` [E, H, I]) and runs them through ``ops.fused_experts``: the
per-expert loop on the CPU, the fused Triton kernels on CUDA (capturable, no host sync).
Routers differ by model and stay in the model files; they end in ``ops.moe_route``.

Checkpoints hold either HF's per-expert tensors (``experts.{i}.gate_proj.weight`` ..., what
``save_pretrained`` writes for Qwen3-MoE) or the stacked tensors under the module's own
names; :class:`ExpertWeights` copies the former into their rows.
"""

from __future__ import annotations

import re
from collections import defaultdict

import torch
from torch import nn

from breakgraph.kernels import ops


class FusedMoE(nn.Module):
    def __init__(
        self, num_experts: int, hidden_size: int, intermediate_size: int, activation: str = "silu"
    ):
        super().__init__()
        self.num_experts = num_experts
        self.intermediate_size = intermediate_size
        self.activation = activation
        self.gate_up_proj = nn.Parameter(
            torch.empty(num_experts, 2 * intermediate_size, hidden_size)
        )
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

    def forward(
        self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        """x [T, H] and its routing [T, K] -> sum_k weight_k * expert_k(x) [T, H]."""
        return ops.fused_experts(
            x, self.gate_up_proj, self.down_proj, topk_weights, topk_ids, self.activation
        )

    def expert_rows(self, proj: str) -> tuple[str, slice]:
        """The parameter and its rows (of one expert's slice) holding HF's ``{proj}_proj``."""
        i = self.intermediate_size
        return {
            "gate": ("gate_up_proj", slice(0, i)),
            "up": ("gate_up_proj", slice(i, 2 * i)),
            "down": ("down_proj", slice(None)),
        }[proj]


_PER_EXPERT = re.compile(
    r"(?P<module>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>gate|up|down)_proj\.weight"
)


class ExpertWeights:
    """Loads HF's per-expert tensors into the stacked parameters of a model's ``FusedMoE``
    modules; reports a stacked parameter loaded only once every expert's shards arrived."""

    def __init__(self, model: nn.Module):
        self.modules = {n: m for n, m in model.named_modules() if isinstance(m, FusedMoE)}
        self._shards: dict[str, set[tuple[int, str]]] = defaultdict(set)

    def load(self, name: str, tensor: torch.Tensor) -> bool:
        """Copy ``name`` if it is a per-expert tensor of one of the modules; else False."""
        m = _PER_EXPERT.fullmatch(name)
        if m is None or m["module"] not in self.modules:
            return False
        module = self.modules[m["module"]]
        expert, proj = int(m["expert"]), m["proj"]
        if expert >= module.num_experts:
            raise KeyError(
                f"checkpoint tensor {name!r}: the layer has {module.num_experts} experts"
            )
        param, rows = module.expert_rows(proj)
        getattr(module, param).data[expert, rows].copy_(tensor)
        self._shards[f"{m['module']}.{param}"].add((expert, proj))
        return True

    def loaded(self) -> set[str]:
        """Names of the stacked parameters filled for every expert (shards of all others are
        missing: the loader reports those parameters as absent)."""
        done = set()
        for name, shards in self._shards.items():
            module = self.modules[name.rsplit(".", 1)[0]]
            projs = ("gate", "up") if name.endswith("gate_up_proj") else ("down",)
            if len(shards) == module.num_experts * len(projs):
                done.add(name)
        return done
