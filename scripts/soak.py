"""Reliability soak: many clients, random aborts and bad inputs, then killed workers.

    .venv/bin/python scripts/soak.py [--clients 8] [--requests 25] [--seed 0] [--edge-inputs]

Not part of `make test` (up to minutes, each phase bounded). Every daemon runs on the bundled model with its
socket in a private runtime directory (ipc only). Three phases, one line each:

1. TP 1: ``--clients`` processes each send ``--requests`` streaming generates over raw
   ZeroMQ + msgpack (docs/protocol.md), aborting some mid-stream, vanishing mid-stream now
   and then, and mixing in bad inputs whose error replies are counted (with --edge-inputs,
   also numbers at integer-width edges). Then the daemon must
   have freed every KV block, and it must stop cleanly (SIGTERM, exit 0).
2. TP 2: a worker is SIGKILLed while the daemon is idle: the daemon must exit 1 by itself.
3. TP 2: a worker is SIGKILLed while four streams are in flight: each must get an error reply
   and the daemon must exit 1.

After each phase no process of the daemon's tree and no shared-memory segment named after one
may remain. The exit status is 0 when every "must be 0" count is 0 and the daemons exited as
expected. Requests lost are requests that got no final reply within --reply-timeout seconds.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import queue
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import msgpack
import zmq

from tpserve.procs import descendants, pid_alive

PROMPTS = ["def quicksort(xs):", "import os\n", "class Stack:\n    def __init__(self):",
           "for i in range(10):", "# parse the arguments\n", "with open(path) as f:",
           "try:\n    import json\nexcept ImportError:", "async def fetch(url):"]
# Bad inputs and the error code docs/protocol.md gives each; "ID" is replaced by a fresh id.
BAD_INPUTS = [
    (b"\xc1", "bad_message"),
    ({"v": 2, "type": "ping"}, "unsupported_version"),
    ({"v": 1, "type": "frobnicate", "id": "ID"}, "unknown_type"),
    ({"v": 1, "type": "generate", "id": "ID"}, "missing_field"),
    ({"v": 1, "type": "generate", "id": "ID", "prompt": "hi", "colour": 1}, "unknown_field"),
    ({"v": 1, "type": "generate", "id": "ID", "prompt": "hi", "params": {"temperature": -1}}, "invalid_field"),
    ({"v": 1, "type": "generate", "id": "ID", "prompt": "hi", "params": {"max_tokens": -1}}, "invalid_field"),
    ({"v": 1, "type": "generate", "id": "ID", "prompt": ""}, "invalid_field"),
    ({"v": 1, "type": "generate", "id": "ID", "prompt": [10 ** 6]}, "invalid_field"),
    ({"v": 1, "type": "generate", "id": "ID", "prompt": "hi", "params": {"max_tokens": 10 ** 6}}, "admission"),
    ({"v": 1, "type": "abort", "id": "ID"}, "unknown_id"),
    ("DUPLICATE", "duplicate_id"),  # a valid generate sent twice: the second is refused
]
# Numbers at integer-width edges (--edge-inputs): each must get its error, never cost the daemon.
EDGE_INPUTS = [
    ({"v": 1, "type": "generate", "id": "ID", "prompt": "hi", "params": {"top_k": 2 ** 31}}, "invalid_field"),
    ({"v": 1, "type": "generate", "id": "ID", "prompt": "hi", "params": {"stop_token_ids": [2 ** 31]}},
     "invalid_field"),
    ({"v": 1, "type": "generate", "id": "ID", "prompt": "hi", "params": {"max_tokens": 2 ** 63 - 1}}, "invalid_field"),
    ({"v": 1, "type": "generate", "id": "ID", "prompt": "hi", "params": {"max_tokens": 2 ** 31 - 1}}, "admission"),
    ({"v": 1, "type": "generate", "id": "ID", "prompt": "hi", "params": {"seed": 2 ** 64 - 1}}, "invalid_field"),
]


# ---- one client process -------------------------------------------------------------------
class Lost(Exception):
    """No reply within the timeout."""


class Conn:
    def __init__(self, address: str, timeout: float):
        self.address, self.timeout = address, timeout
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)

    def send(self, obj) -> None:
        self.sock.send(obj if isinstance(obj, bytes) else msgpack.packb(obj, use_bin_type=True))

    def recv(self) -> dict:
        if not self.sock.poll(int(self.timeout * 1000)):
            raise Lost()
        return msgpack.unpackb(self.sock.recv(), raw=False)

    def close(self) -> None:
        self.sock.close(linger=0)


def client_main(index: int, address: str, num_requests: int, seed: int, timeout: float, edge: bool,
                out) -> None:
    rng = random.Random(seed * 1000 + index)
    bad_inputs = BAD_INPUTS + (EDGE_INPUTS if edge else [])
    counts = dict(completed=0, aborted=0, disconnected=0, bad_inputs=0, errors_answered=0,
                  other_code=0, lost=0, refused=0, client_errors=0)
    conn = Conn(address, timeout)
    for n in range(num_requests):
        rid = f"c{index}-r{n}"
        try:
            if rng.random() < 0.25:
                frame, code = rng.choice(bad_inputs)
                if frame == "DUPLICATE":
                    reply = duplicate(conn, rid)
                else:
                    if isinstance(frame, dict):
                        frame = {k: (rid if v == "ID" else v) for k, v in frame.items()}
                    conn.send(frame)
                    reply = conn.recv()
                counts["bad_inputs"] += 1
                if reply.get("type") == "error":
                    counts["errors_answered"] += 1
                    counts["other_code"] += reply.get("code") != code
                else:
                    counts["refused"] += 1  # a bad input was not refused
                continue
            params = {"max_tokens": rng.randint(1, 48), "temperature": rng.choice([0.0, 0.7, 1.0])}
            if rng.random() < 0.5:
                params["seed"] = rng.randrange(1 << 32)
            conn.send({"v": 1, "type": "generate", "id": rid, "prompt": rng.choice(PROMPTS), "params": params})
            abort_after = rng.randint(1, 4) if rng.random() < 0.25 else None
            vanish_after = rng.randint(1, 3) if abort_after is None and rng.random() < 0.05 else None
            deltas, abort_sent = 0, False
            while True:
                msg = conn.recv()
                kind = msg.get("type")
                if msg.get("id") != rid:
                    continue  # a late reply for an earlier request of this connection
                if kind == "delta":
                    deltas += 1
                    if vanish_after is not None and deltas >= vanish_after:
                        conn.close()  # the daemon must abort it and free its blocks
                        conn = Conn(address, timeout)
                        counts["disconnected"] += 1
                        break
                    if abort_after is not None and deltas >= abort_after and not abort_sent:
                        conn.send({"v": 1, "type": "abort", "id": rid})
                        abort_sent = True
                elif kind == "done":
                    if msg.get("finish_reason") == "abort":
                        counts["aborted"] += 1
                    else:
                        counts["completed"] += 1
                        if abort_sent:  # it finished first: the abort gets unknown_id
                            late = conn.recv()
                            assert late.get("type") == "error" and late.get("code") == "unknown_id", late
                    break
                else:  # an error for a valid request
                    counts["refused"] += 1
                    break
        except Lost:
            counts["lost"] += 1
            conn.close()
            conn = Conn(address, timeout)
        except Exception:  # a bug of this script: say so, and keep the counts coming
            traceback.print_exc()
            counts["client_errors"] += 1
            conn.close()
            conn = Conn(address, timeout)
    conn.close()
    out.put(counts)


def duplicate(conn: Conn, rid: str) -> dict:
    """Send one short generate twice; return the reply to the second after the first's done."""
    request = {"v": 1, "type": "generate", "id": rid, "prompt": "x = ", "params": {"max_tokens": 4}}
    conn.send(request)
    conn.send(request)
    refusal, done = None, False
    while refusal is None or not done:
        msg = conn.recv()
        if msg.get("type") == "error" and refusal is None:
            refusal = msg
        elif msg.get("type") == "done":
            done = True
        elif msg.get("type") == "error":
            raise Lost()  # the first request failed: count it lost
    return refusal


# ---- daemons ---------------------------------------------------------------------------
class Daemon:
    """`tpserve serve` in the foreground in a private runtime dir; remembers its process tree."""

    def __init__(self, *args: str, startup_timeout: float = 300):
        self.rd = tempfile.mkdtemp(prefix="tps-soak-", dir="/tmp")
        self.address = f"ipc://{self.rd}/tpserve.sock"
        self.log = open(Path(self.rd, "serve.log"), "wb")
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        self.proc = subprocess.Popen([sys.executable, "-m", "tpserve", "serve", "--runtime-dir", self.rd, *args],
                                     stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        deadline = time.monotonic() + startup_timeout
        while not Path(self.rd, "tpserve.ready").exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("daemon did not start:\n" + self.log_text()[-3000:])
            time.sleep(0.1)
        self.tree = [self.proc.pid] + descendants(self.proc.pid)

    def log_text(self) -> str:
        return Path(self.rd, "serve.log").read_text(errors="replace")

    def workers(self) -> list[int]:
        return [p for p in descendants(self.proc.pid)
                if b"spawn_main" in Path(f"/proc/{p}/cmdline").read_bytes()]

    def status(self, timeout: float = 30) -> dict:
        conn = Conn(self.address, timeout)
        try:
            conn.send({"v": 1, "type": "status", "id": "soak"})
            return conn.recv()["stats"]
        finally:
            conn.close()

    def leftovers(self) -> tuple[int, int]:
        """(processes of the tree still alive after 10 s, shm segments named after the tree)."""
        deadline = time.monotonic() + 10
        while any(pid_alive(p) for p in self.tree) and time.monotonic() < deadline:
            time.sleep(0.1)
        alive = [p for p in self.tree if pid_alive(p)]
        shm = [n for n in os.listdir("/dev/shm") if any(n.startswith(f"tpserve-{p}-") for p in self.tree)] \
            if os.path.isdir("/dev/shm") else []
        return len(alive), len(shm)

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        for p in self.tree:
            if pid_alive(p):
                os.kill(p, signal.SIGKILL)
        self.log.close()
        shutil.rmtree(self.rd, ignore_errors=True)


def stream_until_first_delta(address: str, rid: str, timeout: float) -> Conn:
    conn = Conn(address, timeout)
    conn.send({"v": 1, "type": "generate", "id": rid, "prompt": "def main():",
               "params": {"max_tokens": 900, "ignore_eos": True, "temperature": 0}})
    msg = conn.recv()
    assert msg.get("type") == "delta", msg
    return conn


# ---- phases ------------------------------------------------------------------------------
def phase_clients(args) -> bool:
    t0 = time.monotonic()
    d = Daemon()
    try:
        ctx = mp.get_context("spawn")
        out = ctx.Queue()
        procs = [ctx.Process(target=client_main, args=(i, d.address, args.requests, args.seed,
                                                       args.reply_timeout, args.edge_inputs, out), name=f"soak-client-{i}")
                 for i in range(args.clients)]
        for p in procs:
            p.start()
        totals: dict[str, int] = dict.fromkeys(("completed", "aborted", "disconnected", "bad_inputs",
                                                "errors_answered", "other_code", "lost", "refused", "client_errors"), 0)
        reported, deadline = 0, time.monotonic() + args.phase_timeout
        while reported < len(procs):
            if d.proc.poll() is not None or time.monotonic() > deadline:
                for p in procs:  # the daemon died (or hangs): what the clients hold is lost
                    p.kill()
                totals["lost"] += len(procs) * args.requests - sum(totals[k] for k in (
                    "completed", "aborted", "disconnected", "bad_inputs", "lost", "client_errors"))
                print("soak phase 1: the daemon " + ("exited" if d.proc.poll() is not None else "hangs")
                      + "; its log ends:\n" + d.log_text()[-2000:], flush=True)
                break
            try:
                counts = out.get(timeout=1.0)
            except queue.Empty:
                continue
            reported += 1
            for k, v in counts.items():
                totals[k] += v
        for p in procs:
            p.join(30)
        if d.proc.poll() is not None:
            code, leaked = d.proc.returncode, -1
            procs_left, shm_left = d.leftovers()
            return _print_phase1(args, totals, leaked, procs_left, shm_left, code, t0) and False
        deadline = time.monotonic() + 30  # vanished clients are noticed when a send fails
        while True:
            st = d.status()
            if (st["kv_blocks_used"] == 0 and st["requests_in_flight"] == 0) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        leaked = st["kv_blocks_used"]
        d.proc.send_signal(signal.SIGTERM)
        code = d.proc.wait(timeout=60)
        procs_left, shm_left = d.leftovers()
    finally:
        d.close()
    return _print_phase1(args, totals, leaked, procs_left, shm_left, code, t0)


def _print_phase1(args, totals, leaked, procs_left, shm_left, code, t0) -> bool:
    print(f"soak phase 1 (TP 1, {args.clients} clients x {args.requests} requests): requests completed "
          f"{totals['completed']}, aborted by clients {totals['aborted']}, clients vanished "
          f"{totals['disconnected']}, bad inputs {totals['bad_inputs']}, errors answered "
          f"{totals['errors_answered']} ({totals['other_code']} with another code than documented), "
          f"valid requests refused {totals['refused']}, requests lost {totals['lost']}, blocks leaked "
          f"{leaked if leaked >= 0 else 'unknown (daemon gone)'}, leftover processes {procs_left}, shm segments {shm_left}, daemon exit {code}, "
          f"soak client errors {totals['client_errors']}, "
          f"{time.monotonic() - t0:.0f} s", flush=True)
    return (totals["lost"] == totals["refused"] == totals["client_errors"] == leaked == procs_left == shm_left
            == code == 0 and args.clients * args.requests == sum(
                totals[k] for k in ("completed", "aborted", "disconnected", "bad_inputs", "lost", "client_errors")))


def phase_kill_idle(args) -> bool:
    t0 = time.monotonic()
    d = Daemon("--tp", "2")
    try:
        conn = Conn(d.address, args.reply_timeout)
        conn.send({"v": 1, "type": "generate", "id": "warm", "prompt": "x = 1", "params": {"max_tokens": 4}})
        while conn.recv().get("type") != "done":
            pass
        conn.close()
        workers = d.workers()
        os.kill(workers[0], signal.SIGKILL)
        try:
            code = d.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            code = None
        reported = "worker rank 1 died" in d.log_text()
        procs_left, shm_left = d.leftovers()
    finally:
        d.close()
    print(f"soak phase 2 (TP 2, worker SIGKILL while idle): daemon exit {code} (must be 1), death logged "
          f"{reported}, leftover processes {procs_left}, shm segments {shm_left}, {time.monotonic() - t0:.0f} s",
          flush=True)
    return code == 1 and reported and procs_left == shm_left == 0


def phase_kill_busy(args) -> bool:
    t0 = time.monotonic()
    d = Daemon("--tp", "2")
    errors = lost = other = 0
    try:
        conns = [stream_until_first_delta(d.address, f"s{i}", args.reply_timeout) for i in range(4)]
        os.kill(d.workers()[0], signal.SIGKILL)
        for c in conns:
            try:
                while True:
                    msg = c.recv()
                    if msg.get("type") == "error":
                        errors += 1
                        break
                    if msg.get("type") == "done":
                        other += 1
                        break
            except Lost:
                lost += 1
            c.close()
        try:
            code = d.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            code = None
        procs_left, shm_left = d.leftovers()
    finally:
        d.close()
    print(f"soak phase 3 (TP 2, worker SIGKILL with 4 streams in flight): errors answered {errors}, "
          f"finished otherwise {other}, requests lost {lost}, daemon exit {code} (must be 1), leftover "
          f"processes {procs_left}, shm segments {shm_left}, {time.monotonic() - t0:.0f} s", flush=True)
    return errors == 4 and lost == 0 and code == 1 and procs_left == shm_left == 0


def main() -> int:
    ap = argparse.ArgumentParser(description="tpserve reliability soak (minutes; see the module docstring)")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--requests", type=int, default=25, help="per client")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--reply-timeout", type=float, default=60.0, help="seconds without a reply that count as lost")
    ap.add_argument("--edge-inputs", action="store_true",
                    help="also send numbers at integer-width edges (top_k 2^31, max_tokens 2^63 - 1, ...), "
                         "which the protocol must refuse with an error each")
    ap.add_argument("--phase-timeout", type=float, default=900.0,
                    help="seconds the clients of phase 1 may take in all before the rest counts as lost")
    args = ap.parse_args()
    ok = [phase_clients(args), phase_kill_idle(args), phase_kill_busy(args)]
    print("soak:", "PASS" if all(ok) else "FAIL", flush=True)
    return 0 if all(ok) else 1


if __name__ == "__main__":
    sys.exit(main())
