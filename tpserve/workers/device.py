"""Accelerator: the one seam between the workers and device-specific runtime calls.

Workers never call ``torch.cuda.*`` directly; they call an ``Accelerator``. That keeps the CUDA
start-up order (set the device before the first collective) and the KV sizing arithmetic
(warm up, release cached blocks, read free memory and the activation peak) in plain Python
that CPU tests drive with a fake accelerator whose memory figures they choose.

    Accelerator          the host CPU: no memory figures, no graphs; every hook is a no-op.
    CudaAccelerator      one CUDA device (``torch.cuda``), NCCL, pinned host memory, CUDA graphs.

``is_accelerator`` selects the device path in ``ModelRunner``: KV pool sized from a fraction of
device memory after a warm-up, and decode graphs unless ``enforce_eager``. A test fake is an
``Accelerator`` subclass with ``is_accelerator = True`` whose tensors live on the CPU.

Graphs: ``capture_graph(fn, pool)`` returns an object with ``output`` (the tensor ``fn``
returned), ``replay()``, which recomputes ``output`` in place from whatever the static inputs
``fn`` reads now hold, and ``release()``, which frees it. The host version replays by calling
``fn`` again, which is what a CUDA graph does in effect, so graph bookkeeping (padding, buffer
reuse) is testable on CPU.
"""
from __future__ import annotations

from typing import Callable

import torch


class _DoneEvent:
    """Host work is synchronous: every event has already happened."""

    def synchronize(self) -> None:
        pass


class EagerGraph:
    """A 'graph' that replays by re-running its function into the first run's output."""

    def __init__(self, fn: Callable[[], torch.Tensor]):
        self._fn = fn
        self.output = fn()
        self.pool = None

    def replay(self) -> None:
        self.output.copy_(self._fn())

    def release(self) -> None:
        self._fn = self.output = None


class CudaGraph:
    """One captured CUDA graph; ``pool`` is its memory pool, shared by later captures."""

    def __init__(self, fn: Callable[[], torch.Tensor], pool=None):
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.output = fn()
        self.pool = self.graph.pool()

    def replay(self) -> None:
        self.graph.replay()

    def release(self) -> None:
        """Free the graph; its pool's memory returns to the allocator once no graph uses it."""
        self.graph.reset()
        self.output = self.pool = None


class Accelerator:
    """The host CPU (and the base class): device hooks are no-ops, memory is not measured."""

    is_accelerator = False
    dist_backend = "gloo"

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.device})"

    # ---- process and memory ------------------------------------------------------------
    def set_device(self) -> None:
        """Make this the current device of the process (before any collective)."""

    def synchronize(self) -> None:
        """Wait for all queued work on the device."""

    def empty_cache(self) -> None:
        """Return the allocator's cached, unused blocks to the device."""

    def mem_get_info(self) -> tuple[int, int]:
        """(free bytes, total bytes) of the device."""
        raise RuntimeError(f"{self!r} has no device memory to report: host KV sizing uses "
                           "kv_cache_memory_gb, not free device memory")

    def reset_peak_memory_stats(self) -> None:
        """Start a new window for :meth:`peak_extra_bytes`."""

    def peak_extra_bytes(self) -> int:
        """Bytes allocated at the peak since the last reset beyond what is allocated now: the
        transient (activation) memory of the work run in that window."""
        return 0

    def dist_device_id(self) -> torch.device | None:
        """The ``device_id`` for ``init_process_group`` (binds the communicator), or None."""
        return None

    # ---- host staging and graphs -------------------------------------------------------
    def host_buffer(self, nbytes: int) -> torch.Tensor:
        """A uint8 host tensor of ``nbytes`` to stage host-to-device copies through."""
        return torch.empty(nbytes, dtype=torch.uint8)

    def capture_graph(self, fn: Callable[[], torch.Tensor], pool=None):
        return EagerGraph(fn)

    def record_event(self):
        """A marker after the work queued so far; its ``synchronize()`` waits for that work."""
        return _DoneEvent()


class CudaAccelerator(Accelerator):
    """One CUDA device: NCCL, pinned staging memory, CUDA graphs, caching-allocator figures."""

    is_accelerator = True
    dist_backend = "nccl"

    def __init__(self, device: torch.device | str | int):
        if isinstance(device, int):
            device = torch.device("cuda", device)
        device = torch.device(device)
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        super().__init__(device)

    def set_device(self) -> None:
        torch.cuda.set_device(self.device)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def mem_get_info(self) -> tuple[int, int]:
        free, total = torch.cuda.mem_get_info(self.device)
        return int(free), int(total)

    def reset_peak_memory_stats(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def peak_extra_bytes(self) -> int:
        stats = torch.cuda.memory_stats(self.device)
        return int(stats["allocated_bytes.all.peak"] - stats["allocated_bytes.all.current"])

    def dist_device_id(self) -> torch.device | None:
        return self.device

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        # Pinned: a non_blocking copy from pageable memory is synchronous (staged by the driver).
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def capture_graph(self, fn: Callable[[], torch.Tensor], pool=None):
        return CudaGraph(fn, pool)

    def record_event(self):
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event


def cuda_available() -> bool:
    return torch.cuda.is_available()


def accelerator_for(device: "torch.device | str | Accelerator") -> Accelerator:
    """The accelerator of ``device``: an Accelerator passes through, cuda -> CudaAccelerator,
    anything else -> the host. Raises ValueError for a string that is not a torch device."""
    if isinstance(device, Accelerator):
        return device
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device: not a torch device: {device!r} ({e})") from None
    if device.type == "cuda":
        return CudaAccelerator(device)
    return Accelerator(device)


def local_accelerator(local_rank: int) -> Accelerator:
    """The accelerator a process of node-local rank ``local_rank`` uses: cuda:local_rank when
    CUDA is present, else the host."""
    if cuda_available():
        return CudaAccelerator(local_rank)
    return Accelerator("cpu")
