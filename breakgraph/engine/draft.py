"""A draft model for speculative decoding (``--speculative-algorithm STANDALONE``): a smaller
model with the target's vocabulary that drafts each request's next tokens greedily.

Its KV lives in a pool of its own, indexed by the target's slots and request table: the
token at slot s has the draft's keys at slot s of the draft pool. So the draft needs no
allocator, radix tree or table of its own, and a radix hit is a hit for both. Every target
step but a verify step is *mirrored* (the draft runs the same batch, writing its KV for the
same rows); a verify step's rows are the draft's own steps, so their KV is written as they
draft: the request's last token and its first ``k - 1`` draft tokens. When a request keeps
all ``k`` draft tokens, the last one has no draft KV yet: the request's next round starts one
row earlier (``Req.draft_hole``) and writes it. A draft slot left stale otherwise (all kept,
then a plain step) only lowers the acceptance rate: the target verifies every token.

The draft is greedy, so its distribution is a point mass and the target's acceptance
(speculative.verify_sample) keeps plain sampling's distribution at any temperature.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from breakgraph.cache.kv_pool import KVPool
from breakgraph.engine.model_runner import ModelRunner
from breakgraph.engine.prefill import extend_batch
from breakgraph.engine.spec_chain import device_batch
from breakgraph.forward_batch import ForwardBatch, ForwardMode, upload_many
from breakgraph.models.loader import load_model

logger = logging.getLogger(__name__)


def load_draft_model(args, device: torch.device, target_config, context_len: int):
    """The draft model ``--speculative-draft-model-path`` names, checked against the target:
    the same vocabulary, a context as long, no per-request state; one line if not."""
    path = args.speculative_draft_model_path
    if not path:
        raise ValueError(
            "--speculative-algorithm STANDALONE is not supported without "
            "--speculative-draft-model-path (the draft model)"
        )
    loaded = load_model(path, args.load_format, args.dtype, device, args.seed, context_len)
    model, cfg = loaded.model, loaded.config
    why = None
    if cfg.vocab_size != target_config.vocab_size:
        why = f"its vocabulary ({cfg.vocab_size} tokens) is not the target's "
        why += f"({target_config.vocab_size})"
    elif cfg.max_position_embeddings < context_len:
        why = f"its context ({cfg.max_position_embeddings}) is shorter than {context_len}"
    elif getattr(model, "request_state_shapes", None) and model.request_state_shapes():
        why = "it keeps per-request state beside its KV"
    elif getattr(model, "forward_logits_rows", None) is not None:
        why = "it bounds its forward to the last rows (KV sharing)"
    if why:
        raise ValueError(f"--speculative-draft-model-path {path}: {why}")
    logger.info("draft model %s (%s) for STANDALONE speculation", loaded.source, cfg.architecture)
    return model


class DraftModel:
    """The draft's runner over its own KV pool and the target's request table: ``mirror``
    a target step, ``propose`` a verify step's drafts on the device."""

    def __init__(self, model, kv_pool: KVPool, req_pool, device: torch.device):
        self.runner = ModelRunner(model, kv_pool, req_pool.table)
        self.req_pool = req_pool
        self.device = device

    @property
    def kv_pool(self) -> KVPool:
        return self.runner.kv_pool

    def mirror(self, batch: ForwardBatch, reqs=None) -> None:
        """The draft's KV for a target step's rows (its logits are not used)."""
        self.runner.forward(batch)

    def hold(self, verify) -> None:
        """Nothing of a verify step's target forward is needed."""

    def accepted(self, verify, kept: list[int | None]) -> None:
        """A request that kept all its draft tokens has no draft KV for the last one: its
        next round starts one row earlier (``propose``)."""
        for req, draft, n, p in zip(verify.reqs, verify.drafts, kept, verify.prefixes,
                                    strict=True):  # fmt: skip
            if n is not None and draft.size and n == len(draft):
                req.draft_hole = p + n  # its last draft token's position

    def propose(self, reqs, lens: list[int], prefixes: list[int]) -> torch.Tensor:
        """Drafts [len(reqs), max(lens)] int64 on the device: request i's first ``lens[i]``
        tokens drafted greedily from its last token at position ``prefixes[i]``, whose KV
        slots (``prefixes[i]`` onwards) its request already holds and the table has. No
        host sync: step j feeds step j - 1's argmax."""
        n, k = len(reqs), max(lens)
        drafts = torch.zeros(n, k, dtype=torch.int64, device=self.device)
        live = [i for i in range(n) if lens[i] > 0]
        # step 0: each request's last token, one row earlier where its last kept draft
        # token has no draft KV yet
        ids, slot_rows, pre, ext = [], [], [], []
        for i in live:
            req, at = reqs[i], prefixes[i]
            lag = 1 if req.draft_hole == at - 1 else 0
            req.draft_hole = -1
            ids += [*req.fill_prefix(at, at - lag).tolist(), req.output_ids[-1]]
            slot_rows.append(req.kv_slots[at - lag : at + 1])
            pre.append(at - lag)
            ext.append(1 + lag)
        rows = [reqs[i].req_pool_idx for i in live]
        batch = extend_batch(
            np.asarray(ids, dtype=np.int32), torch.cat(slot_rows), rows, pre, ext,
            self.req_pool, self.device,
        )  # fmt: skip
        batch.decode_rows = True
        (idx,) = upload_many([live], torch.int64, self.device)
        drafts[idx, 0] = self.runner.forward(batch).argmax(dim=-1)
        for j in range(1, k):
            live = [i for i in live if lens[i] > j]
            slots = torch.stack([reqs[i].kv_slots[prefixes[i] + j] for i in live])
            batch = ForwardBatch.build(
                ForwardMode.DECODE, np.zeros(len(live), dtype=np.int64), slots,
                [reqs[i].req_pool_idx for i in live], [prefixes[i] + j for i in live],
                [1] * len(live), self.device,
            )  # fmt: skip
            (idx,) = upload_many([live], torch.int64, self.device)
            batch.input_ids = drafts[idx, j - 1]
            drafts[idx, j] = self.runner.forward(batch).argmax(dim=-1)
        return drafts

    def propose_chained(self, reqs, lens: list[int], base, prev, last) -> torch.Tensor:
        """``propose`` for a verify step chained to the one still on the device
        (engine/spec_chain.py): request i's last token ``last[i]`` at position ``base[i]``
        and the token before it ``prev[i]`` (device tensors). Its first step always runs
        both rows (the one before has no draft KV when the step before kept every draft);
        the positions, and the KV slots the table holds there, are gathered on the device."""
        n, k = len(reqs), max(lens)
        drafts = torch.zeros(n, k, dtype=torch.int64, device=self.device)
        live = [i for i in range(n) if lens[i] > 0]
        for req in reqs:
            req.draft_hole = -1
        if not live:
            return drafts
        table = self.req_pool.table
        upper = [reqs[i].kv_len for i in live]  # bounds of the positions
        rows = [reqs[i].req_pool_idx for i in live]
        (idx,) = upload_many([live], torch.int64, self.device)
        ids = torch.stack([prev[idx], last[idx]], dim=1).flatten()
        batch = device_batch(
            ForwardMode.EXTEND, table, rows, base[idx] - 1, [2] * len(live), upper, ids, False
        )
        batch.decode_rows = True
        drafts[idx, 0] = self.runner.forward(batch).argmax(dim=-1)
        for j in range(1, k):
            keep = [m for m, i in enumerate(live) if lens[i] > j]
            live = [live[m] for m in keep]
            (idx,) = upload_many([live], torch.int64, self.device)
            batch = device_batch(
                ForwardMode.DECODE, table, [reqs[i].req_pool_idx for i in live], base[idx] + j,
                [1] * len(live), [reqs[i].kv_len for i in live], drafts[idx, j - 1], False,
            )  # fmt: skip
            drafts[idx, j] = self.runner.forward(batch).argmax(dim=-1)
        return drafts
