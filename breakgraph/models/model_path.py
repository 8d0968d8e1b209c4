"""What ``--model-path`` names, checked without torch before anything loads: a checkpoint
directory, a ``.gguf`` file, a built-in config, or a Hugging Face Hub id, which
``huggingface_hub`` resolves to a snapshot in its cache (``HF_HOME``, ``HF_HUB_CACHE``,
``HF_HUB_OFFLINE`` honoured) and downloads when online.

A checkpoint's architecture is checked here too, from its config.json alone, so that an
unsupported one is refused in one line before a process is spawned or a weight is read.
"""

from __future__ import annotations

import difflib
import json
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path

from breakgraph.models.sources import BUILTIN_MODELS, EmbeddedModelMissing, find_embedded_gguf

logger = logging.getLogger(__name__)

# MODEL_REGISTRY's keys (models/registry.py imports torch; this list does not): the
# architectures a config.json may name. tests/cli/test_model_path.py keeps the two equal.
SUPPORTED_ARCHITECTURES = (
    "DeepseekV4ForCausalLM",
    "Gemma4ForCausalLM",
    "Gemma4ForConditionalGeneration",
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
)

# what the engine reads from a hub repo: configs, the tokenizer and chat template, weights;
# files in subfolders (e.g. original/*.pth, a second copy of the weights) are never needed
_META_PATTERNS = ["*.json", "*.jinja"]
_SUBFOLDERS = ["*/*"]
_INDEX = "model.safetensors.index.json"


class ModelPathError(ValueError):
    """``--model-path`` names nothing the engine can load; the message is one line."""


@dataclass
class ModelPath:
    """A resolved ``--model-path``: ``path`` is what the loaders take (a local directory or
    file, a built-in name, or None for the embedded model); ``hub_id`` the repo it came from."""

    path: str | None
    hub_id: str | None = None

    @property
    def name(self) -> str | None:
        """The name a user gave: the hub id, else the path."""
        return self.hub_id or self.path


def resolve_model_path(model_path: str | None, load_format: str = "auto") -> ModelPath:
    """``model_path`` as the loaders take it, checked; a hub id becomes its cached snapshot
    (downloaded first when online: with ``load_format`` dummy, its configs only). Raises
    ModelPathError with a one-line message, naming the download command where one helps."""
    if model_path is None:
        try:
            find_embedded_gguf()
        except EmbeddedModelMissing as e:
            raise ModelPathError(str(e)) from None
        return ModelPath(None)
    if model_path in BUILTIN_MODELS:
        return ModelPath(model_path)
    path = Path(model_path).expanduser()
    if path.exists():
        check_local_path(str(path), load_format)
        return ModelPath(str(path))
    close = _close_builtin(model_path)
    if close or not _is_hub_id(model_path):
        raise ModelPathError(
            f"--model-path {model_path}: no such file or directory"
            + (f"; did you mean the built-in config {close}?" if close else _what_else())
        )
    snapshot = _snapshot(model_path, load_format)
    check_local_path(snapshot, load_format, hub_id=model_path)
    logger.info("%s: the snapshot in %s", model_path, snapshot)
    return ModelPath(snapshot, hub_id=model_path)


def check_local_path(model_path: str, load_format: str = "auto", hub_id: str | None = None) -> None:
    """A local ``--model-path``: a .gguf file, or a directory whose config.json names a
    supported architecture (and, unless ``load_format`` is dummy, holds *.safetensors)."""
    path = Path(model_path)
    what = f"--model-path {hub_id or model_path}"
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelPathError(f"{what}: a file must be a .gguf model")
        return
    config = path / "config.json"
    if not config.is_file():
        raise ModelPathError(f"{what}: the directory has no config.json{_fetch(hub_id)}")
    check_architecture(config)
    if load_format != "dummy" and not any(path.glob("*.safetensors")):
        raise ModelPathError(
            f"{what}: no *.safetensors in {path}{_fetch(hub_id)} (or run it with "
            "--load-format dummy for random weights)"
        )


def check_architecture(config_json: str | Path) -> str:
    """The architecture a config.json names, refused in one line where it is not served."""
    try:
        cfg = json.loads(Path(config_json).read_text())
    except (OSError, ValueError) as e:
        raise ModelPathError(f"cannot read {config_json}: {e}") from None
    archs = cfg.get("architectures") or ["LlamaForCausalLM"]  # ModelConfig's default too
    arch = archs[0]
    if arch not in SUPPORTED_ARCHITECTURES:
        known = ", ".join(SUPPORTED_ARCHITECTURES)
        raise ModelPathError(f"architecture {arch} is not supported; supported: {known}")
    return arch


def download_command(repo_id: str) -> str:
    """The shell command that fetches ``repo_id`` into the cache the engine reads: the ``hf``
    CLI of huggingface_hub >= 0.34, else the older ``huggingface-cli``."""
    old = shutil.which("hf") is None and shutil.which("huggingface-cli") is not None
    return f"{'huggingface-cli' if old else 'hf'} download {repo_id}"


def _is_hub_id(name: str) -> bool:
    if name.endswith(".gguf") or name.startswith(("/", ".", "~")):
        return False
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def _close_builtin(name: str) -> str | None:
    """The built-in config a bare name (no org/) comes close to, if any: a typo of one."""
    if "/" in name:
        return None
    close = difflib.get_close_matches(name.lower(), BUILTIN_MODELS, n=1, cutoff=0.75)
    return close[0] if close else None


def _what_else() -> str:
    return f", not a built-in config ({', '.join(BUILTIN_MODELS)}) and not a hub id (org/name)"


def _fetch(hub_id: str | None) -> str:
    return f"; download it with: {download_command(hub_id)}" if hub_id else ""


def _snapshot(repo_id: str, load_format: str) -> str:
    """The local snapshot directory of ``repo_id``: its configs and tokenizer, then (unless
    ``load_format`` is dummy) its weights: those the index names, else every *.safetensors."""
    from huggingface_hub import constants, snapshot_download

    where = f"the Hugging Face cache ({constants.HF_HUB_CACHE})"
    offline = bool(constants.HF_HUB_OFFLINE)

    def fetch(patterns: list[str]) -> str:
        return snapshot_download(repo_id, allow_patterns=patterns, ignore_patterns=_SUBFOLDERS)

    try:
        path = fetch(_META_PATTERNS)
        if load_format != "dummy":
            index = Path(path) / _INDEX
            weights = ["*.safetensors"]
            if index.is_file():
                weights = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            path = fetch(weights)
    except Exception as e:  # huggingface_hub's errors differ by version: sorted by name
        raise ModelPathError(_download_failed(repo_id, e, where, offline)) from None
    return path


def _download_failed(repo_id: str, e: Exception, where: str, offline: bool) -> str:
    kind = type(e).__name__
    what = f"--model-path {repo_id}"
    if kind == "GatedRepoError":
        return (
            f"{what}: the repo is gated: accept its terms on https://huggingface.co/{repo_id} "
            "and log in (hf auth login) or set HF_TOKEN"
        )
    if kind in ("RepositoryNotFoundError", "RevisionNotFoundError"):
        return f"{what}: no such file or directory, and no such repo on the Hugging Face Hub"
    command = download_command(repo_id)
    if kind == "IncompleteSnapshotError":
        return f"{what}: its snapshot in {where} is incomplete; complete it with: {command}"
    if offline or kind == "OfflineModeIsEnabled":
        return f"{what}: not in {where} and HF_HUB_OFFLINE is set; download it with: {command}"
    if kind != "LocalEntryNotFoundError":  # not a miss in the cache: say what went wrong
        detail = str(e).strip().splitlines()[0] if str(e).strip() else ""
        return f"{what}: {kind}: {detail}" if detail else f"{what}: {kind}"
    cause = e.__cause__ or e.__context__  # why the Hub could not be asked
    detail = type(cause).__name__ if cause is not None else "no connection"
    return (
        f"{what}: not in {where}, and the Hugging Face Hub cannot be reached ({detail}); "
        f"download it with: {command}"
    )
