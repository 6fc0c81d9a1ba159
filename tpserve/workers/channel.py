"""The StepPlan channel on one node: a single-writer, multi-reader ring in shared memory.

Rank 0 (the scheduler process) publishes every engine step's ``StepPlan``; each worker rank
on the node receives every plan, in order, exactly once. Plans are encoded straight into a
ring slot with ``StepPlan.write_into`` and decoded by the readers as numpy views of that slot
(``StepPlan.read_from``): no pickle, no copy on either side. Control commands (shutdown,
reset prefix cache, profiling) are plans with ``cmd != STEP`` and travel the same way.

Layout (see ``shm_ring`` for the byte offsets)::

    writer (rank 0)                      shared memory "tpserve-<pid>-<hex>"
      publish(n) ──payload, nbytes──▶  slot (n-1)%S: [seq | nbytes | overflow] [payload]
                 ──then seq = n─────▶                  ▲ polled by readers
                                                       │
      waits until min(released)       reader r: [released | pid | sleeping] ◀── reader r
      ≥ n-S before reusing a slot ◀──                  sets released = n-1 when it asks
                                                       for n, sleeping while it sleeps
      rings reader r's doorbell  ───▶ socket "\\0<ring>-r<r>"  (only if sleeping is set)

    a plan larger than a slot:   slot holds nbytes + overflow=1, no payload;
                                 the plan itself goes to its own segment "<ring>-x<n>",
                                 unlinked by the writer once every reader released n.

Write ordering, message n into slot s = (n - 1) % S:

    writer                                      reader r (expects n)
    1. wait: every reader's released ≥ n - S    1. fence; released_r = n - 1
       (nobody still reads slot s's old plan)     (its previous plan's views die here)
    2. fence                                    2. poll until seq[s] == n (after the
    3. write payload (or overflow segment),        spin time: sleeping = 1, fence,
       nbytes[s], overflow[s]                      re-check, sleep on the doorbell)
    4. fence                                    3. fence
    5. seq[s] = n   (one aligned 8-byte store)  4. read nbytes/overflow, decode views
    6. fence; ring readers with sleeping = 1    5. check seq[s] is still n

A reader never sees a half-written plan because ``seq[s]`` becomes ``n`` only after the
payload is complete, and the writer cannot start overwriting slot ``s`` while any reader has
not released message ``n`` (step 1 of the writer), so the views a reader decodes stay intact
until that reader's next ``receive``. The check in reader step 5 turns a protocol violation
(a second writer, a corrupted header) into an error instead of silent garbage.

Why this ordering holds without explicit fences in Python. Writer and readers are separate
processes, so the GIL orders nothing between them; what matters is the order in which the
CPU makes stores visible. Every ``seq``/``released`` update is a single aligned 8-byte store
(``memoryview`` of format ``Q``), so it is never seen torn, and it is issued by the
interpreter only after the C call that copied the payload has returned. On x86-64 (TSO)
stores become visible in program order and loads are not reordered with older loads, which
is all the protocol needs. On weakly ordered CPUs (ARM) stores and loads may be reordered,
so ``_fence`` sits at the three points above: a ``threading.Lock`` acquire/release, i.e. a
pair of atomic read-modify-writes with acquire and release semantics (what glibc's lock
primitives compile to), which in practice drains the store buffer and stops later loads from
being hoisted. Between the payload copy and the sequence store the interpreter also executes
thousands of instructions, far beyond any reordering window of real hardware. This is
"safe enough", not a proof under the C11 memory model; Python offers nothing stronger.

Waiting. Latency matters (a decode step is a few milliseconds) but the host cores may be
shared, so a wait first polls for ``WaitPolicy.spin_s`` yielding the core on every poll
(``sched_yield``: free when the core is idle, cedes it when another process wants it), then
sleeps with doubling intervals up to ``max_sleep_s``. A reader sleeps on its doorbell (see
``shm_ring``): it sets its ``sleeping`` word, fences, re-checks ``seq`` and only then blocks;
the writer, after storing ``seq``, fences and rings every reader whose ``sleeping`` word is
set. Either the reader sees the new ``seq`` or the writer sees the flag, so a sleeping
reader is woken within a scheduler wake-up instead of at the end of its sleep; should a
wake-up still be lost, the sleep's own timeout bounds the delay. Every
``liveness_interval_s`` a waiting reader checks that the writer's process (pid in the
header) is alive and a waiting writer checks the readers it waits for, so a dead rank 0
makes workers raise ``ChannelClosed`` and exit on their own.

Lifetime. Names are unique per instance (``make_segment_name``). The writer unlinks the ring
and all overflow segments on ``close()``, at interpreter exit (also in multiprocessing
children) and when it is garbage-collected; ``cleanup_stale_segments`` removes what a
SIGKILLed writer left. Readers never unlink and are never tracked by multiprocessing's
resource tracker (see ``shm_ring``). Close the writer after the readers are done (e.g. after
joining the workers that received SHUTDOWN): plans not yet read when it closes may be lost.
"""
from __future__ import annotations

import collections
import multiprocessing.util
import os
import threading
import time
from dataclasses import dataclass
from typing import NamedTuple

from tpserve.errors import ConfigError, TpserveError
from tpserve.plan import StepPlan
from tpserve.workers.shm_ring import (
    DEFAULT_PREFIX, H_CLOSED, H_MAGIC, H_READERS, H_SLOT_BYTES, H_SLOTS, H_VERSION,
    H_WRITER_PID, MAGIC, NAME_RULE, R_PID, R_RELEASED, R_SLEEPING, S_NBYTES, S_OVERFLOW, S_SEQ,
    VERSION, Doorbell, DoorbellRinger, RingLayout, Segment, cleanup_stale_segments,
    is_valid_name, make_segment_name, overflow_name, unlink_segment,
)
from tpserve.procs import pid_alive

# ``released`` of a reader that closed on purpose: larger than any sequence number, so the
# writer never waits for it again.
DETACHED = 1 << 62

__all__ = ["ChannelError", "ChannelClosed", "ChannelTimeout", "WaitPolicy", "PlanWriter",
           "PlanReader", "ReaderStatus", "DETACHED", "DEFAULT_PREFIX", "cleanup_stale_segments",
           "make_segment_name"]


class ChannelError(TpserveError, RuntimeError):
    """The plan channel cannot be used as asked (bad segment, protocol violation)."""


class ChannelClosed(ChannelError):
    """The other side is gone: the writer closed or died, or a reader the writer waits for died."""


class ChannelTimeout(ChannelError, TimeoutError):
    """A publish or receive did not complete within its timeout."""


@dataclass(frozen=True)
class WaitPolicy:
    """How a blocked publish/receive waits. See the module docstring."""

    spin_s: float = 0.002            # poll with sched_yield for this long first
    min_sleep_s: float = 20e-6       # then sleep, starting here ...
    max_sleep_s: float = 0.001       # ... doubling up to this
    liveness_interval_s: float = 0.1  # how often a waiter checks the other side's pid


class ReaderStatus(NamedTuple):
    released: int   # last plan the reader is done with; DETACHED once it closed
    pid: int        # 0 until a reader attaches
    sleeping: bool  # waiting on its doorbell right now


_FENCE_LOCK = threading.Lock()


def _fence() -> None:
    """Best-effort full memory barrier: an uncontended lock acquire + release."""
    _FENCE_LOCK.acquire()
    _FENCE_LOCK.release()


class _Waiter:
    """One blocked wait: spin, then back off; reports timeouts and due liveness checks."""

    __slots__ = ("_policy", "_spin_until", "_deadline", "_next_check", "_sleep")

    def __init__(self, policy: WaitPolicy, timeout: float | None):
        now = time.monotonic()
        self._policy = policy
        self._spin_until = now + policy.spin_s
        self._deadline = None if timeout is None else now + max(0.0, timeout)
        self._next_check = now + policy.liveness_interval_s
        self._sleep = policy.min_sleep_s

    def pause(self, sleep=time.sleep) -> tuple[bool, bool]:
        """Wait a little; ``sleep(seconds)`` may return early (a doorbell).
        Returns (timed_out, liveness_check_due)."""
        now = time.monotonic()
        if self._deadline is not None and now >= self._deadline:
            return True, False
        if now < self._spin_until:
            os.sched_yield()
        else:
            nap = self._sleep if self._deadline is None else min(self._sleep, self._deadline - now)
            sleep(nap)
            self._sleep = min(2 * self._sleep, self._policy.max_sleep_s)
        if now >= self._next_check:
            self._next_check = now + self._policy.liveness_interval_s
            return False, True
        return False, False


def _finalize_writer(ring: Segment, overflow: collections.deque, ctrl,
                     ringer: DoorbellRinger, layout: RingLayout, owner_pid: int) -> None:
    """Tear down a writer's segments; shared by close(), GC and interpreter exit."""
    if os.getpid() != owner_pid:
        return  # a forked copy of the writer's process must not tear down the live ring
    try:
        ctrl[H_CLOSED] = 1  # readers waiting on an empty ring stop at once
        for r in range(layout.num_readers):
            ringer.ring(r)
    except ValueError:
        pass  # control view already released
    ringer.close()
    while overflow:
        unlink_segment(overflow.popleft()[1])
    unlink_segment(ring.name)


class PlanWriter:
    """The writing end, owned by rank 0; one per engine instance. Not thread-safe.

    Invariants: ``_next_seq - 1`` messages were published; slot ``(n-1) % S`` is rewritten
    only after every attached-or-not-yet-attached reader released message ``n - S``; every
    overflow segment in ``_overflow`` belongs to a published message not yet released by all.
    """

    def __init__(self, seg: Segment, layout: RingLayout, policy: WaitPolicy):
        self.name = seg.name
        self.layout = layout
        self.policy = policy
        self._seg = seg
        self._ctrl = seg.buf[:layout.control_bytes].cast("Q")
        self._next_seq = 1
        # Per slot: numpy views of the last plan layouts written there (see StepPlan.write_into).
        self._slot_views: list[dict] = [{} for _ in range(layout.num_slots)]
        self._overflow: collections.deque[tuple[int, str]] = collections.deque()
        self._ringer = DoorbellRinger(seg.name, layout.num_readers)
        self._sleeping_words = [layout.reader_word(r, R_SLEEPING)
                                for r in range(layout.num_readers)]
        self._closed = False
        # Runs on close(), on GC, and at exit of the main process and of multiprocessing
        # children (which leave through os._exit and skip plain atexit handlers).
        self._finalizer = multiprocessing.util.Finalize(
            self, _finalize_writer,
            args=(seg, self._overflow, self._ctrl, self._ringer, layout, os.getpid()),
            exitpriority=10)

    @classmethod
    def create(cls, num_readers: int, num_slots: int = 8, slot_bytes: int = 1 << 20,
               name: str | None = None, policy: WaitPolicy | None = None) -> "PlanWriter":
        """Create the ring segment. ``name`` defaults to ``make_segment_name()``; a custom
        name should keep the ``tpserve-<pid>-`` form so ``cleanup_stale_segments`` finds it."""
        for fld, value, low in (("num_readers", num_readers, 1), ("num_slots", num_slots, 1),
                                ("slot_bytes", slot_bytes, 64)):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ConfigError(fld, f"must be an integer >= {low}, got {value!r}")
        if name is None:
            name = make_segment_name()
        if not is_valid_name(name):
            raise ConfigError("name", f"expected {NAME_RULE}, got {name!r}")
        layout = RingLayout.build(num_readers, num_slots, slot_bytes)
        try:
            seg = Segment.create(name, layout.total_bytes)
        except FileExistsError:
            raise ConfigError("name", f"a shared memory segment named {name!r} already exists; "
                              f"names must be unique per engine instance") from None
        ctrl = seg.buf[:layout.control_bytes].cast("Q")
        for word, value in ((H_VERSION, VERSION), (H_READERS, num_readers),
                            (H_SLOTS, num_slots), (H_SLOT_BYTES, layout.slot_bytes),
                            (H_WRITER_PID, os.getpid())):
            ctrl[word] = value
        _fence()
        ctrl[H_MAGIC] = MAGIC  # last: a reader that sees the magic sees a complete header
        ctrl.release()
        return cls(seg, layout, policy or WaitPolicy())

    @property
    def num_published(self) -> int:
        return self._next_seq - 1

    def reader_status(self, reader: int) -> ReaderStatus:
        """What reader ``reader`` last told the writer (for diagnostics and tests)."""
        ctrl, lay = self._ctrl, self.layout
        return ReaderStatus(released=ctrl[lay.reader_word(reader, R_RELEASED)],
                            pid=ctrl[lay.reader_word(reader, R_PID)],
                            sleeping=bool(ctrl[lay.reader_word(reader, R_SLEEPING)]))

    def _released(self, reader: int) -> int:
        return self._ctrl[self.layout.reader_word(reader, R_RELEASED)]

    def _min_released(self) -> int:
        return min(self._released(r) for r in range(self.layout.num_readers))

    def _wait_for_readers(self, need: int, seq: int, timeout: float | None) -> None:
        waiter = _Waiter(self.policy, timeout)
        while True:
            behind = [r for r in range(self.layout.num_readers) if self._released(r) < need]
            if not behind:
                return
            timed_out, check = waiter.pause()
            if timed_out:
                raise ChannelTimeout(
                    f"publish of plan {seq} on {self.name!r} timed out after {timeout} s: "
                    f"slot {(seq - 1) % self.layout.num_slots} still held by "
                    + ", ".join(self._describe_reader(r, need) for r in behind))
            if check:
                for r in behind:
                    pid = self._ctrl[self.layout.reader_word(r, R_PID)]
                    if pid and not pid_alive(pid):
                        raise ChannelClosed(f"plan reader {r} (pid {pid}) of {self.name!r} died; "
                                            f"{self._describe_reader(r, need)}")

    def _describe_reader(self, r: int, need: int) -> str:
        pid = self._ctrl[self.layout.reader_word(r, R_PID)]
        who = f"pid {pid}" if pid else "not attached yet"
        return f"reader {r} ({who}) has released plans up to {self._released(r)}, needs {need}"

    def _collect_overflow(self) -> None:
        if self._overflow:
            done = self._min_released()
            while self._overflow and self._overflow[0][0] <= done:
                unlink_segment(self._overflow.popleft()[1])

    def publish(self, plan: StepPlan, timeout: float | None = None) -> int:
        """Publish ``plan`` to every reader; returns its sequence number (1, 2, ...).

        Blocks while the target slot is still held by a reader (ring full); raises
        ``ChannelTimeout`` naming the readers behind after ``timeout`` seconds (None: wait
        forever), ``ChannelClosed`` if one of them died. The plan is not validated here.
        """
        if self._closed:
            raise ChannelClosed(f"plan channel {self.name!r} is closed")
        lay = self.layout
        seq = self._next_seq
        slot = (seq - 1) % lay.num_slots
        need = seq - lay.num_slots
        if need > 0 and self._min_released() < need:
            self._wait_for_readers(need, seq, timeout)
        self._collect_overflow()
        _fence()  # the readers' releases are seen before the slot is overwritten
        off = lay.payload_offset(slot)
        try:
            nbytes = plan.write_into(self._seg.buf[off:off + lay.slot_bytes], self._slot_views[slot])
            overflow = 0
        except ValueError:
            nbytes = plan.nbytes()
            if nbytes <= lay.slot_bytes:
                raise
            self._write_overflow(plan, seq, nbytes)
            overflow = 1
        ctrl = self._ctrl
        ctrl[lay.slot_word(slot, S_NBYTES)] = nbytes
        ctrl[lay.slot_word(slot, S_OVERFLOW)] = overflow
        _fence()  # payload and slot fields are visible before the sequence number
        ctrl[lay.slot_word(slot, S_SEQ)] = seq
        self._next_seq = seq + 1
        _fence()  # the store of seq comes before the loads of the sleeping flags
        for r, word in enumerate(self._sleeping_words):
            if ctrl[word]:
                self._ringer.ring(r)
        return seq

    def _write_overflow(self, plan: StepPlan, seq: int, nbytes: int) -> None:
        name = overflow_name(self.name, seq)
        seg = Segment.create(name, nbytes)
        self._overflow.append((seq, name))  # registered first, so close() unlinks it anyway
        try:
            plan.write_into(seg.buf)
        finally:
            seg.close()

    def close(self) -> None:
        """Mark the channel closed for readers and unlink every segment. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._finalizer()
        self._slot_views = []
        self._ctrl.release()
        self._seg.close()

    def __enter__(self) -> "PlanWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class PlanReader:
    """A receiving end, one per worker rank on the node (``reader_index`` 0..R-1).

    ``receive`` returns plans in publication order, each exactly once. The arrays of a
    returned plan are read-only views into shared memory, valid until the next ``receive``
    (which tells the writer the slot may be reused): copy anything needed longer.
    """

    def __init__(self, seg: Segment, layout: RingLayout, reader_index: int, policy: WaitPolicy):
        self.name = seg.name
        self.layout = layout
        self.reader_index = reader_index
        self.policy = policy
        self._seg = seg
        self._ctrl = seg.buf[:layout.control_bytes].cast("Q")
        self._released_word = layout.reader_word(reader_index, R_RELEASED)
        self._sleeping_word = layout.reader_word(reader_index, R_SLEEPING)
        self._doorbell: Doorbell | None = None
        self._writer_pid = self._ctrl[H_WRITER_PID]
        self._last = self._ctrl[self._released_word]
        self._held: Segment | None = None  # overflow segment of the plan last returned
        # Per slot: numpy views of the plan layouts read there (see StepPlan.read_from).
        self._slot_views: list[dict] = [{} for _ in range(layout.num_slots)]
        self._closed = False

    @classmethod
    def attach(cls, name: str, reader_index: int,
               policy: WaitPolicy | None = None) -> "PlanReader":
        try:
            seg = Segment.attach(name)
        except FileNotFoundError:
            raise ChannelClosed(f"no plan channel {name!r} in shared memory (writer not "
                                f"created yet, or already closed)") from None
        try:
            head = [0] * 8
            if seg.size >= 64:
                ctrl = seg.buf[:64].cast("Q")
                head = list(ctrl)
                ctrl.release()
            if head[H_MAGIC] != MAGIC or head[H_VERSION] != VERSION:
                raise ChannelError(f"shared memory segment {name!r} is not a version-{VERSION} "
                                   f"plan channel")
            layout = RingLayout(head[H_READERS], head[H_SLOTS], head[H_SLOT_BYTES])
            if seg.size < layout.total_bytes:
                raise ChannelError(f"plan channel {name!r} is truncated: {seg.size} bytes, its "
                                   f"header describes {layout.total_bytes}")
            if (not isinstance(reader_index, int) or isinstance(reader_index, bool)
                    or not 0 <= reader_index < layout.num_readers):
                raise ConfigError("reader_index", f"must be an integer in [0, "
                                  f"{layout.num_readers}) for channel {name!r}, got "
                                  f"{reader_index!r}")
            reader = cls(seg, layout, reader_index, policy or WaitPolicy())
        except BaseException:
            seg.close()
            raise
        try:
            reader._claim()
        except BaseException:
            reader._unmap()  # not close(): the reader line belongs to someone else
            raise
        return reader

    def _claim(self) -> None:
        ctrl, lay, r = self._ctrl, self.layout, self.reader_index
        if self._last >= DETACHED:
            raise ChannelError(f"reader {r} of {self.name!r} was closed; plans it skipped are "
                               f"gone, so it cannot attach again")
        pid = ctrl[lay.reader_word(r, R_PID)]
        if pid and pid != os.getpid() and pid_alive(pid):
            raise ChannelError(f"reader {r} of {self.name!r} is already attached by pid {pid}")
        ctrl[lay.reader_word(r, R_PID)] = os.getpid()
        self._doorbell = Doorbell.open(self.name, r)

    def receive(self, timeout: float | None = None) -> StepPlan:
        """The next plan. Raises ``ChannelTimeout`` after ``timeout`` seconds without one
        (None: wait forever) and ``ChannelClosed`` once the writer closed or died and every
        plan it published has been received."""
        if self._closed:
            raise ChannelClosed(f"reader {self.reader_index} of {self.name!r} is closed")
        self._held = None  # the previous plan's overflow mapping dies with its last view
        lay, ctrl = self.layout, self._ctrl
        seq = self._last + 1
        slot = (seq - 1) % lay.num_slots
        seq_word = lay.slot_word(slot, S_SEQ)
        _fence()  # done reading the previous plan before saying so
        ctrl[self._released_word] = self._last
        if ctrl[seq_word] != seq:
            self._wait_for(seq, seq_word, timeout)
        _fence()  # the payload is read only after the sequence number was seen
        nbytes = ctrl[lay.slot_word(slot, S_NBYTES)]
        if ctrl[lay.slot_word(slot, S_OVERFLOW)]:
            try:
                self._held = Segment.attach(overflow_name(self.name, seq))
            except FileNotFoundError:
                raise ChannelClosed(f"overflow segment of plan {seq} on {self.name!r} is gone "
                                    f"(writer closed)") from None
            view = self._held.buf[:nbytes]
            plan = StepPlan.read_from(view.toreadonly())
        else:
            off = lay.payload_offset(slot)
            plan = StepPlan.read_from(self._seg.buf[off:off + nbytes].toreadonly(),
                                      self._slot_views[slot])
        if ctrl[seq_word] != seq:
            raise ChannelError(f"slot {slot} of {self.name!r} was overwritten while plan {seq} "
                               f"was read: is there a second writer?")
        self._last = seq
        return plan

    def _wait_for(self, seq: int, seq_word: int, timeout: float | None) -> None:
        ctrl = self._ctrl

        def sleep(seconds: float) -> None:
            if self._doorbell is None:
                time.sleep(seconds)
                return
            # Dekker-style handshake with publish(): flag, fence, re-check here; seq, fence,
            # read the flag there. One side always sees the other's store.
            ctrl[self._sleeping_word] = 1
            _fence()
            try:
                if ctrl[seq_word] != seq:
                    self._doorbell.wait(seconds)
            finally:
                ctrl[self._sleeping_word] = 0

        waiter = _Waiter(self.policy, timeout)
        while True:
            got = ctrl[seq_word]
            if got == seq:
                return
            if got > seq:
                raise ChannelError(f"plan {seq} on {self.name!r} was overwritten by plan {got} "
                                   f"before reader {self.reader_index} read it")
            if ctrl[H_CLOSED]:
                raise ChannelClosed(f"writer closed plan channel {self.name!r} after plan "
                                    f"{seq - 1}")
            timed_out, check = waiter.pause(sleep)
            if timed_out:
                raise ChannelTimeout(f"reader {self.reader_index} of {self.name!r}: no plan "
                                     f"{seq} within {timeout} s")
            if check and not pid_alive(self._writer_pid):
                raise ChannelClosed(f"writer process {self._writer_pid} of plan channel "
                                    f"{self.name!r} died (last plan received: {seq - 1})")

    def close(self) -> None:
        """Detach: the writer stops waiting for this reader. Never unlinks. Idempotent."""
        if self._closed:
            return
        try:
            _fence()
            self._ctrl[self._released_word] = DETACHED
        finally:
            self._unmap()

    def _unmap(self) -> None:
        self._closed = True
        self._held = None
        self._slot_views = []
        if self._doorbell is not None:
            self._doorbell.close()
            self._doorbell = None
        self._ctrl.release()
        self._seg.close()

    def __enter__(self) -> "PlanReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
