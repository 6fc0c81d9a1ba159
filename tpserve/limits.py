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

import array
import json
import math
import numbers
from typing import Any

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
#: Completions per prompt (``n``).
MAX_N = 16
#: presence/frequency penalties: OpenAI's range.
MAX_ABS_PENALTY = 2.0
#: repetition_penalty is in (0, MAX_REPETITION_PENALTY]; 1 disables it.
MAX_REPETITION_PENALTY = 10.0
#: logit_bias values: OpenAI's range; at most MAX_LOGIT_BIAS tokens per request.
MAX_ABS_LOGIT_BIAS = 100.0
MAX_LOGIT_BIAS = 1024
MAX_ALLOWED_TOKEN_IDS = 1 << 16
MAX_BAD_WORDS = 64
MAX_BAD_WORD_CHARS = 256
#: structured_outputs: the text of a schema, regex or grammar; the number and size of choices.
MAX_GRAMMAR_CHARS = 1 << 20
MAX_CHOICES = 1024
MAX_CHOICE_CHARS = 4096

#: Request priorities (lower is served first, under the "priority" scheduling order): vLLM
#: takes any integer; these bounds keep it an int32.
MIN_PRIORITY = -(2**31)
MAX_PRIORITY = 2**31 - 1
#: A request's timeout, seconds (about 11.5 days).
MAX_TIMEOUT = 1_000_000.0

#: "error": the request could not go on (e.g. its logits controls left no token to sample).
#: "timeout": its timeout passed before it finished.
FINISH_REASONS = ("stop", "length", "abort", "error", "timeout")

# Shorter token-id arrays are checked item by item (numpy's set-up costs more than the loop).
_VECTOR_MIN = 256


def is_int(v: Any) -> bool:
    """An integer that is not a bool (numpy integers count)."""
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def check_token_ids(name: str, ids: Any, max_len: int, min_len: int = 0,
                    vocab_size: int | None = None) -> list[int]:
    """``ids`` as a list of ints in [0, vocab_size) (or [0, MAX_TOKEN_ID] without a vocabulary).

    ``ids`` may also be an ``array.array("i")``, as the tokenizer process gives a long text's
    ids (check_packed_ids).
    """
    if isinstance(ids, array.array) and ids.typecode == "i":
        return check_packed_ids(name, ids, max_len, min_len, vocab_size).tolist()
    if not isinstance(ids, (list, tuple)):
        raise InvalidFieldError(name, f"must be an array of token ids, got {type(ids).__name__}")
    if not min_len <= len(ids) <= max_len:
        raise InvalidFieldError(name, f"length must be in [{min_len}, {max_len}], got {len(ids)}")
    hi = MAX_TOKEN_ID if vocab_size is None else min(MAX_TOKEN_ID, vocab_size - 1)
    if len(ids) > _VECTOR_MIN and set(map(type, ids)) == {int}:
        # A long prompt is checked in a few C passes: a loop of Python comparisons over a
        # million ids holds the serving loop (and the GIL) for a second. numpy is imported here,
        # not with the module: the CLI and the client import this module and stay light.
        import numpy as np
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
    where = " of the vocabulary" if vocab_size is not None else ""
    return InvalidFieldError(f"{name}[{i}]", f"must be a token id{where} in [0, {hi}], got {t!r}"[:512])


def check_packed_ids(name: str, ids: array.array, max_len: int, min_len: int = 0,
                     vocab_size: int | None = None) -> array.array:
    """``ids`` (an ``array.array("i")``) checked as check_token_ids checks a list, in one
    vectorized pass with no Python int looked at; returns it."""
    if not min_len <= len(ids) <= max_len:
        raise InvalidFieldError(name, f"length must be in [{min_len}, {max_len}], got {len(ids)}")
    hi = MAX_TOKEN_ID if vocab_size is None else min(MAX_TOKEN_ID, vocab_size - 1)
    import numpy as np  # here, not with the module (see check_token_ids)
    arr = np.frombuffer(ids, dtype=np.int32) if len(ids) else np.zeros(0, np.int32)
    bad = np.flatnonzero((arr < 0) | (arr > hi))
    if bad.size:
        raise _not_a_token_id(name, int(bad[0]), int(arr[bad[0]]), hi, vocab_size)
    return ids


def check_prompt_shape(prompt: Any, name: str = "prompt") -> str | list[int]:
    """A non-empty string of at most MAX_PROMPT_CHARS, or 1..MAX_PROMPT_TOKENS token ids."""
    if isinstance(prompt, str):
        if not 1 <= len(prompt) <= MAX_PROMPT_CHARS:
            raise InvalidFieldError(name, f"length must be in [1, {MAX_PROMPT_CHARS}] characters, "
                                          f"got {len(prompt)}")
        return prompt
    if isinstance(prompt, (list, tuple, array.array)):
        return check_token_ids(name, prompt, MAX_PROMPT_TOKENS, min_len=1)
    raise InvalidFieldError(name, f"must be a string or an array of token ids, got {type(prompt).__name__}")


def check_request(prompt: Any, params, vocab_size: int | None) -> str | list[int]:
    """Check a request against the model: returns the prompt (token ids as plain ints).

    ``params`` is a SamplingParams (already range-checked at construction); its token ids
    (stop_token_ids, logit_bias keys, allowed_token_ids) must be < ``vocab_size`` too.
    ``vocab_size`` None skips the vocabulary checks.
    """
    if isinstance(prompt, (list, tuple, array.array)) and vocab_size is not None:
        # the shape and the vocabulary in one pass: a million ids take ~15 ms a pass, on the
        # daemon's serving loop
        prompt = check_token_ids("prompt", prompt, MAX_PROMPT_TOKENS, 1, vocab_size)
    else:
        prompt = check_prompt_shape(prompt)
    if vocab_size is not None and params is not None:
        check_token_ids("params.stop_token_ids", params.stop_token_ids, MAX_STOP_TOKEN_IDS,
                        vocab_size=vocab_size)
        if params.logit_bias:
            check_token_ids("params.logit_bias", list(params.logit_bias), MAX_LOGIT_BIAS,
                            vocab_size=vocab_size)
        if params.allowed_token_ids is not None:
            check_token_ids("params.allowed_token_ids", params.allowed_token_ids,
                            MAX_ALLOWED_TOKEN_IDS, 1, vocab_size)
    return prompt


def check_priority(value: Any, name: str = "priority") -> int:
    """A request's priority: an integer in [MIN_PRIORITY, MAX_PRIORITY] (lower first)."""
    return _integer(name, value, MIN_PRIORITY, MAX_PRIORITY)


def check_timeout(value: Any, name: str = "timeout") -> float | None:
    """A request's timeout in seconds: None (no limit) or a number in (0, MAX_TIMEOUT]."""
    if value is None:
        return None
    return _number(name, value, 0.0, MAX_TIMEOUT, lo_open=True)


# ---- sampling parameters -------------------------------------------------------------------------
def _number(name: str, value: Any, lo: float, hi: float, lo_open: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidFieldError(name, f"must be a number, got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value):
        raise InvalidFieldError(name, f"must be finite, got {value}")
    if not (lo < value if lo_open else lo <= value) or not value <= hi:
        raise InvalidFieldError(name, f"must be in {'(' if lo_open else '['}{lo:g}, {hi:g}], got {value:g}")
    return value


def _integer(name: str, value: Any, lo: int, hi: int, what: str = "") -> int:
    if not is_int(value):
        raise InvalidFieldError(name, f"must be an integer, got {type(value).__name__}")
    if not lo <= value <= hi:
        raise InvalidFieldError(name, f"must be in [{lo}, {hi}]{what}, got {value}")
    return int(value)


def _boolean(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise InvalidFieldError(name, f"must be a bool, got {type(value).__name__}")
    return value


def _strings(name: str, value: Any, max_count: int, max_chars: int) -> list[str]:
    if not isinstance(value, (list, tuple)):
        raise InvalidFieldError(name, f"must be a list of strings, got {type(value).__name__}")
    if len(value) > max_count:
        raise InvalidFieldError(name, f"at most {max_count} strings, got {len(value)}")
    for i, s in enumerate(value):
        if not isinstance(s, str) or not s:
            raise InvalidFieldError(f"{name}[{i}]", "must be a non-empty string")
        if len(s) > max_chars:
            raise InvalidFieldError(f"{name}[{i}]", f"at most {max_chars} characters, got {len(s)}")
        check_text(f"{name}[{i}]", s)
    return list(value)


def check_text(name: str, s: str) -> str:
    """Text must be encodable as UTF-8 (no lone surrogates, which JSON escapes can carry)."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidFieldError(name, f"is not valid Unicode text (a lone surrogate at {e.start})") from None
    return s


def _logit_bias(value: Any) -> dict[int, float] | None:
    """token id (int, or its decimal string as JSON spells map keys) -> bias in [-100, 100]."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise InvalidFieldError("logit_bias", f"must be a map of token id to bias, got {type(value).__name__}")
    if len(value) > MAX_LOGIT_BIAS:
        raise InvalidFieldError("logit_bias", f"at most {MAX_LOGIT_BIAS} tokens, got {len(value)}")
    out: dict[int, float] = {}
    for key, bias in value.items():
        tok = key
        if isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 10:
            tok = int(key)
        if not is_int(tok) or not 0 <= tok <= MAX_TOKEN_ID:
            raise InvalidFieldError("logit_bias", f"keys must be token ids in [0, {MAX_TOKEN_ID}], "
                                                  f"got {key!r}"[:200])
        out[int(tok)] = _number(f"logit_bias[{int(tok)}]", bias, -MAX_ABS_LOGIT_BIAS, MAX_ABS_LOGIT_BIAS)
    return out


def _json_schema(name: str, value: Any) -> str | dict:
    """A JSON schema object, as a dict or its JSON text (at most MAX_GRAMMAR_CHARS). Text is not
    parsed here (a megabyte of it takes ~50 ms, and this check runs where a request arrives,
    e.g. on the daemon's serving loop): it must look like an object; the grammar process parses
    it (tpserve/grammar) and refuses text that is not JSON with this field's name."""
    if isinstance(value, str):
        if len(value) > MAX_GRAMMAR_CHARS:
            raise InvalidFieldError(name, f"at most {MAX_GRAMMAR_CHARS} characters, got {len(value)}")
        body = value.strip()
        parsed = {} if body.startswith("{") and body.endswith("}") else None
        if parsed is None:
            raise InvalidFieldError(name, "must be a JSON schema object ({...}) or its JSON text")
    elif isinstance(value, dict):
        parsed = value
        try:
            text = json.dumps(value, allow_nan=False)
        except RecursionError:
            raise InvalidFieldError(name, "is nested too deeply") from None
        except (TypeError, ValueError) as e:
            raise InvalidFieldError(name, f"is not a JSON value: {e}"[:512]) from None
        if len(text) > MAX_GRAMMAR_CHARS:
            raise InvalidFieldError(name, f"at most {MAX_GRAMMAR_CHARS} characters as JSON, got {len(text)}")
    else:
        raise InvalidFieldError(name, f"must be a JSON schema (an object or its JSON text), "
                                      f"got {type(value).__name__}")
    if not isinstance(parsed, dict):
        raise InvalidFieldError(name, f"must be a JSON schema object, got {type(parsed).__name__}")
    return value


def _grammar_text(name: str, value: Any) -> str:
    if not isinstance(value, str):
        raise InvalidFieldError(name, f"must be a string, got {type(value).__name__}")
    if not 1 <= len(value) <= MAX_GRAMMAR_CHARS:
        raise InvalidFieldError(name, f"length must be in [1, {MAX_GRAMMAR_CHARS}] characters, got {len(value)}")
    return check_text(name, value)


#: The constraints of StructuredOutputsParams; exactly one is set.
STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")


def check_structured(so, name: str = "structured_outputs") -> None:
    """Validate a StructuredOutputsParams ``so`` in place: exactly one constraint, each within
    its bounds. Whether a schema, regex or grammar compiles is the grammar engine's answer
    (tpserve/grammar), reported with the same field names."""
    given = [k for k in STRUCTURED_KINDS if getattr(so, k) is not None]
    if len(given) != 1:
        raise InvalidFieldError(name, f"exactly one of {', '.join(STRUCTURED_KINDS)} must be set, "
                                      f"got {', '.join(given) if given else 'none'}")
    kind = given[0]
    where = f"{name}.{kind}"
    if kind == "json":
        so.json = _json_schema(where, so.json)
    elif kind in ("regex", "grammar"):
        setattr(so, kind, _grammar_text(where, getattr(so, kind)))
    elif kind == "choice":
        if not isinstance(so.choice, (list, tuple)):
            raise InvalidFieldError(where, f"must be a list of strings, got {type(so.choice).__name__}")
        if not 1 <= len(so.choice) <= MAX_CHOICES:
            raise InvalidFieldError(where, f"must hold 1 to {MAX_CHOICES} strings, got {len(so.choice)}")
        for i, c in enumerate(so.choice):
            if not isinstance(c, str) or not c:
                raise InvalidFieldError(f"{where}[{i}]", "must be a non-empty string")
            if len(c) > MAX_CHOICE_CHARS:
                raise InvalidFieldError(f"{where}[{i}]", f"at most {MAX_CHOICE_CHARS} characters, got {len(c)}")
            check_text(f"{where}[{i}]", c)
        so.choice = list(so.choice)
    elif so.json_object is not True:
        raise InvalidFieldError(where, f"must be true when set (any JSON object), got {so.json_object!r}")
    for flag in ("disable_any_whitespace", "disable_additional_properties", "disable_fallback"):
        _boolean(f"{name}.{flag}", getattr(so, flag))
    if so.whitespace_pattern is not None:
        if kind not in ("json", "json_object"):
            raise InvalidFieldError(f"{name}.whitespace_pattern", "applies to json and json_object only")
        so.whitespace_pattern = _grammar_text(f"{name}.whitespace_pattern", so.whitespace_pattern)


def check_sampling(p) -> None:
    """Validate and normalise every field of the SamplingParams ``p`` in place (bounds above).

    Raises InvalidFieldError naming the first bad field (``stop[1]``, ``logit_bias[7]``, ...).
    ``structured_outputs`` is already a StructuredOutputsParams here (sampling.py builds it from
    a map and validates it with ``check_structured``): this module imports nothing of sampling.py.
    """
    p.temperature = _number("temperature", p.temperature, 0.0, MAX_TEMPERATURE)
    p.top_p = _number("top_p", p.top_p, 0.0, 1.0, lo_open=True)
    p.top_k = _integer("top_k", p.top_k, -1, MAX_TOP_K, " (-1 or 0 disable it)")
    p.min_p = _number("min_p", p.min_p, 0.0, 1.0)
    if p.seed is not None:
        p.seed = _integer("seed", p.seed, 0, MAX_SEED)
    p.n = _integer("n", p.n, 1, MAX_N)
    if p.max_tokens is not None:  # None: the rest of the context, resolved once the prompt is tokenized
        p.max_tokens = _integer("max_tokens", p.max_tokens, 0, MAX_MAX_TOKENS, " (0: score the prompt only)")
    p.min_tokens = _integer("min_tokens", p.min_tokens, 0, MAX_MAX_TOKENS)
    if p.max_tokens is not None and p.min_tokens > p.max_tokens:
        raise InvalidFieldError("min_tokens", f"must be at most max_tokens ({p.max_tokens}), got {p.min_tokens}")
    p.presence_penalty = _number("presence_penalty", p.presence_penalty, -MAX_ABS_PENALTY, MAX_ABS_PENALTY)
    p.frequency_penalty = _number("frequency_penalty", p.frequency_penalty, -MAX_ABS_PENALTY, MAX_ABS_PENALTY)
    p.repetition_penalty = _number("repetition_penalty", p.repetition_penalty, 0.0, MAX_REPETITION_PENALTY,
                                   lo_open=True)
    p.stop_token_ids = check_token_ids("stop_token_ids", p.stop_token_ids, MAX_STOP_TOKEN_IDS)
    if isinstance(p.stop, str):  # one stop string: errors name "stop", not "stop[0]"
        try:
            p.stop = _strings("stop", [p.stop], 1, MAX_STOP_CHARS)
        except InvalidFieldError as e:
            raise InvalidFieldError("stop", e.reason) from None
    p.stop = _strings("stop", p.stop, MAX_STOP_STRINGS, MAX_STOP_CHARS)
    p.bad_words = _strings("bad_words", p.bad_words, MAX_BAD_WORDS, MAX_BAD_WORD_CHARS)
    for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens",
                 "spaces_between_special_tokens"):
        _boolean(name, getattr(p, name))
    if p.logprobs is not None:
        p.logprobs = _integer("logprobs", p.logprobs, 0, MAX_LOGPROBS)
    if p.prompt_logprobs is not None:
        p.prompt_logprobs = _integer("prompt_logprobs", p.prompt_logprobs, 0, MAX_LOGPROBS)
    if p.truncate_prompt_tokens is not None:
        p.truncate_prompt_tokens = _integer("truncate_prompt_tokens", p.truncate_prompt_tokens, 1,
                                            MAX_PROMPT_TOKENS)
    p.logit_bias = _logit_bias(p.logit_bias) or None
    if p.allowed_token_ids is not None:
        p.allowed_token_ids = check_token_ids("allowed_token_ids", p.allowed_token_ids,
                                              MAX_ALLOWED_TOKEN_IDS, min_len=1)
    if p.structured_outputs is not None and not hasattr(p.structured_outputs, "kind"):
        raise InvalidFieldError("structured_outputs", "must be a StructuredOutputsParams or a map of its fields, "
                                                      f"got {type(p.structured_outputs).__name__}")
