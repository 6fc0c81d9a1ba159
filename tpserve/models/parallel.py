"""The tensor-parallel context every parallel layer is built with.

A :class:`TPContext` names this process's place in the tensor-parallel group (``rank`` of
``size``) and the ``torch.distributed`` group that carries its collectives. It is passed to each
layer's constructor explicitly: there is no module-level "current group", so two models with
different TP layouts can live in one process (the tests build a TP=1 reference next to a shard).

Invariants:
- ``0 <= rank < size``.
- With ``size == 1`` every collective returns its input unchanged and no process group is
  needed (``group`` may be None and ``torch.distributed`` need not be initialised).
- With ``size > 1`` the caller has initialised ``torch.distributed``; ``group=None`` then means
  the default (world) group, whose ranks must coincide with TP ranks.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPContext:
    """This process's rank within a tensor-parallel group of ``size`` ranks."""

    rank: int = 0
    size: int = 1
    group: Any = None  # a torch.distributed ProcessGroup, or None for the default group
    # The batch-invariant mode: all-reduce sums every element in rank order (see all_reduce).
    fixed_order: bool = False
    # CPU ranks on one machine: workers/shm_allreduce.py's ShmAllReduce, which sums through shared
    # memory what fits its slots (in rank order); None: every all-reduce goes to torch.distributed.
    shm: Any = None

    def __post_init__(self) -> None:
        if not isinstance(self.size, int) or self.size < 1:
            raise ValueError(f"TPContext.size: must be an int >= 1, got {self.size!r}")
        if not isinstance(self.rank, int) or not 0 <= self.rank < self.size:
            raise ValueError(f"TPContext.rank: must be an int in [0, {self.size}), got {self.rank!r}")

    @property
    def is_first(self) -> bool:
        """True on the rank that receives gathered results (logits)."""
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the group, in place; returns ``x``.

        With ``fixed_order`` (the batch-invariant mode) every element is ``((x0 + x1) + x2) + ...``
        in rank order: a ring all-reduce over three or more ranks cuts the tensor into chunks by
        its size (the step's row count) and starts each chunk's sum at another rank, so an
        element's sum order, hence its last bits, would follow the batch. Two ranks need no
        care (x0 + x1 == x1 + x0 exactly), and keep the plain all-reduce. ``shm`` (CPU ranks of one
        machine) sums what fits its slots in rank order too, through shared memory."""
        if self.size == 1:
            return x
        if self.shm is not None and self.shm.all_reduce(x):
            return x
        if self.fixed_order and self.size > 2:
            parts = [torch.empty_like(x) for _ in range(self.size)]
            dist.all_gather(parts, x.contiguous(), group=self.group)
            total = parts[0]
            for p in parts[1:]:
                total = total + p
            x.copy_(total)
            return x
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's ``x`` along ``dim`` (rank order); every rank gets the result."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)

    def gather_to_rank0(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor | None:
        """Concatenate every rank's ``x`` along ``dim`` on rank 0; other ranks get None.

        Cheaper than :meth:`all_gather` when only rank 0 consumes the result (sampling).
        """
        if self.size == 1:
            return x
        x = x.contiguous()
        if self.shm is not None:
            taken, parts = self.shm.gather(x)
            if taken:
                return torch.cat(parts, dim=dim) if parts is not None else None
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else None
        # ``dst`` is a global rank; ``group_dst`` (a group rank) needs torch >= 2.6.
        dst = 0 if self.group is None else dist.get_global_rank(self.group, 0)
        dist.gather(x, parts, dst=dst, group=self.group)
        return torch.cat(parts, dim=dim) if parts is not None else None
