"""The command line and the client library load nothing of the engine or the server.

Each command runs in a fresh interpreter whose import system refuses the engine's and the
server's packages (torch, transformers, triton, tpserve.engine, ...): `--help`, `status`, `stop`
and `generate` must still answer properly, with no daemon, with what a killed daemon left, and
against a daemon (a fake engine behind the real server, in this process). At exit the child
reports every import it was refused (a refusal the code caught and worked around counts too)
and which of the usual heavy modules it loaded.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from test_daemon import FakeEngine, ServerThread
from tpserve.sampling import SamplingParams
from tpserve.server.runtime import PidFile, write_ready

BLOCKED = ("torch", "transformers", "triton", "tokenizers", "safetensors", "llguidance", "fastapi", "uvicorn",
           "grpc", "prometheus_client", "tpserve.engine", "tpserve.llm", "tpserve.workers", "tpserve.models",
           "tpserve.kernels", "tpserve.scheduler", "tpserve.blockpool", "tpserve.grammar",
           "tpserve.server.server",
           "tpserve.server.daemon", "tpserve.fronts", "tpserve.cli.daemon_cmds", "tpserve.cli.options")

PRELUDE = textwrap.dedent("""
    import atexit, importlib.abc, json, os, sys

    BLOCKED = {blocked!r}
    refused = []

    class Refuse(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if any(name == b or name.startswith(b + ".") for b in BLOCKED):
                refused.append(name)
                raise ImportError(f"{{name}} is blocked: the light CLI must not import it")
            return None

    sys.meta_path.insert(0, Refuse())

    def report():
        with open(os.environ["LIGHT_REPORT"], "w") as f:
            json.dump({{"refused": refused, "modules": sorted(sys.modules)}}, f)

    atexit.register(report)
""").format(blocked=BLOCKED)

RUN_CLI = PRELUDE + textwrap.dedent("""
    from tpserve.cli.main import main
    main(sys.argv[1:], prog_name="tpserve")
""")


def run_light(code: str, *args, timeout=60):
    """Run ``code`` (with the import blocker) in a fresh interpreter; returns (process, report)."""
    fd, report_path = tempfile.mkstemp(prefix="tpserve-light-", suffix=".json")
    os.close(fd)
    try:
        env = dict(os.environ, LIGHT_REPORT=report_path)
        env.pop("TPSERVE_ADDRESS", None)
        proc = subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True,
                              timeout=timeout, env=env)
        report = json.loads(Path(report_path).read_text() or "{}")
    finally:
        os.unlink(report_path)
    assert report, proc.stderr
    return proc, report


def cli(*args, timeout=60):
    proc, report = run_light(RUN_CLI, *args, timeout=timeout)
    assert report["refused"] == [], (args, report["refused"], proc.stderr)
    return proc, set(report["modules"])


HEAVY = {"torch", "transformers", "triton", "tpserve.engine", "tpserve.server.server", "tpserve.config"}
CLIENT_LIBS = {"zmq", "msgpack", "numpy"}


@pytest.fixture
def rd():
    path = Path(tempfile.mkdtemp(prefix="tpl-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_help_loads_neither_the_engine_nor_the_client():
    out, modules = cli("--help")
    assert out.returncode == 0, out.stderr
    for name in ("start", "serve", "stop", "status", "generate", "profile", "keys"):
        assert f"\n  {name} " in out.stdout
    assert not modules & (HEAVY | CLIENT_LIBS), modules & (HEAVY | CLIENT_LIBS)
    for cmd in ("status", "stop", "generate", "profile", "keys"):
        out, modules = cli(cmd, "--help")
        assert out.returncode == 0 and "Usage: tpserve " + cmd in out.stdout, out.stderr
        assert not modules & HEAVY


def test_the_client_library_imports_light():
    code = PRELUDE + textwrap.dedent("""
        import tpserve, tpserve.client
        from tpserve.client import AsyncClient, Client, ClientTimeout, ProtocolError, PROTOCOL_VERSION
        from tpserve.client import addresses, keys, protocol
        assert tpserve.Client is Client and tpserve.AsyncClient is AsyncClient
        print(tpserve.SamplingParams(max_tokens=3).max_tokens, PROTOCOL_VERSION)
    """)
    out, report = run_light(code)
    assert out.returncode == 0, out.stderr
    assert report["refused"] == [] and not set(report["modules"]) & HEAVY
    assert "numpy" not in report["modules"]  # tpserve.limits imports it only to check long id lists
    assert out.stdout.split()[0] == "3"


def test_status_stop_generate_without_a_daemon(rd):
    for args in (["status"], ["stop"], ["generate", "hi"]):
        out, modules = cli(*args, "--runtime-dir", rd)
        assert out.returncode == 1, (args, out.stdout, out.stderr)
        assert f"tpserve: no tpserve daemon is running with runtime dir {rd}" in out.stderr, out.stderr
        assert not modules & HEAVY
        if args != ["generate", "hi"]:  # found without a daemon: neither the client library nor numpy
            assert not modules & CLIENT_LIBS, (args, modules & CLIENT_LIBS)
    out, _ = cli("status", "--runtime-dir", rd / "missing")  # no runtime dir at all
    assert out.returncode == 1 and "no tpserve daemon is running" in out.stderr
    out, _ = cli("status", "--address", f"ipc://{rd}/nothing.sock")
    assert out.returncode == 1 and f"no tpserve daemon at ipc://{rd}/nothing.sock" in out.stderr


def test_what_a_killed_daemon_left_is_cleaned_up(rd):
    """kill -9 leaves a pid file whose lock nobody holds, the ready file and the socket."""
    for args in (["status"], ["generate", "hi"], ["stop"]):
        (rd / "tpserve.pid").write_text("999999\n")
        (rd / "tpserve.ready").write_text(json.dumps({"pid": 999999, "address": f"ipc://{rd}/tpserve.sock"}))
        (rd / "tpserve.sock").touch()
        out, modules = cli(*args, "--runtime-dir", rd, "--timeout", 30)
        assert out.returncode == 1 and "no tpserve daemon is running" in out.stderr, out.stderr
        assert sorted(os.listdir(rd)) == [], args
        assert not modules & HEAVY
    # A socket and ready file without a pid file are left over too (a daemon locks its pid file first).
    (rd / "tpserve.sock").touch()
    (rd / "tpserve.ready").write_text("{}")
    out, _ = cli("status", "--runtime-dir", rd)
    assert out.returncode == 1 and sorted(os.listdir(rd)) == []


def test_status_and_generate_against_a_daemon(rd):
    """The real server (fake engine) on tcp, found through the runtime dir as a daemon's would be."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    pidfile = PidFile(rd)
    pidfile.acquire()  # this process stands in for the daemon that owns rd
    try:
        with ServerThread(FakeEngine(), address=address) as srv:
            write_ready(rd, address)
            out, modules = cli("status", "--runtime-dir", rd)
            assert out.returncode == 0, out.stderr
            assert f"tpserve daemon at {address}" in out.stdout and "fake-model" in out.stdout
            assert not modules & HEAVY, modules & HEAVY
            tokens = FakeEngine.expected_tokens("hello", SamplingParams(max_tokens=3))
            expected = "".join(f"{t} " for t in tokens)
            for extra in ([], ["--no-stream"]):
                out, modules = cli("generate", "hello", "--max-tokens", 3, "--show-finish", *extra,
                                   "--runtime-dir", rd)
                assert out.returncode == 0, out.stderr
                assert out.stdout == expected + "\n"
                assert "[finish_reason=length prompt_tokens=5 completion_tokens=3]" in out.stderr
                assert not modules & HEAVY, modules & HEAVY
            assert srv.stop() == 0
    finally:
        pidfile.release()
