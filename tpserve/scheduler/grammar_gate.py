"""GrammarGate: structured-output requests between ``Scheduler.add`` and the waiting queue, and
each constrained request's matcher advanced by the tokens it samples.

A request whose grammar still compiles (tpserve/grammar: off the serving loop, in the grammar
process and the compiler's thread) waits here, not in ``waiting``; ``schedule()`` moves it to the
back of the waiting queue once its grammar is built (in arrival order among those), or finishes
it with "error" when its grammar was refused: the engine reports those with the grammar's
InvalidFieldError (``take_failures``). A request finished while it waits here (aborted, timed
out) cancels its compilation (``RequestGrammar.cancel``): the grammar process stops working on
a grammar nobody waits for.

``advance`` feeds each constrained sequence its sampled token: the grammar ends the request with
"stop" once complete, and with "error" when it refuses the token or finds no continuation after
it (an unsatisfiable rest: never "stop" on text the grammar does not match).
"""
from __future__ import annotations

import logging
from concurrent.futures import FIRST_COMPLETED, wait as futures_wait

log = logging.getLogger("tpserve.scheduler")


class GrammarGate:
    def __init__(self, waiting):
        self.waiting = waiting
        self.compiling: list = []   # requests whose grammar is not built yet (or failed, not yet seen)
        self.failures: list = []    # finished "error" by their grammar, not yet reported
        self.num_seqs = 0           # unfinished requests with a grammar (0: postprocess skips matchers)

    def hold(self, seq) -> bool:
        """Count a new constrained request; True if it waits here (its grammar is not built, or
        failed: reported by the next ``schedule()`` like a late failure), False if it may queue."""
        self.num_seqs += 1
        g = seq.grammar
        if not g.ready() or g.error is not None:
            self.compiling.append(seq)
            return True
        return False

    def queue_compiled(self) -> list:
        """Move the requests whose grammar is built to the back of ``waiting`` (arrival order);
        returns those whose grammar failed, for the scheduler to finish with "error"."""
        still, failed = [], []
        for seq in self.compiling:
            if not seq.grammar.ready():
                still.append(seq)
            elif seq.grammar.error is not None:
                failed.append(seq)
            else:
                self.waiting.append(seq)
        self.compiling = still
        self.failures += failed
        return failed

    def take_failures(self) -> list:
        out, self.failures = self.failures, []
        return out

    def wait(self, timeout: float) -> None:
        """Block up to ``timeout`` seconds until a compiling grammar is done."""
        if self.compiling:
            futures_wait([s.grammar.future for s in self.compiling], timeout, FIRST_COMPLETED)

    def finished(self, seq) -> bool:
        """``seq`` (with a grammar) finished: True if it was held here rather than queued or
        running. One still compiling cancels its compilation."""
        self.num_seqs -= 1
        if seq in self.compiling:
            self.compiling.remove(seq)
            seq.grammar.cancel()
            return True
        return seq in self.failures

    def advance(self, seqs: list, toks: list[int]) -> list[str | None]:
        """Feed each constrained sequence its sampled token (EOS included: where the grammar may
        end, EOS completes it). Per sequence: "stop" once its grammar is complete, "error" if the
        token broke it or left no continuation, None while it goes on."""
        out: list[str | None] = []
        for seq, tok in zip(seqs, toks):
            g = seq.grammar
            if g is None:
                out.append(None)
            elif not g.accept(tok):
                why = (g.describe_error().splitlines() or [""])[0][:300]
                log.warning("request %r ends with \"error\": its grammar has no continuation after "
                            "token %d: %s", seq.request_id, tok, why)
                out.append("error")
            else:
                out.append("stop" if g.is_complete else None)
        return out
