"""SamplingParams: per-request decoding options, named as in vLLM."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from tpserve.errors import InvalidFieldError
from tpserve.requests import (MAX_MAX_TOKENS, MAX_SEED, MAX_STOP_CHARS, MAX_STOP_STRINGS,
                              MAX_LOGPROBS, MAX_STOP_TOKEN_IDS, MAX_TEMPERATURE, MAX_TOP_K, check_token_ids, is_int)


@dataclass
class SamplingParams:
    """How to pick each next token of one request.

    temperature 0 means greedy. ``top_k`` <= 0 (or -1, vLLM's spelling) disables top-k;
    ``top_p`` 1.0 disables nucleus sampling. With ``seed`` set, the sampled tokens depend only
    on the seed, the model and the prompt -- not on which other requests share the batch.

    Every field is checked at construction against the bounds of ``tpserve.requests``; a bad
    value raises ``InvalidFieldError`` naming the field (``stop_token_ids[2]``, ...).

    ``logprobs`` None reports no log-probabilities; k >= 0 reports each sampled token's
    log-probability and the k most likely tokens with theirs (from the unscaled distribution).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    max_tokens: int = 16
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None

    def __post_init__(self):
        # A single stop string is reported as "stop", an element of a list as "stop[i]".
        self._single_stop = isinstance(self.stop, str)
        if self._single_stop:
            self.stop = [self.stop]
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if self.stop is None:
            self.stop = []
        self.validate()

    def validate(self) -> None:
        def number(name, value):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise InvalidFieldError(name, f"must be a number, got {type(value).__name__}")
            if not math.isfinite(value):
                raise InvalidFieldError(name, f"must be finite, got {value}")

        def integer(name, value, lo, hi, what=""):
            if not is_int(value):
                raise InvalidFieldError(name, f"must be an integer, got {type(value).__name__}")
            if not lo <= value <= hi:
                raise InvalidFieldError(name, f"must be in [{lo}, {hi}]{what}, got {value}")

        number("temperature", self.temperature)
        if not 0.0 <= self.temperature <= MAX_TEMPERATURE:
            raise InvalidFieldError("temperature", f"must be in [0, {MAX_TEMPERATURE:g}], got {self.temperature}")
        number("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidFieldError("top_p", f"must be in (0, 1], got {self.top_p}")
        integer("top_k", self.top_k, -1, MAX_TOP_K, " (-1 or 0 disable it)")
        self.top_k = int(self.top_k)
        if self.seed is not None:
            integer("seed", self.seed, 0, MAX_SEED)
            self.seed = int(self.seed)
        integer("max_tokens", self.max_tokens, 1, MAX_MAX_TOKENS)
        self.max_tokens = int(self.max_tokens)
        self.stop_token_ids = check_token_ids("stop_token_ids", self.stop_token_ids, MAX_STOP_TOKEN_IDS)
        if not isinstance(self.stop, (list, tuple)):
            raise InvalidFieldError("stop", f"must be a string or a list of strings, got {type(self.stop).__name__}")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidFieldError("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise InvalidFieldError("stop", "must be a string or a list of non-empty strings")
        for i, s in enumerate(self.stop):
            if len(s) > MAX_STOP_CHARS:
                name = "stop" if self._single_stop else f"stop[{i}]"
                raise InvalidFieldError(name, f"at most {MAX_STOP_CHARS} characters, got {len(s)}")
        self.stop = list(self.stop)
        if not isinstance(self.ignore_eos, bool):
            raise InvalidFieldError("ignore_eos", f"must be a bool, got {type(self.ignore_eos).__name__}")
        if self.logprobs is not None:
            integer("logprobs", self.logprobs, 0, MAX_LOGPROBS)
            self.logprobs = int(self.logprobs)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
