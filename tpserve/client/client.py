"""Client library for the tpserve daemon: ``Client`` (blocking) and ``AsyncClient`` (asyncio).

Both talk protocol version 1 (docs/protocol.md) over one DEALER socket. Request ids are
generated here (uuid4 hex) unless given; replies are routed by id, so several streams may be
open on one client at once. Every wait is bounded by ``timeout`` seconds (None waits forever):
``ClientTimeout`` names the address and the limit instead of hanging. A reply of type
``error`` raises ``RequestError`` with the daemon's code and message.

A non-streaming ``generate`` waits up to ``timeout`` for the whole completion; a stream waits up
to ``timeout`` for each piece. When a wait times out, the request is aborted on a best-effort
basis, so the daemon frees its KV blocks.
"""
from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections import deque
from dataclasses import dataclass
from typing import AsyncIterator, Iterator

import zmq
import zmq.asyncio

from tpserve.client import protocol as P
from tpserve.client.keys import load_public_key, load_secret_keys
from tpserve.client.addresses import client_address
from tpserve.errors import TpserveError
from tpserve.sampling import SamplingParams

_DEFAULT = object()


class ClientTimeout(TpserveError, TimeoutError):
    """No reply from the daemon in time (not running, wrong address, wrong CurveZMQ key...)."""

    def __init__(self, address: str, timeout: float):
        self.address = address
        self.timeout = timeout
        super().__init__(f"no reply from tpserve daemon at {address} within {timeout:g} s")


class RequestError(TpserveError, RuntimeError):
    """The daemon answered with an ``error`` message."""

    def __init__(self, code: str, message: str, request_id: str | None = None, field: str | None = None,
                 limit: str | None = None, requested: int | None = None, allowed: int | None = None,
                 retry_after: float | None = None):
        self.code = code
        self.message = message
        self.request_id = request_id
        self.field = field
        self.limit = limit
        self.requested = requested
        self.allowed = allowed
        self.retry_after = retry_after  # seconds, for "overloaded" and "shutting_down"
        super().__init__(f"{code}: {field + ': ' if field else ''}{message}")

    @classmethod
    def from_reply(cls, msg: P.ErrorReply) -> "RequestError":
        return cls(msg.code, msg.message, msg.id, msg.field, msg.limit, msg.requested, msg.allowed,
                   msg.retry_after)


@dataclass
class Delta:
    """A piece of a streamed completion. ``logprobs`` (requests with logprobs set): one
    ``[logprob, [[token id, logprob], ...]]`` per token id.

    With ``n`` > 1, completion ``index``'s last Delta says that it ended, as soon as it did
    (its siblings may still run): ``finish_reason`` is set, ``completion_tokens`` counts that
    completion's tokens, ``prompt_tokens`` and ``cached_tokens`` are the request's. Such a
    Delta may carry no text and no token ids. Otherwise (and always with ``n`` = 1, which the
    stream's result ends) they are None, except that a request's first Delta carries
    ``prompt_tokens`` and ``cached_tokens`` (as its result will)."""

    request_id: str
    text: str
    token_ids: list[int]
    logprobs: list | None = None
    index: int = 0                       # which completion (SamplingParams.n)
    prompt_logprobs: list | None = None  # the request's first message: nil, then one per prompt token
    finish_reason: str | None = None     # n > 1: completion ``index`` ended (its last Delta)
    completion_tokens: int | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None


@dataclass
class GenerateResult:
    """A finished request. ``abort_reason`` is set when finish_reason is "abort".

    With ``n`` > 1, ``completions`` holds one GenerateResult per completion (by index) and
    the fields above are the first completion's (``completion_tokens``: all of them)."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    abort_reason: str | None = None
    logprobs: list | None = None
    prompt_logprobs: list | None = None
    completions: list["GenerateResult"] | None = None
    index: int = 0
    cached_tokens: int = 0  # prompt tokens the daemon served from its prefix cache


@dataclass
class PoolingResult:
    """One prompt's result of ``embed`` (its embedding) or ``classify`` (``[score]``)."""

    data: list[float]
    prompt_tokens: int


def _pool_results(msg: P.Message) -> list[PoolingResult]:
    """The PoolingResults of a ``pool``'s reply (RequestError for an ``error``, or for a
    ``done``: the request ended early, e.g. its timeout)."""
    msg = _checked(msg)
    if isinstance(msg, P.DoneReply):
        raise RequestError(msg.finish_reason, f"the request ended ({msg.finish_reason}) before its results",
                           msg.id)
    assert isinstance(msg, P.PooledReply), msg
    return [PoolingResult(v, n) for v, n in zip(msg.vectors(), msg.prompt_tokens)]


def _make_params(params: SamplingParams | None, sampling: dict) -> SamplingParams:
    if params is not None and sampling:
        raise TypeError("pass either params=SamplingParams(...) or sampling keywords, not both")
    return params if params is not None else SamplingParams(**sampling)


def _configure(sock: zmq.Socket, server_public_key, client_keys) -> None:
    sock.setsockopt(zmq.LINGER, 200)
    sock.setsockopt(zmq.MAXMSGSIZE, -1)
    if server_public_key is None:
        return
    if isinstance(client_keys, (str, os.PathLike)):
        public, secret = load_secret_keys(client_keys)
    elif client_keys is not None:
        public, secret = client_keys
    else:
        public, secret = zmq.curve_keypair()  # an anonymous client identity
    sock.curve_serverkey = load_public_key(server_public_key)
    sock.curve_publickey = public
    sock.curve_secretkey = secret


class _ClientCore:
    """What ``Client`` and ``AsyncClient`` share: the socket's set-up, building requests and
    reading replies. Subclasses only add the waiting (blocking or awaited)."""

    def __init__(self, address, timeout, runtime_dir, context, server_public_key, client_keys):
        self.address = client_address(address, runtime_dir)
        self.timeout = timeout
        self._sock = context.socket(zmq.DEALER)
        _configure(self._sock, server_public_key, client_keys)
        self._sock.connect(self.address)
        # Requests sent that have had no reply yet (id -> whether it is a generate): the ones an
        # ``error`` without an id may answer (``_unattributed``).
        self._unacked: dict[str, bool] = {}

    def _timeout(self, timeout):
        return self.timeout if timeout is _DEFAULT else timeout

    @staticmethod
    def _new_id() -> str:
        return uuid.uuid4().hex

    def _generate_frame(self, prompt, params, request_id, stream: bool, in_use, priority=None,
                        request_timeout=None) -> tuple[str, bytes]:
        """The id and frame of a ``generate``, checked locally before anything is sent."""
        rid = request_id or self._new_id()
        frame = P.encode(P.GenerateRequest(rid, prompt, params, stream, priority, request_timeout))
        if rid in in_use:
            raise ValueError(f"request id {rid!r} is already in use on this client")
        return rid, frame

    def _pool_frame(self, prompts, task, dimensions, normalize, priority, request_timeout, request_id,
                    in_use) -> tuple[str, bytes]:
        """The id and frame of a ``pool`` request, checked locally before anything is sent
        (a field the wire refuses raises RequestError naming it, as the daemon's answer would)."""
        rid = request_id or self._new_id()
        if rid in in_use:
            raise ValueError(f"request id {rid!r} is already in use on this client")
        prompts = [list(p) if isinstance(p, (list, tuple)) else p for p in prompts] \
            if isinstance(prompts, (list, tuple)) else prompts
        try:
            return rid, P.encode(P.PoolRequest(rid, prompts, task, dimensions, normalize, priority or None,
                                               request_timeout))
        except P.ProtocolError as e:  # as the daemon would answer it: a RequestError naming the field
            raise RequestError(e.code, e.message, rid, e.field) from None

    def _send_abort_nowait(self, rid: str) -> None:
        """Best effort: a full or closed socket loses the abort, never blocks."""
        try:
            self._sock.send(P.encode(P.AbortRequest(rid)), zmq.NOBLOCK)
        except zmq.ZMQError:
            pass

    def _unattributed(self, msg: P.ErrorReply) -> list[P.ErrorReply]:
        """An ``error`` without an id: the daemon could not read which request it refuses (it
        salvages the id of any frame whose map it can read, so this is rare: a frame this client
        sent that the daemon could not read at all). Every request sent on this connection that
        has had no reply yet may be the one, so each of them ends with this error (one copy
        per request, carrying its id) rather than wait for an answer that will never come; the
        generates among them are aborted, in case the daemon did accept them."""
        ended = []
        for rid, is_generate in self._unacked.items():
            ended.append(P.ErrorReply(msg.code, f"{msg.message} (the daemon's error named no request: "
                                      "every request of this connection still waiting for its first reply "
                                      "ends with it)",
                                      id=rid, field=msg.field, limit=msg.limit, requested=msg.requested,
                                      allowed=msg.allowed, retry_after=msg.retry_after))
            if is_generate:
                self._send_abort_nowait(rid)
        self._unacked.clear()
        return ended


def _checked(reply: P.Message) -> P.Message:
    """``reply``, unless it is an ``error``: then RequestError."""
    if isinstance(reply, P.ErrorReply):
        raise RequestError.from_reply(reply)
    return reply


def _result(rid: str, msg: P.Message, text: str | None = None, token_ids: list[int] | None = None) -> GenerateResult:
    """The GenerateResult of a request's final reply (RequestError for an ``error``); a stream
    passes the ``text``/``token_ids`` its deltas carried."""
    msg = _checked(msg)
    assert isinstance(msg, P.DoneReply), msg
    if text is None:
        text, token_ids, logprobs = msg.text or "", msg.token_ids or [], msg.logprobs
    else:
        logprobs = None
    completions = None
    if msg.completions:
        completions = [GenerateResult(rid, c.get("text") or "", c.get("token_ids") or [], c["finish_reason"],
                                      msg.prompt_tokens, c["completion_tokens"], logprobs=c.get("logprobs"),
                                      index=c["index"]) for c in msg.completions]
    return GenerateResult(rid, text, token_ids, msg.finish_reason, msg.prompt_tokens, msg.completion_tokens,
                          msg.abort_reason, logprobs, msg.prompt_logprobs, completions,
                          cached_tokens=msg.cached_tokens or 0)


def _delta(msg: P.DeltaReply) -> Delta:
    return Delta(msg.id, msg.text, msg.token_ids, msg.logprobs, msg.index, msg.prompt_logprobs,
                 msg.finish_reason, msg.completion_tokens, msg.prompt_tokens, msg.cached_tokens)


class Client(_ClientCore):
    """Blocking client. Not thread-safe: use one per thread (they are cheap).

    ``server_public_key`` (Z85 key or key file) enables CurveZMQ; ``client_keys`` is this
    client's identity (a ``.key_secret`` file or a (public, secret) pair; default: a fresh pair).
    """

    def __init__(self, address: str | None = None, timeout: float | None = 30.0,
                 runtime_dir: str | os.PathLike | None = None, server_public_key=None,
                 client_keys=None, context: zmq.Context | None = None):
        super().__init__(address, timeout, runtime_dir, context or zmq.Context.instance(),
                         server_public_key, client_keys)
        self._open: dict[str, deque] = {}  # replies received for ids being waited on

    # ---- public API --------------------------------------------------------------------------
    def generate(self, prompt: str | list[int], params: SamplingParams | None = None, *,
                 request_id: str | None = None, timeout=_DEFAULT, priority: int | None = None,
                 request_timeout: float | None = None, **sampling) -> GenerateResult:
        """Generate a completion and return it whole.

        ``priority`` (lower first; the daemon must schedule by priority) and ``request_timeout``
        (seconds the daemon gives the request before it ends with finish_reason "timeout"; the
        wire's ``timeout``) travel with the request; ``timeout`` is this client's own wait."""
        rid = self._submit(prompt, _make_params(params, sampling), request_id, stream=False,
                           priority=priority, request_timeout=request_timeout)
        try:
            msg = self._next(rid, self._timeout(timeout))
        except ClientTimeout:
            self._send_abort_nowait(rid)
            raise
        finally:
            self._open.pop(rid, None)
            self._unacked.pop(rid, None)
        return _result(rid, msg)

    def stream(self, prompt: str | list[int], params: SamplingParams | None = None, *,
               request_id: str | None = None, timeout=_DEFAULT, priority: int | None = None,
               request_timeout: float | None = None, **sampling) -> "Stream":
        """Start a streaming request; iterate the result for ``Delta``s (see ``Stream``).
        ``priority``, ``request_timeout``: as for ``generate``."""
        rid = self._submit(prompt, _make_params(params, sampling), request_id, stream=True,
                           priority=priority, request_timeout=request_timeout)
        return Stream(self, rid, self._timeout(timeout))

    def embed(self, prompts: list[list[int]], *, dimensions: int | None = None, normalize: bool | None = None,
              priority: int = 0, timeout=_DEFAULT, request_timeout: float | None = None,
              request_id: str | None = None) -> list["PoolingResult"]:
        """The embedding of each prompt (token ids), one batch on a ``--runner pooling`` daemon:
        ``data`` cut to ``dimensions`` and L2-normalised unless ``normalize`` is false. Errors
        (RequestError): a field out of bounds names it; a generate daemon names ``--runner``."""
        return self._pool(prompts, "embed", dimensions, normalize, priority, timeout, request_timeout,
                          request_id)

    def classify(self, prompts: list[list[int]], *, priority: int = 0, timeout=_DEFAULT,
                 request_timeout: float | None = None,
                 request_id: str | None = None) -> list["PoolingResult"]:
        """One score per prompt (``data`` = [score]): a sequence-classification head's, or a yes/no
        reranker's sigmoid(logit[yes] - logit[no]) at the last position."""
        return self._pool(prompts, "classify", None, None, priority, timeout, request_timeout, request_id)

    def _pool(self, prompts, task, dimensions, normalize, priority, timeout, request_timeout, request_id):
        rid, frame = self._pool_frame(prompts, task, dimensions, normalize, priority, request_timeout,
                                      request_id, self._open)
        self._open[rid] = deque()
        self._unacked[rid] = True
        try:
            self._sock.send(frame)
            msg = self._next(rid, self._timeout(timeout))
        except ClientTimeout:
            self._send_abort_nowait(rid)
            raise
        finally:
            self._open.pop(rid, None)
            self._unacked.pop(rid, None)
        return _pool_results(msg)

    def abort(self, request_id: str, timeout=_DEFAULT) -> bool:
        """Abort a request sent by this client. True if it was aborted, False if it had
        already finished (or was never in flight). An open stream of it ends with
        finish_reason "abort"."""
        temporary = request_id not in self._open
        if temporary:
            self._open[request_id] = deque()
        try:
            self._sock.send(P.encode(P.AbortRequest(request_id)))
            msg = self._next(request_id, self._timeout(timeout), peek=True)
            if temporary:
                self._open[request_id].popleft()
            return isinstance(msg, P.DoneReply) and msg.finish_reason == "abort"
        finally:
            if temporary:
                self._open.pop(request_id, None)

    def status(self, timeout=_DEFAULT) -> dict:
        """The daemon's status map (engine counters, pid, uptime...)."""
        return self._call(P.StatusRequest(id=self._new_id()), timeout).stats

    def metrics(self, timeout=_DEFAULT) -> str:
        """The daemon's Prometheus metrics, in the text exposition format."""
        return self._call(P.MetricsRequest(id=self._new_id()), timeout).text

    def tokenize(self, text: str, add_special_tokens: bool = False, timeout=_DEFAULT) -> list[int]:
        """The token ids of ``text`` by the daemon's tokenizer (a long text off its serving loop)."""
        return self._call(P.TokenizeRequest(self._new_id(), text, add_special_tokens), timeout).token_ids.tolist()

    def ping(self, timeout=_DEFAULT) -> float:
        """Round-trip time in seconds; raises ClientTimeout if the daemon does not answer."""
        start = time.perf_counter()
        self._call(P.PingRequest(id=self._new_id()), timeout)
        return time.perf_counter() - start

    def profile(self, seconds: float, timeout=_DEFAULT) -> list[str]:
        """Record a profiler trace on every rank for ``seconds`` while the daemon serves; returns
        the trace files written on the daemon's machine. ``timeout`` counts after ``seconds``."""
        timeout = self._timeout(timeout)
        msg = self._call(P.ProfileRequest(seconds, id=self._new_id()),
                         None if timeout is None else seconds + timeout)
        return msg.files

    def close(self) -> None:
        self._sock.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---- internals ---------------------------------------------------------------------------
    def _submit(self, prompt, params, request_id, stream, priority=None, request_timeout=None) -> str:
        rid, frame = self._generate_frame(prompt, params, request_id, stream, self._open, priority,
                                          request_timeout)
        self._open[rid] = deque()
        self._unacked[rid] = True
        self._sock.send(frame)
        return rid

    def _call(self, msg, timeout):
        self._open[msg.id] = deque()
        try:
            self._unacked[msg.id] = False
            self._sock.send(P.encode(msg))
            reply = self._next(msg.id, self._timeout(timeout))
        finally:
            self._open.pop(msg.id, None)
            self._unacked.pop(msg.id, None)
        return _checked(reply)

    def _next(self, rid: str, timeout: float | None, peek: bool = False) -> P.Message:
        """The next reply for ``rid`` (with ``peek``: the first terminal one, left queued)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        queue = self._open[rid]
        while True:
            if peek:
                for msg in queue:
                    if isinstance(msg, (P.DoneReply, P.ErrorReply)):
                        return msg
            elif queue:
                return queue.popleft()
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            if wait is not None and wait <= 0.0:
                raise ClientTimeout(self.address, timeout)
            if not self._sock.poll(None if wait is None else int(wait * 1000) + 1, zmq.POLLIN):
                continue
            msg = P.decode(self._sock.recv(), "reply")
            if msg.id is None:
                if isinstance(msg, P.ErrorReply):
                    for error in self._unattributed(msg):
                        if error.id in self._open:
                            self._open[error.id].append(error)
                continue
            self._unacked.pop(msg.id, None)
            target = self._open.get(msg.id)
            if target is not None:  # replies to ids nobody waits for any more are dropped
                target.append(msg)


class Stream:
    """Iterator over the ``Delta``s of one streaming request.

    After the last delta, ``result`` holds the ``GenerateResult`` (whose text/token_ids are the
    concatenation of all deltas). Closing the stream early (``close()``, ``break`` in a ``with``
    block, or garbage collection) aborts the request.
    """

    def __init__(self, client: Client, request_id: str, timeout: float | None):
        self.client = client
        self.request_id = request_id
        self.timeout = timeout
        self.result: GenerateResult | None = None
        self._parts: dict[int, tuple[list[str], list[int]]] = {}  # completion index -> its output
        self._closed = False

    def __iter__(self) -> Iterator[Delta]:
        return self

    def __next__(self) -> Delta:
        if self._closed:
            raise StopIteration
        try:
            msg = self.client._next(self.request_id, self.timeout)
        except ClientTimeout:
            self.close()
            raise
        if isinstance(msg, P.DeltaReply):
            text, tokens = self._parts.setdefault(msg.index, ([], []))
            text.append(msg.text)
            tokens.extend(msg.token_ids)
            return _delta(msg)
        self._finish()
        text, tokens = self._parts.get(0, ([], []))
        self.result = _result(self.request_id, msg, "".join(text), tokens)
        for c in self.result.completions or ():
            text, tokens = self._parts.get(c.index, ([], []))
            c.text, c.token_ids = "".join(text), tokens
        raise StopIteration

    def _finish(self) -> None:
        self._closed = True
        self.client._open.pop(self.request_id, None)
        self.client._unacked.pop(self.request_id, None)

    def close(self) -> None:
        """Stop listening; aborts the request on the daemon if it is still running."""
        if not self._closed:
            self._finish()
            self.client._send_abort_nowait(self.request_id)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


class AsyncClient(_ClientCore):
    """asyncio client with the same API; safe to use from many tasks of one event loop.

    A reader task routes replies by id to per-request queues; it starts with the first call.
    """

    def __init__(self, address: str | None = None, timeout: float | None = 30.0,
                 runtime_dir: str | os.PathLike | None = None, server_public_key=None,
                 client_keys=None, context: zmq.asyncio.Context | None = None):
        super().__init__(address, timeout, runtime_dir, context or zmq.asyncio.Context.instance(),
                         server_public_key, client_keys)
        self._queues: dict[str, asyncio.Queue] = {}
        self._abort_waiters: dict[str, asyncio.Future] = {}
        self._reader: asyncio.Task | None = None
        self._reader_error: BaseException | None = None

    async def generate(self, prompt, params: SamplingParams | None = None, *, request_id=None,
                       timeout=_DEFAULT, priority: int | None = None, request_timeout: float | None = None,
                       **sampling) -> GenerateResult:
        rid = await self._submit(prompt, _make_params(params, sampling), request_id, stream=False,
                                 priority=priority, request_timeout=request_timeout)
        done = False
        try:
            msg = await self._get(rid, self._timeout(timeout))
            done = True
        finally:
            self._queues.pop(rid, None)
            self._unacked.pop(rid, None)
            if not done:  # cancelled (or timed out): the daemon stops the request
                self._send_abort_nowait(rid)
        return _result(rid, msg)

    async def stream(self, prompt, params: SamplingParams | None = None, *, request_id=None,
                     timeout=_DEFAULT, final: bool = False, priority: int | None = None,
                     request_timeout: float | None = None, **sampling) -> AsyncIterator[Delta]:
        """Async generator of ``Delta``s; closing it early aborts the request.

        With ``final`` the last item is a ``GenerateResult`` carrying the finish reason and
        token counts (its text and token_ids are empty: the deltas carried them).
        ``priority``, ``request_timeout``: as for ``Client.generate``."""
        rid = await self._submit(prompt, _make_params(params, sampling), request_id, stream=True,
                                 priority=priority, request_timeout=request_timeout)
        done = False
        try:
            while True:
                msg = await self._get(rid, self._timeout(timeout))
                if isinstance(msg, P.DeltaReply):
                    yield _delta(msg)
                    continue
                done = True
                result = _result(rid, msg, "", [])
                if final:
                    yield result
                return
        finally:
            self._queues.pop(rid, None)
            self._unacked.pop(rid, None)
            if not done:
                self._send_abort_nowait(rid)

    async def embed(self, prompts: list[list[int]], *, dimensions: int | None = None,
                    normalize: bool | None = None, priority: int = 0, timeout=_DEFAULT,
                    request_timeout: float | None = None,
                    request_id: str | None = None) -> list[PoolingResult]:
        """As ``Client.embed``."""
        return await self._pool(prompts, "embed", dimensions, normalize, priority, timeout, request_timeout,
                                request_id)

    async def classify(self, prompts: list[list[int]], *, priority: int = 0, timeout=_DEFAULT,
                       request_timeout: float | None = None,
                       request_id: str | None = None) -> list[PoolingResult]:
        """As ``Client.classify``."""
        return await self._pool(prompts, "classify", None, None, priority, timeout, request_timeout,
                                request_id)

    async def _pool(self, prompts, task, dimensions, normalize, priority, timeout, request_timeout,
                    request_id):
        rid, frame = self._pool_frame(prompts, task, dimensions, normalize, priority, request_timeout,
                                      request_id, self._queues)
        self._queues[rid] = asyncio.Queue()
        self._ensure_reader()
        self._unacked[rid] = True
        done = False
        try:
            await self._sock.send(frame)
            msg = await self._get(rid, self._timeout(timeout))
            done = True
        finally:
            self._queues.pop(rid, None)
            self._unacked.pop(rid, None)
            if not done:  # cancelled (or timed out): the daemon stops the request
                self._send_abort_nowait(rid)
        return _pool_results(msg)

    async def abort(self, request_id: str, timeout=_DEFAULT) -> bool:
        """True if the request was aborted, False if it was not in flight."""
        fut = asyncio.get_running_loop().create_future()
        self._abort_waiters[request_id] = fut
        self._ensure_reader()
        try:
            await self._sock.send(P.encode(P.AbortRequest(request_id)))
            return await self._wait(fut, self._timeout(timeout))
        finally:
            self._abort_waiters.pop(request_id, None)

    async def status(self, timeout=_DEFAULT) -> dict:
        return (await self._call(P.StatusRequest(id=self._new_id()), timeout)).stats

    async def metrics(self, timeout=_DEFAULT) -> str:
        return (await self._call(P.MetricsRequest(id=self._new_id()), timeout)).text

    async def tokenize(self, text: str, add_special_tokens: bool = False, timeout=_DEFAULT) -> list[int]:
        reply = await self._call(P.TokenizeRequest(self._new_id(), text, add_special_tokens), timeout)
        return reply.token_ids.tolist()

    async def ping(self, timeout=_DEFAULT) -> float:
        start = time.perf_counter()
        await self._call(P.PingRequest(id=self._new_id()), timeout)
        return time.perf_counter() - start

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            try:
                await self._reader
            except (asyncio.CancelledError, Exception):
                pass
        self._sock.close()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()

    # ---- internals ---------------------------------------------------------------------------
    async def _submit(self, prompt, params, request_id, stream, priority=None, request_timeout=None) -> str:
        rid, frame = self._generate_frame(prompt, params, request_id, stream, self._queues, priority,
                                          request_timeout)
        self._queues[rid] = asyncio.Queue()
        self._ensure_reader()
        self._unacked[rid] = True  # before the send: the reader may see its reply before it returns
        await self._sock.send(frame)
        return rid

    async def _call(self, msg, timeout):
        self._queues[msg.id] = asyncio.Queue()
        self._ensure_reader()
        try:
            self._unacked[msg.id] = False
            await self._sock.send(P.encode(msg))
            reply = await self._get(msg.id, self._timeout(timeout))
        finally:
            self._queues.pop(msg.id, None)
            self._unacked.pop(msg.id, None)
        return _checked(reply)

    async def _get(self, rid: str, timeout):
        try:
            return await self._wait(self._queues[rid].get(), timeout)
        except ClientTimeout:
            self._send_abort_nowait(rid)
            raise

    async def _wait(self, awaitable, timeout):
        try:
            return await asyncio.wait_for(awaitable, timeout)
        except asyncio.TimeoutError:
            if self._reader_error is not None:
                raise self._reader_error from None
            raise ClientTimeout(self.address, timeout) from None

    def _ensure_reader(self) -> None:
        if self._reader is None or self._reader.done():
            self._reader = asyncio.get_running_loop().create_task(self._read())

    async def _read(self) -> None:
        try:
            while True:
                msg = P.decode(await self._sock.recv(), "reply")
                rid = msg.id
                if rid is None:
                    if isinstance(msg, P.ErrorReply):
                        for error in self._unattributed(msg):
                            queue = self._queues.get(error.id)
                            if queue is not None:
                                queue.put_nowait(error)
                    continue
                self._unacked.pop(rid, None)
                terminal = isinstance(msg, (P.DoneReply, P.ErrorReply))
                fut = self._abort_waiters.get(rid)
                if terminal and fut is not None and not fut.done():
                    aborted = isinstance(msg, P.DoneReply) and msg.finish_reason == "abort"
                    fut.set_result(aborted)
                    if isinstance(msg, P.ErrorReply) and msg.code == P.UNKNOWN_ID:
                        continue  # the answer to the abort itself, not to a stream
                queue = self._queues.get(rid)
                if queue is not None:
                    queue.put_nowait(msg)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # undecodable reply: fail waiters instead of leaving them hanging
            self._reader_error = e
            raise
