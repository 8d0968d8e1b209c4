"""SGLang's sampling parameters and their checks; torch-free: the API process imports it."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

MAX_NEW_TOKENS_LIMIT = 1 << 20
TOP_K_LIMIT = (1 << 31) - 1  # beyond any vocabulary; keeps top_k a 32-bit int in the sampler
# what torch.Generator.manual_seed takes, and what msgpack carries
SEED_MIN, SEED_MAX = -(1 << 63), (1 << 64) - 1
TOKEN_ID_LIMIT = (1 << 63) - 1
# SGLang's _SAMPLING_EPS: a temperature below it samples greedily (logits / 1e-45 overflow)
GREEDY_TEMPERATURE_EPS = 1e-6
# above it float32 logits / temperature are uniform to the last bit; larger temperatures are
# sampled at this one (a temperature past float32's range would turn a banned logit into NaN)
MAX_EFFECTIVE_TEMPERATURE = 1e6
# the smallest repetition penalty: logits / penalty stays finite in float32 (SGLang: > 0)
MIN_REPETITION_PENALTY = 1e-6
MAX_SAMPLES = 64  # samples of one prompt (``n``; OpenAI's choices)
MAX_TOP_LOGPROBS = 20  # top logprobs per position (OpenAI's limit)
# the grammars a request's output can be held to (engine/grammar/), SGLang's parameter names
GRAMMAR_KINDS = ("json_schema", "regex", "ebnf")
MAX_GRAMMAR_CHARS = 1 << 20  # a schema, regex or EBNF grammar past this is refused unread


@dataclass
class SamplingParams:
    """SGLang's sampling_params (same names, same defaults)."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    ignore_eos: bool = False
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    frequency_penalty: float = 0.0  # OpenAI: logit -= count * frequency_penalty (output tokens)
    presence_penalty: float = 0.0  # OpenAI: logit -= presence_penalty if the token was output
    repetition_penalty: float = 1.0  # HF/SGLang: a seen token's logit / p if > 0, else * p
    min_new_tokens: int = 0  # EOS and stop_token_ids are masked until this many are out
    logit_bias: dict[str, float] | None = None  # OpenAI: token id (as a string) -> added bias
    # structured output: at most one, the output held to it token by token (engine/grammar/)
    json_schema: str | None = None  # a JSON schema, as JSON text
    regex: str | None = None
    ebnf: str | None = None  # xgrammar's EBNF (GBNF-like: root ::= ...)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        """Whether the sampler keeps this request's token counts (on the device)."""
        return (
            self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    @property
    def grammar(self) -> tuple[str, str] | None:
        """(kind, source) of the request's grammar (one of GRAMMAR_KINDS), or None."""
        for kind in GRAMMAR_KINDS:
            source = getattr(self, kind)
            if source is not None:
                return kind, source
        return None

    def validate(self) -> None:
        """Raise ValueError naming the first parameter out of range (or of the wrong type)."""
        if not _is_int(self.max_new_tokens):
            raise ValueError(f"max_new_tokens must be an integer, got {self.max_new_tokens!r}")
        if not 0 <= self.max_new_tokens <= MAX_NEW_TOKENS_LIMIT:
            raise ValueError(
                f"max_new_tokens must be in [0, {MAX_NEW_TOKENS_LIMIT}], got {self.max_new_tokens}"
            )
        for name in ("temperature", "top_p", "min_p"):
            value = getattr(self, name)
            if not _is_number(value) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.temperature < GREEDY_TEMPERATURE_EPS:
            self.temperature = 0.0
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not _is_int(self.top_k) or not (self.top_k == -1 or 1 <= self.top_k <= TOP_K_LIMIT):
            raise ValueError(
                f"top_k must be -1 (off) or an integer in [1, {TOP_K_LIMIT}], got {self.top_k!r}"
            )
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        self._validate_penalties()
        if self.seed is not None and not (_is_int(self.seed) and SEED_MIN <= self.seed <= SEED_MAX):
            raise ValueError(f"seed must be an integer in [-2**63, 2**64), got {self.seed!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a boolean, got {self.ignore_eos!r}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, list) or any(
            not isinstance(s, str) or not s for s in self.stop
        ):
            raise ValueError("stop must be a non-empty string or a list of them")
        if not isinstance(self.stop_token_ids, list) or any(
            not _is_int(t) or not 0 <= t <= TOKEN_ID_LIMIT for t in self.stop_token_ids
        ):
            raise ValueError("stop_token_ids must be a list of non-negative token ids")
        self._validate_grammar()

    def _validate_grammar(self) -> None:
        given = [k for k in GRAMMAR_KINDS if getattr(self, k) is not None]
        if len(given) > 1:
            raise ValueError(f"give at most one of json_schema, regex and ebnf, got {given}")
        for kind in given:
            source = getattr(self, kind)
            if not isinstance(source, str) or not source:
                raise ValueError(f"{kind} must be a non-empty string, got {source!r:.40}")
            if len(source) > MAX_GRAMMAR_CHARS:
                raise ValueError(f"{kind} is over {MAX_GRAMMAR_CHARS} characters")

    def _validate_penalties(self) -> None:
        for name in ("frequency_penalty", "presence_penalty", "repetition_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
            setattr(self, name, float(value))
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not MIN_REPETITION_PENALTY <= self.repetition_penalty <= 2.0:
            raise ValueError(
                f"repetition_penalty must be in [{MIN_REPETITION_PENALTY:g}, 2], "
                f"got {self.repetition_penalty}"
            )
        if not _is_int(self.min_new_tokens) or not 0 <= self.min_new_tokens <= MAX_NEW_TOKENS_LIMIT:
            raise ValueError(
                f"min_new_tokens must be an integer in [0, {MAX_NEW_TOKENS_LIMIT}], "
                f"got {self.min_new_tokens!r}"
            )
        if self.logit_bias is None:
            return
        if not isinstance(self.logit_bias, dict):
            raise ValueError("logit_bias must be an object of token id -> bias")
        bias = {}
        for key, value in self.logit_bias.items():
            tok = str(key)
            # ASCII digits only: str.isdigit() also takes "５" or "²", which int() reads or refuses
            if not (tok.isascii() and tok.isdigit()) or not 0 <= int(tok) <= TOKEN_ID_LIMIT:
                raise ValueError(f"logit_bias key {key!r} is not a token id")
            if not _is_number(value) or not -100.0 <= value <= 100.0:
                raise ValueError(
                    f"logit_bias[{key}] must be a number in [-100, 100], got {value!r}"
                )
            bias[str(int(tok))] = float(value)
        self.logit_bias = bias or None

    def check_token_ids(self, vocab_size: int) -> None:
        """Raise ValueError if stop_token_ids or logit_bias name a token past the vocabulary."""
        for t in self.stop_token_ids:
            if t >= vocab_size:
                raise ValueError(f"stop token id {t} is out of range [0, {vocab_size})")
        for key in self.logit_bias or {}:
            if int(key) >= vocab_size:
                raise ValueError(f"logit_bias token id {key} is out of range [0, {vocab_size})")

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> SamplingParams:
        d = dict(d or {})
        known = set(cls.__dataclass_fields__)
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown sampling parameter(s): {sorted(unknown)}")
        if d.get("stop") is None:
            d.pop("stop", None)
        if d.get("stop_token_ids") is None:
            d.pop("stop_token_ids", None)
        params = cls(**d)
        params.validate()
        return params


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def check_logprob_args(prompt_len: int, logprob_start_len: int, top_logprobs_num: int) -> None:
    """Raise ValueError on logprob arguments out of range."""
    if not _is_int(logprob_start_len) or not -1 <= logprob_start_len < prompt_len:
        raise ValueError(
            f"logprob_start_len must be -1 (none) or in [0, {prompt_len}) for a prompt of "
            f"{prompt_len} tokens, got {logprob_start_len!r}"
        )
    if not _is_int(top_logprobs_num) or not 0 <= top_logprobs_num <= MAX_TOP_LOGPROBS:
        raise ValueError(
            f"top_logprobs_num must be in [0, {MAX_TOP_LOGPROBS}], got {top_logprobs_num!r}"
        )
