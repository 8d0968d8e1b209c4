"""Flags as a user of SGLang or vLLM types them: a mistake answered in two lines (a short usage,
then the flag meant or what to use instead), the peers' names for the same setting accepted,
``--version``, and every value checked before anything loads."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys

import pytest

from breakgraph import cli


def run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "breakgraph.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def two_line_error(r: subprocess.CompletedProcess) -> str:
    """The problem line of a flag error, checked to follow a one-line usage."""
    assert r.returncode == 2, r.stderr
    usage, problem = r.stderr.strip().splitlines()  # not argparse's 35-line usage
    assert usage.startswith("usage: breakgraph ")
    return problem


@pytest.mark.parametrize(
    "args,answer",
    [
        (["serve", "--prot", "8000"], "did you mean --port?"),
        (["generate", "--max-new-tokes", "8", "hi"], "did you mean --max-new-tokens?"),
        (["serve", "--tokenizer-path", "x"], "the tokenizer is read from --model-path"),
        (["generate", "--tokenizer", "x", "hi"], "the tokenizer is read from --model-path"),
        (["serve", "--gpu-memory-utilization", "0.9"], "use --mem-fraction-static"),
        (["serve", "--quantization", "fp8"], "not supported"),
    ],
)
def test_a_bad_flag_gets_a_short_usage_and_what_to_use(args, answer):
    problem = two_line_error(run(*args))
    assert problem.startswith(f"breakgraph {args[0]}: error: unrecognized arguments: {args[1]}")
    assert answer in problem


@pytest.mark.parametrize(
    "args,dest,value",
    [
        (["--max-model-len", "4096"], "context_length", 4096),
        (["--tensor-parallel-size", "2"], "tp_size", 2),
        (["--tp", "2"], "tp_size", 2),
        (["--max-num-seqs", "8"], "max_running_requests", 8),
        (["--enforce-eager"], "disable_cuda_graph", True),
        (["--trust-remote-code"], "trust_remote_code", True),
    ],
)
def test_the_peers_names_for_a_setting_are_accepted(args, dest, value):
    for command in (["serve"], ["generate", "hi"]):
        assert getattr(cli.build_parser().parse_args([*command, *args]), dest) == value


def test_trust_remote_code_runs_as_without_it():
    common = ["generate", "--model-path", "smollm2-135m", "--load-format", "dummy"]
    common += ["--input-ids", "1 2 3", "--max-new-tokens", "3", "--ignore-eos"]
    plain, trusting = run(*common), run(*common, "--trust-remote-code")
    assert plain.returncode == 0 and trusting.returncode == 0, trusting.stderr
    assert trusting.stdout == plain.stdout and len(plain.stdout.split()) == 3


@pytest.mark.parametrize("module", ["breakgraph", "breakgraph.cli"])
def test_version(module):
    r = subprocess.run(
        [sys.executable, "-m", module, "--version"], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"breakgraph {importlib.metadata.version('breakgraph')} ")
    assert f"torch {importlib.metadata.version('torch')}" in r.stdout


@pytest.mark.parametrize(
    "args,words",
    [
        (["generate", "--temperature", "-1", "hi"], ["--temperature must be >= 0"]),
        (["generate", "--top-p", "0", "hi"], ["--top-p must be in (0, 1]"]),
        (["generate", "--max-new-tokens", "-3", "hi"], ["--max-new-tokens must be in"]),
        (["generate", "--input-ids", "1 two 3"], ["--input-ids", "token ids"]),
        (["generate", "--chunked-prefill-size", "0", "hi"], ["--chunked-prefill-size", "positive"]),
        (["serve", "--mem-fraction-static", "1.5"], ["--mem-fraction-static", "(0, 1]"]),
        (["serve", "--max-model-len", "-1"], ["--context-length", "positive"]),
        (["serve", "--cuda-graph-max-bs", "x"], ["--cuda-graph-max-bs", "must be an integer"]),
    ],
)
def test_every_flag_is_checked_before_anything_loads(args, words):
    problem = two_line_error(run(*args))
    for w in words:
        assert w in problem
