"""API-process time of streaming a long output's text with stop strings (issue 14), on the CPU.

A streamed request's text goes through ``TextStream.feed`` once per token: detokenize, cut at
the earliest stop string, hold back a tail that could start one. The stream now searches only
the newly decoded text for stop strings; the former body searched the whole text, every token.
Per output length, the mean µs per token over a whole output fed one id at a time (the
embedded SmolLM2 tokenizer, English-like text, two stop strings that never occur), the former
search inline in the same run.
Usage: python benchmarks/text_stream.py [--tokens 4096 16384 32768]"""

from __future__ import annotations

import argparse
import random
import time

from breakgraph.server.detokenize import TextStream, load_tokenizer

STOP = ["STOPHERE", "\n\nUser:"]


class WholeTextStream(TextStream):
    """The former search: every stop string looked for in the whole text, every token."""

    def _stop_at(self, text: str) -> int | None:
        cuts = [text.index(s) for s in self.stop if s in text]
        return min(cuts) if cuts else None


def us_per_token(cls, tok, ids: list[int]) -> float:
    stream = cls(tok, STOP)
    t0 = time.perf_counter()
    for i in ids:
        stream.feed([i])
    return (time.perf_counter() - t0) / len(ids) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384, 32768])
    args = ap.parse_args()
    tok = load_tokenizer(None)
    rng = random.Random(0)
    words = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "and", "then"]
    ids = tok.encode(" ".join(rng.choice(words) for _ in range(2 * max(args.tokens))))
    print(f"{'tokens':>7} {'whole-text us/token':>20} {'new-text us/token':>18} {'ratio':>7}")
    for n in args.tokens:
        old = us_per_token(WholeTextStream, tok, ids[:n])
        new = us_per_token(TextStream, tok, ids[:n])
        print(f"{n:>7} {old:>20.1f} {new:>18.1f} {old / new:>6.2f}x", flush=True)


if __name__ == "__main__":
    main()
