#!/usr/bin/env python3
"""`tpserve start --tp 2` / `tpserve stop`, N times: every rank must exit with status 0.

    python scripts/tp_cycles.py [--cycles 30] [--model DIR]

This script makes itself a child subreaper (prctl PR_SET_CHILD_SUBREAPER), so the daemon that
`tpserve start` leaves behind is reparented to it and its real exit status can be read with
waitpid once `tpserve stop` returns -- a rank aborting during interpreter exit (SIGABRT) shows
up here even though the daemon's log already said "stopped". The workers' exit codes come
from the daemon's log ("tensor-parallel worker rank r exited with code c"). One line per cycle,
then a summary line; exit status 1 if any rank of any cycle did not exit 0.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PR_SET_CHILD_SUBREAPER = 36
ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = ROOT / "tpserve" / "assets" / "default-model"


def tpserve(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tpserve", *args], capture_output=True, text=True,
                          check=check, timeout=300)


def reap(pid: int, timeout: float = 60.0) -> int | str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got, status = os.waitpid(pid, os.WNOHANG)
        if got == pid:
            if os.WIFSIGNALED(status):
                return f"signal {os.WTERMSIG(status)}"
            return os.WEXITSTATUS(status)
        time.sleep(0.05)
    return "did not exit"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cycles", type=int, default=30)
    ap.add_argument("--model", default=str(DEFAULT_MODEL))
    args = ap.parse_args()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        print("prctl(PR_SET_CHILD_SUBREAPER) failed: this needs Linux", file=sys.stderr)
        return 2
    bad = 0
    with tempfile.TemporaryDirectory(prefix="tpserve-cycles-") as rd:
        log = Path(rd) / "tpserve.log"
        for i in range(1, args.cycles + 1):
            offset = log.stat().st_size if log.exists() else 0
            t0 = time.monotonic()
            tpserve("start", "--model", args.model, "--tp", "2", "--runtime-dir", rd,
                    "--kv-cache-memory-gb", "0.05")
            pid = json.loads((Path(rd) / "tpserve.ready").read_text())["pid"] \
                if (Path(rd) / "tpserve.ready").exists() else None
            tpserve("generate", "--runtime-dir", rd, "def f(x):", "--max-tokens", "4", check=False)
            tpserve("stop", "--runtime-dir", rd)
            daemon = reap(pid) if pid else "no pid"
            text = log.read_text(errors="replace")[offset:]
            workers = [int(c) if c.lstrip("-").isdigit() else c
                       for c in re.findall(r"worker rank \d+ exited with code (\S+)", text)]
            ok = daemon == 0 and workers == [0]
            bad += not ok
            print(f"cycle {i}: rank0={daemon} workers={workers} {'ok' if ok else 'FAILED'} "
                  f"({time.monotonic() - t0:.1f} s)", flush=True)
    print(f"tp_cycles cycles={args.cycles} failed={bad}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
