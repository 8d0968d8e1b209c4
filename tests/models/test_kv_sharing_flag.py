"""--kv-sharing-fast-prefill: on by default for models with KV-shared layers, off on request;
either way greedy outputs are the same (the fast path is exact)."""

from __future__ import annotations

import argparse

import pytest

from breakgraph.engine.args import EngineArgs
from breakgraph.engine.flags import add_engine_args
from breakgraph.engine.request import SamplingParams
from tests.support.engines import make_engine
from tests.support.gemma4 import make_hf_gemma4
from tests.support.hf import prompts


def parse(*flags: str) -> EngineArgs:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return EngineArgs.from_namespace(parser.parse_args(list(flags)))


def test_flag_parses_on_off_and_default():
    assert parse().kv_sharing_fast_prefill is None
    assert parse("--kv-sharing-fast-prefill").kv_sharing_fast_prefill is True
    assert parse("--no-kv-sharing-fast-prefill").kv_sharing_fast_prefill is False


@pytest.fixture(scope="module")
def gemma4_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-gemma4-flag")
    make_hf_gemma4("text").save_pretrained(path)
    return path


def test_engine_applies_the_flag_and_outputs_agree(gemma4_dir):
    sp = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
    ps = prompts(3, [30, 3, 17], seed=4)
    outputs = {}
    for flag in (None, False):
        engine = make_engine(gemma4_dir, kv_sharing_fast_prefill=flag)
        assert engine.model.kv_sharing_fast_prefill is (flag is None)
        outputs[flag] = [r.output_ids for r in engine.generate(ps, sp)]
    assert outputs[None] == outputs[False]
