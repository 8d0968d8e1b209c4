"""Prompt-lookup drafts (``--speculative-algorithm NGRAM``): a request's next tokens guessed
from what followed the most recent earlier occurrence of its last n tokens in its own prompt
and output, no second model (engine/speculative.py verifies them)."""

from __future__ import annotations

import numpy as np


class NgramProposer:
    """Drafts of up to ``num_draft`` tokens from a request's own tokens."""

    def __init__(self, num_draft: int, min_match: int = 1, max_match: int = 4):
        if num_draft < 1 or not 1 <= min_match <= max_match:
            raise ValueError(
                f"speculative draft tokens ({num_draft}) must be >= 1 and the n-gram match "
                f"window {min_match}..{max_match} non-empty"
            )
        self.num_draft, self.min_match, self.max_match = num_draft, min_match, max_match

    def propose(self, tokens: np.ndarray, limit: int) -> np.ndarray:
        """The continuation (at most ``min(num_draft, limit)`` tokens) of the most recent
        earlier occurrence of the longest suffix of ``tokens`` (n >= min_match) that occurs
        earlier; empty if none does."""
        return self._continuation(tokens, min(self.num_draft, limit))

    def propose_after(self, tokens: np.ndarray, ahead: np.ndarray, limit: int) -> np.ndarray:
        """A draft for the verify step after one still on the device, which verifies
        ``ahead`` after ``tokens`` and whose next token the host does not know yet: the
        continuation of ``tokens + ahead`` past the token it predicts there. It prepares for
        that step keeping all of ``ahead`` and guessing the next token as this lookup does;
        otherwise the draft is merely poor (the target verifies every token)."""
        k = min(self.num_draft, limit)
        if k < 1:
            return tokens[:0]
        return self._continuation(np.concatenate([tokens, ahead]), k + 1)[1:]

    def _continuation(self, tokens: np.ndarray, k: int) -> np.ndarray:
        n_tok = len(tokens)
        if k < 1 or n_tok < self.min_match + 1:
            return tokens[:0]
        for n in range(min(self.max_match, n_tok - 1), self.min_match - 1, -1):
            suffix = tokens[n_tok - n :]
            # windows starting at 0 .. n_tok - n - 1 (the suffix itself excluded)
            windows = np.lib.stride_tricks.sliding_window_view(tokens[: n_tok - 1], n)
            hits = np.flatnonzero((windows == suffix).all(axis=1))
            if hits.size:
                # what followed it, up to the end; past the end the sequence goes on as it
                # did after the occurrence, so the continuation repeats with its own length
                # (a loop of one token drafts that token k times, not once)
                start = int(hits[-1]) + n
                return tokens[start + np.arange(k) % (n_tok - start)]
        return tokens[:0]
