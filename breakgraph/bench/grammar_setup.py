"""``bench grammar``'s model and grammars: a built-in config's shape with the embedded SmolLM2
tokenizer's vocabulary (a grammar needs real token strings, which dummy weights lack), the
JSON schema its requests are held to, and the compile times of the twenty test schemas."""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

# A catalog: a bounded summary, then at least eight records of every JSON kind (integers,
# bounded strings, an enum, booleans, numbers, a nested array). Sampled from random logits
# (dummy weights) an answer runs 600-1200 tokens (650 in the median) and ends by the grammar:
# a request lives long in the batch, and its steps cross every kind of grammar state, not
# mostly a string's.
CATALOG_SCHEMA = {
    "type": "object",
    "properties": {
        "summary": {"type": "string", "maxLength": 64},
        "items": {
            "type": "array",
            "minItems": 8,
            "items": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 0},
                    "name": {"type": "string", "maxLength": 24},
                    "kind": {"enum": ["tool", "part", "kit"]},
                    "in_stock": {"type": "boolean"},
                    "price": {"type": "number", "minimum": 0},
                    "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}},
                },
                "required": ["id", "name", "kind", "in_stock", "price", "tags"],
            },
        },
    },
    "required": ["summary", "items"],
}


def embedded_tokenizer():
    """The embedded SmolLM2's tokenizer (from its GGUF's metadata, no weights loaded)."""
    from breakgraph.server.detokenize import load_tokenizer

    return load_tokenizer(None)


def bench_tokenizer(path: str | None):
    """The tokenizer of an HF directory (its tokenizer.json), or None: the embedded SmolLM2's.
    A directory stands in for the embedded model (94 MB) where that is not installed: write
    one with ``save_tokenizer(embedded_tokenizer(), DIR)``."""
    if path is None:
        return embedded_tokenizer()
    from breakgraph.tokenizer import Tokenizer

    return Tokenizer.from_pretrained(path)


def save_tokenizer(tokenizer, out: str | Path) -> Path:
    """``tokenizer``'s files in the HF layout: tokenizer.json and tokenizer_config.json (its
    special tokens), which ``Tokenizer.from_pretrained`` reads back (EOS included)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.backend.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer.special_tokens))
    return out


def checkpoint_dir(model: str, tokenizer, out: Path) -> Path:
    """An HF checkpoint directory (no weights: run it with ``--load-format dummy``) of the
    built-in config ``model`` with ``tokenizer``'s vocabulary: config.json with its
    ``vocab_size``, BOS and EOS, and the tokenizer's files. The engine loads it as it loads
    any checkpoint, tokenizer included."""
    from breakgraph.models.sources import BUILTIN_MODELS, CONFIG_DIR

    if model not in BUILTIN_MODELS:
        raise SystemExit(f"error: bench grammar: {model!r} is not a built-in config")
    config = json.loads((CONFIG_DIR / f"{model}.json").read_text())
    config["vocab_size"] = tokenizer.vocab_size
    config["bos_token_id"] = tokenizer.bos_token_id
    config["eos_token_id"] = sorted(tokenizer.eos_token_ids)
    save_tokenizer(tokenizer, out)
    (out / "config.json").write_text(json.dumps(config, indent=1))
    return out


@dataclass
class CompileTimes:
    """Compiles of the twenty test schemas through the engine's compiler (its thread pool,
    its options), in ms: ``setup_ms`` the first grammar of a fresh compiler (xgrammar reads
    the vocabulary), then each schema's first compile and a second one (xgrammar's cache)."""

    setup_ms: float
    first_ms: list[float] = field(default_factory=list)
    cached_ms: list[float] = field(default_factory=list)
    bench_schema_ms: float = 0.0  # the benchmark's own schema, first compile

    def summary(self) -> dict[str, float]:
        return {
            "first_total_ms": sum(self.first_ms),
            "first_median_ms": statistics.median(self.first_ms),
            "first_max_ms": max(self.first_ms),
            "cached_median_ms": statistics.median(self.cached_ms),
            "cached_max_ms": max(self.cached_ms),
        }


def compile_times(tokenizer, vocab_size: int, stop_ids: set[int]) -> CompileTimes:
    """Time the compiles of ``grammar_schemas.SCHEMAS`` on a fresh ``GrammarCompiler``."""
    from breakgraph.bench.grammar_schemas import SCHEMAS
    from breakgraph.engine.grammar import GrammarCompiler

    compiler = GrammarCompiler(tokenizer, vocab_size, stop_ids)

    def timed(kind: str, source: str) -> float:
        t0 = time.perf_counter()
        compiler.submit(kind, source).result()
        return (time.perf_counter() - t0) * 1e3

    try:
        times = CompileTimes(setup_ms=timed("regex", "[a-z]+"))
        for _, schema in SCHEMAS:
            source = json.dumps(schema)
            times.first_ms.append(timed("json_schema", source))
            times.cached_ms.append(timed("json_schema", source))
        times.bench_schema_ms = timed("json_schema", json.dumps(CATALOG_SCHEMA))
    finally:
        compiler.shutdown()
    return times


def format_compile_times(t: CompileTimes) -> str:
    s = t.summary()
    return (
        f"grammar compile, 20 test schemas: first {s['first_total_ms']:.1f} ms in all "
        f"(median {s['first_median_ms']:.2f}, max {s['first_max_ms']:.2f} ms); cached median "
        f"{s['cached_median_ms']:.3f} ms (max {s['cached_max_ms']:.3f}); compiler setup "
        f"{t.setup_ms:.0f} ms; the bench's schema {t.bench_schema_ms:.1f} ms"
    )
