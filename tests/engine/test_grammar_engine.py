"""Structured output through the engine, on the embedded SmolLM2 (real weights, CPU): JSON
schema, regex and EBNF outputs that parse and match, finishing with "stop" when the grammar
ends; constrained and unconstrained requests in one batch; the same tokens with overlap
scheduling as without (the mask of a step waits for the previous step's tokens); bad grammars
and slow compiles refused without holding up other requests."""

from __future__ import annotations

import json
import re

import pytest

xgr = pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

from breakgraph.engine.args import EngineArgs  # noqa: E402
from breakgraph.engine.engine import Engine  # noqa: E402
from breakgraph.engine.request import SamplingParams  # noqa: E402
from tests.support.engines import assert_no_leak  # noqa: E402

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"enum": ["Paris", "Rome", "Oslo"]},
    },
    "required": ["name", "age", "city"],
}
PHONE = r"[0-9]{3}-[0-9]{4}"
YES_NO = 'root ::= "yes" | "no"'


@pytest.fixture(scope="module")
def engines():
    made = {o: Engine(EngineArgs(device="cpu", overlap_schedule=o)) for o in (True, False)}
    yield made
    for eng in made.values():
        eng.shutdown()


def _workload():
    prompts = [
        "Describe a person as JSON.",
        "Write a phone number.",
        "Say hello.",
        "Is Paris in France? Answer yes or no.",
        "Describe another person as JSON.",
    ]
    sps = [
        SamplingParams(max_new_tokens=40, temperature=0.0, json_schema=json.dumps(PERSON)),
        SamplingParams(max_new_tokens=12, temperature=0.0, regex=PHONE),
        SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True),
        # a grammar with penalties and a seeded sample: the mask after the penalty pool
        SamplingParams(
            max_new_tokens=6, temperature=0.7, seed=3, ebnf=YES_NO, frequency_penalty=0.5
        ),  # fmt: skip
        SamplingParams(max_new_tokens=40, temperature=0.9, seed=5, json_schema=json.dumps(PERSON)),
    ]
    return prompts, sps


def test_constrained_and_unconstrained_in_one_batch_overlap_or_not(engines):
    """Every constrained output is valid and ends with "stop" on EOS; with overlap
    scheduling the tokens are the same as without; the plain request runs unmasked."""
    prompts, sps = _workload()
    got = {}
    for overlap, eng in engines.items():
        res = eng.generate(prompts, sps, chat=True, return_logprob=True)
        got[overlap] = [(r.output_ids, r.finish_reason) for r in res]
        person, phone, hello, yes_no, person2 = res
        for r in (person, person2):
            jsonschema.validate(json.loads(r.text), PERSON)
        assert re.fullmatch(PHONE, phone.text), phone.text
        assert yes_no.text in ("yes", "no")
        for r in (person, phone, yes_no, person2):
            assert r.finish_reason == {"type": "stop", "matched": 2}, r.finish_reason
        assert hello.finish_reason["type"] == "length" and len(hello.output_ids) == 6
        # logprobs are the model's own, not the masked distribution's
        assert all(lp <= 0 for lp in person.output_logprobs)
        assert_no_leak(eng)
    assert got[True] == got[False]


def test_bad_grammar_is_refused_in_one_line(engines):
    eng = engines[True]
    for kind, source in (("json_schema", '{"type": 5}'), ("regex", "(("), ("ebnf", "x ::=")):
        with pytest.raises(ValueError) as err:
            eng.generate(["hi"], SamplingParams(max_new_tokens=4, **{kind: source}))
        assert f"{kind} failed to compile" in str(err.value) and "\n" not in str(err.value)
    assert not eng.has_work and not eng.compiling


def test_slow_compile_holds_up_no_one(engines):
    """A grammar that compiles past the deadline is refused; a plain request sent with it
    runs meanwhile and finishes."""
    eng = engines[True]
    props = {f"f{i}": {"type": "string", "pattern": f"[a-z]{{2,{5 + i}}}[0-9]+"}
             for i in range(400)}  # fmt: skip
    slow = json.dumps({"type": "object", "properties": props, "required": list(props)})
    timeout = eng.grammars.timeout_s
    eng.grammars.timeout_s = 0.05
    try:
        eng.add_request([1, 2, 3], SamplingParams(max_new_tokens=4, json_schema=slow), rid="slow")
        eng.add_request([1, 2, 3], SamplingParams(max_new_tokens=4, ignore_eos=True), rid="plain")
        finished, rejected = {}, {}
        while eng.has_work or eng.compiling:
            for out in eng.step():
                if out.finished:
                    finished[out.rid] = out
            rejected.update(eng.take_rejected())
            if not eng.has_work and eng.compiling:
                eng.grammars.wait(0.01)
    finally:
        eng.grammars.timeout_s = timeout
    assert finished["plain"].completion_tokens == 4 and "slow" not in finished
    assert "json_schema did not compile within 0.05 s" in rejected["slow"]


def test_abort_while_compiling(engines):
    eng = engines[False]
    eng.add_request([1, 2, 3], SamplingParams(max_new_tokens=4, regex="[a-f]{4}"), rid="gone")
    out = eng.abort("gone")
    assert out.finished and out.finish_reason["type"] == "abort"
    assert not eng.compiling and eng.abort("gone") is None
    eng.grammars.wait(5.0)
    assert eng.step() == [] and eng.take_rejected() == []


@pytest.mark.parametrize("algorithm", ["NGRAM", "STANDALONE"])
def test_speculative_drafts_checked_against_the_grammar(engines, algorithm):
    """Verify rows masked by the grammar after each prefix of their draft: greedy outputs
    equal plain constrained decoding's token for token, drafts were kept, a sampled one
    stays valid (a draft the grammar refuses has probability 0: never kept). STANDALONE's
    draft is the model itself, on the greedy request only (CPU time)."""
    from breakgraph.models.sources import find_embedded_gguf

    spec = Engine(
        EngineArgs(
            device="cpu", overlap_schedule=False, speculative_algorithm=algorithm,
            speculative_draft_model_path=str(find_embedded_gguf()),
        )
    )  # fmt: skip
    try:
        ask = 'Repeat exactly: {"name": "Ann", "age": 31, "city": "Rome"} and 555-1234'
        schema = json.dumps(PERSON)
        prompts = [ask, "Write a phone number like 555-1234.", ask]
        sps = [
            SamplingParams(max_new_tokens=30, temperature=0.0, json_schema=schema),
            SamplingParams(max_new_tokens=10, temperature=0.0, regex=PHONE),
            SamplingParams(max_new_tokens=30, temperature=0.8, seed=2, json_schema=schema),
        ]
        if algorithm == "STANDALONE":
            prompts, sps = prompts[:1], sps[:1]
        want = engines[False].generate(prompts, sps, chat=True)
        got = spec.generate(prompts, sps, chat=True)
        for r, w, sp in zip(got, want, sps, strict=True):
            if sp.temperature == 0.0:
                assert r.output_ids == w.output_ids
            if sp.json_schema:
                jsonschema.validate(json.loads(r.text), PERSON)
                assert r.finish_reason == {"type": "stop", "matched": 2}, r.finish_reason
            else:
                assert re.fullmatch(PHONE, r.text), r.text
        stats = spec.scheduler.spec_stats
        assert stats.steps > 0 and stats.accepted > 0, stats
        assert_no_leak(spec)
    finally:
        spec.shutdown()
