"""Where a server's host time goes, from a py-spy raw profile (collapsed stacks, as
``PROFILE=1`` or ``PROFILE=workloads bash benchmarks/h200_serve.sh ...`` writes them): per
process, the functions with the most samples, self and inclusive (a function counted once
per stack). ``--within FRAME`` keeps only the stacks through a frame containing FRAME, from
that frame down (e.g. ``Scheduler.schedule``: what the schedule stage spends its time on).
Usage: python benchmarks/pyspy_top.py pyspy_NAME.txt [--top N] [--match S] [--within FRAME]"""

from __future__ import annotations

import argparse
from collections import Counter, defaultdict


def parse(path: str, within: str = "") -> dict[str, tuple[int, Counter, Counter]]:
    """process -> (samples, self counts, inclusive counts) by frame ("func (file:line)" with
    the line number dropped, so a function's lines add up). A profile of one process
    (``py-spy --pid``) has no process frame: its stacks count as one process."""
    out: dict[str, list] = defaultdict(lambda: [0, Counter(), Counter()])
    with open(path) as f:
        for line in f:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if not stack or not count.isdigit():
                continue
            n = int(count)
            frames = stack.split(";")
            process = frames.pop(0) if frames[0].startswith("process ") else "one process"
            frames = [fr.rsplit(":", 1)[0] + ")" if ":" in fr else fr for fr in frames]
            if within:
                first = next((i for i, fr in enumerate(frames) if within in fr), None)
                if first is None:
                    continue
                frames = frames[first:]
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
    ap.add_argument("--within", default="", help="only stacks through this frame, from it down")
    args = ap.parse_args()
    profile = parse(args.path, args.within)
    for process, (total, own, incl) in sorted(profile.items(), key=lambda x: -x[1][0]):
        print(f"\n{process}: {total} samples")
        print(f"  {'self %':>7} {'incl %':>7}  frame")
        ranked = [(fr, n) for fr, n in incl.most_common() if args.match in fr][: args.top]
        for fr, n in ranked:
            print(f"  {100 * own[fr] / total:>6.1f}% {100 * n / total:>6.1f}%  {fr}")


if __name__ == "__main__":
    main()
