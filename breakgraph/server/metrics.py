"""Server metrics for /metrics, produced by prometheus_client (text format 0.0.4).

Counters and histograms live in the API process. The engine sends, with each step's
outputs, the step's host times and (CUDA) an earlier step's GPU forward time, and once per
request, with its first output, the wall-clock stamps of its engine stages; the API process
turns those into histograms. Gauges of load and KV usage come from the engine's live stats
at scrape time. Each ServerMetrics has its own registry.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from breakgraph.common.messages import EngineStats

try:  # no *_created series: the exposition stays what it was before prometheus_client
    from prometheus_client import disable_created_metrics

    disable_created_metrics()
except ImportError:  # pragma: no cover - older prometheus_client
    pass

PREFIX = "breakgraph_"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

LATENCY_BUCKETS_S = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2,
    0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
# host-side stages are far below a millisecond when all is well
STAGE_BUCKETS_S = (
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
    0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 80.0,
)  # fmt: skip
SHARE_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)

# engine stats key -> (metric name, help)
GAUGES = {
    "num_running_reqs": ("num_requests_running", "Requests in the running batch."),
    "num_queued_reqs": ("num_requests_waiting", "Requests waiting to be scheduled."),
    "kv_tokens_used": ("kv_slots_used", "KV slots held by requests (cached prefixes excluded)."),
    "kv_tokens_cached": ("kv_slots_cached", "KV slots held by evictable cached prefixes."),
    "kv_tokens_total": ("kv_slots_total", "KV slots in the pool."),
    "penalized_reqs": (
        "num_requests_penalized",
        "Requests holding a penalty-pool row (penalties, logit_bias or min_new_tokens).",
    ),
    "penalized_reqs_max": (
        "num_requests_penalized_max",
        "Penalty-pool rows when the decode graphs apply them (--max-penalized-requests; "
        "0: unbounded); a request needing one waits while all are held.",
    ),
    "spec_verify_steps": (
        "spec_verify_steps_total",
        "Speculative verify steps (--speculative-algorithm).",
    ),
    "spec_draft_tokens": ("spec_draft_tokens_total", "Draft tokens verified."),
    "spec_accepted_tokens": ("spec_accepted_tokens_total", "Draft tokens kept."),
    "spec_accept_length": (
        "spec_accept_length",
        "Mean tokens kept per request and verify step, the bonus token included (SGLang's "
        "accept length; 0 before the first verify step).",
    ),
    "kernel_compilations_after_ready": (
        "kernel_compilations_after_ready",
        "JIT kernel compilations (Triton) since the server became ready: each is a stall.",
    ),
    "kernel_compilations_total": (
        "kernel_compilations_total",
        "JIT kernel compilations (Triton) since the engine started.",
    ),
    "gc_collections_after_ready": (
        "engine_gc_collections_after_ready",
        "Python garbage collections in the engine process since ready.",
    ),
    "gc_pause_seconds_after_ready": (
        "engine_gc_pause_seconds_after_ready",
        "Host time the engine process spent in garbage collection since ready (a stall of "
        "the step it falls in).",
    ),
    "gc_max_pause_seconds_after_ready": (
        "engine_gc_max_pause_seconds_after_ready",
        "The engine process's longest garbage-collection pause since ready.",
    ),
}


class _EngineStats(Collector):
    """The engine's live stats, as gauges, from the snapshot taken for this scrape."""

    def __init__(self) -> None:
        self.stats: EngineStats | None = None

    def collect(self):
        for key, (name, help_text) in GAUGES.items():
            if self.stats is not None and key in self.stats:
                yield GaugeMetricFamily(PREFIX + name, help_text, value=self.stats[key])
        steps = (self.stats or {}).get("forward_steps")
        if steps:
            family = CounterMetricFamily(
                PREFIX + "forward_steps",
                "Forward steps by the CUDA graph bank they replayed (eager: none; reason: why "
                "a step ran eagerly), the warm-up's included.",
                labels=("graph", "reason"),
            )
            for graph, n in sorted(steps.items()):
                bank, _, why = graph.partition(" (")
                family.add_metric([bank, why.removesuffix(")")], n)
            yield family


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = reg = CollectorRegistry(auto_describe=False)
        self._engine_stats = _EngineStats()
        reg.register(self._engine_stats)

        def counter(name: str, help_text: str, labels: tuple[str, ...] = ()) -> Counter:
            return Counter(PREFIX + name, help_text, labels, registry=reg)

        def hist(name: str, help_text: str, buckets=LATENCY_BUCKETS_S) -> Histogram:
            return Histogram(PREFIX + name, help_text, buckets=buckets, registry=reg)

        def gauge(name: str, help_text: str) -> Gauge:
            return Gauge(PREFIX + name, help_text, registry=reg)

        self.prompt_tokens = counter("prompt_tokens_total", "Prompt tokens of admitted requests.")
        self.generation_tokens = counter("generation_tokens_total", "Tokens generated.")
        self.cached_tokens = counter(
            "cached_tokens_total", "Prompt tokens served from the prefix cache."
        )
        self.requests = counter("requests_total", "Requests finished, by reason.", ("reason",))
        self.ttft = hist("time_to_first_token_seconds", "Time to first token.")
        self.itl = hist("inter_token_latency_seconds", "Time between output tokens.")
        self.e2e = hist("e2e_request_latency_seconds", "Request latency, end to end.")
        self.step_time = hist("step_time_seconds", "Engine step time (engine process).")
        # the request timeline (wall clock across the two processes)
        self.api_time = hist(
            "request_api_seconds",
            "API process: request received -> sent to the engine (parse, validate, tokenize).",
            STAGE_BUCKETS_S,
        )
        self.ipc_time = hist(
            "request_ipc_seconds",
            "Sent by the API process -> received by the engine loop.",
            STAGE_BUCKETS_S,
        )
        self.queue_time = hist(
            "request_queue_seconds",
            "Received by the engine -> first scheduled (waiting queue).",
            STAGE_BUCKETS_S,
        )
        self.scheduling_time = hist(
            "request_scheduling_seconds",
            "First scheduled -> its first forward starts (batch building, uploads).",
            STAGE_BUCKETS_S,
        )
        self.forward_time = hist(
            "forward_host_seconds",
            "Host time inside each step's forward call (launches; the whole forward on CPU).",
            STAGE_BUCKETS_S,
        )
        # host time vs GPU time per step
        self.step_host = gauge("step_host_seconds", "Host wall time of the last engine step.")
        self.step_gpu = gauge(
            "step_gpu_seconds",
            "GPU time of the forward of the latest step whose CUDA events resolved (CUDA only).",
        )
        self.host_share = hist(
            "step_host_share",
            "Share of a step's host wall time the GPU was not running its forward (CUDA only):"
            " near 1 is host-bound.",
            SHARE_BUCKETS,
        )

    def observe_step(
        self,
        step_ms: float,
        forward_ms: float | None,
        gpu_ms: float | None,
        gpu_step_ms: float | None,
    ) -> None:
        self.step_time.observe(step_ms / 1000.0)
        self.step_host.set(step_ms / 1000.0)
        if forward_ms is not None:
            self.forward_time.observe(forward_ms / 1000.0)
        if gpu_ms is not None and gpu_step_ms:
            self.step_gpu.set(gpu_ms / 1000.0)
            self.host_share.observe(min(max(1.0 - gpu_ms / gpu_step_ms, 0.0), 1.0))

    def observe_timeline(self, received_at: float, sent_at: float, engine: dict) -> None:
        """A request's stages up to its first forward (wall-clock stamps, time.time)."""
        self.api_time.observe(max(sent_at - received_at, 0.0))
        self.ipc_time.observe(max(engine["engine_recv"] - sent_at, 0.0))
        self.queue_time.observe(max(engine["scheduled"] - engine["engine_recv"], 0.0))
        self.scheduling_time.observe(max(engine["forward_start"] - engine["scheduled"], 0.0))

    def render(self, stats: EngineStats | None) -> str:
        self._engine_stats.stats = stats
        return generate_latest(self.registry).decode()
