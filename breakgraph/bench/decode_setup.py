"""The in-process decode benches' engine: dummy weights, decode graphs up to the largest batch,
and table rows of requests over a fixed context (``bench decode``, ``--variants``)."""

from __future__ import annotations


def decode_engine(
    model: str, device: str, max_bs: int, context: int, draft_tokens: int = 0, **engine_args
):
    """An engine (dummy weights, decode graphs up to ``max_bs``, no prefill graphs) with
    ``max_bs`` requests' table rows over ``context + 1`` KV slots each: ``(engine, rows,
    slots [max_bs, context + 1])``. With ``draft_tokens`` k, an engine that verifies k
    NGRAM drafts a step (decode graphs up to ``max_bs * (1 + k)`` rows; prefill graphs with
    the verify buckets, which a model with per-request state replays) and ``context + 1 + k``
    slots a request."""
    from breakgraph.engine.args import EngineArgs
    from breakgraph.engine.engine import Engine

    rows_each = 1 + draft_tokens
    args = dict(
        model_path=model,
        load_format="dummy",
        device=device,
        max_total_tokens=max_bs * (context + rows_each) + 16,
        max_running_requests=max_bs * rows_each,
        cuda_graph_max_bs=max_bs * rows_each,
        cuda_graph_backend_prefill="disabled",
        context_length=max(context + 16 + draft_tokens, 4096),
    )
    if draft_tokens:
        args.update(
            speculative_algorithm="NGRAM",
            speculative_num_draft_tokens=draft_tokens,
            cuda_graph_backend_prefill="auto",
            cuda_graph_max_tokens_prefill=256,  # the verify buckets below it, not 8K's
        )
    eng = Engine(EngineArgs(**{**args, **engine_args}))
    rows = [eng.req_pool.alloc() for _ in range(max_bs)]
    slots = eng.allocator.alloc(max_bs * (context + rows_each)).view(max_bs, -1)
    for r, s in zip(rows, slots, strict=True):
        eng.req_pool.write(r, 0, s)
    return eng, rows, slots


def decode_batch(eng, rows, slots, bs: int, context: int):
    """The decode step of the first ``bs`` requests, each over ``context`` tokens."""
    from breakgraph.forward_batch import ForwardBatch, ForwardMode

    return ForwardBatch.build(
        ForwardMode.DECODE,
        [1000 + i for i in range(bs)],
        slots[:bs, context].tolist(),
        rows[:bs],
        [context] * bs,
        [1] * bs,
        eng.device,
    )


def verify_batch(eng, rows, slots, bs: int, context: int, draft_tokens: int):
    """The speculative verify step of the first ``bs`` requests, each over ``context``
    tokens: its last token and ``draft_tokens`` drafts, a row each, every row's logits (as
    engine/verify_step.build_verify builds it)."""
    import numpy as np

    from breakgraph.engine.verify_step import verify_rows_batch

    n = 1 + draft_tokens
    ids = (1000 + np.arange(bs * n, dtype=np.int32)) % 2000
    new = slots[:bs, context : context + n].reshape(-1)
    return verify_rows_batch(
        ids, new, rows[:bs], [context] * bs, [n] * bs, eng.req_pool, eng.device
    )
