"""The benches as a user runs them, on the CPU: ``bench prefill cold|hit`` and ``bench serving``
through the CLI against a real server subprocess (a tiny random model, token ids only), their
JSON and PNG outputs, ``bench step --plot``, ``bench plot``, ``bench host``, and the client's
stream accounting."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from breakgraph.bench.http_client import BenchError, ServerClient
from tests.support.hf import make_hf_model
from tests.support.server import metric_values

pytest.importorskip("matplotlib")

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
NUM = r"(\d+(?:\.\d+)?)"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cli(*args: str, timeout_s: float = 120.0) -> str:
    """Run ``python -m breakgraph.cli ARGS``; its stdout (fails with its stderr)."""
    out = subprocess.run(
        [sys.executable, "-m", "breakgraph.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    assert out.returncode == 0, f"exit {out.returncode}\n{out.stdout}\n{out.stderr}"
    return out.stdout


def assert_png(path: Path) -> None:
    assert path.is_file(), f"{path} not written"
    assert path.read_bytes()[:8] == PNG_MAGIC


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The URL of a ``breakgraph serve`` subprocess on a tiny llama (vocab 256, context 512)."""
    model_dir = tmp_path_factory.mktemp("bench-model")
    make_hf_model("llama").save_pretrained(model_dir)
    port = free_port()
    log_path = tmp_path_factory.mktemp("bench-logs") / "server.log"
    log = open(log_path, "w")  # noqa: SIM115 (closed below)
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "breakgraph.cli", "serve", "--port", str(port),
            "--model-path", str(model_dir), "--device", "cpu",
            "--max-total-tokens", "4096", "--chunked-prefill-size", "256",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                pytest.fail(f"server exited ({proc.returncode}):\n{log_path.read_text()}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"server not ready in 120 s:\n{log_path.read_text()}")
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def check_prefill_json(path: Path, mode: str, new_tokens: int) -> dict:
    d = json.loads(path.read_text())
    assert d["bench"] == "prefill" and d["mode"] == mode
    assert (d["tokens"], d["concurrency"], d["new_tokens"]) == (64, 2, new_tokens)
    assert d["vocab_size"] == 256
    assert len(d["waves"]) == 5  # measured waves; the two warm-up waves are not reported
    for w in d["waves"]:
        assert len(w["ttft_ms"]) == 2 and all(t > 0 for t in w["ttft_ms"])
        assert w["wall_ms"] >= max(w["ttft_ms"])
        assert w["prompt_tokens"] == 2 * (64 + (new_tokens if mode == "hit" else 0))
        assert w["input_tok_s"] > 0
    assert 0 < d["ttft_p50_ms"] <= d["ttft_p90_ms"]
    assert d["input_tok_s"] > 0 and d["new_input_tok_s"] > 0
    # the server's timeline of each request: its stages up to the first token cover the TTFT
    stages = d["timeline_p50_ms"]
    assert list(stages)[:6] == ["validate", "send", "ipc", "queue", "schedule", "forward"]
    for w in d["waves"]:
        assert len(w["timelines_ms"]) == 2
        for t, ttft in zip(w["timelines_ms"], w["ttft_ms"], strict=True):
            assert all(v >= 0 for v in t.values())
            assert sum(t.values()) <= ttft + 1.0  # the server's stamps lie within the client's
    return d


def summary_line(out: str) -> str:
    """The summary's first line; the second lists the timeline's stages."""
    first, second = out.strip().splitlines()
    assert second.strip().startswith("timeline p50 (ms): validate ")
    return first


def test_prefill_cold(server, tmp_path):
    out = cli(
        "bench", "prefill", "cold", "64", "2", "--url", server,
        "--json", str(tmp_path / "cold.json"), "--plot", str(tmp_path / "cold.png"),
    )  # fmt: skip
    m = re.fullmatch(
        rf"cold 64 x2: TTFT p50 {NUM} ms, p90 {NUM} ms, input (\d+) tok/s", summary_line(out)
    )
    assert m, out
    d = check_prefill_json(tmp_path / "cold.json", "cold", 64)
    assert float(m[1]) == pytest.approx(d["ttft_p50_ms"], abs=0.01)
    assert d["cached_tokens_per_req"] == 0  # the cache is flushed before every wave
    assert_png(tmp_path / "cold.png")


def test_prefill_hit(server, tmp_path):
    out = cli(
        "bench", "prefill", "hit", "64", "2", "--hit-new-tokens", "32", "--url", server,
        "--json", str(tmp_path / "hit.json"), "--plot", str(tmp_path / "hit.png"),
    )  # fmt: skip
    m = re.fullmatch(
        rf"hit 64\+32 x2: TTFT p50 {NUM} ms, p90 {NUM} ms, input (\d+) tok/s, cached (\d+) tok/req",
        summary_line(out),
    )
    assert m, out
    d = check_prefill_json(tmp_path / "hit.json", "hit", 32)
    assert d["cached_tokens_per_req"] > 0
    assert all(w["cached_tokens"] > 0 for w in d["waves"])  # every wave hits the prefix
    assert d["cached_tokens_per_req"] <= 64  # the prefix, never the new tokens
    assert_png(tmp_path / "hit.png")


def _computed_prompt_tokens(server: str) -> float:
    """Prompt tokens the server has prefilled so far (admitted less cached), from /metrics."""
    values = metric_values(server)
    return values["breakgraph_prompt_tokens_total"] - values["breakgraph_cached_tokens_total"]


def test_prefill_hit_keep_cache_reuses_the_prefix(server, tmp_path):
    """``--keep-cache``: a second run with the same seed finds its prefix cached (no flush,
    no second prefill of it), and its new tokens are fresh (none the first run cached)."""
    args = ["bench", "prefill", "hit", "64", "2", "--hit-new-tokens", "16", "--keep-cache",
            "--url", server, "--json", str(tmp_path / "keep.json")]  # fmt: skip
    cli(*args)
    before = _computed_prompt_tokens(server)
    cli(*args)
    computed = _computed_prompt_tokens(server) - before
    # (2 warm-up + 5 measured waves) x 2 requests x 16 new tokens; in a 256-token vocabulary
    # a new token now and then matches a cached branch's first, so within a few of it: far
    # from the 64 more of a second prefill of the prefix, or the ~0 of repeated new tokens
    new = 7 * 2 * 16
    assert new - 16 <= computed < new + 32, computed
    d = json.loads((tmp_path / "keep.json").read_text())
    assert all(w["cached_tokens"] >= 2 * 63 for w in d["waves"]), d["waves"]


def test_serving(server, tmp_path):
    out = cli(
        "bench", "serving", "--url", server, "--concurrency", "1", "2",
        "--input-len", "32", "--output-len", "8", "--requests-per-level", "2",
        "--json", str(tmp_path / "serving.json"), "--plot", str(tmp_path / "serving.png"),
    )  # fmt: skip
    rows = re.findall(rf"^\| (\d+) \| (\d+) \| {NUM} \| {NUM} \| {NUM} \| {NUM} \|$", out, re.M)
    assert [int(r[0]) for r in rows] == [1, 2, 2, 1], out  # round 2 in reverse order
    assert out.count("| concurrency | requests | decode step p50 (ms) |") == 2
    assert "round 1" in out and "round 2" in out
    d = json.loads((tmp_path / "serving.json").read_text())
    assert d["bench"] == "serving" and (d["input_len"], d["output_len"]) == (32, 8)
    assert [(r["round"], r["concurrency"]) for r in d["rows"]] == [(1, 1), (1, 2), (2, 2), (2, 1)]
    for r in d["rows"]:
        assert r["requests"] == 2
        for key in (
            "decode_step_p50_ms", "tok_s_per_user_p50", "output_tok_s", "input_tok_s",
            "ttft_p50_ms", "e2e_p50_ms", "wall_s",
        ):  # fmt: skip
            assert r[key] > 0, (key, r)
        # 8 tokens per request, 2 requests: the aggregate rate is output / wall time
        assert r["output_tok_s"] == pytest.approx(16 / r["wall_s"])
        assert r["timeline_p50_ms"]["decode"] > 0  # the server's stages, decode included
        # the server's decode step: its decode stage over the 7 tokens after the first
        assert 0 < r["server_decode_step_p50_ms"] < r["e2e_p50_ms"]
    assert out.count("round 2, concurrency 1: server decode step p50 ") == 1
    assert len(re.findall(r"server decode step p50 [\d.]+ ms; validate ", out)) == 4
    assert_png(tmp_path / "serving.png")


def test_step_plot(tmp_path):
    cli(
        "bench", "step", "--models", "smollm2-135m", "-N", "8", "16", "--reps", "1", "--no-hf",
        "--device", "cpu", "--json", str(tmp_path / "step.json"), "--plot", str(tmp_path / "step.png"),
    )  # fmt: skip
    points = json.loads((tmp_path / "step.json").read_text())
    assert [p["new_tokens"] for p in points] == [8, 16]
    assert_png(tmp_path / "step.png")


def test_plots_from_saved_results(tmp_path):
    """``bench plot``: decode (no GPU: no graph arm) and step with a floor arm, from JSON as
    the benches save it."""
    step = [
        {"model": "m", "new_tokens": n, "prefix_tokens": p, "arms": [
            {"arm": "breakgraph graphs", "ms": 1.0 + n / 256, "launches": 40, "note": ""},
            {"arm": "floor", "ms": 0.9 + n / 256, "launches": 1, "note": ""},
            {"arm": "HF compile", "ms": None, "launches": None, "note": "skipped"},
        ]}
        for n in (256, 1024) for p in (0, 4096)
    ]  # fmt: skip
    decode = [
        {"model": "m", "batch_size": bs, "context": 1024, "eager_ms": 20.0, "graph_ms": None,
         "eager_launches": None, "graph_launches": None}
        for bs in (1, 2, 4)
    ]  # fmt: skip
    for name, data in (("step", step), ("decode", decode)):
        (tmp_path / f"{name}.json").write_text(json.dumps(data))
        png = tmp_path / f"{name}.png"
        cli("bench", "plot", name, str(tmp_path / f"{name}.json"), "-o", str(png))
        assert_png(png)


def test_plot_without_matplotlib(monkeypatch):
    from breakgraph.bench.plot import require_matplotlib

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(SystemExit, match="pip install matplotlib"):
        require_matplotlib()


@contextlib.asynccontextmanager
async def _sse_server(events: list[str]):
    """A local HTTP server whose /generate streams ``events``; yields its URL."""
    from aiohttp import web

    body = "".join(f"data: {e}\n\n" for e in events).encode()

    async def generate(request):
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(body)
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_post("/generate", generate)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


def _event(n: int, finish: dict | None = None) -> str:
    meta = {"prompt_tokens": 5, "completion_tokens": n, "cached_tokens": 2, "finish_reason": finish}
    return json.dumps({"text": None, "output_ids": list(range(n)), "meta_info": meta})


def test_stream_accounting_counts_coalesced_tokens():
    """An event carrying several tokens gives each of them an inter-token latency."""
    events = [_event(1), _event(3), _event(4), _event(4, {"type": "length"}), "[DONE]"]

    async def go():
        async with _sse_server(events) as url, ServerClient(url) as c:
            return await c.generate([1, 2, 3, 4, 5], max_new_tokens=4)

    r = asyncio.run(go())
    assert (r.prompt_tokens, r.cached_tokens, r.completion_tokens) == (5, 2, 4)
    assert len(r.itl_ms) == 3  # one per token after the first
    assert r.finish_reason == {"type": "length"}
    assert 0 < r.ttft_ms <= r.e2e_ms


def test_stream_error_event_is_an_error():
    events = [_event(1), json.dumps({"error": {"message": "engine died", "code": 503}}), "[DONE]"]

    async def go():
        async with _sse_server(events) as url, ServerClient(url) as c:
            await c.generate([1, 2], max_new_tokens=4)

    with pytest.raises(BenchError, match="engine died"):
        asyncio.run(go())


def test_step_arms_for_kv_shared_layers(tmp_path):
    """A model with KV-shared layers (Gemma 4) is timed twice: all rows and bounded replay."""
    from tests.support.gemma4 import make_hf_gemma4

    make_hf_gemma4("text").save_pretrained(tmp_path / "gemma4")
    cli(
        "bench", "step", "--models", str(tmp_path / "gemma4"), "-N", "8", "-P", "0", "4",
        "--reps", "1", "--no-hf", "--device", "cpu", "--json", str(tmp_path / "step.json"),
    )  # fmt: skip
    points = json.loads((tmp_path / "step.json").read_text())
    assert [(p["new_tokens"], p["prefix_tokens"]) for p in points] == [(8, 0), (8, 4)]
    for p in points:
        arms = {a["arm"]: a for a in p["arms"]}
        assert set(arms) == {
            "breakgraph eager all rows", "breakgraph graphs all rows",
            "breakgraph eager bounded", "breakgraph graphs bounded",
        }  # fmt: skip
        assert arms["breakgraph eager bounded"]["ms"] > 0 < arms["breakgraph eager all rows"]["ms"]


def test_step_and_decode_benches_under_tensor_parallelism(tmp_path):
    """`--tp 2`: the benches drive the worker rank too (an arm that ran on rank 0 alone would
    wait forever for its all-reduces) and stop it at the end."""
    from tests.support.hf import make_hf_model

    make_hf_model("llama").save_pretrained(tmp_path / "llama")
    common = ["--models", str(tmp_path / "llama"), "--reps", "1", "--device", "cpu", "--tp", "2"]
    cli("bench", "step", *common, "-N", "8", "--no-hf", "--json", str(tmp_path / "step.json"))
    cli("bench", "decode", *common, "--batch-sizes", "1", "2", "--context", "16",
        "--json", str(tmp_path / "decode.json"))  # fmt: skip
    (step,) = json.loads((tmp_path / "step.json").read_text())
    assert next(a for a in step["arms"] if a["arm"] == "breakgraph eager")["ms"] > 0
    decode = json.loads((tmp_path / "decode.json").read_text())
    assert [p["batch_size"] for p in decode] == [1, 2] and all(p["eager_ms"] > 0 for p in decode)


def test_decode_floor_counts_the_bytes_a_step_reads():
    """Weights once (the tied embedding only as the LM head), MoE experts only as many as
    batch x top_k can touch, plus every request's KV."""
    from breakgraph.bench.decode import step_read_bytes
    from breakgraph.layers.moe import FusedMoE
    from breakgraph.models.loader import load_model

    model = load_model("qwen3-moe-tiny", "dummy", "float32", "cpu", 0, None).model
    every = sum(p.numel() * 4 for p in model.parameters())  # parameters() yields a tied one once
    experts = sum(
        p.numel() * 4 for m in model.modules() if isinstance(m, FusedMoE) for p in m.parameters()
    )
    assert experts > 0
    # 16 experts, top-4: batch 4 touches all of them; batch 1 at most a quarter
    assert step_read_bytes(model, 4, 100, 10, top_k=4) == every + 4 * 100 * 10
    assert step_read_bytes(model, 1, 0, 10, top_k=4) == every - experts + experts // 4
    # a verify step of 1 + 3 rows a request: its rows touch experts, its KV is read once
    assert step_read_bytes(model, 1, 100, 10, top_k=4, rows_each=4) == every + 100 * 10


def test_decode_bench_times_a_verify_step_beside_the_plain_one(tmp_path):
    """`--draft-tokens K`: each request's step is a verify step of 1 + K rows over its
    context (every row's logits, decode rows: what serving's speculative step replays), run
    in an engine that verifies K NGRAM drafts."""
    from breakgraph.bench.decode_setup import decode_engine, verify_batch

    eng, rows, slots = decode_engine("smollm2-135m", "cpu", 2, 16, draft_tokens=3)
    try:
        assert eng.scheduler.spec is not None
        batch = verify_batch(eng, rows, slots, 2, 16, 3)
        assert batch.decode_rows and batch.num_tokens == 8 and batch.batch_size == 2
        assert list(batch.seq_lens_cpu) == [20, 20]
        assert batch.out_cache_loc.tolist() == slots[:2, 16:20].reshape(-1).tolist()
        assert eng.runner.forward(batch).shape[0] == 8  # a row of logits per token
    finally:
        eng.shutdown()
    out = cli("bench", "decode", "--models", "smollm2-135m", "--batch-sizes", "1", "--context",
              "16", "--reps", "1", "--device", "cpu", "--draft-tokens", "2",
              "--json", str(tmp_path / "verify.json"))  # fmt: skip
    assert "bs=1+2d" in out
    (pt,) = json.loads((tmp_path / "verify.json").read_text())
    assert pt["draft_tokens"] == 2 and pt["eager_ms"] > 0


def test_decode_profile_kinds_and_line():
    """--profile sorts kernels by name into GEMM / attention / all-reduce / other and prints
    their shares and the step's idle GPU time."""
    from breakgraph.bench.decode import DecodePoint, format_decode_point, kernel_kind

    assert kernel_kind("ncclDevKernel_AllReduce_Sum_bf16_RING_LL") == "all-reduce"
    assert kernel_kind("_decode_split_kernel") == "attention"
    assert kernel_kind("nvjet_tst_64x8_64x16_4x1_v_bz_coopB_TNT") == "gemm"
    assert kernel_kind("_moe_gemm_kernel") == "gemm"
    assert kernel_kind("_rms_norm_kernel") == "other"
    by = {"gemm": 1.2, "attention": 0.3, "other": 0.2, "total": 1.7}
    pt = DecodePoint("m", 1, 1024, 5.0, 2.0, 300, 1, 10.0, 1.5, by)
    line = format_decode_point(pt)
    assert "kernels 300 (10.0/layer)" in line and "floor 1.500 ms (1.33x)" in line
    assert "GPU kernels 1.700 ms (idle 0.300 ms): gemm 1.200 ms (71%)" in line
    assert "back-to-back" not in line
    pt.back_to_back_ms = 1.75  # graph steps with no sync between them
    assert "graph    2.000 ms     2.5x  back-to-back 1.750 ms  kernels 300" in format_decode_point(
        pt
    )


def test_decode_profile_gaps_by_the_kernel_before_them():
    """--profile's gaps: idle GPU time between kernels, charged to the kind of the kernel
    before each gap, per step; overlapping kernels (two streams) leave no gap."""
    from breakgraph.bench.decode import DecodePoint, format_decode_point, gaps_by_kind

    step = [  # µs: gemm, a 20 µs wait after the all-reduce, attention overlapping a norm
        (0, 10, "nvjet_gemm"), (11, 15, "ncclDevKernel_AllReduce"), (35, 45, "_decode_split_kernel"),
        (40, 50, "_rms_norm_kernel"), (50, 60, "nvjet_gemm"),
    ]  # fmt: skip
    two_steps = step + [(s + 100, e + 100, n) for s, e, n in step]
    gaps = gaps_by_kind(two_steps, reps=2)
    assert gaps["all-reduce"] == pytest.approx([0.020, 1.0, 20.0])
    assert gaps["gemm"] == pytest.approx([0.021, 1.5, 40.0])  # 1 µs in each step, 40 between
    assert "attention" not in gaps and "other" not in gaps
    assert gaps_by_kind([], reps=1) == {}
    pt = DecodePoint("m", 1, 1024, 5.0, 2.0, 300, 1, 10.0, 1.5, {"gemm": 1.0, "total": 1.0})
    pt.gpu_gaps_by_kind = gaps
    line = format_decode_point(pt)
    assert "gaps after: gemm 0.021 ms (1.5/step, max 40 us), all-reduce 0.020 ms (1/step" in line


def test_gemm_bench_shapes_and_table_entries(monkeypatch):
    """The projections of a Llama-style config, and measured choices merged into the table
    the skinny-GEMM dispatch reads (None: cuBLAS)."""
    from breakgraph.bench import gemm
    from breakgraph.bench.shapes import projection_shapes
    from breakgraph.kernels import skinny_gemm as sg

    assert dict(projection_shapes("qwen3-0.6b")) == {
        "qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072),
        "lm_head": (151936, 1024),
    }  # fmt: skip
    assert dict(projection_shapes("llama-3.1-8b", tp=2)) == {  # one rank's shard
        "qkv": (3072, 4096), "o": (4096, 2048), "gate_up": (14336, 4096), "down": (4096, 7168),
        "lm_head": (64128, 4096),
    }  # fmt: skip
    gemma = projection_shapes("gemma-4-e2b")  # layer types of two widths, its own ones
    assert len({nk for name, nk in gemma if name == "gate_up"}) == 2
    assert {"per_layer_input_gate", "lm_head"} <= {name for name, _ in gemma}
    a, b = sg.SkinnyConfig(16, 128, 4), sg.SkinnyConfig(64, 256, 1)
    entries = gemm.table_entries([(1, a), (4, a), (16, b), (64, None)])
    assert entries == [(4, a), (16, b), (64, None)]
    monkeypatch.setitem(sg.SKINNY_TABLE, (4096, 1024), entries)
    assert [sg.table_config(m, 4096, 1024) for m in (1, 3, 4, 5, 16, 17, 64, 65)] == [
        a, a, a, b, b, None, None, None,
    ]  # fmt: skip
    assert sg.table_config(1, 4096, 4096 + 8) is None  # a shape never measured
    assert all(1024 // c.split_k >= c.block_k for c in gemm.configs_for(1024))
    # the sweep keeps the table's GEMV entries (batch 1, chosen inside the decode graph)
    v = sg.SkinnyConfig(2, 2048, 1, 2, 2, fuse_norm=False, gemv=True)
    monkeypatch.setitem(sg.SKINNY_TABLE, (4096, 1024), [(1, v), (64, None)])
    assert gemm.with_gemv_entries((4096, 1024), [(1, None), (4, a), (64, None)]) == [
        (1, v), (4, a), (64, None),
    ]  # fmt: skip
    assert gemm.with_gemv_entries((7, 7), entries) == entries


def test_shipped_table_sends_batch_1_to_the_gemv_kernel():
    """Every single-GPU shape of every built-in model takes the GEMV kernel at one row (no
    norm prologue: the tensor-core kernel's only) and not at two, and so does one rank's
    every shape of the tensor-parallel models at 2, 4 and 8 ranks; the exceptions are named
    (``bench gemm --gemv`` measures them)."""
    from breakgraph.bench.shapes import projection_shapes
    from breakgraph.kernels import skinny_gemm as sg
    from breakgraph.models.sources import CONFIG_DIR

    # SmolLM2's LM head: cuBLAS measured faster
    cublas = {("smollm2-135m", "lm_head")}
    # DeepSeek V4's shapes are not swept yet (`bench gemm --gemv --models deepseek-v4-flash`
    # on an H200 adds them): its projections take cuBLAS until then; so do llama-3.2-1b's (a
    # draft model for llama-3.1-8b: `bench gemm --gemv --models llama-3.2-1b`)
    unswept = {
        "qwen3-moe-tiny", "deepseek-v4-flash", "deepseek-v4-flash-e32", "deepseek-v4-tiny",
        "llama-3.2-1b",
    }  # fmt: skip
    models = sorted(p.stem for p in CONFIG_DIR.glob("*.json") if p.stem not in unswept)
    assert "gemma-4-26b-a4b" in models and "qwen3-8b" in models
    for model in models:
        for name, (n, k) in projection_shapes(model):
            one, two = sg.table_config(1, n, k), sg.table_config(2, n, k)
            if (model, name) in cublas:
                assert one is None
                continue
            assert one is not None and one.gemv and not one.fuse_norm, (model, name)
            assert two is None or not two.gemv, (model, name)
    # one rank's shapes of the tensor-parallel models (#17, #18), swept on one H200 too
    for model in ("llama-3.1-8b", "qwen3-8b", "qwen3-30b-a3b"):
        for tp in (2, 4, 8):
            for name, (n, k) in projection_shapes(model, tp):
                one = sg.table_config(1, n, k)
                if (model, name) in cublas:
                    assert one is None
                    continue
                assert one is not None and one.gemv, (model, tp, name)


def test_skinny_table_file_round_trips(tmp_path):
    """``bench gemm --table-out`` writes what ``BREAKGRAPH_SKINNY=PATH`` loads: another GPU's
    table served without editing the code, entries and their None (cuBLAS) kept."""
    import json

    from breakgraph.kernels import skinny_gemm as sg

    table = {
        (4096, 1024): [(4, sg.SkinnyConfig(16, 128, 4, fuse_norm=False)), (64, None)],
        (1024, 3072): [(64, sg.SkinnyConfig(32, 128, 8))],
    }
    path = tmp_path / "table.json"
    path.write_text(json.dumps(sg.table_to_json(table)))
    assert sg.load_table(str(path)) == table


def test_skinny_modes(monkeypatch, knobs):
    """BREAKGRAPH_SKINNY=all: every shape of at most MAX_M rows on a generic config (about
    two programs per SM); =off: none, whatever the table says."""
    from breakgraph.kernels import skinny_gemm as sg

    monkeypatch.setitem(sg.SKINNY_TABLE, (4096, 1024), [(64, sg.SkinnyConfig(16, 128, 2))])
    knobs(SKINNY="off")
    assert sg.table_config(1, 4096, 1024) is None
    knobs(SKINNY="all")
    cfg = sg.table_config(1, 1024, 3072)
    assert cfg == sg.generic_config(1024, 3072) and cfg.split_k > 1
    assert -(-1024 // cfg.block_n) * cfg.split_k >= 132
    assert sg.table_config(sg.MAX_M + 1, 1024, 3072) is None
    assert sg.generic_config(151936, 1024).split_k == 1  # the LM head fills the GPU alone


def test_host_bench_decode_stages_add_up_and_amortize(tmp_path):
    """``bench host decode``: each host stage of a decode step is a positive time within the
    step's host total, and the per-request host cost falls as the batch grows (the step's
    fixed costs are paid once per step)."""
    cli("bench", "host", "decode", "--batch", "1", "16", "--steps", "8", "--rounds", "1",
        "--json", str(tmp_path / "host.json"), timeout_s=300)  # fmt: skip
    got = json.loads((tmp_path / "host.json").read_text())
    assert set(got) == {"batch 1", "batch 16"} and set(got["batch 1"]) == {"this"}
    for label, arms in got.items():
        m = arms["this"]
        stages = [m[k] for k in ("schedule", "launch", "process_outputs")]
        assert min(stages) > 0 and sum(stages) < m["host"], (label, m)
    assert got["batch 16"]["this"]["host"] / 16 < got["batch 1"]["this"]["host"], got


def test_host_bench_times_verify_steps(tmp_path):
    """``bench host decode --speculative NGRAM``: the stages of verify steps (the steps of
    ``batch x (1 + k)`` rows are timed: without them no step would count and the medians
    fail), each positive and within the total."""
    cli("bench", "host", "decode", "--batch", "4", "--steps", "6", "--rounds", "1",
        "--speculative", "NGRAM", "--json", str(tmp_path / "host.json"), timeout_s=300)  # fmt: skip
    m = json.loads((tmp_path / "host.json").read_text())["batch 4"]["this"]
    stages = [m[k] for k in ("schedule", "launch", "process_outputs")]
    assert min(stages) > 0 and sum(stages) < m["host"], m


def test_host_bench_times_a_cold_prefill():
    """``bench host prefill``: a cold prompt's host stages around its forward, each a positive
    time within the step's host total."""
    out = cli("bench", "host", "prefill", "--tokens", "64", "--requests", "8", "--rounds", "1",
              timeout_s=300)  # fmt: skip
    cells = " +".join(f"{k} +{NUM}" for k in ("schedule", "launch", "cache", "process_outputs"))
    got = re.search(rf"^prefill +64 this +µs/step: {cells} +host +{NUM}", out, re.M)
    assert got is not None, out
    stages, host = list(map(float, got.groups()[:-1])), float(got.group(5))
    assert min(stages) > 0 and sum(stages) < host, out


def test_host_bench_api_cpu_per_token():
    """``bench host api`` starts a CPU server on a tiny dummy model, streams closed-loop
    requests and reads both processes' CPU time per output token from /proc. /proc counts
    clock ticks (10 ms): 1,024 output tokens keep the API's CPU time many ticks long."""
    out = cli("bench", "host", "api", "--concurrency", "4", "--requests", "32",
              "--output-len", "32", "--rounds", "1", timeout_s=300)  # fmt: skip
    got = re.search(rf"concurrency 4: API {NUM} µs CPU per output token .*engine {NUM} µs", out)
    assert got is not None and float(got.group(1)) > 0 and float(got.group(2)) > 0, out


def test_decode_variants_read_a_moe_gemv_table_from_either_json(tmp_path):
    """``bench decode --variants moetable=PATH``: the table's rows as JSON, or ``bench moe
    --gemv-kernels --json``'s output (a model's best configs per kernel and step size)."""
    from breakgraph.bench.decode_variants import moe_gemv_table
    from breakgraph.kernels.fused_moe import MoEGemvConfig

    rows = tmp_path / "rows.json"
    rows.write_text(json.dumps([[1, [4, 1024, 2], [4, 1024, 4]], [4, [1, 512, 1], [2, 256, 1]]]))
    assert moe_gemv_table(str(rows), "any") == (
        (1, MoEGemvConfig((4, 1024, 2), (4, 1024, 4))),
        (4, MoEGemvConfig((1, 512, 1), (2, 256, 1))),
    )

    def timed(model, m, kernel, us, cfg):
        return dict(model=model, m=m, kernel=kernel, mb=1.0, table=[us, cfg], top=[[us, cfg]])

    kernels = tmp_path / "kernels.json"
    kernels.write_text(json.dumps([
        timed("a", 1, "gate_up", 14.0, [1, 1024, 1]), timed("a", 1, "down", 10.0, [1, 256, 1]),
        timed("a", 2, "gate_up", 25.0, [1, 512, 1]), timed("a", 2, "down", 17.0, [2, 256, 1]),
        timed("b", 1, "gate_up", 1.0, [8, 128, 8]), timed("b", 1, "down", 1.0, [8, 128, 8]),
    ]))  # fmt: skip
    assert moe_gemv_table(str(kernels), "a") == (
        (1, MoEGemvConfig((1, 1024, 1), (1, 256, 1))),
        (2, MoEGemvConfig((1, 512, 1), (2, 256, 1))),
    )


def test_hf_arm_is_built_in_the_engine_dtype():
    """The HF twin is built in the engine's dtype (a float32 copy first would not fit beside
    a 61 GB bf16 engine on one GPU) and runs its own MoE path."""
    import torch

    from breakgraph.bench.step import HFArms, StepBench

    sb = StepBench("qwen3-moe-tiny", 8, 0, "cpu", dtype="bfloat16")
    hf = HFArms(sb.engine, compile_timeout_s=10)
    assert {p.dtype for p in hf.model.parameters()} == {torch.bfloat16}
    assert type(hf.model).__name__ == "Qwen3MoeForCausalLM"
    logits = hf.eager_fn(8, 0)()
    assert logits.shape[:2] == (1, 1) and logits.dtype == torch.bfloat16
    assert torch.isfinite(logits).all()
    sb.engine.shutdown()
