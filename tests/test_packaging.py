"""tpserve as an installed package: the sdist and the wheel built from it carry every source the
C++ CPU operators compile from (each file a C++ source ``#include "..."``s), and the Makefile and
scripts name no fixed absolute path outside the checkout.

The wheel is built offline from a copy of the sources (``pip wheel --no-deps
--no-build-isolation`` on the sdist, as ``python -m build`` does), so nothing is written into the
checkout. ``scripts/check_wheel_install.sh`` goes further: it installs such a wheel into a fresh
virtualenv and generates with the operators compiled from the installed files.
"""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path, PurePosixPath

import pytest

ROOT = Path(__file__).resolve().parents[1]
CPP_SUFFIXES = {".c", ".cc", ".cpp", ".cxx", ".h", ".hh", ".hpp", ".cu", ".cuh"}
INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.MULTILINE)
METADATA_FILES = ("pyproject.toml", "setup.cfg", "MANIFEST.in", "README.md")


def cpp_files() -> list[Path]:
    return sorted(p for p in (ROOT / "tpserve").rglob("*") if p.suffix in CPP_SUFFIXES and p.is_file())


def quoted_includes() -> dict[str, set[str]]:
    """``{included file: {files that include it}}``, paths relative to the checkout."""
    found: dict[str, set[str]] = {}
    for src in cpp_files():
        for name in INCLUDE.findall(src.read_text()):
            target = (src.parent / name).resolve()
            found.setdefault(target.relative_to(ROOT).as_posix(), set()).add(src.relative_to(ROOT).as_posix())
    return found


@pytest.fixture(scope="module")
def dists(tmp_path_factory) -> dict[str, set[str]]:
    """The sdist's and the wheel's file lists (paths inside the package tree, ``tpserve/...``), and
    the modules of the copy they were built from."""
    tmp = tmp_path_factory.mktemp("dist")
    src, out = tmp / "src", tmp / "out"
    shutil.copytree(ROOT / "tpserve", src / "tpserve",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.so", "*.egg-info"))
    for name in METADATA_FILES:
        shutil.copy2(ROOT / name, src / name)
    out.mkdir()
    run = dict(capture_output=True, text=True, timeout=240)
    sdist = subprocess.run([sys.executable, "-c", "import sys; from setuptools import build_meta as b; "
                            "print(b.build_sdist(sys.argv[1]))", str(out)], cwd=src, **run)
    assert sdist.returncode == 0, sdist.stderr[-4000:]
    (sdist_path,) = out.glob("tpserve-*.tar.gz")
    wheel = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                            "--no-index", "-w", str(out), str(sdist_path)], cwd=tmp, **run)
    assert wheel.returncode == 0, wheel.stdout[-2000:] + wheel.stderr[-4000:]
    (wheel_path,) = out.glob("tpserve-*.whl")
    with tarfile.open(sdist_path) as t:  # members are tpserve-<version>/<path>
        sdist_files = {PurePosixPath(*PurePosixPath(m.name).parts[1:]).as_posix() for m in t.getmembers()
                       if m.isfile()}
    with zipfile.ZipFile(wheel_path) as z:
        wheel_files = set(z.namelist())
    copied = {p.relative_to(src).as_posix() for p in (src / "tpserve").rglob("*.py")}
    return {"sdist": sdist_files, "wheel": wheel_files, "copied_modules": copied}


def test_the_cpp_sources_include_headers_of_their_own():
    """The premise of the packaging check: the parse finds the project's quoted includes."""
    includes = quoted_includes()
    assert "tpserve/kernels/csrc/vec.h" in includes and "tpserve/kernels/csrc/linear_ops.h" in includes
    for header, users in includes.items():
        assert (ROOT / header).is_file(), f"{sorted(users)} include {header}, which does not exist"


@pytest.mark.parametrize("kind", ["sdist", "wheel"])
def test_the_distribution_carries_every_cpp_source_and_what_it_includes(dists, kind):
    files = dists[kind]
    assert "tpserve/__init__.py" in files and "tpserve/assets/default-model/model.safetensors" in files
    sources = {p.relative_to(ROOT).as_posix() for p in cpp_files()}
    missing_sources = sorted(sources - files)
    assert not missing_sources, f"the {kind} lacks C++ sources: {missing_sources}"
    missing = {h: sorted(users) for h, users in quoted_includes().items() if h not in files}
    assert not missing, f"the {kind} lacks files the C++ sources include: {missing}"
    from tpserve.kernels import cpu_extension  # the translation units it compiles, by name
    for f in cpu_extension.SOURCES:
        assert f.relative_to(ROOT).as_posix() in files


def test_the_wheel_has_the_command_and_no_stale_modules(dists):
    files = dists["wheel"]
    (entry_points,) = [f for f in files if f.endswith(".dist-info/entry_points.txt")]
    assert entry_points
    # Only modules of the sources: a build directory's leftovers (an old package layout) stay out.
    modules = {f for f in files if f.endswith(".py")}
    assert modules == dists["copied_modules"]


ABSOLUTE_WORK = re.compile(r"(?<![\w.$}])/work/")


def test_the_makefile_and_scripts_name_no_fixed_path_outside_the_checkout():
    """Peers install under the checkout (.peers/) or a user cache dir, never at /work/..."""
    files = [ROOT / "Makefile", ROOT / ".ci" / "run", *sorted((ROOT / "scripts").rglob("*"))]
    hits = []
    for f in files:
        if not f.is_file() or "__pycache__" in f.parts:
            continue
        for n, line in enumerate(f.read_text(errors="replace").splitlines(), 1):
            if ABSOLUTE_WORK.search(line):
                hits.append(f"{f.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not hits, "\n".join(hits)
    if (ROOT / ".git").exists() and shutil.which("git"):
        out = subprocess.run(["git", "grep", "-n", "/work/", "--", "Makefile", "scripts", ".ci"], cwd=ROOT,
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 1 and out.stdout == "", out.stdout  # 1: no match


def test_make_clean_removes_what_make_created():
    if shutil.which("make") is None:
        pytest.fail("make is not installed")
    out = subprocess.run(["make", "-n", "clean"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    removed = {Path(p).name for p in out.stdout.split()}  # .peers is given as $(CURDIR)/.peers
    for path in (".venv", ".peers", "build", "dist"):
        assert path in removed, f"make clean leaves {path}: {out.stdout}"
    ignored = (ROOT / ".gitignore").read_text().split()
    assert ".peers/" in ignored
