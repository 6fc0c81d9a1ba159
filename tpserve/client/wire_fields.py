"""The fields of the wire protocol's messages: limits, error codes and validators.

Every field of a message (tpserve/client/protocol.py) is checked by a validator here:
``(field name, value) -> normalized value``, raising ``ProtocolError(code, field, message)``.
The request limits are tpserve.limits' (the offline API enforces the same), re-exported here
because they are part of the wire contract; a generate's ``params`` map is checked by the
request model (tpserve/request.py) with the wire's spelling (``ZMQ``: ``params.<key>``).
docs/protocol.md documents every bound.
"""
from __future__ import annotations

import array
import json
import sys
from dataclasses import fields as dc_fields
from typing import Any, Callable

from tpserve import limits as R
from tpserve.errors import InvalidFieldError, TpserveError
from tpserve.request import ZMQ_PARAMS_PREFIX, Api
from tpserve.request import sampling_params as request_sampling_params
from tpserve.sampling import MAX_LOGPROBS, SamplingParams, StructuredOutputsParams

# ---- limits ------------------------------------------------------------------------------
#: Frames larger than this are dropped by ZMQ (MAXMSGSIZE) and the sending peer is disconnected.
MAX_MESSAGE_BYTES = 8 * 1024 * 1024
MAX_MESSAGE_CHARS = 4096  # error messages
MAX_STATUS_ENTRIES = 64
MAX_CODE_CHARS = 64
#: The most entries of one wire map. Above the largest map a request may carry (``logit_bias``,
#: MAX_LOGIT_BIAS), with room for a map somewhat over its bound to reach its field check and be
#: answered ``invalid_field`` naming it: no layer below a documented bound is stricter than it
#: (tests/test_bounds.py). Bounded, as a huge map costs seconds of the serving loop to build.
MAX_MAP_ENTRIES = 4 * R.MAX_LOGIT_BIAS
#: How deep maps and arrays nest in a frame: msgpack-python's own (compiled) limit. Only a
#: ``structured_outputs.json`` schema sent as a map comes near it (3 levels down: message,
#: params, structured_outputs); a deeper schema travels as text (docs/protocol.md).
MAX_NESTING = 1024
# Request limits are tpserve.limits' (the offline API enforces the same); re-exported here
# because they are part of the wire contract.
MAX_ID_CHARS = R.MAX_ID_CHARS
MAX_PROMPT_CHARS = R.MAX_PROMPT_CHARS
MAX_PROMPT_TOKENS = R.MAX_PROMPT_TOKENS
MAX_TOKEN_ID = R.MAX_TOKEN_ID
# The ids one ``tokens`` reply carries: 4 bytes each within a frame (a million-character text
# gives ~360k ids of an English BPE vocabulary, at most 4M of a byte-level one).
MAX_TOKENIZED_IDS = (MAX_MESSAGE_BYTES - 4096) // 4
MAX_STOP_STRINGS = R.MAX_STOP_STRINGS
MAX_STOP_CHARS = R.MAX_STOP_CHARS
MAX_N = R.MAX_N
MAX_STOP_TOKEN_IDS = R.MAX_STOP_TOKEN_IDS
FINISH_REASONS = R.FINISH_REASONS
MAX_METRICS_CHARS = 4 * 1024 * 1024  # Prometheus text exposition
ABORT_REASONS = ("client", "shutting_down")

# ---- error codes -------------------------------------------------------------------------
BAD_MESSAGE = "bad_message"                  # not one frame of msgpack holding a map
UNSUPPORTED_VERSION = "unsupported_version"  # v is not PROTOCOL_VERSION
UNKNOWN_TYPE = "unknown_type"
UNKNOWN_FIELD = "unknown_field"
MISSING_FIELD = "missing_field"
INVALID_FIELD = "invalid_field"              # wrong type, out of range, too long
DUPLICATE_ID = "duplicate_id"                # id already in flight on this connection
UNKNOWN_ID = "unknown_id"                    # abort of an id not in flight on this connection
ADMISSION = "admission"                      # the engine can never schedule this request
INVALID_REQUEST = "invalid_request"          # well-formed, but the engine refused it (e.g. empty after tokenizing)
SHUTTING_DOWN = "shutting_down"              # daemon is stopping; no new requests
OVERLOADED = "overloaded"                    # the waiting queue is full; retry after retry_after s
STEP_FAILED = "step_failed"                  # an engine step failed for this request; the daemon serves on
TOO_MANY_REQUESTS = "too_many_requests"      # the connection has its maximum of requests in flight
INTERNAL = "internal"                        # engine failure; the daemon is going down
ERROR_CODES = (BAD_MESSAGE, UNSUPPORTED_VERSION, UNKNOWN_TYPE, UNKNOWN_FIELD, MISSING_FIELD,
               INVALID_FIELD, DUPLICATE_ID, UNKNOWN_ID, ADMISSION, INVALID_REQUEST, SHUTTING_DOWN, OVERLOADED,
               STEP_FAILED, TOO_MANY_REQUESTS, INTERNAL)


class ProtocolError(TpserveError, ValueError):
    """A frame that is not a valid protocol message. ``field`` is None for frame-level faults."""

    def __init__(self, code: str, field: str | None, message: str):
        self.code = code
        self.field = field
        self.message = message
        super().__init__(f"{code}: {field}: {message}" if field else f"{code}: {message}")


# ---- field validators: (field name, value) -> normalized value, or ProtocolError -------------
Validator = Callable[[str, Any], Any]


def invalid(name: str, message: str) -> ProtocolError:
    return ProtocolError(INVALID_FIELD, name, message)


def field_name(key) -> str:
    """A map key as it appears in an error's ``field`` (keys may be bytes or absurdly long)."""
    return (key if isinstance(key, str) else repr(key))[:128]


def is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def text(max_chars: int, min_chars: int = 0) -> Validator:
    def check(name, v):
        if not isinstance(v, str):
            raise invalid(name, f"must be a string, got {type(v).__name__}")
        if not min_chars <= len(v) <= max_chars:
            raise invalid(name, f"length must be in [{min_chars}, {max_chars}] characters, got {len(v)}")
        return v
    return check


def integer(lo: int, hi: int) -> Validator:
    def check(name, v):
        if not is_int(v):
            raise invalid(name, f"must be an integer, got {type(v).__name__}")
        if not lo <= v <= hi:
            raise invalid(name, f"must be in [{lo}, {hi}], got {v}")
        return v
    return check


def number(lo: float, hi: float) -> Validator:
    def check(name, v):
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise invalid(name, f"must be a number, got {type(v).__name__}")
        if not lo <= v <= hi:
            raise invalid(name, f"must be in [{lo:g}, {hi:g}], got {v}")
        return v
    return check


def boolean(name, v):
    if not isinstance(v, bool):
        raise invalid(name, f"must be a boolean, got {type(v).__name__}")
    return v


def one_of(choices: tuple[str, ...]) -> Validator:
    def check(name, v):
        if v not in choices:
            raise invalid(name, f"must be one of {', '.join(choices)}, got {v!r}")
        return v
    return check


def token_ids(max_len: int, min_len: int = 0) -> Validator:
    def check(name, v):
        return _wire(R.check_token_ids, name, v, max_len, min_len)
    return check


def packed_token_ids(max_len: int) -> Validator:
    """Token ids packed as int32 little-endian: ``bin`` on the wire, an ``array.array("i")``
    in a message (a list is packed). A million ids cost a memcpy and one vectorized range
    check instead of a million msgpack integers and their checks."""
    def check(name, v):
        if isinstance(v, (bytes, bytearray, memoryview)):
            if len(v) % 4:
                raise invalid(name, f"must be int32 little-endian token ids, got {len(v)} bytes")
            ids = array.array("i")
            ids.frombytes(v)
            v = _native(ids)
        elif isinstance(v, (list, tuple)):
            v = array.array("i", _wire(R.check_token_ids, name, v, max_len))
        elif not (isinstance(v, array.array) and v.typecode == "i"):
            raise invalid(name, f"must be packed token ids (bin), got {type(v).__name__}")
        return _wire(R.check_packed_ids, name, v, max_len)
    return check


def _native(ids: array.array) -> array.array:
    """Little-endian int32 ids in this machine's order (in place)."""
    assert ids.itemsize == 4
    if sys.byteorder != "little":
        ids.byteswap()
    return ids


def packed(ids: array.array) -> bytes:
    return _native(array.array("i", ids)).tobytes() if sys.byteorder != "little" else ids.tobytes()


def _wire(check, *args):
    """Run a tpserve.limits check; its InvalidFieldError becomes the wire's invalid_field."""
    try:
        return check(*args)
    except InvalidFieldError as e:
        raise invalid(e.field, e.reason) from None


def priority(name, v):
    """A request's priority (tpserve.limits bounds); lower is served first."""
    return _wire(R.check_priority, v, name)


def timeout(name, v):
    """A request's timeout in seconds (tpserve.limits bounds)."""
    return _wire(R.check_timeout, v, name)


def nullable(inner: Validator) -> Validator:
    def check(name, v):
        return None if v is None else inner(name, v)
    return check


def logprobs_list(name, v):
    """Per token: ``[logprob, [[token id, logprob], ...]]`` with at most MAX_LOGPROBS pairs."""
    if not isinstance(v, (list, tuple)):
        raise invalid(name, f"must be an array of [logprob, top] entries, got {type(v).__name__}")
    out = []
    for i, entry in enumerate(v):
        where = f"{name}[{i}]"
        if not (isinstance(entry, (list, tuple)) and len(entry) == 2 and _is_number(entry[0])
                and isinstance(entry[1], (list, tuple)) and len(entry[1]) <= MAX_LOGPROBS):
            raise invalid(where, f"must be [logprob, [[token id, logprob], ...]] with at most "
                              f"{MAX_LOGPROBS} pairs")
        top = []
        for pair in entry[1]:
            if not (isinstance(pair, (list, tuple)) and len(pair) == 2 and is_int(pair[0])
                    and 0 <= pair[0] <= MAX_TOKEN_ID and _is_number(pair[1])):
                raise invalid(where, f"each top entry must be [token id, logprob], got {pair!r}"[:256])
            top.append([pair[0], float(pair[1])])
        out.append([float(entry[0]), top])
    return out


def prompt_logprobs_list(name, v):
    """Per prompt token: nil for the first, then ``[logprob, [[token id, logprob], ...]]``."""
    if not isinstance(v, (list, tuple)) or not v or v[0] is not None:
        raise invalid(name, "must be an array starting with nil (the first prompt token has none)")
    return [None] + logprobs_list(name, v[1:])


def completions_list(name, v):
    """The completions of an ``n`` > 1 request (done): maps of index, finish_reason,
    completion_tokens and, for a request that was not streamed, text, token_ids, logprobs."""
    if not isinstance(v, (list, tuple)) or len(v) > MAX_N:
        raise invalid(name, f"must be an array of at most {MAX_N} completion maps")
    out = []
    for i, c in enumerate(v):
        where = f"{name}[{i}]"
        if not isinstance(c, dict):
            raise invalid(where, f"must be a map, got {type(c).__name__}")
        item = {"index": integer(0, MAX_N - 1)(f"{where}.index", c.get("index")),
                "finish_reason": one_of(FINISH_REASONS)(f"{where}.finish_reason", c.get("finish_reason")),
                "completion_tokens": count(f"{where}.completion_tokens", c.get("completion_tokens"))}
        for key, check in (("text", text(2**31)), ("token_ids", token_ids(2**31)), ("logprobs", logprobs_list)):
            if c.get(key) is not None:
                item[key] = check(f"{where}.{key}", c[key])
        out.append(item)
    return out


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


request_id = text(MAX_ID_CHARS, min_chars=1)
count = integer(0, 2**63 - 1)


def prompt(name, v):
    """A prompt is a non-empty string or a non-empty array of token ids."""
    return _wire(R.check_prompt_shape, v, name)


SAMPLING_FIELDS = tuple(f.name for f in dc_fields(SamplingParams))
#: How the wire spells a request (tpserve/request.py): sampling fields nested under ``params``;
#: ``max_tokens`` left out of the map is 16, nil is the rest of the context.
ZMQ = Api("zmq", SamplingParams.max_tokens, params_prefix=ZMQ_PARAMS_PREFIX)


def sampling_params(name, v):
    """A map of SamplingParams fields (any subset; the rest take SamplingParams' defaults).

    The checks are the request model's (tpserve/request.py, the bounds of tpserve.limits);
    this only adds the wire's error codes. ``structured_outputs`` is a map of
    StructuredOutputsParams fields.
    """
    if isinstance(v, SamplingParams):
        return v  # validated when it was constructed (tpserve.limits): not rebuilt here
    if not isinstance(v, dict):
        raise invalid(name, f"must be a map of sampling parameters, got {type(v).__name__}")
    for key in v:
        if key not in SAMPLING_FIELDS:
            raise ProtocolError(UNKNOWN_FIELD, f"{name}.{field_name(key)}",
                                f"unknown sampling parameter; allowed: {', '.join(SAMPLING_FIELDS)}")
    try:
        return request_sampling_params(ZMQ, v)
    except InvalidFieldError as e:
        raise invalid(e.field, e.reason) from None


def params_to_wire(params: SamplingParams) -> dict:
    """SamplingParams as its wire map: fields left at None are left out (but ``max_tokens``,
    whose nil asks for the rest of the context), and ``logit_bias`` keys travel as decimal
    strings (wire maps have string keys, as in JSON)."""
    d = {f: getattr(params, f) for f in SAMPLING_FIELDS}
    d = {k: v for k, v in d.items() if v is not None or k == "max_tokens"}
    if "logit_bias" in d:
        d["logit_bias"] = {str(t): b for t, b in d["logit_bias"].items()}
    if "structured_outputs" in d:
        d["structured_outputs"] = structured_to_wire(d["structured_outputs"])
    return d


def structured_to_wire(so: StructuredOutputsParams) -> dict:
    """StructuredOutputsParams as its wire map: the constraint and the options that differ
    from their defaults; a ``json`` schema travels as its JSON text (a wire map holds at most
    MAX_MAP_ENTRIES entries, a schema's ``properties`` may hold more)."""
    d = {}
    for f in dc_fields(StructuredOutputsParams):
        v = getattr(so, f.name)
        if v is not None and v != f.default:
            d[f.name] = v
    if isinstance(d.get("json"), dict):
        d["json"] = json.dumps(d["json"], separators=(",", ":"))
    return d


def status_map(name, v):
    if not isinstance(v, dict):
        raise invalid(name, f"must be a map, got {type(v).__name__}")
    if len(v) > MAX_STATUS_ENTRIES:
        raise invalid(name, f"at most {MAX_STATUS_ENTRIES} entries, got {len(v)}")
    for key, value in v.items():
        if not isinstance(key, str):
            raise invalid(name, f"keys must be strings, got {type(key).__name__}")
        if not (value is None or isinstance(value, (str, int, float, bool))):
            raise invalid(f"{name}.{key}", f"must be a string, number, boolean or nil, got {type(value).__name__}")
    return dict(v)
