"""Loading a model directory's tokenizer without importing torch.

The engine (rank 0) and the HTTP front both tokenize, and both must produce the same ids for
the same text, so both load the tokenizer here. The front is a process of its own that never
touches a tensor: importing torch would cost it seconds of start-up and hundreds of MiB.

``transformers.AutoTokenizer`` cannot be used for that: importing it imports the model
configuration machinery, which imports torch whenever torch is installed. The tokenizer classes
themselves do not, so this module picks the class the way the checkpoint declares it
(``tokenizer_class`` in tokenizer_config.json, looked up among transformers' public names,
which imports only that tokenizer's module) and falls back to the generic ``tokenizer.json``
backend (``PreTrainedTokenizerFast``) when the declared class is missing or unknown, or when
it is ``LlamaTokenizer`` over a byte-level ``tokenizer.json`` (Llama 3 style checkpoints that
declare the SentencePiece-era class: AutoTokenizer loads those generically too).

Where AutoTokenizer deviates from the declared class for a model type (it overrides some
checkpoints whose declared class is known to be wrong), the class loaded here can differ from
AutoTokenizer's; for the architectures tpserve serves the ids are the same (tested against
AutoTokenizer on the bundled model and the test models).
"""
from __future__ import annotations

import array
import json
import logging
import os
import select
import signal
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgpack

log = logging.getLogger("tpserve.tokenizer")

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def has_tokenizer(path) -> bool:
    """Whether the model directory ships tokenizer files."""
    return any((Path(path) / f).is_file() for f in TOKENIZER_FILES)


def load_tokenizer(path):
    """The model directory's tokenizer, or None when it ships none (token-id prompts only)."""
    if not has_tokenizer(path):
        log.warning("%s has no tokenizer: prompts must be token ids and outputs carry no text", path)
        return None
    return tokenizer_class(path).from_pretrained(str(path))


def tokenizer_class(path) -> type:
    """The transformers tokenizer class for the model directory ``path`` (imports no torch)."""
    import transformers

    declared = _declared_class(Path(path))
    if declared:
        cls = getattr(transformers, declared, None)
        if declared.removesuffix("Fast") == "LlamaTokenizer" and _is_byte_level(Path(path)):
            return transformers.PreTrainedTokenizerFast
        if isinstance(cls, type) and issubclass(cls, transformers.PreTrainedTokenizerBase):
            return cls
        log.warning("%s declares tokenizer class %r, which transformers does not provide; "
                    "loading tokenizer.json generically", path, declared)
    return transformers.PreTrainedTokenizerFast


def _declared_class(path: Path) -> str | None:
    try:
        config = json.loads((path / "tokenizer_config.json").read_text())
    except (FileNotFoundError, ValueError):
        return None
    name = config.get("tokenizer_class") if isinstance(config, dict) else None
    return name if isinstance(name, str) and name.isidentifier() else None


def _is_byte_level(path: Path) -> bool:
    """Whether tokenizer.json pre-tokenizes or decodes byte-level (the GPT-2 / Llama 3 scheme)."""
    try:
        spec = json.loads((path / "tokenizer.json").read_text())
    except (FileNotFoundError, ValueError):
        return False
    return '"ByteLevel"' in json.dumps([spec.get("pre_tokenizer"), spec.get("decoder")])


# ---- a tokenizer in a process of its own -----------------------------------------------------
class TokenizerProcessError(RuntimeError):
    """The tokenizer process died or answered nonsense; the prompt was not tokenized."""


class TokenizerProcess:
    """The model directory's tokenizer in a child process at a lower CPU priority.

    Tokenizing a megabyte of text takes a CPU core for a second or more. In a thread of the
    serving process it competes for the GIL and, on a machine with few cores, for the cores
    the engine's threads need; a niced process yields both. ``encode`` blocks the calling
    thread (in pipe I/O, without the GIL) until the ids are back; callers use it from a worker
    thread. The child starts on the first ``encode`` (about a second) and is started again if
    it died. ``close`` kills it; it also exits when its stdin closes, which the kernel does when
    this process dies, so it never outlives its parent for longer than the encode it is in.

    ``cpu_share`` (set from any thread, read at every period) caps the share of one core the
    child takes while it encodes: below 1 the waiting thread runs it on a duty cycle, stopped
    (SIGSTOP) for ``1 - cpu_share`` of every ``DUTY_PERIOD_S``. A nice value cannot keep a
    machine's last core free: once every core is busy a virtual machine can be descheduled by
    its host for whole periods (measured on a 2-vCPU VM: two busy processes made every other
    process miss 100 ms at a time, one busy process none), and a parallel region waits for its
    slowest thread. The child dies with its parent's thread (PR_SET_PDEATHSIG), so a stopped
    child does not outlive a killed parent.

    Wire (the child's stdin and stdout): each message is a 4-byte little-endian length and a
    msgpack value: ``[text, add_special_tokens]``, answered by ``{"ids": int32 bytes}`` or
    ``{"error": text}``.
    """

    DUTY_PERIOD_S = 0.02

    def __init__(self, path, niceness: int = 10):
        self.path = str(path)
        self.niceness = niceness
        self.cpu_share = 1.0
        self._proc = None
        self._lock = threading.Lock()  # one request at a time on the pipes
        self._spawn_lock = threading.Lock()  # starting vs closing: no child after close()
        self._closed = False

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def encode(self, text: str, add_special_tokens: bool = False, packed: bool = False) -> list[int] | array.array:
        """Token ids of ``text``, as the in-process tokenizer's ``encode`` gives them
        (``packed``: as an ``array.array("i")``, not a list of a million ints)."""
        with self._lock:
            proc = self._running()
            try:
                _write_frame(proc.stdin.fileno(), msgpack.packb([text, bool(add_special_tokens)]))
                self._await_reply(proc)
                frame = _read_frame(proc.stdout)
            except OSError:
                frame = None
            if frame is None:
                code = proc.poll()
                self._stop(proc)
                raise TokenizerProcessError(f"the tokenizer process (pid {proc.pid}) exited"
                                            f"{f' with status {code}' if code is not None else ''}")
        reply = msgpack.unpackb(frame)
        if "error" in reply:
            raise TokenizerProcessError(f"tokenizing failed: {reply['error']}")
        ids = array.array("i")
        ids.frombytes(reply["ids"])
        return ids if packed else ids.tolist()

    def _await_reply(self, proc) -> None:
        """Return once the child's reply starts (or it exited), holding it to ``cpu_share`` of
        a core meanwhile; the child is never left stopped."""
        period = self.DUTY_PERIOD_S
        while True:
            share = min(1.0, max(0.05, float(self.cpu_share)))
            readable, _, _ = select.select([proc.stdout], [], [], period * share)
            if readable or proc.poll() is not None:
                return
            if share >= 1.0:
                continue
            proc.send_signal(signal.SIGSTOP)  # not once it is reaped: its pid may be another's
            try:
                time.sleep(period * (1.0 - share))
            finally:
                proc.send_signal(signal.SIGCONT)

    def warm_up(self) -> None:
        """Start the child and load its tokenizer (blocks); errors are logged, not raised."""
        try:
            self.encode(" ")
        except TokenizerProcessError as e:
            log.warning("the tokenizer process did not start: %s", e)

    def close(self) -> None:
        """Stop the child now (from any thread; an encode in progress fails, and so does every
        later one); idempotent."""
        with self._spawn_lock:
            self._closed = True
            proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
        if proc is not None:
            proc.wait()

    def _running(self):
        with self._spawn_lock:
            if self._closed:
                raise TokenizerProcessError("the tokenizer process is closed")
            if self._proc is not None and self._proc.poll() is None:
                return self._proc
        dead = self._proc
        if dead is not None:
            self._stop(dead)
        with self._spawn_lock:
            if self._closed:
                raise TokenizerProcessError("the tokenizer process is closed")
            # Niced before its imports: starting takes a second of CPU too. Where the kernel
            # groups processes by session for CPU shares (autogroup), a process's nice value
            # only ranks it within its own session: the child gets a session of its own and
            # sets that group's nice value, or else (under a front that runs in a session of its
            # own) it would take half the cores from the engine's session however niced.
            n = int(self.niceness)
            code = (f"import os, sys; os.nice({n})\n"
                    f"from tpserve.procs import die_with_parent; die_with_parent({os.getpid()}, {int(signal.SIGKILL)})\n"
                    "try:\n"
                    f"    with open('/proc/self/autogroup', 'w') as f: f.write('{n}')\n"
                    "except OSError:\n"
                    "    pass\n"
                    "from tpserve.tokenizer import _serve; sys.exit(_serve(sys.argv[1]))")
            proc = self._proc = subprocess.Popen([sys.executable, "-c", code, self.path], stdin=subprocess.PIPE,
                                                 stdout=subprocess.PIPE, close_fds=True, start_new_session=True)
        return proc

    def _stop(self, proc) -> None:
        for f in (proc.stdin, proc.stdout):
            try:
                f.close()
            except OSError:
                pass
        try:
            proc.wait(_CHILD_EXIT_S)  # stdin closed: it exits after the encode it is in
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if self._proc is proc:
            self._proc = None


_CHILD_EXIT_S = 2.0


def _write_frame(fd: int, payload: bytes) -> None:
    """One message, written with ``os.write`` until every byte is out (both directions). A
    buffered writer can lose the tail of a large write that a stop signal cut short (SIGSTOP
    and SIGCONT, from the parent's duty cycle, an operator or a debugger, make a pipe write
    return early), and the reader would then wait for bytes that never come."""
    view = memoryview(struct.pack("<I", len(payload)) + payload)
    while view:
        view = view[os.write(fd, view):]


def _read_frame(f) -> bytes | None:
    """One message, or None at end of stream."""
    head = f.read(4)
    if len(head) < 4:
        return None
    (n,) = struct.unpack("<I", head)
    payload = f.read(n)
    return payload if len(payload) == n else None


def _serve(path: str) -> int:
    """The child's loop: one text in, its ids out, until stdin closes."""
    tokenizer = load_tokenizer(path)
    stdin, stdout = sys.stdin.buffer, sys.stdout.fileno()
    sys.stdout = sys.stderr  # nothing but frames on the pipe
    while (frame := _read_frame(stdin)) is not None:
        try:
            text, special = msgpack.unpackb(frame)
            ids = tokenizer.encode(text, add_special_tokens=special)
            reply = {"ids": array.array("i", ids).tobytes()}
        except Exception as e:  # the parent turns it into the request's error
            reply = {"error": f"{type(e).__name__}: {e}"[:1024]}
        _write_frame(stdout, msgpack.packb(reply))
    return 0

