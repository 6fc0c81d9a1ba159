"""ProfileRecorder: the one ``profile`` request being recorded while the daemon serves.

``start`` turns the profiler on on every rank and remembers who asked and until when; the loop
sleeps no longer than ``deadline`` and calls ``finish`` once it has passed (or at shutdown),
which stops the profiler and answers with the trace files (``<dir>/tpserve-profile-<pid>-<n>``
+ ``.rank<r>.json``) or with the error that kept them from being written.
"""
from __future__ import annotations

import logging
import os
import tempfile
import time
from dataclasses import dataclass

from tpserve.client import protocol as P

log = logging.getLogger("tpserve.daemon")


@dataclass
class _Profile:
    identity: bytes
    id: str | None
    deadline: float


class ProfileRecorder:
    """At most one profile at a time; ``directory`` None writes to the temp dir."""

    def __init__(self, directory: str | None):
        self.directory = directory
        self._profile: _Profile | None = None
        self._count = 0

    @property
    def deadline(self) -> float | None:
        """When the profile being recorded ends (monotonic clock), or None."""
        return self._profile.deadline if self._profile is not None else None

    def start(self, engine, identity: bytes, msg: P.ProfileRequest) -> P.ErrorReply | None:
        """Start recording for ``msg.seconds``; the error to answer instead, if it cannot."""
        if self._profile is not None:
            return P.ErrorReply(P.INVALID_REQUEST, "a profile is already being recorded; "
                                "try again when it is written", id=msg.id)
        try:
            engine.start_profile()
        except Exception as e:
            log.exception("could not start the profiler")
            return P.ErrorReply(P.INVALID_REQUEST, f"cannot start the profiler: "
                                f"{type(e).__name__}: {e}"[:P.MAX_MESSAGE_CHARS], id=msg.id)
        self._profile = _Profile(identity, msg.id, time.monotonic() + msg.seconds)
        log.info("profiling for %g s", msg.seconds)
        return None

    def finish(self, engine) -> tuple[bytes, P.Message]:
        """Stop the profile being recorded; returns who asked and the reply for them."""
        prof, self._profile = self._profile, None
        self._count += 1
        stem = os.path.join(self.directory or tempfile.gettempdir(),
                            f"tpserve-profile-{os.getpid()}-{self._count}")
        try:
            reply = P.ProfileReply(engine.stop_profile(stem), id=prof.id)
            log.info("profile written: %s", ", ".join(reply.files))
        except Exception as e:
            log.exception("could not write the profile")
            reply = P.ErrorReply(P.INVALID_REQUEST, f"cannot write the profile: "
                                 f"{type(e).__name__}: {e}"[:P.MAX_MESSAGE_CHARS], id=prof.id)
        return prof.identity, reply
