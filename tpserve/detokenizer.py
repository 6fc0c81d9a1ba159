"""Incremental detokenization and stop strings.

Decoding the whole completion every step costs O(n^2) over a request. Instead each request keeps
two offsets into its token list: text before ``prefix_offset`` is settled, and the tokens in
``[prefix_offset, read_offset)`` are re-decoded as left context so that byte-level pieces and
leading spaces come out right. A step's new text is ``decode(tokens[prefix:]) minus
decode(tokens[prefix:read])``; it is held back while it ends in an incomplete UTF-8 sequence
(U+FFFD), and released once the following token completes it.
"""
from __future__ import annotations

# Tokens of left context re-decoded with each new token.
_CONTEXT = 6


class IncrementalDetokenizer:
    """``stop``: stop strings; ``include_stop``: a matched stop string stays in the text
    (vLLM's include_stop_str_in_output); ``skip_special_tokens`` /
    ``spaces_between_special_tokens``: as the tokenizer's decode takes them."""

    def __init__(self, tokenizer, prompt_token_ids: list[int], stop: list[str] | None = None,
                 include_stop: bool = False, skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.include_stop = include_stop
        self.skip_special_tokens = skip_special_tokens
        self._decode_kw = {} if spaces_between_special_tokens else {"spaces_between_special_tokens": False}
        # A stop string must end after this offset of the text to count (min_tokens).
        self.stop_from = 0
        self.tokens: list[int] = list(prompt_token_ids[-_CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.tokens)
        self.text = ""
        self.stop = stop or []
        # Text that may still turn into a stop string is not released yet.
        self._hold = max((len(s) for s in self.stop), default=1) - 1
        self.emitted = 0
        self.matched_stop: str | None = None  # the stop string find_stop found

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens,
                                     clean_up_tokenization_spaces=False, **self._decode_kw)

    def add(self, token_ids: list[int]) -> None:
        for t in token_ids:
            self.tokens.append(int(t))
            prefix = self._decode(self.tokens[self.prefix_offset:self.read_offset])
            full = self._decode(self.tokens[self.prefix_offset:])
            if full.endswith("\ufffd") or len(full) < len(prefix):
                continue
            self.text += full[len(prefix):]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.tokens)

    def flush(self) -> None:
        """At the end of a request: release held-back bytes even if they are not valid UTF-8,
        so the streamed text equals a plain decode of all completion tokens."""
        prefix = self._decode(self.tokens[self.prefix_offset:self.read_offset])
        full = self._decode(self.tokens[self.prefix_offset:])
        if len(full) > len(prefix):
            self.text += full[len(prefix):]
        self.prefix_offset = self.read_offset = len(self.tokens)

    def ignore_stops_so_far(self) -> None:
        """Stop strings that end in the text produced so far do not count (before min_tokens)."""
        self.stop_from = len(self.text)

    def find_stop(self) -> bool:
        """If a stop string occurs in the text, cut the text before it (after it, with
        ``include_stop``), keep it in ``matched_stop`` and return True."""
        if not self.stop:
            return False
        start = max(0, self.emitted - self._hold)
        cut = -1
        for s in self.stop:
            i = self.text.find(s, max(start, self.stop_from - len(s) + 1))
            end = i + len(s) if self.include_stop else i
            if i != -1 and (cut == -1 or end < cut):
                cut, self.matched_stop = end, s
        if cut == -1:
            return False
        self.text = self.text[:cut]
        return True

    def take_new_text(self, final: bool = False) -> str:
        """Text not yet handed out; keeps back a possible stop-string prefix unless ``final``."""
        end = len(self.text) if final else max(self.emitted, len(self.text) - self._hold)
        new = self.text[self.emitted:end]
        self.emitted = end
        return new
