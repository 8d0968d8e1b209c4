"""Tokenizer side of the API process: load the tokenizer alone, and stream text with stop strings."""

from __future__ import annotations

import logging
from pathlib import Path

from breakgraph.models.sources import BUILTIN_MODELS, find_embedded_gguf
from breakgraph.tokenizer import IncrementalDetokenizer, Tokenizer

logger = logging.getLogger(__name__)


def load_tokenizer(model_path: str | None) -> Tokenizer | None:
    """The model's tokenizer without its weights: from GGUF metadata (None: the embedded model)
    or an HF dir's tokenizer.json; None for built-in config-only names and tokenizer-less dirs."""
    if model_path is None or str(model_path).endswith(".gguf"):
        from gguf import GGUFReader

        path = Path(model_path) if model_path else find_embedded_gguf()
        return Tokenizer.from_gguf(GGUFReader(str(path)))
    if model_path in BUILTIN_MODELS:
        return None
    path = Path(model_path)
    if (path / "tokenizer.json").is_file():
        return Tokenizer.from_pretrained(path)
    return None


def final_text(
    tokenizer: Tokenizer,
    output_ids: list[int],
    finish_reason: dict | None,
    skip_special_tokens: bool = True,
    no_stop_trim: bool = False,
) -> str:
    """The text of a finished output: a matched stop token and stop string cut off (SGLang's)."""
    ids = output_ids
    matched = (finish_reason or {}).get("matched")
    if not no_stop_trim and isinstance(matched, int) and ids and ids[-1] == matched:
        ids = ids[:-1]
    text = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    if not no_stop_trim and isinstance(matched, str) and matched in text:
        text = text[: text.index(matched)]
    return text


class TextStream:
    """Cumulative text of a streamed output that never shows what a stop string will cut.

    While generating, text that could be the start of a stop string is held back; at the
    end the full decode (``final_text``) replaces it, which extends what was shown.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        stop: list[str],
        skip_special_tokens: bool = True,
        no_stop_trim: bool = False,
    ):
        self.tokenizer = tokenizer
        self.stop = [] if no_stop_trim else list(stop)
        self.skip_special_tokens = skip_special_tokens
        self.no_stop_trim = no_stop_trim
        self._detok = IncrementalDetokenizer(tokenizer, skip_special_tokens)
        self.text = ""  # what may be shown so far
        self._searched = 0  # the length of the decoded text already searched for stop strings
        self._cut: int | None = None  # where the earliest stop string found so far starts

    def feed(self, ids: list[int]) -> str:
        """Add generated ids; return the text that may be shown now (cumulative)."""
        self._detok.feed(ids)
        text = self._detok.text
        cut = self._stop_at(text)
        if cut is not None:
            text = text[:cut]
        text = text[: len(text) - self._held_back(text)]
        if text.startswith(self.text):  # never take back what was shown
            self.text = text
        return self.text

    def _stop_at(self, text: str) -> int | None:
        """Where the earliest stop string in ``text`` starts (None: nowhere). The decoded text
        only grows, so only matches that end in its new part are searched for: a search of
        the whole text per token made a long output's stream quadratic in the API process (a
        32K-token stream with stop strings took 2.8 s of its thread, now 0.4 s)."""
        for s in self.stop:
            i = text.find(s, max(0, self._searched - len(s) + 1))
            if i >= 0 and (self._cut is None or i < self._cut):
                self._cut = i
        self._searched = len(text)
        return self._cut

    def finish(self, output_ids: list[int], finish_reason: dict | None) -> str:
        text = final_text(
            self.tokenizer, output_ids, finish_reason, self.skip_special_tokens, self.no_stop_trim
        )
        if not text.startswith(self.text):
            logger.warning("final text does not extend the streamed text")
        self.text = text
        return text

    def _held_back(self, text: str) -> int:
        """Length of the longest tail of ``text`` that is a proper prefix of a stop string."""
        best = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:k]):
                    best = k
                    break
        return best
