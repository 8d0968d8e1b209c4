"""breakgraph.common is what the API process shares with the engine process: each of its
modules imports without torch (the API process never loads it; tests/server/test_server.py's
test_api_process_never_loads_torch checks the running server)."""

from __future__ import annotations

import pkgutil
import subprocess
import sys

import pytest

import breakgraph.common

MODULES = sorted(m.name for m in pkgutil.iter_modules(breakgraph.common.__path__))

CHILD = """
import importlib, sys
importlib.import_module(sys.argv[1])
torchy = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
assert not torchy, torchy[:5]
"""


def test_common_holds_the_shared_types():
    assert {"messages", "sampling_params", "gc_watch"} <= set(MODULES)


@pytest.mark.parametrize("name", MODULES)
def test_module_imports_without_torch(name):
    """Each module in a fresh interpreter: one that pulled torch in would fail here, not in
    the API process's start-up."""
    module = f"breakgraph.common.{name}"
    subprocess.run([sys.executable, "-c", CHILD, module], check=True, timeout=120)
