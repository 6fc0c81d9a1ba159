"""Zero-filled host tensors whose pages stay untouched until written.

``torch.zeros`` on the CPU allocates through the C heap and then writes every byte, so a KV
pool sized for the busiest hour is resident from the first second (for the 0.6B shape at
``kv_cache_memory_gb=0.5``, half a GiB before any request). A private anonymous mapping is
zero-filled by the kernel page by page on first touch: :func:`lazy_zeros` hands such a mapping
to torch, so a pool costs resident memory only for the blocks that have been written.

The mapping asks for 2 MB pages (``MADV_HUGEPAGE``; transparent huge pages in their default
``madvise`` mode give them to such mappings only): a decode step reads its sequences' blocks
from anywhere in the pool, and with 4 KB pages nearly every block cost a TLB miss (decode
attention over 26 layers of 32 sequences read 12.0 GB/s with 4 KB pages, 12.9 with 2 MB ones).
Residency then grows 2 MB at a time where a written block starts a fresh huge page.

A first touch is not free: the kernel zeroes the page, and in a virtual machine the host may
have to back it first. On the 2-vCPU VM this was measured on, writing 1 GiB of fresh pages took
0.1 to 2.7 s, and the Gemma 3 benchmark workload, whose blocks start pages all run long, ran
309-317 tok/s with an untouched pool against 350-357 with the pool written beforehand. So by
default (``EngineConfig.kv_cache_prefault``) the pool is populated when it is made
(``prefault=True``: ``MADV_POPULATE_WRITE``, or a write to every page where the kernel lacks
it), as vLLM and llama.cpp write theirs at start; ``--no-kv-cache-prefault`` keeps it lazy.
"""
from __future__ import annotations

import math
import mmap

import torch


_MADV_POPULATE_WRITE = 23  # Linux 5.14
_PAGE = 4096


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu",
               prefault: bool = False) -> torch.Tensor:
    """``torch.zeros(shape, dtype=dtype, device=device)``; on the CPU backed by an anonymous
    mapping of its own (page-aligned, unmapped when the tensor's storage is freed), its pages
    written now with ``prefault``, else at their first write."""
    device = torch.device(device)
    numel = math.prod(shape)
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if device.type != "cpu" or nbytes == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            buf.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # a kernel without transparent huge pages: 4 KB pages, as before
            pass
    # the tensor holds the buffer (and so the mapping) for as long as its storage lives
    t = torch.frombuffer(buf, dtype=dtype, count=numel).view(shape)
    if prefault:
        try:
            buf.madvise(_MADV_POPULATE_WRITE)
        except OSError:  # an older kernel: a zero written to every page does the same
            t.view(-1).view(torch.uint8)[::_PAGE].zero_()
    return t
