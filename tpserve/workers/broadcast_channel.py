"""The StepPlan channel across nodes: torch.distributed broadcast on a CPU (gloo) group.

Same interface as the shared-memory ring (``publish(plan)`` on the source rank,
``receive()`` on every other rank of the group), for workers that share no memory with
rank 0. Each plan costs two broadcasts:

    1. int64 [1]     the encoded length n
    2. uint8 [n]     the bytes of ``StepPlan.write_into``

Both sides keep one growing uint8 buffer: the source encodes straight into it (no extra
copy before the send) and receivers decode it with ``StepPlan.read_from``, so a received
plan's arrays are read-only views of that buffer, valid until the next ``receive``.

Every rank of the group must call ``publish``/``receive`` in the same order, as with any
collective. A timed-out receive leaves the group mid-collective: treat it as fatal.
"""
from __future__ import annotations

import datetime
import time

import torch
import torch.distributed as dist

from tpserve.plan import StepPlan
from tpserve.workers.channel import ChannelClosed, ChannelError, ChannelTimeout


class BroadcastPlanChannel:
    """One end of a broadcast plan channel. ``src`` is the global rank that publishes."""

    def __init__(self, group: dist.ProcessGroup | None = None, src: int = 0):
        self.group = group
        self.src = src
        self.rank = dist.get_rank()
        self._len = torch.zeros(1, dtype=torch.int64)
        self._buf = torch.empty(1 << 16, dtype=torch.uint8)
        self._closed = False

    @property
    def is_source(self) -> bool:
        return self.rank == self.src

    def _buffer(self, nbytes: int) -> torch.Tensor:
        if nbytes > self._buf.numel():
            # A new tensor, not an in-place resize: views of the previous plan stay valid.
            self._buf = torch.empty(max(nbytes, 2 * self._buf.numel()), dtype=torch.uint8)
        return self._buf[:nbytes]

    def _broadcast(self, tensor: torch.Tensor, timeout: float | None, what: str) -> None:
        start = time.monotonic()
        try:
            if timeout is None:
                dist.broadcast(tensor, src=self.src, group=self.group)
            else:
                work = dist.broadcast(tensor, src=self.src, group=self.group, async_op=True)
                work.wait(timeout=datetime.timedelta(seconds=timeout))
        except RuntimeError as e:  # gloo reports both a lost peer and a timeout this way
            if timeout is not None and time.monotonic() - start >= timeout:
                raise ChannelTimeout(f"rank {self.rank}: broadcast of the plan {what} from rank "
                                     f"{self.src} did not complete within {timeout} s") from e
            raise ChannelClosed(f"rank {self.rank}: broadcast of the plan {what} from rank "
                                f"{self.src} failed: {e}") from e

    def publish(self, plan: StepPlan, timeout: float | None = None) -> int:
        """Send ``plan`` to every rank of the group; only the source rank may call this.
        Returns the encoded size in bytes."""
        self._check_open()
        if not self.is_source:
            raise ChannelError(f"rank {self.rank} cannot publish on a plan channel whose "
                               f"source is rank {self.src}")
        nbytes = plan.nbytes()
        buf = self._buffer(nbytes)
        plan.write_into(buf.numpy())
        self._len[0] = nbytes
        self._broadcast(self._len, timeout, "length")
        self._broadcast(buf, timeout, "payload")
        return nbytes

    def receive(self, timeout: float | None = None) -> StepPlan:
        """The next plan from the source rank; arrays are views valid until the next call."""
        self._check_open()
        if self.is_source:
            raise ChannelError(f"rank {self.rank} is the source of this plan channel; only "
                               f"other ranks receive")
        self._broadcast(self._len, timeout, "length")
        nbytes = int(self._len[0])
        if nbytes <= 0:
            raise ChannelError(f"rank {self.rank}: received a plan length of {nbytes} bytes")
        buf = self._buffer(nbytes)
        self._broadcast(buf, timeout, "payload")
        return StepPlan.read_from(memoryview(buf.numpy()).toreadonly())

    def _check_open(self) -> None:
        if self._closed:
            raise ChannelClosed(f"rank {self.rank}: plan channel is closed")

    def close(self) -> None:
        """Drop the buffers; the process group belongs to the caller and stays up."""
        self._closed = True
        self._buf = torch.empty(0, dtype=torch.uint8)
