"""A decode batch over the largest graph bucket replays it in pieces (engine/graphs/decode.py):
the dispatcher's key and the piece logic against a bank with a graph's contract (one static
output buffer that every replay overwrites, rows past the live ones left stale). The GPU twin
of this test is test_engine_gpu.py's graph-equals-eager workload, whose batch of 20 exceeds
its 16 bucket."""

from __future__ import annotations

import pytest
import torch

from breakgraph.engine.graphs.decode import replay_rows
from breakgraph.engine.graphs.dispatch import decode_key
from breakgraph.engine.graphs.key import DECODE


class StaticOutputBank:
    sizes = [1, 2, 4, 8]

    def __init__(self, pair: bool = False):
        self.pair = pair
        self.out = torch.zeros(self.sizes[-1], 3)
        self.scaled = torch.zeros(self.sizes[-1], 3)
        self.calls: list[tuple[int, int]] = []

    def replay(self, size: int, n: int, **live: torch.Tensor):
        assert size in self.sizes and n <= size, (size, n)
        self.calls.append((size, n))
        self.out.fill_(float("nan"))  # a replay writes every row of its bucket: pad rows junk
        self.out[:n] = live["x"][:, None] * torch.tensor([1.0, 2.0, 3.0])
        if not self.pair:
            return self.out
        self.scaled[:n] = self.out[:n] * live["w"][:, None]
        return self.out, self.scaled


@pytest.mark.parametrize("bs", [1, 3, 5, 8, 9, 20, 24])
def test_pieces_compute_what_one_step_would(bs):
    bank = StaticOutputBank()
    x = torch.arange(bs, dtype=torch.float32) + 1
    key = decode_key(DECODE, bank.sizes, bs)
    logits = replay_rows(bank, key, bs, {"x": x})
    assert torch.equal(logits, x[:, None] * torch.tensor([1.0, 2.0, 3.0]))
    pieces = [min(8, bs - s) for s in range(0, bs, 8)]
    # each piece in the smallest bucket that holds it
    assert bank.calls == [(next(b for b in bank.sizes if b >= n), n) for n in pieces]


def test_pieces_of_a_pair_output():
    bank = StaticOutputBank(pair=True)
    x, w = torch.arange(19, dtype=torch.float32), torch.linspace(0.5, 2.0, 19)
    key = decode_key(DECODE, bank.sizes, 19)
    assert (key.size, key.rest) == (8, 4)
    logits, scaled = replay_rows(bank, key, 19, {"x": x, "w": w})
    want = x[:, None] * torch.tensor([1.0, 2.0, 3.0])
    assert torch.equal(logits, want) and torch.equal(scaled, want * w[:, None])
