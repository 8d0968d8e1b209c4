"""Engine and server settings: SGLang's names, one dataclass (``EngineArgs``); flags.py defines
their command-line flags."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass

DEFAULT_MAX_REQUEST_BYTES = 32 << 20  # a full 128K-token context as JSON token ids fits ~20 times
DEFAULT_SHUTDOWN_TIMEOUT_S = 15.0  # under Kubernetes' default 30 s termination grace
# how long an idle engine on CUDA keeps polling after its last work (--idle-spin-ms): the
# next request's host path then runs on a hot core (docs/design.md, "Engine process")
IDLE_SPIN_MS_CUDA = 5.0


@dataclass
class EngineArgs:
    model_path: str | None = None
    load_format: str = "auto"
    dtype: str = "auto"
    device: str = "auto"
    context_length: int | None = None
    max_total_tokens: int | None = None
    # None: auto, 0.85 of the GPU, or 0.90 where one --context-length request needs it
    mem_fraction_static: float | None = None
    chunked_prefill_size: int = 8192
    max_running_requests: int | None = None
    max_prefill_tokens: int | None = None
    disable_radix_cache: bool = False
    enable_mixed_chunk: bool = True  # running requests decode inside prefill steps
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
    # structured output (json_schema, regex, ebnf): xgrammar, or none (such requests refused)
    grammar_backend: str = "xgrammar"
    grammar_compile_timeout: float = 30.0  # seconds; a request whose grammar takes longer: 400
    # speculative decoding: NGRAM (drafts from the request's own tokens), STANDALONE (a
    # draft model's), or None (off); engine/speculative.py
    speculative_algorithm: str | None = None
    speculative_num_draft_tokens: int = 4
    speculative_num_steps: int | None = None  # STANDALONE, NEXTN: draft steps (None: tokens)
    speculative_draft_model_path: str | None = None
    # a benchmark aid, refused outside one (BREAKGRAPH_BENCH): every verify step keeps this
    # mean number of tokens per request whatever the target says (speculative.py)
    bench_synthetic_accept_length: float | None = None
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
