"""Who may talk to the HTTP front from a browser's reach: the Host and Content-Type checks.

A front on a loopback address without an API key is reachable by any web page the machine's
browser opens: a cross-site form post (CSRF: a "simple" request, text/plain or form-encoded,
sent without a CORS preflight) or a page whose own host name was re-pointed at 127.0.0.1 (DNS
rebinding: the browser then treats the front as that page's origin and reads its answers).
``RequestGuard``, an ASGI middleware in front of every route, stops both:

* ``Host``: only names the front serves. Loopback names (``localhost`` and ``*.localhost``,
  127.0.0.0/8, ``::1``) always; the names of ``--http-allowed-hosts`` (exact, ``*.suffix``, or
  ``*`` for any) besides. Without that option a front listening on a non-loopback address
  answers any name (such a front needs an API key, which a foreign page does not have).
  A request without a ``Host`` (HTTP/1.0) is not from a browser and passes. Refused: 400
  ``invalid_host``.
* ``Content-Type``: a request with a body (POST, PUT, PATCH) must say ``application/json``
  (parameters such as ``charset`` allowed). A browser cannot send that cross-site without a
  preflight, which the front does not grant. Refused: 415 ``unsupported_media_type``.

Both answers carry OpenAI's error body, or Anthropic's on the Messages API's paths
(messages_errors.py), as every other error there.
"""
from __future__ import annotations

import ipaddress
import json
from dataclasses import dataclass, field

_BODY_METHODS = {"POST", "PUT", "PATCH"}


def host_name(value: str) -> str:
    """The name of a Host header value: its port and IPv6 brackets removed, lowercased."""
    value = value.strip().lower()
    if value.startswith("["):
        end = value.find("]")
        return value[1:end] if end > 0 else value
    if value.count(":") == 1:
        value = value.split(":")[0]
    return value.rstrip(".")


def is_loopback_name(name: str) -> bool:
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def parse_allowed_hosts(text: str | None) -> tuple[str, ...] | None:
    """``--http-allowed-hosts``: comma-separated names; None (not given) stays None."""
    if text is None:
        return None
    names = tuple(n.strip().lower().rstrip(".") for n in text.split(",") if n.strip())
    for n in names:
        if n != "*" and ("*" in n[1:] or (n.startswith("*") and not n.startswith("*.")) or "/" in n):
            raise ValueError(f"{n!r} is not a host name, '*.suffix' or '*'")
    return names


@dataclass
class HostPolicy:
    """The Host names one front answers (see the module doc)."""

    names: tuple[str, ...] = ()
    any_name: bool = False
    _suffixes: tuple[str, ...] = field(init=False, default=())

    def __post_init__(self):
        self.any_name = self.any_name or "*" in self.names
        self._suffixes = tuple(n[1:] for n in self.names if n.startswith("*."))

    @classmethod
    def for_bind(cls, allowed: tuple[str, ...] | None, loopback_bind: bool) -> "HostPolicy":
        """Loopback names plus ``allowed``; any name on a non-loopback bind without ``allowed``."""
        if allowed is None:
            return cls((), any_name=not loopback_bind)
        return cls(allowed)

    def allows(self, name: str) -> bool:
        return (self.any_name or is_loopback_name(name) or name in self.names
                or any(name.endswith(s) for s in self._suffixes))


async def _refuse(send, scope, status: int, message: str, code: str) -> None:
    # imported here: the CLI imports this module, and must stay light
    from tpserve.fronts.http.messages_errors import anthropic_body, is_messages_path
    if is_messages_path(scope.get("path", "")):
        body = json.dumps(anthropic_body(status, message)).encode()
    else:
        body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                     "code": code}}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


class RequestGuard:
    """ASGI middleware: the Host check (when ``hosts`` is given) and the Content-Type check."""

    def __init__(self, app, hosts: HostPolicy | None = None):
        self.app = app
        self.hosts = hosts

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        hosts = [v for k, v in scope["headers"] if k == b"host"]
        if self.hosts is not None and hosts:
            shown = hosts[0].decode("latin-1")[:100]
            if len(set(hosts)) > 1 or not self.hosts.allows(host_name(hosts[0].decode("latin-1"))):
                return await _refuse(send, scope, 400, f"Host {shown!r} is not served here: this front "
                                     "answers loopback names (localhost, 127.0.0.1, [::1]); others need "
                                     "--http-allowed-hosts", "invalid_host")
        if scope["method"] in _BODY_METHODS:
            ctype = next((v for k, v in scope["headers"] if k == b"content-type"), b"")
            media = ctype.split(b";")[0].strip().lower()
            if media != b"application/json":
                shown = ctype.decode("latin-1")[:100] or "none"
                return await _refuse(send, scope, 415, "the body must be JSON: send 'Content-Type: "
                                     f"application/json' (got {shown!r})", "unsupported_media_type")
        return await self.app(scope, receive, send)
