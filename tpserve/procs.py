"""Process helpers shared by the daemon and the workers: liveness and killing a process tree,
freezing a serving process's start-up heap, giving freed heap memory back or keeping it for the
next step, and a child's death with its parent.

Linux first: both read /proc. Where there is no procfs, liveness falls back to ``kill(pid, 0)``
and no descendants can be found.
"""
from __future__ import annotations

import ctypes
import gc
import os
import signal
import sys
import time
from pathlib import Path


def freeze_heap() -> int:
    """Move every object alive now to the collector's permanent generation; returns how many.

    Called once a serving process has started (its modules, model and tokenizer loaded: a
    quarter of a million objects in the daemon), so that the collector's full collections no
    longer scan them: one took ~120 ms, on the serving loop, and stalled every stream. What
    start-up left as garbage is collected first, not frozen.
    """
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def release_freed_heap() -> bool:
    """Give the C heap's free memory back to the system (glibc's ``malloc_trim``); False where
    there is no such call. Loading and packing a model frees as much as it keeps (checkpoint
    tensors, the dense copies of packed weights); glibc kept those pages, a resident set of
    2.3-2.9 GiB instead of 1.0 for the 0.6B shape in int8, depending on how the frees fell."""
    try:
        return bool(ctypes.CDLL(None).malloc_trim(0))
    except (OSError, AttributeError):
        return False


# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
STEP_HEAP_MMAP_BYTES = 512 << 20  # allocations below this come from the heap, and are reused
STEP_HEAP_TRIM_BYTES = 1 << 30  # free memory kept at the heap's top before it goes back


def keep_step_heap() -> bool:
    """Have the C heap keep the memory a step frees for the next step; False where there is no
    glibc ``mallopt``. By default glibc serves each allocation over 32 MiB (a prefill's
    activations: 50 MiB for 4,096 rows of a 6,144-wide MLP) with a fresh ``mmap`` and unmaps it
    at its free, and gives the heap's free top back past 64 MiB: every step then faults in and
    zeroes its activations' pages again, a third of a prompt step's time on the 0.6B shape.
    Called once the model is loaded and :func:`release_freed_heap` has run, so what loading
    freed still goes back; the resident set then holds the weights, the touched KV blocks and
    the largest step's working memory, as under tcmalloc or jemalloc."""
    try:
        libc = ctypes.CDLL(None)
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, STEP_HEAP_MMAP_BYTES)
                    and libc.mallopt(_M_TRIM_THRESHOLD, STEP_HEAP_TRIM_BYTES))
    except (OSError, AttributeError):
        return False


def die_with_parent(parent_pid: int, sig: int = signal.SIGTERM) -> None:
    """Have the kernel send this process ``sig`` when its parent dies, however it dies (Linux's
    PR_SET_PDEATHSIG; strictly, when the parent's thread that started it ends). SIGKILL for a
    process its parent may hold stopped: a stopped process keeps any other signal pending."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(sig), 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent_pid:  # it died before prctl took effect
        sys.exit(1)


def pid_alive(pid: int) -> bool:
    """True while ``pid`` is a running process; a zombie (exited, not yet reaped) is dead.

    Containers may never reap orphans, so the zombie check matters for every caller.
    """
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except FileNotFoundError:
        return False
    except OSError:
        return True  # no procfs: os.kill's answer is all we have
    # Field 3 (state) follows the parenthesised command name, which may itself contain ')'.
    state = stat[stat.rfind(b")") + 2:][:1]
    return state not in (b"Z", b"X")


def process_start_time(pid: int) -> float | None:
    """When ``pid`` started (seconds since the epoch, within about a second), or None where it
    cannot be read (no such process, no procfs)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        with open("/proc/stat", "rb") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith(b"btime "))
    except (OSError, StopIteration, ValueError):
        return None
    # Field 22 (starttime, clock ticks after boot), counted after the parenthesised name.
    ticks = int(stat[stat.rfind(b")") + 2:].split()[19])
    return boot + ticks / os.sysconf("SC_CLK_TCK")


def _children_map() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(")") + 2:].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    return children


def descendants(pid: int) -> list[int]:
    """All live descendants of ``pid`` (from /proc; empty where there is no procfs)."""
    if not Path("/proc").is_dir():
        return []
    children = _children_map()
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def kill_tree(pid: int, sig: int = signal.SIGKILL, include_root: bool = True) -> None:
    """Send ``sig`` to the descendants of ``pid`` and, with ``include_root``, to ``pid`` itself
    and to the process group it leads (if it leads one). Processes already gone are skipped.

    ``kill_tree(os.getpid(), include_root=False)`` is how a process kills its own children.
    """
    targets = descendants(pid)
    if include_root:
        targets.insert(0, pid)
        try:
            if os.getpgid(pid) == pid:
                os.killpg(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
    for p in targets:
        try:
            os.kill(p, sig)
        except (ProcessLookupError, PermissionError):
            pass


def wait_gone(pids: list[int], timeout: float) -> bool:
    """Wait until none of ``pids`` is alive; False if some still are after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        if not any(pid_alive(p) for p in pids):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
