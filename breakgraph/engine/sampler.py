"""Batched sampling: greedy, temperature, top-k, top-p, min-p, per-request seeds.

Runs on the device without host syncs: parameters go up in one pinned copy, sampling
uses the exponential-race trick (argmax of p / Exp(1)) instead of multinomial. The filters
hold about ten [rows, V] temporaries (the sort's values and int64 ids, the cumulative sum,
the masks, the noise), so a large batch is sampled ``MAX_SAMPLE_FLOATS // V`` rows at a
time: at 1,024 rows of Gemma 4's 262,144-token vocabulary the unchunked peak was ~13 GiB,
which the memory plan had to keep free beside the KV pool.
"""

from __future__ import annotations

import math

import torch

from breakgraph.common.sampling_params import MAX_EFFECTIVE_TEMPERATURE
from breakgraph.engine.request import SamplingParams
from breakgraph.forward_batch import upload_many

MAX_SAMPLE_FLOATS = 1 << 24  # a chunk of rows' [rows, V] temporary: 64 MiB of float32
TOP_K_FAST = 1024  # a row with a top_k up to this draws among its top-k: no full sort


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    return_logprob: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """logits [B, V] float32 -> (token ids [B] int64, logprobs [B] of those ids or None)."""
    rows = max(1, MAX_SAMPLE_FLOATS // max(logits.shape[-1], 1))
    if logits.shape[0] > rows:  # a chunk of rows at a time (module docstring)
        parts = [
            sample(logits[i : i + rows], params[i : i + rows], generators[i : i + rows],
                   return_logprob)
            for i in range(0, logits.shape[0], rows)
        ]  # fmt: skip
        ids = torch.cat([p[0] for p in parts])
        return ids, torch.cat([p[1] for p in parts]) if return_logprob else None
    greedy = [p.greedy for p in params]
    greedy_ids = logits.argmax(dim=-1) if any(greedy) else None  # a pass over the vocabulary
    if all(greedy):
        ids = greedy_ids
    else:
        ids = _sample_stochastic(logits, params, generators, greedy_ids)
    logprobs = None
    if return_logprob:
        logprobs = torch.log_softmax(logits, dim=-1).gather(1, ids[:, None]).squeeze(1)
    return ids, logprobs


def _sample_stochastic(logits, params, generators, greedy_ids):
    """Sampled rows bounded by a ``top_k`` of at most ``TOP_K_FAST`` draw among their top-k
    (a top-k, not a sort of the vocabulary); the others through ``filtered_probs``. Which
    path a row takes depends on its own parameters only, so a seeded request draws the same
    tokens whatever shares its batch."""
    fast = [_top_k_bounded(p) for p in params]
    if all(f or p.greedy for f, p in zip(fast, params, strict=True)):
        return _sample_top_k(logits, params, generators, greedy_ids)
    if not any(fast):
        return _sample_sorted(logits, params, generators, greedy_ids)
    # a mixed batch: each part on its path, the ids back in their rows
    parts = [[i for i, f in enumerate(fast) if f], [i for i, f in enumerate(fast) if not f]]
    rows = upload_many(parts, torch.int64, logits.device)
    sampled = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
    for sample_part, part, at in zip((_sample_top_k, _sample_sorted), parts, rows, strict=True):
        sampled[at] = sample_part(
            logits[at], [params[i] for i in part], [generators[i] for i in part],
            None if greedy_ids is None else greedy_ids[at],
        )  # fmt: skip
    return sampled


def _top_k_bounded(p: SamplingParams) -> bool:
    return not p.greedy and 0 < p.top_k <= TOP_K_FAST


def _sample_sorted(logits, params, generators, greedy_ids):
    probs, greedy = filtered_probs(logits, params)
    sampled = (probs / exponential_noise(probs, generators)).argmax(dim=-1)
    if not any(p.greedy for p in params):
        return sampled
    return torch.where(greedy.bool(), greedy_ids, sampled)


def _sample_top_k(logits, params, generators, greedy_ids):
    """Rows whose every filter is bounded by their ``top_k`` (greedy rows: one candidate,
    then their argmax, ``greedy_ids``): the softmax over the vocabulary, its top
    ``max(top_k)`` in order, then ``filtered_probs``' top-k, top-p and min-p rules on those
    and the race among the kept. A seeded row draws ``top_k`` noise values from its generator
    (what it keeps at most), however many the batch's largest top-k asks for."""
    temps, top_ps, min_ps, top_ks, greedy = _upload_params(params, logits.shape[-1], logits.device)
    k = min(max(p.top_k if _top_k_bounded(p) else 1 for p in params), logits.shape[-1])
    probs = torch.softmax(logits / temps[:, None], dim=-1)
    vals, ids = probs.topk(k, dim=-1)
    sampled_rows = [p for p in params if not p.greedy]
    vals = _drop_sorted(
        vals, top_ks, top_ps,
        any(p.top_k != k for p in sampled_rows),  # a row keeping fewer than k
        any(p.top_p < 1.0 for p in sampled_rows),
    )  # fmt: skip
    if any(p.min_p > 0 for p in params):  # the most likely is never dropped: column 0
        vals = vals.masked_fill(vals < min_ps[:, None] * vals[:, :1], 0.0)
    noise = torch.empty_like(vals).exponential_()
    for row, (gen, p) in enumerate(zip(generators, params, strict=True)):
        if gen is not None and _top_k_bounded(p):
            noise[row, : p.top_k].exponential_(generator=gen)
    sampled = ids.gather(1, (vals / noise).argmax(dim=-1, keepdim=True)).squeeze(1)
    if not any(p.greedy for p in params):
        return sampled
    return torch.where(greedy.bool(), greedy_ids, sampled)


def exponential_noise(probs: torch.Tensor, generators: list[torch.Generator | None]):
    """Exp(1) noise shaped like ``probs``; a seeded row draws from its own generator."""
    noise = torch.empty_like(probs).exponential_()  # one launch for unseeded rows
    for row, gen in enumerate(generators):
        if gen is not None:  # seeded rows draw from their own generator, reproducibly
            noise[row].exponential_(generator=gen)
    return noise


def filtered_probs(
    logits: torch.Tensor, params: list[SamplingParams]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the rows' sampling weights after temperature, top-k, top-p and min-p: softmax values
    with the filtered ones zeroed, not renormalized; 1.0 where a row is greedy, else 0.0)."""
    device = logits.device
    temps, top_ps, min_ps, top_ks, greedy = _upload_params(params, logits.shape[-1], device)
    probs = torch.softmax(logits / temps[:, None], dim=-1)
    with_top_k, with_top_p = any(p.top_k > 0 for p in params), any(p.top_p < 1.0 for p in params)
    if with_top_k or with_top_p:
        sorted_probs, sorted_idx = probs.sort(dim=-1, descending=True)
        sorted_probs = _drop_sorted(sorted_probs, top_ks, top_ps, with_top_k, with_top_p)
        probs = torch.zeros_like(probs).scatter_(1, sorted_idx, sorted_probs)
    if any(p.min_p > 0 for p in params):
        max_p = probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < min_ps[:, None] * max_p, 0.0)
    return probs, greedy


def _drop_sorted(vals, top_ks, top_ps, with_top_k: bool, with_top_p: bool) -> torch.Tensor:
    """Each row's values in descending order [B, n] with what its ``top_k`` and ``top_p``
    drop zeroed (not renormalized); only the masks asked for run (a lone request's step:
    fewer launches)."""
    if not (with_top_k or with_top_p):
        return vals
    ranks = torch.arange(vals.shape[-1], device=vals.device)[None, :]
    drop = ranks >= top_ks[:, None] if with_top_k else None
    if with_top_p:
        # drop a token once the mass strictly before it already reaches top_p; never the most
        # likely one (a top_p below float32's smallest value rounds to 0: it would drop all)
        beyond = ((vals.cumsum(dim=-1) - vals) >= top_ps[:, None]) & (ranks > 0)
        drop = beyond if drop is None else drop | beyond
    return vals.masked_fill(drop, 0.0)


def _upload_params(params: list[SamplingParams], vocab: int, device: torch.device):
    """(temperature, top_p, min_p, top_k (the vocabulary where unset), greedy as 1.0) per
    row, float32, in one upload."""
    return upload_many(
        [
            [
                min(p.temperature, MAX_EFFECTIVE_TEMPERATURE) if p.temperature > 0 else 1.0
                for p in params
            ],
            # 1.0 keeps every token: never a tail the cumulative sum's rounding reaches 1.0
            # at (the top-p mask runs only where a row of the batch asks for it)
            [p.top_p if p.top_p < 1.0 else math.inf for p in params],
            [p.min_p for p in params],
            [p.top_k if p.top_k > 0 else vocab for p in params],
            [float(p.greedy) for p in params],
        ],
        torch.float32,
        device,
    )
