"""Structured output's parts without the model: the device bitmask apply against xgrammar's
own, one-line compile errors naming the grammar kind, the compile deadline, and the matcher
and mask driven by random logits producing text that parses and validates against its schema
(the embedded SmolLM2 tokenizer's real token strings)."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
import torch

xgr = pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

from gguf import GGUFReader  # noqa: E402

from breakgraph.engine.grammar import (  # noqa: E402
    GrammarCompiler,
    GrammarMask,
    PendingGrammars,
    RequestGrammar,
    apply_token_bitmask,
)
from breakgraph.engine.request import Req, SamplingParams  # noqa: E402
from breakgraph.models.sources import find_embedded_gguf  # noqa: E402
from breakgraph.tokenizer import Tokenizer  # noqa: E402

VOCAB = 49152  # SmolLM2's
EOS = 2


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_gguf(GGUFReader(str(find_embedded_gguf())))


@pytest.fixture(scope="module")
def compiler(tokenizer):
    c = GrammarCompiler(tokenizer, VOCAB, {EOS})
    yield c
    c.shutdown()


@pytest.mark.parametrize("vocab", [64, 100, 49152 + 77])
def test_bitmask_apply_equals_xgrammar(vocab):
    """Bit t % 32 of word t // 32 allows token t; every other logit becomes -inf, as
    xgrammar's own apply does (a vocabulary past the last word's 32 bits included)."""
    gen = torch.Generator().manual_seed(vocab)
    words = (vocab + 31) // 32
    bitmask = torch.randint(-(1 << 31), 1 << 31, (5, words), generator=gen, dtype=torch.int64)
    bitmask = bitmask.to(torch.int32)
    bitmask[2] = -1  # a neutral row stays as it was
    logits = torch.randn(5, vocab, generator=gen)
    ours, ref = logits.clone(), logits.clone()
    apply_token_bitmask(ours, bitmask)
    xgr.apply_token_bitmask_inplace(ref, bitmask, vocab_size=vocab)
    assert torch.equal(ours, ref)
    assert torch.equal(ours[2], logits[2])
    assert torch.isinf(ours).any()


@pytest.mark.parametrize(
    "kind,source,says",
    [
        ("json_schema", '{"type": "objec"}', "Unsupported type"),
        ("json_schema", '{"type": "object", ', "Failed to parse JSON"),
        ("regex", "a(b", "parenthesis"),
        ("ebnf", "root ::= foo", 'Rule "foo" is not defined'),
    ],
)
def test_bad_grammar_is_one_line_naming_its_kind(compiler, kind, source, says):
    with pytest.raises(ValueError) as err:
        compiler.submit(kind, source).result(timeout=60)
    msg = str(err.value)
    assert msg.startswith(f"{kind} failed to compile: ") and says in msg, msg
    assert "\n" not in msg and ".cc:" not in msg and len(msg) < 400


def _heavy_schema(n: int) -> str:
    props = {f"field_{i}": {"type": "string", "pattern": f"[a-z]{{3,{9 + i}}}[0-9]+"}
             for i in range(n)}  # fmt: skip
    return json.dumps({"type": "object", "properties": props, "required": list(props)})


def _req(rid: str, **grammar) -> Req:
    sp = SamplingParams(**grammar)
    sp.validate()
    return Req(rid=rid, input_ids=np.array([1, 2, 3], dtype=np.int32), sampling=sp)


def test_compile_past_its_deadline_is_rejected_while_others_go_on(compiler):
    """A grammar slower than the deadline is rejected with a reason naming the deadline; one
    submitted after it, fast, is ready first (compiles run on the pool, not the caller)."""
    pending = PendingGrammars(compiler, timeout_s=0.02)
    pending.submit(_req("slow", json_schema=_heavy_schema(300)))
    pending.submit(_req("fast", regex="[0-9]+"))
    ready, rejected = [], []
    deadline = time.monotonic() + 60
    while len(pending) and time.monotonic() < deadline:
        pending.wait(0.05)
        r, j = pending.collect()
        ready += r
        rejected += j
    assert [r.rid for r in ready] == ["fast"] and isinstance(ready[0].grammar, RequestGrammar)
    ((req, reason),) = rejected
    assert req.rid == "slow" and "did not compile within 0.02 s" in reason, reason


def test_pending_rejects_every_grammar_without_a_compiler():
    pending = PendingGrammars(None, 1.0, "structured output needs xgrammar")
    with pytest.raises(ValueError, match="needs xgrammar"):
        pending.submit(_req("r", regex="a"))


SCHEMAS = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
            "score": {"type": "integer", "minimum": -5, "maximum": 5},
            "inner": {
                "type": "object",
                "properties": {"ok": {"type": "boolean"}, "note": {"type": "null"}},
                "required": ["ok", "note"],
            },
        },
        "required": ["name", "tags", "score", "inner"],
    },
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "minItems": 1,
     "maxItems": 4},
    {"enum": ["red", "green", {"rgb": [1, 2, 3]}]},
]  # fmt: skip


@pytest.mark.parametrize("schema", SCHEMAS, ids=["object", "array", "enum"])
def test_random_logits_under_the_mask_give_valid_json(compiler, tokenizer, schema):
    """Sampling anything the mask allows, at every step, spells JSON that the schema accepts,
    and the grammar ends on the stop token: the mask, the matcher and the tokenizer's
    vocabulary agree token by token."""
    g = RequestGrammar("json_schema", compiler.submit("json_schema", json.dumps(schema)).result())
    mask = GrammarMask(VOCAB, torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(200):
        logits = torch.randn(2, VOCAB, generator=gen) * 4
        logits[0, EOS] -= 3.0  # let the JSON run a while before the grammar may end
        assert mask.apply(logits, [g, None])
        assert torch.isfinite(logits[1]).all()  # the unconstrained row is untouched
        tok = int(logits[0].argmax())
        assert g.accept(tok)
        if g.terminated:
            break
        out.append(tok)
    assert g.terminated and tok == EOS
    text = tokenizer.decode(out, skip_special_tokens=False)
    jsonschema.validate(json.loads(text), schema)


def test_regex_and_ebnf_under_the_mask(compiler, tokenizer):
    import re

    mask = GrammarMask(VOCAB, torch.device("cpu"))
    cases = [("regex", r"[A-Z][a-z]{2,5}-[0-9]{2}"), ("ebnf", 'root ::= "yes" | "no" | "ma" "ybe"')]
    grammars = [RequestGrammar(k, compiler.submit(k, s).result()) for k, s in cases]
    outs = [[] for _ in grammars]
    gen = torch.Generator().manual_seed(1)
    for _ in range(40):
        live = [None if g.terminated else g for g in grammars]
        if not any(live):
            break
        logits = torch.randn(len(grammars), VOCAB, generator=gen)
        mask.apply(logits, live)
        for g, row, out in zip(live, logits, outs, strict=True):
            if g is not None:
                tok = int(row.argmax())
                assert g.accept(tok)
                out.append(tok)
    texts = [tokenizer.decode(o[:-1], skip_special_tokens=False) for o in outs]
    assert re.fullmatch(cases[0][1], texts[0]), texts
    assert texts[1] in ("yes", "no", "maybe"), texts
