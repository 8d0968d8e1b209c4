"""Requests whose grammar is compiling: held out of the scheduler until it is ready, so a slow
compile delays only its own request. Each compile has a deadline: past it, or when the grammar
does not compile, the request is rejected with a one-line reason (the server's 400)."""

from __future__ import annotations

import concurrent.futures
import time
from concurrent.futures import Future
from dataclasses import dataclass

from breakgraph.engine.grammar.compiler import GrammarCompiler, GrammarUnavailable
from breakgraph.engine.grammar.matcher import RequestGrammar
from breakgraph.engine.request import Req


@dataclass
class _Compiling:
    req: Req
    kind: str
    source: str
    future: Future
    deadline: float  # time.monotonic()


class PendingGrammars:
    def __init__(self, compiler: GrammarCompiler | None, timeout_s: float, why_none: str = ""):
        """``compiler`` None: every grammar is refused, for ``why_none``."""
        self.compiler = compiler
        self.timeout_s = timeout_s
        self.why_none = why_none or "structured output is disabled (--grammar-backend none)"
        self._waiting: dict[str, _Compiling] = {}

    def __len__(self) -> int:
        return len(self._waiting)

    def holds(self, rid: str) -> bool:
        return rid in self._waiting

    def submit(self, req: Req) -> None:
        """Start compiling ``req``'s grammar; ValueError if this engine serves none."""
        if self.compiler is None:
            raise ValueError(self.why_none)
        kind, source = req.sampling.grammar
        fut = self.compiler.submit(kind, source)
        deadline = time.monotonic() + self.timeout_s
        self._waiting[req.rid] = _Compiling(req, kind, source, fut, deadline)

    def has_ready(self) -> bool:
        """Whether ``collect`` would return something: a compile done or past its deadline."""
        if not self._waiting:
            return False
        now = time.monotonic()
        return any(w.future.done() or now >= w.deadline for w in self._waiting.values())

    def wait(self, timeout_s: float) -> None:
        """Block until a compile finishes, or ``timeout_s`` (at most until the next deadline)."""
        if not self._waiting:
            return
        until = min(w.deadline for w in self._waiting.values()) - time.monotonic()
        futures = [w.future for w in self._waiting.values()]
        concurrent.futures.wait(
            futures, max(min(timeout_s, until), 0.0), concurrent.futures.FIRST_COMPLETED
        )

    def collect(self) -> tuple[list[Req], list[tuple[Req, str]]]:
        """(requests whose grammar is ready, each with its matcher; (request, reason) of each
        one rejected), in arrival order."""
        ready, rejected = [], []
        now = time.monotonic()
        for rid, w in list(self._waiting.items()):
            if w.future.done():
                del self._waiting[rid]
                self.compiler.forget(w.kind, w.source, w.future)
                err = w.future.exception()
                if err is None:
                    w.req.grammar = RequestGrammar(w.kind, w.future.result())
                    ready.append(w.req)
                else:
                    rejected.append((w.req, _reason(w.kind, err)))
            elif now >= w.deadline:
                del self._waiting[rid]
                rejected.append(
                    (w.req, f"{w.kind} did not compile within {self.timeout_s:g} s "
                            "(--grammar-compile-timeout)")
                )  # fmt: skip
        return ready, rejected

    def abort(self, rid: str) -> Req | None:
        """Forget a request still compiling (its compile runs on, cached for a later one)."""
        w = self._waiting.pop(rid, None)
        return None if w is None else w.req

    def shutdown(self) -> None:
        if self.compiler is not None:
            self.compiler.shutdown()


def _reason(kind: str, err: BaseException) -> str:
    if isinstance(err, ValueError | GrammarUnavailable):  # one line already
        return str(err)
    return f"{kind} failed to compile: {type(err).__name__}: {err}"
