"""PromptTokenizer: long text prompts tokenized off the serving loop.

Tokenizing megabytes of text takes seconds, and no other client may wait for that: the front
hands a long prompt to ``submit`` and admits the request once its tokens are ready
(``finished``). The worker thread only waits: with a tokenizer on disk, the Server's
``tokenize`` hands the text to a tokenizer process (tpserve.tokenizer.TokenizerProcess), so
neither the GIL nor a core is taken from the loop. A job's completion wakes the loop through
``wake``. Jobs are keyed by the request's engine id; a request aborted meanwhile is
``discard``-ed and its tokens dropped. ``encode`` runs a tokenize-only request (the protocol's
``tokenize``, which the HTTP front sends for its long prompts) on the same worker.

While the worker works (``busy``) the tokenizer takes a core, so the Server lends the engine's
one (Engine.lend_cores): a CPU engine runs one thread per core, and a thread sharing its core
with a busy process delays every parallel region of every step. While other requests run, the
tokenizer process also takes only ``CONTENDED_CPU_SHARE`` of that core (its duty cycle,
TokenizerProcess.cpu_share): with every core busy, a virtual machine's host can take whole
scheduling periods from it, stalling every stream by 100 ms at a time. The long prompt is then
tokenized at half speed, and the others stream on as before.
"""
from __future__ import annotations

import array
import logging
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Iterator

log = logging.getLogger("tpserve.daemon")

CONTENDED_CPU_SHARE = 0.5  # of one core, for the tokenizer process while other requests run


@dataclass
class TokenizeJob:
    """A request waiting for its prompt's tokens. ``result()`` returns them or raises the
    tokenizer's error."""

    req: Any
    params: Any
    future: Future

    def result(self) -> array.array:
        return self.future.result()


class PromptTokenizer:
    """Runs ``tokenize(prompt)`` on a worker, one prompt at a time."""

    def __init__(self, tokenize: Callable[..., list[int]], wake: Callable[..., None]):
        self._tokenize = tokenize  # (text, add_special_tokens=False) -> token ids (packed)
        self._wake = wake
        self._jobs: dict[str, TokenizeJob] = {}
        self._pool: ThreadPoolExecutor | None = None
        self._pending: deque[Future] = deque()  # submitted, in order (one worker: they end in order)

    @property
    def busy(self) -> bool:
        """Whether anything submitted (a prompt, a text, starting the tokenizer) is unfinished."""
        pending = self._pending
        while pending and pending[0].done():
            pending.popleft()
        return bool(pending)

    def __len__(self) -> int:
        return len(self._jobs)

    def __contains__(self, engine_id: str) -> bool:
        return engine_id in self._jobs

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._jobs))

    def get(self, engine_id: str) -> TokenizeJob | None:
        return self._jobs.get(engine_id)

    def requests(self) -> list:
        return [job.req for job in self._jobs.values()]

    def prepare(self) -> None:
        """Tokenize a word in the background, so that whatever the first long prompt would
        set up (a tokenizer process: a second or two) is ready before one comes."""
        self._submit(self._warm_up)

    def _warm_up(self) -> None:
        try:
            self._tokenize(" ")
        except Exception as e:  # the first real prompt reports it
            log.warning("preparing the tokenizer failed: %s", e)

    def _submit(self, fn, *args) -> Future:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="tpserve-tokenize")
        future = self._pool.submit(fn, *args)
        self._pending.append(future)
        future.add_done_callback(self._wake)  # the loop takes its result, and its lent core back
        return future

    def encode(self, text: str, add_special_tokens: bool = False) -> Future:
        """Tokenize ``text`` for a tokenize-only request; the future's completion wakes the loop."""
        return self._submit(self._tokenize, text, add_special_tokens)

    def submit(self, engine_id: str, req, prompt: str, params) -> None:
        future = self._submit(self._tokenize, prompt)
        self._jobs[engine_id] = TokenizeJob(req, params, future)

    def finished(self) -> list[TokenizeJob]:
        """The jobs whose tokens (or error) are ready, in submission order; they stay known
        until ``discard``-ed."""
        return [job for job in self._jobs.values() if job.future.done()]

    def discard(self, engine_id: str) -> bool:
        """Forget a job (its tokens, if they come, are dropped); False if it was not known."""
        return self._jobs.pop(engine_id, None) is not None

    def close(self) -> None:
        if self._pool is not None:
            # A prompt being encoded finishes in the background; nobody waits for its result.
            self._pool.shutdown(wait=False, cancel_futures=True)
