"""The memory plan on the GPU (engine/memory.py, engine/memory_profile.py): every built-in
config starts at default flags and answers a request, with graph pools no larger than the
plan's estimate; the largest request the server accepts runs after ready; the planned banks
are the ones the runner captures."""

from __future__ import annotations

import asyncio
import json
import os

import httpx
import pytest
import torch

from breakgraph.engine.args import EngineArgs
from breakgraph.engine.engine import Engine
from breakgraph.engine.graph_plan import planned_banks
from breakgraph.engine.memory import GIB
from breakgraph.models.sources import BUILTIN_MODELS, CONFIG_DIR
from tests.support.server import ServerProcess, info, post

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

# weights beyond one GPU (its 32-expert cut, deepseek-v4-flash-e32, is the one that fits)
NOT_ONE_GPU = {"deepseek-v4-flash"}
if torch.cuda.mem_get_info()[1] < 100 * GIB:  # an H100: the cut's 78 GiB of weights do not fit
    NOT_ONE_GPU.add("deepseek-v4-flash-e32")
STARTUP_S = 900.0  # dummy weights of a 30B model, the graphs and the serving warm-up
# MEMORY_TEST_MODELS=a,b: only these built-ins (a rerun of a few after a change to the plan)
ONLY = {m for m in os.environ.get("MEMORY_TEST_MODELS", "").split(",") if m}


def _start(name: str, log_dir, *flags: str) -> ServerProcess:
    log = log_dir / f"{name}.log"
    args = ["--model-path", name, "--load-format", "dummy", *flags]
    return ServerProcess(args, log).wait_ready(timeout_s=STARTUP_S)


def test_every_builtin_config_starts_at_default_flags_and_answers(tmp_path):
    """One after another, as a new user would (`breakgraph serve --model-path NAME
    --load-format dummy`): each is ready, answers one request, and its measured graph pools
    fit the plan's estimate (a larger pool would have come out of the KV pool's margin).
    Every model is tried before the test fails, which names each one's outcome."""
    outcomes: dict[str, str] = {}
    for name in sorted((ONLY or set(BUILTIN_MODELS)) - NOT_ONE_GPU):
        try:
            srv = _start(name, tmp_path)
        except (RuntimeError, TimeoutError) as e:
            # the server's own one-line cause: its log's ERROR lines (the last two)
            lines = str(e).splitlines()
            cause = [line for line in lines if " ERROR " in line][-2:] or lines[-1:]
            outcomes[name] = f"did not start: {lines[0]} {' | '.join(cause)}"
            # each outcome as it ends (-s): a run cut by its time limit still shows them
            print(f"{name}: {outcomes[name]}", flush=True)
            continue
        try:
            body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4}}
            r = post(srv, "/generate", body, timeout=300)
            mem = info(srv)["memory"]
            graphs = sum(mem["graph_pool_bytes"].values())
            estimate = mem["graph_pool_estimate_bytes"]
            est = mem["graph_pool_estimates"]
            banks = ", ".join(
                f"{b} {n / GIB:.2f}/{est.get(b, 0) / GIB:.2f}"
                for b, n in mem["graph_pool_bytes"].items()
            )
            summary = (
                f"graph pools {graphs / GIB:.2f} (per bank, measured/estimated: {banks}) "
                "of an estimated "
                f"{estimate / GIB:.2f} GiB, "
                f"activation reserve {mem['activation_reserve_bytes'] / GIB:.2f} GiB, "
                f"KV {mem['kv_tokens']} tokens"
            )
            # what the plan measured: the steps' peaks behind the estimate
            summary += "".join(
                f"; {line.split('memory profile: ', 1)[1]}"
                for line in srv.log().splitlines()
                if "memory profile: " in line
            )
            if r.status_code != 200:
                outcomes[name] = f"answered {r.status_code}: {r.text[:200]}"
            elif graphs > estimate:
                outcomes[name] = f"graph pools over the estimate: {summary}"
            else:
                outcomes[name] = f"ok: {summary}"
        finally:
            code = srv.stop()
        if code != 0 and outcomes[name].startswith("ok"):
            outcomes[name] = f"exited {code}"
        print(f"{name}: {outcomes[name]}", flush=True)
    table = "\n".join(f"{name}: {what}" for name, what in outcomes.items())
    assert all(what.startswith("ok") for what in outcomes.values()), table


async def _largest_load(url: str, ctx: int, max_running: int) -> list[httpx.Response]:
    """A full-context prompt with every row's prompt logprobs (top 20) and n = 2, beside
    enough sampled requests (some with penalties) to fill every running slot."""
    prompt = [5 + (7919 * i) % 30000 for i in range(ctx - 16)]
    sampled = {"temperature": 0.8, "top_p": 0.9, "top_k": 50, "min_p": 0.05, "ignore_eos": True}
    big = {
        "input_ids": prompt,
        "sampling_params": {**sampled, "n": 2, "max_new_tokens": 8, "frequency_penalty": 0.5},
        "return_logprob": True,
        "logprob_start_len": 0,
        "top_logprobs_num": 20,
    }
    small = [
        {
            "input_ids": [3 + i % 97, 11, 13 + i % 5],
            "sampling_params": {
                **sampled,
                "max_new_tokens": 64,
                **({"presence_penalty": 0.3} if i % 4 == 0 else {}),
            },
        }
        for i in range(max_running - 2)
    ]
    limits = httpx.Limits(max_connections=max_running + 1)  # every request at once
    async with httpx.AsyncClient(base_url=url, timeout=1800, limits=limits) as client:
        return await asyncio.gather(*(client.post("/generate", json=b) for b in [big, *small]))


@pytest.mark.parametrize("name", ["gemma-4-e2b", "qwen3-0.6b"])
def test_the_largest_accepted_request_runs_after_ready(tmp_path, name):
    """At default flags, after ready: a prompt of the whole context with prompt logprobs and
    two samples, while every other running slot decodes a sampled request: all answered,
    and the server still up (nothing ran out of memory in traffic)."""
    srv = _start(name, tmp_path)
    try:
        i = info(srv)
        ctx, max_running = i["context_length"], i["max_running_requests"]
        replies = asyncio.run(_largest_load(srv.url, ctx, max_running))
        assert all(r.status_code == 200 for r in replies), [
            r.text[:300] for r in replies if r.status_code != 200
        ]
        big = replies[0].json()
        assert len(big) == 2
        assert len(big[0]["meta_info"]["input_top_logprobs"]) == ctx - 16
        assert srv.proc.poll() is None and httpx.get(f"{srv.url}/health").status_code == 200
    finally:
        assert srv.stop() == 0, srv.log()[-3000:]


@pytest.mark.parametrize("name", ["qwen3-0.6b", "gemma-4-e2b"])
def test_the_models_longest_context_starts_and_runs_a_prompt_that_long(tmp_path, name):
    """``--context-length`` at the model's maximum (its config's ``max_position_embeddings``):
    the server starts (the plan keeps one such request's KV beside the reserve) and answers a
    prompt of the whole context less a few tokens."""
    config = json.loads((CONFIG_DIR / f"{name}.json").read_text())
    ctx = config.get("text_config", config)["max_position_embeddings"]
    srv = _start(name, tmp_path, "--context-length", str(ctx))
    try:
        assert info(srv)["context_length"] == ctx
        prompt = [5 + (7919 * i) % 30000 for i in range(ctx - 8)]
        body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}}
        r = post(srv, "/generate", body, timeout=600)
        assert r.status_code == 200, r.text[:300]
        assert r.json()["meta_info"]["completion_tokens"] == 4
    finally:
        assert srv.stop() == 0, srv.log()[-3000:]


def test_the_planned_banks_are_the_captured_ones():
    """The plan estimates the banks the runner then captures: the same names and buckets, for
    a model with whole prefill graphs (Qwen3) and one with a bounded tail (Gemma 4)."""
    for name in ("qwen3-0.6b", "gemma-4-e2b"):
        eng = Engine(EngineArgs(model_path=name, load_format="dummy", max_total_tokens=65536))
        try:
            planned = planned_banks(
                eng.args, eng.model, eng.penalties, eng.max_running_requests, eng.context_len,
                eng.device,
            )  # fmt: skip
            assert planned == {n: b.sizes for n, b in eng.runner.banks().items()}, name
            mem = eng.rank.memory
            assert sum(mem.graph_pool_bytes.values()) <= mem.graph_pool_estimate_bytes, mem
        finally:
            eng.shutdown()
            del eng
            torch.cuda.empty_cache()
