"""The prefill graphs' attention breaks launched through the compiled kernels' own launchers
(``kernels/launch.py``) against Triton's JIT dispatch, in one process: one engine per model
(dummy weights), each step with its attention plans dropped, as a new batch of the server
has none (so each step's first layer goes through the JIT either way), both arms timed in interleaved rounds; prints each
arm's median over rounds of the median graphed step (ms, a sync around each step).

    python benchmarks/launch_ab.py --models qwen3-0.6b gemma-4-e2b -N 256 1024 -P 0 65536
"""

from __future__ import annotations

import argparse
import statistics

from breakgraph.bench.step import StepBench, time_ms
from breakgraph.kernels import launch


def fresh_step(runner, batch):
    """A forward of ``batch`` as a new step: no attention plan kept from the last one."""

    def step() -> None:
        batch.attention_plans.clear()
        runner.forward(batch)

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["qwen3-0.6b"])
    parser.add_argument("-N", "--new-tokens", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("-P", "--prefix-tokens", type=int, nargs="+", default=[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--reps", type=int, default=15)
    args = parser.parse_args()
    for model in args.models:
        sb = StepBench(model, max(args.new_tokens), max(args.prefix_tokens), "cuda")
        runner = sb.engine.runner
        for p in args.prefix_tokens:
            for n in args.new_tokens:
                times: dict[bool, list[float]] = {True: [], False: []}
                step = fresh_step(runner, sb.batch(n, p))
                for _ in range(args.rounds):
                    for direct in (False, True):
                        launch.DIRECT = direct
                        times[direct].append(time_ms(step, args.reps))
                launch.DIRECT = True
                jit, direct = (statistics.median(times[d]) for d in (False, True))
                print(f"{model:<14} N={n:<5} P={p:<6} jit dispatch {jit:7.3f} ms  "
                      f"direct {direct:7.3f} ms  {direct / jit:.3f}x", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
