"""``StepKey``: which graph a step replays (a bank and its bucket) or that it runs eagerly,
and why. The dispatcher (dispatch.py) makes one per step; the banks replay the key they are
given; the TP workers receive rank 0's; the runner counts steps by it."""

from __future__ import annotations

from dataclasses import dataclass

EAGER = "eager"
DECODE = "decode"
DECODE_LONG = "decode_long"  # batch 1 over a long context: decode attention's long variant
DECODE_PENALIZED = "decode_penalized"  # the forward followed by the penalty pool's apply
PREFILL = "prefill"  # the breakable bank per token bucket
PREFILL_WHOLE = "prefill_whole"  # a lone short request, attention captured inline
BANKS = (EAGER, DECODE, DECODE_LONG, DECODE_PENALIZED, PREFILL, PREFILL_WHOLE)  # wire order
DECODE_BANKS = (DECODE, DECODE_LONG, DECODE_PENALIZED)  # one row per request (decode graphs)
TAIL = "tail"  # bounded prefill's tail bank, replayed inside a PREFILL key (``StepKey.tail``)
MTP_DECODE = "mtp_decode"  # NEXTN's MTP layer's draft steps (rank 0's own: not on the wire)


@dataclass(frozen=True, slots=True)
class StepKey:
    """A step's graph: ``bank`` and its bucket ``size`` (rows), or ``EAGER`` with ``reason``.

    ``rest``: a decode step over the bank's largest bucket replays it in pieces of ``size``
    rows and its last, smaller piece in bucket ``rest`` (0: no such piece). ``tail``: a
    model with bounded prefill replays its KV-shared tail in the tail bank's bucket ``tail``
    (0: the tail runs eagerly)."""

    bank: str
    size: int = 0
    rest: int = 0
    tail: int = 0
    reason: str = ""

    @property
    def eager(self) -> bool:
        return self.bank == EAGER

    def __str__(self) -> str:
        if self.eager:
            return f"eager ({self.reason})" if self.reason else "eager"
        s = f"{self.bank}[{self.size}]"
        if self.rest:
            s += f" in pieces, last [{self.rest}]"
        if self.tail:
            s += f" + tail[{self.tail}]"
        return s


def eager(reason: str) -> StepKey:
    return StepKey(EAGER, reason=reason)
