"""Building and loading tpserve's C++ CPU operators (``csrc/*.cpp``, ``csrc/*.h``).

The operators are compiled on first use with ``torch.utils.cpp_extension.load`` and published
as one shared library, ``$TPSERVE_CACHE_DIR/cpu_ops/tpserve_cpu_<key>.so`` (default cache
``~/.cache/tpserve``). The key hashes everything that changes the binary and nothing else
(``build_inputs``): the source, the torch build, its C++ ABI, the Python ABI, the compiler and
the flags (``TPSERVE_CPU_ARCH`` included; the CPU's flags too under ``-march=native``). So every
virtualenv and checkout with the same inputs shares one build, and any that differs gets its own
file instead of rebuilding another's. Builds go through ``build_cache.publish_once``: into a
temporary directory, then an atomic rename, under a lock, so a library another process has
loaded is never rewritten and concurrent first starts build once. Each build appends one line
to ``cpu_ops/build.log``. ``make install`` runs ``python -m tpserve.kernels.cpu_extension`` so
that a fresh machine builds them during setup rather than during its first request.

The operators are registered as ``torch.ops.tpserve_cpu.*``. A machine that cannot build them
(no compiler, a failed build, a package installed without its headers) runs the plain-torch code
instead, several times slower; ``TPSERVE_CPU_OPS=0`` forces that fallback (the reference path, and
a way to compare the two). ``status()`` says which, and why, without building: the engine puts
it in its stats, so the daemon's status map (``cpu_ops``, ``cpu_ops_reason``), ``/metrics``
(``tpserve:cpu_ops_loaded``, ``tpserve:cpu_ops_info``) and its start log (a WARNING block) show
a daemon running without them.
``TPSERVE_CPU_ARCH`` replaces ``native`` in ``-march`` (e.g. ``haswell`` for an AVX2-only build,
to measure or ship for a smaller instruction set than the build machine's).
"""
from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import sys
import sysconfig
import threading
import time
from pathlib import Path

import torch

from tpserve.kernels.build_cache import publish_once

log = logging.getLogger("tpserve.kernels")

CSRC = Path(__file__).resolve().parent / "csrc"
# Translation units: attention and element-wise ops; the sampler's ops; the packed linear layers;
# the grouped experts of mixture-of-experts layers; the group-quantized (4/8-bit) linear layers and
# the rows read back from their packs.
SOURCES = tuple(CSRC / name for name in ("cpu_ops.cpp", "sampling_ops.cpp", "linear_ops.cpp", "moe_ops.cpp",
                                         "prompt_bf16.cpp", "quant_ops.cpp", "quant_rows.cpp",
                                         "gemma_ops.cpp"))
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
# "ok": whether the operators are usable (absent until the first available()); "error": the whole
# failure; "reason": one line of it (or why they are off).
_state: dict[str, object] = {}
MAX_REASON_CHARS = 300


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


def _compiler_identity() -> str:
    """The C++ compiler torch's build will run (``$CXX`` or ``c++``) and its version line."""
    cxx = os.environ.get("CXX") or "c++"
    try:
        out = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30)
        version = (out.stdout.strip().splitlines() or [""])[0]
    except (OSError, subprocess.SubprocessError):
        version = "unknown"
    return f"{cxx}: {version}"


def build_inputs() -> dict[str, str]:
    """Everything the built library depends on, by name. Paths are left out on purpose: two
    virtualenvs or checkouts with the same inputs build the same binary and share it."""
    flags = cflags()
    return {
        # The translation units and the headers they include (csrc/*.h).
        "source": hashlib.sha256(b"".join(f.read_bytes() for f in (*SOURCES, *sorted(CSRC.glob("*.h")))
                                          )).hexdigest(),
        "torch": f"{torch.__version__} {torch.version.git_version}",
        "torch_cxx11_abi": str(torch._C._GLIBCXX_USE_CXX11_ABI),
        "python_abi": str(sysconfig.get_config_var("SOABI") or sys.implementation.cache_tag),
        "compiler": _compiler_identity(),
        "cflags": " ".join(flags),
        # Only a native build depends on this machine's instruction set.
        "cpu": _cpu_flags() if "-march=native" in flags else "",
    }


def build_name(inputs: dict[str, str] | None = None) -> str:
    """The library's name: a hash of ``build_inputs()``."""
    inputs = build_inputs() if inputs is None else inputs
    h = hashlib.sha256("\n".join(f"{k}={v}" for k, v in sorted(inputs.items())).encode())
    return f"tpserve_cpu_{h.hexdigest()[:16]}"


def library_dir() -> Path:
    return cache_dir() / "cpu_ops"


def _compile(name: str, tmp: Path) -> Path:
    """Build the library in the empty directory ``tmp`` (which also loads it); its path."""
    from torch.utils.cpp_extension import load

    # torch runs `ninja` from PATH; the ninja pip package puts it next to this interpreter,
    # which is not on PATH when the virtualenv was not activated (.venv/bin/python ...).
    path = os.environ.get("PATH", "")
    bin_dir = str(Path(sys.executable).parent)
    if shutil.which("ninja") is None and bin_dir not in path.split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + path
    try:
        load(name=name, sources=[str(f) for f in SOURCES], extra_cflags=cflags(), build_directory=str(tmp),
             is_python_module=False, verbose=False)
    finally:
        os.environ["PATH"] = path
    # torch appends _v<N> to a name it already built in this process.
    (lib,) = sorted(tmp.glob(f"{name}*.so"))
    return lib


def failure_reason(e: BaseException) -> str:
    """One line that says why a build failed: the compiler's first error line (``fatal error:
    vec.h: No such file or directory``) when its output is in the message, else the message's
    last line."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    errors = [line for line in lines if "error:" in line]
    line = errors[0] if errors else (lines[-1] if lines else "")
    reason = f"{type(e).__name__}: {line}" if line else type(e).__name__
    return reason if len(reason) <= MAX_REASON_CHARS else reason[:MAX_REASON_CHARS - 3] + "..."


def _build() -> Path:
    """Load the library, building and publishing it first if this key has no build yet."""
    name = build_name()
    t0 = time.monotonic()
    path, built = publish_once(library_dir(), f"{name}.so", lambda tmp: _compile(name, tmp))
    if not built:
        try:
            torch.ops.load_library(str(path))
            return path
        except OSError as e:  # a file the key did not tell apart (or a foreign one): replace it
            log.warning("%s does not load (%s); rebuilding it", path, e)
            path, built = publish_once(library_dir(), f"{name}.so",
                                       lambda tmp: _compile(name, tmp), force=True)
    with open(library_dir() / "build.log", "a") as f:
        f.write(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} built {name} in "
                f"{time.monotonic() - t0:.1f} s for {sys.executable} (pid {os.getpid()})\n")
    return path


def available() -> bool:
    """Whether ``torch.ops.tpserve_cpu`` is usable; builds/loads it on the first call.

    Never raises: a failed build logs one warning and returns False from then on.
    """
    if "ok" in _state:
        return bool(_state["ok"])
    with _lock:
        if "ok" not in _state:
            if os.environ.get("TPSERVE_CPU_OPS", "1") == "0":
                _state.update(ok=False, reason="disabled by TPSERVE_CPU_OPS=0")
            else:
                try:
                    _build()
                    _state["ok"] = True
                except Exception as e:  # no compiler, no ninja, a compile error: fall back
                    _state["ok"] = False
                    _state["error"] = f"{type(e).__name__}: {e}"
                    _state["reason"] = failure_reason(e)
                    log.warning("tpserve's C++ CPU operators are unavailable (%s); using the "
                                "slower plain-torch CPU path (`python -m "
                                "tpserve.kernels.cpu_extension` shows the build log)", _state["reason"])
    return bool(_state["ok"])


def status() -> dict[str, str]:
    """The operators' state, for the status map and the metrics; never builds or loads them.

    ``cpu_ops`` is ``loaded``; ``unavailable`` (a build or load failed: the plain-torch path
    runs, and ``cpu_ops_reason`` says why); ``disabled`` (``TPSERVE_CPU_OPS=0``; a reason too);
    or ``unused`` (nothing asked for them in this process: its model runs on an accelerator)."""
    if "ok" not in _state:
        return {"cpu_ops": "unused"}
    if _state["ok"]:
        return {"cpu_ops": "loaded"}
    state = "unavailable" if "error" in _state else "disabled"
    return {"cpu_ops": state, "cpu_ops_reason": str(_state.get("reason", ""))}


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
        print(f"tpserve CPU operators ready ({library_dir() / build_name()}.so)")
    else:
        print(f"tpserve CPU operators not built ({_state.get('error') or _state.get('reason')}); "
              "the plain-torch CPU path will be used")
    return 0


if __name__ == "__main__":
    sys.exit(main())
