"""The newcomer's first run: start the daemon on the bundled model, stream a completion, stop.

    make run        (or: .venv/bin/python scripts/quickstart.py [--max-tokens 96])

Uses the `tpserve` command exactly as a user would: `tpserve start`, `tpserve generate`
(streams to the terminal), `tpserve status`, `tpserve stop`, on a private runtime directory.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

PROMPT = "def fibonacci(n):"


def tpserve(*args: str, env: dict) -> int:
    exe = Path(sys.executable).with_name("tpserve")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "tpserve"]
    try:
        print(f"$ tpserve {' '.join(a if ' ' not in a and chr(10) not in a else repr(a) for a in args)}",
              flush=True)
    except OSError:  # stdout closed (e.g. piped into `head`): keep going, the daemon must stop
        pass
    return subprocess.call(cmd + list(args), env=env)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-tokens", type=int, default=96, help="tokens of the streamed completion")
    args = ap.parse_args()
    runtime = tempfile.mkdtemp(prefix="tpserve-quickstart-")
    env = dict(os.environ, TPSERVE_RUNTIME_DIR=runtime)
    try:
        if tpserve("start", env=env) != 0:
            log = Path(runtime, "tpserve.log")
            if log.exists():
                print(log.read_text()[-4000:], file=sys.stderr)
            return 1
        # A 1.3M-parameter model loops under greedy decoding; light seeded sampling reads better.
        rc = tpserve("generate", PROMPT, "--max-tokens", str(args.max_tokens), "--temperature", "0.7",
                     "--top-k", "40", "--seed", "1", env=env)
        rc |= tpserve("status", env=env)
        return rc
    finally:
        rc_stop = tpserve("stop", env=env)
        shutil.rmtree(runtime, ignore_errors=True)
        if rc_stop != 0:
            print("tpserve stop failed", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
