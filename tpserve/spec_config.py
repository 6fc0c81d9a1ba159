"""SpeculativeConfig: the ``speculative_config`` engine option, with vLLM's keys and meanings.

    {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4,
     "prompt_lookup_min": 2, "disable_by_batch_size": 4}

``method`` "ngram" (prompt lookup) is the one proposer tpserve has. ``num_speculative_tokens``
(required) is the most draft tokens a sequence gets per step. The n-gram proposer matches the
longest suffix of a sequence's tokens of ``prompt_lookup_min`` to ``prompt_lookup_max`` tokens
against its earlier tokens (vLLM's defaults: both 5 when neither is given, else the one given).
``disable_by_batch_size``: a step whose decode rows number more than this proposes no drafts,
because verifying drafts costs compute that a large batch no longer has to spare (see
DEFAULT_DISABLE_BY_BATCH_SIZE). vLLM leaves it unset (never disabled); tpserve's default is
measured, and ``null`` turns the limit off.

Mixtures of experts keep the same default. Verifying k drafts there touches more experts
(each of a row's 1 + k queries picks its own top-k), and scripts/bench_verify_cost.py measured
what that costs (docs/performance.md): on a Qwen3-MoE shape (128 experts, top-8) a verify step
with k=4 costs 2.2-2.4x a plain decode step at batch 1-8, against 1.7x at batch 1 rising to 3.0x
at batch 8 on the dense 0.6B shape; the break-even acceptance lengths meet at the limit (2.37
and 2.35 tokens per step at batch 4). At every batch size the rule lets speculate, MoE's
break-even (2.2-2.37) is no higher than the dense model's at the limit, so drafts that pay on
a dense model at the limit pay on MoE wherever they are proposed; above the limit MoE's cost
stays flat (2.4x at batch 8), so a workload with high acceptance may raise the limit there.

Parsing raises ConfigError naming ``speculative_config.<key>``; an unknown key is an error,
never ignored. Nothing here imports torch: the scheduler reads it.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from tpserve.errors import ConfigError

METHODS = ("ngram",)
# Keys vLLM defines for other methods (draft models, EAGLE, MTP, suffix decoding): named in
# the error so that a vLLM configuration fails with a reason rather than "unknown key".
_OTHER_METHODS_KEYS = ("model", "draft_tensor_parallel_size", "quantization", "max_model_len",
                       "revision", "code_revision", "speculative_token_tree", "parallel_drafting",
                       "disable_padded_drafter_batch")
# Measured with scripts/bench_spec.py --sweep (copy-heavy decode, k=4, bf16, 2 CPU cores): with
# drafts at every batch size the 40M model gains up to 8 streams (1.11x at 8) but the 0.6B shape
# only up to 4 (2.97x at 1, 1.50x at 2, 0.97x at 4, 0.85x at 8, 0.79x at 32); 4 keeps both from
# losing where verification no longer pays.
DEFAULT_DISABLE_BY_BATCH_SIZE = 4
# An upper bound that keeps one step's verification rows and the draft search small.
MAX_SPECULATIVE_TOKENS = 32
MAX_LOOKUP = 64


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int
    prompt_lookup_min: int
    disable_by_batch_size: int | None = DEFAULT_DISABLE_BY_BATCH_SIZE

    @classmethod
    def from_dict(cls, d) -> "SpeculativeConfig":
        """Validate a ``speculative_config`` map (vLLM's keys); fills vLLM's defaults."""
        name = "speculative_config"
        if not isinstance(d, dict):
            raise ConfigError(name, f"must be a map such as {{\"method\": \"ngram\", "
                              f"\"num_speculative_tokens\": 4}}, got {type(d).__name__}")
        known = {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
                 "disable_by_batch_size"}
        for key in d:
            if key in known:
                continue
            if key in _OTHER_METHODS_KEYS:
                raise ConfigError(f"{name}.{key}", "is not supported: tpserve speculates with "
                                  "the ngram method only, which needs no draft model")
            raise ConfigError(f"{name}.{key}", "is not a speculative_config key; known: "
                              + ", ".join(sorted(known)))
        method = d.get("method", "ngram")
        if method == "[ngram]":  # vLLM's older spelling
            method = "ngram"
        if method not in METHODS:
            raise ConfigError(f"{name}.method", f"must be one of {', '.join(METHODS)}, got {method!r}")
        if "num_speculative_tokens" not in d:
            raise ConfigError(f"{name}.num_speculative_tokens", "is required (the most draft "
                              "tokens proposed per sequence and step)")
        k = _int(d, "num_speculative_tokens", 1, MAX_SPECULATIVE_TOKENS)
        lo = _int(d, "prompt_lookup_min", 1, MAX_LOOKUP) if d.get("prompt_lookup_min") is not None else None
        hi = _int(d, "prompt_lookup_max", 1, MAX_LOOKUP) if d.get("prompt_lookup_max") is not None else None
        if lo is None and hi is None:
            lo = hi = 5
        lo = hi if lo is None else lo
        hi = lo if hi is None else hi
        if lo > hi:
            raise ConfigError(f"{name}.prompt_lookup_min",
                              f"{lo} must be <= prompt_lookup_max ({hi})")
        limit = d.get("disable_by_batch_size", DEFAULT_DISABLE_BY_BATCH_SIZE)
        if limit is not None:
            limit = _int({"disable_by_batch_size": limit}, "disable_by_batch_size", 1, None)
        return cls(method, k, hi, lo, limit)

    def to_dict(self) -> dict:
        return asdict(self)

    def speculates(self, num_decodes: int) -> bool:
        """Whether a step with ``num_decodes`` decode rows proposes drafts."""
        return 0 < num_decodes and (self.disable_by_batch_size is None
                                    or num_decodes <= self.disable_by_batch_size)


def _int(d: dict, key: str, lo: int, hi: int | None) -> int:
    v = d[key]
    if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
        bound = f"an integer >= {lo}" if hi is None else f"an integer in [{lo}, {hi}]"
        raise ConfigError(f"speculative_config.{key}", f"must be {bound}, got {v!r}")
    return v
