"""Admission: how the server adds a client's request to the engine.

A request is added at once when the engine has room and nobody is held before it; otherwise it
is held in the fair queue (fair_queue.py, one FIFO per connection, taken in turn), counted
against the engine's waiting-queue limit (a full one refuses it: ``overloaded``), and ended with
"timeout" if its deadline passes while held. A text prompt longer than the inline limit comes
here once tokenized (tokenizing.py). The engine's refusals become the wire's error codes:
``admission``, ``overloaded``, ``invalid_field`` / ``invalid_request`` (the field named as the
wire spells it), ``internal``.

``Admission`` is a part of ``Server`` (server.py): it uses the server's engine, queues, peers
and metrics.
"""
from __future__ import annotations

import heapq
import logging
from typing import Callable

from tpserve.client import protocol as P
from tpserve.errors import AdmissionError, InvalidFieldError, InvalidRequestError, OverloadedError
from tpserve.sampling import SamplingParams
from tpserve.server.client_requests import ClientRequest, Ended, Held
from tpserve.tokenizer import TokenizerProcessError

log = logging.getLogger("tpserve.daemon")


class Admission:
    """The server's admission of requests into the engine (see the module docstring)."""

    def _admit_tokenized(self) -> None:
        """Queue (or add) the requests whose prompts have been tokenized."""
        for job in self._tokenizer.finished():  # also while draining: they arrived before it
            self._tokenizer.discard(job.req.engine_id)
            del job.req.peer.requests[job.req.client_id]
            self._queue_or_admit(job.req, job.result, job.params)

    def _queue_or_admit(self, req: ClientRequest, prompt: Callable[[], str | list[int]], params: SamplingParams) -> None:
        """Add ``req`` to the engine now if it has room and nobody is queued before it, else
        queue it (fair_queue.py): one connection's backlog must not delay the others."""
        if not self._queue and self.engine.has_room():
            self._admit(req, prompt, params)
            return
        try:  # held requests count against the engine's waiting-queue limit
            self.engine.check_queue_room(req.engine_id, len(self._queue))
        except OverloadedError as e:
            self._refuse_overloaded(req, e)
            self.peers.forget_if_idle(req.peer)
            return
        req.peer.requests[req.client_id] = req
        self._queue.push(req.peer.tag, req.engine_id, Held(req, prompt, params))
        if req.timeout is not None:
            heapq.heappush(self._held_deadlines, (req.arrival + req.timeout, req.engine_id))

    def _expire_held(self, now: float) -> None:
        """End with "timeout" the held requests whose deadline has passed (the engine would
        expire them only once it took them); those admitted meanwhile the engine times out."""
        heap = self._held_deadlines
        while heap and heap[0][0] <= now:
            _, engine_id = heapq.heappop(heap)
            queued = self._queue.get(engine_id)
            if queued is None:
                continue  # admitted, aborted or gone since
            req = queued.req
            prompt = queued.prompt()
            req.prompt_tokens = 0 if isinstance(prompt, str) else len(prompt)
            self._held_timed_out += 1
            for index in range(req.n):  # the last one sends the done and forgets the request
                self._finish_completion(req, Ended(index, "timeout", 0), now)
        if not self._queue:
            heap.clear()

    def _admit_queued(self) -> None:
        """Add queued requests, one connection after another, while the engine has room (also
        while draining: they arrived before it)."""
        while self._queue and self.engine.has_room():
            queued = self._queue.pop()
            del queued.req.peer.requests[queued.req.client_id]
            self._admit(queued.req, queued.prompt, queued.params)

    def _admit(self, req: ClientRequest, prompt: Callable[[], str | list[int]], params: SamplingParams) -> None:
        """Add ``req`` to the engine, or answer the error that refused it."""
        peer = req.peer

        def error(code, message, **kw):
            self.peers.send(peer, P.ErrorReply(code, message[:P.MAX_MESSAGE_CHARS], id=req.client_id, **kw))

        try:
            add = self.engine.add_pooling_request if req.pooling else self.engine.add_request
            # params: a PoolingParams for a ``pool`` request (--runner pooling)
            req.prompt_tokens = add(req.engine_id, prompt(), params, priority=req.priority, timeout=req.timeout,
                                    arrival=req.arrival)
        except OverloadedError as e:
            self._refuse_overloaded(req, e)
        except AdmissionError as e:
            self.metrics.on_refused("admission")
            over = e.requested - e.allowed
            error(P.ADMISSION, f"request needs {e.limit}={e.requested} but the engine allows {e.allowed} "
                  f"(over by {over})", limit=e.limit, requested=int(e.requested), allowed=int(e.allowed))
        except InvalidFieldError as e:
            error(P.INVALID_FIELD, e.reason, field=e.field)
        except InvalidRequestError as e:
            error(P.INVALID_REQUEST, e.reason, field=e.field)
        except ValueError as e:
            error(P.INVALID_REQUEST, str(e))
        except TokenizerProcessError as e:
            log.error("could not tokenize the prompt of %s: %s", req.engine_id, e)
            error(P.INTERNAL, f"the prompt could not be tokenized: {e}")
        except Exception as e:
            log.exception("add_request failed for %s", req.engine_id)
            error(P.INTERNAL, f"the engine could not add the request: {type(e).__name__}: {e}")
        else:
            peer.requests[req.client_id] = req
            self._checked_idle = False
            self.metrics.on_admitted(req.prompt_tokens)
            self._requests[req.engine_id] = req
        self.peers.forget_if_idle(peer)

    def _refuse_overloaded(self, req: ClientRequest, e: OverloadedError) -> None:
        self.metrics.on_refused(e.limit)
        self.peers.send(req.peer, P.ErrorReply(P.OVERLOADED, str(e)[:P.MAX_MESSAGE_CHARS], id=req.client_id,
                                               limit=e.limit, requested=int(e.requested),
                                               allowed=int(e.allowed), retry_after=float(e.retry_after)))
