"""The OpenAI response of one HTTP request, built from its choice events (app.py's ``Front.choices``).

``Response`` turns each choice's Deltas and GenerateResult into OpenAI's JSON: a whole
``text_completion`` / ``chat.completion`` once every choice is done, or server-sent chunks as
they come (``chunks``, then ``final_chunks``: usage and ``[DONE]``). Choice ``i * n + j`` is
completion j of prompt i; with ``echo`` a choice starts with its prompt's text (and, with
logprobs, the prompt tokens' log-probabilities, which completion 0 of each prompt reports).
Chat choices whose tools constrain the answer have their calls read back out (tool_calls.py).
With a reasoning parser (reasoning.py), a chat choice's thoughts go to ``reasoning_content`` and
``reasoning`` (both names, as vLLM used both), and only the answer after them to ``content`` and
the tool-call parsing. A model served in harmony (gpt-oss: harmony.py) has its answer's token
ids parsed instead: the analysis channel as the reasoning, tool calls, the rest as content.
Streamed, a choice's last chunk (its ``finish_reason``) goes out as soon as its completion
ended (the end its last Delta carries when n > 1), not when the whole request is done.
"""
from __future__ import annotations

import json
import time
import uuid

from tpserve.client.client import GenerateResult
from tpserve.fronts.http import openai_api as O
from tpserve.fronts.http.harmony import HarmonyStream, parse_whole
from tpserve.fronts.http.reasoning import REASONING, ReasoningStream, split_reasoning
from tpserve.fronts.http.tool_calls import ToolCallStream, split_calls


def sse_event(obj) -> str:
    """One server-sent event carrying ``obj`` as compact JSON."""
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


class Response:
    """Builds one request's OpenAI response (whole or as SSE chunks) from choice events.

    ``prompts[i]`` are prompt i's token ids and ``prompt_texts[i]`` its text (echo). With echo,
    a choice's text starts with its prompt's, and with logprobs its logprobs start with the
    prompt tokens' (from the daemon's prompt log-probabilities; the first token has none)."""

    def __init__(self, front, job: O.Job, prompts: list[list[int]], prompt_texts: list[str] | None = None):
        self.front, self.job = front, job
        self.id = ("chatcmpl-" if job.chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.prompts = prompts
        self.prompt_texts = prompt_texts or [""] * len(prompts)
        self.n_choices = len(prompts) * job.n
        self.text = [[] for _ in range(self.n_choices)]
        self.token_ids = [[] for _ in range(self.n_choices)]
        self.logprobs = [[] for _ in range(self.n_choices)]
        self.prompt_lps: list = [None] * len(prompts)  # per prompt (its completion 0 reports them)
        self.offset = [0] * self.n_choices
        self.results: dict[int, object] = {}
        self.role_sent = [False] * self.n_choices
        self.ended = [False] * self.n_choices  # the choice's last chunk (its finish_reason) was sent
        self.echoed = [False] * self.n_choices
        self.token_text = (lambda t: f"token_id:{t}") if job.token_ids_as_text else front.token_text
        # Chat with tools whose tool_choice constrains the answer: calls are read back out.
        tools = job.tools if job.chat and job.tools is not None and job.tools.constrains else None
        self.tool_streams = [ToolCallStream() for _ in range(self.n_choices)] if tools else None
        self.parser = getattr(front, "reasoning_parser", None) if job.chat else None
        self.reasoning_streams = None
        self.harmony = getattr(front, "harmony", None) if job.chat else None
        self.harmony_streams = None
        if self.harmony is not None:  # the token ids are parsed (harmony.py), not the text
            self.harmony_streams = [HarmonyStream(self.harmony) for _ in range(self.n_choices)]
            self.tool_streams, self.parser = None, None
        elif self.parser:
            self.reasoning_streams = [ReasoningStream(self.parser, job.thinking_opened)
                                      for _ in range(self.n_choices)]

    def _entries(self, delta) -> list:
        if delta.logprobs is None:
            return []
        return [(tok, lp, top) for tok, (lp, top) in zip(delta.token_ids, delta.logprobs)]

    def _take_prompt_logprobs(self, index: int, item) -> None:
        lps = getattr(item, "prompt_logprobs", None)
        if lps is not None and self.prompt_lps[index // self.job.n] is None:
            self.prompt_lps[index // self.job.n] = lps

    def _echo(self, index: int) -> tuple[str, list]:
        """The prompt's text and logprobs entries a choice starts with (once)."""
        if not self.job.echo or self.echoed[index]:
            return "", []
        self.echoed[index] = True
        if self.job.chat:  # vLLM: the last message's content, when it is the assistant's
            return self.prompt_texts[0], []
        ids = self.prompts[index // self.job.n]
        entries = []
        if self.job.params.logprobs is not None:
            lps = self.prompt_lps[index // self.job.n] or [None] * len(ids)
            entries = [(t, None, None) if e is None else (t, e[0], e[1]) for t, e in zip(ids, lps)]
        return self.prompt_texts[index // self.job.n], entries

    def _logprobs_obj(self, index: int, entries: list):
        if self.job.params.logprobs is None:
            return None
        if self.job.chat:
            return O.chat_logprobs(entries, self.token_text)
        obj = O.completion_logprobs(entries, self.token_text, self.offset[index])
        self.offset[index] += sum(len(t) for t in obj["tokens"])
        return obj

    def _extras(self, index: int) -> dict:
        """vLLM's extra choice fields: prompt_logprobs, token_ids / prompt_token_ids."""
        out = {}
        if self.job.params.prompt_logprobs is not None and not self.job.chat:
            out["prompt_logprobs"] = O.prompt_logprobs_obj(self.prompts[index // self.job.n],
                                                           self.prompt_lps[index // self.job.n] or [],
                                                           self.token_text)
        if self.job.return_token_ids:
            out["prompt_token_ids"] = self.prompts[index // self.job.n]
            out["token_ids"] = self.token_ids[index]
        return out

    def usage(self) -> dict:
        firsts = [r for i, r in self.results.items() if i % self.job.n == 0]  # one per prompt
        return O.usage(sum(r.prompt_tokens for r in firsts), sum(r.completion_tokens for r in self.results.values()),
                       sum(r.cached_tokens for r in firsts))

    # ---- streaming -------------------------------------------------------------------------
    def _chunk(self, choice: dict) -> str:
        body = {"id": self.id, "object": "chat.completion.chunk" if self.job.chat else "text_completion",
                "created": self.created, "model": self.front.model_name, "choices": [choice]}
        if self.job.include_usage:
            body["usage"] = None
        return sse_event(body)

    def chunks(self, index: int, item) -> list[str]:
        """The chunks of one choice event: a Delta's output, and the choice's last chunk (its
        ``finish_reason``) when the event ends it -- a Delta carrying the end of its completion
        (n > 1: it comes as soon as that completion ended, while its siblings run on) or the
        choice's GenerateResult. A GenerateResult of a choice that already ended only counts
        towards the usage."""
        out = []
        self._take_prompt_logprobs(index, item)
        if isinstance(item, GenerateResult):
            self.results[index] = item
            if self.ended[index]:
                return out
        if self.job.chat and not self.role_sent[index]:
            self.role_sent[index] = True
            out.append(self._chunk({"index": index, "delta": {"role": "assistant", "content": ""},
                                    "logprobs": None, "finish_reason": None}))
        echo_text, echo_entries = self._echo(index)
        if isinstance(item, GenerateResult):
            return out + self._last_chunks(index, item.finish_reason, echo_text, echo_entries)
        if item.finish_reason is None or item.token_ids or item.text:
            out += self._output_chunks(index, item, echo_text, echo_entries)
            echo_text, echo_entries = "", []
        if item.finish_reason is not None:
            out += self._last_chunks(index, item.finish_reason, echo_text, echo_entries)
        return out

    def _last_chunks(self, index: int, reason: str, echo_text: str, echo_entries: list) -> list[str]:
        """A choice's last chunk, carrying its ``finish_reason`` (and what it still holds back:
        an echo not yet sent, tool-call deltas)."""
        out = []
        self.ended[index] = True
        if self.harmony_streams is not None:
            hs = self.harmony_streams[index]
            out += [self._chunk({"index": index, "delta": d, "logprobs": None, "finish_reason": None})
                    for d in hs.flush()]
            if hs.num_calls and reason == "stop":
                reason = "tool_calls"
        if self.reasoning_streams is not None:
            out += self._answer_chunks(index, self.reasoning_streams[index].flush(), None)
        if self.tool_streams is not None:
            ts = self.tool_streams[index]
            out += [self._chunk({"index": index, "delta": d, "logprobs": None, "finish_reason": None})
                    for d in ts.flush()]
            if ts.num_calls and reason == "stop":
                reason = "tool_calls"
        if self.job.chat:
            if echo_text:
                out.append(self._chunk({"index": index, "delta": {"content": echo_text}, "logprobs": None,
                                        "finish_reason": None}))
            out.append(self._chunk({"index": index, "delta": {}, "logprobs": None, "finish_reason": reason}))
        else:
            choice = {"index": index, "text": echo_text, "logprobs": self._logprobs_obj(index, echo_entries)
                      if echo_entries else None, "finish_reason": reason}
            if self.job.params.prompt_logprobs is not None:
                choice.update(self._extras(index))
            out.append(self._chunk(choice))
        return out

    def _output_chunks(self, index: int, item, echo_text: str, echo_entries: list) -> list[str]:
        """The chunks of a Delta's text and tokens (after the prompt's, with echo)."""
        out = []
        self.token_ids[index] += item.token_ids
        lp = self._logprobs_obj(index, echo_entries + self._entries(item))
        if self.harmony_streams is not None:
            deltas = self.harmony_streams[index].feed(item.token_ids)
            if echo_text:
                deltas.insert(0, {"content": echo_text})
            if not deltas and lp is not None:  # held back tokens: their logprobs still go out
                deltas = [{}]
            for d in deltas:
                out.append(self._chunk({"index": index, "delta": d, "logprobs": lp, "finish_reason": None}))
                lp = None
        elif self.reasoning_streams is not None:
            if echo_text:
                out.append(self._chunk({"index": index, "delta": {"content": echo_text}, "logprobs": None,
                                        "finish_reason": None}))
            pieces = self.reasoning_streams[index].feed(item.text)
            out += self._answer_chunks(index, pieces, lp)
            if not pieces and lp is not None:  # held back text: its tokens' logprobs still go out
                out.append(self._chunk({"index": index, "delta": {}, "logprobs": lp, "finish_reason": None}))
        elif self.tool_streams is not None:
            for d in self.tool_streams[index].feed(item.text):
                out.append(self._chunk({"index": index, "delta": d, "logprobs": lp, "finish_reason": None}))
                lp = None
        elif self.job.chat:
            out.append(self._chunk({"index": index, "delta": {"content": echo_text + item.text}, "logprobs": lp,
                                    "finish_reason": None}))
        else:
            choice = {"index": index, "text": echo_text + item.text, "logprobs": lp, "finish_reason": None}
            if self.job.return_token_ids:
                choice["token_ids"] = item.token_ids
            out.append(self._chunk(choice))
        return out

    def _answer_chunks(self, index: int, pieces: list, lp) -> list[str]:
        """The chunks of a chat choice's (kind, text) pieces from its reasoning stream: thoughts as
        reasoning deltas, the answer as content or, with tools, through the tool-call parsing."""
        out = []
        for kind, text in pieces:
            if kind == REASONING:
                deltas = [{"reasoning_content": text, "reasoning": text}]
            elif self.tool_streams is not None:
                deltas = self.tool_streams[index].feed(text)
            else:
                deltas = [{"content": text}]
            for d in deltas:
                out.append(self._chunk({"index": index, "delta": d, "logprobs": lp, "finish_reason": None}))
                lp = None
        return out

    def final_chunks(self) -> list[str]:
        out = []
        if self.job.include_usage:
            body = {"id": self.id, "object": "chat.completion.chunk" if self.job.chat else "text_completion",
                    "created": self.created, "model": self.front.model_name, "choices": [],
                    "usage": self.usage()}
            out.append(sse_event(body))
        out.append("data: [DONE]\n\n")
        return out

    # ---- whole -----------------------------------------------------------------------------
    def add(self, index: int, item) -> None:
        self._take_prompt_logprobs(index, item)
        if isinstance(item, GenerateResult):
            self.results[index] = item
        else:
            self.text[index].append(item.text)
            self.token_ids[index] += item.token_ids
            self.logprobs[index] += self._entries(item)

    def whole(self) -> dict:
        choices = []
        for i in range(self.n_choices):
            echo_text, echo_entries = self._echo(i)
            text, reason = echo_text + "".join(self.text[i]), self.results[i].finish_reason
            lp = self._logprobs_obj(i, echo_entries + self.logprobs[i])
            if self.job.chat and self.harmony is not None:
                thoughts, answer, calls, _ = parse_whole(self.harmony, self.token_ids[i])
                message = {"role": "assistant", "content": echo_text + (answer or "") or None,
                           "reasoning_content": thoughts, "reasoning": thoughts}
                if calls:
                    message["tool_calls"] = calls
                    reason = "tool_calls" if reason == "stop" else reason
                choice = {"index": i, "message": message, "logprobs": lp, "finish_reason": reason}
            elif self.job.chat:
                message = {"role": "assistant", "content": text}
                if self.parser:
                    gen = "".join(self.text[i])
                    thoughts, answer = split_reasoning(gen, self.parser, self.job.thinking_opened)
                    text = echo_text + (answer or "")
                    message.update(content=text or None, reasoning_content=thoughts, reasoning=thoughts)
                if self.tool_streams is not None:
                    message["content"], calls = split_calls(text)
                    if calls:
                        message["tool_calls"] = calls
                        reason = "tool_calls" if reason == "stop" else reason
                choice = {"index": i, "message": message, "logprobs": lp, "finish_reason": reason}
            else:
                choice = {"index": i, "text": text, "logprobs": lp, "finish_reason": reason}
            choice.update(self._extras(i))
            choices.append(choice)
        return {"id": self.id, "object": "chat.completion" if self.job.chat else "text_completion",
                "created": self.created, "model": self.front.model_name, "choices": choices,
                "usage": self.usage()}
