"""``breakgraph bench peers``: breakgraph and the engine a user would pick instead (vLLM by
default), on the same machine one after the other, each started from nothing and driven by one
client through OpenAI's ``/v1/completions`` with the same token-id prompts, so that the two
differ only in the engine.

Per model (a built-in config on dummy weights, ``peer_engines.write_model_dir``) and per
setting (``default``; ``latency``: the flags an engine's documentation recommends for latency,
its defaults where it names none), each engine is started and measured:

- startup: launch to its ready URL answering 200 (``--cold-start``: first a start with its
  compile caches pointed at empty folders, then the measured start on the caches it filled);
- the first request after ready: ``--first-waves`` prompts of ``--first-tokens`` one after the
  other (``bench prefill cold T 1``, no warm-up); the first's TTFT against the median of the
  fourth on (steady);
- the seed prefill workloads (``bench prefill``'s waves: TTFT p50/p90, input tok/s);
- seed 003's serving table (``bench serving``'s closed loop: TTFT p50, decode step p50, tok/s
  per user, output tok/s per concurrency, the median over its rounds).

Then per model and setting a table breakgraph / peer / ratio (below 1: breakgraph's time is
shorter; on a throughput row above 1 is breakgraph ahead), both engines' command lines, added
environment and versions; ``--json`` all of it, ``--plot`` the ratios. An engine that fails
to start or to serve is reported with its log's tail and the run goes on.
"""

from __future__ import annotations

import asyncio
import functools
import shlex
import signal
import subprocess
import tempfile
from dataclasses import asdict
from pathlib import Path

PEERS_HELP = "breakgraph against another engine (vLLM), started one after the other, one client"
PEERS_EXAMPLE = (  # a second breakgraph standing in for the peer, sized for the CPU
    "breakgraph bench peers --models smollm2-135m --peer command --peer-command "
    "'{python} -m breakgraph.cli serve --model-path {model_dir} --load-format dummy "
    "--port {port}' --context-length 512 --first-tokens 64 --first-waves 2 --prefill "
    "'cold 64 2' --concurrency 1 --input-len 64 --output-len 8 --requests-per-level 2 "
    "--rounds 1"
)
SEED_PREFILL = ["cold 8192 8", "hit 65536 1", "cold 256 1", "cold 1024 1", "cold 256 16"]


def add_peers_args(p) -> None:
    """``bench peers``'s flags (here, not in args.py, which would pass 400 lines)."""
    p.add_argument("--models", nargs="+", default=["qwen3-0.6b"], help="built-in configs, run "
                   "on dummy weights")  # fmt: skip
    g = p.add_argument_group("the peer")
    g.add_argument("--peer", choices=["vllm", "command"], default="vllm",
                   help="vllm: the tree of ../shared/peers/vllm/README.md; command: "
                   "--peer-command")  # fmt: skip
    g.add_argument("--vllm-site", default="/tmp/vllm-site/site", help="vllm: the unpacked tree")
    g.add_argument("--vllm-cache", default="/tmp/vllm-cache", help="vllm: VLLM_CACHE_ROOT")
    g.add_argument("--vllm-extra-path", nargs="*", default=[], metavar="DIR",
                   help="vllm: folders before the tree on its PYTHONPATH (Gemma 4 needs "
                   "transformers 5.14.1 and tokenizers 0.22.2 there)")  # fmt: skip
    g.add_argument("--peer-name", default="peer", help="command: the peer's name in the tables")
    g.add_argument("--peer-command", help="command: its command line, with {python}, "
                   "{model_dir}, {host}, {port} and {context_length} filled in (default: none)")  # fmt: skip
    g.add_argument("--peer-env", nargs="*", default=[], metavar="KEY=VALUE",
                   help="command: its environment on top of this one's")  # fmt: skip
    g.add_argument("--peer-ready-path", default="/health", help="command: 200 once ready")
    g.add_argument("--peer-flush-path", help="command: POST drops its prefix cache (default: "
                   "none; random prompts rarely share a prefix anyway)")  # fmt: skip
    g = p.add_argument_group("each engine's flags (a single flag as --engine-flags='--x')")
    g.add_argument("--engine-flags", default="", help="more `breakgraph serve` flags")
    g.add_argument("--peer-flags", default="", help="more flags for the peer")
    g.add_argument("--settings", nargs="+", choices=["default", "latency"], default=["default"],
                   help="latency: the flags each engine's documentation recommends for it "
                   "(an engine that names none runs its defaults, measured once)")  # fmt: skip
    g.add_argument("--latency-flags", default="", help="breakgraph's latency setting (default: "
                   "none, its defaults mix decodes into prefill steps: docs/deploy.md)")  # fmt: skip
    g.add_argument("--peer-latency-flags", default=None, help="the peer's latency setting "
                   "(default: vllm's --max-num-batched-tokens 16384; none)")  # fmt: skip
    g.add_argument("--context-length", type=int, default=70000, help="both engines' longest "
                   "request (the hit workload needs 65536 + 1024 + 1)")  # fmt: skip
    g.add_argument("--cold-start", action="store_true", help="first also a start with empty "
                   "compile caches (Triton's; vLLM's torch.compile and Inductor caches)")  # fmt: skip
    g.add_argument("--startup-timeout", type=float, default=1200.0, help="seconds to ready")
    g = p.add_argument_group("workloads (an empty list skips one)")
    g.add_argument("--first-tokens", type=int, default=8192, help="first requests' prompt")
    g.add_argument("--first-waves", type=int, default=8, help="the first requests after ready, "
                   "one at a time (0: none); steady is the median from the fourth on")  # fmt: skip
    g.add_argument("--prefill", nargs="*", default=SEED_PREFILL, metavar="'MODE TOKENS C'",
                   help="bench prefill workloads")  # fmt: skip
    g.add_argument("--hit-new-tokens", type=int, default=1024, help="hit: new tokens")
    g.add_argument("--profile", metavar="'MODE TOKENS C'", default=None, help="after the "
                   "workloads, one more wave of this one under each engine's torch profiler: "
                   "GPU time by kernel, side by side (bench/peer_profile.py)")  # fmt: skip
    g.add_argument("--warmup-waves", type=int, default=2, help="prefill: unmeasured waves")
    g.add_argument("--waves", type=int, default=5, help="prefill: measured waves")
    g.add_argument("--concurrency", type=int, nargs="*", default=[1, 2, 4, 8],
                   help="bench serving's levels")  # fmt: skip
    g.add_argument("--input-len", type=int, default=8192, help="serving: prompt tokens")
    g.add_argument("--output-len", type=int, default=1024, help="serving: new tokens")
    g.add_argument("--requests-per-level", type=int, default=None, help="serving: default 4 x "
                   "the concurrency")  # fmt: skip
    g.add_argument("--rounds", type=int, default=2, help="serving: rounds (even ones reversed)")
    g.add_argument("--seed", type=int, default=0, help="the prompts' random token ids")
    p.add_argument("--log-dir", help="the engines' logs and model folders (default: a new "
                   "temporary folder)")  # fmt: skip
    p.add_argument("--json", default=None, metavar="FILE", help="write the results as JSON")
    p.add_argument("--plot", default=None, metavar="FILE.png", help="the ratios, a panel per "
                   "model and setting")  # fmt: skip


def parse_workload(text: str) -> tuple[str, int, int]:
    """``"cold 8192 8"`` -> (mode, tokens, concurrency)."""
    parts = text.split()
    if len(parts) != 3 or parts[0] not in ("cold", "hit") or not "".join(parts[1:]).isdigit():
        raise SystemExit(f"error: --prefill takes 'cold|hit TOKENS C' items, got {text!r}")
    return parts[0], int(parts[1]), int(parts[2])


def specs(args):
    """(breakgraph's spec, the peer's) from the flags."""
    from breakgraph.bench import peer_engines as pe

    split = shlex.split
    bg = pe.breakgraph_spec(split(args.engine_flags), split(args.latency_flags))
    peer_latency = None if args.peer_latency_flags is None else split(args.peer_latency_flags)
    if args.peer_name == bg.name:
        raise SystemExit("error: --peer-name must differ from breakgraph")
    if args.peer == "vllm":
        peer = pe.vllm_spec(
            args.vllm_site, args.vllm_cache, split(args.peer_flags), peer_latency,
            tuple(args.vllm_extra_path),
        )  # fmt: skip
    else:
        if not args.peer_command:
            raise SystemExit("error: --peer command needs --peer-command")
        peer = pe.command_spec(
            args.peer_name, args.peer_command, args.peer_env, args.peer_ready_path,
            args.peer_flush_path, split(args.peer_flags), peer_latency or [],
        )  # fmt: skip
    return bg, peer


async def _workloads(run, url: str, client_factory, args, spec, trace_dir: Path) -> None:
    from breakgraph.bench.http_client import median
    from breakgraph.bench.prefill import run_prefill
    from breakgraph.bench.serving import HEADER, run_serving

    if args.first_waves:
        res = await run_prefill(url, "cold", args.first_tokens, 1, warmup_waves=0,
                                waves=args.first_waves, seed=args.seed,
                                client_factory=client_factory)  # fmt: skip
        ttfts = [w.ttft_ms[0] for w in res.waves]
        steady = ttfts[3:] if len(ttfts) > 3 else ttfts[1:]
        run.first = {"tokens": args.first_tokens, "ttft_ms": ttfts[0], "ttfts_ms": ttfts,
                     "steady_ttft_ms": median(steady) if steady else None}  # fmt: skip
        print(f"  first request after ready: TTFT {ttfts[0]:.2f} ms", flush=True)
    for workload in args.prefill:
        mode, tokens, concurrency = parse_workload(workload)
        res = await run_prefill(url, mode, tokens, concurrency, args.hit_new_tokens,
                                args.warmup_waves, args.waves, args.seed,
                                client_factory=client_factory)  # fmt: skip
        run.prefill.append(res.to_dict())
        print("  " + res.summary().splitlines()[0], flush=True)
    if args.concurrency:

        def on_level(rnd, level) -> None:
            print(f"  round {rnd}\n{HEADER}" if level is None else level.row(), flush=True)

        levels = await run_serving(url, args.concurrency, args.input_len, args.output_len,
                                   args.requests_per_level, args.rounds, args.seed,
                                   on_level=on_level, client_factory=client_factory)  # fmt: skip
        run.serving = [asdict(level) for level in levels]
    if args.profile:
        from breakgraph.bench.peer_profile import profile_wave

        run.profile = await profile_wave(spec, url, str(trace_dir), parse_workload(args.profile),
                                         args.hit_new_tokens, args.seed, client_factory)  # fmt: skip
        print(f"  profiled one wave of {args.profile}: {run.profile['gpu_ms']:.1f} GPU ms in "
              f"{len(run.profile['files'])} trace(s)", flush=True)  # fmt: skip


def measure(run, spec, model_dir, config: dict, raised: bool, args, logs) -> None:
    """Start ``spec``'s engine on ``run``'s model under its setting (cold first with
    ``--cold-start``), run the workloads into ``run``, stop it. Failures are recorded in the
    run, not raised."""
    from breakgraph.bench import peer_engines as pe
    from breakgraph.bench.host_api import free_port
    from breakgraph.bench.http_client import BenchError
    from breakgraph.bench.openai_client import OpenAIClient

    model, setting = run.model, run.setting
    env = spec.added_env(raised)
    stem = f"{model}-{setting}-{spec.name}"
    problem = spec.preflight(config)
    if problem:
        run.error = problem
        print(f"{spec.name}: {problem}", flush=True)
        return

    trace_dir = logs / f"{stem}-profile"

    def start(log_name: str):
        port = free_port()
        argv = spec.argv(model_dir, port, args.context_length, setting, config)
        if args.profile:
            from breakgraph.bench.peer_profile import profiler_argv

            argv += profiler_argv(spec, str(trace_dir))
        run.command, run.env, run.log = argv, env, str(logs / log_name)
        print(f"{spec.name} ({model}, {setting}): starting: {shlex.join(argv)}", flush=True)
        return pe.start_engine(spec, argv, env, port, logs / log_name, args.startup_timeout)

    try:
        if args.cold_start:
            env.update(pe.cold_cache_env(spec, logs))
            engine = start(f"{stem}-cold.log")
            run.startup_cold_s = engine.startup_s
            engine.stop()
            print(f"  ready after {run.startup_cold_s:.1f} s (cold caches)", flush=True)
        engine = start(f"{stem}.log")
        run.startup_s = engine.startup_s
        print(f"  ready after {run.startup_s:.1f} s", flush=True)
        try:
            run.version = pe.version(engine.url)
            run.served_model = pe.get_json(engine.url + "/v1/models")["data"][0]["id"]
            text = config.get("text_config", config)
            factory = functools.partial(OpenAIClient, model=run.served_model,
                                        vocab=text["vocab_size"], flush_path=spec.flush_path)  # fmt: skip
            asyncio.run(_workloads(run, engine.url, factory, args, spec, trace_dir))
        except BenchError as e:
            run.error = f"{e}\n{engine.log_tail()}"
        except Exception as e:  # an engine that dies mid-run: keep what it measured, go on
            run.error = f"{type(e).__name__}: {e}\n{engine.log_tail()}"
        finally:
            engine.stop()
    except RuntimeError as e:  # did not start
        run.error = str(e)
    if run.error:
        print(f"{spec.name} ({model}, {setting}) failed: {run.error}", flush=True)


def breakgraph_commit() -> str | None:
    """This tree's commit (``+`` when it has uncommitted changes), where it is a git checkout."""
    root = Path(__file__).resolve().parents[2]
    try:
        rev = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, timeout=10, check=True).stdout.strip()  # fmt: skip
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "-uno"],
                               capture_output=True, text=True, timeout=10).stdout.strip()  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return rev + ("+" if dirty else "")


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)  # unwinds: each running engine is stopped on the way out


def run_peers_bench(args) -> dict:
    from breakgraph.bench import peer_engines as pe
    from breakgraph.bench import peers_report as report
    from breakgraph.bench.plot import require_plot

    require_plot(args.plot)
    for workload in args.prefill + ([args.profile] if args.profile else []):
        parse_workload(workload)  # a typo fails now, not after an engine's start-up
    bg, peer = specs(args)
    logs = Path(args.log_dir or tempfile.mkdtemp(prefix="bench-peers-"))
    logs.mkdir(parents=True, exist_ok=True)
    print(f"bench peers: breakgraph against {peer.name}; engine logs under {logs}", flush=True)
    commit = breakgraph_commit()
    runs: dict[tuple[str, str, str], pe.EngineRun] = {}
    tables = []
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        for model in args.models:
            model_dir, config, raised = pe.write_model_dir(model, logs / "models",
                                                           args.context_length)  # fmt: skip
            for setting in args.settings:
                pair = []
                for spec in (bg, peer):
                    own = setting if spec.has_setting(setting) else "default"
                    key = (model, spec.name, own)
                    if key not in runs:
                        runs[key] = pe.EngineRun(engine=spec.name, model=model, setting=own)
                        measure(runs[key], spec, model_dir, config, raised, args, logs)
                        # what is measured so far, in case a time limit ends the run
                        report.save(report.result(args, peer.name, commit, list(runs.values()),
                                                  tables), args.json, None)  # fmt: skip
                    pair.append(runs[key])
                tables.append(report.Table(model, setting, *pair))
    except BaseException:  # interrupted (SIGTERM, Ctrl-C): keep the engine in progress's part
        partial = report.result(args, peer.name, commit, list(runs.values()), tables)
        report.save({**partial, "interrupted": True}, args.json, None)
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)
    result = report.result(args, peer.name, commit, list(runs.values()), tables)
    print(report.format_report(result, tables), flush=True)
    report.save(result, args.json, args.plot)
    return result
