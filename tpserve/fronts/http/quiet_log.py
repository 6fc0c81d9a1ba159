"""Rate-limited logging for the HTTP front: one line per condition, however often it recurs.

The front's log is the daemon's log file. A flood of bad or abandoned connections must not turn
it into megabytes per second of identical lines and tracebacks, so every record passes
``RateLimit``: records of one *condition* -- the same logger, level and message template (the
format string before its arguments), or for asyncio's loop errors the same kind of failure --
are written once per ``interval`` seconds; the next one written says how many were left out.
Only the first record of a condition keeps its traceback.

``install(interval)`` puts the filter on the root logger's handlers and returns it;
``loop_exception_handler`` replaces asyncio's default handler (which logs a traceback per
call, e.g. one per failed ``accept()`` when descriptors run out) with one rate-limited line.
"""
from __future__ import annotations

import logging
import time

log = logging.getLogger("tpserve.http")

DEFAULT_INTERVAL = 10.0


class RateLimit(logging.Filter):
    """Lets one record per condition through per ``interval`` seconds (see the module doc)."""

    def __init__(self, interval: float = DEFAULT_INTERVAL, clock=time.monotonic):
        super().__init__()
        self.interval = interval
        self.clock = clock
        self._last: dict[tuple, float] = {}      # condition -> when its last record was written
        self._left_out: dict[tuple, int] = {}    # condition -> records dropped since then
        self._seen: set[tuple] = set()           # conditions whose traceback was written once

    @staticmethod
    def condition(record: logging.LogRecord) -> tuple:
        key = getattr(record, "condition", None)  # set by callers whose message text varies
        return (record.name, record.levelno, key if key is not None else str(record.msg))

    def filter(self, record: logging.LogRecord) -> bool:
        key = self.condition(record)
        now = self.clock()
        last = self._last.get(key)
        if last is not None and now - last < self.interval:
            self._left_out[key] = self._left_out.get(key, 0) + 1
            return False
        self._last[key] = now
        left_out = self._left_out.pop(key, 0)
        if left_out:
            record.msg = f"{record.getMessage()} [{left_out} more like this in the last {now - last:.0f} s]"
            record.args = None
        if key in self._seen:
            record.exc_info = record.exc_text = None
            record.stack_info = None
        elif record.exc_info:
            self._seen.add(key)
        return True


def install(interval: float = DEFAULT_INTERVAL) -> RateLimit:
    """Rate-limit every record the root logger's handlers write; returns the filter."""
    limit = RateLimit(interval)
    for handler in logging.getLogger().handlers:
        handler.addFilter(limit)
    return limit


def loop_exception_handler(loop, context: dict) -> None:
    """asyncio's exception handler: one line per kind of failure (rate-limited by RateLimit)."""
    exc = context.get("exception")
    message = str(context.get("message") or "unhandled exception in the event loop")
    # "Exception in callback Handle(...)" embeds the handle: the condition is the text before it.
    kind = message.split("(")[0].strip()
    condition = f"asyncio: {kind}: {type(exc).__name__ if exc else ''}"
    detail = f": {type(exc).__name__}: {exc}" if exc is not None else ""
    log.error("event loop: %s%s", kind, detail, extra={"condition": condition},
              exc_info=None if isinstance(exc, OSError) else exc)
