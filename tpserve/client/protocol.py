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
(daemon -> client). ``status`` and ``profile`` name both a request and its reply. The fields'
limits, error codes and validators are wire_fields.py's, re-exported here.
"""
from __future__ import annotations

import array
import sys
from dataclasses import dataclass, field
from typing import ClassVar

import msgpack

from tpserve.pooling import MAX_DIMENSIONS, MAX_POOLING_INPUTS, TASKS as POOLING_TASKS
from tpserve.request import Request
from tpserve.sampling import SamplingParams
from tpserve.client.wire_fields import (
    MAX_MESSAGE_BYTES, MAX_MESSAGE_CHARS, MAX_STATUS_ENTRIES, MAX_CODE_CHARS, MAX_MAP_ENTRIES,
    MAX_NESTING, MAX_ID_CHARS, MAX_PROMPT_CHARS, MAX_PROMPT_TOKENS, MAX_TOKEN_ID, MAX_TOKENIZED_IDS,
    MAX_STOP_STRINGS, MAX_STOP_CHARS, MAX_N, MAX_STOP_TOKEN_IDS, FINISH_REASONS, MAX_METRICS_CHARS,
    ABORT_REASONS, BAD_MESSAGE, UNSUPPORTED_VERSION, UNKNOWN_TYPE, UNKNOWN_FIELD, MISSING_FIELD,
    INVALID_FIELD, DUPLICATE_ID, UNKNOWN_ID, ADMISSION, INVALID_REQUEST, SHUTTING_DOWN, OVERLOADED,
    STEP_FAILED, TOO_MANY_REQUESTS, INTERNAL, ERROR_CODES, ProtocolError, Validator, invalid, field_name,
    is_int, text, integer, number, boolean, one_of, token_ids, packed_token_ids, packed, priority,
    timeout, nullable, logprobs_list, prompt_logprobs_list, completions_list, request_id, count, prompt,
    SAMPLING_FIELDS, ZMQ, sampling_params, params_to_wire, structured_to_wire, status_map)

PROTOCOL_VERSION = 1

__all__ = [  # the wire contract: this module's messages, and wire_fields.py's names
    "MAX_MESSAGE_BYTES", "MAX_MESSAGE_CHARS", "MAX_STATUS_ENTRIES", "MAX_CODE_CHARS", "MAX_MAP_ENTRIES",
    "MAX_NESTING", "MAX_ID_CHARS", "MAX_PROMPT_CHARS", "MAX_PROMPT_TOKENS", "MAX_TOKEN_ID",
    "MAX_TOKENIZED_IDS", "MAX_STOP_STRINGS", "MAX_STOP_CHARS", "MAX_N", "MAX_STOP_TOKEN_IDS",
    "FINISH_REASONS", "MAX_METRICS_CHARS", "ABORT_REASONS", "BAD_MESSAGE", "UNSUPPORTED_VERSION",
    "UNKNOWN_TYPE", "UNKNOWN_FIELD", "MISSING_FIELD", "INVALID_FIELD", "DUPLICATE_ID", "UNKNOWN_ID",
    "ADMISSION", "INVALID_REQUEST", "SHUTTING_DOWN", "OVERLOADED", "STEP_FAILED", "TOO_MANY_REQUESTS",
    "INTERNAL", "ERROR_CODES", "ProtocolError", "Validator", "invalid", "field_name", "is_int", "packed",
    "text", "integer", "number", "boolean",
    "one_of", "token_ids", "packed_token_ids", "priority", "timeout", "nullable", "logprobs_list",
    "prompt_logprobs_list", "completions_list", "request_id", "count", "prompt", "SAMPLING_FIELDS",
    "ZMQ", "sampling_params", "params_to_wire", "structured_to_wire", "status_map", "PROTOCOL_VERSION",
    "Message", "GenerateRequest", "AbortRequest", "StatusRequest", "PingRequest", "MAX_PROFILE_SECONDS",
    "ProfileRequest", "MetricsRequest", "TokenizeRequest", "PoolRequest", "PooledReply",
    "DeltaReply", "DoneReply", "ErrorReply",
    "StatusReply", "ProfileReply", "PongReply", "MetricsReply", "TokensReply", "encode", "unpack_frame",
    "decode", "readable_id", "salvage_id",
]

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


def _pool_prompts(name, v):
    """The prompts of a ``pool`` request: 1..MAX_POOLING_INPUTS arrays of token ids."""
    if not isinstance(v, (list, tuple)) or not v:
        raise invalid(name, "must be a non-empty array of prompts (arrays of token ids)")
    if len(v) > MAX_POOLING_INPUTS:
        raise invalid(name, f"holds {len(v)} prompts; at most {MAX_POOLING_INPUTS}")
    check = token_ids(MAX_PROMPT_TOKENS, 1)
    return [check(f"{name}[{i}]", p) for i, p in enumerate(v)]


def _packed_floats(name, v):
    """float32 little-endian values as ``bin`` (an ``array.array("f")`` in a message)."""
    if isinstance(v, (bytes, bytearray, memoryview)):
        if len(v) % 4:
            raise invalid(name, f"must be float32 little-endian values, got {len(v)} bytes")
        out = array.array("f")
        out.frombytes(v)
        if sys.byteorder != "little":
            out.byteswap()
        return out
    if isinstance(v, array.array) and v.typecode == "f":
        return v
    raise invalid(name, f"must be packed float32 values (bin), got {type(v).__name__}")


def _counts(name, v):
    if not isinstance(v, (list, tuple)) or len(v) > MAX_POOLING_INPUTS:
        raise invalid(name, f"must be an array of at most {MAX_POOLING_INPUTS} counts")
    return [count(f"{name}[{i}]", c) for i, c in enumerate(v)]


@dataclass
class PoolRequest(Message):
    """Embed or classify ``prompts`` (--runner pooling), all in one batch. Reply: one
    ``pooled``, or one ``error``; a request that ended early (timeout, abort): ``done``."""

    TYPE = "pool"
    DIRECTION = "request"
    FIELDS = {"id": (request_id, True), "prompts": (_pool_prompts, True),
              "task": (one_of(POOLING_TASKS), False),
              "dimensions": (nullable(integer(1, MAX_DIMENSIONS)), False),
              "normalize": (nullable(boolean), False),
              "priority": (nullable(priority), False), "timeout": (nullable(timeout), False)}
    id: str
    prompts: list[list[int]]
    task: str = "embed"
    dimensions: int | None = None
    normalize: bool | None = None
    priority: int | None = None   # None: 0
    timeout: float | None = None  # None: the daemon's --request-timeout


@dataclass
class PooledReply(Message):
    """The results of a ``pool``: ``data`` holds each prompt's vector (its embedding, or
    [score]) back to back, ``dim`` values each (float32, packed); ``prompt_tokens`` each
    prompt's token count."""

    TYPE = "pooled"
    DIRECTION = "reply"
    FIELDS = {"id": (request_id, True), "data": (_packed_floats, True),
              "dim": (integer(0, MAX_DIMENSIONS), True), "prompt_tokens": (_counts, True)}
    id: str
    data: array.array
    dim: int
    prompt_tokens: list[int]

    def vectors(self) -> list[list[float]]:
        d, flat = self.dim, self.data.tolist()
        return [flat[i * d:(i + 1) * d] for i in range(len(self.prompt_tokens))]


@dataclass
class DeltaReply(Message):
    """New output of a streaming request since its previous delta.

    With ``n`` > 1, the last delta of each completion carries its end: ``finish_reason`` and
    that completion's ``completion_tokens``, with the request's ``prompt_tokens`` and
    ``cached_tokens`` (the ``done`` still follows once every completion ended). The request's
    first delta also carries ``prompt_tokens`` and ``cached_tokens`` (as its ``done`` will),
    ``n`` = 1 too. Absent (None) in every other delta."""

    TYPE = "delta"
    DIRECTION = "reply"
    FIELDS = {"id": (request_id, True), "text": (text(2**31), True),
              "token_ids": (token_ids(2**31), True), "logprobs": (nullable(logprobs_list), False),
              "index": (integer(0, MAX_N - 1), False),
              "prompt_logprobs": (nullable(prompt_logprobs_list), False),
              "finish_reason": (nullable(one_of(FINISH_REASONS)), False),
              "completion_tokens": (nullable(count), False),
              "prompt_tokens": (nullable(count), False),
              "cached_tokens": (nullable(count), False)}
    id: str
    text: str
    token_ids: list[int]
    logprobs: list | None = None
    index: int = 0                      # which of the request's n completions
    prompt_logprobs: list | None = None  # in the request's first message only
    finish_reason: str | None = None     # n > 1: this completion ended (its last delta)
    completion_tokens: int | None = None  # with finish_reason: this completion's tokens
    prompt_tokens: int | None = None      # with finish_reason, and in the first delta: as done's
    cached_tokens: int | None = None      # with finish_reason, and in the first delta: as done's


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
        raise invalid(name, f"must be an array of at most {MAX_STATUS_ENTRIES} strings")
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
                                       ProfileRequest, MetricsRequest, TokenizeRequest, PoolRequest)}
REPLIES: dict[str, type[Message]] = {c.TYPE: c for c in
                                     (DeltaReply, DoneReply, ErrorReply, StatusReply, PongReply, ProfileReply,
                                      MetricsReply, TokensReply, PooledReply)}


# ---- encode / decode ---------------------------------------------------------------------
def _check_fields(cls: type[Message], values: dict) -> dict:
    for key in values:
        if key not in cls.FIELDS:
            raise ProtocolError(UNKNOWN_FIELD, field_name(key),
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
            checked[name] = packed(value) if value.typecode == "i" else _float_bytes(value)
    return msgpack.packb({"v": PROTOCOL_VERSION, "type": msg.TYPE, **checked}, use_bin_type=True)


def _float_bytes(values: array.array) -> bytes:
    if sys.byteorder != "little":
        values = array.array("f", values)
        values.byteswap()
    return values.tobytes()


class _MapKeyError(Exception):
    """Raised inside msgpack's unpacker by ``_strict_map``; carries the offending key."""


def _strict_map(pairs):
    """Build a map that has string keys, each once (docs/protocol.md: Transport)."""
    out = {}
    for key, value in pairs:
        if not isinstance(key, str):
            raise _MapKeyError(f"map keys must be strings, got {type(key).__name__} {field_name(key)}")
        if key in out:
            raise _MapKeyError(f"map key {field_name(key)!r} appears more than once")
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
            raise ProtocolError(BAD_MESSAGE, None, f"maps and arrays nest more than {MAX_NESTING} levels "
                                                   "deep; send a deep JSON schema as text") from None
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
    if not is_int(obj["v"]) or obj["v"] != PROTOCOL_VERSION:
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
