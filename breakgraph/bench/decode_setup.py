"""The in-process decode benches' engine: dummy weights, decode graphs up to the largest batch,
and table rows of requests over a fixed context (``bench decode``, ``--variants``)."""

from __future__ import annotations


def decode_engine(model: str, device: str, max_bs: int, context: int, **engine_args):
    """An engine (dummy weights, decode graphs up to ``max_bs``, no prefill graphs) with
    ``max_bs`` requests' table rows over ``context + 1`` KV slots each: ``(engine, rows,
    slots [max_bs, context + 1])``."""
    from breakgraph.engine.args import EngineArgs
    from breakgraph.engine.engine import Engine

    eng = Engine(
        EngineArgs(
            model_path=model,
            load_format="dummy",
            device=device,
            max_total_tokens=max_bs * (context + 1) + 16,
            max_running_requests=max_bs,
            cuda_graph_max_bs=max_bs,
            cuda_graph_backend_prefill="disabled",
            context_length=max(context + 16, 4096),
            **engine_args,
        )
    )
    rows = [eng.req_pool.alloc() for _ in range(max_bs)]
    slots = eng.allocator.alloc(max_bs * (context + 1)).view(max_bs, -1)
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
