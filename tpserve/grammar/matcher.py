"""RequestGrammar: one request's position in its grammar, and the step's batched bitmask fill.

A request's matcher lives with its Sequence on the scheduler side. It consumes every token the
request samples (``accept``), so it always stands where the output ends: a preempted request
keeps its generated tokens and its matcher as they are, and a prefix-cache hit changes
nothing. ``ready`` is False while the grammar compiles (the scheduler keeps the request out of
its waiting queue until then); ``error`` holds the InvalidFieldError of a grammar that failed;
``cancel`` tells the compiler that this request no longer waits (it was aborted or timed out).

A matcher can run into an error state after a token it allowed: a grammar whose continuation no
text satisfies (a Lark rule of an empty regex class, ``"x" /[a&&b]/``) offers only EOS next and
reports the error. ``accept`` counts that as a refusal, so the request ends with "error" and
never with "stop" on text the grammar does not match.
"""
from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

log = logging.getLogger("tpserve.grammar")

_executor = None
_filler = None


class RequestGrammar:
    __slots__ = ("future", "matcher", "error", "_release")

    def __init__(self, future: Future, release=None):
        self.future = future
        self.matcher = None
        self.error: Exception | None = None
        self._release = release  # GrammarCompiler.release, called once by cancel()

    def cancel(self) -> None:
        """This request stopped waiting for its grammar (idempotent; nothing once compiled)."""
        release, self._release = self._release, None
        if release is not None and self.matcher is None and self.error is None:
            release(self.future)

    def ready(self) -> bool:
        """True once the grammar compiled (the matcher is set) or failed (``error`` is set)."""
        if self.matcher is not None or self.error is not None:
            return True
        if not self.future.done():
            return False
        try:
            self.matcher = self.future.result().deep_copy()
        except Exception as e:  # InvalidFieldError from the compiler, or anything it raised
            self.error = e
        return True

    def accept(self, token: int) -> bool:
        """Advance by one sampled token; False if the grammar does not allow it, or if the
        matcher is in an error state after it (see the module)."""
        m = self.matcher
        return m.consume_token(token) and not m.is_error()

    @property
    def is_complete(self) -> bool:
        """Nothing can follow: the grammar is satisfied and only EOS is left."""
        return self.matcher.is_stopped()

    def describe_error(self) -> str:
        return self.matcher.get_error() if self.matcher is not None else str(self.error)


def fill_bitmask_async(grammars: list[RequestGrammar], words: int) -> tuple[np.ndarray, Future]:
    """``fill_bitmask`` on a thread: (the bitmask array, the future that has written it).

    The caller must not advance these matchers until the future is done; the engine does not
    (the sampler waits for it, then postprocess consumes the sampled tokens). llguidance drops
    the GIL while it computes, so the forward of the step runs meanwhile."""
    global _filler
    if _filler is None:
        _filler = ThreadPoolExecutor(1, thread_name_prefix="tpserve-mask")
    bitmask = np.empty((len(grammars), words), dtype=np.int32)
    return bitmask, _filler.submit(fill_bitmask, grammars, words, bitmask)


def fill_bitmask(grammars: list[RequestGrammar], words: int, bitmask: np.ndarray | None = None) -> np.ndarray:
    """int32 [len(grammars), words]: row i allows the tokens grammar i accepts next (bit t % 32
    of word t // 32). One call into llguidance for the whole batch, which spreads the rows
    over its own threads."""
    import llguidance
    import llguidance.numpy as lnp
    global _executor
    if bitmask is None:
        bitmask = np.empty((len(grammars), words), dtype=np.int32)
    if len(grammars) == 1:
        lnp.fill_next_token_bitmask(grammars[0].matcher, bitmask, 0)
        return bitmask
    if _executor is None:
        _executor = llguidance.LLExecutor()
    lnp.fill_next_token_bitmask_par(_executor, [(g.matcher, i) for i, g in enumerate(grammars)], bitmask)
    return bitmask
