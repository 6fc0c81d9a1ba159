"""SamplingParams: per-request decoding options, named as in vLLM."""
from __future__ import annotations

from dataclasses import dataclass, field

from tpserve.errors import ConfigError

# Largest seed accepted; seeds are mixed into a 63-bit counter-based RNG.
MAX_SEED = 2**63 - 1
# Most alternatives a request may ask logprobs for (the OpenAI API's top_logprobs limit).
MAX_LOGPROBS = 20


@dataclass
class SamplingParams:
    """How to pick each next token of one request.

    temperature 0 means greedy. ``top_k`` <= 0 (or -1, vLLM's spelling) disables top-k;
    ``top_p`` 1.0 disables nucleus sampling. With ``seed`` set, the sampled tokens depend only
    on the seed, the model and the prompt -- not on which other requests share the batch.
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
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if self.stop is None:
            self.stop = []
        self.validate()

    def validate(self) -> None:
        def num(name, value, kinds=(int, float)):
            if isinstance(value, bool) or not isinstance(value, kinds):
                raise ConfigError(name, f"must be a number, got {type(value).__name__}")

        num("temperature", self.temperature)
        if not 0.0 <= self.temperature <= 100.0:
            raise ConfigError("temperature", f"must be in [0, 100], got {self.temperature}")
        num("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError("top_p", f"must be in (0, 1], got {self.top_p}")
        num("top_k", self.top_k, (int,))
        if self.top_k < -1:
            raise ConfigError("top_k", f"must be -1 (disabled), 0 (disabled) or positive, got {self.top_k}")
        if self.seed is not None:
            num("seed", self.seed, (int,))
            if not 0 <= self.seed <= MAX_SEED:
                raise ConfigError("seed", f"must be in [0, 2**63-1], got {self.seed}")
        num("max_tokens", self.max_tokens, (int,))
        if self.max_tokens < 1:
            raise ConfigError("max_tokens", f"must be >= 1, got {self.max_tokens}")
        if not isinstance(self.stop_token_ids, (list, tuple)) or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids):
            raise ConfigError("stop_token_ids", "must be a list of non-negative ints")
        self.stop_token_ids = list(self.stop_token_ids)
        if not isinstance(self.stop, (list, tuple)) or not all(
                isinstance(s, str) and s for s in self.stop):
            raise ConfigError("stop", "must be a string or a list of non-empty strings")
        self.stop = list(self.stop)
        if not isinstance(self.ignore_eos, bool):
            raise ConfigError("ignore_eos", f"must be a bool, got {type(self.ignore_eos).__name__}")
        if self.logprobs is not None:
            num("logprobs", self.logprobs, (int,))
            if not 0 <= self.logprobs <= MAX_LOGPROBS:
                raise ConfigError("logprobs", f"must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
