"""On the GPU: a bank's buckets replay into one output buffer per output, the largest bucket's
(graph/bank.py), and each replay still computes what eager computes; a bank of a vocabulary-
sized float32 output keeps one bucket's output in its pool, not one per bucket."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from breakgraph.graph import GraphBank, StaticInput, smallest_bucket

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

VOCAB = 262144  # float32 rows of 1 MiB, as a decode bank's logits of Gemma 4


class Head(nn.Module):
    """An LM-head-like pair of outputs: float32 logits and a second output derived from them."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(64, VOCAB, bias=False)

    def forward(self, x):
        logits = self.proj(x).float()
        return logits, logits * 0.5 + 1.0


def test_buckets_replay_into_one_output_each_and_equal_eager():
    torch.manual_seed(0)
    head = Head().cuda()
    sizes = [1, 2, 4, 8, 16, 24, 32, 64]
    bank = GraphBank(
        lambda x: head(x), [StaticInput("x", torch.float32, (64,))], sizes, "cuda",
        guard_tensors=lambda: head.parameters(), check_addresses=True,
    )  # fmt: skip
    with torch.no_grad():
        bank.capture(progress=False)
        logits_buf, scaled_buf = bank.outputs
        assert logits_buf.shape == scaled_buf.shape == (64, VOCAB)
        for size, graph in bank.graphs.items():
            assert graph.output[0].data_ptr() == logits_buf.data_ptr(), size
            assert graph.output[1].data_ptr() == scaled_buf.data_ptr(), size
        for n in (1, 3, 7, 16, 20, 33, 64, 5):
            x = torch.randn(n, 64, device="cuda")
            logits, scaled = bank.replay(smallest_bucket(sizes, n), n, x=x)
            want = head(x)
            torch.testing.assert_close(logits[:n], want[0], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(scaled[:n], want[1], rtol=1e-5, atol=1e-5)
            assert logits.data_ptr() == logits_buf.data_ptr()
    # the pool: one bucket's outputs (64 rows of both: 128 MiB) beside the largest capture's
    # transient (64 MiB) and a cuBLAS workspace, under what a pair of outputs per bucket
    # would keep alone (151 rows: 302 MiB)
    row_bytes = 2 * VOCAB * 4
    assert bank.reserved_bytes < sum(sizes) * row_bytes, bank.reserved_bytes
