"""The engines ``bench peers`` starts, each described the same way: a name, a command line, the
environment it adds, the URL that answers once it is ready, its prefix-cache flush route, its
named settings (more flags), and the variables that point at its compile caches. Presets:
``breakgraph`` (``breakgraph serve``), ``vllm`` (vLLM 0.25.1 from the ``pip --target`` tree
that ``../shared/peers/vllm/README.md`` brings to the GPU machine) and ``command`` (any
OpenAI-compatible server, say a second breakgraph standing in for the peer on the CPU); and
``EngineRun``, what one engine measured.

Both engines get the same ``MODEL_DIR``: a folder holding breakgraph's built-in config.json of
the model, its ``max_position_embeddings`` raised to the context length where that is larger
(vLLM sizes its rotary cache by it: a request past it is a device-side assert), and random
weights (``--load-format dummy``). An engine runs in its own session (process group), so
stopping it stops every process it started before the next engine takes the GPU.
"""

from __future__ import annotations

import ctypes
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from breakgraph.models.sources import BUILTIN_MODELS, CONFIG_DIR

# vLLM's optimization guide (docs/configuration/optimization.md, "Performance Tuning with
# Chunked Prefill"): a larger max_num_batched_tokens gives a better TTFT; its API server's
# default on an H100/H200 is 8192, its offline LLM class's 16384
VLLM_LATENCY_FLAGS = ["--max-num-batched-tokens", "16384"]
VLLM_ENV = {  # ../shared/peers/vllm/README.md, "Starting it"
    "VLLM_USE_FLASHINFER_SAMPLER": "0",  # the tree has no FlashInfer
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "VLLM_SERVER_DEV_MODE": "1",  # for /reset_prefix_cache, the cold workloads' flush
}
VLLM_MOE_LIBRARY = "vllm/_moe_C_stable_libtorch.abi3.so"


@dataclass
class EngineSpec:
    """How to start one engine and talk to it. ``command`` is an argv template whose items
    may hold ``{python}``, ``{model_dir}``, ``{host}``, ``{port}`` and ``{context_length}``."""

    name: str
    command: list[str]
    env: dict[str, str] = field(default_factory=dict)
    ready_path: str = "/health"
    flush_path: str | None = None
    settings: dict[str, list[str]] = field(default_factory=dict)  # name -> more flags
    cold_cache_env: tuple[str, ...] = ()  # a cold start points these at empty folders
    extra_flags: list[str] = field(default_factory=list)
    vllm_site: str | None = None  # the vllm preset's tree (PYTHONPATH)
    path_first: tuple[str, ...] = ()  # put before it on PYTHONPATH (--vllm-extra-path)
    _imports: dict[str, bool] = field(default_factory=dict, init=False, repr=False)

    def has_setting(self, setting: str) -> bool:
        return setting == "default" or bool(self.settings.get(setting))

    def argv(self, model_dir: Path, port: int, context_length: int, setting: str, config: dict):
        values = {"python": sys.executable, "model_dir": str(model_dir), "host": "127.0.0.1",
                  "port": port, "context_length": context_length}  # fmt: skip
        argv = [part.format(**values) for part in self.command]
        return argv + model_flags(self, config) + self.settings.get(setting, []) + self.extra_flags

    def added_env(self, long_context: bool) -> dict[str, str]:
        """What this engine's process gets on top of this process's environment."""
        env = dict(self.env)
        if self.vllm_site is not None:
            env["PYTHONPATH"] = os.pathsep.join(
                p for p in (*self.path_first, self.vllm_site, os.environ.get("PYTHONPATH")) if p
            )
            if long_context:
                env["VLLM_ALLOW_LONG_MAX_MODEL_LEN"] = "1"
        return env

    def probe(self, code: str) -> subprocess.CompletedProcess:
        """``code`` run by a child with this engine's PYTHONPATH (what its imports find)."""
        env = {**os.environ, "PYTHONPATH": self.added_env(False)["PYTHONPATH"]}
        return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                              text=True, timeout=120)  # fmt: skip

    def imports(self, module: str) -> bool:
        """Whether ``module`` imports on this engine's path (asked once per module)."""
        if module not in self._imports:
            self._imports[module] = self.probe(f"import {module}").returncode == 0
        return self._imports[module]

    def preflight(self, config: dict) -> str | None:
        """Why this engine cannot run the model here, before minutes of start-up (or None)."""
        if self.vllm_site is None:
            return None
        site = Path(self.vllm_site)
        if not (site / "vllm").is_dir():
            return f"no vLLM tree at {site} (../shared/peers/vllm/README.md; --vllm-site)"
        if is_moe(config) and not (site / VLLM_MOE_LIBRARY).is_file():
            return (
                f"{site / VLLM_MOE_LIBRARY} is missing (an MoE model needs it): cat "
                f"moe_C.so.xz.part* | xz -dc > {site / VLLM_MOE_LIBRARY}"
            )
        if is_gemma4(config):
            problem = self._gemma4_transformers()
            if problem is None and not self.imports("cutlass"):
                print(f"{self.name}: no CUTLASS DSL on its path (FA4's Gemma 4 kernels import "
                      "it): its Triton attention instead", flush=True)  # fmt: skip
            return problem
        return None

    def _gemma4_transformers(self) -> str | None:
        """vLLM 0.25.1 reads Gemma 4's ``head_dim`` and ``global_head_dim`` off the text
        config; transformers 5.15 and later make that config heterogeneous (a per-layer
        ``head_dim``, ``global_head_dim`` folded into it) and refuse the global read
        (``AmbiguousGlobalPerLayerAttributeError``; vLLM reads them per layer from 0.28).
        Which transformers vLLM's path imports, asked of a child with its PYTHONPATH."""
        out = self.probe("import transformers; print(transformers.__version__)")
        if out.returncode:
            last = (out.stderr.strip().splitlines() or ["?"])[-1]
            return f"transformers does not import on vLLM's path: {last}"
        found = out.stdout.strip()
        major, minor = (int(x) for x in found.split(".")[:2])
        if (major, minor) < (5, 15):
            return None
        return (
            f"vLLM 0.25.1 cannot read Gemma 4's config under transformers {found} (5.15 and "
            "later refuse a global head_dim: AmbiguousGlobalPerLayerAttributeError): put "
            "transformers 5.14.1 and tokenizers 0.22.2 first on its path (pip install --no-deps "
            "--target DIR; --vllm-extra-path DIR)"
        )


@dataclass
class EngineRun:
    """One engine's measurements on one model under one setting."""

    engine: str
    model: str
    setting: str  # the setting it ran under (an engine without one runs its defaults)
    command: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)  # added to the bench's environment
    version: str | None = None
    served_model: str | None = None
    startup_s: float | None = None
    startup_cold_s: float | None = None  # --cold-start: on empty compile caches
    first: dict | None = None  # the first request after ready: ttft_ms, steady_ttft_ms, ...
    prefill: list[dict] = field(default_factory=list)  # PrefillResult.to_dict() each
    serving: list[dict] = field(default_factory=list)  # a LevelResult each, every round
    profile: dict | None = None  # --profile: peer_profile.summarize's of its profiled wave
    error: str | None = None
    log: str = ""


def is_gemma4(config: dict) -> bool:
    return str(config.get("model_type", "")).startswith("gemma4")


def is_moe(config: dict) -> bool:
    text = config.get("text_config", config)
    return bool(text.get("num_experts") or text.get("n_routed_experts"))


def model_flags(spec: EngineSpec, config: dict) -> list[str]:
    """The peer's own flags for a model's traits: vLLM's trim of Gemma 4's KV-shared layers
    in prefill (``--kv-sharing-fast-prefill``), against breakgraph's bounded tail (its
    default). vLLM 0.25.1 attends Gemma 4 (head sizes 256 and 512) with FA4 on every layer,
    whose CuTe kernels import the CUTLASS DSL (``cutlass``, nvidia-cutlass-dsl 4.5.2, with
    quack-kernels and cuda-python: about 155 MB of wheels), which the pruned tree leaves out;
    where it does not import on vLLM's path, vLLM's Triton attention serves the model instead
    (``--attention-backend TRITON_ATTN``, said by the preflight)."""
    if spec.vllm_site is None:
        return []
    text = config.get("text_config", config)
    flags = ["--kv-sharing-fast-prefill"] if text.get("num_kv_shared_layers") else []
    if is_gemma4(config) and not spec.imports("cutlass"):
        flags += ["--attention-backend", "TRITON_ATTN"]
    return flags


def breakgraph_spec(extra_flags: list[str], latency_flags: list[str]) -> EngineSpec:
    """``breakgraph serve`` from this interpreter; ``latency_flags``: its latency setting
    (``bench peers``' default: none, its defaults are docs/deploy.md's advice for latency)."""
    command = ["{python}", "-m", "breakgraph.cli", "serve", "--model-path", "{model_dir}",
               "--load-format", "dummy", "--host", "{host}", "--port", "{port}",
               "--context-length", "{context_length}"]  # fmt: skip
    return EngineSpec(
        name="breakgraph",
        command=command,
        flush_path="/flush_cache",
        settings={"latency": latency_flags},
        cold_cache_env=("TRITON_CACHE_DIR",),
        extra_flags=extra_flags,
    )


def vllm_spec(
    site: str,
    cache_root: str,
    extra_flags: list[str],
    latency_flags: list[str] | None,
    path_first: tuple[str, ...] = (),
) -> EngineSpec:
    """vLLM from the tree at ``site``, started as its README says (python3 -m ... serve, dummy
    weights, no tokenizer, its own generation config, prompt token details reported);
    ``path_first``: folders before the tree on its PYTHONPATH (another transformers)."""
    command = ["{python}", "-m", "vllm.entrypoints.cli.main", "serve", "{model_dir}",
               "--load-format", "dummy", "--skip-tokenizer-init", "--generation-config", "vllm",
               "--host", "{host}", "--port", "{port}", "--max-model-len", "{context_length}",
               "--enable-prompt-tokens-details"]  # fmt: skip
    return EngineSpec(
        name="vllm",
        command=command,
        # its own Triton cache: not breakgraph's (device_env.sh carries that one between runs)
        env={
            **VLLM_ENV,
            "VLLM_CACHE_ROOT": cache_root,
            "TRITON_CACHE_DIR": os.path.join(cache_root, "triton"),
        },
        flush_path="/reset_prefix_cache",
        settings={"latency": VLLM_LATENCY_FLAGS if latency_flags is None else latency_flags},
        cold_cache_env=("VLLM_CACHE_ROOT", "TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR"),
        extra_flags=extra_flags,
        vllm_site=site,
        path_first=tuple(path_first),
    )


def command_spec(
    name: str,
    command: str,
    env: list[str],
    ready_path: str,
    flush_path: str | None,
    extra_flags: list[str],
    latency_flags: list[str],
) -> EngineSpec:
    """Any OpenAI-compatible server: ``command`` a shell-quoted template, ``env`` K=V items."""
    pairs = [item.partition("=") for item in env]
    if any(not sep or not key for key, sep, _ in pairs):
        raise SystemExit(f"error: --peer-env takes KEY=VALUE items, got {env}")
    return EngineSpec(
        name=name,
        command=shlex.split(command),
        env={key: value for key, _, value in pairs},
        ready_path=ready_path,
        flush_path=flush_path,
        settings={"latency": latency_flags},
        extra_flags=extra_flags,
    )


def write_model_dir(model: str, root: Path, context_length: int) -> tuple[Path, dict, bool]:
    """``root/model/config.json``: the built-in config, ``max_position_embeddings`` raised to
    ``context_length`` where smaller. Returns the folder, the config, and whether it was."""
    if model not in BUILTIN_MODELS:
        raise SystemExit(f"error: {model!r} is not a built-in config ({', '.join(BUILTIN_MODELS)})")
    config = json.loads((CONFIG_DIR / f"{model}.json").read_text())
    raised = False
    for part in (config, config.get("text_config")):
        if part and part.get("max_position_embeddings", context_length) < context_length:
            part["max_position_embeddings"] = context_length
            raised = True
    path = root / model
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=1))
    return path, config, raised


def get_json(url: str, timeout_s: float = 10.0) -> dict:
    with urllib.request.urlopen(url, timeout=timeout_s) as r:
        return json.loads(r.read())


def version(url: str) -> str | None:
    """``GET /version``'s version (breakgraph's and vLLM's route), None where there is none."""
    try:
        return get_json(url + "/version").get("version")
    except (OSError, ValueError, AttributeError):
        return None


@dataclass
class Running:
    """One started engine: its process (the leader of its own process group) and address."""

    spec: EngineSpec
    proc: subprocess.Popen
    url: str
    argv: list[str]
    env: dict[str, str]  # what it got on top of this process's environment
    log_path: Path
    startup_s: float = 0.0

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self, timeout_s: float = 60.0) -> None:
        """SIGTERM to the engine's process group, SIGKILL if it outlives ``timeout_s``, then
        SIGKILL to whatever of the group is left (a worker its leader did not wait for), and
        wait until the group is gone: the next engine checks the GPU's free memory at start."""
        pgid = self.proc.pid
        if self.proc.poll() is None:
            _signal_group(pgid, signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                _signal_group(pgid, signal.SIGKILL)
                self.proc.wait()
        deadline = time.monotonic() + 30
        while _signal_group(pgid, signal.SIGKILL) and time.monotonic() < deadline:
            time.sleep(0.1)


def _signal_group(pgid: int, sig: int) -> bool:
    """Signal a process group; False when none of it is left."""
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def _die_with_this_process() -> None:
    """In the engine's leader before exec: SIGKILL when the bench dies (a device run's time
    limit kills it), so no engine outlives it holding the GPU; its own children follow it
    (vLLM's engine core and breakgraph's engine process exit when their API process does)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG (Linux)
    except (OSError, AttributeError):
        pass


def start_engine(
    spec: EngineSpec,
    argv: list[str],
    env: dict[str, str],
    port: int,
    log_path: Path,
    timeout_s: float,
) -> Running:
    """Start ``argv`` and wait until ``spec.ready_path`` answers 200: ``startup_s`` is from
    the launch to that answer. Raises RuntimeError (with its log's tail) if it exits first
    or is not ready in ``timeout_s``; stops it on any error or interruption."""
    log = open(log_path, "w")  # noqa: SIM115 (the child holds it; closed here after the fork)
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        argv, env={**os.environ, **env}, stdout=log, stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=_die_with_this_process,
    )  # fmt: skip
    log.close()
    run = Running(spec, proc, f"http://127.0.0.1:{port}", argv, env, log_path)
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{spec.name} exited ({proc.returncode}):\n{run.log_tail()}")
            try:
                with urllib.request.urlopen(run.url + spec.ready_path, timeout=2) as r:
                    if r.status == 200:
                        run.startup_s = time.perf_counter() - t0
                        return run
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{spec.name} not ready in {timeout_s:.0f} s:\n{run.log_tail()}")
            time.sleep(0.1)
    except BaseException:
        run.stop()
        raise


def cold_cache_env(spec: EngineSpec, root: Path) -> dict[str, str]:
    """Empty folders for the engine's compile caches (a cold start; the warm one reuses them)."""
    base = Path(tempfile.mkdtemp(prefix=f"{spec.name}-caches-", dir=root))
    return {var: str(base / var.lower()) for var in spec.cold_cache_env}
