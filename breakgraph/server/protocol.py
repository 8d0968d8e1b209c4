"""Request validation in the API process (SGLang-native shapes): a parsed body (json_body.py)
becomes checked prompts and sampling parameters.

Everything that can be checked without the engine is checked here, with the limits the
engine reported when it became ready, so a bad request is answered 400 before it is sent.
"""

from __future__ import annotations

import functools
from dataclasses import replace
from typing import Any, TypeVar

import numpy as np
from pydantic import BaseModel, ConfigDict, StrictBool, StrictInt, ValidationError

from breakgraph.common.codec import IdArray, packed_id_list
from breakgraph.common.messages import ModelInfo
from breakgraph.common.sampling_params import MAX_SAMPLES as MAX_CHOICES
from breakgraph.common.sampling_params import SamplingParams, check_logprob_args
from breakgraph.server.errors import APIError
from breakgraph.server.json_body import IntList, int_values
from breakgraph.server.structured import sampling_grammar
from breakgraph.tokenizer import Tokenizer

# sampling parameters handled in the API process (detokenization), not by the engine
API_SAMPLING_KEYS = {"skip_special_tokens": True, "no_stop_trim": False}
_FLOAT_PARAMS = (
    "temperature",
    "top_p",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
)
_INT_PARAMS = ("max_new_tokens", "top_k", "seed", "min_new_tokens")
TOKENIZED = "tokenized text"  # how a 400 names a prompt the tokenizer produced
# SGLang sampling parameters breakgraph lacks: accepted at their neutral value only
_NEUTRAL_PARAMS = {"spaces_between_special_tokens": True}

M = TypeVar("M", bound=BaseModel)


def parse_model(model: type[M], body: Any) -> M:
    """Validate a JSON body against a pydantic model; errors become one readable 400."""
    if not isinstance(body, dict):
        raise APIError(f"the request body must be a JSON object, not {type(body).__name__}")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        problems = []
        for err in e.errors():
            where = ".".join(str(p) for p in err["loc"]) or "body"
            problems.append(f"{where}: {err['msg']}")
        raise APIError("invalid request: " + "; ".join(problems)) from None


class GenerateReqInput(BaseModel):
    """SGLang's /generate body (the fields breakgraph serves; a few more are accepted if unset)."""

    model_config = ConfigDict(extra="forbid")

    text: str | list[str] | None = None
    input_ids: Any = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    stream: StrictBool = False
    return_logprob: StrictBool | list[StrictBool] = False
    rid: str | list[str] | None = None
    logprob_start_len: StrictInt | list[StrictInt] | None = None
    top_logprobs_num: StrictInt | list[StrictInt] | None = None
    return_text_in_logprobs: StrictBool = False
    return_timeline: StrictBool = False  # per-request stage durations in meta_info["timeline"]
    # accepted for compatibility; only their defaults are supported
    image_data: Any = None
    lora_path: Any = None
    custom_logit_processor: Any = None


def pop_n(d: dict[str, Any] | None) -> tuple[dict[str, Any] | None, int]:
    """SGLang's ``sampling_params.n`` (samples of the prompt, 1 to MAX_CHOICES) taken out of
    the dict: the rest goes to :func:`sampling_from_dict`."""
    if not isinstance(d, dict) or d.get("n") is None:
        return d, 1
    d = dict(d)
    n = d.pop("n")
    if type(n) is not int or not 1 <= n <= MAX_CHOICES:
        raise APIError(
            f"sampling_params.n must be an integer in [1, {MAX_CHOICES}], got {n!r}", param="n"
        )
    return d, n


def per_sample(sampling: SamplingParams, n: int) -> list[SamplingParams]:
    """The sampling of each of ``n`` samples of one prompt: a seeded request's samples get
    seeds seed+j (mod 2**64, so every seed stays in the range the first one was checked in),
    so they differ and each stays reproducible."""
    if sampling.seed is None:
        return [sampling] * n
    return [
        sampling if j == 0 else replace(sampling, seed=(sampling.seed + j) % (1 << 64))
        for j in range(n)
    ]


def sampling_from_dict(d: dict[str, Any] | None) -> tuple[SamplingParams, dict[str, bool]]:
    """SamplingParams (validated) and the API-side options (skip_special_tokens, no_stop_trim)."""
    d = {k: v for k, v in (d or {}).items() if v is not None}  # null means the default
    for key, neutral in _NEUTRAL_PARAMS.items():
        if key in d and d.pop(key) != neutral:
            raise APIError(f"{key} is not supported (only {neutral!r})", param=key)
    api_opts = {}
    for key, default in API_SAMPLING_KEYS.items():
        value = d.pop(key, default)
        if not isinstance(value, bool):
            raise APIError(f"{key} must be a boolean, got {value!r}", param=key)
        api_opts[key] = value
    for key in _FLOAT_PARAMS:
        value = d.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
            raise APIError(f"{key} must be a number, got {value!r}", param=key)
        if value is not None:
            d[key] = float(value)
    for key in _INT_PARAMS:
        value = d.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise APIError(f"{key} must be an integer, got {value!r}", param=key)
    if "ignore_eos" in d and not isinstance(d["ignore_eos"], bool):
        raise APIError(f"ignore_eos must be a boolean, got {d['ignore_eos']!r}", param="ignore_eos")
    if isinstance(d.get("stop"), str):
        d["stop"] = [d["stop"]]
    for key in ("stop", "stop_token_ids"):
        if d.get(key) is not None and not isinstance(d[key], list):
            raise APIError(f"{key} must be a list, got {d[key]!r}", param=key)
    if "logit_bias" in d and not isinstance(d["logit_bias"], dict):
        raise APIError("logit_bias must be an object of token id -> bias", param="logit_bias")
    sampling_grammar(d)  # json_schema, regex, ebnf
    try:
        params = SamplingParams.from_dict(d)
    except (ValueError, TypeError) as e:
        raise APIError(str(e)) from None
    if params.min_new_tokens > params.max_new_tokens:
        raise APIError(
            f"min_new_tokens ({params.min_new_tokens}) is above max_new_tokens "
            f"({params.max_new_tokens})",
            param="min_new_tokens",
        )
    return params, api_opts


def encode_text(tokenizer: Tokenizer | None, text: str, max_tokens: int | None = None) -> list[int]:
    """``text``'s token ids; a text that surely exceeds ``max_tokens`` is refused untokenized."""
    if tokenizer is None:
        raise APIError(
            "this model has no tokenizer (dummy weights or no tokenizer.json): "
            "send input_ids instead of text"
        )
    if max_tokens is not None and len(text) > max_tokens:
        # each token covers at most max_token_bytes(...) bytes of text: a lower bound
        at_least = len(text.encode("utf-8", "surrogatepass")) // max_token_bytes(tokenizer)
        if at_least > max_tokens:
            raise APIError(
                f"the text is at least {at_least} tokens, over the context length {max_tokens}"
            )
    try:
        return tokenizer.encode(text)
    except Exception as e:  # the Rust tokenizer refuses what it cannot encode
        raise APIError(f"cannot tokenize the text: {e}") from None


@functools.cache
def max_token_bytes(tokenizer: Tokenizer) -> int:
    """The most UTF-8 bytes of text one token decodes to (a partial character counts as 3)."""
    backend = tokenizer.backend
    lengths = (
        len(backend.decode([i], skip_special_tokens=False).encode("utf-8", "surrogatepass"))
        for i in range(backend.get_vocab_size(True))
    )
    return max(lengths, default=1) or 1


def check_input_ids(ids: Any, info: ModelInfo, field: str = "input_ids") -> list[int]:
    """A prompt of token ids, checked against the vocabulary; ``field`` names it in a 400.

    Prompts run to 64K+ ids: the common case (all plain ints in range) is checked in C, and
    only a prompt that fails it is walked in Python to name its first bad id."""
    if type(ids) is IdArray:  # parsed as ints already (parse_json's fast path)
        lo, hi = int(ids.values.min()), int(ids.values.max())
        if lo < 0 or hi >= info.vocab_size:
            i = int(np.flatnonzero((ids.values < 0) | (ids.values >= info.vocab_size))[0])
            raise APIError(
                f"{field}[{i}]: token id {ids[i]} is out of range [0, {info.vocab_size})"
            )
        ids.packed = ids.values.astype(np.int32).tobytes()
        return ids
    if not isinstance(ids, list):
        raise APIError(f"{field} must be a list of integers, got {type(ids).__name__}")
    if not ids:
        raise APIError("the prompt is empty")
    # no bool, float, str, None, list (an IntList: checked and converted while parsing)
    if type(ids) is IntList:
        arr = ids.values
    elif {*map(type, ids)} == {int}:
        arr = int_values(ids)  # None beyond 64 bits: out of range, named below
    else:
        arr = None
    if arr is not None:
        lo, hi = int(arr.min()), int(arr.max())
        if lo >= 0 and hi < info.vocab_size:  # its int32 bytes go to the engine as they are
            return packed_id_list(ids, arr)
    for i, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, int):
            raise APIError(f"{field}[{i}]: token id {_short(t)} is not an integer")
        if not 0 <= t < info.vocab_size:
            raise APIError(
                f"{field}[{i}]: token id {_short(t)} is out of range [0, {info.vocab_size})"
            )
    return ids  # int subclasses: valid, just not on the fast path


def _short(value: Any, limit: int = 40) -> str:
    """``repr(value)``, cut to ``limit`` characters (a 400 message stays one short line)."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def check_fits(ids: list[int], sampling: SamplingParams, info: ModelInfo) -> None:
    """Prompt + max_new_tokens within the context length; the prompt within the KV pool."""
    if not ids:
        raise APIError("the prompt is empty")
    try:
        sampling.check_token_ids(info.vocab_size)
    except ValueError as e:
        raise APIError(str(e)) from None
    total = len(ids) + sampling.max_new_tokens
    if total > info.context_length:
        raise APIError(
            f"prompt ({len(ids)} tokens) + max_new_tokens ({sampling.max_new_tokens}) = {total} "
            f"exceeds the context length {info.context_length}"
        )
    if total > info.kv_capacity_tokens:
        raise APIError(
            f"prompt ({len(ids)} tokens) + max_new_tokens ({sampling.max_new_tokens}) = {total} "
            f"exceeds the KV pool ({info.kv_capacity_tokens} tokens, --max-total-tokens)"
        )


def _as_batch(value: Any, n: int, name: str, is_single: Any) -> list[Any]:
    """A per-prompt value given once (shared) or as a list of n."""
    if isinstance(value, list) and not is_single(value):
        if len(value) != n:
            raise APIError(f"{name} has {len(value)} entries for {n} prompts")
        return value
    return [value] * n


def prompts_of(req: GenerateReqInput, tokenizer: Tokenizer | None, info: ModelInfo):
    """(token id prompts, is_batch) of a /generate request."""
    if (req.text is None) == (req.input_ids is None):
        raise APIError("give exactly one of text and input_ids")
    if req.text is not None:
        texts = [req.text] if isinstance(req.text, str) else req.text
        if not texts:
            raise APIError("text is an empty list")
        prompts = [
            check_input_ids(encode_text(tokenizer, t, info.context_length), info, TOKENIZED)
            for t in texts
        ]
        return prompts, not isinstance(req.text, str)
    ids = req.input_ids
    if isinstance(ids, list) and ids and all(isinstance(x, list | IdArray) for x in ids):
        return [check_input_ids(x, info, f"input_ids[{i}]") for i, x in enumerate(ids)], True
    return [check_input_ids(ids, info)], False


def unsupported(req: GenerateReqInput) -> None:
    if req.image_data is not None:
        raise APIError("image_data is not supported: this is a text-only server")
    if req.lora_path is not None:
        raise APIError("lora_path is not supported")
    if req.custom_logit_processor is not None:
        raise APIError("custom_logit_processor is not supported")


def check_logprobs(prompt_len: int, logprob_start_len: int | None, top_k: int | None) -> None:
    """Logprob arguments in range for this prompt (a 400 otherwise)."""
    try:
        check_logprob_args(prompt_len, -1 if logprob_start_len is None else logprob_start_len,
                           top_k or 0)  # fmt: skip
    except ValueError as e:
        raise APIError(str(e)) from None


def batch_fields(req: GenerateReqInput, n: int) -> tuple[list, list, list, list, list]:
    """Per-prompt (sampling_params, return_logprob, rid, logprob_start_len, top_logprobs_num)."""
    sampling = _as_batch(req.sampling_params, n, "sampling_params", lambda v: False)
    logprob = _as_batch(req.return_logprob, n, "return_logprob", lambda v: False)
    start = _as_batch(req.logprob_start_len, n, "logprob_start_len", lambda v: False)
    top = _as_batch(req.top_logprobs_num, n, "top_logprobs_num", lambda v: False)
    if isinstance(req.rid, list):
        rids = _as_batch(req.rid, n, "rid", lambda v: False)
    elif req.rid is not None and n > 1:
        rids = [f"{req.rid}-{i}" for i in range(n)]
    else:
        rids = [req.rid] * n
    return sampling, logprob, rids, start, top
