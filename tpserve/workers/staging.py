"""PlanStager: every array of a StepPlan to the device in one copy, through one host buffer.

A step needs about a dozen small index arrays on the device. Copied one by one they cost a
dozen host-to-device transfers, and from pageable memory each ``non_blocking`` copy is in fact
synchronous. The stager packs them into one host buffer (pinned on CUDA), issues one copy into
one device buffer, and hands out typed views of it. On the CPU the host buffer *is* the device
buffer: the packing is the one copy a step makes of its plan (plans may be read-only views into
shared memory), and the same code runs, so CPU tests cover the layout.

Layout: arrays in ``ARRAY_FIELDS`` order, each starting on a 16-byte boundary so that int64 and
float32 views of the byte buffer are aligned. Buffers grow to the next power of two and are
reused. Before the host buffer is overwritten, the stager waits for the previous step's copy
(ranks > 0 never synchronise with the device otherwise).
"""
from __future__ import annotations

import numpy as np
import torch

from tpserve.plan import ARRAY_FIELDS, StepPlan
from tpserve.workers.device import Accelerator

_ALIGN = 16
_TORCH_DTYPES = {np.dtype(np.int32): torch.int32, np.dtype(np.int64): torch.int64,
                 np.dtype(np.float32): torch.float32}


def plan_layout(plan: StepPlan) -> tuple[list[tuple[str, int, tuple[int, ...]]], int]:
    """([(field, byte offset, shape)], total bytes) of ``plan``'s arrays in the staging buffer."""
    out, pos = [], 0
    for name, dtype in ARRAY_FIELDS.items():
        arr = getattr(plan, name)
        out.append((name, pos, arr.shape))
        pos += -(-arr.size * dtype.itemsize // _ALIGN) * _ALIGN
    return out, pos


class PlanStager:
    """Owns the staging buffers of one runner; ``stage(plan)`` -> {field: device tensor}.

    Consecutive decode steps have the same array shapes; the typed views of the buffers are
    made once per set of shapes and reused (making them was most of a small step's staging).
    """

    def __init__(self, accel: Accelerator):
        self.accel = accel
        self._host: torch.Tensor | None = None
        self._host_np: np.ndarray | None = None
        self._device: torch.Tensor | None = None
        self._copied = None
        self._shapes: tuple | None = None  # the shapes the views below were made for
        self._views: tuple[list[tuple[str, np.ndarray]], dict[str, torch.Tensor], int] | None = None

    def _reserve(self, nbytes: int) -> None:
        if self._host is not None and self._host.numel() >= nbytes:
            return
        size = max(1024, 1 << (max(nbytes, 1) - 1).bit_length())
        self._host = self.accel.host_buffer(size)
        self._host_np = self._host.numpy()
        if self.accel.device.type == "cpu":
            self._device = self._host
        else:
            self._device = torch.empty(size, dtype=torch.uint8, device=self.accel.device)
        self._copied = None
        self._shapes = self._views = None

    def _make_views(self, plan: StepPlan):
        layout, total = plan_layout(plan)
        self._reserve(total)
        host, dev = [], {}
        for name, off, shape in layout:
            dtype = ARRAY_FIELDS[name]
            n = int(np.prod(shape, dtype=np.int64))
            host.append((name, self._host_np[off:off + n * dtype.itemsize].view(dtype).reshape(shape)))
            dev[name] = self._device[off:off + n * dtype.itemsize].view(_TORCH_DTYPES[dtype]).view(shape)
        return host, dev, total

    def stage(self, plan: StepPlan) -> dict[str, torch.Tensor]:
        """Device tensors of all of ``plan``'s arrays, valid until the next ``stage`` call."""
        if self._copied is not None:
            self._copied.synchronize()  # the previous copy still reads the host buffer
        shapes = tuple(getattr(plan, name).shape for name in ARRAY_FIELDS)
        if shapes != self._shapes:
            self._views = self._make_views(plan)
            self._shapes = shapes
        host, dev, total = self._views
        for name, view in host:
            view[...] = getattr(plan, name)
        if self._device is not self._host:
            self._device[:total].copy_(self._host[:total], non_blocking=True)
            self._copied = self.accel.record_event()
        return dict(dev)
