"""ServingEngine: the part of the engine the daemon's front uses, and nothing more.

``tpserve.engine.Engine`` satisfies it, and so does the test suite's fake engine; a test
checks both against this declaration, so the Server cannot start reaching into engine
internals (its config, scheduler or tokenizer) without that test noticing.
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

from tpserve.outputs import EngineOutput
from tpserve.sampling import SamplingParams


@runtime_checkable
class ServingEngine(Protocol):
    """What ``Server`` calls. All methods but ``tokenize`` run on the serving loop's thread."""

    def tokenize(self, prompt: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of a text prompt. Thread-safe: the Server calls it off the serving loop.

        Raises InvalidRequestError/InvalidFieldError (tpserve.errors) for a prompt it refuses.
        """

    def tokenizer_path(self) -> str | None:
        """The model directory whose tokenizer ``tokenize`` uses, so that long prompts can be
        tokenized in another process (tpserve.tokenizer.TokenizerProcess); None: only
        ``tokenize`` can."""

    def add_request(self, request_id: str, prompt: str | list[int],
                    params: SamplingParams | None = None, *, priority: int = 0,
                    timeout: float | None = None, arrival: float | None = None) -> int:
        """Queue a request; returns its prompt length in tokens.

        Raises AdmissionError (it can never be scheduled), OverloadedError (the waiting queue
        is full, with ``retry_after``), InvalidFieldError (a field out of bounds, e.g. a token
        id outside the vocabulary, or a priority the scheduling order refuses) or
        InvalidRequestError, queueing nothing. ``timeout`` seconds after ``arrival``
        (time.monotonic()) the request ends with finish_reason "timeout".
        """

    def add_pooling_request(self, request_id: str, prompts: list, params=None, *, priority: int = 0,
                            timeout: float | None = None, arrival: float | None = None) -> int:
        """Queue an embed / classify request of several prompts (--runner pooling, a
        tpserve.pooling.PoolingParams); one output answers them all (``EngineOutput.pooled``).
        Raises as ``add_request`` does; InvalidRequestError naming ``--runner`` on a generate
        engine (and ``add_request`` on a pooling one)."""

    def abort_request(self, request_id: str) -> bool:
        """Drop an unfinished request and free its blocks; False if it is not unfinished."""

    def has_unfinished(self) -> bool:
        """Whether ``step`` has work to do."""

    def has_room(self) -> bool:
        """Whether a request added now would be among those the next step can start (fewer
        are waiting than a step admits at most); the Server holds the others back, so that it
        can choose fairly between clients which one comes next. An engine that orders its
        waiting requests by priority always has room: its own queue decides."""

    def check_queue_room(self, request_id: str, held: int) -> None:
        """Raise OverloadedError (with ``retry_after``) if a request arriving now, behind the
        ``held`` requests the Server holds back, would take the engine's waiting queue past
        its request limit; the Server then refuses it at once instead of holding it."""

    def step(self) -> list[EngineOutput]:
        """One engine step. Raises StepFailedError when only that step's requests are lost
        (they are aborted already); any other exception means the engine is unusable."""

    def stats(self) -> dict:
        """Counters for ``status`` (plain values; docs/protocol.md lists the keys)."""

    def start_profile(self) -> None:
        """Start a profiler trace on every rank."""

    def stop_profile(self, path: str) -> list[str]:
        """Stop it; every rank writes a trace file named after ``path``. Returns the files."""

    def enable_kv_events(self, capacity: int = 65536) -> None:
        """Start recording prefix-cache events (tpserve.blockpool.kv_events) for drain_kv_events."""

    def drain_kv_events(self, resync: bool = False) -> list:
        """Prefix-cache events since the last call, oldest first; with ``resync`` (or after
        events were lost) AllBlocksCleared and a BlockStored for every cached block instead."""

    def check_integrity(self) -> None:
        """Raise AssertionError if an internal invariant is broken (an idle engine: also if any
        KV block is still in use). The Server runs it when the engine has become idle."""

    def health_fd(self) -> int | None:
        """A file descriptor that becomes readable when a worker dies (None: nothing to watch)."""

    def check_health(self) -> None:
        """Raise WorkerDiedError (tpserve.errors) if a worker died; cheap, no collective."""

    def lend_cores(self, cores: int) -> None:
        """Leave ``cores`` cores to other work of this machine until lent 0 (the Server lends
        one while its tokenizer works on a long prompt)."""

    def shutdown(self) -> None:
        """Stop the workers and free the engine's resources."""
