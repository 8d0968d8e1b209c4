"""What ``generate`` and ``serve`` check before anything loads, so that a mistake costs a
second and one line instead of a model load and a traceback: the sampling flags, the device
torch can reach, the model path (a hub id resolved to its cached snapshot here, downloaded
when online) and its architecture.

``--cpu-threads`` is applied here too, before torch starts in any process.

A flag's problem is a ``FlagError`` (shown under the short usage, as argparse's own); any
other is a ``StartupError``, logged in the one log format.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import sys

from breakgraph.common.sampling_params import SamplingParams
from breakgraph.models.model_path import ModelPathError, resolve_model_path


class FlagError(ValueError):
    """A flag's value is refused; the message names the flag."""


class StartupError(RuntimeError):
    """The command cannot start as asked; the message is one line."""


# SamplingParams' fields as generate's flags name them
_SAMPLING_FLAGS = {
    "max_new_tokens": "--max-new-tokens",
    "temperature": "--temperature",
    "top_p": "--top-p",
    "top_k": "--top-k",
    "min_p": "--min-p",
    "seed": "--sampling-seed",
}


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    """``generate``'s sampling flags as SamplingParams, validated (FlagError names the flag)."""
    sampling = SamplingParams(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        seed=args.sampling_seed,
        ignore_eos=args.ignore_eos,
    )
    try:
        sampling.validate()
    except ValueError as e:
        field, _, rest = str(e).partition(" ")
        raise FlagError(f"{_SAMPLING_FLAGS.get(field, field)} {rest}") from None
    return sampling


def prompt_ids(args: argparse.Namespace) -> list[int] | None:
    """``--input-ids``' PROMPT as token ids (FlagError if it is not a list of them)."""
    if not args.input_ids:
        return None
    words = args.prompt.replace(",", " ").split()
    if not words or not all(w.isdigit() for w in words):
        raise FlagError(
            f"--input-ids: PROMPT must be token ids such as '1 2 3', got {args.prompt!r}"
        )
    return [int(w) for w in words]


def check_device(device: str, import_torch: bool) -> None:
    """``--device cuda`` where torch can reach no GPU, refused in one line. Without
    ``import_torch`` (the API process) only a CPU build of torch is recognized, by its
    version (``+cpu``); the engine process finds the rest."""
    if device != "cuda":
        return
    try:
        build = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        build = "unknown"
    if "+cpu" in build:
        raise StartupError(f"CUDA is not available in this torch build ({build})")
    if not import_torch:
        return
    import torch

    if torch.version.cuda is None and torch.version.hip is None:
        raise StartupError(f"CUDA is not available in this torch build ({torch.__version__})")
    if not torch.cuda.is_available():
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        where = f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
        raise StartupError(f"CUDA is not available: torch {torch.__version__} sees no GPU{where}")


def apply_cpu_threads(threads: int | None) -> None:
    """``--cpu-threads``: OMP_NUM_THREADS for the processes started from here (the engine
    process, TP workers), read when their torch starts, and torch's pool in this process
    where torch is loaded already (``generate``)."""
    if threads is None:
        return
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(threads)


def resolve_model(args: argparse.Namespace) -> None:
    """``--model-path`` resolved in place (a hub id becomes its snapshot directory; serve's
    model name stays the hub id) and checked: StartupError if nothing loadable is there."""
    try:
        resolved = resolve_model_path(args.model_path, args.load_format)
    except ModelPathError as e:
        raise StartupError(str(e)) from None
    if resolved.hub_id and getattr(args, "served_model_name", "") is None:
        args.served_model_name = resolved.hub_id
    args.model_path = resolved.path
