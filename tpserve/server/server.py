"""The daemon's front: a ZMQ ROUTER socket in front of one Engine.

``Server(engine, address, options).run()`` interleaves, on one thread:

* draining the socket without blocking, at most ``max_messages_per_step`` frames per engine step
  (so a flood of requests cannot starve running ones),
* one ``engine.step()`` while the engine has unfinished work, sending each output as a ``delta``
  and/or ``done`` to the client that asked (a step that fails with StepFailedError costs only
  its own requests, answered ``step_failed``; any other engine failure ends the daemon),
* admitting text prompts longer than ``inline_tokenize_chars`` once they are tokenized off the
  loop (tokenizing.py): tokenizing megabytes takes seconds, and no other client may wait for that
  (``tokenize`` requests, the HTTP front's long prompts, take the same way); meanwhile the engine
  lends the tokenizer one of its cores (Engine.lend_cores),
* retrying sends that a slow client's high-water mark refused (outbox.py).

When the engine is idle it sleeps in the listener's poll (listener.py) on the socket, a wake-up
socket pair (written by signal handlers and ``request_shutdown``) and the engine's health fd
(readable once a tensor-parallel worker died), so an idle daemon uses no CPU and still notices a
dead worker at once: it then fails every request in flight, reports ``state: failed`` and exits 1.

Request ids are scoped per connection (the ZMQ routing id of the client's DEALER): two clients
may use the same id; one client may reuse an id once its ``done``/``error`` was sent. The engine
sees ``"<connection tag>:<id>"``.

The engine is reached only through ``ServingEngine`` (engine_api.py); request validation is
the wire decoder's (the request model's, tpserve/request.py) and the engine's, whose typed
errors map to wire error codes (admission.py). ``Server`` is this loop; its parts live in
modules of their own: admission.py (adding requests to the engine, the fair queue's held
requests), tokenize_requests.py (long prompts and ``tokenize`` requests), client_requests.py
(a request's state and the replies its outputs make), status.py (``status`` and metrics).

Invariants:
* every request in ``_requests`` is unfinished in the engine, and vice versa for requests the
  server added; a request leaves ``_requests`` exactly when its ``done`` or ``error`` is queued
  (or its client is dropped), and the engine is told to abort it unless it finished there.
* a request whose prompt is being tokenized is in ``_tokenizer`` and its peer's ``requests``
  (so ``abort`` and ``duplicate_id`` see it) but not yet in the engine; so is a request in
  ``_queue``, held back while the engine has no room (fair_queue.py). A request is in exactly
  one of ``_requests``, ``_tokenizer`` and ``_queue`` while it is in flight.
* a connection has at most ``max_requests_per_connection`` requests in flight.
* messages to one client leave in the order they were produced: once a send is refused, later
  messages queue behind it in that client's outbox (a waiting delta takes in the later deltas
  of its request, so each request's text and tokens keep their order).
* a client that disconnected (its connection closed, or EHOSTUNREACH), or for which more than
  ``max_queued_replies`` messages wait, is dropped: its requests are aborted in the engine,
  freeing their KV blocks. A client that reads, however slowly, is not (outbox.py).
* whenever the engine has become idle, its integrity check runs once (``check_integrity``:
  every KV block free, nothing queued); a broken invariant fails the daemon like a dead engine.
* every frame received gets exactly one answer (docs/protocol.md), also frames still queued
  when a shutdown begins: they are drained and answered before the socket closes.

Pressure: a request carries a ``priority`` and a ``timeout`` (default ``request_timeout``),
counted from its arrival here, tokenizing included; a full waiting queue refuses it with
``overloaded`` and a ``retry_after`` estimate. A shutdown is a drain: new requests get
``shutting_down`` (with the seconds the drain has left as ``retry_after``) while those in flight,
queued ones included, finish for up to ``shutdown_grace`` seconds; then the rest end with
finish_reason "abort", abort_reason "shutting_down". ``request_shutdown(now=True)`` (a second
signal) ends the drain at once. ``status`` says ``state: shutting_down`` and ``ready: false``
from the drain's first moment.
"""
from __future__ import annotations

import array
import logging
import math
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable

import zmq

from tpserve.client import protocol as P
from tpserve.server.admission import Admission
from tpserve.server.client_requests import ClientRequest
from tpserve.server.engine_api import ServingEngine
from tpserve.server.fair_queue import FairQueue
from tpserve.server.kv_events import KVEventsOptions
from tpserve.server.listener import Listener
from tpserve.server.metrics import ServingMetrics
from tpserve.server.outbox import Peer, Peers
from tpserve.server.profiling import ProfileRecorder
from tpserve.server.status import StatusReport
from tpserve.server.tokenize_requests import TokenizeRequests
from tpserve.server.tokenizing import CONTENDED_CPU_SHARE, PromptTokenizer
from tpserve.errors import InvalidFieldError, StepFailedError
from tpserve.pooling import PoolingParams
from tpserve.tokenizer import TokenizerProcess

log = logging.getLogger("tpserve.daemon")

_STALL_ON_EXIT = 2.0   # s without progress before a client's last messages are given up at exit
_EXIT_FLUSH = 10.0     # s at most spent delivering last messages at exit
_EXIT_DRAIN_ROUNDS = 100  # rounds of max_messages_per_step frames answered at exit


@dataclass
class ServerOptions:
    """Knobs of the front. ``curve_*`` enable CurveZMQ; ``curve_client_keys`` limits clients."""

    #: seconds a drain lets requests in flight finish before aborting them
    shutdown_grace: float = 30.0
    #: seconds a request without a ``timeout`` of its own may take (None: no limit)
    request_timeout: float | None = None
    max_messages_per_step: int = 64
    send_hwm: int = 1000
    #: Requests one connection may have in flight (queued, tokenizing or running); past it a
    #: ``generate`` is answered ``too_many_requests``.
    max_requests_per_connection: int = 4096
    #: Messages that may wait for one connection (its deltas merged, so about two per request)
    #: before it counts as not reading and is dropped.
    max_queued_replies: int = 65536
    #: Text prompts longer than this are tokenized off the serving loop.
    inline_tokenize_chars: int = 8192
    #: Where ``profile`` traces are written (the daemon uses its runtime dir); None: the temp dir.
    profile_dir: str | None = None
    curve_public_key: bytes | None = None
    curve_secret_key: bytes | None = None
    curve_client_keys_dir: str | None = None
    served_model_name: str | None = None  # metrics label; default: the model directory's name
    kv_events: KVEventsOptions | None = None  # publish prefix-cache events (kv_events.py)


class Server(Admission, TokenizeRequests, StatusReport):
    """See the module docstring. Construct (binds), then ``run()``; ``close()`` when done."""

    def __init__(self, engine: ServingEngine | None, address: str, options: ServerOptions | None = None,
                 context: zmq.Context | None = None):
        self.engine = engine
        self.address = address
        self.options = options = options or ServerOptions()
        self.listener = Listener(address, options.send_hwm, context, options.curve_public_key,
                                 options.curve_secret_key, options.curve_client_keys_dir)
        self.peers = Peers(self.listener.sock, self._on_peer_gone, options.max_queued_replies)
        self._requests: dict[str, ClientRequest] = {}  # by engine id
        self._queue = FairQueue()  # received, not yet in the engine: Held by engine id
        # (deadline, engine id) of queued requests with a timeout: they end at it, held or not
        self._held_deadlines: list[tuple[float, str]] = []
        self._held_timed_out = 0
        self._tokenizer = PromptTokenizer(self._tokenize, self.listener.wake)
        # tokenize requests waiting for their ids: (connection, id) -> future of the ids
        self._encodes: dict[tuple[bytes, str], Future] = {}
        self._cores_lent = 0  # to the tokenizer, while it works
        self._tokenizer_process: TokenizerProcess | None = None  # made by the tokenizing thread
        self._tokenizer_process_lock = threading.Lock()
        self._closed = False
        self._profiler = ProfileRecorder(options.profile_dir)
        self._started = time.monotonic()
        self._stop_requested = False
        self._stop_now = False
        self._stopping = False
        self._stop_deadline = 0.0
        self.exit_code = 0
        self.failure: str | None = None  # why the engine stopped working, once it has
        self._health_fd: int | None = None
        self._metrics: ServingMetrics | None = None
        #: more entries for the status map (the daemon's HTTP front reports its state here)
        self.status_extras: Callable[[], dict] | None = None
        self._kv_events = None
        if self.options.kv_events is not None:
            try:
                self._kv_events = self.options.kv_events.publisher()
            except OSError:
                self.close()
                raise
        self._checked_idle = True  # the engine's integrity was checked since it last worked

    # ---- life cycle --------------------------------------------------------------------------
    def request_shutdown(self, now: bool = False) -> None:
        """Begin the drain at the next loop turn; ``now``: end it (or skip it) at once, aborting
        what is in flight. Safe from signal handlers and other threads."""
        self._stop_requested = True
        self._stop_now = self._stop_now or now
        self.listener.wake()

    @property
    def draining(self) -> bool:
        """Whether the drain has begun (no new requests; the loop still serves)."""
        return self._stopping

    @property
    def wake_fd(self) -> int:
        """Write end of the wake-up pair, for ``signal.set_wakeup_fd``."""
        return self.listener.wake_fd

    def run(self) -> int:
        """Serve until a requested shutdown completes or the engine fails. Returns the exit code."""
        log.info("serving on %s", self.address)
        self._health_fd = self.engine.health_fd()
        if self._kv_events is not None:
            self.engine.enable_kv_events()
        if self._health_fd is not None:  # a worker dying while the loop sleeps must wake it
            self.listener.watch(self._health_fd)
        if self.engine.tokenizer_path() is not None:
            self._tokenizer.prepare()  # the tokenizer process starts now, not with the first long prompt
        try:
            while True:
                if self._stop_requested and not self._stopping:
                    self._begin_shutdown()
                if self._stopping and self._stop_now:
                    self._stop_deadline = min(self._stop_deadline, time.monotonic())
                if self._stopping and not (self._requests or self._tokenizer or self._queue or self._encodes):
                    break
                if self._stopping and time.monotonic() >= self._stop_deadline:
                    log.warning("the drain ended%s: aborting %d request(s) still in flight",
                                " on a second stop signal" if self._stop_now
                                else f" after its {self.options.shutdown_grace:g} s",
                                len(self._requests) + len(self._tokenizer) + len(self._queue))
                    break
                self._turn()
        except _EngineFailed:
            self.exit_code = 1
            self._stopping = True  # queued generates get shutting_down, not a dead engine
        self._finish_shutdown()
        return self.exit_code

    def _turn(self) -> None:
        busy = self.engine.has_unfinished()
        if not busy and not self._checked_idle:
            self._check_idle_engine()
        if busy:
            timeout = 0
        elif self._stopping or self.peers.any_queued():
            timeout = 20  # ms: retry refused sends / watch the grace deadline
        else:
            timeout = None  # idle: sleep until a message or a wake-up
        deadline = self._profiler.deadline
        if deadline is not None and timeout != 0:
            left_ms = max(0, int((deadline - time.monotonic()) * 1000) + 1)
            timeout = left_ms if timeout is None else min(timeout, left_ms)
        events = self.listener.poll(timeout)
        if self._health_fd is not None and self._health_fd in events:
            self._check_engine_health()
        self._drop_disconnected()
        if self.listener.sock in events:
            self._drain()
        if self._tokenizer:
            self._admit_tokenized()
        if self._encodes:
            self._answer_tokenized()
        if self._held_deadlines:
            self._expire_held(time.monotonic())
        if self._queue:
            self._admit_queued()
        self._lend_cores()
        if self.engine.has_unfinished():
            self._checked_idle = False
            try:
                outputs = self.engine.step()
            except StepFailedError as e:  # the engine aborted that step's requests and serves on
                self._fail_requests(e.request_ids, P.STEP_FAILED, str(e))
                outputs = []
            except Exception as e:  # a dead worker or a kernel error: nothing can be trusted now
                log.exception("engine step failed; shutting down")
                self._engine_failed(e)
            self._dispatch(outputs)
        if self._kv_events is not None:
            self._kv_events.publish(self.engine.drain_kv_events(self._kv_events.resync_wanted()))
        deadline = self._profiler.deadline
        if deadline is not None and time.monotonic() >= deadline:
            self._finish_profile()
        self.peers.flush()

    def _lend_cores(self) -> None:
        """While the tokenizer works it takes a core: the engine leaves it one (tokenizing.py),
        and while other requests run the tokenizer process takes only part of it."""
        busy = self._tokenizer.busy
        proc = self._tokenizer_process
        if proc is not None:
            proc.cpu_share = CONTENDED_CPU_SHARE if busy and self.engine.has_unfinished() else 1.0
        want = 1 if busy else 0
        if want != self._cores_lent:
            self._cores_lent = want
            try:
                self.engine.lend_cores(want)
            except Exception as e:  # a dead worker: like a failed step
                log.exception("lending cores to the tokenizer failed; shutting down")
                self._engine_failed(e)

    def _check_idle_engine(self) -> None:
        """Once per idle period: the engine's invariants (every block free, queues empty). A
        broken one means its KV state cannot be trusted: fail like a dead engine."""
        self._checked_idle = True
        try:
            self.engine.check_integrity()
        except AssertionError as e:
            log.error("the idle engine's integrity check failed: %s; shutting down", e)
            self._engine_failed(e)

    def _check_engine_health(self) -> None:
        try:
            self.engine.check_health()
        except Exception as e:
            log.error("engine failed while idle: %s; shutting down", e)
            self._engine_failed(e)
        # Readable but healthy breaks the engine's contract; stop polling it rather than spin.
        log.error("the engine's health fd is readable but check_health() passed; no longer watching it")
        self.listener.unwatch(self._health_fd)
        self._health_fd = None

    def _engine_failed(self, e: Exception) -> None:
        """Tell every client in flight, remember why for ``status``, end ``run`` with status 1."""
        self.failure = f"engine failed: {type(e).__name__}: {e}"
        self._fail_all(self.failure)
        raise _EngineFailed from e

    def _begin_shutdown(self) -> None:
        self._stopping = True
        self.metrics.on_drain()
        self._stop_deadline = time.monotonic() + self.options.shutdown_grace
        log.info("draining: no new requests; %d in flight may finish within %g s", len(self._requests),
                 0 if self._stop_now else self.options.shutdown_grace)

    def _finish_shutdown(self) -> None:
        # Frames that arrived before the stop are still answered (generate: shutting_down).
        for _ in range(_EXIT_DRAIN_ROUNDS):
            if self._drain() < self.options.max_messages_per_step:
                break
        if self._profiler.deadline is not None:
            self._finish_profile()
        for req in [*self._requests.values(), *self._tokenizer.requests(), *(q.req for q in self._queue.entries())]:
            self._abort(req, "shutting_down")
        for identity, client_id in list(self._encodes):
            del self._encodes[identity, client_id]
            self.peers.reply(identity, P.ErrorReply(P.SHUTTING_DOWN, "the daemon stopped before the text was "
                                                    "tokenized", id=client_id))
        # Let clients take their final messages while they keep reading; a client whose queue
        # has not moved for STALL_ON_EXIT seconds is dropped, and nobody delays exit past EXIT_FLUSH.
        deadline = time.monotonic() + _EXIT_FLUSH
        while self.peers.any_queued() and time.monotonic() < deadline:
            self.peers.flush(_STALL_ON_EXIT)
            time.sleep(0.005)
        log.info("front stopped")

    def close(self) -> None:
        """Close and remove the socket; returns once queued replies are delivered (at most 2 s)."""
        with self._tokenizer_process_lock:
            self._closed = True
        self._tokenizer.close()
        if self._tokenizer_process is not None:
            self._tokenizer_process.close()
        self.listener.close()
        if self._kv_events is not None:
            self._kv_events.close()

    # ---- receiving ---------------------------------------------------------------------------
    def _drop_disconnected(self) -> None:
        """Abort the requests of connections that closed (a vanished client's requests would
        otherwise run to their end: nothing is sent to a non-streaming one until then)."""
        for identity in self.listener.connections.drain_events():
            peer = self.peers.get(identity)
            if peer is not None:
                self.peers.drop(peer, "disconnected")

    def _drain(self) -> int:
        """Handle at most max_messages_per_step queued frames; returns how many there were."""
        sock, connections = self.listener.sock, self.listener.connections
        self._drop_disconnected()  # before the messages: they may come from a new connection
        for n in range(self.options.max_messages_per_step):
            try:
                parts = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return n
            frames = [p.bytes for p in parts]
            if not connections.attach(frames[0], parts[-1]):
                continue  # its connection closed since it was sent: there is nobody to answer
            try:
                self._handle(frames)
            except _EngineFailed:
                raise
            except Exception as e:  # a bug must cost one request, not the daemon
                log.exception("failed to handle a message")
                self.peers.reply(frames[0], P.ErrorReply(
                    P.INTERNAL, f"{type(e).__name__}: {e}"[:P.MAX_MESSAGE_CHARS],
                    id=self._refused_id(frames[0], None, frames[-1])))
        return self.options.max_messages_per_step

    def _handle(self, frames: list[bytes]) -> None:
        identity = frames[0]
        reply = self.peers.reply
        if len(frames) != 2:
            reply(identity, P.ErrorReply(P.BAD_MESSAGE,
                  f"a message is exactly one frame (a DEALER send of one msgpack map); got {len(frames) - 1}"))
            return
        obj = None
        try:
            obj = P.unpack_frame(frames[1])
            msg = P.decode(obj, "request")
        except P.ProtocolError as e:
            reply(identity, P.ErrorReply(e.code, e.message[:P.MAX_MESSAGE_CHARS],
                                         id=self._refused_id(identity, obj, frames[1]), field=e.field))
            return
        if isinstance(msg, P.GenerateRequest):
            self._on_generate(identity, msg)
        elif isinstance(msg, P.AbortRequest):
            self._on_abort(identity, msg)
        elif isinstance(msg, P.StatusRequest):
            reply(identity, P.StatusReply(self.stats(), id=msg.id))
        elif isinstance(msg, P.ProfileRequest):
            error = self._profiler.start(self.engine, identity, msg)
            if error is not None:
                reply(identity, error)
        elif isinstance(msg, P.MetricsRequest):
            reply(identity, P.MetricsReply(self.metrics.render(), id=msg.id))
        elif isinstance(msg, P.TokenizeRequest):
            self._on_tokenize(identity, msg)
        elif isinstance(msg, P.PoolRequest):
            self._on_pool(identity, msg)
        else:
            assert isinstance(msg, P.PingRequest)
            reply(identity, P.PongReply(id=msg.id))

    def _refused_id(self, identity: bytes, obj, frame: bytes) -> str | None:
        """The id an invalid message's ``error`` carries: its ``id``, read from the decoded map or,
        for a frame that did not decode, salvaged from its bytes, so that the sender can tell
        which request was refused. None when unreadable, or when a request of that id is in
        flight on this connection: an error with an id ends that request for its client."""
        rid = P.readable_id(obj) if obj is not None else P.salvage_id(frame)
        if rid is None:
            return None
        peer = self.peers.get(identity)
        if (peer is not None and rid in peer.requests) or (identity, rid) in self._encodes:
            return None
        return rid

    def _refused_on_arrival(self, identity: bytes, msg_id: str, error) -> bool:
        """Refuse a new request while the daemon drains, or whose id is already in flight on
        its connection (``error(code, message, **kw)`` replies); whether it was refused."""
        if self._stopping:
            self.metrics.on_refused("shutting_down")
            error(P.SHUTTING_DOWN, "the daemon is shutting down (draining) and admits no new requests",
                  id=msg_id, retry_after=float(max(1, math.ceil(self._stop_deadline - time.monotonic()))))
            return True
        peer = self.peers.get(identity)
        if peer is not None and msg_id in peer.requests:
            # No ``id``: an error with an id ends that request, and this one keeps running.
            error(P.DUPLICATE_ID, f"request id {msg_id!r} is already in flight on this connection; "
                  "that request continues", field="id")
            return True
        return False

    def _on_generate(self, identity: bytes, msg: P.GenerateRequest) -> None:
        def error(code, message, **kw):
            self.peers.reply(identity, P.ErrorReply(code, message[:P.MAX_MESSAGE_CHARS], **kw))

        if self._refused_on_arrival(identity, msg.id, error):
            return
        peer = self.peers.get(identity)
        if self._refused_over_cap(identity, peer, msg.id):
            return
        peer = self.peers.peer(identity)
        request = msg.to_request()  # the request model of the wire's spelling (validated by decode)
        req = ClientRequest(peer, msg.id, f"{peer.tag}:{msg.id}", request.stream, prompt_tokens=0,
                            arrival=time.monotonic(), n=request.n,
                            logprobs_wanted=request.params.logprobs is not None, priority=request.priority,
                            timeout=self.options.request_timeout if request.timeout is None else request.timeout)
        if isinstance(request.prompt, str) and len(request.prompt) > self.options.inline_tokenize_chars:
            peer.requests[msg.id] = req
            self._tokenizer.submit(req.engine_id, req, request.prompt, request.params)
            self._lend_cores()  # now, not after the rest of this turn's messages
            return
        self._queue_or_admit(req, lambda: request.prompt, request.params)

    def _on_pool(self, identity: bytes, msg: P.PoolRequest) -> None:
        """An embed / classify request (--runner pooling): its prompts admitted together, one
        ``pooled`` reply once all are computed (``_finish_pooling``)."""
        def error(code, message, **kw):
            self.peers.reply(identity, P.ErrorReply(code, message[:P.MAX_MESSAGE_CHARS], **kw))

        if self._refused_on_arrival(identity, msg.id, error):
            return
        peer = self.peers.get(identity)
        try:
            params = PoolingParams(msg.task, dimensions=msg.dimensions, normalize=msg.normalize)
        except InvalidFieldError as e:
            return error(P.INVALID_FIELD, e.reason, id=msg.id, field=e.field)
        if self._refused_over_cap(identity, peer, msg.id):
            return
        peer = self.peers.peer(identity)
        req = ClientRequest(peer, msg.id, f"{peer.tag}:{msg.id}", False, prompt_tokens=0,
                            arrival=time.monotonic(), priority=msg.priority or 0, pooling=True,
                            timeout=self.options.request_timeout if msg.timeout is None else msg.timeout)
        prompts = msg.prompts
        self._queue_or_admit(req, lambda: prompts, params)

    def _refused_over_cap(self, identity: bytes, peer: Peer | None, client_id: str) -> bool:
        """Refuse (too_many_requests) a request of a connection at its cap of requests in flight."""
        limit = self.options.max_requests_per_connection
        in_flight = (len(peer.requests) if peer is not None else 0) + (
            sum(key[0] == identity for key in self._encodes) if self._encodes else 0)
        if in_flight < limit:
            return False
        self.peers.reply(identity, P.ErrorReply(
            P.TOO_MANY_REQUESTS, f"this connection has {in_flight} requests in flight, the most one connection "
            f"may have (--max-requests-per-connection {limit}); wait for some to finish or use another connection",
            id=client_id))
        return True

    def _on_abort(self, identity: bytes, msg: P.AbortRequest) -> None:
        peer = self.peers.get(identity)
        req = peer.requests.get(msg.id) if peer is not None else None
        if req is None:
            self.peers.reply(identity, P.ErrorReply(P.UNKNOWN_ID, f"no request {msg.id!r} is in flight on "
                                                    "this connection (finished, never started, or sent by "
                                                    "another connection)", id=msg.id, field="id"))
            return
        self._abort(req, "client")

    def _finish_profile(self) -> None:
        identity, reply = self._profiler.finish(self.engine)
        self.peers.reply(identity, reply)

    # ---- engine outputs ----------------------------------------------------------------------
    def _dispatch(self, outputs) -> None:
        now = time.monotonic()
        metrics = self.metrics
        for out in outputs:
            req = self._requests.get(out.request_id)
            if req is None:
                continue  # aborted or dropped since the engine produced it
            if req.pooling:
                if out.finished:
                    self._finish_pooling(req, out, now)
                continue
            if out.error is not None:  # its grammar did not compile: no token was produced
                self._close(req)
                e = out.error
                field = getattr(e, "field", None)
                code = P.INVALID_FIELD if field else P.INVALID_REQUEST
                self.peers.send(req.peer, P.ErrorReply(code, str(getattr(e, "reason", e))[:P.MAX_MESSAGE_CHARS],
                                                       id=req.client_id, field=field))
                self.peers.forget_if_idle(req.peer)
                continue
            if out.new_token_ids:
                metrics.on_tokens(len(out.new_token_ids), now, req.arrival, req.last_token, out.queue_time)
                req.last_token = now
            delta = req.take(out)
            if delta is not None:
                self.peers.send(req.peer, delta)
                if out.request_id not in self._requests:
                    continue  # the send found the client gone and dropped its requests
            if out.finished:
                self._finish_completion(req, out, now)

    def _finish_completion(self, req: ClientRequest, out, now: float) -> None:
        """One completion of ``req`` ended; the request's ``done`` goes out with its last."""
        done = req.finish(out)
        if done is None:
            return
        self.metrics.on_finished(now, req.arrival)
        self._close(req)
        self.peers.send(req.peer, done)
        self.peers.forget_if_idle(req.peer)

    def _finish_pooling(self, req: ClientRequest, out, now: float) -> None:
        """A pool request's one output: its ``pooled`` reply (a ``done`` if it ended early)."""
        self._close(req)
        self.metrics.on_finished(now, req.arrival)
        if out.pooled is None:
            reply = P.DoneReply(req.client_id, out.finish_reason or "abort", out.num_prompt_tokens, 0)
        else:
            dim = len(out.pooled[0]) if out.pooled else 0
            data = array.array("f", [x for vec in out.pooled for x in vec])
            reply = P.PooledReply(req.client_id, data, dim, list(out.pooled_prompt_tokens))
        self.peers.send(req.peer, reply)
        self.peers.forget_if_idle(req.peer)

    def _abort(self, req: ClientRequest, reason: str) -> None:
        """Abort ``req`` in the engine and tell its client (``done`` with finish_reason abort)."""
        self._close(req)
        self.engine.abort_request(req.engine_id)
        self.peers.send(req.peer, req.aborted(reason))
        self.peers.forget_if_idle(req.peer)

    def _close(self, req: ClientRequest) -> None:
        """Forget ``req`` (admitted, or still being tokenized: its tokens are then dropped)."""
        if self._requests.pop(req.engine_id, None) is None:
            known = self._tokenizer.discard(req.engine_id) or self._queue.discard(req.engine_id)
            assert known, req.engine_id
        del req.peer.requests[req.client_id]

    def _on_peer_gone(self, peer: Peer, why: str) -> None:
        for req in list(peer.requests.values()):
            self._close(req)
            self.engine.abort_request(req.engine_id)

    def _fail_all(self, message: str) -> None:
        queued = [q.req.engine_id for q in self._queue.entries()]
        self._fail_requests([*self._requests, *self._tokenizer, *queued], P.INTERNAL, message)

    def _fail_requests(self, engine_ids, code: str, message: str) -> None:
        """Answer ``code`` to each request still known by ``engine_ids``; they end here."""
        for engine_id in engine_ids:
            req = (self._requests.get(engine_id) or getattr(self._tokenizer.get(engine_id), "req", None)
                   or getattr(self._queue.get(engine_id), "req", None))
            if req is None:
                continue
            self._close(req)
            self.peers.send(req.peer, P.ErrorReply(code, message[:P.MAX_MESSAGE_CHARS], id=req.client_id))
            self.peers.forget_if_idle(req.peer)


class _EngineFailed(Exception):
    """Raised inside ``run`` when engine.step() failed; ends the loop with exit code 1."""
