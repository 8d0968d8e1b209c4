"""The graph library on a small non-LLM module: breakable capture, bank, guards, debug mode."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from breakgraph.graph import (
    BreakableGraph,
    GraphAddressError,
    GraphBank,
    GraphReplayError,
    StaticInput,
    eager_break,
)

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

LIVE = {"scale": None}  # per-step state a break reads at replay, like a forward context


@eager_break
def live_scale(x: torch.Tensor, out: torch.Tensor) -> None:
    """Multiply each row by a per-step scale: reads live state, so it cannot be captured."""
    scale = LIVE["scale"]
    n = min(scale.shape[0], x.shape[0])
    out[:n].copy_(x[:n] * scale[:n, None])


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(32, 64)
        self.b = nn.Linear(64, 64)
        self.c = nn.Linear(64, 8)

    def forward(self, x):
        h = torch.relu(self.a(x))
        out = torch.empty_like(h)
        live_scale(h, out)
        h = torch.tanh(self.b(out))
        out2 = torch.empty_like(h)
        live_scale(h, out2)
        return self.c(out2)


def make():
    torch.manual_seed(0)
    return Net().cuda()


def test_breakable_graph_equals_eager_with_live_state():
    net = make()
    x = torch.randn(16, 32, device="cuda")
    LIVE["scale"] = torch.ones(16, device="cuda")
    graph = BreakableGraph()
    with torch.no_grad():
        out = graph.capture(net, x)
        assert graph.num_segments == 3 and len(graph.breaks) == 2
        for step in range(3):
            x.copy_(torch.randn(16, 32, device="cuda"))
            LIVE["scale"] = torch.rand(16, device="cuda") + step  # a new tensor each step
            graph.replay()
            torch.testing.assert_close(out, net(x), rtol=0, atol=0)


def test_bank_pads_to_the_bucket_it_is_given():
    net = make()
    LIVE["scale"] = torch.ones(64, device="cuda")
    bank = GraphBank(
        lambda x: net(x), [StaticInput("x", torch.float32, (32,))], [16, 32, 64], "cuda",
        check_addresses=True,
    )  # fmt: skip
    with torch.no_grad():
        bank.capture(progress=False)
        for n, bucket in [(1, 16), (16, 16), (17, 32), (40, 64), (64, 64), (17, 64)]:
            x = torch.randn(n, 32, device="cuda")
            LIVE["scale"] = torch.rand(n, device="cuda")
            out = bank.replay(bucket, n, x=x)[:n]
            torch.testing.assert_close(out, net(x), rtol=1e-6, atol=1e-6)


def test_address_guard_fires_when_a_static_buffer_moves():
    net = make()
    LIVE["scale"] = torch.ones(16, device="cuda")
    bank = GraphBank(
        lambda x: net(x), [StaticInput("x", torch.float32, (32,))], [16], "cuda",
        guard_tensors=lambda: net.parameters(), check_addresses=True,
    )  # fmt: skip
    with torch.no_grad():
        bank.capture(progress=False)
        bank.replay(16, 8, x=torch.zeros(8, 32, device="cuda"))
        net.b.weight.data = net.b.weight.data.clone()  # a captured kernel still reads the old one
        with pytest.raises(GraphAddressError, match="moved"):
            bank.replay(16, 8, x=torch.zeros(8, 32, device="cuda"))
        bank.static["x"] = torch.zeros_like(bank.static["x"])
        with pytest.raises(GraphAddressError):
            bank.replay(16, 8, x=torch.zeros(8, 32, device="cuda"))


def test_debug_mode_names_the_faulting_break(knobs):
    net = make()
    x = torch.randn(16, 32, device="cuda")
    LIVE["scale"] = torch.ones(16, device="cuda")
    graph = BreakableGraph()
    with torch.no_grad():
        graph.capture(net, x)
    knobs(GRAPH_DEBUG=True)
    LIVE["scale"] = "not a tensor"  # the second piece to run (break 0) faults
    with pytest.raises(GraphReplayError, match=r"break 0 \(live_scale#0\)"):
        graph.replay()


FAULT_SCRIPT = r"""
import torch
from breakgraph.graph import BreakableGraph, GraphReplayError, eager_break

@eager_break
def gather(src, idx, out):
    out.copy_(src[idx])

src = torch.randn(100, device="cuda")
idx = torch.zeros(10, dtype=torch.long, device="cuda")
out = torch.empty(10, device="cuda")
def fn():
    a = src * 2
    gather(a, idx, out)
    b = out + 1
    return torch.index_select(src, 0, idx + b.long() * 0)
g = BreakableGraph()
g.capture(fn)
idx.fill_(10**9)  # the break now reads far out of bounds on the device
try:
    g.replay()
except GraphReplayError as e:
    print("NAMED:", e)
"""


def test_debug_mode_names_a_device_fault():
    env = dict(os.environ, BREAKGRAPH_GRAPH_DEBUG="1", CUDA_LAUNCH_BLOCKING="0")
    out = subprocess.run(
        [sys.executable, "-c", FAULT_SCRIPT], capture_output=True, text=True, env=env, timeout=120
    )
    assert "NAMED: graph replay faulted in break 0 (gather#0)" in out.stdout, (
        out.stdout + out.stderr
    )
