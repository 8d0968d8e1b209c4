"""Breakable CUDA graphs, usable on any PyTorch callable (nothing here knows about LLMs)."""

from breakgraph.graph.bank import GraphAddressError, GraphBank, StaticInput
from breakgraph.graph.breakable import BreakableGraph, GraphReplayError, eager_break

__all__ = [
    "BreakableGraph",
    "GraphAddressError",
    "GraphBank",
    "GraphReplayError",
    "StaticInput",
    "eager_break",
]
