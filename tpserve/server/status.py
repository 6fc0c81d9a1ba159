"""The daemon's status and metrics: the ``status`` map and the Prometheus metrics' source.

``status`` answers the engine's counters (waiting requests include those the server holds in
its fair queue; timed-out ones those that ended there) with the daemon's own: state, readiness,
requests in flight and queued, clients, the drain's time left, refusals per limit, KV-event
publisher counters, the failure that stopped the engine, and what the fronts add
(``status_extras``); every value plain (msgpack-able), at most MAX_STATUS_ENTRIES of them.

``StatusReport`` is a part of ``Server`` (server.py): it reads the server's state.
"""
from __future__ import annotations

import logging
import os
import time

from tpserve.client import protocol as P
from tpserve.server.metrics import ServingMetrics

log = logging.getLogger("tpserve.daemon")


def served_model_name(engine, options) -> str:
    """The name clients and metrics know the model by."""
    if options.served_model_name:
        return options.served_model_name
    config = getattr(engine, "config", None)
    name = getattr(config, "model_name", None)  # a GGUF file's stem, a directory's name
    if isinstance(name, str) and name:
        return name
    path = getattr(config, "model_path", None)
    return os.path.basename(os.path.normpath(str(path))) if path else "tpserve"


class StatusReport:
    """The server's ``status`` map and metrics (see the module docstring)."""

    @property
    def metrics(self) -> ServingMetrics:
        """The Prometheus metrics, made once the engine is attached (it names the model)."""
        if self._metrics is None:
            self._metrics = ServingMetrics(served_model_name(self.engine, self.options), self._engine_stats)
        return self._metrics

    def _engine_stats(self) -> dict:
        """The engine's counters; waiting requests include those queued here."""
        stats = dict(self.engine.stats())
        stats["num_waiting"] = int(stats.get("num_waiting") or 0) + len(self._queue)
        if "num_timed_out" in stats:
            stats["num_timed_out"] = int(stats["num_timed_out"]) + self._held_timed_out
        return stats

    def stats(self) -> dict:
        """Engine counters plus the daemon's own, as plain msgpack-able values."""
        try:
            stats = self._engine_stats()
        except Exception as e:
            log.exception("engine.stats() failed")
            stats = {"stats_error": f"{type(e).__name__}: {e}"}
        stats.update(pid=os.getpid(), uptime_s=round(time.monotonic() - self._started, 3),
                     address=self.address, protocol_version=P.PROTOCOL_VERSION,
                     state="failed" if self.failure else "shutting_down" if self._stopping else "running",
                     ready=not (self.failure or self._stopping or self._stop_requested),
                     requests_in_flight=len(self._requests) + len(self._tokenizer) + len(self._queue),
                     requests_queued=len(self._queue),
                     clients=len(self.peers), shutdown_grace=self.options.shutdown_grace,
                     request_timeout=self.options.request_timeout)
        if self._stopping:
            stats["drain_left_s"] = round(max(0.0, self._stop_deadline - time.monotonic()), 3)
        stats.update(self.metrics.refused_counts())
        if self._kv_events is not None:
            stats.update(self._kv_events.stats())
        if self.failure:
            stats["failure"] = self.failure
        if self.status_extras is not None:
            stats.update(self.status_extras())
        return {str(k): _plain(v) for k, v in list(stats.items())[:P.MAX_STATUS_ENTRIES]}


def _plain(v):
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if hasattr(v, "item"):  # numpy / torch scalars
        return v.item()
    return str(v)
