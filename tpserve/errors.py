"""Typed errors raised at tpserve's boundaries (config, requests, wire messages).

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


class WorkerDiedError(TpserveError, RuntimeError):
    """A tensor-parallel worker process exited while the engine was running."""

    def __init__(self, rank: int, exitcode: int | None):
        self.rank = rank
        self.exitcode = exitcode
        super().__init__(f"tensor-parallel worker rank {rank} died (exit code {exitcode})")
