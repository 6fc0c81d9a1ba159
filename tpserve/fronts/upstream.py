"""The HTTP front's watch over its daemon: requests whose daemon side may be gone are ended.

The front waits for the daemon's replies without a timeout of its own (a request may queue
or prefill for long). Two ways the daemon's side of a request disappears without a last message:

* the front stalled (SIGSTOP, a blocked loop) while the daemon had replies for it. The daemon
  keeps a slow reader's replies (its deltas merged) and drops a connection that is still open
  only when too many replies wait for it (docs/protocol.md, "Slow and vanished clients"); it then
  aborts its requests and sends them nothing more. The front cannot tell afterwards whether that
  happened, nor which of its requests it hit, so ``UpstreamWatch`` ticks every ``tick`` seconds,
  and when one tick comes ``limit`` (``--http-upstream-timeout``) or more after the previous one
  it ends every request in flight, rather than risk waiting forever for one the daemon dropped;
* the daemon stopped answering (stopped, stuck in a step): while requests are in flight the
  watch pings it every ``limit / 4`` seconds; no answer within ``limit`` ends the requests in
  flight since before that ping.

Ending a request puts an ``UpstreamLost`` into its queue (``Front.fail_requests``): a stream
sends an error event, then ``[DONE]``; a non-streamed request is answered 503
``upstream_lost``. Closing the request then sends the daemon an abort, so nothing keeps running
for a client that was told it failed.
"""
from __future__ import annotations

import asyncio
import logging

from tpserve.client.client import ClientTimeout, RequestError
from tpserve.errors import TpserveError

log = logging.getLogger("tpserve.http")

MIN_LIMIT = 1.0  # s: the watch ticks a few times per limit; it cannot be much faster


class UpstreamLost(TpserveError, ConnectionError):
    """The daemon's side of a request may be gone (see the module doc)."""


class UpstreamWatch:
    """Ends the front's requests when the front stalled or the daemon stopped answering.

    ``front`` provides ``in_flight()`` (number of requests), ``fail_requests(exc, before)``
    (ends those started before loop time ``before``; returns how many) and ``client.ping``;
    its ``KIND`` ("HTTP" unless it says) names it in messages."""

    def __init__(self, front, limit: float, tick: float = 0.5):
        self.front = front
        self.limit = max(float(limit), MIN_LIMIT)
        self.tick = min(tick, self.limit / 4)
        self.stalls = 0  # ticks that came ``limit`` or more late
        self.kind = getattr(front, "KIND", "HTTP")

    def start(self) -> None:
        """Begin ticking on the running loop."""
        self._loop = asyncio.get_running_loop()
        self._last = self._last_ping = self._loop.time()
        self._ping_task: asyncio.Task | None = None
        self._handle = self._loop.call_later(self.tick, self._tick)

    def stop(self) -> None:
        self._handle.cancel()
        if self._ping_task is not None:
            self._ping_task.cancel()

    def _tick(self) -> None:
        # A timer callback, not a task: after a stall it runs in the loop's first round, where
        # only callbacks made ready before the stall run, so every request in flight now began
        # before the stall (a task woken by a timer would run a round later, after handlers that
        # data arriving during the stall had woken).
        now = self._loop.time()
        if now - self._last >= self.limit:
            self.stalls += 1
            self._end(UpstreamLost(
                f"the {self.kind} front was stalled for {now - self._last:.0f} s, at least its upstream "
                f"timeout ({self.limit:g} s): the daemon may have dropped this request"), now)
        self._last = now
        if self.front.in_flight() and (self._ping_task is None or self._ping_task.done()) \
                and now - self._last_ping >= self.limit / 4:
            self._last_ping = now
            self._ping_task = asyncio.ensure_future(self._ping(now))
        self._handle = self._loop.call_later(self.tick, self._tick)

    async def _ping(self, sent: float) -> None:
        try:
            await self.front.client.ping(timeout=self.limit)
        except ClientTimeout:
            self._end(UpstreamLost(f"the tpserve daemon did not answer for {self.limit:g} s"), sent)
        except RequestError:
            pass  # it answered: it is there

    def _end(self, exc: UpstreamLost, before: float) -> None:
        n = self.front.fail_requests(exc, before)
        if n:
            log.error("ended %d %s request(s) in flight: %s", n, self.kind, exc, extra={"condition": "upstream lost"})
