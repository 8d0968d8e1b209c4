"""In-process generation (``breakgraph generate``, the benchmarks, the tests): requests added to
an ``Engine`` and stepped until every one has finished, collected into ``GenerateResult``s."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from breakgraph.engine.request import SamplingParams

if TYPE_CHECKING:
    from breakgraph.engine.engine import Engine


@dataclass
class GenerateResult:
    rid: str
    text: str | None
    output_ids: list[int]
    finish_reason: dict | None
    prompt_tokens: int
    cached_tokens: int
    output_logprobs: list[float]
    e2e_latency: float
    output_top_logprobs: list[list[list]] = field(default_factory=list)
    input_logprobs: list[float | None] = field(default_factory=list)
    input_top_logprobs: list[list[list] | None] = field(default_factory=list)


def output_text(tokenizer, output_ids: list[int], finish_reason: dict | None) -> str:
    """Detokenize an output the way the API reports it: stop token and stop string cut off."""
    ids = output_ids
    matched = (finish_reason or {}).get("matched")
    if isinstance(matched, int) and ids and ids[-1] == matched:
        ids = ids[:-1]
    text = tokenizer.decode(ids, skip_special_tokens=True)
    if isinstance(matched, str) and matched in text:
        text = text[: text.index(matched)]
    return text


def generate(
    engine: Engine,
    prompts: list[str | list[int]],
    sampling: SamplingParams | list[SamplingParams] | None = None,
    chat: bool = False,
    return_logprob: bool = False,
    logprob_start_len: int = -1,
    top_logprobs_num: int = 0,
) -> list[GenerateResult]:
    """Add ``prompts`` (text or token ids; ``chat``: through the chat template) and step
    ``engine`` until all have finished; a request refused (its grammar) raises."""
    if not isinstance(sampling, list):
        sampling = [sampling or SamplingParams()] * len(prompts)
    start = time.perf_counter()
    rids = [
        engine.add_request(
            engine.encode_prompt(p, chat),
            s,
            return_logprob=return_logprob,
            logprob_start_len=logprob_start_len,
            top_logprobs_num=top_logprobs_num,
        )
        for p, s in zip(prompts, sampling, strict=True)
    ]
    results: dict[str, GenerateResult] = {
        rid: GenerateResult(rid, None, [], None, 0, 0, [], 0.0) for rid in rids
    }
    pending = set(rids)
    while pending:
        outs = engine.step()
        for rid, reason in engine.take_rejected():
            raise ValueError(f"request {rid}: {reason}")
        if not outs and not engine.has_work and engine.compiling:
            engine.grammars.wait(0.05)
            continue
        if not outs and not engine.has_work:
            raise RuntimeError(f"the scheduler holds none of the {len(pending)} pending requests")
        for out in outs:
            res = results[out.rid]
            res.output_ids.extend(out.token_ids)
            res.output_logprobs.extend(out.logprobs)
            res.output_top_logprobs.extend(out.top_logprobs)
            if out.input_logprobs is not None:
                res.input_logprobs = out.input_logprobs
                res.input_top_logprobs = out.input_top_logprobs or []
            if out.finished:
                res.finish_reason = out.finish_reason
                res.prompt_tokens, res.cached_tokens = out.prompt_tokens, out.cached_tokens
                res.e2e_latency = time.perf_counter() - start
                pending.discard(out.rid)
    if engine.tokenizer is not None:
        for res in results.values():
            res.text = output_text(engine.tokenizer, res.output_ids, res.finish_reason)
    return [results[r] for r in rids]
