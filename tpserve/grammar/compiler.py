"""GrammarCompiler: a request's ``structured_outputs`` as an llguidance grammar, compiled on a
worker thread and cached by its text.

Why llguidance: it is maintained, has no torch dependency (its matcher fills a numpy int32
bitmask in place), compiles lazily (a 20-property schema builds in about a millisecond; lexer
states are built as masks are asked for), and speaks JSON schema, regular expressions and Lark
(with lazy lexemes, which the tool-call grammars use). See docs/structure.md.

Life of a grammar: ``grammar_text`` turns the constraint into llguidance's grammar text (cheap,
on the caller's thread); ``compile`` returns a future of a template ``LLMatcher`` built on the
compiler's one worker thread (llguidance drops the GIL while it builds), so the serving loop
never waits for a compilation. Templates are cached by text (LRU, ``cache_size``); each request
takes a ``deep_copy`` of its template (sub-microsecond: the compiled grammar and its lexer are
shared). A grammar the engine rejects (a bad regex, an unsupported JSON-schema keyword, an
unsatisfiable schema, a Lark syntax error) resolves its future with an InvalidFieldError naming
the field; that is cached too, so the same bad input fails fast.

The llguidance tokenizer is built from the Hugging Face fast tokenizer's JSON on the worker
thread, at the first compilation (a fraction of a second for a 150k vocabulary), with the
model's vocabulary size, so bitmask rows are ``ceil(vocab_size / 32)`` words wide (tokens the
tokenizer lacks are never allowed), and the model's EOS ids (allowed where the grammar may end).
"""
from __future__ import annotations

import copy
import json
import logging
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

from tpserve.errors import InvalidFieldError

log = logging.getLogger("tpserve.grammar")

#: Keywords whose sub-schemas hold object schemas (``disable_additional_properties`` walks them).
_SCHEMA_MAPS = ("properties", "$defs", "definitions")
_SUB_SCHEMAS = ("items", "prefixItems", "anyOf", "oneOf", "allOf", "additionalProperties")


def _close_objects(schema):
    """A copy of ``schema`` whose object schemas without ``additionalProperties`` forbid any."""
    if isinstance(schema, list):
        return [_close_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {k: _close_objects(v) for k, v in out[key].items()}
    for key in _SUB_SCHEMAS:
        if isinstance(out.get(key), (dict, list)):
            out[key] = _close_objects(out[key])
    if isinstance(out.get("properties"), dict) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def grammar_text(so) -> str:
    """llguidance's grammar text for a validated StructuredOutputsParams (the cache key)."""
    import llguidance
    kind = so.kind
    if kind in ("json", "json_object"):
        schema = json.loads(so.json) if isinstance(so.json, str) else copy.deepcopy(so.json)
        if kind == "json_object":
            schema = {"type": "object"}
        if so.disable_additional_properties:
            schema = _close_objects(schema)
        options = {"whitespace_flexible": not so.disable_any_whitespace}
        if so.whitespace_pattern is not None:
            options = {"whitespace_flexible": True, "whitespace_pattern": so.whitespace_pattern}
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)
        except (ValueError, TypeError) as e:
            raise InvalidFieldError(f"structured_outputs.{kind}", f"is not a usable JSON schema: {e}"[:1024]) from None
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(so.regex)
    if kind == "choice":
        # Lark string literals take JSON's escapes.
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in so.choice))
    try:  # Lark, or GBNF converted to Lark
        return llguidance.grammar_from("grammar", so.grammar)
    except ValueError as e:
        raise InvalidFieldError("structured_outputs.grammar", str(e)[:1024]) from None


class GrammarCompiler:
    """Compiles grammars for one model's tokenizer off the caller's thread (see the module)."""

    def __init__(self, hf_tokenizer, vocab_size: int, eos_token_ids: list[int], cache_size: int = 256):
        self._hf_tokenizer = hf_tokenizer
        self.vocab_size = vocab_size
        self._eos = list(eos_token_ids)
        self._cache_size = cache_size
        self._cache: OrderedDict[str, Future] = OrderedDict()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="tpserve-grammar")
        self._lltokenizer = None
        self.num_compiled = 0

    def compile(self, text: str, field: str) -> Future:
        """A future of the template LLMatcher of grammar ``text``; it raises InvalidFieldError
        naming ``field`` when the grammar is rejected. Cached by ``text``."""
        with self._lock:
            fut = self._cache.get(text)
            if fut is not None:
                self._cache.move_to_end(text)
                return fut
            fut = self._pool.submit(self._build, text, field)
            self._cache[text] = fut
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
            return fut

    def tokenizer(self):
        """The llguidance tokenizer (built on first use)."""
        if self._lltokenizer is None:
            import llguidance
            backend = getattr(self._hf_tokenizer, "backend_tokenizer", None)
            if backend is None:
                raise InvalidFieldError("structured_outputs", "needs a fast (tokenizers) tokenizer; "
                                        f"this model's is a {type(self._hf_tokenizer).__name__}")
            backend = copy.copy(backend)
            backend.no_padding()
            backend.no_truncation()
            self._lltokenizer = llguidance.LLTokenizer(backend.to_str(), n_vocab=self.vocab_size,
                                                       eos_token=self._eos)
        return self._lltokenizer

    def _build(self, text: str, field: str):
        import llguidance
        matcher = llguidance.LLMatcher(self.tokenizer(), text, log_level=0)
        if matcher.is_error():
            raise InvalidFieldError(field, f"the grammar engine rejects it: {matcher.get_error()}"[:2048])
        # The first mask builds the lexer states of the start (shared with every deep copy):
        # here, not in the first step that serves the grammar.
        matcher.compute_bitmask()
        self.num_compiled += 1
        return matcher

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
