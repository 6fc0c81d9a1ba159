"""lazy_zeros: zero tensors whose pages are resident only once written (the KV pool's)."""
import gc
import mmap
import os

import torch

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
