"""Process-group tear-down: ``destroy_tp`` frees the group while the interpreter is alive.

A group that outlives ``destroy_process_group`` keeps its gloo worker threads, and a worker
thread that drops the last collective's tensors during interpreter finalization aborts the
process (SIGABRT, "terminate called without an active exception"). The reference that kept it
alive was a default argument of ``torch.distributed.nn.functional`` bound when that module was
imported after the group existed; these tests import it exactly then.
"""
from __future__ import annotations

import importlib
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tpserve.workers.process_group import destroy_tp, init_tp


def _thread_names() -> list[str]:
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except OSError:  # the thread ended meanwhile
            pass
    return names


def _rank(rank: int, store: str, via_init_tp: bool, out_dir: str) -> None:
    if via_init_tp:
        init_tp(rank, 2, f"file://{store}")
    else:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    # Import (again) the module that binds the default group into its defaults, now.
    sys.modules.pop("torch.distributed.nn.functional", None)
    importlib.import_module("torch.distributed.nn.functional")
    parts = [torch.zeros(1, 2) for _ in range(2)]
    dist.all_gather(parts, torch.tensor([[rank, 10.0 + rank]]))
    dist.barrier()
    destroy_tp()
    gloo = [n for n in _thread_names() if "gloo" in n]
    with open(os.path.join(out_dir, f"rank{rank}"), "w") as f:
        f.write(",".join(gloo))
    # Leave the way the failure needed: through interpreter finalization.


def _run(tmp_path, via_init_tp: bool) -> list[str]:
    ctx = mp.spawn(_rank, args=(str(tmp_path / "store"), via_init_tp, str(tmp_path)), nprocs=2, join=False)
    for p in ctx.processes:
        p.join(timeout=120)
    codes = [p.exitcode for p in ctx.processes]
    for p in ctx.processes:
        if p.is_alive():
            p.kill()
    assert codes == [0, 0]
    return [(tmp_path / f"rank{r}").read_text() for r in range(2)]


def test_destroy_tp_joins_gloo_threads_even_when_a_default_argument_held_the_group(tmp_path):
    assert _run(tmp_path, via_init_tp=False) == ["", ""]


def test_init_tp_and_destroy_tp_leave_no_gloo_thread(tmp_path):
    assert _run(tmp_path, via_init_tp=True) == ["", ""]
