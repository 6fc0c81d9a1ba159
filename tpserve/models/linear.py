"""Tensor-parallel linear layers (Megatron-style column and row sharding).

Weights are stored like ``nn.Linear``: ``weight [out_local, in_local]``. A column-parallel
layer splits the output features across ranks and needs no communication; a row-parallel layer
splits the input features, each rank computes a partial sum and ``forward`` all-reduces it. A
column layer followed by a row layer (QKV -> o_proj, gate_up -> down) therefore costs one
all-reduce.

Matmuls go through ``PackableLinear.matmul``: ``F.linear``, or tpserve's CPU kernels over a
packed (fp32, bf16 or int8) weight once ``prepack_model`` ran (see ``packed_gemm.py``).

Each parameter carries ``weight_loader``, which receives the *full* checkpoint tensor (for packed
layers, one of its parts plus a ``shard_id``) and copies this rank's slice.
"""
from __future__ import annotations

import torch
from torch import nn

from tpserve.models.packed_gemm import PackableLinear
from tpserve.models.parallel import TPContext
from tpserve.models.weights import attach_loader, check_shape, new_param


def _divide(total: int, parts: int, what: str) -> int:
    if total % parts:
        raise ValueError(f"{what}={total} is not divisible by the tensor-parallel size {parts}")
    return total // parts


class ColumnParallelLinear(PackableLinear):
    """``y = x W^T + b`` with W's rows (output features) split evenly across ranks.

    ``forward`` returns this rank's slice of the output, ``[..., output_size / tp.size]``.
    """

    def __init__(self, input_size: int, output_size: int, tp: TPContext, bias: bool = False):
        super().__init__()
        self.tp = tp
        self.input_size = input_size
        self.output_size = output_size
        self.output_size_per_rank = _divide(output_size, tp.size, "output_size")
        self.weight = attach_loader(new_param(self.output_size_per_rank, input_size), self.weight_loader)
        self.bias = attach_loader(new_param(self.output_size_per_rank), self.weight_loader) if bias else None

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        full = (self.output_size,) + tuple(param.shape[1:])
        check_shape(loaded_weight, full, type(self).__name__)
        start = self.tp.rank * self.output_size_per_rank
        with torch.no_grad():
            param.copy_(loaded_weight.narrow(0, start, self.output_size_per_rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input fused into one matmul.

    Used for the MLP's gate and up projections: checkpoint tensors ``gate_proj`` (shard_id 0) and
    ``up_proj`` (shard_id 1) land in one weight whose local layout is
    ``[gate slice of this rank; up slice of this rank]``, so ``forward(x).chunk(2, -1)`` splits them.
    """

    def __init__(self, input_size: int, output_sizes: list[int], tp: TPContext, bias: bool = False):
        self.output_sizes = list(output_sizes)
        for i, size in enumerate(self.output_sizes):
            _divide(size, tp.size, f"output_sizes[{i}]")
        super().__init__(input_size, sum(self.output_sizes), tp, bias)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: int | None = None) -> None:
        assert shard_id is not None and 0 <= shard_id < len(self.output_sizes), shard_id
        size = self.output_sizes[shard_id]
        full = (size,) + tuple(param.shape[1:])
        check_shape(loaded_weight, full, f"{type(self).__name__} part {shard_id}")
        local = size // self.tp.size
        offset = sum(self.output_sizes[:shard_id]) // self.tp.size
        with torch.no_grad():
            param.narrow(0, offset, local).copy_(loaded_weight.narrow(0, self.tp.rank * local, local))


class QKVParallelLinear(ColumnParallelLinear):
    """The fused q/k/v projection of grouped-query attention, sharded by heads.

    Query heads are split evenly. Key/value heads are split evenly when there are at least as
    many as ranks; otherwise (``tp.size > num_kv_heads``) each kv head is replicated on
    ``tp.size / num_kv_heads`` consecutive ranks and every rank holds exactly the one kv head its
    query heads attend with. Either way the local layout is ``[q heads; k heads; v heads]`` and the
    query-to-kv grouping inside a rank equals the global one.
    """

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 tp: TPContext, bias: bool = False):
        self.head_dim = head_dim
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.num_heads_per_rank = _divide(num_heads, tp.size, "num_attention_heads")
        if num_kv_heads >= tp.size:
            self.num_kv_heads_per_rank = _divide(num_kv_heads, tp.size, "num_key_value_heads")
            self.kv_head_start = tp.rank * self.num_kv_heads_per_rank
        else:
            replicas = _divide(tp.size, num_kv_heads, "tensor-parallel size over num_key_value_heads")
            self.num_kv_heads_per_rank = 1
            self.kv_head_start = tp.rank // replicas
        self.q_size = self.num_heads_per_rank * head_dim
        self.kv_size = self.num_kv_heads_per_rank * head_dim
        local = self.q_size + 2 * self.kv_size
        # Every rank holds `local` rows, so the base class's even split of local * size is exact.
        super().__init__(hidden_size, local * tp.size, tp, bias)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: str | None = None) -> None:
        d = self.head_dim
        if shard_id == "q":
            heads, offset, local, src = self.num_heads, 0, self.q_size, self.tp.rank * self.q_size
        elif shard_id in ("k", "v"):
            heads, local, src = self.num_kv_heads, self.kv_size, self.kv_head_start * d
            offset = self.q_size if shard_id == "k" else self.q_size + self.kv_size
        else:
            raise AssertionError(f"QKVParallelLinear shard_id must be 'q', 'k' or 'v', got {shard_id!r}")
        full = (heads * d,) + tuple(param.shape[1:])
        check_shape(loaded_weight, full, f"QKVParallelLinear part {shard_id}")
        with torch.no_grad():
            param.narrow(0, offset, local).copy_(loaded_weight.narrow(0, src, local))

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Split ``forward``'s output into local q, k, v (each ``[..., heads_local * head_dim]``)."""
        return qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)


class RowParallelLinear(PackableLinear):
    """``y = x W^T + b`` with W's columns (input features) split across ranks.

    ``forward`` takes this rank's slice of the input, ``[..., input_size / tp.size]`` (what a
    column-parallel layer produced) and returns the full output on every rank, summed by one
    all-reduce. The bias is replicated but added on rank 0 only, so the sum counts it once.
    """

    def __init__(self, input_size: int, output_size: int, tp: TPContext, bias: bool = False):
        super().__init__()
        self.tp = tp
        self.input_size = input_size
        self.output_size = output_size
        self.input_size_per_rank = _divide(input_size, tp.size, "input_size")
        self.weight = attach_loader(new_param(output_size, self.input_size_per_rank), self.weight_loader)
        self.bias = attach_loader(new_param(output_size), self.weight_loader) if bias else None

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        if param.dim() == 1:  # bias: replicated
            check_shape(loaded_weight, (self.output_size,), "RowParallelLinear bias")
            shard = loaded_weight
        else:
            check_shape(loaded_weight, (self.output_size, self.input_size), "RowParallelLinear weight")
            shard = loaded_weight.narrow(1, self.tp.rank * self.input_size_per_rank, self.input_size_per_rank)
        with torch.no_grad():
            param.copy_(shard)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias if self.tp.rank == 0 else None
        return self.tp.all_reduce(self.matmul(x, bias))
