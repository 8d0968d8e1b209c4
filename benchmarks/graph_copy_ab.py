"""GraphBank.run's copy of the live rows into the static inputs: one multi-tensor copy per
dtype (this tree) against a copy per input (its former body, inline), the decode graph step
of each batch size timed in interleaved rounds, synced and back to back, in one process; and
the two outputs compared bitwise.
Usage: python benchmarks/graph_copy_ab.py [MODEL ...]   (default qwen3-0.6b)"""

from __future__ import annotations

import statistics
import sys

import torch

from breakgraph.bench.decode import decode_batch, decode_engine
from breakgraph.bench.step import time_ms
from breakgraph.graph.bank import GraphBank

NEW_RUN = GraphBank.run


def old_run(self, n, **live):
    """The former GraphBank.run: one copy_ per static input."""
    size = self.bucket_for(n)
    if size is None or size not in self.graphs:
        return None
    for spec in self.inputs:
        buf = self.static[spec.name]
        buf[:n].copy_(live[spec.name], non_blocking=True)
        dirty = self._dirty_rows[spec.name]
        if dirty > n:
            buf[n:dirty].fill_(spec.pad_value)
        self._dirty_rows[spec.name] = n
    if self.check_addresses:
        self.check_guard()
    return self.graphs[size].replay()


def compare(model: str, rounds: int = 9) -> None:
    eng, rows, slots = decode_engine(model, "cuda", 8, 1024)
    graphs = eng.runner.decode_graphs
    for bs in (1, 2, 4, 8):
        batch = decode_batch(eng, rows, slots, bs, 1024)
        step = lambda g=graphs, b=batch: g.run(b)  # noqa: E731
        res = {"old": [], "new": [], "old b2b": [], "new b2b": []}
        arms = [("new", NEW_RUN), ("old", old_run)]
        with torch.inference_mode():
            for r in range(rounds):
                for name, fn in arms if r % 2 == 0 else arms[::-1]:
                    GraphBank.run = fn
                    res[name].append(time_ms(step, 20))
                    res[name + " b2b"].append(time_ms(step, 50, back_to_back=True))
            outs = []
            for fn in (old_run, NEW_RUN):
                GraphBank.run = fn
                outs.append(step().clone())
        med = {k: statistics.median(v) for k, v in res.items()}
        print(f"{model} bs={bs}: synced old {med['old']:.3f} new {med['new']:.3f} "
              f"({med['new'] / med['old']:.3f}x); b2b old {med['old b2b']:.3f} new "
              f"{med['new b2b']:.3f} ({med['new b2b'] / med['old b2b']:.3f}x); "
              f"equal {torch.equal(*outs)}", flush=True)  # fmt: skip
    eng.shutdown()
    torch.cuda.empty_cache()


if __name__ == "__main__":
    for m in sys.argv[1:] or ["qwen3-0.6b"]:
        compare(m)
