"""A CPU engine without tpserve's C++ operators says so, with the reason: ``cpu_extension.status()``,
the engine's stats (the daemon's status map), ``/metrics`` and the daemon's start log.

The failures are real ones: a package whose ``csrc`` lacks the headers its sources include (what a
wheel without ``*.h`` did), and a daemon whose compiler does not run (``CXX=/bin/false``), each
with a fresh build cache so that no earlier build is found."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from tpserve.kernels import cpu_extension
from tpserve.server.metrics import ServingMetrics

ROOT = Path(__file__).resolve().parents[1]
BUNDLED = ROOT / "tpserve" / "assets" / "default-model"


def samples(text: str, name: str) -> list:
    return [s for fam in text_string_to_metric_families(text) for s in fam.samples if s.name == name]


def test_the_operators_of_this_checkout_are_loaded():
    assert cpu_extension.available(), cpu_extension._state.get("error")
    assert cpu_extension.status() == {"cpu_ops": "loaded"}


def test_nothing_asked_for_them_yet_is_unused(monkeypatch):
    monkeypatch.setattr(cpu_extension, "_state", {})
    assert cpu_extension.status() == {"cpu_ops": "unused"}


def test_the_env_switch_is_reported_as_disabled(monkeypatch):
    monkeypatch.setattr(cpu_extension, "_state", {})
    monkeypatch.setenv("TPSERVE_CPU_OPS", "0")
    assert not cpu_extension.available()
    status = cpu_extension.status()
    assert status["cpu_ops"] == "disabled" and "TPSERVE_CPU_OPS=0" in status["cpu_ops_reason"]


def test_sources_without_their_headers_report_the_compilers_error(monkeypatch, tmp_path, caplog):
    headers = [h.name for h in cpu_extension.CSRC.glob("*.h")]
    assert "vec.h" in headers
    csrc = tmp_path / "csrc"
    csrc.mkdir()
    for f in cpu_extension.SOURCES:  # the translation units, none of the headers they include
        shutil.copy2(f, csrc / f.name)
    monkeypatch.setattr(cpu_extension, "CSRC", csrc)
    monkeypatch.setattr(cpu_extension, "SOURCES", tuple(csrc / f.name for f in cpu_extension.SOURCES))
    monkeypatch.setenv("TPSERVE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(cpu_extension, "_state", {})
    with caplog.at_level("WARNING", logger="tpserve.kernels"):
        assert not cpu_extension.available()
    status = cpu_extension.status()
    assert status["cpu_ops"] == "unavailable", status
    reason = status["cpu_ops_reason"]
    assert any(h in reason for h in headers) and "No such file" in reason, reason
    assert "\n" not in reason and len(reason) <= cpu_extension.MAX_REASON_CHARS
    assert any(reason in r.getMessage() for r in caplog.records)
    assert not list((tmp_path / "cache" / "cpu_ops").glob("*.so"))  # nothing published


def test_failure_reason_picks_the_compilers_error_line():
    compiler = "a.cpp:29:10: fatal error: vec.h: No such file or directory"
    e = RuntimeError(f"Error building extension 'x': [1/3] c++ -c a.cpp\nFAILED: a.o\n{compiler}\n"
                     "   29 | #include \"vec.h\"\ncompilation terminated.\n"
                     "ninja: build stopped: subcommand failed.")
    assert cpu_extension.failure_reason(e) == f"RuntimeError: {compiler}"
    assert cpu_extension.failure_reason(OSError("no ninja\nninja: not found")) == "OSError: ninja: not found"
    long = cpu_extension.failure_reason(RuntimeError("x" * 1000))
    assert len(long) == cpu_extension.MAX_REASON_CHARS and long.endswith("...")


def test_metrics_show_the_state_and_the_reason():
    reason = 'RuntimeError: a.cpp:29:10: fatal error: "vec.h": No such file or directory'
    text = ServingMetrics("m", lambda: {"cpu_ops": "unavailable", "cpu_ops_reason": reason}).render()
    (loaded,) = samples(text, "tpserve:cpu_ops_loaded")
    assert loaded.value == 0.0 and loaded.labels == {"model_name": "m"}
    (info,) = samples(text, "tpserve:cpu_ops_info")
    assert info.value == 1.0 and info.labels == {"model_name": "m", "state": "unavailable", "reason": reason}

    text = ServingMetrics("m", lambda: {"cpu_ops": "loaded"}).render()
    assert [s.value for s in samples(text, "tpserve:cpu_ops_loaded")] == [1.0]
    assert [s.labels["state"] for s in samples(text, "tpserve:cpu_ops_info")] == ["loaded"]

    # On an accelerator: nothing to alert on.
    text = ServingMetrics("m", lambda: {"cpu_ops": "unused"}).render()
    assert samples(text, "tpserve:cpu_ops_loaded") == []
    assert [s.labels["state"] for s in samples(text, "tpserve:cpu_ops_info")] == ["unused"]


def test_an_engine_without_the_operators_serves_and_says_why(monkeypatch):
    from tpserve import LLM
    from tpserve.sampling import SamplingParams

    reason = "RuntimeError: a.cpp: fatal error: vec.h: missing"
    monkeypatch.setattr(cpu_extension, "_state", {"ok": False, "error": "RuntimeError: boom",
                                                  "reason": reason})
    llm = LLM(str(BUNDLED), num_kv_blocks=32, dtype="float32")
    try:
        out = llm.generate(["def f(x):"], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
                           use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 4
        stats = llm.engine.stats()
        assert stats["cpu_ops"] == "unavailable"
        assert stats["cpu_ops_reason"] == reason
    finally:
        llm.shutdown()


def test_a_daemon_without_a_compiler_says_so_in_status_metrics_and_its_start_log():
    rd = tempfile.mkdtemp(prefix="tpo-", dir="/tmp")  # short: ipc socket paths are limited
    cache = tempfile.mkdtemp(prefix="tpserve-cache-")
    env = dict(os.environ, CXX="/bin/false", TPSERVE_CACHE_DIR=cache)
    env.pop("TPSERVE_CPU_OPS", None)
    cli = [sys.executable, "-m", "tpserve"]

    def run(*args, timeout=120):
        return subprocess.run(cli + [str(a) for a in args] + ["--runtime-dir", rd], capture_output=True,
                              text=True, timeout=timeout, env=env)
    try:
        started = run("start", "--model", BUNDLED, "--num-kv-blocks", 32, "--startup-timeout", 200,
                      timeout=240)
        assert started.returncode == 0, started.stderr + started.stdout
        status = run("status")
        assert status.returncode == 0, status.stderr
        lines = {line[2:20].strip(): line[20:].strip() for line in status.stdout.splitlines()[1:]}
        assert lines["CPU operators"] == "unavailable"
        assert "C++ CPU operators not loaded" in lines["WARNING"] and "--version" in lines["WARNING"]
        raw = json.loads(run("status", "--json").stdout)
        assert raw["cpu_ops"] == "unavailable" and "--version" in raw["cpu_ops_reason"]
        metrics = run("status", "--metrics").stdout
        assert [s.value for s in samples(metrics, "tpserve:cpu_ops_loaded")] == [0.0]
        (info,) = samples(metrics, "tpserve:cpu_ops_info")
        assert info.labels["state"] == "unavailable" and info.labels["reason"] == raw["cpu_ops_reason"]
        log = Path(rd, "tpserve.log").read_text()
        block = [line for line in log.splitlines() if "WARNING" in line]
        headline = "C++ CPU operators are UNAVAILABLE: " + raw["cpu_ops_reason"]
        assert any(headline in line for line in block), log
        assert any("plain-torch CPU path instead" in line for line in block), log
        assert log.index("operators are UNAVAILABLE") < log.index("tpserve ready")
    finally:
        stopped = run("stop", "--timeout", 60)
        shutil.rmtree(cache, ignore_errors=True)
        shutil.rmtree(rd, ignore_errors=True)
    assert stopped.returncode == 0, stopped.stderr
