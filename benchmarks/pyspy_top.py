"""Where a server's host time goes, from a py-spy raw profile (collapsed stacks, as
``PROFILE=1 bash benchmarks/h200_serve.sh ...`` writes them): per process, the functions
with the most samples, self and inclusive (a function counted once per stack).
Usage: python benchmarks/pyspy_top.py pyspy_NAME.txt [--top N] [--match SUBSTRING]"""

from __future__ import annotations

import argparse
from collections import Counter, defaultdict


def parse(path: str) -> dict[str, tuple[int, Counter, Counter]]:
    """process -> (samples, self counts, inclusive counts) by frame ("func (file:line)" with
    the line number dropped, so a function's lines add up)."""
    out: dict[str, list] = defaultdict(lambda: [0, Counter(), Counter()])
    with open(path) as f:
        for line in f:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if not stack or not count.isdigit():
                continue
            n = int(count)
            process, *frames = stack.split(";")
            frames = [fr.rsplit(":", 1)[0] + ")" if ":" in fr else fr for fr in frames]
            entry = out[process[:120]]
            entry[0] += n
            if frames:
                entry[1][frames[-1]] += n
            for fr in set(frames):
                entry[2][fr] += n
    return {p: (e[0], e[1], e[2]) for p, e in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("path")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--match", default="", help="only frames containing this (e.g. breakgraph/)")
    args = ap.parse_args()
    for process, (total, own, incl) in sorted(parse(args.path).items(), key=lambda x: -x[1][0]):
        print(f"\n{process}: {total} samples")
        print(f"  {'self %':>7} {'incl %':>7}  frame")
        ranked = [(fr, n) for fr, n in incl.most_common() if args.match in fr][: args.top]
        for fr, n in ranked:
            print(f"  {100 * own[fr] / total:>6.1f}% {100 * n / total:>6.1f}%  {fr}")


if __name__ == "__main__":
    main()
