"""CPU engines in float32 over a checkpoint, and the check that one holds nothing after its
requests finished."""

from __future__ import annotations

from breakgraph.engine.args import EngineArgs
from breakgraph.engine.engine import Engine


def make_engine(path, **kw) -> Engine:
    args = EngineArgs(model_path=str(path), device="cpu", dtype="float32", max_total_tokens=2048)
    for k, v in kw.items():
        setattr(args, k, v)
    return Engine(args)


def assert_no_leak(engine: Engine) -> None:
    assert not engine.has_work
    tree, alloc = engine.tree, engine.allocator
    assert tree.protected_size == 0, "a finished request still locks tree nodes"
    assert alloc.available + tree.total_size() == alloc.capacity
    # a runner with graphs holds the padding row their steps read (rank.capture_graphs)
    runner = engine.runner
    pad = int(runner.decode_graphs is not None or runner.prefill_graphs is not None)
    assert engine.req_pool.available == engine.max_running_requests + 1 - pad
    assert engine.flush_cache()
    assert alloc.available == alloc.capacity
