"""Engine arguments: SGLang's flag names, one dataclass, one argparse helper."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass

DEFAULT_MAX_REQUEST_BYTES = 32 << 20  # a full 128K-token context as JSON token ids fits ~20 times
DEFAULT_SHUTDOWN_TIMEOUT_S = 15.0  # under Kubernetes' default 30 s termination grace
# how long an idle engine on CUDA keeps polling after its last work (--idle-spin-ms): the
# next request's host path then runs on a hot core (benchmarks/README.md, sixteenth session)
IDLE_SPIN_MS_CUDA = 5.0


@dataclass
class EngineArgs:
    model_path: str | None = None
    load_format: str = "auto"
    dtype: str = "auto"
    device: str = "auto"
    context_length: int | None = None
    max_total_tokens: int | None = None
    mem_fraction_static: float = 0.85
    chunked_prefill_size: int = 8192
    max_running_requests: int | None = None
    max_prefill_tokens: int | None = None
    disable_radix_cache: bool = False
    enable_mixed_chunk: bool = False
    # launch step k+1 before reading step k back; None: on for CUDA
    overlap_schedule: bool | None = None
    # models with KV-shared layers (Gemma 4): those layers run on each request's last row only
    # in prefill (exact); None: on for such models
    kv_sharing_fast_prefill: bool | None = None
    seed: int = 0
    # tensor parallelism: ranks (processes, one GPU each) a model is sharded over
    tp_size: int = 1
    # TP on CUDA: all-reduces up to 4 MB (decode, short prefills) go to one kernel over
    # symmetric memory unless this is set; larger ones and the CPU (gloo) use the collective
    disable_custom_all_reduce: bool = False
    # the largest decode graph's batch; None: by GPU memory (engine.default_cuda_graph_max_bs)
    cuda_graph_max_bs: int | None = None
    # requests with penalties, logit_bias or min_new_tokens running at once when the decode
    # graphs apply them (rows of device state a graph reads by address); more wait in queue
    max_penalized_requests: int = 64
    disable_cuda_graph: bool = False
    cuda_graph_backend_prefill: str = "auto"  # breakable | disabled; auto: breakable on CUDA
    cuda_graph_bs_prefill: list[int] | None = None  # token buckets; default multiples of 256
    cuda_graph_max_tokens_prefill: int | None = None  # default: --chunked-prefill-size
    prefill_graph_max_pad_factor: float = 2.0
    # prefill buckets up to this many tokens are also captured whole (attention inline), for
    # a lone request whose context fits one; 0: none
    cuda_graph_max_tokens_prefill_whole: int = 2048
    warmups: str = "auto"  # serving-shapes | none; auto: serving-shapes on CUDA
    skip_server_warmup: bool = False
    # serving (`breakgraph serve`): the API process's limits; the engine reads shutdown_timeout
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT_S
    log_requests: bool = False
    incremental_streaming_output: bool = False  # /generate stream events: the new part only
    stream_interval: int = 1  # a stream's events: every this many tokens (first and last at once)
    # the engine polls its socket this long after its last work before it sleeps in poll;
    # None: IDLE_SPIN_MS_CUDA on CUDA, 0 on the CPU (where it would take a core from the API)
    idle_spin_ms: float | None = None

    def resolved_idle_spin_s(self) -> float:
        if self.idle_spin_ms is not None:
            return self.idle_spin_ms / 1000.0
        return IDLE_SPIN_MS_CUDA / 1000.0 if self.resolved_device() == "cuda" else 0.0

    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace) -> EngineArgs:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in vars(ns).items() if k in names})


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    d = EngineArgs()
    g = parser.add_argument_group("model and engine")
    g.add_argument(
        "--model-path",
        default=d.model_path,
        help="HF model dir, a .gguf file, or a built-in name (smollm2-135m, qwen3-0.6b, qwen3-8b, "
        "llama-3.1-8b); default: the embedded SmolLM2-135M-Instruct",
    )
    g.add_argument("--load-format", choices=["auto", "dummy"], default=d.load_format)
    g.add_argument("--dtype", choices=["auto", "bfloat16", "float16", "float32"], default=d.dtype)
    g.add_argument("--device", choices=["auto", "cpu", "cuda"], default=d.device)
    g.add_argument("--context-length", type=int, default=d.context_length)
    g.add_argument(
        "--max-total-tokens", type=int, default=d.max_total_tokens, help="KV pool size in tokens"
    )
    g.add_argument("--mem-fraction-static", type=float, default=d.mem_fraction_static)
    g.add_argument("--chunked-prefill-size", type=int, default=d.chunked_prefill_size)
    g.add_argument("--max-running-requests", type=int, default=d.max_running_requests)
    g.add_argument("--max-prefill-tokens", type=int, default=d.max_prefill_tokens)
    g.add_argument("--disable-radix-cache", action="store_true")
    g.add_argument(
        "--disable-overlap-schedule",
        dest="overlap_schedule",
        action="store_const",
        const=False,
        default=d.overlap_schedule,
        help="read each step's sampled ids back before scheduling the next (default on CUDA: "
        "the next step is scheduled and launched while the GPU runs this one)",
    )
    g.add_argument(
        "--enable-mixed-chunk",
        action="store_true",
        help="running requests decode inside prefill steps instead of waiting for them",
    )
    g.add_argument(
        "--kv-sharing-fast-prefill",
        action=argparse.BooleanOptionalAction,
        default=d.kv_sharing_fast_prefill,
        help="models with KV-shared layers (Gemma 4): run those layers on each request's last "
        "row only in prefill, replayed from their own graph bank (exact; default: on for such "
        "models)",
    )
    g.add_argument("--seed", type=int, default=d.seed)
    g.add_argument(
        "--tp-size",
        "--tp",
        dest="tp_size",
        type=_positive_int,
        default=d.tp_size,
        help="tensor parallelism: shard the model over this many ranks (one process and GPU "
        "each; gloo on the CPU); the heads must divide evenly",
    )
    g.add_argument(
        "--disable-custom-all-reduce",
        action="store_true",
        help="TP on CUDA: every all-reduce on NCCL (by default those of up to 4 MB, decode's "
        "and short prefills', run as one kernel over symmetric memory, falling back to NCCL "
        "with a warning where it cannot be set up)",
    )
    g.add_argument(
        "--cuda-graph-max-bs",
        type=int,
        default=d.cuda_graph_max_bs,
        help="the largest decode graph's batch (default by GPU memory: 256 on an H100 or H200, "
        "512 from --tp-size 4 or past 160 GB, 160 below 60 GB); larger batches replay it in "
        "pieces",
    )
    g.add_argument("--disable-cuda-graph", action="store_true", help="decode runs eagerly")
    g.add_argument(
        "--max-penalized-requests",
        type=int,
        default=d.max_penalized_requests,
        help="with decode graphs: requests with penalties, logit_bias or min_new_tokens "
        "running at once, applied inside the graphs (about 10 bytes x vocabulary each on the "
        "device; more such requests wait in the queue); 0: applied after the graph instead, "
        "without that bound",
    )
    g.add_argument(
        "--cuda-graph-backend-prefill",
        choices=["auto", "breakable", "disabled"],
        default=d.cuda_graph_backend_prefill,
        help="prefill as breakable CUDA graphs (attention as eager breaks); auto: on CUDA",
    )
    g.add_argument(
        "--cuda-graph-bs-prefill",
        type=int,
        nargs="+",
        default=d.cuda_graph_bs_prefill,
        help="prefill token buckets (default: multiples of 256 up to the max tokens)",
    )
    g.add_argument(
        "--cuda-graph-max-tokens-prefill", type=int, default=d.cuda_graph_max_tokens_prefill
    )
    g.add_argument(
        "--prefill-graph-max-pad-factor", type=float, default=d.prefill_graph_max_pad_factor
    )
    g.add_argument(
        "--cuda-graph-max-tokens-prefill-whole",
        type=int,
        default=d.cuda_graph_max_tokens_prefill_whole,
        help="prefill buckets up to this many tokens are also captured whole, attention "
        "inline, for a lone request whose context fits one (0: none)",
    )
    g.add_argument(
        "--warmups",
        choices=["auto", "serving-shapes", "none"],
        default=d.warmups,
        help="before serving, run internal requests over every kernel shape class "
        "(auto: serving-shapes on CUDA)",
    )
    g.add_argument("--skip-server-warmup", action="store_true", help="no warm-up at all")


def add_server_args(parser: argparse.ArgumentParser) -> None:
    """`breakgraph serve`'s request limits, shutdown and logging flags."""
    d = EngineArgs()
    g = parser.add_argument_group("serving")
    g.add_argument(
        "--max-request-bytes",
        type=_positive_int,
        default=d.max_request_bytes,
        help="a larger request body is refused (413) before it is parsed",
    )
    g.add_argument(
        "--shutdown-timeout",
        type=_non_negative_float,
        default=d.shutdown_timeout,
        help="seconds in-flight requests may finish after SIGTERM/Ctrl-C (no new ones are "
        "admitted); then they end with an error (503, or an error event in a stream)",
    )
    g.add_argument(
        "--log-requests", action="store_true", help="log each request received and finished"
    )
    g.add_argument(
        "--stream-interval",
        type=_positive_int,
        default=d.stream_interval,
        help="a stream sends an event once this many new tokens are in (and its first token "
        "and its end at once): fewer, larger events, less API-process time per token at high "
        "concurrency (SGLang's flag)",
    )
    g.add_argument(
        "--idle-spin-ms",
        type=_non_negative_float,
        default=d.idle_spin_ms,
        help="after its last work the engine polls for new requests this long before it "
        f"sleeps (default {IDLE_SPIN_MS_CUDA:g} on CUDA, 0 on the CPU): a request arriving "
        "meanwhile runs its host path on a hot core; 0 always sleeps (SGLang's "
        "--sleep-on-idle), SGLang's default never does",
    )
    g.add_argument(
        "--sleep-on-idle",
        dest="idle_spin_ms",
        action="store_const",
        const=0.0,
        help="never poll when idle: --idle-spin-ms 0 (SGLang's flag)",
    )
    g.add_argument(
        "--incremental-streaming-output",
        action="store_true",
        help="/generate streams: each event carries only what is new since the last one "
        "(text, output_ids, output logprobs; input logprobs in the first event only) instead "
        "of everything so far (SGLang's flag)",
    )


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value
