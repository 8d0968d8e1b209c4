"""The one entry point: ``breakgraph generate | serve | bench``."""

from breakgraph.cli.main import main
from breakgraph.cli.parser import build_parser

__all__ = ["build_parser", "main"]
