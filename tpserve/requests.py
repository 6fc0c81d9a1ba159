"""What a request may hold: the limits and bounds every entry point enforces, in one place.

A request reaches the engine through the offline API (``LLM``, ``Engine.add_request``) or the
daemon's wire protocol; both check it here, so the two cannot disagree. docs/protocol.md
documents these numbers for clients. Bounds exist so that every value fits the fixed-width
arrays a step is built from (int32 token ids and top-k, int64 seeds) and every reply that
echoes a value can be encoded: a value outside them is an ``InvalidFieldError`` naming the
field, raised before anything is queued.

Two kinds of checks:

* shape and range, model-independent: ``SamplingParams`` validates its own fields with the
  bounds below at construction; ``check_prompt_shape`` checks a prompt;
* against the model (vocabulary size): ``check_request`` -- prompt and stop token ids must be
  token ids of the model.

Field names are the wire's: ``prompt``, ``prompt[3]``, ``params.stop_token_ids[0]``.
"""
from __future__ import annotations

import numbers
from typing import Any

import numpy as np

from tpserve.errors import InvalidFieldError

MAX_ID_CHARS = 128
MAX_PROMPT_CHARS = 1_000_000
MAX_PROMPT_TOKENS = 1_000_000
#: Token ids travel in int32 arrays; a model's vocabulary is usually far smaller.
MAX_TOKEN_ID = 2**31 - 1
#: top_k travels in an int32 array; any value >= the vocabulary size keeps every token.
MAX_TOP_K = 2**31 - 1
#: Also bounded by max_model_len at admission; this bound keeps prompt + max_tokens in int64.
MAX_MAX_TOKENS = 2**31 - 1
#: Seeds are mixed into a 63-bit counter-based RNG.
MAX_SEED = 2**63 - 1
MAX_TEMPERATURE = 100.0
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 256
# Most alternatives a request may ask logprobs for (the OpenAI API's top_logprobs limit).
MAX_LOGPROBS = 20

FINISH_REASONS = ("stop", "length", "abort")

# Shorter token-id arrays are checked item by item (numpy's set-up costs more than the loop).
_VECTOR_MIN = 256


def is_int(v: Any) -> bool:
    """An integer that is not a bool (numpy integers count)."""
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def check_token_ids(name: str, ids: Any, max_len: int, min_len: int = 0,
                    vocab_size: int | None = None) -> list[int]:
    """``ids`` as a list of ints in [0, vocab_size) (or [0, MAX_TOKEN_ID] without a vocabulary)."""
    if not isinstance(ids, (list, tuple)):
        raise InvalidFieldError(name, f"must be an array of token ids, got {type(ids).__name__}")
    if not min_len <= len(ids) <= max_len:
        raise InvalidFieldError(name, f"length must be in [{min_len}, {max_len}], got {len(ids)}")
    hi = MAX_TOKEN_ID if vocab_size is None else min(MAX_TOKEN_ID, vocab_size - 1)
    if len(ids) > _VECTOR_MIN and set(map(type, ids)) == {int}:
        # A long prompt is checked in a few C passes: a loop of Python comparisons over a
        # million ids holds the serving loop (and the GIL) for a second.
        try:
            arr = np.fromiter(ids, dtype=np.int64, count=len(ids))
        except OverflowError:
            arr = None  # an id beyond int64: the loop below names it
        if arr is not None:
            bad = np.flatnonzero((arr < 0) | (arr > hi))
            if bad.size:
                raise _not_a_token_id(name, int(bad[0]), ids[int(bad[0])], hi, vocab_size)
            return list(ids)
    for i, t in enumerate(ids):
        if not is_int(t) or not 0 <= t <= hi:
            raise _not_a_token_id(name, i, t, hi, vocab_size)
    return [int(t) for t in ids]


def _not_a_token_id(name: str, i: int, t: Any, hi: int, vocab_size: int | None) -> InvalidFieldError:
    where = "the vocabulary " if vocab_size is not None else ""
    return InvalidFieldError(f"{name}[{i}]", f"must be a token id of {where}in [0, {hi}], got {t!r}"[:512])


def check_prompt_shape(prompt: Any, name: str = "prompt") -> str | list[int]:
    """A non-empty string of at most MAX_PROMPT_CHARS, or 1..MAX_PROMPT_TOKENS token ids."""
    if isinstance(prompt, str):
        if not 1 <= len(prompt) <= MAX_PROMPT_CHARS:
            raise InvalidFieldError(name, f"length must be in [1, {MAX_PROMPT_CHARS}] characters, "
                                          f"got {len(prompt)}")
        return prompt
    if isinstance(prompt, (list, tuple)):
        return check_token_ids(name, prompt, MAX_PROMPT_TOKENS, min_len=1)
    raise InvalidFieldError(name, f"must be a string or an array of token ids, got {type(prompt).__name__}")


def check_request(prompt: Any, params, vocab_size: int | None) -> str | list[int]:
    """Check a request against the model: returns the prompt (token ids as plain ints).

    ``params`` is a SamplingParams (already range-checked at construction); its stop token ids
    must be < ``vocab_size`` too. ``vocab_size`` None skips the vocabulary checks.
    """
    prompt = check_prompt_shape(prompt)
    if isinstance(prompt, list) and vocab_size is not None:
        prompt = check_token_ids("prompt", prompt, MAX_PROMPT_TOKENS, 1, vocab_size)
    if vocab_size is not None and params is not None:
        check_token_ids("params.stop_token_ids", params.stop_token_ids, MAX_STOP_TOKEN_IDS,
                        vocab_size=vocab_size)
    return prompt
