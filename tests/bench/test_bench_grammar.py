"""``breakgraph bench grammar`` end to end on the CPU, as a user runs it: a small model shape on
dummy weights with the embedded SmolLM2 tokenizer's vocabulary (from a saved directory, as on
a GPU machine without the embedded model), real xgrammar; its JSON's structure, and the
answers its constrained arm finished, held to the schema."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from breakgraph.bench.grammar_schemas import SCHEMAS

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")


def saved_embedded_tokenizer(path):
    """The embedded SmolLM2's tokenizer written as an HF directory (how ``--tokenizer`` takes
    it where the embedded model is not installed), read back the same."""
    from breakgraph.bench.grammar_setup import bench_tokenizer, embedded_tokenizer, save_tokenizer

    embedded = embedded_tokenizer()
    saved = bench_tokenizer(str(save_tokenizer(embedded, path)))
    text = '{"color": "amber"} <|im_end|>'
    assert saved.vocab_size == embedded.vocab_size == 49152
    assert saved.eos_token_ids == embedded.eos_token_ids
    assert saved.encode(text) == embedded.encode(text)
    return path


def test_constrained_against_free_decode_steps_and_compile_times(tmp_path):
    """Per batch size both arms' median steps and their ratio; the mask's host fill is part of
    its host total; every answer that ended by its grammar parses and validates; the twenty
    test schemas compile once each, and a second compile comes from the cache."""
    schema = SCHEMAS[2][1]  # a traffic light's colour: about a dozen tokens
    (tmp_path / "schema.json").write_text(json.dumps(schema))
    tokenizer = saved_embedded_tokenizer(tmp_path / "tokenizer")
    out = subprocess.run(
        [sys.executable, "-m", "breakgraph.cli", "bench", "grammar", "--device", "cpu",
         "--batch-sizes", "1", "2", "--steps", "16", "--warmup-steps", "2", "--rounds", "1",
         "--output-len", "48", "--schema", str(tmp_path / "schema.json"),
         "--tokenizer", str(tokenizer),
         "--json", str(tmp_path / "grammar.json")],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads((tmp_path / "grammar.json").read_text())
    assert got["bench"] == "grammar" and got["schema"] == schema
    assert got["models"] == ["smollm2-135m"] and got["vocab_size"] == 49152

    c = got["compile"]
    assert len(c["first_ms"]) == len(c["cached_ms"]) == len(SCHEMAS) == 20
    assert min(c["first_ms"]) > 0 and c["setup_ms"] > 0 and c["bench_schema_ms"] > 0
    assert c["cached_median_ms"] < c["first_median_ms"], c

    points = got["points"]
    assert [p["batch_size"] for p in points] == [1, 2]
    answers = []
    for p in points:
        assert p["steps"] == 16 and p["free_ms"] > 0 and p["json_ms"] > 0, p
        assert p["ratio"] == pytest.approx(p["json_ms"] / p["free_ms"])
        assert 0 < p["fill_ms"] < p["mask_ms"] and p["apply_ms"] > 0, p
        assert p["free_gpu_ms"] is None  # the forward's device time: CUDA only
        assert p["json_valid"] == p["json_finished"] >= len(p["answers"]), p
        answers += p["answers"]
        line = next(ln for ln in out.stdout.splitlines() if f"bs={p['batch_size']} " in ln)
        assert f"{p['ratio']:5.3f}x" in line, line
    assert answers, "no constrained answer ended by its grammar"
    for text in answers:
        jsonschema.validate(json.loads(text), schema)
