"""GrammarCompiler: a request's ``structured_outputs`` as an llguidance matcher, compiled off the
serving loop, under a time and a size budget, and cached.

Why llguidance: it is maintained, has no torch dependency (its matcher fills a numpy int32
bitmask in place), compiles lazily (a 20-property schema builds in about a millisecond; lexer
states are built as masks are asked for), and speaks JSON schema, regular expressions and Lark
(with lazy lexemes, which the tool-call grammars use). See docs/structure.md.

Life of a grammar. ``compile`` only computes the cache key (the constraint's text and options)
on the caller's thread and returns a future. The compiler's one thread (niced, with a large
stack) hands the constraint to the grammar process (worker.py), which parses and converts it
(JSON text, GBNF -> Lark: pure Python, superlinear for GBNF) and builds it once as a trial, all
within ``timeout_s``; a constraint over the time or size budget, one the child crashed on, one
no text satisfies, or one the grammar engine rejects (a bad regex, an unsupported JSON-schema
keyword, an unsatisfiable schema, a Lark syntax error) resolves the future with an
InvalidFieldError naming the field and the reason. Otherwise the thread builds the template
``LLMatcher`` from the child's grammar text (llguidance drops the GIL while it builds) and its
first mask. Templates are cached by key (LRU, ``cache_size``), refusals too, so the same bad
input fails fast; each request takes a ``deep_copy`` of its template (sub-microsecond: the
compiled grammar and its lexer are shared). ``release`` stops a compilation nobody waits for
any more (the request was aborted or timed out): dropped if queued, the child killed if busy.

The llguidance tokenizer is built from the Hugging Face fast tokenizer's JSON on the worker
thread (and in the child), at the first compilation (a fraction of a second for a 150k
vocabulary), with the model's vocabulary size, so bitmask rows are ``ceil(vocab_size / 32)``
words wide (tokens the tokenizer lacks are never allowed), and the model's EOS ids (allowed
where the grammar may end).
"""
from __future__ import annotations

import copy
import json
import logging
import os
import queue
import threading
from collections import OrderedDict
from concurrent.futures import Future

from tpserve.config import DEFAULT_GRAMMAR_TIMEOUT
from tpserve.errors import InvalidFieldError
from tpserve.grammar.worker import (BUILD_STACK_BYTES, GrammarCancelled, GrammarProcess, GrammarRefused,
                                   parser_limits)

log = logging.getLogger("tpserve.grammar")

#: StructuredOutputsParams' fields that make a grammar (``disable_fallback`` changes nothing).
_FIELDS = ("json", "regex", "choice", "grammar", "json_object", "disable_any_whitespace",
           "disable_additional_properties", "whitespace_pattern")
# threading.stack_size is process-wide: one thread at a time changes it, then sets it back.
_STACK_LOCK = threading.Lock()


def cache_key(so) -> tuple:
    """What a StructuredOutputsParams' grammar depends on, hashable and cheap (a schema given as
    a dict, which only the offline API passes, is dumped; the wire carries text)."""
    kind = so.kind
    value = getattr(so, kind)
    if kind == "json" and not isinstance(value, str):
        value = json.dumps(value, sort_keys=True)
    elif kind == "choice":
        value = tuple(value)
    return (kind, value, so.disable_any_whitespace, so.disable_additional_properties, so.whitespace_pattern)


def job_fields(so) -> dict:
    """StructuredOutputsParams' grammar fields as the grammar process takes them (a schema as text)."""
    out = {name: getattr(so, name) for name in _FIELDS if getattr(so, name) is not None}
    if isinstance(out.get("json"), dict):
        out["json"] = json.dumps(out["json"])
    return out


class _Job:
    __slots__ = ("key", "so", "field", "future", "waiters", "cancelled")

    def __init__(self, key, so, field: str):
        self.key, self.so, self.field = key, so, field
        self.future: Future = Future()
        self.waiters = 1
        self.cancelled = threading.Event()


class GrammarCompiler:
    """Compiles grammars for one model's tokenizer off the caller's thread (see the module).

    ``timeout_s`` is the time budget of one grammar in the grammar process (worker.py); its
    size budget is worker.MAX_GRAMMAR_TEXT_CHARS and worker.MAX_GRAMMAR_SYMBOLS."""

    def __init__(self, hf_tokenizer, vocab_size: int, eos_token_ids: list[int], cache_size: int = 256,
                 timeout_s: float = DEFAULT_GRAMMAR_TIMEOUT):
        self._hf_tokenizer = hf_tokenizer
        self.vocab_size = vocab_size
        self._eos = list(eos_token_ids)
        self._cache_size = cache_size
        self.timeout_s = float(timeout_s)
        self._cache: OrderedDict[tuple, Future] = OrderedDict()
        self._jobs: dict[Future, _Job] = {}  # unfinished compilations
        self._lock = threading.Lock()
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._process: GrammarProcess | None = None
        self._closed = False
        self._lltokenizer = None
        self.num_compiled = 0

    def compile(self, so, field: str) -> Future:
        """A future of the template LLMatcher of ``so`` (a validated StructuredOutputsParams); it
        raises InvalidFieldError naming ``field`` when the grammar is refused. Cached: an equal
        constraint shares the future. Only the cache key is computed here."""
        key = cache_key(so)
        with self._lock:
            fut = self._cache.get(key)
            if fut is not None:
                self._cache.move_to_end(key)
                job = self._jobs.get(fut)
                if job is not None:
                    job.waiters += 1
                return fut
            job = _Job(key, so, field)
            fut = job.future
            if self._closed:
                fut.set_exception(InvalidFieldError(field, "cannot be compiled: the engine is shutting down"))
                return fut
            self._jobs[fut] = job
            self._cache[key] = fut
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
            self._start_thread()
        self._queue.put(job)
        return fut

    def release(self, fut: Future) -> None:
        """One request waiting on ``fut`` went away. When it was the last, the compilation
        stops: dropped if still queued, the grammar process killed if it works on it."""
        with self._lock:
            job = self._jobs.get(fut)
            if job is None or fut.done():
                return
            job.waiters -= 1
            if job.waiters > 0:
                return
            job.cancelled.set()
            del self._jobs[fut]
            if self._cache.get(job.key) is fut:
                del self._cache[job.key]
            process = self._process
        if not fut.cancel() and process is not None:  # running: stop the grammar process
            process.cancel()

    def tokenizer(self):
        """The llguidance tokenizer (built on first use)."""
        if self._lltokenizer is None:
            import llguidance
            self._lltokenizer = llguidance.LLTokenizer(self._tokenizer_json(), n_vocab=self.vocab_size,
                                                       eos_token=self._eos)
        return self._lltokenizer

    def _tokenizer_json(self) -> str:
        backend = getattr(self._hf_tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise InvalidFieldError("structured_outputs", "needs a fast (tokenizers) tokenizer; "
                                    f"this model's is a {type(self._hf_tokenizer).__name__}")
        backend = copy.copy(backend)
        backend.no_padding()
        backend.no_truncation()
        return backend.to_str()

    @property
    def process_pid(self) -> int | None:
        """The grammar process's pid while it runs (tests)."""
        return self._process.pid if self._process is not None else None

    # ---- the compiling thread ------------------------------------------------------------------
    def _start_thread(self) -> None:
        if self._thread is not None:
            return
        # A large stack: llguidance's grammar builder recurses per chained rule (worker.py).
        with _STACK_LOCK:
            previous = threading.stack_size(BUILD_STACK_BYTES)
            try:
                self._thread = threading.Thread(target=self._work, name="tpserve-grammar", daemon=True)
                self._thread.start()
            finally:
                threading.stack_size(previous)

    def _work(self) -> None:
        try:  # a niced thread: its builds yield the cores to the engine's threads
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
        except (OSError, AttributeError):
            pass
        while (job := self._queue.get()) is not None:
            if not job.future.set_running_or_notify_cancel():
                continue  # released while queued
            try:
                matcher = self._build(job)
            except BaseException as e:  # noqa: BLE001  InvalidFieldError, or a fault to report
                job.future.set_exception(e)
            else:
                job.future.set_result(matcher)
            finally:
                with self._lock:
                    self._jobs.pop(job.future, None)

    def _build(self, job: _Job):
        """Convert and trial-build in the grammar process, then build the template here."""
        import llguidance
        if self._process is None:
            process = GrammarProcess(self._tokenizer_json(), self.vocab_size, self._eos)
            with self._lock:
                self._process = process
        try:
            text = self._process.run(job_fields(job.so), self.timeout_s, job.cancelled)
        except GrammarRefused as e:
            raise InvalidFieldError(job.field, e.reason) from None
        except GrammarCancelled:
            raise InvalidFieldError(job.field, "was not compiled: its request went away") from None
        matcher = llguidance.LLMatcher(self.tokenizer(), text, log_level=0, limits=parser_limits())
        if matcher.is_error():
            raise InvalidFieldError(job.field, f"the grammar engine rejects it: {matcher.get_error()}"[:2048])
        # The first mask builds the lexer states of the start (shared with every deep copy):
        # here, not in the first step that serves the grammar.
        matcher.compute_bitmask()
        if matcher.is_error():
            raise InvalidFieldError(job.field, "no text satisfies it (the grammar engine finds no token to "
                                    f"start with: {matcher.get_error().splitlines()[0]})"[:1024])
        self.num_compiled += 1
        return matcher

    def shutdown(self) -> None:
        with self._lock:
            self._closed = True
            jobs = list(self._jobs.values())
            process = self._process
        for job in jobs:
            job.cancelled.set()
            job.future.cancel()
        if process is not None:
            process.close()
        self._queue.put(None)
