"""The step metadata every attention kernel reads: which keys each request has and which
query rows are its. Built once per step (``ForwardBatch.attention_meta``); torch only."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class AttentionMeta:
    """Request r's keys are ``req_to_token[req_pool_indices[r], :seq_lens[r]]``; its query
    rows are ``extend_start_loc[r] : + extend_lens[r]``, the last ``extend_lens[r]``
    positions of its sequence.

    The tensors live on the model's device and are read there; the bounds are host-known
    launch sizes: ``max_extend_len`` may overestimate, ``max_seq_len`` (an upper bound of
    ``seq_lens``, None: unknown) lets the Triton extend kernel split long prefixes.
    """

    req_to_token: torch.Tensor  # [max_reqs, max_context] int32, the KV slot of each position
    req_pool_indices: torch.Tensor  # [B] int64, each request's row of req_to_token
    seq_lens: torch.Tensor  # [B] int32, prefix + new tokens
    extend_start_loc: torch.Tensor  # [B] int32, first query row of each request
    extend_lens: torch.Tensor  # [B] int32, query rows (new tokens) of each request
    max_extend_len: int
    max_seq_len: int | None = None
    # the exact host lengths where the host knows them (extend steps; None: bounds only),
    # for kernels that plan on the host (kernels/flashinfer_extend.py)
    extend_lens_cpu: Sequence[int] | None = None
    seq_lens_cpu: Sequence[int] | None = None

    @classmethod
    def decode(
        cls,
        req_to_token: torch.Tensor,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        max_seq_len: int | None = None,
    ) -> AttentionMeta:
        """One query row per request, row b being request b's (allocates the ones/arange)."""
        batch, device = req_pool_indices.shape[0], req_pool_indices.device
        return cls(
            req_to_token,
            req_pool_indices,
            seq_lens,
            extend_start_loc=torch.arange(batch, dtype=torch.int32, device=device),
            extend_lens=torch.ones(batch, dtype=torch.int32, device=device),
            max_extend_len=1,
            max_seq_len=max_seq_len,
        )
