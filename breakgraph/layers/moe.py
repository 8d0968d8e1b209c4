"""Mixture-of-experts layer: E gated MLPs stacked into ``[E, ...]`` tensors (HF 5's layout).

``FusedMoE`` holds the experts as HF's ``*Experts`` modules do (``gate_up_proj`` [E, 2I, H],
gate rows first, ``down_proj`` [E, H, I]) and runs them through ``ops.fused_experts``: the
per-expert loop on the CPU, the fused Triton kernels on CUDA (capturable, no host sync).
Routers differ by model and stay in the model files; they end in ``ops.moe_route``.

Tensor parallel (built under ``tp_group_scope``), as SGLang's and vLLM's: the experts are
split by intermediate size, every rank runs the routing it was given over its slices, and one
all-reduce sums the ranks' outputs.

Checkpoints hold either HF's per-expert tensors (``experts.{i}.gate_proj.weight`` ..., what
``save_pretrained`` writes for Qwen3-MoE) or the stacked tensors under the module's own
names; :class:`ExpertWeights` copies the former into their rows through the parameters'
``weight_loader`` (this rank's slice, read lazily from a safetensors slice under TP).
"""

from __future__ import annotations

import re
from collections import defaultdict

import torch
from torch import nn

from breakgraph.distributed import get_tp_group
from breakgraph.kernels import ops
from breakgraph.layers.linear import divide_for_tp, narrow, sharded_param


class FusedMoE(nn.Module):
    """E experts over the TP group current when built: each rank holds every expert's slice
    of the intermediate dim (gate rows and up rows each sliced, down's columns) and its
    output is all-reduced once, as a row-parallel layer's. TP1: the full experts."""

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        activation: str = "silu",
        swiglu_limit: float | None = None,
    ):
        """``swiglu_limit`` L (DeepSeek V4): gate clamped to at most L, up to [-L, L]."""
        super().__init__()
        self.swiglu_limit = swiglu_limit
        self.tp = get_tp_group()
        self.num_experts = num_experts
        self.intermediate_size = intermediate_size
        self.inter_per_rank = n = divide_for_tp(
            intermediate_size, self.tp.size, "MoE intermediate size"
        )
        self.activation = activation
        self.gate_up_proj = sharded_param(
            (num_experts, 2 * n, hidden_size),
            self.weight_loader,
            (num_experts, 2 * intermediate_size, hidden_size),
        )
        self.down_proj = sharded_param(
            (num_experts, hidden_size, n),
            self.weight_loader,
            (num_experts, hidden_size, intermediate_size),
        )

    def weight_loader(
        self, param: nn.Parameter, loaded, shard_id: str | None = None, expert: int | None = None
    ) -> None:
        """This rank's slice of a stacked tensor (``shard_id`` None: [E, 2I, H] or [E, H, I])
        or of one expert's HF tensor (``shard_id`` "gate", "up" or "down" and ``expert``).
        ``loaded``: a tensor or a lazy safetensors slice."""
        n, start = self.inter_per_rank, self.tp.rank * self.inter_per_rank
        if shard_id is None:
            if param is self.down_proj:
                param.data.copy_(narrow(loaded, 2, start, n))
            else:
                i = self.intermediate_size
                param.data[:, :n].copy_(narrow(loaded, 1, start, n))
                param.data[:, n:].copy_(narrow(loaded, 1, i + start, n))
            return
        if shard_id == "down":
            param.data[expert].copy_(narrow(loaded, 1, start, n))
        else:
            at = 0 if shard_id == "gate" else n
            param.data[expert, at : at + n].copy_(narrow(loaded, 0, start, n))

    def forward(
        self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        """x [T, H] and its routing [T, K] -> sum_k weight_k * expert_k(x) [T, H]."""
        out = ops.fused_experts(
            x, self.gate_up_proj, self.down_proj, topk_weights, topk_ids, self.activation,
            self.swiglu_limit,
        )  # fmt: skip
        return self.tp.all_reduce(out)


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
        param = "down_proj" if proj == "down" else "gate_up_proj"
        weight = getattr(module, param)
        weight.weight_loader(weight, tensor, proj, expert)
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
