"""Breakable CUDA graphs, usable on any PyTorch callable (nothing here knows about LLMs)."""

from breakgraph.graph.bank import (
    GraphAddressError,
    GraphBank,
    GraphCaptureError,
    StaticInput,
    smallest_bucket,
)
from breakgraph.graph.breakable import BreakableGraph, GraphReplayError, eager_break

__all__ = [
    "BreakableGraph",
    "GraphAddressError",
    "GraphBank",
    "GraphCaptureError",
    "GraphReplayError",
    "StaticInput",
    "eager_break",
    "smallest_bucket",
]
