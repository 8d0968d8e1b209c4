"""Tensor-parallel linear layers and vocab-parallel embedding / LM head, as SGLang's and vLLM's.

Each layer shards over the TP group current when it is built (``get_tp_group()``). With TP
size 1 a layer holds the full ``weight`` (and ``bias``) under nn.Linear's / nn.Embedding's
names and computes exactly what they compute.

Every parameter carries ``weight_loader(param, tensor, shard_id=None)`` that copies this
rank's slice of a full checkpoint tensor. ``tensor`` is a torch tensor or a lazy
safetensors slice (``safe_open(...).get_slice(name)``): only the slice is read from disk.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from breakgraph.distributed import get_tp_group
from breakgraph.kernels import ops


def full(loaded) -> torch.Tensor:
    """The whole tensor of a torch tensor or a lazy safetensors slice."""
    return loaded if isinstance(loaded, torch.Tensor) else loaded[:]


def narrow(loaded, dim: int, start: int, length: int) -> torch.Tensor:
    """``loaded[..., start:start+length, ...]`` along ``dim``; reads only that from a lazy slice."""
    if isinstance(loaded, torch.Tensor):
        return loaded.narrow(dim, start, length)
    index = (slice(None),) * dim + (slice(start, start + length),)
    return loaded[index]


def default_weight_loader(param: nn.Parameter, loaded, shard_id=None) -> None:
    """A replicated parameter: the whole tensor."""
    param.data.copy_(full(loaded))


def divide_for_tp(n: int, d: int, what: str) -> int:
    if n % d:
        raise ValueError(f"{what} ({n}) is not divisible by the TP size ({d})")
    return n // d


def sharded_param(shape: tuple[int, ...], loader, full_shape_: tuple[int, ...]) -> nn.Parameter:
    p = nn.Parameter(torch.empty(shape), requires_grad=False)
    p.weight_loader = loader
    # the unsharded shape: dummy weights draw the full tensor and load their slice of it
    p.full_shape = full_shape_
    return p


class ReplicatedLinear(nn.Module):
    """y = x W^T (+ b) with the whole weight on every rank (nn.Linear's parameter names), on
    ``ops.linear`` like the sharded layers (the skinny GEMM where decode's shapes take it)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        shape = (out_features, in_features)
        self.weight = sharded_param(shape, default_weight_loader, shape)
        self.bias = (
            sharded_param((out_features,), default_weight_loader, (out_features,)) if bias else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.linear(x, self.weight, self.bias)


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with W's output rows split across ranks; each rank's y is its slice."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.tp = get_tp_group()
        self.out_per_rank = divide_for_tp(out_features, self.tp.size, "output features")
        self.weight = sharded_param(
            (self.out_per_rank, in_features), self.weight_loader, (out_features, in_features)
        )
        self.bias = (
            sharded_param((self.out_per_rank,), self.weight_loader, (out_features,))
            if bias
            else None
        )

    def weight_loader(self, param: nn.Parameter, loaded, shard_id=None) -> None:
        n = self.out_per_rank
        param.data.copy_(narrow(loaded, 0, self.tp.rank * n, n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.linear(x, self.weight, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Column-parallel over stacked outputs (gate_up: ``[gate; up]``): each part sharded on
    its own, so a rank holds ``[gate slice; up slice]``. shard_id: the part's index."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool = False):
        super().__init__(in_features, sum(out_sizes), bias)
        self.out_sizes = out_sizes
        self.part_per_rank = [divide_for_tp(s, self.tp.size, "output features") for s in out_sizes]

    def act_and_mul(self, x: torch.Tensor, activation: str) -> torch.Tensor:
        """``act(gate) * up`` of this ``[gate; up]`` projection of x (``activation``: "silu"
        or "gelu_tanh"; no bias): one launch where the skinny GEMM serves the shape."""
        assert self.bias is None and len(self.out_sizes) == 2
        return ops.linear_act_and_mul(x, self.weight, activation)

    def weight_loader(self, param: nn.Parameter, loaded, shard_id=None) -> None:
        if shard_id is None:  # the stacked full tensor (dummy weights)
            start = 0
            for i, size in enumerate(self.out_sizes):
                self.weight_loader(param, narrow(loaded, 0, start, size), i)
                start += size
            return
        n = self.part_per_rank[shard_id]
        at = sum(self.part_per_rank[:shard_id])
        param.data[at : at + n].copy_(narrow(loaded, 0, self.tp.rank * n, n))


def local_kv_heads(num_kv_heads: int, tp_size: int) -> int:
    """KV heads a rank holds: its share, or one replica when fewer KV heads than ranks."""
    if num_kv_heads >= tp_size:
        return divide_for_tp(num_kv_heads, tp_size, "KV heads")
    if tp_size % num_kv_heads:
        raise ValueError(f"TP size {tp_size} is not a multiple of the KV heads ({num_kv_heads})")
    return 1


class QKVParallelLinear(nn.Module):
    """q, k, v stacked: q heads split across ranks; KV heads split, or one replicated per
    rank (head ``rank * num_kv_heads // tp``) when there are fewer KV heads than ranks.
    shard_id: "q", "k" or "v". ``with_v=False``: q and k only (a model whose v is k)."""

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool,
        with_v: bool = True,
    ):
        super().__init__()
        self.tp = tp = get_tp_group()
        self.head_dim = head_dim
        self.num_heads = divide_for_tp(num_heads, tp.size, "attention heads")
        self.num_kv_heads = local_kv_heads(num_kv_heads, tp.size)
        if num_kv_heads >= tp.size:
            self.kv_head_start = tp.rank * self.num_kv_heads
        else:
            self.kv_head_start = tp.rank * num_kv_heads // tp.size
        parts = 2 if with_v else 1
        self.full_sizes = [num_heads * head_dim] + [num_kv_heads * head_dim] * parts
        local = (self.num_heads + parts * self.num_kv_heads) * head_dim
        self.out_per_rank = local
        self.weight = sharded_param(
            (local, hidden_size), self.weight_loader, (sum(self.full_sizes), hidden_size)
        )
        self.bias = (
            sharded_param((local,), self.weight_loader, (sum(self.full_sizes),)) if bias else None
        )

    def weight_loader(self, param: nn.Parameter, loaded, shard_id=None) -> None:
        d = self.head_dim
        if shard_id is None:  # the stacked full tensor (dummy weights)
            start = 0
            for sid, size in zip("qkv", self.full_sizes, strict=False):
                self.weight_loader(param, narrow(loaded, 0, start, size), sid)
                start += size
            return
        q, kv = self.num_heads * d, self.num_kv_heads * d
        if shard_id == "v" and len(self.full_sizes) == 2:
            raise ValueError("this q/k projection has no v shard (v is k)")
        if shard_id == "q":
            dst, src = param.data[:q], narrow(loaded, 0, self.tp.rank * q, q)
        else:
            at = q if shard_id == "k" else q + kv
            dst, src = param.data[at : at + kv], narrow(loaded, 0, self.kv_head_start * d, kv)
        dst.copy_(src)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """y = x W^T + b with W's input columns split across ranks: each rank multiplies its
    slice of x (the column-parallel layer's output) and one all-reduce sums the parts."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.tp = get_tp_group()
        # False: forward returns this rank's partial sum, which the layer after it reduces
        # (with its norm: TPGroup.all_reduce_add_rms_norm); set by that layer, bias-free only
        self.reduce_results = True
        self.in_per_rank = divide_for_tp(in_features, self.tp.size, "input features")
        self.weight = sharded_param(
            (out_features, self.in_per_rank), self.weight_loader, (out_features, in_features)
        )
        self.bias = (
            sharded_param((out_features,), default_weight_loader, (out_features,)) if bias else None
        )

    def weight_loader(self, param: nn.Parameter, loaded, shard_id=None) -> None:
        n = self.in_per_rank
        param.data.copy_(narrow(loaded, 1, self.tp.rank * n, n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.tp.is_parallel:
            return ops.linear(x, self.weight, self.bias)
        if not self.reduce_results:
            assert self.bias is None, "a partial sum with a bias would add it on every rank"
            return ops.linear(x, self.weight)
        y = self.tp.all_reduce(ops.linear(x, self.weight))
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Each rank holds a slice of the vocab (padded to a multiple of the TP size); a rank
    looks up the ids of its slice, zeros the others, and an all-reduce sums the ranks."""

    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__()
        self.tp = get_tp_group()
        self.num_embeddings = num_embeddings
        self.per_rank = -(-num_embeddings // self.tp.size)
        self.vocab_start = self.tp.rank * self.per_rank
        self.weight = sharded_param(
            (self.per_rank, embedding_dim), self.weight_loader, (num_embeddings, embedding_dim)
        )

    def weight_loader(self, param: nn.Parameter, loaded, shard_id=None) -> None:
        n = max(0, min(self.per_rank, self.num_embeddings - self.vocab_start))
        param.data[:n].copy_(narrow(loaded, 0, self.vocab_start, n))
        param.data[n:].zero_()  # padding rows past the vocab

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if not self.tp.is_parallel:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        mask = (local >= 0) & (local < self.per_rank)
        out = F.embedding(local.masked_fill(~mask, 0), self.weight)
        out.masked_fill_(~mask.unsqueeze(-1), 0.0)
        return self.tp.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """The LM head over the same vocab slices as VocabParallelEmbedding (so tying works): each
    rank computes its slice of the logits and an all-gather gives every rank the full row."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = ops.linear(hidden_states, self.weight)
        if not self.tp.is_parallel:
            return logits
        return self.tp.all_gather(logits)[..., : self.num_embeddings]
