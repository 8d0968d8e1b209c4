"""Kernels one decode step launches on the Triton path, counted on the CPU: the Triton kernels
run under Triton's interpreter (each launch counted) and the torch ops that are kernels on CUDA
are counted from the profiler (views, metadata and composite ops left out). Tiny random
models of the test suite; the count per layer carries over to the full-size configs.

    TRITON_INTERPRET=1 python -m tests.kernels.decode_kernel_count [family ...]

(needs triton 3.6 and numpy < 2.3, as test_triton_interpret.py, which holds the count).
"""

from __future__ import annotations

import os
import sys
from collections import Counter

import torch
from torch.profiler import ProfilerActivity, profile

from breakgraph.forward_batch import ForwardBatch, ForwardMode

NOT_KERNELS = {
    "aten::view",
    "aten::reshape",
    "aten::slice",
    "aten::select",
    "aten::as_strided",
    "aten::t",
    "aten::transpose",
    "aten::expand",
    "aten::unsqueeze",
    "aten::chunk",
    "aten::split",
    "aten::narrow",
    "aten::empty",
    "aten::empty_like",
    "aten::detach",
    "aten::alias",
    "aten::_unsafe_view",
    "aten::split_with_sizes",
    "aten::squeeze",
    "aten::permute",
    "aten::resolve_conj",
    "aten::resolve_neg",
    "aten::empty_strided",
    "aten::result_type",
    "aten::unbind",
    "aten::lift_fresh",
    "aten::movedim",
    "aten::promote_types",
    "aten::to",
    "aten::contiguous",
    "aten::item",
    "aten::_local_scalar_dense",
    "aten::linear",
    "aten::matmul",
    "aten::embedding",
    "aten::flatten",
    "aten::_reshape_alias",
}  # fmt: skip (a flatten or reshape that copies shows its copy_ or clone beneath it)
LAUNCH = "triton_launch"


def _is_kernel(ev) -> bool:
    """A torch op that launches a kernel of its own: not a view or composite of kernels."""
    if ev.name in NOT_KERNELS or not ev.name.startswith("aten::"):
        return False
    return not any(_is_kernel(c) or _has_kernel(c) for c in ev.cpu_children)


def _has_kernel(ev) -> bool:
    return any(_is_kernel(c) or _has_kernel(c) for c in ev.cpu_children)


def _inside_launch(ev) -> bool:  # the interpreter's own torch ops
    p = ev.cpu_parent
    while p is not None:
        if p.name == LAUNCH:
            return True
        p = p.cpu_parent
    return False


def count_decode_kernels(family: str) -> tuple[int, int, int, Counter]:
    """(layers, Triton launches, torch kernels, torch kernels by name) of one decode step."""
    import triton.runtime.interpreter as interpreter

    from breakgraph.engine.args import EngineArgs
    from breakgraph.engine.engine import Engine
    from breakgraph.kernels import ops
    from tests.kernels.interpret_models import stand_in_h200_host_helpers, tiny_checkpoint

    stand_in_h200_host_helpers()
    ops._use_triton = lambda x: True
    engine = Engine(
        EngineArgs(model_path=tiny_checkpoint(family), device="cpu", dtype="float32",
                   max_total_tokens=2048)
    )  # fmt: skip
    rows = engine.req_pool.alloc()
    slots = engine.allocator.alloc(8)
    engine.req_pool.write(rows, 0, slots)
    prefill = ForwardBatch.build(
        ForwardMode.EXTEND, list(range(5, 12)), slots[:7].tolist(), [rows], [0], [7], engine.device
    )
    engine.runner.forward(prefill)
    decode = ForwardBatch.build(
        ForwardMode.DECODE, [9], slots[7:8].tolist(), [rows], [7], [1], engine.device
    )
    engine.runner.forward(decode)  # once first: workspaces grown, as in a captured graph
    launches = 0
    run = interpreter.GridExecutor.__call__

    def counted(self, *args, **kwargs):
        nonlocal launches
        launches += 1
        with torch.autograd.profiler.record_function(LAUNCH):
            return run(self, *args, **kwargs)

    interpreter.GridExecutor.__call__ = counted
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            engine.runner.forward(decode)
    finally:
        interpreter.GridExecutor.__call__ = run
    ops_ = Counter(ev.name for ev in prof.events() if _is_kernel(ev) and not _inside_launch(ev))
    return engine.model_config.num_hidden_layers, launches, sum(ops_.values()), ops_


def main(families: list[str]) -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1", "set TRITON_INTERPRET=1"
    for family in families:
        layers, triton_n, torch_n, by_name = count_decode_kernels(family)
        total = triton_n + torch_n
        print(
            f"{family:<11} {layers} layers: {total} kernels per decode step "
            f"({triton_n} Triton, {torch_n} torch: {dict(by_name.most_common(6))}), "
            f"{total / layers:.1f} per layer (the step's own kernels included)"
        )


if __name__ == "__main__":
    main(sys.argv[1:] or ["llama", "qwen3", "gemma4"])
