"""xgrammar's compiler behind a thread pool: a request's grammar compiles off the engine's step.

xgrammar compiles in C++ with the GIL released, so a compile on a worker thread never holds
up a step. Its ``GrammarCompiler`` caches each compiled grammar by its source and options;
here a grammar that is still compiling is shared by every request that asks for it. xgrammar
itself (and transformers, which it imports) loads on the pool's first task, not at startup:
an engine that serves no grammar pays nothing for it.
"""

from __future__ import annotations

import re
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

CACHE_LIMIT_BYTES = 512 << 20  # xgrammar's cache of compiled grammars, least recently used out
_XGRAMMAR_PREFIX = re.compile(r"^\[[\d:.]+\] \S+?:\d+: ")  # "[22:06:13] /path/file.cc:94: "
_CHECK_FAILED = re.compile(r"^Check failed: \(.*?\) is false: ")
MAX_MESSAGE_CHARS = 300


class GrammarUnavailable(RuntimeError):
    """The engine cannot hold outputs to a grammar (no tokenizer, or no xgrammar)."""


def one_line(kind: str, error: BaseException) -> str:
    """``error`` (xgrammar's, with its C++ source location) as one line naming ``kind``."""
    text = str(error).strip() or type(error).__name__
    text = _CHECK_FAILED.sub("", _XGRAMMAR_PREFIX.sub("", text))
    first = " ".join(text.splitlines()[0].split()) if text else ""
    if len(first) > MAX_MESSAGE_CHARS:
        first = first[: MAX_MESSAGE_CHARS - 3] + "..."
    return f"{kind} failed to compile: {first}"


class GrammarCompiler:
    """Compiles (kind, source) grammars for one tokenizer on a pool of ``workers`` threads."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: set[int], workers: int = 2):
        """``tokenizer``: breakgraph's (its ``backend`` is a ``tokenizers.Tokenizer``);
        ``vocab_size``: the model's (the logits' width, which may pass the tokenizer's);
        ``stop_token_ids``: the tokens that end a request, the only ones a finished grammar
        allows."""
        if tokenizer is None:
            raise GrammarUnavailable(
                "structured output needs the model's tokenizer (dummy weights have none)"
            )
        self.vocab_size = vocab_size
        self._tokenizer = tokenizer
        self._stop_ids = sorted(t for t in stop_token_ids if 0 <= t < vocab_size)
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="grammar")
        self._lock = threading.Lock()
        self._compiler = None  # xgrammar's GrammarCompiler, built by the first task
        self._compiling: dict[tuple[str, str], Future] = {}

    def submit(self, kind: str, source: str) -> Future:
        """A future of the compiled grammar (xgrammar's ``CompiledGrammar``); a grammar
        that does not compile fails it with a ValueError of one line naming ``kind``."""
        key = (kind, source)
        fut = self._compiling.get(key)
        if fut is None or fut.done():
            fut = self._pool.submit(self._compile, kind, source)
            self._compiling[key] = fut
        return fut

    def forget(self, kind: str, source: str, fut: Future) -> None:
        """Drop a finished compile from the in-flight table (xgrammar's cache keeps it)."""
        if self._compiling.get((kind, source)) is fut:
            del self._compiling[(kind, source)]

    def _compile(self, kind: str, source: str):
        compiler = self._xgrammar_compiler()
        try:
            if kind == "json_schema":
                # compact JSON (", " and ": " between items, no other whitespace): a model
                # free to add whitespace can run out of tokens inside it
                return compiler.compile_json_schema(source, any_whitespace=False, strict_mode=True)
            if kind == "regex":
                return compiler.compile_regex(source)
            if kind == "ebnf":
                return compiler.compile_grammar(source)
        except Exception as e:  # xgrammar raises RuntimeError (and ValueError) with its reason
            raise ValueError(one_line(kind, e)) from None
        raise ValueError(f"unknown grammar kind {kind!r}")

    def _xgrammar_compiler(self):
        with self._lock:
            if self._compiler is None:
                self._compiler = build_xgrammar_compiler(
                    self._tokenizer, self.vocab_size, self._stop_ids
                )
            return self._compiler

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def build_xgrammar_compiler(tokenizer, vocab_size: int, stop_ids: list[int]) -> Any:
    """xgrammar's compiler for ``tokenizer``'s vocabulary, padded to the model's ``vocab_size``
    (ids past the tokenizer's are never allowed)."""
    try:
        import xgrammar as xgr
        from transformers import PreTrainedTokenizerFast
    except ImportError as e:
        raise GrammarUnavailable(
            f"structured output needs xgrammar (pip install 'breakgraph[grammar]'): {e}"
        ) from None
    # xgrammar reads the vocabulary's encoding (byte-level, byte fallback) from an HF fast
    # tokenizer: ours wraps the same `tokenizers` object
    hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend)
    info = xgr.TokenizerInfo.from_huggingface(
        hf, vocab_size=vocab_size, stop_token_ids=stop_ids or None
    )
    return xgr.GrammarCompiler(info, cache_limit_bytes=CACHE_LIMIT_BYTES)
