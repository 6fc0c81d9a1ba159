"""A shared cache of built files, each built once and published atomically.

``publish_once(directory, name, build)`` returns ``directory/name``, building it first if it is
absent. The contract that lets several processes (several virtualenvs, several checkouts) share
one cache directory:

* ``name`` is the whole key: whatever changes the built file must change the name (the caller
  hashes its inputs into it). A file that exists is never rebuilt under the same name.
* A build runs in a fresh temporary directory inside ``directory`` and its result is renamed
  onto ``directory/name`` (``os.replace``: atomic on one filesystem). Readers see no file or a
  complete one, never a half-written one; a process that has the old file mapped (a loaded
  shared library) keeps its inode, untouched, when a forced rebuild replaces the name.
* Builders of one name take an exclusive ``flock`` on ``directory/name.lock`` so the second
  waits for the first and then finds the file instead of building it again. The kernel drops
  the lock of a builder that dies. A builder that cannot get the lock within ``lock_timeout_s``
  builds anyway: the rename keeps that safe, it only costs the duplicate work.
* A failed build leaves neither the file nor its temporary directory behind.
"""
from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterator

log = logging.getLogger("tpserve.kernels")


@contextlib.contextmanager
def file_lock(path: Path, timeout_s: float) -> Iterator[bool]:
    """Hold an exclusive flock on ``path`` (created if needed); yields whether it was taken
    (False after ``timeout_s`` seconds of waiting)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                locked = True
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    locked = False
                    break
                time.sleep(0.05)
        try:
            yield locked
        finally:
            if locked:
                fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def publish_once(directory: Path, name: str, build: Callable[[Path], Path], *,
                 force: bool = False, lock_timeout_s: float = 900.0) -> tuple[Path, bool]:
    """``(directory/name, built_here)``: the published file, built by ``build`` first if it is
    absent (or, with ``force``, replacing it). ``build(tmp)`` writes its result inside the
    empty directory ``tmp`` and returns that file's path. Exceptions from ``build`` propagate;
    nothing is published then."""
    directory = Path(directory)
    final = directory / name
    if final.exists() and not force:
        return final, False
    directory.mkdir(parents=True, exist_ok=True)
    with file_lock(directory / f"{name}.lock", lock_timeout_s) as locked:
        if not locked:
            log.warning("%s: another build has held its lock for over %.0f s; building "
                        "alongside it", final, lock_timeout_s)
        # Whoever held the lock before us may have published it meanwhile.
        if final.exists() and not force:
            return final, False
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=directory))
        try:
            built = Path(build(tmp))
            os.replace(built, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final, True
