"""``BREAKGRAPH_TP_TRACE=1``: where the host time of TP steps goes, logged at shutdown."""

from __future__ import annotations


class StepTrace:
    """Host time of a rank's steps between consecutive stamps: rank 0 sends (stamped before
    and after its pipe writes); a worker's pipe (rank 0's stamp to its receive), build and
    launch."""

    def __init__(self, rank: int, stages: tuple[str, ...]):
        self.rank = rank
        self.samples: dict[str, list[float]] = {s: [] for s in stages}

    def add(self, *stamps: float) -> None:
        """One step's ``time.perf_counter()`` stamps, one more than the stages."""
        for xs, a, b in zip(self.samples.values(), stamps[:-1], stamps[1:], strict=True):
            xs.append((b - a) * 1e6)

    def report(self) -> str:
        parts = []
        for stage, xs in self.samples.items():
            if xs:
                xs = sorted(xs)
                p = [xs[min(len(xs) - 1, int(q * len(xs)))] for q in (0.5, 0.9, 0.99)]
                parts.append(f"{stage} p50 {p[0]:.0f} p90 {p[1]:.0f} p99 {p[2]:.0f}")
        n = len(next(iter(self.samples.values())))
        return f"TP rank {self.rank} trace, {n} steps, us: " + "; ".join(parts)
