"""A request's grammar state: xgrammar's matcher over its compiled grammar, advanced with each
token the request outputs (scheduler.process_outputs), read by each step's bitmask fill."""

from __future__ import annotations

from typing import Any


class RequestGrammar:
    """One request's matcher. ``terminated``: the grammar accepted a stop token (its end)."""

    __slots__ = ("kind", "matcher")

    def __init__(self, kind: str, compiled: Any):
        import xgrammar as xgr  # loaded by the compile that made ``compiled``

        self.kind = kind
        self.matcher = xgr.GrammarMatcher(compiled)

    def accept(self, token: int) -> bool:
        """Advance by ``token``; False if the grammar does not allow it (the matcher is left
        as it was)."""
        return self.matcher.accept_token(token)

    def fill_draft_rows(self, host, first_row: int, draft) -> None:
        """Rows ``first_row ..`` of ``host``: the mask after each prefix of ``draft`` (a
        speculative verify step's rows), as far as the grammar accepts the draft and has not
        ended; the rows past that stay as they are (their tokens are never kept). The
        matcher is left as it was."""
        taken = 0
        self.matcher.fill_next_token_bitmask(host, first_row)
        for tok in draft:
            if not self.matcher.accept_token(int(tok)):
                break
            taken += 1
            if self.matcher.is_terminated():
                break
            self.matcher.fill_next_token_bitmask(host, first_row + taken)
        if taken:
            self.matcher.rollback(taken)

    @property
    def terminated(self) -> bool:
        return self.matcher.is_terminated()

    def finish(self, token: int, reason: dict | None) -> dict | None:
        """Advance by the request's new ``token``: its finish reason ``reason``, or "stop" once
        the grammar has ended (its stop token accepted), or an abort if the grammar refuses
        the token (the mask allowed it: only a bug gets here)."""
        if not self.accept(token):
            return reason or {"type": "abort", "message": f"token {token} breaks the {self.kind}"}
        if reason is None and self.terminated:
            return {"type": "stop", "matched": token}
        return reason
