"""lazy_zeros: zero tensors whose pages are resident only once written (the KV pool's), or all
written at once (``prefault``, the engine's default: ``kv_cache_prefault``)."""
import gc
import mmap
import os

import torch

from model_factory import make_tiny_model
from tpserve.workers import zero_pages
from tpserve.workers.zero_pages import lazy_zeros


def _mapping_field(ptr: int, name: str) -> list[str] | None:
    """The values of field ``name`` (``Rss:``, ``VmFlags:``) of the mapping of this process that
    holds address ``ptr``; None if no mapping does."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= ptr < hi
            elif inside and line.startswith(name):
                return line.split()[1:]
    return None


def _mapping_rss_kib(ptr: int) -> int | None:
    """Rss (KiB) of the mapping of this process that holds address ``ptr``; None if none does."""
    rss = _mapping_field(ptr, "Rss:")
    return None if rss is None else int(rss[0])


def test_lazy_zeros_is_zeros_of_the_shape_and_dtype():
    for dtype in (torch.bfloat16, torch.int8, torch.float32):
        t = lazy_zeros((3, 16, 2, 8), dtype)
        assert t.shape == (3, 16, 2, 8) and t.dtype == dtype and t.is_contiguous()
        assert torch.equal(t, torch.zeros(3, 16, 2, 8, dtype=dtype))
        t[1, 2] = 5
        assert int(t.sum()) == 5 * 2 * 8


def test_lazy_zeros_pages_resident_only_once_written():
    t = lazy_zeros((64, 1 << 20), torch.int8)  # 64 MiB, a mapping of its own
    ptr = t.data_ptr()
    assert ptr % 4096 == 0
    assert _mapping_rss_kib(ptr) == 0
    t[:4].fill_(1)  # 4 MiB written
    assert 4096 <= _mapping_rss_kib(ptr) < 8192
    view = t[2:3]
    del t
    gc.collect()
    assert int(view.sum()) == 1 << 20  # a view keeps the mapping
    del view
    gc.collect()
    assert _mapping_rss_kib(ptr) is None  # unmapped with the last view


def test_lazy_zeros_asks_for_huge_pages():
    """The pool's mapping is advised for 2 MB pages (smaps flag ``hg``) where the kernel has
    transparent huge pages; the values are zeros all the same."""
    t = lazy_zeros((8, 1 << 20), torch.int8)
    flags = _mapping_field(t.data_ptr(), "VmFlags:")
    assert flags is not None
    if hasattr(mmap, "MADV_HUGEPAGE") and os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled"):
        assert "hg" in flags, flags
    assert int(t.abs().sum()) == 0


def test_lazy_zeros_empty_and_scalar_shapes():
    assert lazy_zeros((0, 4), torch.float32).shape == (0, 4)
    assert float(lazy_zeros((), torch.float32)) == 0.0


def test_prefault_makes_every_page_resident(monkeypatch):
    """``prefault`` populates the whole mapping now (MADV_POPULATE_WRITE; where the kernel lacks
    it, a zero written to every page): resident in full, and zeros all the same."""
    for populate in (True, False):
        if not populate:  # an advice the kernel refuses (EINVAL): the fallback's writes
            monkeypatch.setattr(zero_pages, "_MADV_POPULATE_WRITE", 9999)
        t = lazy_zeros((16, 1 << 20), torch.int8, prefault=True)  # 16 MiB
        assert _mapping_rss_kib(t.data_ptr()) >= 16 << 10, populate
        assert int(t.abs().sum()) == 0
        t[3, 7] = 2
        assert int(t.sum()) == 2


def test_the_engine_pool_is_written_at_start_unless_told_not_to(tmp_path):
    """The model runner's pool: resident from the start by default, untouched with
    ``kv_cache_prefault=False`` (the blocks one short prompt writes aside)."""
    from tpserve.config import EngineConfig
    from tpserve.models.parallel import TPContext
    from tpserve.workers.model_runner import ModelRunner
    path = make_tiny_model(tmp_path)
    for prefault in (False, True):
        config = EngineConfig(model=str(path), dtype="float32", num_kv_blocks=16384, block_size=16,
                              kv_cache_prefault=prefault)
        runner = ModelRunner(config, TPContext())
        k = runner.kv_caches[0][0]
        # KiB of the mapping k lies in (with its neighbours: adjacent mappings merge)
        size = int(_mapping_field(k.data_ptr(), "Size:")[0])
        assert size >= k.numel() * k.element_size() >> 10
        rss = _mapping_rss_kib(k.data_ptr())
        if prefault:
            assert rss == size
        else:
            assert rss < size // 4
        del runner, k
        gc.collect()  # unmapped: the next runner's mappings do not merge with these
