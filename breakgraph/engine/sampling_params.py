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

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

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
