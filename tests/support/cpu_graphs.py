"""The engine's graph banks on the CPU, replayed the way a CUDA graph replays them.

A CUDA graph cannot be captured on the CPU, but everything around it can run: the banks
(engine/graphs/), their static buffers padded to a bucket, the dispatcher's keys, the pieces
of a decode batch over the largest bucket, the address guard. ``install_cpu_graphs`` builds
an engine's prefill and decode banks on the CPU and gives each bucket a ``CpuGraph`` in place
of its ``BreakableGraph``:

- "capture" runs the bank's function once in the bucket's capture context, as the real
  capture does, and records the sequence of eager breaks (each one's function, its
  non-tensor arguments and the shapes of its tensor arguments and result);
- a replay runs the function again in the *capture* context, so that what a captured
  segment reads is what it would read at replay: the bank's static buffers and whatever the
  capture context held (not the live step), while each break runs in the live step's
  context with the non-tensor arguments of its capture, as a replayed break does. A replay
  whose breaks differ from the capture's (another count, function or shape) raises.

What this cannot see: a host sync inside a captured part (the GPU tests check that) and a
break argument whose memory the graph does not own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from breakgraph.engine.graphs.base import GraphTarget, decode_batch_sizes
from breakgraph.engine.graphs.decode import DecodeGraphs
from breakgraph.engine.graphs.dispatch import StepDispatcher
from breakgraph.engine.graphs.prefill import PrefillGraphs
from breakgraph.engine.request import SamplingParams
from breakgraph.forward_batch import ForwardContext, forward_context, get_forward_context
from breakgraph.graph import GraphBank
from breakgraph.graph import breakable as _breakable
from tests.support.engines import make_engine
from tests.support.hf import LogitsTap


@dataclass
class _BreakRecord:
    fn: object
    args: tuple
    kwargs: dict
    result_shape: tuple | None


def _shape(x) -> tuple | None:
    """A tensor's shape and dtype (what a captured address fixes), None for anything else."""
    return (*x.shape, x.dtype) if isinstance(x, torch.Tensor) else None


def _frozen(captured, now):
    """A replayed break's argument: its tensor now (shape and dtype as at capture),
    anything else as captured (a CUDA graph's break holds its non-tensor arguments from the
    capture)."""
    if isinstance(captured, torch.Tensor) or captured is None:
        if _shape(captured) != _shape(now):
            raise AssertionError(f"break argument {_shape(now)} captured as {_shape(captured)}")
        return now
    return captured


class CpuGraph:
    """One bucket of a bank, captured and replayed as above."""

    def __init__(self, bank: GraphBank, size: int):
        self.bank, self.size = bank, size
        self.split_at_breaks = bank.split_at_breaks
        self.records: list[_BreakRecord] = []
        self._live: ForwardContext | None = None
        self._cursor: int | None = None  # None: capturing
        self.output = None  # the last capture's or replay's, as a BreakableGraph keeps it

    @property
    def num_breaks(self) -> int:
        return len(self.records)

    def _run(self):
        _breakable._STATE.capture = self
        try:
            with self.bank.capture_context(self.size):
                return self.bank.fn(**self.bank.views(self.size))
        finally:
            _breakable._STATE.capture = None

    def capture(self) -> None:
        self._cursor = None
        self.output = self._run()

    def replay(self):
        # the live step's context, set by the bank's caller (a prefill graph's breaks read it)
        try:
            self._live = get_forward_context()
        except RuntimeError:
            self._live = None
        self._cursor = 0
        out = self._run()
        if self._cursor != len(self.records):
            raise AssertionError(f"replay ran {self._cursor} of {len(self.records)} breaks")
        self.output = out
        return out

    def _run_break(self, fn, args, kwargs):
        if self._cursor is None:  # capture: the break runs once in the capture context
            result = fn(*args, **kwargs)
            if result is not None and not isinstance(result, torch.Tensor):
                raise TypeError(f"eager break {fn.__qualname__} returned {type(result)}")
            self.records.append(_BreakRecord(fn, args, kwargs, _shape(result)))
            return result
        rec = self.records[self._cursor]
        self._cursor += 1
        if rec.fn is not fn or len(rec.args) != len(args) or rec.kwargs.keys() != kwargs.keys():
            raise AssertionError(f"replay break {fn.__qualname__} is not the captured one")
        args = tuple(_frozen(c, a) for c, a in zip(rec.args, args, strict=True))
        kwargs = {k: _frozen(rec.kwargs[k], v) for k, v in kwargs.items()}
        with forward_context(self._live):
            result = fn(*args, **kwargs)
        if _shape(result) != rec.result_shape:
            raise AssertionError(f"break {fn.__qualname__} returned another shape")
        return result


def capture_on_cpu(bank: GraphBank) -> None:
    """Every bucket of ``bank`` captured as a ``CpuGraph`` (largest first, as on CUDA); the
    address guard's list taken after, as ``GraphBank.capture`` takes it."""
    for size in sorted(bank.sizes, reverse=True):
        graph = CpuGraph(bank, size)
        graph.capture()
        bank.graphs[size] = graph
    bank._addresses = [t.data_ptr() for t in bank._watched()]


def install_cpu_graphs(
    engine,
    prefill_buckets: list[int],
    decode_max_bs: int,
    max_pad_factor: float = 8.0,
    tail_max_rows: int = 0,
) -> tuple[PrefillGraphs, DecodeGraphs]:
    """An engine's prefill and decode banks built on its CPU pool and request table (the
    padding request's row taken from the table, as ``capture_graphs`` takes it), captured on
    the CPU, guarded, and dispatched by its runner from now on. A model with bounded prefill
    gets its tail bank up to ``tail_max_rows`` rows (none: 0); a fixed penalty pool of the
    runner's, its penalized decode bank. (No whole prefill graphs: their capture context
    writes the static metadata a replay reads, which a replay here would run again.)"""
    runner = engine.runner
    pad_req_idx = engine.req_pool.alloc()
    target = GraphTarget(
        runner.model, runner.kv_pool, runner.req_to_token, pad_req_idx, pool="cpu",
        check_addresses=True, keep_hidden=runner.keep_hidden,
    )  # fmt: skip
    with torch.inference_mode():
        tail = decode_batch_sizes(tail_max_rows) if tail_max_rows else None
        prefill = PrefillGraphs(
            target, prefill_buckets, max_pad_factor=max_pad_factor, tail_sizes=tail
        )
        pool = runner.penalties
        decode = DecodeGraphs(
            target, decode_max_bs, penalties=pool if pool is not None and pool.fixed else None
        )
        for bank in (*prefill.banks.values(), *decode.banks.values()):
            capture_on_cpu(bank)
    runner.prefill_graphs, runner.decode_graphs = prefill, decode
    runner.dispatcher = StepDispatcher(decode, prefill)
    return prefill, decode


class GraphPair:
    """An eager engine and one replaying CPU graph banks (``install_cpu_graphs``), over the
    same checkpoint and flags, every step's last-row logits of both recorded."""

    def __init__(self, path, buckets: list[int], decode_max_bs: int, **kw):
        self.eager = make_engine(path, **kw)
        self.graphs = make_engine(path, **kw)
        self.prefill, self.decode = install_cpu_graphs(self.graphs, buckets, decode_max_bs)
        self.eager_tap, self.graph_tap = LogitsTap(self.eager), LogitsTap(self.graphs)

    def generate(self, ps, max_new_tokens: int | list[int] = 1):
        """Greedy outputs of ``ps`` (one batch) from both engines, which must be equal -> the
        graph engine's results."""
        lengths = max_new_tokens if isinstance(max_new_tokens, list) else [max_new_tokens]
        sp = [SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths]
        sp = sp if isinstance(max_new_tokens, list) else sp[0]
        want = self.eager.generate(ps, sp)
        got = self.graphs.generate(ps, sp)
        assert [r.output_ids for r in got] == [r.output_ids for r in want]
        return got

    def max_logit_diff(self) -> float:
        """The largest difference of any step's logits between the two (steps must match)."""
        steps = zip(self.graph_tap.steps, self.eager_tap.steps, strict=True)
        assert len(self.graph_tap.steps) == len(self.eager_tap.steps)
        return max(((g - e).abs().max().item() for g, e in steps), default=0.0)

    def assert_same_logits(self, atol: float = 2e-5, rtol: float = 1e-5) -> None:
        assert len(self.graph_tap.steps) == len(self.eager_tap.steps)
        for i, (g, e) in enumerate(zip(self.graph_tap.steps, self.eager_tap.steps, strict=True)):
            torch.testing.assert_close(
                g, e, atol=atol, rtol=rtol, msg=lambda m, i=i: f"step {i}: {m}"
            )

    def buckets(self, bank: str) -> list[int]:
        """The buckets of ``bank`` the graph engine's steps replayed."""
        return sorted({k.size for k in self.graphs.runner.step_counts if k.bank == bank})
