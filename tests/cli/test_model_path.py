"""``--model-path`` as a Hugging Face Hub id: resolved through huggingface_hub from a cache laid
out as huggingface_hub lays it out (``HF_HUB_CACHE``, ``HF_HOME``, offline mode honoured), and
a one-line answer naming the download command where it is not there."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from breakgraph.models.model_path import download_command
from tests.support.hf import make_hf_model

REPO = "tiny-org/tiny-llama"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def lay_out_hub_cache(cache: Path, repo_id: str, files: dict[str, bytes]) -> Path:
    """huggingface_hub's cache layout: ``models--org--name/`` holding each file once under
    ``blobs/<hash>``, the revision's tree as ``snapshots/<commit>/`` of relative links to the
    blobs, and ``refs/main`` naming the commit. Returns the snapshot directory."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / COMMIT
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    for name, data in files.items():
        blob = hashlib.sha256(data).hexdigest()
        (repo / "blobs" / blob).write_bytes(data)
        (snapshot / name).symlink_to(Path("..", "..", "blobs", blob))
    return snapshot


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> dict[str, bytes]:
    """A tiny Llama checkpoint's files (config.json, model.safetensors, ...)."""
    path = tmp_path_factory.mktemp("tiny-llama-hub")
    make_hf_model("llama").save_pretrained(path)
    return {p.name: p.read_bytes() for p in path.iterdir() if p.is_file()}


@pytest.fixture
def hub_cache(tmp_path, checkpoint) -> tuple[Path, Path]:
    """(cache directory, the snapshot of REPO in it)."""
    cache = tmp_path / "hub"
    return cache, lay_out_hub_cache(cache, REPO, checkpoint)


def run(*args: str, env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    return subprocess.run(
        [sys.executable, "-m", "breakgraph.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**clean, **env},
    )


def resolve(repo_id: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    """The resolver alone, in a fresh process (huggingface_hub reads its variables once)."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    code = (
        "import sys; from breakgraph.models.model_path import resolve_model_path as r; "
        "print(r(sys.argv[1]).path)"
    )
    return subprocess.run(
        [sys.executable, "-c", code, repo_id],
        capture_output=True,
        text=True,
        timeout=60,
        env={**clean, **env},
    )


def closed_port_url() -> str:
    """An endpoint that refuses connections: the Hub, unreachable."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def test_the_layout_is_the_one_huggingface_hub_reads(hub_cache):
    from huggingface_hub import scan_cache_dir

    cache, snapshot = hub_cache
    (repo,) = scan_cache_dir(cache).repos
    assert repo.repo_id == REPO and set(repo.refs) == {"main"}
    (revision,) = repo.revisions
    assert revision.commit_hash == COMMIT and revision.snapshot_path == snapshot


def test_a_hub_id_generates_as_its_snapshot_directory_does(hub_cache):
    """Offline: the hub id is read from the cache, and answers as the same files given by
    their directory."""
    cache, snapshot = hub_cache
    common = ["generate", "--input-ids", "1 2 3", "--max-new-tokens", "4", "--ignore-eos"]
    env = {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    by_id = run(*common, "--model-path", REPO, env=env)
    by_dir = run(*common, "--model-path", str(snapshot), env=env)
    assert by_id.returncode == 0, by_id.stderr
    assert by_dir.returncode == 0, by_dir.stderr
    assert len(by_id.stdout.split()) == 4
    assert by_id.stdout == by_dir.stdout


def test_hf_home_locates_the_cache(tmp_path, checkpoint):
    snapshot = lay_out_hub_cache(tmp_path / "home" / "hub", REPO, checkpoint)
    r = resolve(REPO, {"HF_HOME": str(tmp_path / "home"), "HF_HUB_OFFLINE": "1"})
    assert r.returncode == 0, r.stderr
    assert Path(r.stdout.strip()) == snapshot


def test_online_with_the_hub_unreachable_the_cache_serves(hub_cache):
    cache, snapshot = hub_cache
    r = resolve(REPO, {"HF_HUB_CACHE": str(cache), "HF_ENDPOINT": closed_port_url()})
    assert r.returncode == 0, r.stderr
    assert Path(r.stdout.strip()) == snapshot


@pytest.mark.parametrize("offline", [True, False])
def test_a_hub_id_not_in_the_cache_names_the_download_command(tmp_path, offline):
    env = {"HF_HUB_CACHE": str(tmp_path)}
    env.update({"HF_HUB_OFFLINE": "1"} if offline else {"HF_ENDPOINT": closed_port_url()})
    for command in ("generate", "serve"):
        args = [command, "--model-path", "tiny-org/missing"] + (
            ["hi"] if command == "generate" else []
        )
        r = run(*args, env=env, timeout=60)
        assert r.returncode == 2, r.stderr
        (line,) = r.stderr.strip().splitlines()
        assert f"download it with: {download_command('tiny-org/missing')}" in line
        assert str(tmp_path) in line  # where it was looked for
        assert ("HF_HUB_OFFLINE" in line) == offline
        assert ("cannot be reached" in line) == (not offline)


def test_a_cached_snapshot_without_weights_says_so(tmp_path, checkpoint):
    cache = tmp_path / "hub"
    lay_out_hub_cache(cache, REPO, {"config.json": checkpoint["config.json"]})
    env = {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    common = ["generate", "--model-path", REPO, "--input-ids", "1 2", "--max-new-tokens", "2"]
    common.append("--ignore-eos")
    r = run(*common, env=env)
    assert r.returncode == 2
    (line,) = r.stderr.strip().splitlines()
    assert "no *.safetensors" in line and download_command(REPO) in line
    r = run(*common, "--load-format", "dummy", env=env)  # a config is all dummy weights need
    assert r.returncode == 0, r.stderr
    assert len(r.stdout.split()) == 2


def test_a_typo_of_a_builtin_name_is_answered_without_the_hub(tmp_path):
    r = run("serve", "--model-path", "qwen3-0.6B", env={"HF_HUB_CACHE": str(tmp_path)})
    assert r.returncode == 2
    (line,) = r.stderr.strip().splitlines()
    assert "did you mean the built-in config qwen3-0.6b?" in line


def test_the_architectures_checked_without_torch_are_the_registrys():
    from breakgraph.models.model_path import SUPPORTED_ARCHITECTURES
    from breakgraph.models.registry import MODEL_REGISTRY

    assert sorted(SUPPORTED_ARCHITECTURES) == sorted(MODEL_REGISTRY), (
        "models/model_path.py's SUPPORTED_ARCHITECTURES must list MODEL_REGISTRY's keys"
    )


def test_an_unsupported_architecture_is_refused_before_any_weight_is_read(tmp_path):
    """A Mamba checkpoint: one line naming what is served, before a process is spawned or
    its (here unreadable) weights are opened."""
    config = {"architectures": ["MambaForCausalLM"], "hidden_size": 768, "vocab_size": 50280}
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").write_bytes(b"not a safetensors file")
    for command in (["serve"], ["generate", "hi"]):
        r = run(*command, "--model-path", str(tmp_path), env={})
        assert r.returncode == 2, r.stderr
        (line,) = r.stderr.strip().splitlines()
        assert "architecture MambaForCausalLM is not supported; supported: " in line
        assert "Qwen3ForCausalLM" in line and "LlamaForCausalLM" in line


def test_serve_names_the_model_by_its_hub_id(hub_cache, tmp_path, monkeypatch):
    import httpx

    from tests.support.server import ServerProcess

    cache, _ = hub_cache
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    srv = ServerProcess(["--model-path", REPO], tmp_path / "serve.log")
    try:
        srv.wait_ready()
        models = httpx.get(f"{srv.url}/v1/models", timeout=10).json()
        body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}}
        answer = httpx.post(f"{srv.url}/generate", json=body, timeout=60)
    finally:
        assert srv.stop() == 0, srv.log()
    assert [m["id"] for m in models["data"]] == [REPO]
    assert answer.status_code == 200 and len(answer.json()["output_ids"]) >= 1
