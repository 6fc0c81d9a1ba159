"""Errors of Anthropic's Messages API (docs/messages.md): ``{"type": "error", "error": {"type",
"message"}}`` with Anthropic's statuses and error types.

``AnthropicError`` is an OpenAIError whose body is Anthropic's, so app.py's handler answers it;
``anthropic_error`` makes one of an error raised by the shared chat path, its field respelled
with this body's names and its status Anthropic's (a full waiting queue and an unavailable
daemon are 529 ``overloaded_error``, Anthropic's own overload, which its clients retry).

Every error of a Messages path (``is_messages_path``) is Anthropic's, also those raised before
or outside its routes: the request guard's (guard.py: Host, Content-Type) and app.py's
handlers' (a method the path does not serve, an error no route caught) use ``anthropic_body``
or ``anthropic_error`` for these paths.
"""
from __future__ import annotations

from tpserve.fronts.http import openai_api as O
from tpserve.fronts.http.agent_common import respelled

# Anthropic's error type of each status it uses.
_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
          504: "timeout_error", 529: "overloaded_error"}


def is_messages_path(path: str) -> bool:
    """Whether ``path`` is one of the Messages API's (``/v1/messages``, ``/v1/messages/...``)."""
    return path == "/v1/messages" or path.startswith("/v1/messages/")


def anthropic_body(status: int, message: str) -> dict:
    """Anthropic's error body of an answer with ``status``."""
    kind = _TYPES.get(status) or ("api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


class AnthropicError(O.OpenAIError):
    """An error answered with ``status`` and Anthropic's error body."""

    def body(self) -> dict:
        return anthropic_body(self.status, self.message)


def anthropic_error(e: O.OpenAIError, paths: dict | None = None) -> AnthropicError:
    """The Anthropic error of an OpenAIError raised by the shared chat path: its field respelled
    with ``paths`` (the chat body's field -> this body's), its status Anthropic's (a full queue
    and an unavailable daemon are 529 overloaded_error, as Anthropic's own overload)."""
    if isinstance(e, AnthropicError):
        return e
    param, message = e.param, e.message
    if param and paths:
        spelled = _respell(param, paths)
        if spelled != param:
            message, param = respelled(message, param, spelled), spelled
    status = e.status
    if status == 503 or (status == 429 and e.code == "rate_limit_exceeded"):
        status = 529
    return AnthropicError(status, message, param, code=e.code, headers=e.headers)


def _respell(param: str, paths: dict) -> str:
    best = None
    for key in paths:
        if (param == key or param.startswith(key + ".") or param.startswith(key + "[")) and (
                best is None or len(key) > len(best)):
            best = key
    return param if best is None else paths[best] + param[len(best):]


def bad(param: str | None, message: str) -> AnthropicError:
    return AnthropicError(400, f"{param}: {message}" if param else message, param)
