"""A client's requests in the daemon: what the server holds per ``generate`` and the replies
its engine outputs make.

``ClientRequest`` is one ``generate`` of one connection, from its arrival to its ``done`` (or
``error``): its ids, the figures its reply reports, and its output -- streamed as ``delta``
messages, or gathered for the ``done`` when not streamed. Its ``n`` completions are the
engine's (each output carries its index); streamed, each completion's last delta carries its
finish reason (n > 1), and the request's ``done`` goes out when the last of them ended, with
every completion's map. ``Held`` is a request waiting in the fair queue for room in
the engine, ``Ended`` a completion that ended there without running.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from tpserve.client import protocol as P
from tpserve.sampling import SamplingParams
from tpserve.server.outbox import Peer


@dataclass
class Held:
    """A request held in the fair queue until the engine has room for it."""

    req: ClientRequest
    prompt: Callable[[], str | list[int]]
    params: SamplingParams


@dataclass
class Ended:
    """A completion that ended without running, as ``ClientRequest.finish`` reads one."""

    index: int
    finish_reason: str
    num_completion_tokens: int


@dataclass
class ClientRequest:
    """A client's ``generate`` in flight on one connection: its ids, its prompt figures, and
    the output the reply gathers (the done maps of its ``n`` completions, or a non-streamed
    request's text). Not the engine's state of a completion (engine.py's _Completion)."""

    peer: Peer
    client_id: str
    engine_id: str
    stream: bool
    prompt_tokens: int
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from the prefix cache (first completion's)
    arrival: float = 0.0
    last_token: float | None = None
    n: int = 1
    # n > 1: the finished completions' wire maps, and the unfinished ones' gathered output
    done: list = field(default_factory=list)
    parts: dict = field(default_factory=dict)   # index -> (text parts, token ids, logprobs)
    prompt_logprobs_sent: bool = False
    counts_sent: bool = False   # streamed: the first delta carries the prompt's counts
    prompt_logprobs: list | None = None  # wire entries not yet sent (they go with the done)
    logprobs_wanted: bool = False
    priority: int = 0
    timeout: float | None = None  # seconds from ``arrival``
    pooling: bool = False  # a ``pool`` request: one ``pooled`` reply (server._finish_pooling)

    def take(self, out) -> P.DeltaReply | None:
        """Count one engine output of this request; returns the ``delta`` to send (streamed,
        with output, or the end of one of ``n`` > 1 completions: the delta then carries its
        finish reason and counts, so that a client learns of each completion's end as it comes,
        not with the request's ``done``), else None: a request that is not streamed gathers
        its output for the ``done``. Prompt log-probabilities not sent in a delta go with the done.
        The first delta also carries the prompt's counts (prompt and cached tokens): a stream's
        header (the Messages API's ``message_start``) reports them as its ``done`` will."""
        if out.num_prompt_tokens:
            self.prompt_tokens = out.num_prompt_tokens
        if out.index == 0 and out.num_cached_tokens:
            self.cached_tokens = out.num_cached_tokens
        self.completion_tokens += len(out.new_token_ids)
        logprobs = wire_logprobs(out.logprobs)
        prompt_lps = wire_prompt_logprobs(out.prompt_logprobs)
        delta = None
        if self.stream:
            ends = out.finished and self.n > 1  # the completion's end goes with its last delta
            if out.new_token_ids or out.new_text or ends:
                delta = P.DeltaReply(self.client_id, out.new_text, list(out.new_token_ids), logprobs=logprobs,
                                     index=out.index, prompt_logprobs=prompt_lps)
                self.prompt_logprobs_sent |= prompt_lps is not None
                if not self.counts_sent:  # known once the prompt is scheduled: the answer's header
                    delta.prompt_tokens, delta.cached_tokens = self.prompt_tokens, self.cached_tokens
                    self.counts_sent = True
            if ends:
                delta.finish_reason = out.finish_reason or "stop"
                delta.completion_tokens = out.num_completion_tokens
                delta.prompt_tokens = self.prompt_tokens
                delta.cached_tokens = self.cached_tokens
        else:
            text_parts, token_ids, lps = self.parts.setdefault(out.index, ([], [], []))
            text_parts.append(out.new_text)
            token_ids.extend(out.new_token_ids)
            if logprobs is not None:
                lps.extend(logprobs)
        if prompt_lps is not None and not self.prompt_logprobs_sent:
            self.prompt_logprobs = prompt_lps  # goes with the done message
        return delta

    def finish(self, out) -> P.DoneReply | None:
        """One completion ended (an engine output, or an ``Ended``); returns the request's
        ``done`` once its last of ``n`` ended, else None."""
        item = {"index": out.index, "finish_reason": out.finish_reason or "stop",
                "completion_tokens": out.num_completion_tokens}
        if not self.stream:
            text_parts, token_ids, lps = self.parts.pop(out.index, ([], [], []))
            item.update(text="".join(text_parts), token_ids=token_ids,
                        logprobs=lps if self.logprobs_wanted else None)
        self.done.append(item)
        if len(self.done) < self.n:
            return None
        first = min(self.done, key=lambda c: c["index"])
        done = P.DoneReply(self.client_id, first["finish_reason"], self.prompt_tokens,
                           sum(c["completion_tokens"] for c in self.done) or self.completion_tokens,
                           abort_reason=None, prompt_logprobs=self.prompt_logprobs,
                           cached_tokens=self.cached_tokens or None)
        if not self.stream:
            done.text, done.token_ids, done.logprobs = first["text"], first["token_ids"], first["logprobs"]
        if self.n > 1:
            done.completions = sorted(self.done, key=lambda c: c["index"])
        return done

    def aborted(self, reason: str) -> P.DoneReply:
        """The ``done`` of this request ended early (finish_reason "abort", ``reason``)."""
        done = P.DoneReply(self.client_id, "abort", self.prompt_tokens, self.completion_tokens,
                           abort_reason=reason, cached_tokens=self.cached_tokens or None)
        if not self.stream:
            text_parts, token_ids, _ = self.parts.get(0, ([], [], []))
            done.text, done.token_ids = "".join(text_parts), token_ids
        return done


def wire_prompt_logprobs(entries) -> list | None:
    if entries is None:
        return None
    return [None if e is None else [e.logprob, [[t, v] for t, v in e.top]] for e in entries]


def wire_logprobs(logprobs) -> list | None:
    if logprobs is None:
        return None
    return [[lp.logprob, [[t, v] for t, v in lp.top]] for lp in logprobs]
