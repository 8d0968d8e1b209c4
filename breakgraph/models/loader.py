"""Resolve ``--model-path`` and build a model with its weights (safetensors, GGUF or dummy)."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm

from breakgraph.distributed import TPGroup, tp_group_scope
from breakgraph.models.config import ModelConfig
from breakgraph.models.registry import check_tp_support, get_model_class
from breakgraph.models.sources import BUILTIN_MODELS, CONFIG_DIR

logger = logging.getLogger(__name__)

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass
class LoadedModel:
    model: nn.Module
    config: ModelConfig
    tokenizer: object | None  # breakgraph.tokenizer.Tokenizer, or None (token ids only)
    source: str  # a human-readable name of where the weights came from


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    try:
        return DTYPES[dtype]
    except KeyError:
        raise ValueError(
            f"--dtype must be auto or one of {sorted(DTYPES)}, not {dtype!r}"
        ) from None


def load_model(
    model_path: str | None,
    load_format: str = "auto",
    dtype: str = "auto",
    device: str | torch.device = "cpu",
    seed: int = 0,
    context_length: int | None = None,
    tp_group: TPGroup | None = None,
    with_mtp: bool = False,
) -> LoadedModel:
    """Build the model on ``device`` with weights from ``model_path`` (None: the embedded model);
    with a ``tp_group`` of size > 1, this rank's shard of it; ``with_mtp``: its multi-token
    prediction layers too (``model.mtp``, NEXTN's drafts)."""
    device = torch.device(device)
    tp_size = tp_group.size if tp_group else 1
    torch_dtype = resolve_dtype(dtype, device)
    if load_format not in ("auto", "dummy"):
        raise ValueError(f"--load-format must be auto or dummy, not {load_format!r}")

    gguf_file = None
    tokenizer = None
    if model_path is None or str(model_path).endswith(".gguf"):
        from breakgraph.models.gguf_loader import find_embedded_gguf, load_gguf

        gguf_file = Path(model_path) if model_path else find_embedded_gguf()
        source = gguf_file.name
        # GGUF: every rank reads whole tensors (dequantized) and keeps its slice
        gguf = load_gguf(gguf_file, dtype=torch_dtype)
        config, tokenizer = ModelConfig.from_dict(gguf.hf_config), gguf.tokenizer
        weights = iter(gguf.state_dict.items()) if load_format == "auto" else None
    elif model_path in BUILTIN_MODELS:
        if load_format != "dummy":
            raise ValueError(
                f"built-in model {model_path!r} ships a config only: use --load-format dummy, "
                "or point --model-path at a checkpoint directory"
            )
        config, source, weights = (
            ModelConfig.from_file(CONFIG_DIR / f"{model_path}.json"),
            model_path,
            None,
        )
    else:
        path = Path(model_path)
        if not (path / "config.json").is_file():
            known = ", ".join(BUILTIN_MODELS)
            raise FileNotFoundError(
                f"--model-path {model_path!r} is not a directory with config.json, a .gguf file, "
                f"or a built-in name ({known})"
            )
        config, source = ModelConfig.from_file(path / "config.json"), str(path)
        if (path / "tokenizer.json").is_file():
            from breakgraph.tokenizer import Tokenizer

            tokenizer = Tokenizer.from_pretrained(path)
        # under TP, lazy slices: a rank reads only its part of each tensor from disk
        lazy = tp_size > 1
        weights = _safetensors_weights(path, lazy) if load_format == "auto" else None

    if context_length and context_length > config.max_position_embeddings:
        logger.warning(
            "--context-length %d exceeds the model's max_position_embeddings %d: positions "
            "past the trained length are extrapolated, which degrades the output",
            context_length,
            config.max_position_embeddings,
        )
        config.max_position_embeddings = context_length
    check_tp_support(config, tp_size)
    config.with_mtp = with_mtp
    model = build_model(config, torch_dtype, device, tp_group)
    if weights is None:
        init_dummy_weights(model, seed)
    else:
        loaded = model.load_weights(weights)
        missing = {n for n, _ in model.named_parameters()} - loaded
        if config.tie_word_embeddings:
            missing.discard("lm_head.weight")
        if missing:
            what = (
                " (the MTP layers NEXTN drafts with)"
                if any(n.startswith("mtp.") for n in missing)
                else ""
            )
            raise ValueError(
                f"checkpoint lacks {len(missing)} tensors{what}, e.g. {sorted(missing)[:3]}"
            )
    model.eval()
    logger.info(
        "loaded %s (%s, %s, %s weights) on %s",
        source,
        config.architecture,
        torch_dtype,
        "dummy" if weights is None else "real",
        device,
    )
    return LoadedModel(model=model, config=config, tokenizer=tokenizer, source=source)


def peek_config(model_path: str | None) -> ModelConfig | None:
    """The config of a checkpoint directory, built-in name or GGUF file (None: the embedded
    one), without loading weights: a GGUF file's from its header."""
    if model_path is None or str(model_path).endswith(".gguf"):
        from gguf import GGUFReader

        from breakgraph.models.gguf_loader import _hf_config, find_embedded_gguf

        path = Path(model_path) if model_path else find_embedded_gguf()
        return ModelConfig.from_dict(_hf_config(GGUFReader(str(path))))
    if model_path in BUILTIN_MODELS:
        return ModelConfig.from_file(CONFIG_DIR / f"{model_path}.json")
    path = Path(model_path) / "config.json"
    return ModelConfig.from_file(path) if path.is_file() else None


def build_model(
    config: ModelConfig, dtype: torch.dtype, device: torch.device, tp_group: TPGroup | None = None
) -> nn.Module:
    cls = get_model_class(config.architecture)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device), tp_group_scope(tp_group):
            return cls(config)
    finally:
        torch.set_default_dtype(prev)


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    """Random weights, as ``--load-format dummy`` in SGLang/vLLM: norms and scales 1, the rest
    N(0, 0.02).

    A TP shard draws each full tensor in the same generator order and loads its slice, so
    the weights of every TP size are equal (TP1 vs TPn comparisons). That is the full model's
    draws on every rank, transiently one full tensor at a time: cheap for small models,
    seconds to minutes of generator time per rank for large ones."""
    gen_device = next(model.parameters()).device
    gen = torch.Generator(device=gen_device).manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith(("norm.weight", "router.scale", "per_expert_scale")):
            param.fill_(1.0)
        elif name.endswith(".bias"):
            param.zero_()
        elif tuple(getattr(param, "full_shape", param.shape)) != tuple(param.shape):
            whole = torch.empty(param.full_shape, dtype=param.dtype, device=param.device)
            param.weight_loader(param, whole.normal_(0.0, 0.02, generator=gen))
        else:
            param.normal_(0.0, 0.02, generator=gen)


def _safetensors_weights(path: Path, lazy: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every checkpoint tensor; ``lazy``: (name, safetensors slice), from
    which a parameter's weight_loader reads only its rank's part."""
    from safetensors import safe_open

    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"no *.safetensors in {path} (use --load-format dummy for random weights)"
        )
    with tqdm(total=len(files), desc="Loading safetensors", unit="file") as bar:
        for name in files:
            with safe_open(str(path / name), framework="pt", device="cpu") as f:
                for key in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                    yield key, f.get_slice(key) if lazy else f.get_tensor(key)
            bar.update(1)
