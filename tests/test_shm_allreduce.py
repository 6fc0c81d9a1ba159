"""The shared-memory all-reduce and gather of CPU tensor-parallel ranks on one machine
(workers/shm_allreduce.py): gloo's sums and parts exactly, every rank the same bits, what it
cannot take left to gloo, nothing left in /dev/shm, and a dead peer reported, not waited for."""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from test_models_tp import gloo_group, run_two_ranks
from tpserve.models.parallel import TPContext
from tpserve.workers.shm_allreduce import ShmAllReduce


def _sums_worker(rank: int, store: str, out_dir: str) -> None:
    with gloo_group(rank, store):
        shm = ShmAllReduce.join(rank, 2, slot_bytes=1 << 16)
        assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"tpserve-{os.getppid()}-")
                    or n.startswith(f"tpserve-{os.getpid()}-")]  # the name is gone once mapped
        g = torch.Generator().manual_seed(rank)
        results = []
        for i in range(40):  # both buffers, many times over, with sizes changing
            dtype = (torch.float32, torch.bfloat16)[i % 2]
            shape = ((i % 7) + 1, 64 * ((i % 3) + 1))
            x = torch.randn(*shape, generator=g).to(dtype)
            want = x.clone()
            dist.all_reduce(want)
            assert shm.all_reduce(x)
            assert torch.equal(x, want), (i, dtype, shape)
            results.append(x)
            for _ in range(i % 3):  # gathers between them, several in a row at times
                y = torch.randn(*shape, generator=g).to(dtype)
                parts = [torch.empty_like(y) for _ in range(2)] if rank == 0 else None
                dist.gather(y, parts, dst=0)
                taken, got = shm.gather(y)
                assert taken and (got is None) == (rank != 0)
                if rank == 0:
                    assert all(torch.equal(a, b) for a, b in zip(got, parts))
        big = torch.ones(1 << 15)  # 128 KiB: past a 64 KiB slot
        assert not shm.all_reduce(big) and torch.equal(big, torch.ones(1 << 15))
        assert not shm.all_reduce(torch.ones(8, 8).t())  # not contiguous
        tp = TPContext(rank=rank, size=2, shm=shm)  # the context sums through it, then gloo
        x = torch.full((4, 4), float(rank + 1))
        assert torch.equal(tp.all_reduce(x), torch.full((4, 4), 3.0))
        assert torch.equal(tp.all_reduce(big.clone()), torch.full((1 << 15,), 2.0))
        got = tp.gather_to_rank0(torch.full((2, 3), float(rank)), dim=0)
        assert got is None if rank else torch.equal(got, torch.cat([torch.zeros(2, 3), torch.ones(2, 3)]))
        got = tp.gather_to_rank0(big, dim=0)  # past a slot: gloo's
        assert got is None if rank else torch.equal(got, torch.cat([big, big]))
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.mark.timeout(120)
def test_shm_all_reduce_gives_gloos_sums_on_every_rank(tmp_path):
    run_two_ranks(_sums_worker, str(tmp_path), timeout=100)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    assert all(torch.equal(a, b) for a, b in zip(r0, r1))  # every rank the same bits


def _death_worker(rank: int, store: str, out_dir: str) -> None:
    with gloo_group(rank, store):
        shm = ShmAllReduce.join(rank, 2, slot_bytes=1 << 12)
        assert shm.all_reduce(torch.ones(4))
        if rank == 1:
            os._exit(0)  # gone without a word, as a SIGKILLed worker
        with pytest.raises(RuntimeError, match="rank 1 .* died"):
            shm.all_reduce(torch.ones(4))
        open(os.path.join(out_dir, "reported"), "w").close()
        os._exit(0)  # the group's peer is gone: skip its teardown


@pytest.mark.timeout(120)
def test_a_dead_peer_is_reported_not_waited_for(tmp_path):
    run_two_ranks(_death_worker, str(tmp_path), timeout=100)
    assert (tmp_path / "reported").exists()
