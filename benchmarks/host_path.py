"""Host time around the forward for long prompts (issue 14, item 2), on the CPU: API-side
validation of a /generate body, the GenerateReq codec across the process boundary, the
engine's range check of the decoded ids, an extend step's batch build, and the radix tree's
match + insert, for one 65,536-id prompt and for 8 x 8,192; and a prefill step's check that
no request of its batch computes an admitted prompt, for those and 128 x 64. Each stage
runs against an inline copy of its former implementation in the same run (best of --reps).
Usage: python benchmarks/host_path.py [--reps N]"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import msgpack
import numpy as np
import orjson
import torch

from breakgraph.cache.radix_cache import RadixCache
from breakgraph.engine.sampling_params import SamplingParams
from breakgraph.forward_batch import ForwardBatch, ForwardMode, token_positions, upload_many
from breakgraph.server import protocol
from breakgraph.server.http import _prepare_generate
from breakgraph.server.messages import GenerateReq, ModelInfo, decode, encode

VOCAB = 151_936
CPU = torch.device("cpu")
INFO = ModelInfo("bench", "Qwen3ForCausalLM", VOCAB, 131_072, 64, 1 << 20, "bfloat16", "cpu", 0)


# ---- the former implementations (the reference) ----
def old_check_depth(body: Any) -> None:
    stack = [(body, 1)] if isinstance(body, list | dict) else []
    while stack:
        obj, depth = stack.pop()
        if depth > protocol.MAX_JSON_DEPTH:
            raise protocol.APIError("too deep")
        for child in obj.values() if isinstance(obj, dict) else obj:
            if isinstance(child, list | dict):
                stack.append((child, depth + 1))


def old_check_input_ids(ids: Any, info: ModelInfo, field: str = "") -> list[int]:
    if not isinstance(ids, list):
        raise protocol.APIError("input_ids must be a list of integers")
    if not ids:
        raise protocol.APIError("the prompt is empty")
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, int):
            raise protocol.APIError(f"token id {t!r} is not an integer")
        if not 0 <= t < info.vocab_size:
            raise protocol.APIError(f"token id {t} is out of range [0, {info.vocab_size})")
    return ids


def old_encode(msg: GenerateReq) -> bytes:  # ids as a msgpack list of ints
    return msgpack.packb({"type": "GenerateReq", **vars(msg)}, default=vars)


def old_decode(data: bytes) -> GenerateReq:
    wire = msgpack.unpackb(data)
    del wire["type"]
    wire["sampling"] = SamplingParams(**wire["sampling"])
    return GenerateReq(**wire)


def old_upload(rows: list[list[int]], dtype: torch.dtype) -> list[torch.Tensor]:
    flat = [x for r in rows for x in r]
    return list(torch.split(torch.tensor(flat, dtype=dtype), [len(r) for r in rows]))


def old_batch(prompts: list[list[int]], slots: torch.Tensor) -> None:
    """The former extend-step build: Python lists of every token's row, column and position,
    converted by torch.tensor (the table write's rows and columns, then the batch's ids)."""
    input_ids: list[int] = []
    rows: list[int] = []
    cols: list[int] = []
    for i, p in enumerate(prompts):
        input_ids.extend(p)
        rows.extend([i] * len(p))
        cols.extend(range(len(p)))
    old_upload([rows, cols], torch.int64)
    starts, positions, acc = [], [], 0
    for p in prompts:
        starts.append(acc)
        positions.extend(range(len(p)))
        acc += len(p)
    ends = [s + len(p) - 1 for s, p in zip(starts, prompts, strict=True)]
    old_upload([input_ids, positions, slots.tolist(), list(range(len(prompts))), ends], torch.int64)


def list_batch(prompts: list[list[int]], slots: torch.Tensor) -> None:
    """The eighth session's build: numpy rows and positions, the prompts Python lists."""
    input_ids: list[int] = []
    for p in prompts:
        input_ids.extend(p)
    new_batch(prompts, slots, input_ids)


def new_batch(prompts: list, slots: torch.Tensor, input_ids=None) -> None:
    """What PrefillManager._build does now (numpy rows and positions, slots as a tensor,
    the prompts int32 arrays concatenated)."""
    if input_ids is None:
        input_ids = np.concatenate(prompts)
    ext = np.asarray([len(p) for p in prompts], dtype=np.int64)
    zeros = np.zeros(len(prompts), dtype=np.int64)
    cols = token_positions(zeros, ext)
    upload_many([np.repeat(np.arange(len(prompts)), ext), cols], torch.int64, CPU)
    ForwardBatch.build(ForwardMode.EXTEND, input_ids, slots, list(range(len(prompts))),
                       zeros.tolist(), ext.tolist(), CPU)  # fmt: skip


def batch_build(prompts: list[list[int]], reps: int) -> tuple[float, float, float]:
    slots = torch.arange(sum(len(p) for p in prompts))
    arrays = [np.array(p, dtype=np.int32) for p in prompts]
    before = best_ms(lambda: old_batch(prompts, slots), reps)
    lists = best_ms(lambda: list_batch(prompts, slots), reps)
    after = best_ms(lambda: new_batch(arrays, slots), reps)
    return before, lists, after


# ---- timing ----
def best_ms(fn: Callable[[], Any], reps: int, setup: Callable[[], Any] | None = None) -> float:
    """Best of ``reps`` runs of ``fn(setup())`` (or ``fn()``), setup untimed."""
    best = float("inf")
    for _ in range(reps + 1):  # the first run warms up
        arg = setup() if setup is not None else None
        start = time.perf_counter()
        fn(arg) if setup is not None else fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


@dataclass
class Row:
    case: str
    stage: str
    before_ms: float
    after_ms: float


def patched(module: Any, **impls: Any):
    """A context manager that swaps module attributes for the reference ones."""

    class _Swap:
        def __enter__(self):
            self.saved = {k: getattr(module, k) for k in impls}
            for k, v in impls.items():
                setattr(module, k, v)

        def __exit__(self, *exc):
            for k, v in self.saved.items():
                setattr(module, k, v)

    return _Swap()


def validation(prompts: list[list[int]], batch: bool, reps: int) -> tuple[float, float]:
    raw = orjson.dumps({"input_ids": prompts if batch else prompts[0],
                        "sampling_params": {"max_new_tokens": 1}})  # fmt: skip
    state = SimpleNamespace(tokenizer=None, info=INFO)
    after = best_ms(lambda: _prepare_generate(raw, state), reps)
    # the former pipeline: orjson's Python ints (no simdjson int64 buffer), checked one by one
    with patched(protocol, _check_depth=old_check_depth, check_input_ids=old_check_input_ids,
                 _parse_prompt_body=lambda raw: None):  # fmt: skip
        before = best_ms(lambda: _prepare_generate(raw, state), reps)
    return before, after


def codec(prompts: list[list[int]], reps: int) -> list[tuple[str, float, float]]:
    """GenerateReq encode (API process) and decode (engine process), timed apart."""
    sampling = SamplingParams(max_new_tokens=1)
    msgs = [GenerateReq(f"r{i}", p, sampling) for i, p in enumerate(prompts)]
    # as the server sends them: the ids the API validated, which carry their int32 bytes
    validated = [GenerateReq(f"r{i}", protocol.check_input_ids(p, INFO), sampling)
                 for i, p in enumerate(prompts)]  # fmt: skip
    new_wire = [encode(m) for m in validated]
    old_wire = [old_encode(m) for m in msgs]
    assert [decode(w).input_ids.tolist() for w in new_wire] == prompts
    assert [old_decode(w) for w in old_wire] == msgs
    return [
        (
            "GenerateReq encode (API process)",
            best_ms(lambda: [old_encode(m) for m in msgs], reps),
            best_ms(lambda: [encode(m) for m in validated], reps),
        ),
        (
            "GenerateReq decode (engine process)",
            best_ms(lambda: [old_decode(w) for w in old_wire], reps),
            best_ms(lambda: [decode(w) for w in new_wire], reps),
        ),
    ]


def engine_range_check(prompts: list[list[int]], reps: int) -> tuple[float, float]:
    """The engine's backstop vocabulary check of decoded prompts: on the int32 array the
    codec decodes (a numpy min/max) against a plain list (converted first)."""
    from breakgraph.engine.engine import ids_in_vocab

    sampling = SamplingParams(max_new_tokens=1)
    decoded = [decode(encode(GenerateReq(f"r{i}", p, sampling))).input_ids
               for i, p in enumerate(prompts)]  # fmt: skip
    plain = [ids.tolist() for ids in decoded]
    assert all(ids_in_vocab(ids, VOCAB) is not None for ids in decoded + plain)
    after = best_ms(lambda: [ids_in_vocab(ids, VOCAB) for ids in decoded], reps)
    before = best_ms(lambda: [ids_in_vocab(ids, VOCAB) for ids in plain], reps)
    return before, after


class _NoFree:
    def free(self, slots: torch.Tensor) -> None:
        pass


def radix(prompts: list[list[int]], stored: list[list[int]], reps: int) -> tuple[float, float]:
    """match_prefix + insert of each prompt into a fresh tree holding ``stored``: the prompt
    as a Python list (converted on entry; the tree's keys were lists until the ninth
    session) against the int32 array the engine now holds."""

    def setup() -> RadixCache:
        tree = RadixCache(_NoFree())
        for key in stored:
            tree.insert(key, torch.arange(len(key)))
        return tree

    slots = [torch.arange(len(p)) for p in prompts]

    def run(keys) -> Callable[[RadixCache], None]:
        def go(tree: RadixCache) -> None:
            for p, s in zip(keys, slots, strict=True):
                tree.match_prefix(p)
                tree.insert(p, s)

        return go

    arrays = [np.array(p, dtype=np.int32) for p in prompts]
    return best_ms(run(prompts), reps, setup), best_ms(run(arrays), reps, setup)


def old_computes_same_prompt(batch: list, req: Any) -> bool:
    """The former admission check: every request of the batch compared with ``req``."""
    n = len(req.input_ids)
    return any(
        len(m.input_ids) == n
        and m.cached_len < n - 1
        and np.array_equal(m.input_ids, req.input_ids)
        for m in batch
    )


def admission(prompts: list[list[int]], reps: int) -> tuple[float, float]:
    """A prefill step's check, per request admitted, that no request of the batch computes
    its prompt: pairwise before, the batch's prompt index (engine/prefill.py) now."""
    from breakgraph.engine.prefill import _PromptIndex

    reqs = []
    for p in prompts:
        ids = np.array(p, dtype=np.int32)
        ids.flags.writeable = False
        reqs.append(SimpleNamespace(input_ids=ids, cached_len=0))

    def before() -> None:
        batch: list = []
        for r in reqs:
            assert not old_computes_same_prompt(batch, r)
            batch.append(r)

    def after() -> None:
        index = _PromptIndex()
        for r in reqs:
            assert not index.computes(r)
            index.add(r)

    return best_ms(before, reps), best_ms(after, reps)


def diverged(key: list[int], at: int) -> list[int]:
    """``key`` with a different token at ``at`` (and the same after it)."""
    out = list(key)
    out[at] = (out[at] + 1) % VOCAB
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    rng = random.Random(0)
    cases = {
        "1 x 65536": [[rng.randrange(VOCAB) for _ in range(65_536)]],
        "8 x 8192": [[rng.randrange(VOCAB) for _ in range(8_192)] for _ in range(8)],
    }
    rows: list[Row] = []
    for case, prompts in cases.items():
        batch = len(prompts) > 1
        rows.append(
            Row(case, "API validation (/generate body)", *validation(prompts, batch, args.reps))
        )
        rows += [Row(case, *stage) for stage in codec(prompts, args.reps)]
        rows.append(
            Row(case, "engine range check (decoded ids)", *engine_range_check(prompts, args.reps))
        )
        before, lists, after = batch_build(prompts, args.reps)
        rows.append(Row(case, "extend batch build (ids, rows, positions)", before, lists))
        rows.append(Row(case, "extend batch build, prompts as int32 arrays", lists, after))
        radix_arms = {
            "hit (tree holds the prompts)": prompts,
            "miss (tree empty)": [],
            "diverges at the middle": [diverged(p, len(p) // 2) for p in prompts],
            "diverges at the last id": [diverged(p, len(p) - 1) for p in prompts],
        }
        for arm, stored in radix_arms.items():
            rows.append(
                Row(case, f"radix, list -> array keys, {arm}", *radix(prompts, stored, args.reps))
            )
    # a burst of short prompts of one length (a benchmark's, or one template's)
    cases["128 x 64"] = [[rng.randrange(VOCAB) for _ in range(64)] for _ in range(128)]
    for case, prompts in cases.items():
        rows.append(Row(case, "prefill admission: prompt computed in the batch?",
                        *admission(prompts, args.reps)))  # fmt: skip
    threads = torch.get_num_threads()
    print(f"torch {torch.__version__}, {threads} intra-op threads; best of {args.reps} runs")
    print(f"{'case':<10} {'stage':<48} {'before ms':>10} {'after ms':>10} {'before/after':>13}")
    for r in rows:
        ratio = r.before_ms / r.after_ms
        print(
            f"{r.case:<10} {r.stage:<48} {r.before_ms:>10.3f} {r.after_ms:>10.3f} {ratio:>12.2f}x"
        )


if __name__ == "__main__":
    main()
