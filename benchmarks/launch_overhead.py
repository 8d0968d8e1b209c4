"""Host time of one launch on this machine: a Triton kernel through its JIT dispatch
(``kernel[grid](...)``: binding, specialization key, cache lookup) against the compiled
kernel's own launcher, a one-kernel CUDA graph replay and a torch op, each timed over
back-to-back launches with no sync inside the loop (the GPU work is trivial, so the host is
the bound). The kernel has the extend-attention break's argument count (25 runtime args).

    python benchmarks/launch_overhead.py [--launches 5000]
"""

from __future__ import annotations

import argparse
import time

import torch
import triton
import triton.language as tl


@triton.jit
def _many_args(
    a, b, c, d, e, f, g, h, i0, i1, i2, i3, i4, i5, i6, i7, i8, i9, i10, i11, i12, i13, i14,
    x, y, BLOCK: tl.constexpr, FLAG: tl.constexpr,
):  # fmt: skip
    offs = tl.arange(0, BLOCK)
    tl.store(a + offs, tl.load(b + offs) + i0 + x)


def per_launch_us(fn, launches: int) -> float:
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(launches):
        fn()
    host = time.perf_counter() - t
    torch.cuda.synchronize()
    return host / launches * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--launches", type=int, default=5000)
    args = parser.parse_args()
    n = args.launches
    bufs = [torch.zeros(128, device="cuda") for _ in range(8)]
    ints = list(range(1, 16))
    consts = dict(BLOCK=128, FLAG=True)
    grid = (4, 2, 1)
    call = (*bufs, *ints, 3, 0.5)

    def jit():
        _many_args[grid](*call, **consts)

    compiled = _many_args[grid](*call, **consts)
    runner = compiled[grid]
    stream = torch.cuda.current_stream().cuda_stream

    def direct():
        compiled.run(grid[0], grid[1], grid[2], stream, compiled.function,
                     compiled.packed_metadata, None, None, None, *call, 128, True)  # fmt: skip

    def via_runner():
        runner(*call, 128, True, stream=stream)

    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        jit()
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        jit()
    x = bufs[0]
    rows = [
        ("triton jit dispatch", jit),
        ("compiled[grid] runner", via_runner),
        ("compiled.run direct", direct),
        ("graph replay (1 kernel)", graph.replay),
        ("torch add_", lambda: x.add_(1.0)),
    ]
    for name, fn in rows:
        try:
            print(f"{name:<26} {per_launch_us(fn, n):6.2f} us per launch", flush=True)
        except Exception as e:  # noqa: BLE001 - a launcher's signature differs by version
            print(f"{name:<26} failed: {type(e).__name__}: {e}")


if __name__ == "__main__":
    main()
