"""The wire protocol between tpserve clients and the daemon (version 1).

Transport: the daemon binds a ZMQ ROUTER socket, clients connect DEALER sockets. Every message
is exactly one frame holding one msgpack map with at least ``v`` (protocol version, 1) and
``type``. docs/protocol.md is the normative description; this module is its executable form.

One dataclass per message type. Each class lists its fields once, in ``FIELDS``: field name ->
(validator, required). ``encode`` and ``decode`` both run the validators, so a message that
encodes also decodes, and whatever decodes has fields of the documented types and ranges.
Any violation raises ``ProtocolError(code, field, message)``; the daemon turns it into an
``error`` reply.

Type strings are looked up per direction: ``REQUESTS`` (client -> daemon) and ``REPLIES``
(daemon -> client). ``status`` and ``profile`` name both a request and its reply.
"""
from __future__ import annotations

import array
import json
import sys
from dataclasses import dataclass, field, fields as dc_fields
from typing import Any, Callable, ClassVar

import msgpack

from tpserve import limits as R
from tpserve.errors import InvalidFieldError, TpserveError
from tpserve.request import ZMQ_PARAMS_PREFIX, Api, Request
from tpserve.request import sampling_params as request_sampling_params
from tpserve.sampling import MAX_LOGPROBS, SamplingParams, StructuredOutputsParams

PROTOCOL_VERSION = 1

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


def _bad(name: str, message: str) -> ProtocolError:
    return ProtocolError(INVALID_FIELD, name, message)


def _field_name(key) -> str:
    """A map key as it appears in an error's ``field`` (keys may be bytes or absurdly long)."""
    return (key if isinstance(key, str) else repr(key))[:128]


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def text(max_chars: int, min_chars: int = 0) -> Validator:
    def check(name, v):
        if not isinstance(v, str):
            raise _bad(name, f"must be a string, got {type(v).__name__}")
        if not min_chars <= len(v) <= max_chars:
            raise _bad(name, f"length must be in [{min_chars}, {max_chars}] characters, got {len(v)}")
        return v
    return check


def integer(lo: int, hi: int) -> Validator:
    def check(name, v):
        if not _is_int(v):
            raise _bad(name, f"must be an integer, got {type(v).__name__}")
        if not lo <= v <= hi:
            raise _bad(name, f"must be in [{lo}, {hi}], got {v}")
        return v
    return check


def number(lo: float, hi: float) -> Validator:
    def check(name, v):
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise _bad(name, f"must be a number, got {type(v).__name__}")
        if not lo <= v <= hi:
            raise _bad(name, f"must be in [{lo:g}, {hi:g}], got {v}")
        return v
    return check


def boolean(name, v):
    if not isinstance(v, bool):
        raise _bad(name, f"must be a boolean, got {type(v).__name__}")
    return v


def one_of(choices: tuple[str, ...]) -> Validator:
    def check(name, v):
        if v not in choices:
            raise _bad(name, f"must be one of {', '.join(choices)}, got {v!r}")
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
                raise _bad(name, f"must be int32 little-endian token ids, got {len(v)} bytes")
            ids = array.array("i")
            ids.frombytes(v)
            v = _native(ids)
        elif isinstance(v, (list, tuple)):
            v = array.array("i", _wire(R.check_token_ids, name, v, max_len))
        elif not (isinstance(v, array.array) and v.typecode == "i"):
            raise _bad(name, f"must be packed token ids (bin), got {type(v).__name__}")
        return _wire(R.check_packed_ids, name, v, max_len)
    return check


def _native(ids: array.array) -> array.array:
    """Little-endian int32 ids in this machine's order (in place)."""
    assert ids.itemsize == 4
    if sys.byteorder != "little":
        ids.byteswap()
    return ids


def _packed(ids: array.array) -> bytes:
    return _native(array.array("i", ids)).tobytes() if sys.byteorder != "little" else ids.tobytes()


def _wire(check, *args):
    """Run a tpserve.limits check; its InvalidFieldError becomes the wire's invalid_field."""
    try:
        return check(*args)
    except InvalidFieldError as e:
        raise _bad(e.field, e.reason) from None


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
        raise _bad(name, f"must be an array of [logprob, top] entries, got {type(v).__name__}")
    out = []
    for i, entry in enumerate(v):
        where = f"{name}[{i}]"
        if not (isinstance(entry, (list, tuple)) and len(entry) == 2 and _is_number(entry[0])
                and isinstance(entry[1], (list, tuple)) and len(entry[1]) <= MAX_LOGPROBS):
            raise _bad(where, f"must be [logprob, [[token id, logprob], ...]] with at most "
                              f"{MAX_LOGPROBS} pairs")
        top = []
        for pair in entry[1]:
            if not (isinstance(pair, (list, tuple)) and len(pair) == 2 and _is_int(pair[0])
                    and 0 <= pair[0] <= MAX_TOKEN_ID and _is_number(pair[1])):
                raise _bad(where, f"each top entry must be [token id, logprob], got {pair!r}"[:256])
            top.append([pair[0], float(pair[1])])
        out.append([float(entry[0]), top])
    return out


def prompt_logprobs_list(name, v):
    """Per prompt token: nil for the first, then ``[logprob, [[token id, logprob], ...]]``."""
    if not isinstance(v, (list, tuple)) or not v or v[0] is not None:
        raise _bad(name, "must be an array starting with nil (the first prompt token has none)")
    return [None] + logprobs_list(name, v[1:])


def completions_list(name, v):
    """The completions of an ``n`` > 1 request (done): maps of index, finish_reason,
    completion_tokens and, for a request that was not streamed, text, token_ids, logprobs."""
    if not isinstance(v, (list, tuple)) or len(v) > MAX_N:
        raise _bad(name, f"must be an array of at most {MAX_N} completion maps")
    out = []
    for i, c in enumerate(v):
        where = f"{name}[{i}]"
        if not isinstance(c, dict):
            raise _bad(where, f"must be a map, got {type(c).__name__}")
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
        raise _bad(name, f"must be a map of sampling parameters, got {type(v).__name__}")
    for key in v:
        if key not in SAMPLING_FIELDS:
            raise ProtocolError(UNKNOWN_FIELD, f"{name}.{_field_name(key)}",
                                f"unknown sampling parameter; allowed: {', '.join(SAMPLING_FIELDS)}")
    try:
        return request_sampling_params(ZMQ, v)
    except InvalidFieldError as e:
        raise _bad(e.field, e.reason) from None


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
        raise _bad(name, f"must be a map, got {type(v).__name__}")
    if len(v) > MAX_STATUS_ENTRIES:
        raise _bad(name, f"at most {MAX_STATUS_ENTRIES} entries, got {len(v)}")
    for key, value in v.items():
        if not isinstance(key, str):
            raise _bad(name, f"keys must be strings, got {type(key).__name__}")
        if not (value is None or isinstance(value, (str, int, float, bool))):
            raise _bad(f"{name}.{key}", f"must be a string, number, boolean or nil, got {type(value).__name__}")
    return dict(v)


# ---- messages ----------------------------------------------------------------------------
class Message:
    """Base of all wire messages. Subclasses set TYPE, DIRECTION and FIELDS."""

    TYPE: ClassVar[str]
    DIRECTION: ClassVar[str]  # "request" (client -> daemon) or "reply"
    FIELDS: ClassVar[dict[str, tuple[Validator, bool]]]


@dataclass
class GenerateRequest(Message):
    """Start generating for ``prompt``. Replies: ``delta``* then ``done``, or one ``error``."""

    TYPE = "generate"
    DIRECTION = "request"
    FIELDS = {"id": (request_id, True), "prompt": (prompt, True),
              "params": (sampling_params, False), "stream": (boolean, False),
              "priority": (nullable(priority), False), "timeout": (nullable(timeout), False)}
    id: str
    prompt: str | list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    stream: bool = True
    priority: int | None = None   # None: 0
    timeout: float | None = None  # None: the daemon's --request-timeout

    def to_request(self) -> Request:
        """The request model of this message (its fields were validated when it was decoded)."""
        return Request(self.params, self.prompt, request_id=self.id, priority=self.priority or 0,
                       timeout=self.timeout, stream=self.stream, api=ZMQ)


@dataclass
class AbortRequest(Message):
    """Stop request ``id``. Reply: ``done`` with finish_reason "abort", or ``error`` unknown_id."""

    TYPE = "abort"
    DIRECTION = "request"
    FIELDS = {"id": (request_id, True)}
    id: str


@dataclass
class StatusRequest(Message):
    """Ask for the daemon's status. Reply: ``status`` echoing ``id``."""

    TYPE = "status"
    DIRECTION = "request"
    FIELDS = {"id": (nullable(request_id), False)}
    id: str | None = None


@dataclass
class PingRequest(Message):
    """Liveness check. Reply: ``pong`` echoing ``id``."""

    TYPE = "ping"
    DIRECTION = "request"
    FIELDS = {"id": (nullable(request_id), False)}
    id: str | None = None


MAX_PROFILE_SECONDS = 3600.0


@dataclass
class ProfileRequest(Message):
    """Record a profiler trace on every rank for ``seconds``. Reply: ``profile`` once written."""

    TYPE = "profile"
    DIRECTION = "request"
    FIELDS = {"seconds": (number(0.0, MAX_PROFILE_SECONDS), True), "id": (nullable(request_id), False)}
    seconds: float
    id: str | None = None


@dataclass
class MetricsRequest(Message):
    """Ask for the daemon's Prometheus metrics. Reply: ``metrics`` echoing ``id``."""

    TYPE = "metrics"
    DIRECTION = "request"
    FIELDS = {"id": (nullable(request_id), False)}
    id: str | None = None


@dataclass
class TokenizeRequest(Message):
    """The token ids of ``text`` (``add_special_tokens``: as the model's tokenizer defines
    them). Reply: ``tokens`` echoing ``id``, or one ``error``."""

    TYPE = "tokenize"
    DIRECTION = "request"
    FIELDS = {"id": (request_id, True), "text": (text(MAX_PROMPT_CHARS, 1), True),
              "add_special_tokens": (boolean, False)}
    id: str
    text: str
    add_special_tokens: bool = False


@dataclass
class DeltaReply(Message):
    """New output of a streaming request since its previous delta."""

    TYPE = "delta"
    DIRECTION = "reply"
    FIELDS = {"id": (request_id, True), "text": (text(2**31), True),
              "token_ids": (token_ids(2**31), True), "logprobs": (nullable(logprobs_list), False),
              "index": (integer(0, MAX_N - 1), False),
              "prompt_logprobs": (nullable(prompt_logprobs_list), False)}
    id: str
    text: str
    token_ids: list[int]
    logprobs: list | None = None
    index: int = 0                      # which of the request's n completions
    prompt_logprobs: list | None = None  # in the request's first message only


@dataclass
class DoneReply(Message):
    """The last message of a request. ``text``/``token_ids`` are the whole completion when the
    request was not streamed and are absent (None) when it was."""

    TYPE = "done"
    DIRECTION = "reply"
    FIELDS = {"id": (request_id, True), "finish_reason": (one_of(FINISH_REASONS), True),
              "prompt_tokens": (count, True), "completion_tokens": (count, True),
              "text": (nullable(text(2**31)), False), "token_ids": (nullable(token_ids(2**31)), False),
              "abort_reason": (nullable(one_of(ABORT_REASONS)), False),
              "logprobs": (nullable(logprobs_list), False),
              "prompt_logprobs": (nullable(prompt_logprobs_list), False),
              "completions": (nullable(completions_list), False),
              "cached_tokens": (nullable(count), False)}
    id: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    text: str | None = None
    token_ids: list[int] | None = None
    abort_reason: str | None = None
    logprobs: list | None = None
    prompt_logprobs: list | None = None  # unless an earlier delta carried them
    completions: list | None = None      # n > 1: every completion (the fields above: the first's)
    cached_tokens: int | None = None     # prompt tokens served from the prefix cache


@dataclass
class ErrorReply(Message):
    """A request failed or a frame was invalid. ``id`` is set when the request id was readable.
    ``limit``/``requested``/``allowed`` are set for admission and overloaded errors;
    ``retry_after`` (seconds) for overloaded and shutting_down."""

    TYPE = "error"
    DIRECTION = "reply"
    FIELDS = {"code": (text(MAX_CODE_CHARS, 1), True), "message": (text(MAX_MESSAGE_CHARS), True),
              "id": (nullable(request_id), False), "field": (nullable(text(256)), False),
              "limit": (nullable(text(64)), False), "requested": (nullable(integer(-2**63, 2**63 - 1)), False),
              "allowed": (nullable(integer(-2**63, 2**63 - 1)), False),
              "retry_after": (nullable(number(0.0, 86400.0)), False)}
    code: str
    message: str
    id: str | None = None
    field: str | None = None
    limit: str | None = None
    requested: int | None = None
    allowed: int | None = None
    retry_after: float | None = None


@dataclass
class StatusReply(Message):
    """Daemon and engine counters (see docs/protocol.md for the keys)."""

    TYPE = "status"
    DIRECTION = "reply"
    FIELDS = {"stats": (status_map, True), "id": (nullable(request_id), False)}
    stats: dict
    id: str | None = None


@dataclass
class ProfileReply(Message):
    """The trace files written (one per rank, on the daemon's machine)."""

    TYPE = "profile"
    DIRECTION = "reply"
    FIELDS = {"files": (lambda name, v: _string_list(name, v, 4096), True), "id": (nullable(request_id), False)}
    files: list[str]
    id: str | None = None


def _string_list(name, v, max_chars: int) -> list[str]:
    if not isinstance(v, (list, tuple)) or len(v) > MAX_STATUS_ENTRIES:
        raise _bad(name, f"must be an array of at most {MAX_STATUS_ENTRIES} strings")
    return [text(max_chars)(f"{name}[{i}]", s) for i, s in enumerate(v)]


@dataclass
class PongReply(Message):
    TYPE = "pong"
    DIRECTION = "reply"
    FIELDS = {"id": (nullable(request_id), False)}
    id: str | None = None


@dataclass
class MetricsReply(Message):
    """The daemon's metrics in the Prometheus text exposition format (version 0.0.4)."""

    TYPE = "metrics"
    DIRECTION = "reply"
    FIELDS = {"text": (text(MAX_METRICS_CHARS), True), "id": (nullable(request_id), False)}
    text: str
    id: str | None = None


@dataclass
class TokensReply(Message):
    """The token ids a ``tokenize`` request asked for, packed (``packed_token_ids``)."""

    TYPE = "tokens"
    DIRECTION = "reply"
    FIELDS = {"id": (request_id, True), "token_ids": (packed_token_ids(MAX_TOKENIZED_IDS), True)}
    id: str
    token_ids: array.array  # typecode "i"; a list is packed when the message is encoded


REQUESTS: dict[str, type[Message]] = {c.TYPE: c for c in
                                      (GenerateRequest, AbortRequest, StatusRequest, PingRequest,
                                       ProfileRequest, MetricsRequest, TokenizeRequest)}
REPLIES: dict[str, type[Message]] = {c.TYPE: c for c in
                                     (DeltaReply, DoneReply, ErrorReply, StatusReply, PongReply, ProfileReply,
                                      MetricsReply, TokensReply)}


# ---- encode / decode ---------------------------------------------------------------------
def _check_fields(cls: type[Message], values: dict) -> dict:
    for key in values:
        if key not in cls.FIELDS:
            raise ProtocolError(UNKNOWN_FIELD, _field_name(key),
                                f"not a field of {cls.TYPE!r}; allowed: {', '.join(cls.FIELDS) or '(none)'}")
    out = {}
    for name, (check, required) in cls.FIELDS.items():
        if name not in values:
            if required:
                raise ProtocolError(MISSING_FIELD, name, f"required by {cls.TYPE!r}")
            continue
        out[name] = check(name, values[name])
    return out


def encode(msg: Message) -> bytes:
    """Validate ``msg`` and pack it into one frame. Optional fields that are None are left out."""
    values = {}
    for name, (_, required) in msg.FIELDS.items():
        value = getattr(msg, name)
        if value is None and not required:
            continue
        values[name] = value
    checked = _check_fields(type(msg), values)
    if "params" in checked:
        checked["params"] = params_to_wire(checked["params"])
    for name, value in checked.items():
        if isinstance(value, array.array):
            checked[name] = _packed(value)
    return msgpack.packb({"v": PROTOCOL_VERSION, "type": msg.TYPE, **checked}, use_bin_type=True)


class _MapKeyError(Exception):
    """Raised inside msgpack's unpacker by ``_strict_map``; carries the offending key."""


def _strict_map(pairs):
    """Build a map that has string keys, each once (docs/protocol.md: Transport)."""
    out = {}
    for key, value in pairs:
        if not isinstance(key, str):
            raise _MapKeyError(f"map keys must be strings, got {type(key).__name__} {_field_name(key)}")
        if key in out:
            raise _MapKeyError(f"map key {_field_name(key)!r} appears more than once")
        out[key] = value
    return out


def unpack_frame(frame: bytes) -> dict:
    """msgpack-decode one frame into a map, with limits that keep a hostile frame cheap.

    Arrays may be as long as the frame allows (each element takes at least one byte), so an
    over-long prompt reaches its field check and is reported as ``invalid_field`` with its id.
    Maps hold at most MAX_MAP_ENTRIES entries, must have string keys, each key once. Maps and
    arrays nest at most MAX_NESTING levels. A frame refused here is ``bad_message``; its id, if
    it can be read, is ``salvage_id``'s.
    """
    if len(frame) > MAX_MESSAGE_BYTES:
        raise ProtocolError(BAD_MESSAGE, None, f"frame of {len(frame)} bytes exceeds {MAX_MESSAGE_BYTES}")
    try:
        obj = msgpack.unpackb(frame, raw=False, strict_map_key=True, use_list=True,
                              object_pairs_hook=_strict_map,
                              max_str_len=MAX_MESSAGE_BYTES, max_bin_len=MAX_MESSAGE_BYTES,
                              max_array_len=MAX_MESSAGE_BYTES, max_map_len=MAX_MAP_ENTRIES,
                              max_ext_len=0)
    except _MapKeyError as e:
        raise ProtocolError(BAD_MESSAGE, None, str(e)[:512]) from None
    except Exception as e:  # msgpack raises many types (ExtraData, ValueError, StackError, ...)
        if isinstance(e, msgpack.exceptions.StackError) or "recursion limit" in str(e):
            raise ProtocolError(BAD_MESSAGE, None, f"maps and arrays nest more than {MAX_NESTING} levels deep; "
                                                   "send a deep JSON schema as text") from None
        raise ProtocolError(BAD_MESSAGE, None, f"not a msgpack frame: {type(e).__name__}: {e}"[:512]) from None
    if not isinstance(obj, dict):
        raise ProtocolError(BAD_MESSAGE, None, f"a message must be a msgpack map, got {type(obj).__name__}")
    return obj


def decode(frame: bytes | dict, direction: str = "request") -> Message:
    """Decode and validate one frame (or an already unpacked map) sent in ``direction``."""
    table = REQUESTS if direction == "request" else REPLIES
    obj = unpack_frame(frame) if isinstance(frame, (bytes, bytearray, memoryview)) else frame
    if not isinstance(obj, dict):
        raise ProtocolError(BAD_MESSAGE, None, f"a message must be a map, got {type(obj).__name__}")
    if "v" not in obj:
        raise ProtocolError(MISSING_FIELD, "v", f"every message carries the protocol version v={PROTOCOL_VERSION}")
    if not _is_int(obj["v"]) or obj["v"] != PROTOCOL_VERSION:
        raise ProtocolError(UNSUPPORTED_VERSION, "v",
                            f"this daemon speaks protocol version {PROTOCOL_VERSION}, got {obj['v']!r}")
    if "type" not in obj:
        raise ProtocolError(MISSING_FIELD, "type", f"one of {', '.join(table)}")
    cls = table.get(obj["type"]) if isinstance(obj["type"], str) else None
    if cls is None:
        raise ProtocolError(UNKNOWN_TYPE, "type",
                            f"{obj['type']!r} is not a {direction} type; allowed: {', '.join(table)}"[:512])
    values = {k: v for k, v in obj.items() if k not in ("v", "type")}
    return cls(**_check_fields(cls, values))


def readable_id(obj) -> str | None:
    """The request id of a (possibly invalid) unpacked message, if it is a valid id; else None."""
    if isinstance(obj, dict):
        try:
            return request_id("id", obj.get("id"))
        except ProtocolError:
            return None
    return None


def salvage_id(frame: bytes) -> str | None:
    """The ``id`` of a frame that does not decode (``unpack_frame`` refused it), if it can be
    read anyway: the frame starts with a map whose one ``id`` key holds a valid id. The other
    keys' values are skipped unread, so a value that broke the strict decode (a map over
    MAX_MAP_ENTRIES, nesting too deep, a repeated key inside a value, bytes cut short after
    the id) does not hide the id. Two ``id`` keys, or none readable: None.

    The sender then learns which of its requests was refused: an error without an id could
    only be matched to a request by guessing (docs/protocol.md, Errors)."""
    if not isinstance(frame, (bytes, bytearray, memoryview)) or not 0 < len(frame) <= MAX_MESSAGE_BYTES:
        return None
    unpacker = msgpack.Unpacker(raw=False, max_buffer_size=len(frame), max_str_len=MAX_MESSAGE_BYTES,
                                max_bin_len=MAX_MESSAGE_BYTES, max_array_len=MAX_MESSAGE_BYTES,
                                max_map_len=MAX_MESSAGE_BYTES, max_ext_len=MAX_MESSAGE_BYTES)
    unpacker.feed(frame)
    found = None
    try:
        for _ in range(unpacker.read_map_header()):
            if unpacker.unpack() != "id":  # a key: bounded by the frame, as any decode is
                unpacker.skip()
                continue
            if found is not None:
                return None  # two ids: which one would it be?
            found = readable_id({"id": unpacker.unpack()})
            if found is None:
                return None
    except Exception:  # malformed or cut short past the id: the id read so far stands
        pass
    return found
