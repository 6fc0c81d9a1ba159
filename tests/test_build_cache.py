"""The shared build cache of the C++ CPU operators: one build per key, shared across
environments whose inputs match, published atomically, never rewritten under a reader.

Builds here compile a tiny C++ file (no torch headers: well under a second), never the real
operators; "environments" are checkouts at different paths, as two virtualenvs' worktrees are.
"""
from __future__ import annotations

import os
import sys
import threading
import time

import pytest
import torch

from tpserve.kernels import build_cache, cpu_extension
from tpserve.kernels.build_cache import publish_once

TINY_SOURCE = 'extern "C" int tpserve_probe(void) { return 7; }\n'


@pytest.fixture
def compiles(monkeypatch, tmp_path):
    """A private cache directory; counts the compiles torch's ``load`` runs."""
    import torch.utils.cpp_extension as cpp

    monkeypatch.setenv("TPSERVE_CACHE_DIR", str(tmp_path / "cache"))
    calls = []
    real = cpp.load

    def counting(*args, **kw):
        calls.append(kw.get("build_directory"))
        return real(*args, **kw)

    monkeypatch.setattr(cpp, "load", counting)
    return calls


def _checkout(root, name):
    src = root / name / "csrc" / "cpu_ops.cpp"
    src.parent.mkdir(parents=True)
    src.write_text(TINY_SOURCE)
    return src


def test_two_environments_with_the_same_inputs_share_one_build(compiles, tmp_path, monkeypatch):
    monkeypatch.setattr(cpu_extension, "SOURCES", (_checkout(tmp_path, "venv-a"),))
    first = cpu_extension._build()
    # Another checkout (another virtualenv's worktree): the same source text at another path.
    monkeypatch.setattr(cpu_extension, "SOURCES", (_checkout(tmp_path, "venv-b"),))
    second = cpu_extension._build()
    monkeypatch.setattr(cpu_extension, "SOURCES", (tmp_path / "venv-a" / "csrc" / "cpu_ops.cpp",))
    third = cpu_extension._build()
    assert len(compiles) == 1, compiles  # each start after the first loads the shared file
    assert first == second == third and first.parent == cpu_extension.library_dir()
    assert first.name == cpu_extension.build_name() + ".so"
    log = (cpu_extension.library_dir() / "build.log").read_text().splitlines()
    assert len(log) == 1 and cpu_extension.build_name() in log[0]
    # Nothing left of the build but the library, its lock and the log.
    assert sorted(p.name for p in first.parent.iterdir()) == sorted(
        [first.name, first.name + ".lock", "build.log"])


def test_a_different_input_gets_its_own_build_and_keeps_the_other(compiles, tmp_path, monkeypatch):
    monkeypatch.setattr(cpu_extension, "SOURCES", (_checkout(tmp_path, "venv-a"),))
    native = cpu_extension._build()
    monkeypatch.setenv("TPSERVE_CPU_ARCH", "x86-64")  # an environment building for another ISA
    other = cpu_extension._build()
    monkeypatch.delenv("TPSERVE_CPU_ARCH")
    assert cpu_extension._build() == native
    assert other != native and native.exists() and other.exists() and len(compiles) == 2


def test_the_key_holds_every_binary_input_and_no_path(monkeypatch, tmp_path):
    inputs = cpu_extension.build_inputs()
    assert set(inputs) == {"source", "torch", "torch_cxx11_abi", "python_abi", "compiler",
                           "cflags", "cpu"}
    assert torch.version.git_version in inputs["torch"]
    assert "-march=native" in inputs["cflags"] and inputs["cpu"].startswith("flags")
    text = " ".join(inputs.values())
    for path in (str(cpu_extension.SOURCES[0].parent), sys.prefix, sys.executable):
        assert path not in text
    name = cpu_extension.build_name(inputs)
    for key in inputs:
        assert cpu_extension.build_name(dict(inputs, **{key: inputs[key] + "x"})) != name, key
    monkeypatch.setenv("TPSERVE_CPU_ARCH", "haswell")
    arch = cpu_extension.build_inputs()
    assert "-march=haswell" in arch["cflags"] and arch["cpu"] == ""  # not tied to this CPU


def test_concurrent_builders_build_once(tmp_path):
    built = []

    def build(tmp):
        built.append(tmp)
        time.sleep(0.3)  # the other builder arrives while this one works
        (tmp / "lib.so").write_bytes(b"library")
        return tmp / "lib.so"

    results = []
    threads = [threading.Thread(target=lambda: results.append(publish_once(tmp_path, "x.so", build)))
               for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(built) == 1
    assert sorted(r[1] for r in results) == [False, False, True]
    assert {r[0] for r in results} == {tmp_path / "x.so"}
    assert (tmp_path / "x.so").read_bytes() == b"library"


def test_a_rebuild_never_rewrites_the_file_a_reader_holds(tmp_path):
    def build_with(data):
        def build(tmp):
            (tmp / "lib.so").write_bytes(data)
            return tmp / "lib.so"
        return build

    path, _ = publish_once(tmp_path, "x.so", build_with(b"old build"))
    with open(path, "rb") as reader:  # a process that has the library loaded
        publish_once(tmp_path, "x.so", build_with(b"new build"), force=True)
        assert reader.read() == b"old build"
    assert path.read_bytes() == b"new build"


def test_a_failed_build_publishes_nothing_and_frees_the_lock(tmp_path):
    def broken(tmp):
        (tmp / "half.so").write_bytes(b"half")
        raise RuntimeError("compiler died")

    with pytest.raises(RuntimeError, match="compiler died"):
        publish_once(tmp_path, "x.so", broken)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.so.lock"]

    def good(tmp):
        (tmp / "lib.so").write_bytes(b"ok")
        return tmp / "lib.so"

    assert publish_once(tmp_path, "x.so", good, lock_timeout_s=1.0) == (tmp_path / "x.so", True)


def test_a_builder_waits_for_the_lock_then_builds_anyway(tmp_path, caplog):
    def good(tmp):
        (tmp / "lib.so").write_bytes(b"ok")
        return tmp / "lib.so"

    with build_cache.file_lock(tmp_path / "x.so.lock", 1.0) as held:
        assert held
        path, built = publish_once(tmp_path, "x.so", good, lock_timeout_s=0.2)
    assert built and path.read_bytes() == b"ok"
    assert "held its lock" in caplog.text
