"""GrammarProcess: a request's constraint turned into llguidance's grammar text, and built once
as a trial, in a child process under a time budget.

Why a process. Everything a request's grammar asks of the CPU grows with what the request
sends, and some of it faster than linearly: llguidance converts GBNF to Lark in pure Python
(1,000 rules 1 s, 4,000 rules 18 s, 20,000 rules minutes), a JSON schema's text is parsed and
walked in Python, and the grammar builder itself recurses once per chained rule (a chain of a
few thousand rules overflows an 8 MiB thread stack: a segmentation fault, not an exception).
In a thread of the serving process the Python part holds the GIL, so every other stream stops
between two tokens, and no thread can be stopped at a deadline. In a child it is killed at the
budget, or when the request is aborted, and a crash costs only the child.

The child answers each job with the grammar text (the cache key's value on the parent's side)
or with the reason it refuses it: not usable as a schema, a regex or a grammar; over the size
budget (its text, or llguidance's symbol count); no text satisfying it (the first mask of a
fresh matcher leaves nothing); the grammar engine's own error. The trial build runs on a thread
whose stack (``TRIAL_STACK_BYTES``) is smaller than the one the parent builds on
(``BUILD_STACK_BYTES``): a grammar the child built, the parent builds too.

The child is niced (its own session and autogroup, as the tokenizer process), started on the
first job and again after it was killed or crashed. It dies with the parent's thread that
started it (PR_SET_PDEATHSIG). Wire: frames of ``tpserve.tokenizer`` (4-byte length + msgpack);
first ``{"tokenizer", "vocab_size", "eos"}`` answered by ``{"ready": true}``, then one job
``{"so": {...}, "max_chars": n, "max_symbols": n}`` at a time, answered by ``{"text": ...}`` or ``{"error": ...}``.
"""
from __future__ import annotations

import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time

import msgpack

from tpserve.tokenizer import _read_frame, _write_frame

log = logging.getLogger("tpserve.grammar")

#: Size budget: the grammar text handed to llguidance (a schema, a regex, Lark, GBNF once
#: converted) and its grammar's symbols (llguidance's ``max_grammar_size``, its own default).
MAX_GRAMMAR_TEXT_CHARS = 4 << 20
MAX_GRAMMAR_SYMBOLS = 500_000
#: Thread stacks of the trial build (child) and of the real one (parent): see the module.
TRIAL_STACK_BYTES = 64 << 20
BUILD_STACK_BYTES = 128 << 20
#: Seconds the child may take to start and load the tokenizer (not counted in a job's budget).
START_TIMEOUT_S = 60.0


class GrammarRefused(Exception):
    """The child refused the job (``reason``), ran past its budget, or died on it."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class GrammarCancelled(Exception):
    """The job was cancelled (its requests went away) before the child answered."""


def parser_limits(max_symbols: int | None = None):
    import llguidance
    return llguidance.LLParserLimits(max_grammar_size=max_symbols or MAX_GRAMMAR_SYMBOLS)


class GrammarProcess:
    """The child process of one model's grammar jobs (one job at a time; see the module).

    ``run`` blocks the calling thread (in ``select``, without the GIL) until the child answers,
    the budget passes, the child dies, or ``cancel`` is called from another thread."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: list[int], niceness: int = 10):
        self._init = msgpack.packb({"tokenizer": tokenizer_json, "vocab_size": int(vocab_size),
                                    "eos": [int(t) for t in eos_token_ids]})
        self.niceness = int(niceness)
        self._proc = None
        self._lock = threading.RLock()  # _running kills a dead child under it
        self._cancel_r, self._cancel_w = os.pipe()
        os.set_blocking(self._cancel_w, False)
        self._closed = False
        self.num_started = 0

    @property
    def pid(self) -> int | None:
        proc = self._proc
        return proc.pid if proc is not None and proc.poll() is None else None

    def run(self, so_fields: dict, budget_s: float, cancelled: threading.Event | None = None) -> str:
        """The grammar text of a constraint (StructuredOutputsParams' fields), or GrammarRefused /
        GrammarCancelled (once ``cancelled`` is set and ``cancel`` called). ``budget_s`` bounds
        the child's work on it, not its start."""
        cancelled = cancelled or threading.Event()
        self._drain_cancel()
        if cancelled.is_set():
            raise GrammarCancelled()
        proc = self._running()
        job = msgpack.packb({"so": so_fields, "max_chars": MAX_GRAMMAR_TEXT_CHARS,
                             "max_symbols": MAX_GRAMMAR_SYMBOLS})
        try:
            _write_frame(proc.stdin.fileno(), job)
        except OSError:
            self._kill(proc)
            raise GrammarRefused(self._death(proc)) from None
        state = self._wait(proc, budget_s, cancelled)
        if state == "cancelled":
            self._kill(proc)
            raise GrammarCancelled()
        if state == "timeout":
            self._kill(proc)
            raise GrammarRefused(f"took longer than the grammar time budget ({budget_s:g} s) to convert and "
                                 "build: send a smaller or simpler one")
        frame = _read_frame(proc.stdout)
        if frame is None:
            self._kill(proc)
            raise GrammarRefused(self._death(proc))
        reply = msgpack.unpackb(frame)
        if "error" in reply:
            raise GrammarRefused(reply["error"])
        return reply["text"]

    def cancel(self) -> None:
        """Wake the job in progress (from any thread): ``run`` raises GrammarCancelled if its
        ``cancelled`` event is set, else goes on waiting."""
        try:
            os.write(self._cancel_w, b"x")
        except (BlockingIOError, OSError):
            pass

    def close(self) -> None:
        """Kill the child; later ``run`` calls fail. Idempotent."""
        with self._lock:
            self._closed = True
            proc, self._proc = self._proc, None
        if proc is not None:
            self._kill(proc)
        self.cancel()

    # ---- the child ---------------------------------------------------------------------------
    def _wait(self, proc, budget_s: float, cancelled: threading.Event) -> str:
        deadline = time.monotonic() + budget_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return "timeout"
            readable, _, _ = select.select([proc.stdout, self._cancel_r], [], [], left)
            if self._cancel_r in readable:
                self._drain_cancel()
                if cancelled.is_set():
                    return "cancelled"
            if proc.stdout in readable:
                return "ready"

    def _drain_cancel(self) -> None:
        os.set_blocking(self._cancel_r, False)
        try:
            while os.read(self._cancel_r, 64):
                pass
        except (BlockingIOError, OSError):
            pass

    def _death(self, proc) -> str:
        code = proc.poll()
        if code is not None and code < 0:
            how = f"signal {-code} ({signal.Signals(-code).name})" if -code in signal.valid_signals() else \
                f"signal {-code}"
        else:
            how = f"status {code}"
        return (f"made the grammar engine's process fail ({how}): it is likely nested or chained too deeply; "
                "send a smaller or flatter one")

    def _running(self):
        with self._lock:
            if self._closed:
                raise GrammarRefused("cannot be compiled: the engine is shutting down")
            if self._proc is not None and self._proc.poll() is None:
                return self._proc
            if self._proc is not None:
                self._kill(self._proc)
            n = self.niceness
            # As the tokenizer process: niced before its imports, in a session (and autogroup)
            # of its own so that its nice value counts against the engine's threads.
            code = (f"import os, sys; os.nice({n})\n"
                    "from tpserve.procs import die_with_parent\n"
                    f"die_with_parent({os.getpid()}, {int(signal.SIGKILL)})\n"
                    "try:\n"
                    f"    with open('/proc/self/autogroup', 'w') as f: f.write('{n}')\n"
                    "except OSError:\n"
                    "    pass\n"
                    "from tpserve.grammar.worker import _serve; sys.exit(_serve())")
            proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, close_fds=True, start_new_session=True)
            self._proc = proc
            self.num_started += 1
        try:
            _write_frame(proc.stdin.fileno(), self._init)
            ready = select.select([proc.stdout], [], [], START_TIMEOUT_S)[0]
            frame = _read_frame(proc.stdout) if ready else None
        except OSError:
            frame = None
        if frame is None or not msgpack.unpackb(frame).get("ready"):
            self._kill(proc)
            raise GrammarRefused(f"cannot be compiled: the grammar process did not start "
                                 f"({self._death(proc)})")
        return proc

    def _kill(self, proc) -> None:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        for f in (proc.stdin, proc.stdout):
            try:
                f.close()
            except OSError:
                pass
        with self._lock:
            if self._proc is proc:
                self._proc = None


def trial(tokenizer, so_fields: dict, max_chars: int, max_symbols: int) -> dict:
    """The child's answer to one job (see the module): ``{"text": ...}`` or ``{"error": ...}``."""
    import llguidance

    from tpserve.grammar.text import grammar_text
    from tpserve.sampling import StructuredOutputsParams
    from tpserve.errors import InvalidFieldError
    try:
        so = StructuredOutputsParams(**so_fields)
        text = grammar_text(so)
    except InvalidFieldError as e:
        return {"error": e.reason}
    except RecursionError:
        return {"error": "is nested too deeply to convert"}
    except Exception as e:  # noqa: BLE001  anything the converters raise is the input's fault
        return {"error": f"cannot be converted: {type(e).__name__}: {e}"[:1024]}
    if len(text) > max_chars:
        return {"error": f"makes a grammar of {len(text)} characters, over the size budget of {max_chars}"}
    matcher = llguidance.LLMatcher(tokenizer, text, log_level=0, limits=parser_limits(max_symbols))
    if matcher.is_error():
        return {"error": f"the grammar engine rejects it: {matcher.get_error()}"[:2048]}
    matcher.compute_bitmask()
    if matcher.is_error():
        return {"error": "no text satisfies it (the grammar engine finds no token to start with: "
                         f"{matcher.get_error().splitlines()[0]})"[:1024]}
    return {"text": text}


def _serve() -> int:
    """The child's loop: jobs in, answers out, until stdin closes."""
    import llguidance
    stdin, stdout = sys.stdin.buffer, sys.stdout.fileno()
    sys.stdout = sys.stderr  # nothing but frames on the pipe
    init = _read_frame(stdin)
    if init is None:
        return 1
    init = msgpack.unpackb(init)
    tokenizer = llguidance.LLTokenizer(init["tokenizer"], n_vocab=init["vocab_size"], eos_token=init["eos"])
    _write_frame(stdout, msgpack.packb({"ready": True}))
    threading.stack_size(TRIAL_STACK_BYTES)
    while (frame := _read_frame(stdin)) is not None:
        job = msgpack.unpackb(frame)
        answer: dict = {}

        def work():
            try:
                answer.update(trial(tokenizer, job["so"], job["max_chars"], job["max_symbols"]))
            except Exception as e:  # noqa: BLE001  the parent turns it into the request's error
                answer["error"] = f"cannot be compiled: {type(e).__name__}: {e}"[:1024]

        thread = threading.Thread(target=work, name="tpserve-grammar-trial")
        thread.start()
        thread.join()
        _write_frame(stdout, msgpack.packb(answer or {"error": "cannot be compiled"}))
    return 0
