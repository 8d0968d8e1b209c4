"""Prompt-lookup drafts (``--speculative-algorithm NGRAM``): a request's next tokens guessed
from what followed the most recent earlier occurrence of its last n tokens in its own prompt
and output, no second model (engine/speculative.py verifies them).

Each request keeps an ``NgramIndex`` of its tokens, grown as they grow, so a step's lookup
is a dictionary get per n: a scan of the tokens took 0.7 ms per request and step at 8K
tokens on the CPU box (2.7 ms at 32K), the host's whole budget at a few requests. The lookup
reads the request's tokens through ``FillTokens`` (engine/request.py), only those it needs:
building ``fill_ids`` each step cost 22 us per request at 1K output tokens, 151 at 8K."""

from __future__ import annotations

import numpy as np

EMPTY = np.zeros(0, dtype=np.int32)  # no draft


def _tolist_from(tokens, start: int, stop: int | None = None) -> list[int]:
    """``tokens[start:stop]`` as a list: of an array, or of a request's ``FillTokens``."""
    if isinstance(tokens, np.ndarray):
        return tokens[start:stop].tolist()
    return tokens.tolist_from(start, stop)


class NgramIndex:
    """A request's n-grams (n in ``min_match .. max_match``), each mapped to the position
    that followed its latest occurrence (one dict: grams of different n are tuples of
    different lengths). ``update`` indexes the tokens appended since; a sequence that shrank
    or changed is indexed afresh."""

    __slots__ = ("grams", "sizes", "size", "last")

    def __init__(self, min_match: int, max_match: int):
        self.grams: dict[tuple, int] = {}
        self.sizes = range(min_match, max_match + 1)
        self.size = 0  # tokens indexed: the positions 1 .. size - 1 that follow a gram
        self.last: int | None = None  # tokens[size - 1] when indexed

    def update(self, tokens: np.ndarray) -> None:
        n_tok = len(tokens)
        if n_tok < self.size or (self.size and int(tokens[self.size - 1]) != self.last):
            self.grams.clear()
            self.size = 0
        if n_tok == self.size:
            return
        first = max(self.size, 1)
        base = max(first - self.sizes[-1], 0)
        seq = _tolist_from(tokens, base)
        grams = self.grams
        # position t (first .. n_tok - 1) follows the n tokens before it, later positions
        # overwriting earlier ones
        if n_tok - first <= 16:  # a step's few tokens: 3 us for 4 (the zips below, 8)
            # a tuple's slices are the grams: one object each (a list's slice and its tuple,
            # two), about 1 us of 6 per request at 256 requests
            sizes, window = self.sizes, tuple(seq)
            for t in range(first, n_tok):
                end = t - base  # window[end - n : end]: the n tokens before t
                for n in sizes:
                    if n > t:
                        break
                    grams[window[end - n : end]] = t
        else:  # a prompt: the grams as tuples zipped from n shifted columns
            for n in self.sizes:
                lo = max(first, n)
                if lo < n_tok:
                    cols = [seq[lo - n + j - base : n_tok - n + j - base] for j in range(n)]
                    grams.update(zip(zip(*cols, strict=True), range(lo, n_tok), strict=True))
        self.size, self.last = n_tok, seq[-1]


class NgramProposer:
    """Drafts of up to ``num_draft`` tokens from a request's own tokens."""

    def __init__(self, num_draft: int, min_match: int = 1, max_match: int = 4):
        if num_draft < 1 or not 1 <= min_match <= max_match:
            raise ValueError(
                f"speculative draft tokens ({num_draft}) must be >= 1 and the n-gram match "
                f"window {min_match}..{max_match} non-empty"
            )
        self.num_draft, self.min_match, self.max_match = num_draft, min_match, max_match

    def new_index(self) -> NgramIndex:
        return NgramIndex(self.min_match, self.max_match)

    def propose(
        self, tokens: np.ndarray, limit: int, index: NgramIndex | None = None
    ) -> np.ndarray:
        """The continuation (at most ``min(num_draft, limit)`` tokens) of the most recent
        earlier occurrence of the longest suffix of ``tokens`` (n >= min_match) that occurs
        earlier; empty if none does. ``index``: the request's (updated to ``tokens``, an
        array or the request's ``FillTokens``), else the tokens (an array) are scanned."""
        return self._continuation(tokens, min(self.num_draft, limit), index)

    def propose_after(
        self, tokens: np.ndarray, ahead: np.ndarray, limit: int, index: NgramIndex | None = None
    ) -> np.ndarray:
        """A draft for the verify step after one still on the device, which verifies
        ``ahead`` after ``tokens`` and whose next token the host does not know yet: the
        continuation of ``tokens + ahead`` past the token it predicts there. It prepares for
        that step keeping all of ``ahead`` and guessing the next token as this lookup does;
        otherwise the draft is merely poor (the target verifies every token)."""
        k = min(self.num_draft, limit)
        if k < 1:
            return EMPTY
        return self._continuation(tokens, k + 1, index, ahead)[1:]

    def _continuation(self, tokens, k: int, index=None, ahead=None) -> np.ndarray:
        if index is not None:
            return self._indexed(tokens, k, index, ahead)
        seq = tokens if ahead is None or not len(ahead) else np.concatenate([tokens, ahead])
        n_tok = len(seq)
        if k < 1 or n_tok < self.min_match + 1:
            return EMPTY
        start = self._scan(seq)
        if start is None:
            return EMPTY
        # what followed it, up to the end; past the end the sequence goes on as it did after
        # the occurrence, so the continuation repeats with its own length (a loop of one
        # token drafts that token k times, not once)
        return seq[start + np.arange(k) % (n_tok - start)].astype(np.int32, copy=False)

    def _scan(self, seq: np.ndarray) -> int | None:
        """Where the continuation starts: the longest suffix's latest earlier occurrence,
        found by comparing every window."""
        n_tok = len(seq)
        for n in range(min(self.max_match, n_tok - 1), self.min_match - 1, -1):
            suffix = seq[n_tok - n :]
            # windows starting at 0 .. n_tok - n - 1 (the suffix itself excluded)
            windows = np.lib.stride_tricks.sliding_window_view(seq[: n_tok - 1], n)
            hits = np.flatnonzero((windows == suffix).all(axis=1))
            if hits.size:
                return int(hits[-1]) + n
        return None

    def _indexed(self, tokens, k: int, index: NgramIndex, ahead) -> np.ndarray:
        """``_continuation`` from ``index`` (updated to ``tokens`` here) and the few
        positions past them (``ahead``), compared one by one, latest first. It reads the
        tokens it needs only (the last few, those it drafts, the ones the index has not
        seen): ``tokens`` may be a request's ``FillTokens``, whose slices past the prompt
        are copies, so a step's lookup costs the same at any length."""
        indexed = len(tokens)
        extra = ahead.tolist() if ahead is not None else []
        n_tok = indexed + len(extra)
        if k < 1 or n_tok < self.min_match + 1:
            return EMPTY
        index.update(tokens)
        off = max(indexed - self.max_match, 0)
        # the sequence from position off on
        tail = _tolist_from(tokens, off)
        tail += extra
        start = self._latest(tail, off, indexed, index)
        if start is None:
            return EMPTY
        # _continuation's k tokens: the period from start (at most k of it), repeated
        m = min(k, n_tok - start)
        run = _tolist_from(tokens, start, min(start + m, off)) if start < off else []
        if start + m > off:
            run += tail[max(start, off) - off : start + m - off]
        return np.array(run * (k // m) + run[: k % m], dtype=np.int32)

    def _latest(self, tail: list[int], off: int, indexed: int, index: NgramIndex) -> int | None:
        """Where the continuation starts (``_scan``'s answer): for n from the longest, the
        latest occurrence past the index (the positions from ``indexed`` on, whose grams it
        has not seen) or else the index's. ``tail``: the tokens from position ``off`` on. An
        occurrence past the index ends with the last token, so those positions are the
        few whose token before is the last token (mostly none: a dictionary get per n)."""
        n_tok = off + len(tail)
        last = tail[-1]
        late = [t for t in range(n_tok - 1, max(indexed, 1) - 1, -1) if tail[t - 1 - off] == last]
        grams = index.grams
        for n in range(min(self.max_match, n_tok - 1), self.min_match - 1, -1):
            suffix = tail[n_tok - n - off :]
            for t in late:
                if t >= n and tail[t - n - off : t - off] == suffix:
                    return t
            start = grams.get(tuple(suffix))
            if start is not None:
                return start
        return None
