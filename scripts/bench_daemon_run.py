"""A daemon started for one benchmark run, and the ISA field of benchmark lines.

    with started_daemon(model, http=True) as (address, url):
        ...

``tpserve start`` in a fresh runtime dir under /tmp; stopped and removed on the way out.
Raises RuntimeError with the start's error output when it does not start; ``on_daemon(model,
fn)`` runs ``fn(address)`` on one and exits with status 1 and that output instead.
"""
from __future__ import annotations

import contextlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile

TPSERVE = [sys.executable, "-m", "tpserve"]


@contextlib.contextmanager
def started_daemon(model: str | None, http: bool = False, *extra: str):
    rd = tempfile.mkdtemp(prefix="tpb-", dir="/tmp")
    cmd = TPSERVE + ["start", "--runtime-dir", rd, *extra]
    if http:
        cmd += ["--http-port", "0", "--served-model-name", "bench"]
    if model:
        cmd += ["--model", model]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        shutil.rmtree(rd, ignore_errors=True)
        raise RuntimeError(out.stderr)
    lines = out.stdout.split()
    try:
        yield lines[0], (lines[1] if http else None)
    finally:
        subprocess.run(TPSERVE + ["stop", "--runtime-dir", rd], capture_output=True)
        shutil.rmtree(rd, ignore_errors=True)


def on_daemon(model: str | None, fn):
    """``fn(address)`` on a daemon started for it; a daemon that does not start ends the script."""
    try:
        with started_daemon(model) as (address, _):
            return fn(address)
    except RuntimeError as e:
        print(e, file=sys.stderr)
        sys.exit(1)


def isa() -> str:
    flags = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    return next((f for f in ("amx_bf16", "avx512_bf16", "avx512f", "avx2") if f in flags), platform.machine())
