"""`tpserve stop` against daemons that do not cooperate, and what a daemon killed with SIGKILL left.

A stand-in daemon (a small Python process) owns a runtime dir as a daemon does: it holds the
pid-file lock, listens on the socket, has a child (its "worker") and writes the ready file with
its shutdown grace. A graceful one exits on SIGTERM, removing its files; a stalled one ignores
SIGTERM, as a daemon whose serving loop is stuck in a step never gets to read it. Every test
is bounded and kills whatever it started.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from model_factory import make_tiny_model, tiny_models_root  # noqa: F401
from tpserve.cli.control_cmds import LOOP_SLACK
from tpserve.cli.main import main
from tpserve.procs import descendants, pid_alive

STAND_IN = textwrap.dedent("""
    import os, signal, socket, subprocess, sys, time
    from pathlib import Path
    from tpserve.server.runtime import PidFile, write_ready

    rd, mode, grace = Path(sys.argv[1]), sys.argv[2], float(sys.argv[3])
    pidfile = PidFile(rd)
    pidfile.acquire()
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(rd / "tpserve.sock"))
    sock.listen()
    worker = subprocess.Popen(["sleep", "600"])

    def graceful(signum, frame):
        worker.kill()
        worker.wait()
        (rd / "tpserve.ready").unlink()
        sock.close()
        (rd / "tpserve.sock").unlink()
        pidfile.release()
        sys.exit(0)

    signal.signal(signal.SIGTERM, signal.SIG_IGN if mode == "stalled" else graceful)
    write_ready(rd, f"ipc://{rd}/tpserve.sock", shutdown_grace=grace)
    while True:
        time.sleep(1)
""")


class StandIn:
    def __init__(self, mode: str, grace: float = 0.5):
        self.rd = Path(tempfile.mkdtemp(prefix="tps-", dir="/tmp"))
        self.proc = subprocess.Popen([sys.executable, "-c", STAND_IN, str(self.rd), mode, str(grace)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     start_new_session=True)
        self.tree = [self.proc.pid]
        try:
            deadline = time.monotonic() + 60
            while not (self.rd / "tpserve.ready").exists():
                assert self.proc.poll() is None, self.proc.stderr.read().decode()
                assert time.monotonic() < deadline, "the stand-in daemon did not get ready"
                time.sleep(0.05)
            self.tree += descendants(self.proc.pid)
            assert len(self.tree) == 2
        except BaseException:
            self.close()
            raise

    def files(self) -> list[str]:
        return sorted(os.listdir(self.rd))

    def close(self):
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # its own session: the stand-in and its worker
        except ProcessLookupError:
            pass
        for p in self.tree:
            if pid_alive(p):
                os.kill(p, signal.SIGKILL)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        shutil.rmtree(self.rd, ignore_errors=True)


@pytest.fixture
def stand_ins():
    made = []

    def make(*args, **kw):
        made.append(StandIn(*args, **kw))
        return made[-1]
    yield make
    for s in made:
        s.close()


def stop(rd, *args, timeout=60):
    argv = [sys.executable, "-m", "tpserve", "stop", "--runtime-dir", str(rd), *map(str, args)]
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout)


def assert_tree_gone(tree, within=10.0):
    deadline = time.monotonic() + within
    while any(pid_alive(p) for p in tree):
        assert time.monotonic() < deadline, [p for p in tree if pid_alive(p)]
        time.sleep(0.05)


def test_a_stalled_daemon_is_killed_after_its_grace(stand_ins):
    """SIGTERM changes nothing: once the grace and LOOP_SLACK have passed with the serving loop
    still running (the ready file is there), stop says so and kills the whole tree."""
    d = stand_ins("stalled", grace=0.5)
    t0 = time.monotonic()
    out = stop(d.rd)
    took = time.monotonic() - t0
    assert out.returncode == 0, out.stderr
    assert f"the daemon (pid {d.proc.pid}) is stalled: its serving loop still runs" in out.stderr
    assert "killing it and its workers" in out.stderr
    assert f"killed tpserve daemon (pid {d.proc.pid})" in out.stdout
    assert d.proc.wait(timeout=10) == -signal.SIGKILL
    assert_tree_gone(d.tree)
    assert d.files() == []  # pid file, ready file and socket removed
    assert took >= 0.5 + LOOP_SLACK  # not before the grace and the slack


def test_an_explicit_timeout_bounds_the_wait(stand_ins):
    d = stand_ins("stalled", grace=600)
    out = stop(d.rd, "--timeout", 1)
    assert out.returncode == 0, out.stderr
    assert f"the daemon (pid {d.proc.pid}) did not exit within 1 s; killing it and its workers" in out.stderr
    assert_tree_gone(d.tree)
    assert d.files() == []


def test_a_sigstopped_daemon_is_continued_and_drains(stand_ins):
    d = stand_ins("graceful")
    os.kill(d.proc.pid, signal.SIGSTOP)
    out = stop(d.rd)
    assert out.returncode == 0, out.stderr
    assert f"pid {d.proc.pid} of the daemon was stopped (SIGSTOP); continuing it" in out.stderr
    assert out.stdout.strip() == f"stopped tpserve daemon (pid {d.proc.pid})"
    assert d.proc.wait(timeout=10) == 0
    assert_tree_gone(d.tree)
    assert d.files() == []


def test_a_sigstopped_stalled_tree_is_killed(stand_ins):
    """The daemon and its worker both stopped, the daemon deaf to SIGTERM once continued."""
    d = stand_ins("stalled", grace=0)
    for p in d.tree:
        os.kill(p, signal.SIGSTOP)
    out = stop(d.rd, "--timeout", 2)
    assert out.returncode == 0, out.stderr
    assert "did not exit within 2 s; killing it and its workers" in out.stderr
    assert_tree_gone(d.tree)
    assert d.files() == []


def test_kill_9_leftovers_are_cleaned_by_status_stop_and_start(stand_ins, tiny_models_root):  # noqa: F811
    def killed():
        d = stand_ins("graceful")
        os.killpg(d.proc.pid, signal.SIGKILL)
        d.proc.wait(timeout=10)
        assert_tree_gone(d.tree)
        assert d.files() == ["tpserve.pid", "tpserve.ready", "tpserve.sock"]
        return d

    d = killed()
    st = CliRunner().invoke(main, ["status", "--runtime-dir", str(d.rd), "--timeout", "30"])
    assert st.exit_code == 1 and "no tpserve daemon is running" in st.output
    assert d.files() == []

    d = killed()
    out = stop(d.rd)
    assert out.returncode == 1 and "no tpserve daemon is running" in out.stderr
    assert d.files() == []

    # start cleans up before it launches: here the launch itself fails (its log is on a full disk).
    d = killed()
    (d.rd / "tpserve.log").symlink_to("/dev/full")
    model = make_tiny_model(tiny_models_root, arch="qwen3")
    result = CliRunner().invoke(main, ["start", "--model", str(model), "--runtime-dir", str(d.rd)])
    assert result.exit_code == 1 and "no space left on the file system of" in result.output
    assert d.files() == ["tpserve.log"]
