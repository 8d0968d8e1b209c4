"""A step's request-table write, host time per step: the former way (its own upload of rows,
columns and slots, then an ``index_put_``, before the batch's upload; decode: four kernels
from the batch's tensors) against the write from the batch's own upload
(``ForwardBatch.build(table_width=W)`` then ``ReqToTokenPool.write_batch``: one kernel), in
one process, on CUDA when there is a GPU. Host time: the calls are timed without a sync
between them (mean of --reps after a warm-up; the device work is a few small kernels).
Usage: python benchmarks/table_write.py [--reps N]"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from breakgraph.cache.req_to_token import ReqToTokenPool
from breakgraph.forward_batch import ForwardBatch, ForwardMode, token_positions

WIDTH = 70_016  # a request table row: the context length (70000) and some room


def host_us(fn, reps: int) -> float:
    for _ in range(10):
        fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    elapsed = time.perf_counter() - start
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return elapsed / reps * 1e6


def cases(device: torch.device):
    """(name, former, now) per step shape: an extend of N tokens over P cached, decode of B."""
    pool = ReqToTokenPool(65, WIDTH, device)
    for n, p in ((256, 0), (1024, 65_536), (8192, 0)):
        ids = np.arange(n, dtype=np.int32)
        slots = torch.arange(1, n + 1, dtype=torch.int64)
        rows, pre, ext = [3], [p], [n]
        cols = token_positions(np.asarray(pre, dtype=np.int64), np.asarray(ext, dtype=np.int64))
        rows_of = np.repeat(np.asarray(rows, dtype=np.int64), ext)

        def former(ids=ids, slots=slots, rows=rows, pre=pre, ext=ext, cols=cols, rows_of=rows_of):
            pool.write_many(rows_of, cols, slots)
            ForwardBatch.build(
                ForwardMode.EXTEND, ids, slots, rows, pre, ext, device, positions=cols
            )

        def now(ids=ids, slots=slots, rows=rows, pre=pre, ext=ext, cols=cols, rows_of=rows_of):
            b = ForwardBatch.build(
                ForwardMode.EXTEND, ids, slots, rows, pre, ext, device, positions=cols,
                table_width=WIDTH,
            )  # fmt: skip
            pool.write_batch(b, log=(rows_of, cols, slots))

        yield f"extend N={n} P={p}", former, now
    for bs in (1, 8, 64):
        ids = [7] * bs
        slots = torch.arange(1, bs + 1, dtype=torch.int64)
        rows, pre, ones = list(range(bs)), [1000] * bs, [1] * bs

        def former(ids=ids, slots=slots, rows=rows, pre=pre, ones=ones):
            b = ForwardBatch.build(ForwardMode.DECODE, ids, slots, rows, pre, ones, device)
            flat = b.req_pool_indices * WIDTH + b.positions  # the former write_decode
            pool.table.view(-1).index_copy_(0, flat, b.out_cache_loc.to(pool.table.dtype))

        def now(ids=ids, slots=slots, rows=rows, pre=pre, ones=ones):
            b = ForwardBatch.build(
                ForwardMode.DECODE, ids, slots, rows, pre, ones, device, table_width=WIDTH
            )
            pool.write_batch(b)

        yield f"decode bs={bs}", former, now


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=500)
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.set_num_threads(1)  # as the engine process runs (tp_worker.claim_device)
    print(f"{device}, torch {torch.__version__}; host us per step, mean of {args.reps}")
    print(f"{'step':<24} {'former us':>10} {'now us':>8} {'former/now':>11}")
    for name, former, now in cases(device):
        a, b = host_us(former, args.reps), host_us(now, args.reps)
        print(f"{name:<24} {a:>10.1f} {b:>8.1f} {a / b:>10.2f}x")


if __name__ == "__main__":
    main()
