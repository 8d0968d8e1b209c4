"""Server metrics in the Prometheus text exposition format (version 0.0.4), without a client lib.

Counters and histograms live in the API process; the step-time histogram is fed with the
step times the engine process measures and sends along with each step's outputs. Gauges
(running/queued requests, KV slots) come from the engine's live stats at scrape time.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Sequence

PREFIX = "breakgraph_"

LATENCY_BUCKETS_S = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2,
    0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip


def _fmt(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if float(value).is_integer():
        return str(int(value))
    return repr(float(value))


def _labels(pairs: Iterable[tuple[str, str]]) -> str:
    items = [f'{k}="{_escape(v)}"' for k, v in pairs]
    return "{" + ",".join(items) + "}" if items else ""


def _escape(value: str) -> str:
    return str(value).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


class Counter:
    def __init__(self, name: str, help_text: str, label: str | None = None):
        self.name, self.help, self.label = PREFIX + name, help_text, label
        self.values: dict[str, float] = {}

    def inc(self, amount: float = 1.0, label_value: str = "") -> None:
        self.values[label_value] = self.values.get(label_value, 0.0) + amount

    def value(self, label_value: str = "") -> float:
        return self.values.get(label_value, 0.0)

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} counter"]
        values = self.values or {"": 0.0}
        for lv, v in sorted(values.items()):
            labels = _labels([(self.label, lv)] if self.label else [])
            lines.append(f"{self.name}{labels} {_fmt(v)}")
        return lines


class Histogram:
    def __init__(self, name: str, help_text: str, buckets: Sequence[float] = LATENCY_BUCKETS_S):
        self.name, self.help = PREFIX + name, help_text
        self.buckets = tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)  # last: above every bound (+Inf only)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        cumulative = 0
        for bound, n in zip((*self.buckets, math.inf), self.counts, strict=True):
            cumulative += n
            lines.append(f"{self.name}_bucket{_labels([('le', _fmt(bound))])} {cumulative}")
        lines.append(f"{self.name}_sum {_fmt(self.sum)}")
        lines.append(f"{self.name}_count {self.count}")
        return lines


# engine stats key -> (metric name, help)
GAUGES = {
    "num_running_reqs": ("num_requests_running", "Requests in the running batch."),
    "num_queued_reqs": ("num_requests_waiting", "Requests waiting to be scheduled."),
    "kv_tokens_used": ("kv_slots_used", "KV slots held by requests (cached prefixes excluded)."),
    "kv_tokens_cached": ("kv_slots_cached", "KV slots held by evictable cached prefixes."),
    "kv_tokens_total": ("kv_slots_total", "KV slots in the pool."),
    "kernel_compilations_after_ready": (
        "kernel_compilations_after_ready",
        "JIT kernel compilations (Triton) since the server became ready: each is a stall.",
    ),
    "kernel_compilations_total": (
        "kernel_compilations_total",
        "JIT kernel compilations (Triton) since the engine started.",
    ),
}


class ServerMetrics:
    def __init__(self) -> None:
        self.prompt_tokens = Counter("prompt_tokens_total", "Prompt tokens of admitted requests.")
        self.generation_tokens = Counter("generation_tokens_total", "Tokens generated.")
        self.cached_tokens = Counter(
            "cached_tokens_total", "Prompt tokens served from the prefix cache."
        )
        self.requests = Counter("requests_total", "Requests finished, by reason.", label="reason")
        self.ttft = Histogram("time_to_first_token_seconds", "Time to first token.")
        self.itl = Histogram("inter_token_latency_seconds", "Time between output tokens.")
        self.e2e = Histogram("e2e_request_latency_seconds", "Request latency, end to end.")
        self.step_time = Histogram("step_time_seconds", "Engine step time (engine process).")

    def render(self, stats: dict[str, int] | None) -> str:
        lines: list[str] = []
        for key, (name, help_text) in GAUGES.items():
            if stats is not None and key in stats:
                lines += [f"# HELP {PREFIX}{name} {help_text}", f"# TYPE {PREFIX}{name} gauge"]
                lines.append(f"{PREFIX}{name} {_fmt(stats[key])}")
        for metric in (
            self.prompt_tokens,
            self.generation_tokens,
            self.cached_tokens,
            self.requests,
            self.ttft,
            self.itl,
            self.e2e,
            self.step_time,
        ):
            lines += metric.render()
        return "\n".join(lines) + "\n"
