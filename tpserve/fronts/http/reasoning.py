"""Reasoning output: a chat answer's thoughts split from its answer (``--reasoning-parser``).

Reasoning models write their thoughts between ``<think>`` and ``</think>`` before the answer.
With a parser set, the HTTP front splits the generated *text* (not the token ids) at the first
``</think>``, so it works whether the tokenizer spells the tag as one special token or as
several, and when the chat template already opened ``<think>`` at the end of the prompt (the
output then has no opening tag). A ``<think>`` at the very start of the output is removed.

The parsers (vLLM's names):

* ``deepseek_r1``: the output is thoughts until ``</think>``; one that never closes them is all
  reasoning, with no answer (generation ended inside the thoughts).
* ``qwen3``: the output is thoughts only when it starts with ``<think>`` or the prompt opened
  one; otherwise it is all answer (Qwen3 with ``enable_thinking`` false, whose template closes
  the thoughts in the prompt). Thoughts that never close are reasoning with no answer.
* ``openai_gptoss``: gpt-oss's harmony format; not a split of the text: harmony.py renders the
  prompt and parses the answer's token ids (the default of a gpt-oss model).

``ReasoningStream`` does the split incrementally, holding back only a tail that may be the start
of a tag split across deltas; ``split_reasoning`` runs it over a whole text, so a whole answer
and a streamed one always agree. Tool calls are read from the answer part only (chat_output.py).
"""
from __future__ import annotations

OPEN, CLOSE = "<think>", "</think>"
PARSERS = ("deepseek_r1", "qwen3")
# gpt-oss's harmony format, parsed from the token ids by harmony.py (a gpt-oss model's default)
HARMONY = "openai_gptoss"
CHOICES = PARSERS + (HARMONY,)  # --reasoning-parser's values

REASONING, CONTENT = "reasoning", "content"


def prompt_opens_thinking(prompt_text: str) -> bool:
    """Whether the rendered prompt ends with an opened ``<think>`` (blanks after it allowed)."""
    tail = prompt_text.rstrip()
    return tail.endswith(OPEN)


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that is a proper start of ``tag``."""
    for k in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


class ReasoningStream:
    """Splits one choice's output text, delta by delta, into (REASONING | CONTENT, text) pieces."""

    def __init__(self, parser: str, prompt_opened: bool = False):
        if parser not in PARSERS:
            raise ValueError(f"unknown reasoning parser {parser!r}; one of {', '.join(PARSERS)}")
        self.parser = parser
        self.prompt_opened = prompt_opened
        self.mode: str | None = None   # None: the output's start is not known yet
        self.buf = ""

    def _start(self, opened_here: bool) -> None:
        thinking = opened_here or self.prompt_opened or self.parser == "deepseek_r1"
        self.mode = REASONING if thinking else CONTENT

    def feed(self, text: str) -> list[tuple[str, str]]:
        self.buf += text
        out: list[tuple[str, str]] = []
        if self.mode is None:
            if OPEN.startswith(self.buf) and len(self.buf) < len(OPEN):
                return out  # may still become "<think>"
            opened = self.buf.startswith(OPEN)
            if opened:
                self.buf = self.buf[len(OPEN):]
            self._start(opened)
        if self.mode == REASONING:
            at = self.buf.find(CLOSE)
            if at >= 0:
                thoughts, self.buf = self.buf[:at], self.buf[at + len(CLOSE):]
                if thoughts:
                    out.append((REASONING, thoughts))
                self.mode = CONTENT
            else:
                keep = _partial_suffix(self.buf, CLOSE)
                thoughts = self.buf[:len(self.buf) - keep]
                self.buf = self.buf[len(self.buf) - keep:]
                if thoughts:
                    out.append((REASONING, thoughts))
                return out
        if self.buf:
            out.append((CONTENT, self.buf))
            self.buf = ""
        return out

    def flush(self) -> list[tuple[str, str]]:
        """What is still held back, once the output has ended."""
        if self.mode is None:
            self._start(False)
        text, self.buf = self.buf, ""
        return [(self.mode, text)] if text else []


def split_reasoning(text: str, parser: str, prompt_opened: bool = False) -> tuple[str | None, str | None]:
    """(reasoning, answer) of a whole output; either is None when empty."""
    stream = ReasoningStream(parser, prompt_opened)
    parts = {REASONING: [], CONTENT: []}
    for kind, piece in stream.feed(text) + stream.flush():
        parts[kind].append(piece)
    return "".join(parts[REASONING]) or None, "".join(parts[CONTENT]) or None
