"""``breakgraph bench decode``: one decode step per batch size, decode CUDA graph vs eager,
each request over a context of C tokens (dummy weights, in-process)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from breakgraph.bench.step import count_launches, save_results, time_ms


@dataclass
class DecodePoint:
    model: str
    batch_size: int
    context: int
    eager_ms: float
    graph_ms: float | None
    eager_launches: int | None
    graph_launches: int | None


def run_decode_bench(args) -> list[DecodePoint]:
    from breakgraph.engine.args import EngineArgs
    from breakgraph.engine.engine import Engine
    from breakgraph.forward_batch import ForwardBatch, ForwardMode

    if args.plot:  # fail before the run, not after it
        from breakgraph.bench.plot import require_matplotlib

        require_matplotlib()
    device = (
        args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    )
    max_bs = max(args.batch_sizes)
    points = []
    for model in args.models:
        eng = Engine(
            EngineArgs(
                model_path=model,
                load_format="dummy",
                device=device,
                max_total_tokens=max_bs * (args.context + 1) + 16,
                max_running_requests=max_bs,
                cuda_graph_max_bs=max_bs,
                cuda_graph_backend_prefill="disabled",
                context_length=max(args.context + 16, 4096),
                tp_size=args.tp_size,
            )
        )
        rows = [eng.req_pool.alloc() for _ in range(max_bs)]
        slots = eng.allocator.alloc(max_bs * (args.context + 1)).view(max_bs, -1)
        for r, s in zip(rows, slots, strict=True):
            eng.req_pool.write(r, 0, s)
        runner = eng.runner
        for bs in args.batch_sizes:
            batch = ForwardBatch.build(
                ForwardMode.DECODE,
                [1000 + i for i in range(bs)],
                slots[:bs, args.context].tolist(),
                rows[:bs],
                [args.context] * bs,
                [1] * bs,
                eng.device,
            )
            eager = lambda b=batch, r=runner: r.forward_eager(b)  # noqa: E731
            graph = lambda b=batch, r=runner: r.forward(b)  # noqa: E731
            has_graph = runner.decode_graphs is not None
            pt = DecodePoint(
                model,
                bs,
                args.context,
                time_ms(eager, args.reps),
                time_ms(graph, args.reps) if has_graph else None,
                count_launches(eager),
                count_launches(graph) if has_graph else None,
            )
            points.append(pt)
            g = f"{pt.graph_ms:8.3f}" if pt.graph_ms is not None else f"{'-':>8}"
            ratio = f"{pt.eager_ms / pt.graph_ms:6.1f}x" if pt.graph_ms else ""
            print(
                f"{model:<14} bs={bs:<4} C={args.context:<6} eager {pt.eager_ms:8.3f} ms  graph {g} ms  {ratio}",
                flush=True,
            )
        eng.shutdown()  # TP workers, if any
        del eng, runner, rows, slots
        if device == "cuda":
            torch.cuda.empty_cache()
    save_results(points, args.json, args.plot, "plot_decode")
    return points
