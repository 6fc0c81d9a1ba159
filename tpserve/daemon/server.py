"""The daemon's front: a ZMQ ROUTER socket in front of one Engine.

``Server(engine, address, options).run()`` interleaves, on one thread:

* draining the socket without blocking, at most ``max_messages_per_step`` frames per engine step
  (so a flood of requests cannot starve running ones),
* one ``engine.step()`` while the engine has unfinished work, sending each output as a ``delta``
  and/or ``done`` to the client that asked,
* retrying sends that a slow client's high-water mark refused.

When the engine is idle it blocks in ``zmq.Poller.poll`` on the socket and a wake-up socket pair
(written by signal handlers and ``request_shutdown``), so an idle daemon uses no CPU.

Request ids are scoped per connection (the ZMQ routing id of the client's DEALER): two clients
may use the same id; one client may reuse an id once its ``done``/``error`` was sent. The engine
sees ``"<connection tag>:<id>"``.

Invariants:
* every request in ``_requests`` is unfinished in the engine, and vice versa for requests the
  server added; a request leaves ``_requests`` exactly when its ``done`` or ``error`` is queued
  (or its client is dropped), and the engine is told to abort it unless it finished there.
* messages to one client leave in the order they were produced: once a send is refused, later
  messages queue behind it in that client's outbox.
* a client whose outbox has not moved for ``client_timeout`` seconds, or that disconnected
  (EHOSTUNREACH), is dropped: its requests are aborted in the engine, freeing their KV blocks.
* every frame received gets exactly one answer (docs/protocol.md), also frames still queued
  when a shutdown begins: they are drained and answered before the socket closes.
"""
from __future__ import annotations

import errno
import logging
import os
import socket
import time
from collections import deque
from dataclasses import dataclass, field

import zmq

from tpserve.errors import AdmissionError, ConfigError
from tpserve.daemon import protocol as P
from tpserve.daemon.metrics import ServingMetrics

log = logging.getLogger("tpserve.daemon")

_STALL_ON_EXIT = 2.0   # s without progress before a client's last messages are given up at exit
_EXIT_FLUSH = 10.0     # s at most spent delivering last messages at exit
_EXIT_DRAIN_ROUNDS = 100  # rounds of max_messages_per_step frames answered at exit
_CLOSE_LINGER_MS = 2000  # then at most this long for ZMQ to hand queued frames to the kernel


@dataclass
class ServerOptions:
    """Knobs of the front. ``curve_*`` enable CurveZMQ; ``curve_client_keys`` limits clients."""

    client_timeout: float = 30.0
    shutdown_grace: float = 0.0
    max_messages_per_step: int = 64
    send_hwm: int = 1000
    curve_public_key: bytes | None = None
    curve_secret_key: bytes | None = None
    curve_client_keys_dir: str | None = None
    served_model_name: str | None = None  # metrics label; default: the model directory's name


@dataclass
class _Peer:
    identity: bytes
    tag: int
    requests: dict[str, "_Request"] = field(default_factory=dict)
    outbox: deque = field(default_factory=deque)
    blocked_since: float = 0.0


@dataclass
class _Request:
    peer: _Peer
    client_id: str
    engine_id: str
    stream: bool
    prompt_tokens: int
    completion_tokens: int = 0
    text_parts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list | None = None  # wire entries gathered for a non-streamed reply
    arrival: float = 0.0
    last_token: float | None = None


def served_model_name(engine, options: ServerOptions) -> str:
    """The name clients and metrics know the model by."""
    if options.served_model_name:
        return options.served_model_name
    path = getattr(getattr(engine, "config", None), "model_path", None)
    return os.path.basename(os.path.normpath(str(path))) if path else "tpserve"


def _wire_logprobs(logprobs) -> list | None:
    if logprobs is None:
        return None
    return [[lp.logprob, [[t, v] for t, v in lp.top]] for lp in logprobs]


class Server:
    """See the module docstring. Construct (binds), then ``run()``; ``close()`` when done."""

    def __init__(self, engine, address: str, options: ServerOptions | None = None,
                 context: zmq.Context | None = None):
        self.engine = engine
        self.address = address
        self.options = options or ServerOptions()
        # An own context by default, so close() can wait (term) until final replies are out.
        self._own_context = context is None
        self._ctx = context or zmq.Context()
        self._auth = None
        self._peers: dict[bytes, _Peer] = {}
        self._requests: dict[str, _Request] = {}  # by engine id
        self._next_tag = 0
        self._started = time.monotonic()
        self._stop_requested = False
        self._stopping = False
        self._stop_deadline = 0.0
        self.exit_code = 0
        self._metrics: ServingMetrics | None = None

        self.sock = self._ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, _CLOSE_LINGER_MS)
        self.sock.setsockopt(zmq.MAXMSGSIZE, P.MAX_MESSAGE_BYTES)
        self.sock.setsockopt(zmq.SNDHWM, self.options.send_hwm)
        # Mandatory routing turns "peer gone" and "peer full" into errors (EHOSTUNREACH, EAGAIN)
        # instead of silent drops, so a stream is never missing a piece.
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        if self.options.curve_secret_key is not None:
            self._enable_curve()
        try:
            self.sock.bind(address)
        except zmq.ZMQError as e:
            self.sock.close(linger=0)
            self._stop_auth()
            if self._own_context:
                self._ctx.term()
            raise OSError(e.errno, f"cannot bind {address}: {e.strerror}") from None
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self.poller = zmq.Poller()
        self.poller.register(self.sock, zmq.POLLIN)
        self.poller.register(self._wake_r.fileno(), zmq.POLLIN)

    def _enable_curve(self) -> None:
        opts = self.options
        if opts.curve_client_keys_dir is not None:
            from zmq.auth.thread import ThreadAuthenticator
            self._auth = ThreadAuthenticator(self._ctx, log=logging.getLogger("tpserve.daemon.auth"))
            self._auth.start()
            self._auth.configure_curve(domain="*", location=str(opts.curve_client_keys_dir))
        self.sock.curve_server = True
        self.sock.curve_secretkey = opts.curve_secret_key
        self.sock.curve_publickey = opts.curve_public_key

    def _stop_auth(self) -> None:
        if self._auth is not None:
            self._auth.stop()
            self._auth = None

    # ---- life cycle --------------------------------------------------------------------------
    def request_shutdown(self) -> None:
        """Begin a graceful shutdown at the next loop turn (safe from signal handlers/threads)."""
        self._stop_requested = True
        try:
            self._wake_w.send(b"\0")
        except OSError:
            pass  # buffer full: a wake-up is already pending

    @property
    def wake_fd(self) -> int:
        """Write end of the wake-up pair, for ``signal.set_wakeup_fd``."""
        return self._wake_w.fileno()

    def run(self) -> int:
        """Serve until a requested shutdown completes or the engine fails. Returns the exit code."""
        log.info("serving on %s", self.address)
        try:
            while True:
                if self._stop_requested and not self._stopping:
                    self._begin_shutdown()
                if self._stopping and (not self._requests or time.monotonic() >= self._stop_deadline):
                    break
                self._turn()
        except _EngineFailed:
            self.exit_code = 1
            self._stopping = True  # queued generates get shutting_down, not a dead engine
        self._finish_shutdown()
        return self.exit_code

    def _turn(self) -> None:
        busy = self.engine.has_unfinished()
        if busy:
            timeout = 0
        elif self._stopping or any(p.outbox for p in self._peers.values()):
            timeout = 20  # ms: retry refused sends / watch the grace deadline
        else:
            timeout = None  # idle: sleep until a message or a wake-up
        events = dict(self.poller.poll(timeout))
        if self._wake_r.fileno() in events:
            try:
                while self._wake_r.recv(4096):
                    pass
            except (BlockingIOError, InterruptedError):
                pass
        if self.sock in events:
            self._drain()
        if self.engine.has_unfinished():
            try:
                outputs = self.engine.step()
            except Exception as e:  # a dead worker or a kernel error: nothing can be trusted now
                log.exception("engine step failed; shutting down")
                self._fail_all(f"engine failed: {type(e).__name__}: {e}")
                raise _EngineFailed from e
            self._dispatch(outputs)
        self._flush()

    def _begin_shutdown(self) -> None:
        self._stopping = True
        self._stop_deadline = time.monotonic() + self.options.shutdown_grace
        log.info("shutting down: no new requests; %d in flight%s", len(self._requests),
                 f", {self.options.shutdown_grace:g} s grace" if self.options.shutdown_grace else "")

    def _finish_shutdown(self) -> None:
        # Frames that arrived before the stop are still answered (generate: shutting_down).
        for _ in range(_EXIT_DRAIN_ROUNDS):
            if self._drain() < self.options.max_messages_per_step:
                break
        for req in list(self._requests.values()):
            self._abort(req, "shutting_down")
        # Let clients take their final messages while they keep reading; a client whose queue
        # has not moved for STALL_ON_EXIT seconds is dropped, and nobody delays exit past EXIT_FLUSH.
        stall = min(self.options.client_timeout, _STALL_ON_EXIT)
        deadline = time.monotonic() + _EXIT_FLUSH
        while any(p.outbox for p in self._peers.values()) and time.monotonic() < deadline:
            self._flush(stall)
            time.sleep(0.005)
        log.info("front stopped")

    def close(self) -> None:
        """Close the socket; returns once queued replies are delivered (at most 2 s)."""
        self.sock.close(linger=_CLOSE_LINGER_MS)
        self._stop_auth()
        self._wake_r.close()
        self._wake_w.close()
        if self._own_context:
            self._ctx.term()  # waits for the linger of the socket above

    # ---- receiving ---------------------------------------------------------------------------
    def _drain(self) -> int:
        """Handle at most max_messages_per_step queued frames; returns how many there were."""
        for n in range(self.options.max_messages_per_step):
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                return n
            try:
                self._handle(frames)
            except _EngineFailed:
                raise
            except Exception as e:  # a bug must cost one request, not the daemon
                log.exception("failed to handle a message")
                self._reply(frames[0], P.ErrorReply(P.INTERNAL, f"{type(e).__name__}: {e}"[:P.MAX_MESSAGE_CHARS]))
        return self.options.max_messages_per_step

    def _handle(self, frames: list[bytes]) -> None:
        identity = frames[0]
        if len(frames) != 2:
            self._reply(identity, P.ErrorReply(P.BAD_MESSAGE,
                        f"a message is exactly one frame (a DEALER send of one msgpack map); got {len(frames) - 1}"))
            return
        obj = None
        try:
            obj = P.unpack_frame(frames[1])
            msg = P.decode(obj, "request")
        except P.ProtocolError as e:
            self._reply(identity, P.ErrorReply(e.code, e.message[:P.MAX_MESSAGE_CHARS],
                                               id=P.readable_id(obj), field=e.field))
            return
        if isinstance(msg, P.GenerateRequest):
            self._on_generate(identity, msg)
        elif isinstance(msg, P.AbortRequest):
            self._on_abort(identity, msg)
        elif isinstance(msg, P.StatusRequest):
            self._reply(identity, P.StatusReply(self.stats(), id=msg.id))
        elif isinstance(msg, P.MetricsRequest):
            self._reply(identity, P.MetricsReply(self.metrics.render(), id=msg.id))
        else:
            assert isinstance(msg, P.PingRequest)
            self._reply(identity, P.PongReply(id=msg.id))

    def _on_generate(self, identity: bytes, msg: P.GenerateRequest) -> None:
        def error(code, message, **kw):
            self._reply(identity, P.ErrorReply(code, message[:P.MAX_MESSAGE_CHARS], id=msg.id, **kw))

        if self._stopping:
            return error(P.SHUTTING_DOWN, "the daemon is shutting down and admits no new requests")
        peer = self._peers.get(identity)
        if peer is not None and msg.id in peer.requests:
            return error(P.DUPLICATE_ID, f"request id {msg.id!r} is already in flight on this connection",
                         field="id")
        if isinstance(msg.prompt, list):
            vocab = _vocab_size(self.engine)
            if vocab is not None:
                bad = next((i for i, t in enumerate(msg.prompt) if t >= vocab), None)
                if bad is not None:
                    return error(P.INVALID_FIELD, f"token id {msg.prompt[bad]} is outside the vocabulary "
                                 f"[0, {vocab})", field=f"prompt[{bad}]")
        peer = self._peer(identity)
        engine_id = f"{peer.tag}:{msg.id}"
        try:
            num_prompt_tokens = self.engine.add_request(engine_id, msg.prompt, msg.params)
        except AdmissionError as e:
            over = e.requested - e.allowed
            error(P.ADMISSION, f"request needs {e.limit}={e.requested} but the engine allows {e.allowed} "
                  f"(over by {over})", limit=e.limit, requested=int(e.requested), allowed=int(e.allowed))
        except ConfigError as e:  # the engine's own input checks (e.g. empty after tokenizing)
            error(P.INVALID_REQUEST, e.reason, field=e.field)
        except ValueError as e:
            error(P.INVALID_REQUEST, str(e))
        except Exception as e:
            log.exception("add_request failed for %s", engine_id)
            error(P.INTERNAL, f"the engine could not add the request: {type(e).__name__}: {e}")
        else:
            req = _Request(peer, msg.id, engine_id, msg.stream, prompt_tokens=num_prompt_tokens,
                           arrival=time.monotonic())
            peer.requests[msg.id] = req
            self.metrics.on_admitted(num_prompt_tokens)
            self._requests[engine_id] = req
        self._forget_if_idle(peer)

    def _on_abort(self, identity: bytes, msg: P.AbortRequest) -> None:
        peer = self._peers.get(identity)
        req = peer.requests.get(msg.id) if peer is not None else None
        if req is None:
            self._reply(identity, P.ErrorReply(P.UNKNOWN_ID, f"no request {msg.id!r} is in flight on this "
                                               "connection (finished, never started, or sent by another "
                                               "connection)", id=msg.id, field="id"))
            return
        self._abort(req, "client")

    # ---- engine outputs ----------------------------------------------------------------------
    def _dispatch(self, outputs) -> None:
        now = time.monotonic()
        metrics = self.metrics
        for out in outputs:
            req = self._requests.get(out.request_id)
            if req is None:
                continue  # aborted or dropped since the engine produced it
            if out.num_prompt_tokens:
                req.prompt_tokens = out.num_prompt_tokens
            req.completion_tokens += len(out.new_token_ids)
            if out.new_token_ids:
                metrics.on_tokens(len(out.new_token_ids), now, req.arrival, req.last_token, out.queue_time)
                req.last_token = now
            logprobs = _wire_logprobs(out.logprobs)
            if req.stream:
                if out.new_token_ids or out.new_text:
                    self._send(req.peer, P.DeltaReply(req.client_id, out.new_text, list(out.new_token_ids),
                                                      logprobs=logprobs))
            else:
                req.text_parts.append(out.new_text)
                req.token_ids.extend(out.new_token_ids)
                if logprobs is not None:
                    if req.logprobs is None:
                        req.logprobs = []
                    req.logprobs.extend(logprobs)
            if out.finished:
                metrics.on_finished(now, req.arrival)
                self._close(req)
                done = P.DoneReply(req.client_id, out.finish_reason or "stop", req.prompt_tokens,
                                   out.num_completion_tokens or req.completion_tokens,
                                   abort_reason=None)
                if not req.stream:
                    done.text, done.token_ids = "".join(req.text_parts), req.token_ids
                    done.logprobs = req.logprobs
                self._send(req.peer, done)
                self._forget_if_idle(req.peer)

    def _abort(self, req: _Request, reason: str) -> None:
        """Abort ``req`` in the engine and tell its client (``done`` with finish_reason abort)."""
        self._close(req)
        self.engine.abort_request(req.engine_id)
        done = P.DoneReply(req.client_id, "abort", req.prompt_tokens, req.completion_tokens,
                           abort_reason=reason)
        if not req.stream:
            done.text, done.token_ids = "".join(req.text_parts), req.token_ids
        self._send(req.peer, done)
        self._forget_if_idle(req.peer)

    def _close(self, req: _Request) -> None:
        del self._requests[req.engine_id]
        del req.peer.requests[req.client_id]

    def _fail_all(self, message: str) -> None:
        for req in list(self._requests.values()):
            self._close(req)
            self._send(req.peer, P.ErrorReply(P.INTERNAL, message[:P.MAX_MESSAGE_CHARS], id=req.client_id))

    # ---- sending -----------------------------------------------------------------------------
    def _peer(self, identity: bytes) -> _Peer:
        peer = self._peers.get(identity)
        if peer is None:
            self._next_tag += 1
            peer = self._peers[identity] = _Peer(identity, self._next_tag)
        return peer

    def _forget_if_idle(self, peer: _Peer) -> None:
        if not peer.requests and not peer.outbox and self._peers.get(peer.identity) is peer:
            del self._peers[peer.identity]

    def _reply(self, identity: bytes, msg: P.Message) -> None:
        """Answer a request outside any generation (errors, status, pong)."""
        peer = self._peer(identity)
        self._send(peer, msg)
        self._forget_if_idle(peer)

    def _send(self, peer: _Peer, msg: P.Message) -> None:
        try:
            frame = P.encode(msg)
        except P.ProtocolError:
            log.exception("dropping a reply that does not encode: %r", msg)
            return
        if peer.outbox:
            peer.outbox.append(frame)
            return
        self._try_send(peer, frame)

    def _try_send(self, peer: _Peer, frame: bytes) -> bool:
        """Send one frame now; on refusal queue it (full) or drop the peer (gone)."""
        try:
            self.sock.send_multipart([peer.identity, frame], zmq.NOBLOCK)
            return True
        except zmq.Again:
            if not peer.outbox:
                peer.blocked_since = time.monotonic()
            peer.outbox.append(frame)
        except zmq.ZMQError as e:
            if e.errno != errno.EHOSTUNREACH:
                raise
            self._drop_peer(peer, "disconnected")
        return False

    def _flush(self, stall_timeout: float | None = None) -> None:
        stall_timeout = self.options.client_timeout if stall_timeout is None else stall_timeout
        now = time.monotonic()
        for peer in [p for p in self._peers.values() if p.outbox]:
            while peer.outbox:
                frame = peer.outbox[0]
                try:
                    self.sock.send_multipart([peer.identity, frame], zmq.NOBLOCK)
                except zmq.Again:
                    break
                except zmq.ZMQError as e:
                    if e.errno != errno.EHOSTUNREACH:
                        raise
                    self._drop_peer(peer, "disconnected")
                    break
                peer.outbox.popleft()
                peer.blocked_since = now
            if peer.outbox and now - peer.blocked_since > stall_timeout:
                self._drop_peer(peer, f"not reading for {stall_timeout:g} s")
            else:
                self._forget_if_idle(peer)

    def _drop_peer(self, peer: _Peer, why: str) -> None:
        """Abort every request of a client that is gone or stalled; nothing more is sent to it."""
        if peer.requests:
            log.warning("client %s %s: aborting %d request(s)", peer.identity.hex(), why, len(peer.requests))
        for req in list(peer.requests.values()):
            self._close(req)
            self.engine.abort_request(req.engine_id)
        peer.outbox.clear()
        if self._peers.get(peer.identity) is peer:
            del self._peers[peer.identity]

    # ---- status ------------------------------------------------------------------------------
    @property
    def metrics(self) -> ServingMetrics:
        """The Prometheus metrics, made once the engine is attached (it names the model)."""
        if self._metrics is None:
            self._metrics = ServingMetrics(served_model_name(self.engine, self.options), self.engine.stats)
        return self._metrics

    def stats(self) -> dict:
        """Engine counters plus the daemon's own, as plain msgpack-able values."""
        try:
            stats = dict(self.engine.stats())
        except Exception as e:
            log.exception("engine.stats() failed")
            stats = {"stats_error": f"{type(e).__name__}: {e}"}
        stats.update(pid=os.getpid(), uptime_s=round(time.monotonic() - self._started, 3),
                     address=self.address, protocol_version=P.PROTOCOL_VERSION,
                     state="shutting_down" if self._stopping else "running",
                     requests_in_flight=len(self._requests), clients=len(self._peers))
        return {str(k): _plain(v) for k, v in list(stats.items())[:P.MAX_STATUS_ENTRIES]}


class _EngineFailed(Exception):
    """Raised inside ``run`` when engine.step() failed; ends the loop with exit code 1."""


def _plain(v):
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if hasattr(v, "item"):  # numpy / torch scalars
        return v.item()
    return str(v)


def _vocab_size(engine) -> int | None:
    cfg = getattr(engine, "config", None)
    hf = getattr(cfg, "hf_config", None) or {}
    vocab = hf.get("vocab_size")
    return int(vocab) if vocab else None
