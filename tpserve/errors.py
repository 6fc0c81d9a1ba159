"""Typed errors raised at tpserve's boundaries (config, requests, steps, wire messages).

Internal invariants use ``assert``; anything a user or a client can cause raises one of
these, with a message that says what was wrong and what is allowed.
"""
from __future__ import annotations


class TpserveError(Exception):
    """Base class of every error tpserve raises on purpose."""


class ConfigError(TpserveError, ValueError):
    """An engine or sampling option is out of range or inconsistent."""

    def __init__(self, field: str, reason: str):
        self.field = field
        self.reason = reason
        super().__init__(f"{field}: {reason}")


class InvalidRequestError(TpserveError, ValueError):
    """A request is well-formed but cannot be served as it is (e.g. empty after tokenizing).

    ``field`` names the offending part of the request (``prompt``, ``params.stop``, ...) or is
    None; ``reason`` says what was wrong and what is allowed.
    """

    def __init__(self, field: str | None, reason: str):
        self.field = field
        self.reason = reason
        super().__init__(f"{field}: {reason}" if field else reason)


class InvalidFieldError(InvalidRequestError):
    """One field of a request has the wrong type or is out of its documented bounds.

    Raised by ``SamplingParams`` and ``tpserve.limits`` before anything is queued; the daemon
    answers it with the wire error ``invalid_field`` naming ``field``.
    """


class StepFailedError(TpserveError, RuntimeError):
    """One engine step failed in a way that only its own requests are affected by.

    The engine has already aborted ``request_ids`` (their KV blocks are free) and can keep
    stepping; ``__cause__`` is the original exception.
    """

    def __init__(self, request_ids: list[str], cause: BaseException):
        self.request_ids = list(request_ids)
        super().__init__(f"an engine step failed for {len(self.request_ids)} request(s): "
                         f"{type(cause).__name__}: {cause}")


class AdmissionError(TpserveError, ValueError):
    """A request can never be scheduled: it exceeds a hard limit of the engine.

    ``limit`` names the limit (``max_model_len`` or ``num_kv_blocks``), ``allowed`` is its
    value and ``requested`` what the request would need, so callers can report by how much.
    """

    def __init__(self, request_id: str, limit: str, requested: int, allowed: int, detail: str = ""):
        self.request_id = request_id
        self.limit = limit
        self.requested = requested
        self.allowed = allowed
        msg = (f"request {request_id!r} needs {limit}={requested} but the engine allows {allowed} "
               f"(over by {requested - allowed})")
        if detail:
            msg += f": {detail}"
        super().__init__(msg)


class OverloadedError(TpserveError, RuntimeError):
    """The waiting queue is full: the request was refused now and may succeed later.

    ``limit`` names the queue limit (``max_waiting_requests`` or ``max_waiting_tokens``),
    ``requested`` what the queue would hold with this request, ``allowed`` the limit;
    ``retry_after`` (seconds, >= 1) estimates when the queue has room again.
    """

    def __init__(self, request_id: str, limit: str, requested: int, allowed: int, retry_after: float = 1.0):
        self.request_id = request_id
        self.limit = limit
        self.requested = requested
        self.allowed = allowed
        self.retry_after = retry_after
        what = "requests" if limit == "max_waiting_requests" else "prompt tokens"
        super().__init__(f"the server is overloaded: its queue would hold {requested} {what}, over "
                         f"{limit}={allowed}; retry in about {retry_after:.0f} s")


class WorkerDiedError(TpserveError, RuntimeError):
    """A tensor-parallel worker process exited while the engine was running."""

    def __init__(self, rank: int, exitcode: int | None):
        self.rank = rank
        self.exitcode = exitcode
        super().__init__(f"tensor-parallel worker rank {rank} died (exit code {exitcode})")
