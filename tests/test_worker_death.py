"""A tensor-parallel worker killed while the daemon is idle: detected at once, reported, exit 1.

`tpserve serve --tp 2` runs in the foreground on a tiny model. The daemon is frozen (SIGSTOP)
while rank 1 is SIGKILLed and a client asks for the status, so nothing but the worker's death
can make the idle daemon act: it must exit with status 1 by itself, say why in its log, answer
the waiting client, and leave no process and no shared-memory segment behind. (Requests in
flight when a worker dies get an error reply: test_daemon.py, with an engine whose worker can
be killed on cue.)
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

from model_factory import make_tiny_model, tiny_models_root  # noqa: F401
from test_cli import NUM_KV_BLOCKS, TPSERVE, shm_segments_of, short_tmpdir
from test_daemon import Raw
from tpserve.client import protocol as P
from tpserve.procs import descendants, pid_alive


def _wait_ready(proc, rd: str, log: Path) -> None:
    ready = Path(rd, "tpserve.ready")
    deadline = time.monotonic() + 200
    while not ready.exists():
        assert proc.poll() is None, log.read_text()
        assert time.monotonic() < deadline, "daemon did not become ready"
        time.sleep(0.1)


def test_worker_killed_while_idle_is_reported_and_the_daemon_exits_1(tiny_models_root):  # noqa: F811
    model = make_tiny_model(tiny_models_root, arch="qwen3")
    rd = short_tmpdir()
    log_path = Path(rd, "serve.log")
    log = open(log_path, "wb")
    proc = subprocess.Popen(TPSERVE + ["serve", "--model", str(model), "--tp", "2", "--runtime-dir", rd,
                                       "--num-kv-blocks", str(NUM_KV_BLOCKS)],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    clients = []
    try:
        _wait_ready(proc, rd, log_path)
        tree = [proc.pid] + descendants(proc.pid)
        workers = [p for p in descendants(proc.pid) if b"spawn_main" in Path(f"/proc/{p}/cmdline").read_bytes()]
        assert len(workers) == 1
        address = f"ipc://{rd}/tpserve.sock"
        clients = [Raw(address)]
        clients[0].send_msg(P.PingRequest(id="ping"))  # connected before the freeze: the frame queues
        assert isinstance(clients[0].recv(timeout=60), P.PongReply)

        os.kill(proc.pid, signal.SIGSTOP)
        os.kill(workers[0], signal.SIGKILL)
        clients[0].send_msg(P.StatusRequest(id="st"))
        os.kill(proc.pid, signal.SIGCONT)

        status = clients[0].recv(timeout=60)
        assert isinstance(status, P.StatusReply), status
        if status.stats["state"] != "running":  # answered after the death was noticed
            assert status.stats["state"] == "failed" and "rank 1" in status.stats["failure"]
        assert proc.wait(timeout=60) == 1  # without a request: only the death itself can end it
        text = log_path.read_text()
        assert "tensor-parallel worker rank 1 died (exit code -9)" in text, text[-3000:]
        deadline = time.monotonic() + 10
        while any(pid_alive(p) for p in tree):
            assert time.monotonic() < deadline, [p for p in tree if pid_alive(p)]
            time.sleep(0.1)
        assert shm_segments_of(tree) == []
        assert sorted(os.listdir(rd)) == ["serve.log"]
    finally:
        for c in clients:
            c.close()
        log.close()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGCONT)
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        shutil.rmtree(rd, ignore_errors=True)
