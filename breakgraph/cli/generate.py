"""``breakgraph generate``: one prompt answered in-process, its text printed as it comes
(``--no-stream``: once complete); every flag checked before the model loads."""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import TextIO

from breakgraph.cli import preflight
from breakgraph.cli.preflight import FlagError, StartupError
from breakgraph.models.sources import BUILTIN_MODELS


def cmd_generate(args: argparse.Namespace) -> int:
    sampling = preflight.sampling_params(args)
    ids = preflight.prompt_ids(args)
    preflight.apply_cpu_threads(args.cpu_threads)
    preflight.check_device(args.device, import_torch=True)
    preflight.resolve_model(args)
    if ids is None and not _has_tokenizer(args.model_path):
        raise FlagError(
            f"--model-path {args.model_path} has no tokenizer (a built-in config, or no "
            "tokenizer.json): give PROMPT as token ids with --input-ids"
        )

    import torch

    from breakgraph.engine.args import EngineArgs
    from breakgraph.engine.engine import Engine
    from breakgraph.engine.memory import MemoryPlanError
    from breakgraph.engine.tp.driver import TPWorkerError
    from breakgraph.models.sources import EmbeddedModelMissing

    try:
        engine = Engine(EngineArgs.from_namespace(args))
    except (EmbeddedModelMissing, FileNotFoundError, ValueError, MemoryPlanError) as e:
        raise StartupError(str(e)) from None
    except torch.OutOfMemoryError as e:  # past the plan: a graph capture, the KV pool
        raise out_of_memory(e, "while starting") from None
    try:
        try:
            prompt = ids if ids is not None else engine.encode_prompt(args.prompt, not args.raw)
            if args.stream:
                stream_answer(engine, prompt, sampling, sys.stdout)
            else:
                (result,) = engine.generate([prompt], sampling)
                print(result.text if result.text is not None else _ids_text(result.output_ids))
        except ValueError as e:  # the prompt against the model: too long, an id out of range
            raise StartupError(str(e)) from None
        except torch.OutOfMemoryError as e:
            raise out_of_memory(e, "while generating") from None
        except TPWorkerError as e:  # a worker's failure, named in one line
            raise worker_failure(e) from None
    finally:
        engine.shutdown(leave_group=False)  # TP workers, if any: this process exits next
    return 0


def worker_failure(e) -> StartupError:
    """A TP worker's failure during a step (``TPWorkerError``) as one line; its device's
    out-of-memory error as rank 0's own."""
    if e.out_of_memory:
        return out_of_memory(e.error, f"on TP rank {e.rank} while generating")
    return StartupError((str(e).splitlines() or [""])[0])


def out_of_memory(e: BaseException | str, stage: str) -> StartupError:
    """A device out-of-memory error the memory plan did not foresee (a graph capture, a step)
    as one line: what was asked and free (torch's message says both), and the flags that
    leave more room beside the KV pool or ask for less."""
    text = str(e)
    asked = re.search(r"Tried to allocate ([\d.]+ \w+)", text)
    free = re.search(r"of which ([\d.]+ \w+) is free", text)
    if asked is not None:
        cause = f"{asked[1]} asked" + (f", {free[1]} free" if free is not None else "")
    else:
        cause = (text.splitlines() or [""])[0] or type(e).__name__
    return StartupError(
        f"the device ran out of memory {stage}, outside the memory plan ({cause}): lower "
        "--mem-fraction-static (more room beside the KV pool), --cuda-graph-max-bs, "
        "--chunked-prefill-size or --max-running-requests, or add --disable-cuda-graph"
    )


def stream_answer(engine, prompt: list[int], sampling, out: TextIO) -> None:
    """Run one request on ``engine``, writing its text (or, without a tokenizer, its token
    ids) to ``out`` as each step adds to it; what is written equals the whole answer's text
    (stop tokens cut off), then a newline."""
    from breakgraph.server.detokenize import TextStream

    rid = engine.add_request(prompt, sampling)
    text = TextStream(engine.tokenizer, stop=[]) if engine.tokenizer is not None else None
    output_ids: list[int] = []
    shown = ""
    finished = False
    while not finished:
        deltas = [d for d in engine.step() if d.rid == rid]
        if not deltas and not engine.has_work:
            raise RuntimeError("the scheduler dropped the request")
        for delta in deltas:
            output_ids.extend(delta.token_ids)
            if text is None:
                now = _ids_text(output_ids)
            elif delta.finished:
                now = text.finish(output_ids, delta.finish_reason)
            else:
                now = text.feed(delta.token_ids)
            if now.startswith(shown) and len(now) > len(shown):
                out.write(now[len(shown) :])
                out.flush()
                shown = now
            finished = finished or delta.finished
    out.write("\n")
    out.flush()


def _ids_text(ids: list[int]) -> str:
    return " ".join(map(str, ids))


def _has_tokenizer(model_path: str | None) -> bool:
    """Whether the loaders will find a tokenizer: GGUF files carry one, built-in configs
    none, a checkpoint directory its tokenizer.json."""
    if model_path is None or model_path.endswith(".gguf"):
        return True
    if model_path in BUILTIN_MODELS:
        return False
    return (Path(model_path) / "tokenizer.json").is_file()
