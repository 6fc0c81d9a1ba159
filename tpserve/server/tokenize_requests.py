"""The server's tokenizing: long text prompts and ``tokenize`` requests, off the serving loop.

A text longer than ``inline_tokenize_chars`` is tokenized on the tokenizing thread
(tokenizing.py) -- in the tokenizer process when the engine names its tokenizer -- and its ids
come back packed (an ``array.array("i")``); a short one is tokenized at once. A ``tokenize``
request counts against its connection's cap of requests in flight while it waits.

``TokenizeRequests`` is a part of ``Server`` (server.py): it uses the server's engine, peers
and tokenizer state.
"""
from __future__ import annotations

import array
import logging
import math
import time
from typing import Callable

from tpserve.client import protocol as P
from tpserve.errors import InvalidFieldError, InvalidRequestError
from tpserve.tokenizer import TokenizerProcess, TokenizerProcessError

log = logging.getLogger("tpserve.daemon")


class TokenizeRequests:
    """The server's tokenizing of prompts and ``tokenize`` requests (see the module docstring)."""

    def _tokenize(self, prompt: str, add_special_tokens: bool = False) -> array.array:
        """On the tokenizing thread: in the tokenizer process when the engine names its
        tokenizer (the thread then only waits on a pipe), else with the engine's. The ids come
        packed (an ``array.array("i")``): the engine checks them, and a tokenize reply carries
        them, without a Python int per id."""
        path = self.engine.tokenizer_path()
        if path is None:
            return array.array("i", self.engine.tokenize(prompt, add_special_tokens))
        with self._tokenizer_process_lock:  # against close(): no child is made after it
            if self._closed:
                raise TokenizerProcessError("the daemon is closing")
            if self._tokenizer_process is None:
                self._tokenizer_process = TokenizerProcess(path)
            proc = self._tokenizer_process
        return proc.encode(prompt, add_special_tokens, packed=True)

    def _on_tokenize(self, identity: bytes, msg: P.TokenizeRequest) -> None:
        """Answer the text's token ids: a long text from the tokenizing thread (as a long
        prompt is), a short one at once. In flight it counts against the connection's cap."""
        def error(code, message, **kw):
            self.peers.reply(identity, P.ErrorReply(code, message[:P.MAX_MESSAGE_CHARS], **kw))

        if self._stopping:
            return error(P.SHUTTING_DOWN, "the daemon is shutting down (draining) and admits no new requests",
                         id=msg.id, retry_after=float(max(1, math.ceil(self._stop_deadline - time.monotonic()))))
        peer = self.peers.get(identity)
        if (identity, msg.id) in self._encodes or (peer is not None and msg.id in peer.requests):
            return error(P.DUPLICATE_ID, f"request id {msg.id!r} is already in flight on this connection; "
                         "that request continues", field="id")
        if self._refused_over_cap(identity, peer, msg.id):
            return
        if len(msg.text) > self.options.inline_tokenize_chars:
            self._encodes[identity, msg.id] = self._tokenizer.encode(msg.text, msg.add_special_tokens)
            self._lend_cores()  # now, not after the rest of this turn's messages
            return
        self._answer_encode(identity, msg.id, lambda: self.engine.tokenize(msg.text, msg.add_special_tokens))

    def _answer_tokenized(self) -> None:
        for key, future in list(self._encodes.items()):
            if future.done():
                del self._encodes[key]
                self._answer_encode(*key, future.result)

    def _answer_encode(self, identity: bytes, client_id: str,
                       ids_of: Callable[[], list[int] | array.array]) -> None:
        """Reply ``ids_of()``, or the error it raises."""
        try:
            ids = ids_of()
        except (InvalidRequestError, InvalidFieldError) as e:
            reply = P.ErrorReply(P.INVALID_REQUEST, e.reason[:P.MAX_MESSAGE_CHARS], id=client_id, field="text")
        except Exception as e:
            log.error("could not tokenize the text of request %r: %s", client_id, e)
            reply = P.ErrorReply(P.INTERNAL, f"the text could not be tokenized: {e}"[:P.MAX_MESSAGE_CHARS],
                                 id=client_id)
        else:
            if len(ids) <= P.MAX_TOKENIZED_IDS:
                reply = P.TokensReply(client_id, ids)
            else:
                reply = P.ErrorReply(P.INVALID_REQUEST, f"the text is {len(ids)} tokens, more than one reply "
                                     f"carries ({P.MAX_TOKENIZED_IDS})", id=client_id, field="text")
        self.peers.reply(identity, reply)
