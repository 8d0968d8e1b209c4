"""``breakgraph bench`` for a new user: each bench's help shows its defaults and a CPU-sized
example that parses, a server bench without a server says so in one line, and a CPU run's
tables say why a cell is empty."""

from __future__ import annotations

import argparse
import shlex
import socket
import subprocess
import sys

import pytest

from breakgraph import cli
from breakgraph.bench.args import BENCHES, EXAMPLES
from breakgraph.engine.flags import shown_default


def bench_parsers() -> dict[str, argparse.ArgumentParser]:
    def subcommands(p):
        (action,) = [a for a in p._actions if isinstance(a, argparse._SubParsersAction)]
        return action.choices

    return dict(subcommands(subcommands(cli.build_parser())["bench"]))


@pytest.mark.parametrize("name", sorted(BENCHES))
def test_a_bench_help_shows_every_default_and_an_example(name):
    parser = bench_parsers()[name]
    text = " ".join(parser.format_help().split())
    for action in parser._actions:
        default = shown_default(action)
        if default is not None:
            assert action.help, f"bench {name} {action.option_strings}: no help"
            assert f"(default: {default})" in text, (name, action.option_strings)
    assert f"example: {' '.join(EXAMPLES[name].split())}" in text


@pytest.mark.parametrize("name", sorted(BENCHES))
def test_each_example_is_a_valid_command(name):
    parser = cli.build_parser()
    commands = [
        line.split("#")[0].rstrip(" &").split(": ", 1)[-1]  # "CUDA only: breakgraph ..."
        for line in EXAMPLES[name].splitlines()
        if "breakgraph " in line
    ]
    assert any(f"bench {name}" in c for c in commands), EXAMPLES[name]
    for command in commands:
        argv = shlex.split(command)
        assert argv[0] == "breakgraph"
        parser.parse_args(argv[1:])  # exits on a bad flag


def test_a_server_bench_without_a_server_is_one_line():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"  # closed once the block ends
    r = subprocess.run(
        [sys.executable, "-m", "breakgraph.cli", "bench", "prefill", "cold", "16", "1"]
        + ["--url", url],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode != 0
    (line,) = r.stderr.strip().splitlines()
    assert f"cannot reach {url}: connection refused" in line
    assert "ClientConnectorError" not in line and "ConnectionKey" not in line


def test_a_cpu_step_table_says_why_each_cell_is_empty():
    from breakgraph.bench.step import ArmResult, PointResult, format_table

    pt = PointResult("smollm2-135m", 16, 0)
    pt.arms = [
        ArmResult("breakgraph eager", 406.6, None, ""),
        ArmResult("breakgraph graphs", None, None, "eager (no prefill graphs)"),
        ArmResult("HF compile", None, None, "skipped: CUDA only"),
    ]
    lines = format_table([pt]).splitlines()
    reasons = " ".join(line for line in lines if line.startswith("  - "))
    for column in ("ms:", "x floor:", "x HF:", "launches:"):
        assert column in reasons
    assert "eager (no prefill graphs): graphs are captured on CUDA only" in reasons


def test_a_cpu_decode_line_says_why_there_is_no_graph():
    from breakgraph.bench.decode import DecodePoint, format_decode_point

    pt = DecodePoint("m", 1, 64, 5.0, None, None, None, graph_note="eager (no decode graphs)")
    assert "graph        - ms  eager (no decode graphs): graphs are captured on CUDA only" in (
        format_decode_point(pt)
    )
