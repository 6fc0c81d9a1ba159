"""`tpserve` CLI: option handling (CliRunner) and real daemons on a tiny model, end to end.

The end-to-end tests start real daemons with `tpserve start`/`serve` on a tiny random Qwen3
model and compare what clients receive with the offline API (tpserve.LLM) for the same seeds.
After each daemon stops, neither it, its workers, nor its shared-memory segments may remain.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from model_factory import make_tiny_model, tiny_models_root  # noqa: F401
from test_daemon import FakeEngine, ServerThread
from tpserve.cli.main import main
from tpserve.client.client import Client
from tpserve.client.keys import load_keys
from tpserve.cli.options import config_from_options, engine_options, options_argv
from tpserve.client.addresses import read_ready
from tpserve.server.runtime import PidFile, write_ready
from tpserve.procs import descendants, pid_alive
from tpserve.sampling import SamplingParams

NUM_KV_BLOCKS = 64
TPSERVE = [sys.executable, "-m", "tpserve"]


def short_tmpdir() -> str:
    return tempfile.mkdtemp(prefix="tpc-", dir="/tmp")


def run_cli(*args, timeout=240, env=None) -> subprocess.CompletedProcess:
    return subprocess.run(TPSERVE + [str(a) for a in args], capture_output=True, text=True, timeout=timeout,
                          env=env)


def shm_segments_of(pids) -> list[str]:
    """Shared-memory segments named after any of ``pids`` (segment names are tpserve-<pid>-...)."""
    names = os.listdir("/dev/shm") if os.path.isdir("/dev/shm") else []
    return [n for n in names if any(n.startswith(f"tpserve-{p}-") for p in pids)]


# ---- option handling (no daemon) -------------------------------------------------------------
def test_help_of_every_command():
    runner = CliRunner()
    result = runner.invoke(main, ["--help"])
    assert result.exit_code == 0
    for cmd in ("start", "serve", "stop", "status", "generate", "profile", "keys"):
        assert cmd in result.output
        sub = runner.invoke(main, [cmd, "--help"])
        assert sub.exit_code == 0, sub.output
        assert "Usage:" in sub.output
    start_help = runner.invoke(main, ["start", "--help"], terminal_width=200).output
    for opt in ("--model", "--tp, --tensor-parallel-size", "--block-size", "--max-num-seqs",
                "--max-num-batched-tokens", "--max-model-len", "--kv-cache-memory-gb", "--num-kv-blocks",
                "--dtype", "--attention-backend", "--enforce-eager", "--no-prefix-caching",
                "--no-kv-cache-prefault", "--seed",
                "--address", "--runtime-dir", "--curve-secret-key", "--startup-timeout", "TPSERVE_NUM_KV_BLOCKS"):
        assert opt in start_help, opt


def test_the_command_list_matches_the_commands():
    """`tpserve --help` lists the commands from a table, without importing them: each summary
    there must be its command's own."""
    from tpserve.cli.main import COMMANDS
    ctx = click.Context(main)
    assert sorted(main.list_commands(ctx)) == sorted(COMMANDS) and len(COMMANDS) == 7
    for name, ref in COMMANDS.items():
        cmd = main.get_command(ctx, name)
        assert cmd is not None and cmd.name == name and cmd.callback.__module__ == ref.module
        summary = click.Command(name, help=ref.summary).get_short_help_str(1000)
        assert summary == cmd.get_short_help_str(1000), name
    assert main.get_command(ctx, "nonsense") is None
    result = CliRunner().invoke(main, ["nonsense"])
    assert result.exit_code == 2 and "No such command 'nonsense'" in result.output


def test_python_dash_m_runs_the_cli():
    out = run_cli("--help", timeout=60)
    assert out.returncode == 0 and "generate" in out.stdout


@pytest.mark.parametrize("args,env,option,reason", [
    (["--block-size", "0"], {}, "--block-size", "must be an integer >= 1"),
    (["--tp", "0"], {}, "--tensor-parallel-size", "must be an integer >= 1"),
    (["--kv-cache-memory-gb", "-1"], {}, "--kv-cache-memory-gb", "must be > 0"),
    (["--seed", "-3"], {}, "--seed", "must be an integer >= 0"),
    ([], {"TPSERVE_MAX_NUM_SEQS": "0"}, "--max-num-seqs", "must be an integer >= 1"),
    (["--model", "/nonexistent/model"], {}, "--model", "not a Hugging Face model directory"),
    (["--dtype", "float8"], {}, "--dtype", "float8"),
])
def test_bad_engine_options_name_the_option(args, env, option, reason):
    result = CliRunner().invoke(main, ["serve", *args], env=env)
    assert result.exit_code == 2
    assert option in result.output and reason in result.output


@pytest.mark.parametrize("args,option", [
    (["--top-p", "0"], "--top-p"), (["--temperature", "-1"], "--temperature"),
    (["--max-tokens", "0"], "--max-tokens"), (["--stop-token-id", "-5"], "'--stop-token-id'"),
    (["--top-k", "2147483648"], "'--top-k'"), (["--stop-token-id", "1", "--stop-token-id", "2147483648"],
                                                "'--stop-token-id'"),
    (["--max-tokens", str(2**63 - 1)], "'--max-tokens'"), (["--seed", str(2**63)], "'--seed'"),
])
def test_bad_sampling_options_name_the_option(args, option):
    result = CliRunner().invoke(main, ["generate", "hi", *args, "--address", "tcp://127.0.0.1:9"])
    assert result.exit_code == 2 and option in result.output


def test_engine_options_come_from_the_environment(tiny_models_root):  # noqa: F811
    model = make_tiny_model(tiny_models_root, arch="qwen3")
    kw = dict(model=str(model), tensor_parallel_size=2, block_size=8, max_num_seqs=4,
              max_num_batched_tokens=64, max_model_len=128, kv_cache_memory_gb=0.5,
              gpu_memory_utilization=0.5, num_kv_blocks=9, dtype="float32", attention_backend="torch",
              enforce_eager=True, no_prefix_caching=True, no_kv_cache_prefault=True, seed=7,
              startup_timeout=42.5)
    config = config_from_options(dict(kw))
    assert config.startup_timeout == 42.5  # one meaning: the engine's start, also what `start` waits
    assert (config.block_size, config.num_kv_blocks, config.enable_prefix_caching) == (8, 9, False)
    assert config.kv_cache_prefault is False
    # What `start` passes to its child rebuilds the same configuration.
    seen = {}

    @click.command()
    @engine_options
    def probe(**kwargs):
        seen["config"] = config_from_options(kwargs)

    result = CliRunner().invoke(probe, options_argv(config))
    assert result.exit_code == 0, result.output
    assert seen["config"].to_dict() == config.to_dict()
    result = CliRunner().invoke(probe, [], env={"TPSERVE_MODEL": str(model), "TPSERVE_NUM_KV_BLOCKS": "11",
                                                "TPSERVE_NO_PREFIX_CACHING": "1", "TPSERVE_TP": "2"})
    assert result.exit_code == 0, result.output
    assert seen["config"].num_kv_blocks == 11 and not seen["config"].enable_prefix_caching
    assert seen["config"].tensor_parallel_size == 2
    result = CliRunner().invoke(probe, ["--model", str(model)], env={"TPSERVE_STARTUP_TIMEOUT": "7"})
    assert result.exit_code == 0 and seen["config"].startup_timeout == 7.0
    result = CliRunner().invoke(probe, ["--model", str(model), "--startup-timeout", "0"])
    assert result.exit_code == 2 and "--startup-timeout" in result.output


def test_keys(tmp_path):
    result = CliRunner().invoke(main, ["keys", str(tmp_path / "k")])
    assert result.exit_code == 0, result.output
    public, secret = tmp_path / "k" / "tpserve.key", tmp_path / "k" / "tpserve.key_secret"
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    pub, none = load_keys(public)
    pub2, sec = load_keys(secret)
    assert none is None and pub == pub2 and len(pub) == 40 and len(sec) == 40
    assert pub.decode() in result.output
    again = CliRunner().invoke(main, ["keys", str(tmp_path / "k")])
    assert again.exit_code == 1 and "--force" in again.output
    assert load_keys(public)[0] == pub
    forced = CliRunner().invoke(main, ["keys", str(tmp_path / "k"), "--force"])
    assert forced.exit_code == 0 and load_keys(public)[0] != pub


def test_commands_without_a_daemon_fail_clearly():
    rd = short_tmpdir()
    try:
        runner = CliRunner()
        st = runner.invoke(main, ["status", "--runtime-dir", rd])
        assert st.exit_code == 1 and f"no tpserve daemon is running with runtime dir {rd}" in st.output
        gen = runner.invoke(main, ["generate", "hi", "--runtime-dir", rd])
        assert gen.exit_code == 1 and "no tpserve daemon is running" in gen.output
        # What a kill -9 leaves: a socket file and a pid file whose lock nobody holds. The lock
        # decides at once (the default --timeout is 5 s; no reply is awaited here).
        Path(rd, "tpserve.sock").touch()
        Path(rd, "tpserve.pid").write_text("999999\n")
        st = runner.invoke(main, ["status", "--runtime-dir", rd, "--timeout", "30"])
        assert st.exit_code == 1 and "no tpserve daemon is running" in st.output
        assert not Path(rd, "tpserve.sock").exists()  # the stale files are cleaned up
        sock = runner.invoke(main, ["status", "--address", f"ipc://{rd}/nothing.sock"])
        assert sock.exit_code == 1 and f"no tpserve daemon at ipc://{rd}/nothing.sock" in sock.output
        tcp = runner.invoke(main, ["status", "--address", "tcp://127.0.0.1:9", "--timeout", "0.3"])
        assert tcp.exit_code == 1 and "tcp://127.0.0.1:9 within 0.3 s" in tcp.output
        stop = runner.invoke(main, ["stop", "--runtime-dir", rd])
        assert stop.exit_code == 1 and "no tpserve daemon is running" in stop.output
    finally:
        shutil.rmtree(rd, ignore_errors=True)


def test_status_finds_a_tcp_daemon_through_the_runtime_dir():
    rd = Path(short_tmpdir())
    address = f"tcp://127.0.0.1:{_free_port()}"
    pidfile = PidFile(rd)
    pidfile.acquire()  # this process stands in for the daemon that owns rd
    try:
        with ServerThread(FakeEngine(), address=address) as srv:
            write_ready(rd, address)
            st = CliRunner().invoke(main, ["status", "--runtime-dir", str(rd)])
            assert st.exit_code == 0, st.output
            assert f"tpserve daemon at {address}" in st.output and "fake-model" in st.output
            prof = CliRunner().invoke(main, ["profile", "--seconds", "0.05", "--runtime-dir", str(rd)])
            assert prof.exit_code == 0, prof.output
            assert prof.output.strip() == f"{srv.engine.profiles[0]}.rank0.json"
            assert srv.stop() == 0
    finally:
        pidfile.release()
        shutil.rmtree(rd, ignore_errors=True)


def test_stale_pid_file_is_cleaned(tmp_path):
    rd = tmp_path / "rt"
    rd.mkdir(mode=0o700)
    (rd / "tpserve.pid").write_text("999999\n")  # nobody holds its lock
    (rd / "tpserve.ready").write_text("{}")
    stop = CliRunner().invoke(main, ["stop", "--runtime-dir", str(rd)])
    assert stop.exit_code == 1 and "no tpserve daemon is running" in stop.output
    assert not (rd / "tpserve.pid").exists() and not (rd / "tpserve.ready").exists()


def test_start_refuses_an_exposed_address_without_keys(tiny_models_root, tmp_path):  # noqa: F811
    model = make_tiny_model(tiny_models_root, arch="qwen3")
    result = CliRunner().invoke(main, ["start", "--model", str(model), "--runtime-dir", str(tmp_path / "rt"),
                                       "--address", "tcp://0.0.0.0:5999"])
    assert result.exit_code == 2
    assert "--curve-secret-key" in result.output and "not a loopback address" in result.output
    assert not (tmp_path / "rt" / "tpserve.pid").exists()
    result = CliRunner().invoke(main, ["start", "--model", str(model), "--runtime-dir", str(tmp_path / "rt"),
                                       "--address", "tcp://0.0.0.0:5999", "--curve-secret-key",
                                       str(tmp_path / "missing.key_secret")])
    assert result.exit_code == 2 and "cannot read key file" in result.output


def test_start_on_a_full_disk_says_so(tiny_models_root, tmp_path):  # noqa: F811
    """Writes to /dev/full fail as on a full file system (ENOSPC)."""
    model = make_tiny_model(tiny_models_root, arch="qwen3")
    rd = tmp_path / "rt"
    rd.mkdir(mode=0o700)
    (rd / "tpserve.log").symlink_to("/dev/full")
    result = CliRunner().invoke(main, ["start", "--model", str(model), "--runtime-dir", str(rd)])
    assert result.exit_code == 1, result.output
    assert "no space left on the file system of" in result.output and "(the log is empty)" not in result.output
    assert not (rd / "tpserve.pid").exists() and not (rd / "tpserve.ready").exists()


def test_a_daemon_that_died_silently_on_a_full_disk_is_explained(tmp_path, monkeypatch):
    from tpserve.cli import daemon_cmds as cli
    log = tmp_path / "tpserve.log"
    log.write_bytes(b"old run\nstart's own line\n")
    offset = len(b"old run\n")
    assert cli._log_tail(log, offset, skip=1) == "(the log is empty)"
    monkeypatch.setattr(cli.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**9, 10**9, 0))
    assert "no space left on the file system of" in cli._log_tail(log, offset, skip=1)
    log.write_bytes(b"old run\nstart's own line\nTraceback: boom\n")
    assert cli._log_tail(log, offset, skip=1) == "Traceback: boom"


# ---- real daemons ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_model(tiny_models_root):  # noqa: F811
    return make_tiny_model(tiny_models_root, arch="qwen3")


class Daemon:
    """A daemon started with `tpserve start`; remembers its process tree for the leak checks."""

    def __init__(self, model, *extra):
        self.rd = short_tmpdir()
        out = run_cli("start", "--model", model, "--runtime-dir", self.rd, "--num-kv-blocks", NUM_KV_BLOCKS,
                      "--startup-timeout", 200, *extra)
        if out.returncode != 0:
            shutil.rmtree(self.rd, ignore_errors=True)
        assert out.returncode == 0, out.stderr + out.stdout
        self.address = out.stdout.strip()
        self.pid = int(Path(self.rd, "tpserve.pid").read_text())
        self.tree = [self.pid] + descendants(self.pid)

    def cli(self, *args, **kw):
        return run_cli(*args, "--runtime-dir", self.rd, **kw)

    def stop(self):
        out = self.cli("stop", "--timeout", 60)
        assert out.returncode == 0, out.stderr + out.stdout
        return out

    def assert_gone(self):
        deadline = time.monotonic() + 10
        while any(pid_alive(p) for p in self.tree):
            assert time.monotonic() < deadline, [p for p in self.tree if pid_alive(p)]
            time.sleep(0.1)
        assert shm_segments_of(self.tree) == []
        assert sorted(os.listdir(self.rd)) == ["tpserve.log"]

    def kill(self):
        for p in self.tree:
            if pid_alive(p):
                os.kill(p, signal.SIGKILL)
        shutil.rmtree(self.rd, ignore_errors=True)


@pytest.fixture(scope="module")
def daemon(tiny_model):
    # No queue limits: these tests flood the daemon to compare it with the offline API.
    d = Daemon(tiny_model, "--max-waiting-requests", "none", "--max-waiting-tokens", "none")
    yield d
    d.kill()


@pytest.fixture(scope="module")
def offline(tiny_model):
    from tpserve import LLM
    llm = LLM(str(tiny_model), num_kv_blocks=NUM_KV_BLOCKS)
    yield llm
    llm.shutdown()


def test_start_status_generate(daemon, offline, tiny_model):
    assert daemon.address == f"ipc://{daemon.rd}/tpserve.sock"
    assert stat.S_IMODE(os.stat(daemon.rd).st_mode) == 0o700
    again = daemon.cli("start", "--model", tiny_model)
    assert again.returncode == 1 and f"(pid {daemon.pid}) is already running" in again.stderr

    status = daemon.cli("status")
    assert status.returncode == 0, status.stderr
    lines = {line[2:20].strip(): line[20:] for line in status.stdout.splitlines()[1:]}
    assert str(daemon.pid) in lines["pid"] and str(tiny_model) in lines["model"]
    assert lines["tensor parallel"].split()[-1] == "1"
    assert lines["KV blocks used"].split()[-3:] == ["0", "/", str(NUM_KV_BLOCKS)]
    for key in ("uptime", "requests running", "requests waiting", "prefix cache hits", "preemptions", "tokens/s"):
        assert key in lines
    assert lines["ready"].strip() == "True" and lines["scheduling order"].strip() == "fcfs"
    assert lines["requests waiting"].strip() == "0 (limit none)" and lines["timed out"].strip() == "0"
    assert lines["refused"].strip() == "queue full 0 / queued tokens 0 / draining 0 / never fits 0"

    refused = daemon.cli("generate", "Hello", "--max-tokens", 100000)
    assert refused.returncode == 1 and "admission" in refused.stderr and "max_model_len" in refused.stderr

    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    want = offline.generate(["Hello world"], params, use_tqdm=False)[0]
    with Client(daemon.address, timeout=60) as c:
        assert c.generate("Hello world", params).token_ids == want.token_ids
    streamed = daemon.cli("generate", "Hello world", "--temperature", 0, "--max-tokens", 8, "--ignore-eos",
                          "--show-finish")
    assert streamed.returncode == 0, streamed.stderr
    assert "finish_reason=length" in streamed.stderr and "completion_tokens=8" in streamed.stderr
    whole = daemon.cli("generate", "Hello world", "--temperature", 0, "--max-tokens", 8, "--ignore-eos",
                       "--no-stream")
    assert whole.returncode == 0 and whole.stdout == streamed.stdout
    # The text a client sees is the offline API's text for the same tokens.
    assert streamed.stdout == want.text + "\n"


CLIENT_SCRIPT = textwrap.dedent("""
    import json, sys
    from tpserve.client.client import Client
    spec = json.loads(sys.argv[1])
    out = {}
    with Client(spec["address"], timeout=180) as c:
        streams = {rid: c.stream(prompt, request_id=rid, **params) for rid, prompt, params in spec["requests"]}
        tokens = {rid: [] for rid in streams}
        while streams:  # read all open streams round-robin
            for rid, s in list(streams.items()):
                try:
                    tokens[rid] += next(s).token_ids
                except StopIteration:
                    out[rid] = {"streamed": tokens[rid], "result": s.result.token_ids,
                                "finish_reason": s.result.finish_reason}
                    del streams[rid]
    print(json.dumps(out))
""")


def _workload(num_clients, per_client):
    work = []
    for c in range(num_clients):
        reqs = []
        for r in range(per_client):
            prompt = f"client {c} asks question {r}: the quick brown fox"
            if r % 2:
                params = dict(temperature=0.0, max_tokens=2 + r % 3)
            else:
                params = dict(temperature=0.9, top_k=20, seed=1000 * c + r, max_tokens=2 + r % 3)
            reqs.append((f"c{c}-r{r}", prompt, params))
        work.append(reqs)
    return work


def test_concurrent_clients_match_the_offline_api(daemon, offline):
    work = _workload(num_clients=8, per_client=25)
    procs = [subprocess.Popen([sys.executable, "-c", CLIENT_SCRIPT,
                               json.dumps({"address": daemon.address, "requests": reqs})],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for reqs in work]
    results = {}
    for p in procs:
        out, err = p.communicate(timeout=200)
        assert p.returncode == 0, err
        results.update(json.loads(out))
    flat = [req for reqs in work for req in reqs]
    assert len(results) == len(flat) == 200
    expected = offline.generate([prompt for _, prompt, _ in flat],
                                [SamplingParams(**params) for _, _, params in flat], use_tqdm=False)
    for (rid, _, params), want in zip(flat, expected):
        got = results[rid]
        assert got["streamed"] == got["result"] == want.token_ids, rid
        assert got["finish_reason"] == want.finish_reason
    with Client(daemon.address, timeout=30) as c:
        stats = c.status()
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0 and stats["kv_blocks_used"] == 0


HOLDER_SCRIPT = textwrap.dedent("""
    import sys
    from tpserve.client.client import Client
    c = Client(sys.argv[1], timeout=60)
    s = c.stream("a client that vanishes", max_tokens=400, ignore_eos=True)
    next(s)
    print("streaming", flush=True)
    sys.stdin.read()
""")


def test_aborts_and_vanished_clients_free_their_blocks(daemon):
    with Client(daemon.address, timeout=60) as c:
        streams = [c.stream(f"abort me {i} " * 5, max_tokens=400, ignore_eos=True) for i in range(4)]
        for s in streams:
            next(s)
        used = c.status()["kv_blocks_used"]
        assert used >= 4
        for s in streams:
            assert c.abort(s.request_id) is True
            for _ in s:
                pass
            assert s.result.finish_reason == "abort"
        stats = c.status()
        assert stats["kv_blocks_used"] == 0 and stats["num_running"] == 0 and stats["num_waiting"] == 0

        holder = subprocess.Popen([sys.executable, "-c", HOLDER_SCRIPT, daemon.address], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True)
        try:
            assert holder.stdout.readline().strip() == "streaming"
            assert c.status()["num_running"] + c.status()["num_waiting"] == 1
        finally:
            holder.kill()
            holder.wait()
        deadline = time.monotonic() + 30
        while True:
            stats = c.status()
            if stats["kv_blocks_used"] == 0 and stats["num_running"] == 0:
                break
            assert time.monotonic() < deadline, stats
            time.sleep(0.1)
    # Freed because the daemon noticed the client was gone, not because the request ran out.
    assert "disconnected: aborting 1 request(s)" in Path(daemon.rd, "tpserve.log").read_text()


def test_stop_leaves_no_process_and_no_shared_memory(daemon):
    assert all(pid_alive(p) for p in daemon.tree)
    out = daemon.stop()
    assert f"stopped tpserve daemon (pid {daemon.pid})" in out.stdout
    daemon.assert_gone()
    log = Path(daemon.rd, "tpserve.log").read_text()
    assert "received SIGTERM" in log and "exit status 0" in log
    gone = daemon.cli("status", "--timeout", 0.5)
    assert gone.returncode == 1


def _free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_sigterm_during_generation_on_a_curve_socket(tiny_model):
    """`tpserve serve` in the foreground, CurveZMQ on loopback TCP; SIGTERM mid-generation."""
    rd = short_tmpdir()
    keys = Path(rd) / "keys"
    assert CliRunner().invoke(main, ["keys", str(keys)]).exit_code == 0
    address = f"tcp://127.0.0.1:{_free_port()}"
    log = open(Path(rd) / "serve.log", "wb")
    proc = subprocess.Popen(TPSERVE + ["serve", "--model", str(tiny_model), "--runtime-dir", rd,
                                       "--num-kv-blocks", str(NUM_KV_BLOCKS), "--address", address,
                                       "--curve-secret-key", str(keys / "tpserve.key_secret"),
                                       "--shutdown-grace", "0"],  # SIGTERM aborts at once
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    tree = [proc.pid]
    try:
        deadline = time.monotonic() + 200
        while (read_ready(Path(rd)) or {}).get("pid") != proc.pid:
            assert proc.poll() is None, Path(rd, "serve.log").read_text()
            assert time.monotonic() < deadline
            time.sleep(0.1)
        tree += descendants(proc.pid)
        no_key = run_cli("status", "--address", address, "--timeout", 0.5)
        assert no_key.returncode == 1 and f"no reply from tpserve daemon at {address}" in no_key.stderr
        with_key = run_cli("status", "--address", address, "--server-key", keys / "tpserve.key")
        assert with_key.returncode == 0 and f"pid                {proc.pid}" in with_key.stdout
        with Client(address, timeout=60, server_public_key=keys / "tpserve.key") as c:
            streams = [c.stream(f"in flight {i}", max_tokens=400, ignore_eos=True) for i in range(3)]
            for s in streams:
                next(s)
            proc.send_signal(signal.SIGTERM)
            for s in streams:
                for _ in s:
                    pass
                assert (s.result.finish_reason, s.result.abort_reason) == ("abort", "shutting_down")
                assert 1 <= s.result.completion_tokens < 400
        assert proc.wait(timeout=60) == 0
        deadline = time.monotonic() + 10
        while any(pid_alive(p) for p in tree):
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert shm_segments_of(tree) == []
        assert sorted(os.listdir(rd)) == ["keys", "serve.log"]
    finally:
        log.close()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        shutil.rmtree(rd, ignore_errors=True)


def test_tensor_parallel_2_daemon_on_cpu(tiny_model, offline):
    d = Daemon(tiny_model, "--tp", 2)
    try:
        assert len(d.tree) >= 2  # rank 0 plus at least one worker process
        with Client(d.address, timeout=120) as c:
            stats = c.status()
            assert stats["tensor_parallel_size"] == 2
            prompts = ["tensor parallel", "on two ranks"]
            params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
            want = offline.generate(prompts, params, use_tqdm=False)
            for prompt, w in zip(prompts, want):
                assert c.generate(prompt, params).token_ids == w.token_ids
        d.stop()
        d.assert_gone()
    finally:
        d.kill()


TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]


def test_serve_under_torchrun(tiny_model, offline):
    """torchrun starts both ranks; rank 0 becomes the daemon, rank 1 a worker."""
    rd = short_tmpdir()
    log = open(Path(rd) / "torchrun.log", "wb")
    proc = subprocess.Popen(TORCHRUN + ["-m", "tpserve", "serve", "--model", str(tiny_model), "--tp", "2",
                                        "--runtime-dir", rd, "--num-kv-blocks", str(NUM_KV_BLOCKS)],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 200
        while not Path(rd, "tpserve.ready").exists():
            assert proc.poll() is None, Path(rd, "torchrun.log").read_text()
            assert time.monotonic() < deadline
            time.sleep(0.1)
        tree = [proc.pid] + descendants(proc.pid)
        daemon_pid = read_ready(Path(rd))["pid"]
        assert daemon_pid in tree and len(tree) >= 3  # torchrun, rank 0, rank 1
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        want = offline.generate(["under torchrun"], params, use_tqdm=False)[0]
        with Client(runtime_dir=rd, timeout=120) as c:
            assert c.status()["tensor_parallel_size"] == 2
            assert c.generate("under torchrun", params).token_ids == want.token_ids
        out = run_cli("stop", "--runtime-dir", rd, "--timeout", 60)
        assert out.returncode == 0, out.stderr
        assert proc.wait(timeout=60) == 0, Path(rd, "torchrun.log").read_text()
        deadline = time.monotonic() + 10
        while any(pid_alive(p) for p in tree):
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert shm_segments_of(tree) == []
    finally:
        log.close()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        shutil.rmtree(rd, ignore_errors=True)


HUNG_DAEMON = textwrap.dedent("""
    import subprocess, sys
    sys.path.insert(0, {tests!r})
    from test_daemon import FakeEngine
    from tpserve.config import EngineConfig
    from tpserve.server.daemon import run_daemon
    from tpserve.server.server import ServerOptions

    class HungEngine(FakeEngine):
        def __init__(self):
            super().__init__(shutdown_delay=600)  # shutdown never finishes
            self.worker = subprocess.Popen(["sleep", "600"])  # stands in for a worker process

    sys.exit(run_daemon(EngineConfig(), None, {rd!r}, ServerOptions(), engine_factory=lambda cfg: HungEngine()))
""")


def test_stop_escalates_to_killing_the_whole_tree():
    rd = short_tmpdir()
    proc = subprocess.Popen([sys.executable, "-c", HUNG_DAEMON.format(tests=str(Path(__file__).parent), rd=rd)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while (read_ready(Path(rd)) or {}).get("pid") != proc.pid:
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        tree = [proc.pid] + descendants(proc.pid)
        assert len(tree) == 2
        out = run_cli("stop", "--runtime-dir", rd, "--timeout", 1)
        assert out.returncode == 0, out.stderr
        assert "did not exit within 1 s; killing" in out.stderr
        assert proc.wait(timeout=10) == -signal.SIGKILL
        deadline = time.monotonic() + 10
        while any(pid_alive(p) for p in tree):
            assert time.monotonic() < deadline, "a worker survived"
            time.sleep(0.05)
        assert not Path(rd, "tpserve.pid").exists() and not Path(rd, "tpserve.sock").exists()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        shutil.rmtree(rd, ignore_errors=True)
