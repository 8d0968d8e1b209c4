"""``breakgraph bench spec``: speculative decoding against plain decoding in one process.

The model (the embedded SmolLM2 by default: real weights, so that a repeated text is
repeated) is asked through its chat template to repeat a text word for word; one engine
decodes without speculation, then one per ``--algorithm`` (NGRAM; STANDALONE with
``--draft-model-path``, by default the model itself; NEXTN, a model's own MTP layers), each
on the same prompt, greedy, after a short warm-up. With ``--input-len`` (or a model without a
tokenizer: a built-in config, dummy weights) the prompt is that many random token ids.
With ``--unchained`` STANDALONE runs once more with each verify step read back before the
next (on CUDA, where overlap scheduling chains them: engine/spec_chain.py). Reports decode
tok/s of each, the ratio to plain decoding, verify steps and the mean
accepted length (tokens a request kept per verify step), and whether the answers are the
same tokens (greedy: they must be, unless ``--synthetic-accept-length`` fixes the tokens
kept, a benchmark of the mechanics, not of the model; or dummy weights in bfloat16, whose
flat logits' near ties may differ between the verify and decode kernels).
"""

from __future__ import annotations

import gc
import json
import time

import numpy as np
import torch

TEXT = (
    "Here is a list: apples, pears, plums, figs, dates, limes, cherries, grapes, melons, "
    "kiwis, mangoes, papayas, lemons, oranges, peaches."
)
ASK = "Repeat the following text exactly, word for word, and nothing else.\n\n"


def run_spec_bench(args) -> int:
    from breakgraph.common import envs
    from breakgraph.engine.args import EngineArgs
    from breakgraph.engine.engine import Engine
    from breakgraph.engine.request import SamplingParams
    from breakgraph.models.sources import BUILTIN_MODELS, find_embedded_gguf

    rows = []
    answers = []
    synthetic = args.synthetic_accept_length
    dummy = args.model_path in BUILTIN_MODELS
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    tokens = args.input_len + args.output_len
    runs = [(a, True) for a in (None, *args.algorithm)]
    if args.unchained and "STANDALONE" in args.algorithm:
        runs.append(("STANDALONE", False))
    for algorithm, chain in runs:
        draft = None
        if algorithm == "STANDALONE":
            draft = args.draft_model_path or args.model_path or str(find_embedded_gguf())
        with envs.BENCH.override(True), envs.SPEC_CHAIN.override(chain):
            engine = Engine(
                EngineArgs(
                    model_path=args.model_path, device="cuda" if cuda else "cpu",
                    dtype="auto" if cuda else "float32",
                    load_format="dummy" if dummy else "auto",
                    max_total_tokens=None if cuda else max(8192, 2 * tokens),
                    speculative_algorithm=algorithm,
                    speculative_num_draft_tokens=args.draft_tokens,
                    speculative_draft_model_path=draft,
                    bench_synthetic_accept_length=synthetic if algorithm else None,
                )
            )  # fmt: skip
        ids = _prompt(engine.tokenizer, args.input_len)
        engine.generate([ids], SamplingParams(max_new_tokens=4, temperature=0.0))  # warm-up
        engine.scheduler.spec_stats.__init__()
        sp = SamplingParams(max_new_tokens=args.output_len, temperature=0.0, ignore_eos=dummy)
        gpu_ms = _time_steps(engine)
        t0 = time.perf_counter()
        (res,) = engine.generate([ids], sp)
        seconds = time.perf_counter() - t0
        stats = engine.scheduler.spec_stats
        answers.append(res.output_ids)
        rows.append(
            {
                "speculation": (algorithm or "off") + ("" if chain else " unchained"),
                "prompt_tokens": len(ids),
                "output_tokens": len(res.output_ids),
                "seconds": seconds,
                "tok_s": len(res.output_ids) / seconds,
                "verify_steps": stats.steps,
                # the prompt is cached by the warm-up: the time is the steps'
                "ms_per_step": 1e3 * seconds / max(1, stats.steps or len(res.output_ids) - 1),
                "gpu_ms_per_step": float(np.median(gpu_ms)) if gpu_ms else None,
                "mean_accepted_length": stats.mean_accepted_length if stats.steps else 1.0,
            }
        )
        engine.shutdown()
        del engine  # its KV pool and graph pools, before the next engine sizes its own
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    print(
        "| speculation | output tokens | tok/s | verify steps | mean accepted length | ms/step "
        "| GPU ms/step |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        gpu = r["gpu_ms_per_step"]
        print(
            f"| {r['speculation']} | {r['output_tokens']} | {r['tok_s']:.1f} | "
            f"{r['verify_steps']} | {r['mean_accepted_length']:.2f} | {r['ms_per_step']:.2f} | "
            f"{'' if gpu is None else f'{gpu:.2f}'} |"
        )
    same = all(a == answers[0] for a in answers[1:])
    for r in rows[1:]:
        step = r["ms_per_step"] / rows[0]["ms_per_step"]
        line = f"{r['speculation']} / off: {r['tok_s'] / rows[0]['tok_s']:.2f}x tok/s, "
        line += f"{step:.2f}x the time of a step"
        if r["gpu_ms_per_step"] and rows[0]["gpu_ms_per_step"]:
            line += f" ({r['gpu_ms_per_step'] / rows[0]['gpu_ms_per_step']:.2f}x its GPU time)"
        print(line)
    print(f"same tokens: {same}" + (" (synthetic acceptance)" if synthetic else ""))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bench": "spec", "rows": rows, "same_tokens": same}, f, indent=2)
    return 0 if same or synthetic or dummy else 1


def _prompt(tokenizer, input_len: int) -> list[int]:
    """The chat prompt asking to repeat the text, or ``input_len`` random token ids (seeded)
    where that is asked or the model has no tokenizer."""
    if input_len or tokenizer is None:
        gen = np.random.default_rng(0)
        return gen.integers(10, 1000, size=input_len or 1024).tolist()
    return tokenizer.encode(
        tokenizer.apply_chat_template([{"role": "user", "content": ASK + TEXT}])
    )


def _time_steps(engine) -> list[float]:
    """From now on, the GPU time of each step's forward (CUDA events around it, read a step
    late: engine/step_timer.py; a verify step's includes its drafts), collected as the
    engine steps."""
    times: list[float] = []
    step = engine.step

    def timed():
        out = step()
        ms = engine.scheduler.timer.last.gpu_ms
        if ms is not None:
            times.append(ms)
        return out

    engine.step = timed
    return times
