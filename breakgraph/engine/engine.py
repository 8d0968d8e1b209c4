"""The engine: model, KV cache, radix tree, scheduler; ``step()`` runs one batch.

Used in-process by ``breakgraph generate`` and the benchmarks, and inside the engine
process behind the HTTP server.
"""

from __future__ import annotations

import array
import logging
import uuid
from collections.abc import Sequence
from dataclasses import asdict

import numpy as np
import torch

from breakgraph.cache.kv_pool import SlotAllocator
from breakgraph.cache.radix_cache import RadixCache
from breakgraph.common import envs, gc_watch
from breakgraph.common.messages import EngineStats, TokenDelta
from breakgraph.common.sampling_params import check_logprob_args
from breakgraph.distributed import TPGroup
from breakgraph.engine.args import EngineArgs
from breakgraph.engine.config import SchedulerConfig
from breakgraph.engine.generate import generate as _generate
from breakgraph.engine.grammar import (
    GrammarCompiler,
    GrammarMask,
    GrammarUnavailable,
    PendingGrammars,
)
from breakgraph.engine.memory import memory_log_line
from breakgraph.engine.mtp import MtpDrafter
from breakgraph.engine.output import finished_output
from breakgraph.engine.rank import build_rank, claim_device, rank_device
from breakgraph.engine.rank_ops import StateRewind
from breakgraph.engine.request import Req, SamplingParams
from breakgraph.engine.scheduler import Scheduler
from breakgraph.engine.step_timer import StepTiming
from breakgraph.engine.tp.driver import TPDriver
from breakgraph.engine.verify_step import draft_tokens
from breakgraph.engine.warmup import WarmupReport, warmup_serving_shapes
from breakgraph.kernels import jit_watch
from breakgraph.models.loader import peek_config
from breakgraph.models.registry import check_tp_support

logger = logging.getLogger(__name__)


def ids_in_vocab(input_ids: Sequence[int] | np.ndarray, vocab_size: int) -> np.ndarray | None:
    """The ids as an int array if all are ints in [0, vocab), else None: an int array is
    checked as it is (one numpy max, microseconds for 64K packed ids), a list converted in
    one C pass first (~1 ms for 64K)."""
    if isinstance(input_ids, np.ndarray):
        ids = input_ids if input_ids.dtype.kind in "iu" else None
    else:
        try:
            ids = np.frombuffer(array.array("q", input_ids), dtype=np.int64)
        except (TypeError, OverflowError):  # a non-integer, or past int64
            ids = None
    # one pass: read as unsigned, a negative id is past any vocabulary
    if ids is None or not ids.view(f"u{ids.dtype.itemsize}").max() < vocab_size:
        return None
    return ids


def _prompt_array(ids: np.ndarray) -> np.ndarray:
    """A checked prompt as the engine keeps it: int32 and read-only, its own copy (of the
    server's packed ids a memcpy: microseconds for 64K)."""
    arr = np.array(ids, dtype=np.int32)  # a copy: the caller's buffer may be reused
    arr.flags.writeable = False
    return arr


class Engine:
    def __init__(self, args: EngineArgs):
        """With ``args.tp_size`` N > 1 this is TP rank 0: it spawns ranks 1..N-1 (stop them
        with ``shutdown()``) and runs the scheduler; every rank holds a shard of the model."""
        self.args = args
        self.tp_driver: TPDriver | None = None
        if args.tp_size != 1:
            config = peek_config(args.model_path)
            if config is not None:  # fail before spawning anything
                check_tp_support(config, args.tp_size)
            self.tp_driver = TPDriver(args, args.tp_size)
        try:
            self._init(args)
        except BaseException:
            self.shutdown()
            raise

    def shutdown(self, leave_group: bool = True) -> None:
        """Stop the TP workers, if any (idempotent; a TP 1 engine holds none).
        ``leave_group=False`` where the process exits next: see ``TPDriver.shutdown``."""
        if self.tp_driver is not None:
            self.tp_driver.shutdown(leave_group)
        grammars = getattr(self, "grammars", None)
        if grammars is not None:
            grammars.shutdown()

    def _init(self, args: EngineArgs) -> None:
        self.warmup_report: WarmupReport | None = None
        device = torch.device(args.resolved_device())
        driver = self.tp_driver
        if driver is not None:
            device = rank_device(device, 0)
        claim_device(device)
        torch.manual_seed(args.seed)
        self.tp_group = driver.join_group(device) if driver else TPGroup(device=device)
        self.rank = rank = build_rank(
            args, device, self.tp_group,
            agree_slots=driver.agree_num_slots if driver else lambda n: n,
            on_tables=driver.attach if driver else lambda req_pool: None,
        )  # fmt: skip
        self.device, self.dtype, self.context_len = rank.device, rank.dtype, rank.context_len
        self.model, self.model_config, self.tokenizer = rank.model, rank.config, rank.tokenizer
        self.model_source, self.eos_token_ids = rank.model_source, rank.eos_token_ids
        self.penalties, self.kv_pool, self.req_pool = rank.penalties, rank.kv_pool, rank.req_pool
        self.max_running_requests = rank.max_running_requests
        self.runner = rank.runner
        send = None
        if driver is not None:
            self.runner.attach_tp(driver)
            send = driver.send_op
            if isinstance(rank.drafter, MtpDrafter):  # a draft model runs on rank 0 only
                rank.drafter.attach_tp(driver)
        self.allocator = SlotAllocator(rank.num_slots + 1)
        self.tree = RadixCache(self.allocator, disable=args.disable_radix_cache)
        overlap = device.type == "cuda" if args.overlap_schedule is None else args.overlap_schedule
        self.scheduler = Scheduler(
            self.runner.forward,
            self.allocator,
            self.req_pool,
            self.tree,
            SchedulerConfig(
                chunked_prefill_size=args.chunked_prefill_size,
                max_running_requests=self.max_running_requests,
                max_context_len=self.context_len,
                eos_token_ids=self.eos_token_ids,
                enable_mixed_chunk=args.enable_mixed_chunk,
                overlap=overlap,
                max_prefill_tokens=args.max_prefill_tokens,
                prefix_align=getattr(self.model, "prefix_align", 1),
                prefix_recompute=getattr(self.model, "prefix_recompute", 0),
                speculative_num_draft_tokens=draft_tokens(args, self.model),
                speculative_synthetic_accept_length=args.bench_synthetic_accept_length,
                speculative_chain=envs.SPEC_CHAIN.get(),
            ),
            device,
            stop_text=self._stop_text if self.tokenizer is not None else None,
            prompt_forward=self.runner.forward_prompt,
            penalties=self.penalties,
            penalized_forward=self.runner.forward_penalized,
            grammar_mask=GrammarMask(self.vocab_size, device),
            drafter=rank.drafter,
            states=StateRewind(self.kv_pool, self.req_pool, send),
        )
        # requests whose grammar compiles (on threads), and those refused: (rid, reason)
        self.grammars = self._grammars(args)
        self._rejected: list[tuple[str, str]] = []
        logger.info(
            "engine ready: %d KV slots (%.2f GiB), max %d running requests, context %d",
            rank.num_slots,
            self.kv_pool.size_bytes / 2**30,
            self.max_running_requests,
            self.context_len,
        )
        logger.info("%s", memory_log_line(rank.memory))

    def run_warmups(self) -> WarmupReport | None:
        """The serving-shape warm-up, when enabled (see ``--warmups``)."""
        args = self.args
        wanted = args.warmups
        if wanted == "auto":
            wanted = "serving-shapes" if self.device.type == "cuda" else "none"
        if args.skip_server_warmup or wanted == "none":
            return None
        self.warmup_report = warmup_serving_shapes(self, seed=args.seed)
        return self.warmup_report

    def mark_ready(self) -> None:
        """Serving starts: JIT compilations from now on are counted as stalls in traffic."""
        jit_watch.mark_ready()

    def _grammars(self, args: EngineArgs) -> PendingGrammars:
        timeout = args.grammar_compile_timeout
        if args.grammar_backend == "none":
            return PendingGrammars(None, timeout)
        try:
            compiler = GrammarCompiler(self.tokenizer, self.vocab_size, self.eos_token_ids)
        except GrammarUnavailable as e:
            return PendingGrammars(None, timeout, str(e))
        return PendingGrammars(compiler, timeout)

    def _stop_text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    # ---- requests ----
    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    def validate_input(
        self, input_ids: Sequence[int] | np.ndarray, sampling: SamplingParams
    ) -> np.ndarray:
        """Raise ValueError with a message fit for an HTTP 400; return the prompt as the
        int array the check made (converted once)."""
        if not len(input_ids):
            raise ValueError("the prompt is empty")
        checked = ids_in_vocab(input_ids, self.vocab_size)
        if checked is None:
            v = self.vocab_size  # the slow scan only names the first bad id
            ids = input_ids.tolist() if isinstance(input_ids, np.ndarray) else input_ids
            bad = next(t for t in ids if not isinstance(t, int) or not 0 <= t < v)
            raise ValueError(f"token id {bad!r} is out of range [0, {v})")
        sampling.validate()
        sampling.check_token_ids(self.vocab_size)
        total = len(input_ids) + sampling.max_new_tokens
        if total > self.context_len:
            raise ValueError(
                f"prompt ({len(input_ids)} tokens) + max_new_tokens ({sampling.max_new_tokens}) "
                f"= {total} exceeds the context length {self.context_len}"
            )
        if len(input_ids) + 1 > self.allocator.capacity:
            raise ValueError(
                f"prompt ({len(input_ids)} tokens) does not fit the KV pool "
                f"({self.allocator.capacity} tokens; raise --max-total-tokens)"
            )
        return checked

    def add_request(
        self,
        input_ids: Sequence[int] | np.ndarray,
        sampling: SamplingParams | None = None,
        rid: str | None = None,
        return_logprob: bool = False,
        logprob_start_len: int = -1,
        top_logprobs_num: int = 0,
        received_at: float | None = None,
    ) -> str:
        """``received_at``: when the request reached the engine (time.time), for its timeline."""
        sampling = sampling or SamplingParams()
        checked = self.validate_input(input_ids, sampling)
        check_logprob_args(len(input_ids), logprob_start_len, top_logprobs_num)
        rid = rid or uuid.uuid4().hex
        generator = None
        if sampling.seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(sampling.seed)
        req = Req(
            rid=rid,
            input_ids=_prompt_array(checked),
            sampling=sampling,
            return_logprob=return_logprob,
            logprob_start_len=logprob_start_len if return_logprob else -1,
            top_logprobs_num=top_logprobs_num if return_logprob else 0,
            generator=generator,
        )
        if received_at is not None:
            req.received_at = received_at
        if sampling.grammar is None:
            self.scheduler.add(req)
            return rid
        if rid in self.scheduler.reqs or self.grammars.holds(rid):
            raise ValueError(f"request id {rid!r} is already in use")
        self.grammars.submit(req)  # scheduled once its grammar compiled (step)
        return rid

    def abort(self, rid: str) -> TokenDelta | None:
        compiling = self.grammars.abort(rid)
        if compiling is not None:
            return finished_output(compiling, {"type": "abort", "message": "aborted"})
        return self.scheduler.abort(rid)

    def step(self) -> list[TokenDelta]:
        if len(self.grammars):
            ready, rejected = self.grammars.collect()
            for req in ready:
                self.scheduler.add(req)
            self._rejected += [(req.rid, reason) for req, reason in rejected]
        outputs = self.scheduler.step()
        if self.tp_driver is not None:
            # a worker gone during the step (its collectives aborted by the TP watchdog):
            # what the step read back is not to be trusted
            self.tp_driver.check_workers()
        return outputs

    @property
    def last_step_timing(self) -> StepTiming:
        """The last step's host time and, when resolved, an earlier step's GPU time."""
        return self.scheduler.timer.last

    @property
    def has_work(self) -> bool:
        """Whether ``step`` has something to do (a request whose grammar still compiles has
        nothing until it is done: see ``compiling``)."""
        return self.scheduler.has_work or self.grammars.has_ready()

    @property
    def compiling(self) -> bool:
        """Requests wait for their grammar to compile: poll ``has_work`` soon."""
        return len(self.grammars) > 0

    def take_rejected(self) -> list[tuple[str, str]]:
        """(rid, one-line reason) of each request refused since the last call: its grammar did
        not compile, or not in time (the server answers 400)."""
        rejected, self._rejected = self._rejected, []
        return rejected

    def stats(self) -> EngineStats:
        """Live load and KV usage, for the server's /metrics and /get_server_info; the
        forward steps by graph (``forward_steps``: each bank's count, an eager step's by its
        reason, the warm-up's included)."""
        compiles = jit_watch.stats()
        return {
            **asdict(self.scheduler.stats()),
            "forward_steps": self.runner.steps_by_graph(),
            "kernel_compilations_total": compiles.total,
            "kernel_compilations_after_ready": compiles.after_ready,
            "warmup_requests": self.warmup_report.requests if self.warmup_report else 0,
            "warmup_seconds": round(self.warmup_report.seconds, 2) if self.warmup_report else 0,
            **gc_watch.report(),
        }

    def release_finished(self, defer: bool | None = None) -> None:
        """Release finished requests' KV now; ``defer``: from now on, finished requests
        keep it until this is called (the server's loop: after sending their outputs) or
        the next step starts."""
        if defer is not None:
            self.scheduler.defer_release = defer
        self.scheduler.release_finished()

    def flush_cache(self) -> bool:
        """Drop every cached prefix; refused (False) while requests are in flight."""
        self.scheduler.release_finished()
        if self.has_work:
            return False
        return self.tree.flush()

    # ---- convenience: run requests to completion in-process ----
    def encode_prompt(self, prompt: str | list[int], chat: bool = False) -> list[int]:
        if isinstance(prompt, list):
            return prompt
        if self.tokenizer is None:
            raise ValueError(
                f"model {self.model_source!r} has no tokenizer (dummy weights or no tokenizer.json): "
                "send token ids (input_ids) instead of text"
            )
        if chat:
            prompt = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True
            )
        return self.tokenizer.encode(prompt)

    # run prompts to completion in-process (generate.py)
    generate = _generate
