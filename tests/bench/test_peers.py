"""``breakgraph bench peers`` on the CPU: the whole harness against a second ``breakgraph serve``
standing in for the peer (the ``command`` preset; the embedded SmolLM2's shapes on dummy
weights, tiny workloads), and the ``vllm`` preset's command line and environment as the vLLM
tree's README gives them (vLLM itself runs on the GPU machine only)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

import pytest

from breakgraph.bench import peer_engines as pe
from breakgraph.cli import build_parser
from tests.support.server import pid_alive

pytest.importorskip("aiohttp")

PEER_COMMAND = (
    "{python} -m breakgraph.cli serve --model-path {model_dir} --load-format dummy "
    "--host {host} --port {port} --context-length {context_length}"
)


def test_vllm_preset_starts_vllm_as_its_readme_says(tmp_path):
    site = tmp_path / "site"
    spec = pe.vllm_spec(str(site), "/tmp/vllm-cache", [], None)
    model_dir, config, raised = pe.write_model_dir("qwen3-0.6b", tmp_path, 70000)
    assert raised and json.loads((model_dir / "config.json").read_text()) == config
    assert config["max_position_embeddings"] == 70000  # vLLM sizes its rotary cache by it
    assert spec.argv(model_dir, 8000, 70000, "default", config) == [
        sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(model_dir),
        "--load-format", "dummy", "--skip-tokenizer-init", "--generation-config", "vllm",
        "--host", "127.0.0.1", "--port", "8000", "--max-model-len", "70000",
        "--enable-prompt-tokens-details",
    ]  # fmt: skip
    latency = spec.argv(model_dir, 8000, 70000, "latency", config)
    assert latency[-2:] == ["--max-num-batched-tokens", "16384"]
    env = spec.added_env(raised)
    assert env["VLLM_ALLOW_LONG_MAX_MODEL_LEN"] == "1"
    assert env["PYTHONPATH"].split(":")[0] == str(site)
    assert {k: env[k] for k in ("VLLM_USE_FLASHINFER_SAMPLER", "HF_HUB_OFFLINE",
            "TRANSFORMERS_OFFLINE", "VLLM_NO_USAGE_STATS", "VLLM_CACHE_ROOT")} == {
        "VLLM_USE_FLASHINFER_SAMPLER": "0", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1", "VLLM_CACHE_ROOT": "/tmp/vllm-cache",
    }  # fmt: skip
    assert env["TRITON_CACHE_DIR"] == "/tmp/vllm-cache/triton"  # not breakgraph's, carried

    # a config long enough already is left alone, and needs no long-context switch
    _, llama, raised = pe.write_model_dir("llama-3.1-8b", tmp_path, 70000)
    assert not raised and "VLLM_ALLOW_LONG_MAX_MODEL_LEN" not in spec.added_env(raised)
    # Gemma 4 against vLLM's trim of its KV-shared layers; breakgraph's is its default
    _, gemma, _ = pe.write_model_dir("gemma-4-e2b", tmp_path, 70000)
    assert "--kv-sharing-fast-prefill" in spec.argv(model_dir, 1, 70000, "default", gemma)
    bg = pe.breakgraph_spec([], [])
    assert "--kv-sharing-fast-prefill" not in bg.argv(model_dir, 1, 70000, "default", gemma)
    assert not bg.has_setting("latency")  # no latency flags: its defaults
    # bench peers' default latency setting for breakgraph: none (its defaults mix chunks)
    from breakgraph.bench.peers import specs
    from breakgraph.cli import build_parser

    bg, _ = specs(build_parser().parse_args(["bench", "peers"]))
    assert not bg.has_setting("latency")

    # what the GPU machine must hold, said before minutes of start-up
    assert "no vLLM tree" in spec.preflight(config)
    (site / "vllm").mkdir(parents=True)
    assert spec.preflight(config) is None
    _, moe, _ = pe.write_model_dir("qwen3-30b-a3b", tmp_path, 70000)
    assert "_moe_C_stable_libtorch.abi3.so is missing" in spec.preflight(moe)
    (site / pe.VLLM_MOE_LIBRARY).touch()
    assert spec.preflight(moe) is None


def test_gemma4_under_vllm_needs_a_transformers_before_5_15(tmp_path):
    """vLLM 0.25.1 reads Gemma 4's head_dim globally, which transformers 5.15 and later
    refuse: said before start-up, with the fix (--vllm-extra-path, another transformers
    first on vLLM's path); with one there the preflight passes."""
    transformers = pytest.importorskip("transformers")
    site = tmp_path / "site"
    (site / "vllm").mkdir(parents=True)
    _, gemma, _ = pe.write_model_dir("gemma-4-e2b", tmp_path, 70000)
    spec = pe.vllm_spec(str(site), "/tmp/vllm-cache", [], None)
    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    if (major, minor) >= (5, 15):
        assert "put transformers 5.14.1" in spec.preflight(gemma)
    older = tmp_path / "tf514"
    (older / "transformers").mkdir(parents=True)
    (older / "transformers" / "__init__.py").write_text('__version__ = "5.14.1"\n')
    spec = pe.vllm_spec(str(site), "/tmp/vllm-cache", [], None, (str(older),))
    assert spec.added_env(False)["PYTHONPATH"].split(":")[:2] == [str(older), str(site)]
    assert spec.preflight(gemma) is None
    (older / "transformers" / "__init__.py").write_text("raise ImportError('tokenizers')\n")
    assert "transformers does not import on vLLM's path" in spec.preflight(gemma)


def test_gemma4_under_vllm_attends_with_triton_without_the_cutlass_dsl(tmp_path, capsys):
    """vLLM 0.25.1's FA4 kernels for Gemma 4 import the CUTLASS DSL, which the pruned tree
    lacks: without it on vLLM's path, the peer runs its Triton attention (said in one line,
    and in the command printed with the results); with it there, vLLM's own choice."""
    site, extra = tmp_path / "site", tmp_path / "extra"
    (site / "vllm").mkdir(parents=True)
    (extra / "transformers").mkdir(parents=True)
    (extra / "transformers" / "__init__.py").write_text('__version__ = "5.14.1"\n')
    _, gemma, _ = pe.write_model_dir("gemma-4-e2b", tmp_path, 70000)
    _, llama, _ = pe.write_model_dir("llama-3.1-8b", tmp_path, 70000)
    spec = pe.vllm_spec(str(site), "/tmp/vllm-cache", [], None, (str(extra),))
    assert spec.preflight(gemma) is None
    assert "no CUTLASS DSL on its path" in capsys.readouterr().out
    argv = spec.argv(tmp_path, 1, 70000, "default", gemma)
    assert argv[-3:] == ["--kv-sharing-fast-prefill", "--attention-backend", "TRITON_ATTN"]
    assert "--attention-backend" not in spec.argv(tmp_path, 1, 70000, "default", llama)
    (extra / "cutlass").mkdir()
    (extra / "cutlass" / "__init__.py").write_text("")
    spec = pe.vllm_spec(str(site), "/tmp/vllm-cache", [], None, (str(extra),))
    assert spec.preflight(gemma) is None and "CUTLASS" not in capsys.readouterr().out
    assert spec.argv(tmp_path, 1, 70000, "default", gemma)[-1] == "--kv-sharing-fast-prefill"


def test_an_engine_that_does_not_start_is_reported_with_its_log(tmp_path):
    from breakgraph.bench.peers import measure

    command = "{python} -c \"print('no such engine'); raise SystemExit(3)\""
    spec = pe.command_spec("broken", command, ["A=1"], "/health", None, [], [])
    args = build_parser().parse_args(["bench", "peers", "--cold-start"])
    model_dir, config, raised = pe.write_model_dir("smollm2-135m", tmp_path, 512)
    run = pe.EngineRun(engine="broken", model="smollm2-135m", setting="default")
    measure(run, spec, model_dir, config, raised, args, tmp_path)
    assert "broken exited (3)" in run.error and "no such engine" in run.error
    assert run.startup_s is None and run.startup_cold_s is None and run.env == {"A": "1"}


def test_no_engine_outlives_the_bench(tmp_path):
    """A bench killed outright (a device run's time limit) takes its engine with it, so the
    next run finds the GPU free."""
    code = (
        "import sys, time; from pathlib import Path; from breakgraph.bench import peer_engines "
        "as pe; from breakgraph.bench.host_api import free_port\n"
        "spec = pe.command_spec('http', '{python} -m http.server {port} --bind {host}', [], '/',"
        " None, [], [])\nport = free_port()\n"
        "run = pe.start_engine(spec, spec.argv(Path('.'), port, 0, 'default', {}), {}, port, "
        "Path(sys.argv[1]), 60)\nprint(run.proc.pid, flush=True); time.sleep(120)"
    )
    bench = subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "http.log")],
                             stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        engine = int(bench.stdout.readline())
        assert pid_alive(engine)
    finally:
        bench.kill()
        bench.wait()
    deadline = time.monotonic() + 10
    while pid_alive(engine) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not pid_alive(engine)


def test_harness_end_to_end_against_a_second_breakgraph(tmp_path):
    """Both servers start one after the other, each driven through /v1/completions: startup,
    the first requests after ready, a cold and a hit prefill workload, two serving levels;
    then a table with both engines' values and their ratios, the JSON and the plot."""
    from breakgraph.bench.peers import run_peers_bench

    argv = [
        "bench", "peers", "--models", "smollm2-135m", "--peer", "command",
        "--peer-name", "stand-in", "--peer-command", PEER_COMMAND,
        "--peer-flush-path", "/flush_cache", "--context-length", "256",
        "--first-tokens", "16", "--first-waves", "2",
        "--prefill", "cold 16 2", "hit 32 1", "--hit-new-tokens", "8",
        "--warmup-waves", "0", "--waves", "1",
        "--concurrency", "1", "2", "--input-len", "16", "--output-len", "4",
        "--requests-per-level", "2", "--rounds", "1", "--profile", "hit 32 1",
        "--log-dir", str(tmp_path / "logs"), "--json", str(tmp_path / "peers.json"),
    ]  # fmt: skip
    plot = None
    if __import__("importlib").util.find_spec("matplotlib") is not None:
        plot = tmp_path / "peers.png"
        argv += ["--plot", str(plot)]
    args = build_parser().parse_args(argv)
    result = run_peers_bench(args)

    runs = {run["engine"]: run for run in result["runs"]}
    assert sorted(runs) == ["breakgraph", "stand-in"]
    for name, run in runs.items():
        assert run["error"] is None, (name, run["error"])
        assert run["startup_s"] > 0 and run["version"] == __import__("breakgraph").__version__
        assert str(tmp_path / "logs" / "models" / "smollm2-135m") in run["command"]
        assert len(run["first"]["ttfts_ms"]) == 2
        cold, hit = run["prefill"]
        assert (cold["label"], hit["label"]) == ("cold 16 x2", "hit 32+8 x1")
        # the prefix's tokens came back cached, as the OpenAI usage reports them
        assert hit["cached_tokens_per_req"] == 32 and cold["cached_tokens_per_req"] == 0
        levels = {row["concurrency"]: row for row in run["serving"]}
        assert sorted(levels) == [1, 2]
        # a chunk per token: decode steps were timed (one final chunk would leave none)
        assert all(row["decode_step_p50_ms"] > 0 for row in levels.values())
        assert all(row["output_tok_s"] > 0 for row in levels.values())
        # --profile: one more wave under the engine's profiler (/start_profile, /stop_profile),
        # its trace in the engine's profile folder (no GPU events on the CPU)
        (trace,) = run["profile"]["files"]
        assert trace.startswith(str(tmp_path / "logs")) and trace.endswith(".trace.json.gz")
        assert run["profile"]["gpu_ms"] == 0.0
        # stopped: nothing answers on its port any more
        port = int(run["command"][run["command"].index("--port") + 1])
        with pytest.raises(OSError), socket.create_connection(("127.0.0.1", port), timeout=2):
            pass
    assert runs["stand-in"]["command"][:3] == [sys.executable, "-m", "breakgraph.cli"]

    (table,) = result["tables"]
    assert (table["model"], table["setting"]) == ("smollm2-135m", "default")
    rows = {row["metric"]: row for row in table["rows"]}
    for metric in ("startup to ready (s)", "cold 16 x2: TTFT p50 (ms)",
                   "hit 32+8 x1: TTFT p50 (ms)", "serving, concurrency 2: output tok/s"):  # fmt: skip
        row = rows[metric]
        assert row["ratio"] == pytest.approx(row["breakgraph"] / row["peer"])
    assert rows["serving, concurrency 2: output tok/s"]["higher_is_better"]
    assert json.loads((tmp_path / "peers.json").read_text())["tables"] == result["tables"]
    if plot is not None:
        assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_profile_sums_gpu_time_by_kernel_and_kind(tmp_path):
    """peer_profile.summarize over Chrome traces (one gzipped, one plain): GPU events only,
    summed by kernel name and by kind; vLLM is profiled through --profiler-config."""
    import gzip

    from breakgraph.bench import peer_profile as pp

    def x(name, ts, dur, cat="kernel"):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}

    worker = {"traceEvents": [
        x("flash::FlashAttnFwdSm90<...>", 0, 300), x("nvjet_tst_128x256_64x4", 300, 500),
        x("nvjet_tst_128x256_64x4", 800, 500), x("rms_norm_kernel", 1300, 50),
        x("Memcpy HtoD (Pinned -> Device)", 1350, 10, "gpu_memcpy"),
        x("aten::mm", 0, 9999, "cpu_op"), {"ph": "i", "name": "marker", "ts": 5},
    ]}  # fmt: skip
    (tmp_path / "w.trace.json.gz").write_bytes(gzip.compress(json.dumps(worker).encode()))
    front = {
        "traceEvents": [x("_extend_attention_kernel", 10, 200), x("fused_moe_kernel", 210, 90)]
    }
    (tmp_path / "f.json").write_text(json.dumps(front))
    res = pp.summarize([tmp_path / "w.trace.json.gz", tmp_path / "f.json"], top=3)
    assert res["gpu_ms"] == pytest.approx((300 + 1000 + 50 + 10 + 200 + 90) / 1e3)
    assert res["span_ms"] == pytest.approx((1360 + 290) / 1e3)  # each trace's first to last
    assert res["kinds"] == pytest.approx({"gemm": 1.0, "attention": 0.5, "moe": 0.09,
                                          "norm": 0.05, "copy": 0.01})  # fmt: skip
    assert res["kernels"][0] == ["nvjet_tst_128x256_64x4", 1.0, 2] and len(res["kernels"]) == 3
    lines = pp.format_profiles("cold 8192 8", {"breakgraph": res, "vllm": res})
    assert "| gemm | 1.00 | 1.00 |" in lines and "| all GPU events | 1.65 | 1.65 |" in lines
    vllm = pe.vllm_spec("/site", "/cache", [], None)
    flag, config = pp.profiler_argv(vllm, "/tmp/p")
    assert flag == "--profiler-config"
    assert json.loads(config) == {"profiler": "torch", "torch_profiler_dir": "/tmp/p",
                                  "torch_profiler_with_stack": False}  # fmt: skip
    assert pp.profiler_argv(pe.breakgraph_spec([], []), "/tmp/p") == []
