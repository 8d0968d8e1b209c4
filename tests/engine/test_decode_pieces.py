"""A decode batch over the largest graph bucket replays it in pieces (engine/cuda_graphs.py):
the piece logic against a bank with a graph's contract (one static output buffer that every
replay overwrites, rows past the live ones left stale). The GPU twin of this test is
test_engine_gpu.py's graph-equals-eager workload, whose batch of 20 exceeds its 16 bucket."""

from __future__ import annotations

import pytest
import torch

from breakgraph.engine.cuda_graphs import _replay_rows


class StaticOutputBank:
    sizes = (1, 2, 4, 8)

    def __init__(self, pair: bool = False):
        self.max_size = self.sizes[-1]
        self.pair = pair
        self.out = torch.zeros(self.max_size, 3)
        self.scaled = torch.zeros(self.max_size, 3)
        self.calls: list[int] = []

    def run(self, n: int, **live: torch.Tensor):
        bucket = next((s for s in self.sizes if s >= n), None)
        if bucket is None:
            return None
        self.calls.append(n)
        self.out.fill_(float("nan"))  # a replay writes every row of its bucket: pad rows junk
        self.out[:n] = live["x"][:, None] * torch.tensor([1.0, 2.0, 3.0])
        if not self.pair:
            return self.out
        self.scaled[:n] = self.out[:n] * live["w"][:, None]
        return self.out, self.scaled


@pytest.mark.parametrize("bs", [1, 5, 8, 9, 20, 24])
def test_pieces_compute_what_one_step_would(bs):
    bank = StaticOutputBank()
    x = torch.arange(bs, dtype=torch.float32) + 1
    logits = _replay_rows(bank, bs, {"x": x})
    assert torch.equal(logits, x[:, None] * torch.tensor([1.0, 2.0, 3.0]))
    assert bank.calls == [min(8, bs - s) for s in range(0, bs, 8)]


def test_pieces_of_a_pair_output_and_a_missing_bucket():
    bank = StaticOutputBank(pair=True)
    x, w = torch.arange(19, dtype=torch.float32), torch.linspace(0.5, 2.0, 19)
    logits, scaled = _replay_rows(bank, 19, {"x": x, "w": w})
    want = x[:, None] * torch.tensor([1.0, 2.0, 3.0])
    assert torch.equal(logits, want) and torch.equal(scaled, want * w[:, None])
    bank.sizes = ()  # no bucket at all: the caller runs the step eagerly
    assert _replay_rows(bank, 3, {"x": x[:3], "w": w[:3]}) is None
