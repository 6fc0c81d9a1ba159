"""Building and loading tpserve's C++ CPU operators (``csrc/*.cpp``, ``csrc/*.h``).

The operators are compiled on first use with ``torch.utils.cpp_extension.load`` into a build
directory under ``$TPSERVE_CACHE_DIR`` (default ``~/.cache/tpserve``) named after a hash of the
source, the torch version, the compiler flags and the CPU's instruction-set flags, so a build is
reused across runs and never mixed up with another machine's or another version's.
``make install`` runs ``python -m tpserve.kernels.cpu_extension`` so that a fresh machine builds
them during setup rather than during its first request.

The operators are registered as ``torch.ops.tpserve_cpu.*``. A machine that cannot build them
(no compiler, a failed build) runs the plain-torch code instead, after one logged warning;
``TPSERVE_CPU_OPS=0`` forces that fallback (the reference path, and a way to compare the two).
``TPSERVE_CPU_ARCH`` replaces ``native`` in ``-march`` (e.g. ``haswell`` for an AVX2-only build,
to measure or ship for a smaller instruction set than the build machine's).
"""
from __future__ import annotations

import hashlib
import logging
import os
import shutil
import sys
import threading
from pathlib import Path

import torch

log = logging.getLogger("tpserve.kernels")

CSRC = Path(__file__).resolve().parent / "csrc"
# Translation units: attention and element-wise ops; the packed linear layers.
SOURCES = tuple(CSRC / name for name in ("cpu_ops.cpp", "linear_ops.cpp"))
# -march=native: the build is per machine anyway (its directory is keyed by the CPU's flags),
# and it lets the compiler use AVX-512 / AVX2 and FMA in the attention loops.
# -fno-trapping-math: nothing here reads floating-point exception flags, and without it gcc
# keeps the exp / select loops scalar (measured 8x slower SiLU-and-mul).
# -fopenmp at compile time only: at::parallel_for's inline OpenMP implementation needs it (without
# it the operators run on one thread). Not at link time: the GOMP symbols then resolve to the
# OpenMP runtime torch already loaded; linking the system's libgomp as a second runtime made
# tensor-parallel ranks abort at exit ("terminate called without an active exception").
def cflags() -> list[str]:
    arch = os.environ.get("TPSERVE_CPU_ARCH") or "native"
    return ["-O3", f"-march={arch}", "-fno-trapping-math", "-fopenmp"]


_lock = threading.Lock()
_state: dict[str, object] = {}


def cache_dir() -> Path:
    return Path(os.environ.get("TPSERVE_CACHE_DIR") or Path.home() / ".cache" / "tpserve")


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return line
    except OSError:
        pass
    return ""


def build_name() -> str:
    """The extension's name: changes whenever the source, torch, the flags or the CPU change."""
    h = hashlib.sha256()
    sources = [p.read_bytes() for p in sorted(CSRC.glob("*.cpp")) + sorted(CSRC.glob("*.h"))]
    for part in (*sources, torch.__version__.encode(), " ".join(cflags()).encode(),
                 _cpu_flags().encode(), sys.version.encode()):
        h.update(part)
    return f"tpserve_cpu_{h.hexdigest()[:16]}"


def _build() -> None:
    from torch.utils.cpp_extension import load

    name = build_name()
    build_dir = cache_dir() / "torch_extensions" / name
    build_dir.mkdir(parents=True, exist_ok=True)
    # torch runs `ninja` from PATH; the ninja pip package puts it next to this interpreter,
    # which is not on PATH when the virtualenv was not activated (.venv/bin/python ...).
    path = os.environ.get("PATH", "")
    bin_dir = str(Path(sys.executable).parent)
    if shutil.which("ninja") is None and bin_dir not in path.split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + path
    try:
        load(name=name, sources=[str(p) for p in SOURCES], extra_cflags=cflags(),
             build_directory=str(build_dir), is_python_module=False, verbose=False)
    finally:
        os.environ["PATH"] = path


def available() -> bool:
    """Whether ``torch.ops.tpserve_cpu`` is usable; builds/loads it on the first call.

    Never raises: a failed build logs one warning and returns False from then on.
    """
    if "ok" in _state:
        return bool(_state["ok"])
    with _lock:
        if "ok" not in _state:
            if os.environ.get("TPSERVE_CPU_OPS", "1") == "0":
                _state["ok"] = False
            else:
                try:
                    _build()
                    _state["ok"] = True
                except Exception as e:  # no compiler, no ninja, a compile error: fall back
                    _state["ok"] = False
                    _state["error"] = f"{type(e).__name__}: {e}"
                    last_line = (str(e).strip().splitlines() or [type(e).__name__])[-1]
                    log.warning("tpserve's C++ CPU operators are unavailable (%s); using the "
                                "slower plain-torch CPU path (`python -m "
                                "tpserve.kernels.cpu_extension` shows the build log)", last_line)
    return bool(_state["ok"])


def ops():
    """``torch.ops.tpserve_cpu`` (call ``available()`` first)."""
    return torch.ops.tpserve_cpu


_OP_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def ops_for(t: torch.Tensor):
    """``torch.ops.tpserve_cpu`` if its operators can take ``t`` (a CPU tensor of a dtype they
    handle, and the operators built), else None: the caller then runs its plain-torch code."""
    if t.device.type != "cpu" or t.dtype not in _OP_DTYPES or not available():
        return None
    return torch.ops.tpserve_cpu


def main() -> int:
    """Build the operators now (``make install``); exit status 0 even without a compiler."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if available():
        print(f"tpserve CPU operators ready ({build_name()}, cache {cache_dir()})")
    else:
        print(f"tpserve CPU operators not built ({_state.get('error', 'disabled')}); "
              "the plain-torch CPU path will be used")
    return 0


if __name__ == "__main__":
    sys.exit(main())
