"""The environment-knob registry (breakgraph/common/envs.py): typed, read at each call,
overridden in the environment itself, the only reader of ``BREAKGRAPH_*`` variables, and
docs/env.md generated from it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from breakgraph.common import envs

PACKAGE = Path(envs.__file__).resolve().parents[1]


def test_each_knob_is_named_for_its_attribute():
    knobs = envs.registry()
    assert len(knobs) >= 10
    for attr, var in knobs.items():
        assert var.name == envs.PREFIX + attr
        assert var.kind in envs.KINDS and var.doc.endswith(".")


def test_read_at_each_call_not_at_import(monkeypatch):
    monkeypatch.delenv("BREAKGRAPH_MOE_GEMV", raising=False)
    assert envs.MOE_GEMV.get() == 4
    monkeypatch.setenv("BREAKGRAPH_MOE_GEMV", "8")
    assert envs.MOE_GEMV.get() == 8
    monkeypatch.setenv("BREAKGRAPH_MOE_GEMV", "")  # empty: the default
    assert envs.MOE_GEMV.get() == 4
    monkeypatch.setenv("BREAKGRAPH_MOE_ATOMIC_SUM", "off")
    assert envs.MOE_ATOMIC_SUM.get() is False
    monkeypatch.setenv("BREAKGRAPH_MOE_ATOMIC_SUM", "True")
    assert envs.MOE_ATOMIC_SUM.get() is True
    monkeypatch.setenv("BREAKGRAPH_TP_TIMEOUT_S", "2.5")
    assert envs.TP_TIMEOUT_S.get() == 2.5


def test_a_bad_value_names_the_variable(monkeypatch):
    for name, bad in (("MOE_GEMV", "four"), ("GRAPH_GUARD", "2"), ("PDL", "on")):
        monkeypatch.setenv(envs.PREFIX + name, bad)
        with pytest.raises(ValueError, match=f"BREAKGRAPH_{name}='{bad}': expected"):
            getattr(envs, name).get()


def test_override_sets_the_environment_and_restores_it(monkeypatch):
    """A child process sees an override; on exit a set variable gets its value back and an
    unset one is unset again; a value the knob would refuse raises before anything is set."""
    monkeypatch.setenv("BREAKGRAPH_PDL", "0")
    monkeypatch.delenv("BREAKGRAPH_MOE_GEMV", raising=False)
    with envs.override(PDL="1", MOE_GEMV=0):
        assert envs.PDL.get() == "1" and envs.MOE_GEMV.get() == 0
        child = "from breakgraph.common import envs; print(envs.PDL.get(), envs.MOE_GEMV.get())"
        out = subprocess.run(
            [sys.executable, "-c", child], capture_output=True, text=True, check=True
        )
        assert out.stdout.split() == ["1", "0"]
        with envs.GRAPH_GUARD.override(True):
            assert os.environ["BREAKGRAPH_GRAPH_GUARD"] == "1" and envs.GRAPH_GUARD.get()
        with envs.PDL.override(None):
            assert envs.PDL.get() == "auto"
        assert envs.PDL.get() == "1"
    assert os.environ["BREAKGRAPH_PDL"] == "0" and "BREAKGRAPH_MOE_GEMV" not in os.environ
    with pytest.raises(ValueError, match="BREAKGRAPH_PDL"), envs.PDL.override("2"):
        pass
    with pytest.raises(KeyError, match="NO_SUCH"), envs.override(NO_SUCH=1):
        pass
    assert os.environ["BREAKGRAPH_PDL"] == "0"


def test_only_the_registry_reads_knobs_and_every_name_is_declared():
    """No module reads a ``BREAKGRAPH_*`` variable itself (at import or later), and every
    such name the package mentions is a declared knob (a deleted one leaves no mention)."""
    declared = {var.name for var in envs.registry().values()}
    readers, undeclared = [], set()
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "envs.py" and path.parent.name == "common":
            continue
        text = path.read_text()
        for line in text.splitlines():
            if "BREAKGRAPH_" in line and re.search(r"environ|getenv", line):
                readers.append(f"{path.relative_to(PACKAGE.parent)}: {line.strip()}")
        undeclared |= set(re.findall(r"BREAKGRAPH_[A-Z0-9_]+", text)) - declared
    assert not readers, readers
    assert not undeclared, undeclared


def test_docs_env_md_is_current():
    """docs/env.md is what ``python -m breakgraph.common.envs`` writes."""
    assert envs.DOC_PATH.read_text() == envs.describe(), "run: python -m breakgraph.common.envs"
