"""Primitives under the StepPlan channel: segments, ring layout, doorbells, names, cleanup.

The protocol (who writes which word when) lives in ``channel.py``; this module only knows
where things are, how segments are created, attached and removed, and how a sleeping reader
is woken.

Segments
    ``Segment`` opens POSIX shared memory with ``_posixshmem`` + ``mmap``, the same two calls
    ``multiprocessing.shared_memory.SharedMemory`` makes, but without registering the name
    with multiprocessing's resource tracker. Before Python 3.13 ``SharedMemory`` registers
    every *attach* as well as every create, and spawned children share their parent's tracker,
    whose per-type registry is a set: a reader that attaches and then calls
    ``resource_tracker.unregister`` also erases the writer's registration, and the writer's
    own ``unlink`` then makes the tracker print a ``KeyError``; a reader that does not
    unregister gets the segment unlinked under everyone's feet when it exits. (3.13 added
    ``track=False`` for exactly this.) Here nobody is tracked: the writer unlinks on close,
    at interpreter exit and on garbage collection, and ``cleanup_stale_segments`` removes
    what a SIGKILLed writer left behind.

Doorbells
    A reader that has waited longer than its spin time sets its ``sleeping`` word and sleeps
    in ``recv`` on a Unix datagram socket bound to the abstract name ``<ring>-r<index>``
    (leading NUL byte; Linux only; nothing in the file system, gone when the socket
    closes); after publishing, the writer sends one byte to every reader whose ``sleeping``
    word is set. A woken sleeper
    is scheduled at once, whereas a process that polls with ``sched_yield`` on a busy core
    waits behind the other processes' time slices. Every sleep still has a short timeout, so
    a lost wake-up (or a platform without abstract sockets: no doorbell at all) costs at most
    one sleep interval, never a hang.

Names
    ``<prefix><pid>-<8 hex>`` for a ring (``make_segment_name``) and ``<ring>-x<seq>`` for the
    overflow segment of message ``seq``. The creator's pid in the name is what lets
    ``cleanup_stale_segments`` decide that a segment is orphaned.

Ring layout (every field a little-endian u64; every line 64 bytes, so the words that
different processes write never share a cache line)::

    offset 0        +------------------------------------------------------------------+
    header line     | magic | version | num_readers | num_slots | slot_bytes |          |
                    | writer_pid | closed | (reserved)                                  |
    64              +------------------------------------------------------------------+
    reader line r   | released (last message reader r is done with) | pid | (reserved) |
      (r = 0..R-1)  +------------------------------------------------------------------+
    64 * (1 + R)    +------------------------------------------------------------------+
    slot line s     | seq (message in payload s) | nbytes | overflow (0/1) | (reserved) |
      (s = 0..S-1)  +------------------------------------------------------------------+
    payload_offset  +------------------------------------------------------------------+
    payload s       | encoded StepPlan, slot_bytes (rounded up to 64) per slot         |
                    +------------------------------------------------------------------+

Message ``n`` (1, 2, 3, ...) lives in slot ``(n - 1) % S``.
"""
from __future__ import annotations

import mmap
import os
import re
import secrets
import socket
from dataclasses import dataclass

import _posixshmem  # the primitive behind multiprocessing.shared_memory on POSIX

from tpserve.procs import pid_alive, process_start_time

MAGIC = 0x7470_5249_4E47_3031  # "tpRING01"
VERSION = 1
LINE = 64          # bytes per control line (one cache line on x86 and most ARM cores)
WORDS = LINE // 8  # u64 words per control line
DEFAULT_PREFIX = "tpserve-"
SHM_DIR = "/dev/shm"

# Word indices inside the header line.
H_MAGIC, H_VERSION, H_READERS, H_SLOTS, H_SLOT_BYTES, H_WRITER_PID, H_CLOSED = range(7)
# Word offsets inside a reader line and a slot line.
R_RELEASED, R_PID, R_SLEEPING = 0, 1, 2
S_SEQ, S_NBYTES, S_OVERFLOW = 0, 1, 2

_NAME_RE = re.compile(r"^[A-Za-z0-9._-]{1,200}$")


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


@dataclass(frozen=True)
class RingLayout:
    """Where every control word and payload lives in a ring of R readers and S slots."""

    num_readers: int
    num_slots: int
    slot_bytes: int  # usable payload bytes per slot, a multiple of LINE

    @classmethod
    def build(cls, num_readers: int, num_slots: int, slot_bytes: int) -> "RingLayout":
        return cls(num_readers, num_slots, _round_up(slot_bytes, LINE))

    @property
    def control_bytes(self) -> int:
        return LINE * (1 + self.num_readers + self.num_slots)

    @property
    def total_bytes(self) -> int:
        return self.control_bytes + self.num_slots * self.slot_bytes

    # Indices into the control area viewed as u64 words.
    def reader_word(self, reader: int, field: int) -> int:
        return WORDS * (1 + reader) + field

    def slot_word(self, slot: int, field: int) -> int:
        return WORDS * (1 + self.num_readers + slot) + field

    def payload_offset(self, slot: int) -> int:
        return self.control_bytes + slot * self.slot_bytes


class Segment:
    """One mapped POSIX shared-memory segment; ``buf`` is a writable memoryview of all of it.

    ``close`` unmaps (or, while numpy views still point into it, leaves the unmapping to the
    garbage collector: the mapping lives as long as any view does). ``unlink`` removes the
    name; processes that already mapped the segment keep their mapping.
    """

    def __init__(self, name: str, mm: mmap.mmap):
        self.name = name
        self._mmap: mmap.mmap | None = mm
        self.buf: memoryview | None = memoryview(mm)

    @property
    def size(self) -> int:
        assert self.buf is not None, "segment is closed"
        return len(self.buf)

    @classmethod
    def create(cls, name: str, size: int) -> "Segment":
        """Create a new zero-filled segment; FileExistsError if the name is taken."""
        fd = _posixshmem.shm_open("/" + name, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode=0o600)
        try:
            os.ftruncate(fd, size)
            mm = mmap.mmap(fd, size)
        except BaseException:
            unlink_segment(name)
            raise
        finally:
            os.close(fd)
        return cls(name, mm)

    @classmethod
    def attach(cls, name: str) -> "Segment":
        """Map an existing segment; FileNotFoundError if there is none by that name."""
        fd = _posixshmem.shm_open("/" + name, os.O_RDWR, mode=0o600)
        try:
            mm = mmap.mmap(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)
        return cls(name, mm)

    def close(self) -> None:
        # While numpy views still use the mapping, releasing fails with BufferError; the
        # mapping is then unmapped by the garbage collector when the last view dies.
        if self.buf is not None:
            try:
                self.buf.release()
            except BufferError:
                pass
            self.buf = None
        if self._mmap is not None:
            try:
                self._mmap.close()
            except BufferError:
                pass
            self._mmap = None


class Doorbell:
    """The receiving side of a reader's wake-up socket; see the module docstring."""

    def __init__(self, sock: socket.socket):
        self._sock = sock

    @classmethod
    def open(cls, ring_name: str, reader: int) -> "Doorbell | None":
        """Bind the reader's doorbell; None where abstract Unix sockets are unavailable or the
        name is taken (the reader then just sleeps in short intervals)."""
        try:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        except (AttributeError, OSError):
            return None
        try:
            sock.bind(doorbell_address(ring_name, reader))
        except OSError:
            sock.close()
            return None
        return cls(sock)

    def wait(self, timeout: float) -> None:
        """Sleep until rung or ``timeout`` seconds passed; each ring wakes one wait."""
        self._sock.settimeout(timeout)
        try:
            self._sock.recv(16)
        except (TimeoutError, socket.timeout, BlockingIOError, InterruptedError):
            pass

    def close(self) -> None:
        self._sock.close()


class DoorbellRinger:
    """The writer's side: one unbound socket that rings any reader's doorbell."""

    def __init__(self, ring_name: str, num_readers: int):
        self._addresses = [doorbell_address(ring_name, r) for r in range(num_readers)]
        try:
            self._sock: socket.socket | None = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            self._sock.setblocking(False)
        except (AttributeError, OSError):
            self._sock = None

    def ring(self, reader: int) -> None:
        if self._sock is None:
            return
        try:
            self._sock.sendto(b"\x01", self._addresses[reader])
        except OSError:
            pass  # no such doorbell (reader gone) or its queue is full (already rung)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def doorbell_address(ring_name: str, reader: int) -> str:
    return f"\0{ring_name}-r{reader}"


def unlink_segment(name: str) -> bool:
    """Remove a segment's name; False if it was already gone."""
    try:
        _posixshmem.shm_unlink("/" + name)
    except FileNotFoundError:
        return False
    return True


NAME_RULE = "1-200 characters from [A-Za-z0-9._-]"


def is_valid_name(name: object) -> bool:
    """Whether ``name`` can name a ring (and, with ``-x<seq>`` appended, its overflows)."""
    return isinstance(name, str) and _NAME_RE.match(name) is not None


def make_segment_name(prefix: str = DEFAULT_PREFIX) -> str:
    """A fresh ring name carrying this process's pid, e.g. ``tpserve-4242-9f1c03ab``."""
    return f"{prefix}{os.getpid()}-{secrets.token_hex(4)}"


def overflow_name(ring_name: str, seq: int) -> str:
    return f"{ring_name}-x{seq}"


def creator_pid(name: str, prefix: str = DEFAULT_PREFIX) -> int | None:
    """The pid encoded in a name made by ``make_segment_name`` (or an overflow of one)."""
    if not name.startswith(prefix):
        return None
    head = name[len(prefix):].split("-", 1)[0]
    return int(head) if head.isdigit() else None


# Slack when comparing a process's start with a segment's change time: the boot time that a
# start time is computed from has one-second resolution.
_CLOCK_SLACK_S = 2.0


def cleanup_stale_segments(prefix: str = DEFAULT_PREFIX) -> list[str]:
    """Unlink every ``/dev/shm`` segment named ``<prefix><pid>-...`` whose creator is dead.

    Covers writers that were SIGKILLed (no exit handler ran). The creator is proven dead when
    no process has its pid, or when the process that has it now started after the segment was
    last changed (the pid was reused; the creator made the segment before that). Segments
    whose name carries no pid are left alone, and so is one whose creator may be alive.
    Returns the names removed. Where there is no ``/dev/shm`` to list (not Linux) nothing can
    be found and the result is empty.
    """
    try:
        entries = os.listdir(SHM_DIR)
    except FileNotFoundError:
        return []
    removed = []
    for name in sorted(entries):
        pid = creator_pid(name, prefix)
        if pid is not None and _creator_gone(pid, name) and unlink_segment(name):
            removed.append(name)
    return removed


def _creator_gone(pid: int, name: str) -> bool:
    if not pid_alive(pid):
        return True
    started = process_start_time(pid)
    try:
        changed = os.stat(os.path.join(SHM_DIR, name)).st_ctime  # never before the creation
    except FileNotFoundError:
        return False  # removed meanwhile: nothing to do
    return started is not None and started > changed + _CLOCK_SLACK_S
