"""Mixture-of-experts layers: the router, the experts of one layer, the sparse MLP block.

A sparse layer replaces the dense MLP with (names as in Hugging Face checkpoints)::

    SparseMoeBlock                   (``mlp``; Mixtral: ``block_sparse_moe``)
    ├─ gate: ReplicatedLinear        router [num_experts, hidden], on every rank (no bias but
    │                                gpt-oss's, whose checkpoint calls it ``router``)
    ├─ experts: FusedMoE             this rank's experts, stacked
    ├─ shared_expert: MLP            Qwen2-MoE only, sharded like the dense MLP
    └─ shared_expert_gate: ReplicatedLinear   [1, hidden]: sigmoid gate of the shared expert

Routing (:func:`route`): softmax in fp32 over the experts, top-k (ties broken as
``torch.topk``), renormalised to sum to 1 when the config says so (Qwen's ``norm_topk_prob``;
Mixtral always); gpt-oss instead takes the top-k of the logits and a softmax over those k.
Each token's output is the sum over its k experts of ``weight * down(silu(gate(x)) * up(x))``,
plus ``sigmoid(shared_expert_gate(x)) * shared(x)``. gpt-oss's experts add biases
(``w13_bias``, ``w2_bias``) and gate with its clamped SwiGLU (:func:`swiglu_oai`): the torch
path and the C++ grouped kernel run them (its ``set_swiglu_oai``; routed in torch), the Triton
one does not (a GPU runs them in torch).

Sharding across the tensor-parallel group, in one of two modes:

* intermediate (default): every rank holds every expert, each expert's intermediate dimension
  split like the dense MLP's (gate and up rows by rank, down's input columns by rank);
* expert parallel (``enable_expert_parallel``): rank r holds whole experts
  ``[expert_start, expert_start + num_local_experts)``; a token routed to an expert elsewhere
  gets nothing from it here.

Either way a rank's result is a partial sum, and the block ends with ONE all-reduce that adds
the routed experts' partials and the shared expert's (its down projection does not reduce on
its own). The router runs on every rank on the same (all-reduced) input and weights, so every
rank picks the same experts.

:class:`FusedMoE` stores ``w13_weight [E_local, 2 * I_local, H]`` (gate rows, then up rows)
and ``w2_weight [E_local, H, I_local]``; int8 checkpoints add ``w13_weight_scale
[E_local, 2 * I_local]`` and ``w2_weight_scale [E_local, H]`` (fp32, one per output channel).
Its loader takes one expert's checkpoint tensor (``experts.{e}.gate_proj.weight`` ...) or the
fused ones transformers uses in memory (``experts.gate_up_proj [E, 2I, H]``,
``experts.down_proj [E, H, I]``). :meth:`FusedMoE.experts` runs the plain-torch path
(:func:`experts_reference`: tokens grouped by expert, a loop over the experts that got tokens;
on a GPU the grouped Triton kernel of ``tpserve/kernels/triton_moe.py``) unless
``prepack_experts`` handed the weights to the C++ grouped-expert kernel
(``tpserve/models/moe_kernel.py``), whose ``pack_experts(module)`` object then runs them; the
block then routes with the kernel's router and hands it the shared expert too, so that its fp32
sum is the one the fused decode computes.
"""
from __future__ import annotations

import importlib

import torch
import torch.nn.functional as F
from torch import nn

from tpserve.models.activation import SiluAndMul
from tpserve.models.errors import CheckpointError
from tpserve.models.linear import MergedColumnParallelLinear, RowParallelLinear
from tpserve.models.moe_group import DOWN, GATE, UP, GroupExperts
from tpserve.models.packed_gemm import PackableLinear, quantize_int8
from tpserve.models.parallel import TPContext
from tpserve.models.weights import attach_loader, check_shape, new_param

FUSED_GATE_UP, FUSED_DOWN = "gate_up", "down"


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool,
          topk_then_softmax: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``router_logits [T, E]`` -> ``(topk_weights fp32 [T, k], topk_ids int64 [T, k])``.

    Softmax in fp32 over the experts, the k largest (equal probabilities: the order
    ``torch.topk`` gives), optionally renormalised to sum to 1 per token. With
    ``topk_then_softmax`` (gpt-oss): the k largest logits, then a softmax over them in the
    logits' dtype (as transformers computes it).
    """
    if topk_then_softmax:
        values, ids = torch.topk(router_logits, top_k, dim=-1)
        return torch.softmax(values, dim=-1).float(), ids
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def swiglu_oai(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's gated activation of ``gate_up [T, 2I]`` (gate columns, then up columns):
    ``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)``, ``g = clamp(gate, max=limit)``."""
    inter = gate_up.shape[-1] // 2
    gate = gate_up[..., :inter].clamp(max=limit)
    up = gate_up[..., inter:].clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def _dequantized(w: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    if w.dtype != torch.int8:
        return w.to(dtype)  # float experts, or a GroupStack's dequantized fp32 expert
    return (w.float() * scale.float()[:, None]).to(dtype)


def experts_reference(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                      w13: torch.Tensor, w2: torch.Tensor, expert_start: int = 0,
                      w13_scale: torch.Tensor | None = None,
                      w2_scale: torch.Tensor | None = None, *,
                      w13_bias: torch.Tensor | None = None, w2_bias: torch.Tensor | None = None,
                      act=None) -> torch.Tensor:
    """The routed experts in plain torch: ``x [T, H]`` -> ``[T, H]`` in x's dtype.

    ``topk_ids [T, k]`` are global expert ids; ``w13 [E_local, 2I, H]`` / ``w2 [E_local, H, I]``
    hold experts ``expert_start ..`` (int8 with ``w13_scale [E_local, 2I]`` and ``w2_scale
    [E_local, H]``, or group codes as ``moe_group.GroupStack``, dequantized per expert used).
    Tokens routed to experts outside this range contribute nothing. Experts are visited in
    ascending order and each adds ``weight * down(silu(gate) * up)`` to its tokens' rows, as
    transformers does. With biases (``w13_bias [E_local, 2I]``, ``w2_bias [E_local, H]``) each
    projection adds its own; ``act`` replaces SiLU-and-mul (a function of ``gate_up [n, 2I]``).
    """
    num_tokens, top_k = topk_ids.shape
    num_local = w13.shape[0]
    inter = w13.shape[1] // 2
    out = torch.zeros_like(x)
    if num_tokens == 0:
        return out
    local = topk_ids.reshape(-1) - expert_start
    rows = torch.nonzero((local >= 0) & (local < num_local)).squeeze(1)
    if rows.numel() == 0:
        return out
    local = local[rows]
    order = torch.argsort(local, stable=True)
    rows, local = rows[order], local[order]
    counts = torch.bincount(local, minlength=num_local).tolist()
    weights = topk_weights.reshape(-1).float()
    start = 0
    for e, count in enumerate(counts):
        if count == 0:
            continue
        picked = rows[start:start + count]
        start += count
        tokens = picked // top_k
        w_gu = _dequantized(w13[e], None if w13_scale is None else w13_scale[e], x.dtype)
        w_d = _dequantized(w2[e], None if w2_scale is None else w2_scale[e], x.dtype)
        gate_up = F.linear(x[tokens], w_gu, None if w13_bias is None else w13_bias[e])
        if act is None:
            hidden = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        else:
            hidden = act(gate_up)
        y = F.linear(hidden, w_d, None if w2_bias is None else w2_bias[e])
        out.index_add_(0, tokens, (y.float() * weights[picked, None]).to(out.dtype))
    return out


class ReplicatedLinear(PackableLinear):
    """``y = x W^T`` with the whole weight on every rank (the router, the shared expert's gate).

    Quantized only when an int8 checkpoint stores it so: ``--quantization int8`` leaves it float
    (``is_router``), as the choice of experts is sensitive to it and it is small.
    """

    is_router = True

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.weight = attach_loader(new_param(output_size, input_size), self.weight_loader)
        self.bias = attach_loader(new_param(output_size), self.weight_loader) if bias else None

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        check_shape(loaded_weight, param.shape, type(self).__name__)
        with torch.no_grad():
            param.copy_(loaded_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)


class UnreducedRowParallelLinear(RowParallelLinear):
    """A row-parallel linear layer that returns this rank's partial sum (no all-reduce): the
    shared expert's down projection, whose partials join the routed experts' in the block's one
    all-reduce."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias if self.tp.rank == 0 else None)


class SharedExpertMLP(nn.Module):
    """Qwen2-MoE's shared expert: the dense MLP, sharded like it, returning partial sums."""

    def __init__(self, hidden_size: int, intermediate_size: int, tp: TPContext):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, tp)
        self.act = SiluAndMul()
        self.down_proj = UnreducedRowParallelLinear(intermediate_size, hidden_size, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


def _moe_kernel():
    """``tpserve.models.moe_kernel`` (the C++ grouped-expert kernel's Python side), or None
    where it is not part of this build."""
    try:
        return importlib.import_module("tpserve.models.moe_kernel")
    except ModuleNotFoundError as e:
        if e.name != "tpserve.models.moe_kernel":
            raise
        return None


class FusedMoE(nn.Module):
    """This rank's experts of one layer, stacked (see the module docstring for the layout).

    Attributes read by the kernels: ``num_experts`` (global), ``top_k``, ``expert_start``,
    ``num_local_experts``, ``hidden_size``, ``intermediate_size_per_rank``, ``w13_weight``,
    ``w2_weight`` (and their ``_scale`` for int8 checkpoints), ``quantize_at_load``
    (``--quantization int8``), ``int8_activations`` (W8A8), ``packed``.
    """

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 tp: TPContext, expert_parallel: bool = False,
                 proj_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
                 bias: bool = False, swiglu_oai: tuple[float, float] | None = None):
        super().__init__()
        self.tp = tp
        self.num_experts = num_experts
        self.top_k = top_k
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.expert_parallel = expert_parallel
        if expert_parallel:
            if num_experts % tp.size:
                raise ValueError(f"num_experts={num_experts} is not divisible by the tensor-parallel "
                                 f"size {tp.size}")
            self.num_local_experts = num_experts // tp.size
            self.expert_start = tp.rank * self.num_local_experts
            self.intermediate_size_per_rank = intermediate_size
        else:
            if intermediate_size % tp.size:
                raise ValueError(f"intermediate_size={intermediate_size} is not divisible by the "
                                 f"tensor-parallel size {tp.size}")
            self.num_local_experts = num_experts
            self.expert_start = 0
            self.intermediate_size_per_rank = intermediate_size // tp.size
        # checkpoint name of an expert's projection -> GATE / UP / DOWN
        self.proj_names = dict(zip(proj_names, (GATE, UP, DOWN)))
        e, i = self.num_local_experts, self.intermediate_size_per_rank
        self.w13_weight = attach_loader(new_param(e, 2 * i, hidden_size), self.weight_loader)
        self.w2_weight = attach_loader(new_param(e, hidden_size, i), self.weight_loader)
        self.w13_weight_scale: nn.Parameter | None = None
        self.w2_weight_scale: nn.Parameter | None = None
        # gpt-oss: each expert's projections add a bias (checkpoint ``experts.{e}.<proj>.bias``)
        self.w13_bias = attach_loader(new_param(e, 2 * i), self.weight_loader) if bias else None
        self.w2_bias = attach_loader(new_param(e, hidden_size), self.weight_loader) if bias else None
        # (alpha, limit) of gpt-oss's clamped SwiGLU; None: SiLU-and-mul
        self.swiglu_oai = swiglu_oai
        self.quantize_at_load = False
        self.int8_activations = False
        self.group: GroupExperts | None = None  # group-quantized experts (make_group)
        self.packed = None
        self.prepacked = False

    # ---- int8 ----------------------------------------------------------------------------
    def make_int8(self) -> None:
        """Re-type the weights as int8 and add their scales (an int8 checkpoint's experts)."""
        for name in ("w13_weight", "w2_weight"):
            old = getattr(self, name)
            weight = torch.empty(old.shape, dtype=torch.int8, device=old.device)
            setattr(self, name, attach_loader(nn.Parameter(weight, requires_grad=False), self.weight_loader))
            scale = torch.empty(old.shape[:2], dtype=torch.float32, device=old.device)
            setattr(self, f"{name}_scale", attach_loader(nn.Parameter(scale, requires_grad=False),
                                                         self.weight_loader))

    def make_group(self, from_checkpoint: bool, group_size: int = 128, bits: int = 0) -> None:
        """Group-quantized experts (``moe_group.py``): 4/6/8-bit codes from the checkpoint
        (parameters ``w13_weight_codes``, ``w13_weight_group_scales`` ... replace the float
        weights), or the float weights quantized with ``group_size`` and ``bits`` when packed."""
        self.int8_activations = True
        self.group = GroupExperts(self, from_checkpoint, group_size, bits, kernel=_moe_kernel())

    # ---- loading -------------------------------------------------------------------------
    @property
    def plain_experts(self) -> bool:
        """SiLU-and-mul experts without biases: what the grouped C++ and Triton kernels run."""
        return self.w13_bias is None and self.swiglu_oai is None

    def needed_shards(self, param_name: str) -> set:
        """The ``(expert, part)`` pieces the checkpoint must provide for a parameter."""
        parts = (DOWN,) if param_name.startswith("w2_") else (GATE, UP)
        return {(e, p) for e in range(self.num_experts) for p in parts}

    def checkpoint_name(self, prefix: str, shard: tuple[int, str], leaf: str) -> str:
        """The checkpoint tensor name of one expert's part (for error messages); ``leaf``:
        the parameter's name (``w13_weight``, ``w2_weight_scale``, ``w13_bias`` ...)."""
        e, part = shard
        proj = next(name for name, p in self.proj_names.items() if p == part)
        return f"{prefix}.{e}.{proj}.{leaf.split('_', 1)[1]}"  # w13_weight_scale -> weight_scale

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: tuple) -> None:
        """Copy this rank's share of a checkpoint tensor into ``param``.

        ``shard``: ``(expert id, GATE | UP | DOWN)`` for one expert's ``[I, H]`` / ``[H, I]``
        weight (``[I, 1]`` / ``[H, 1]`` scale), or ``(None, FUSED_GATE_UP | FUSED_DOWN)`` for the
        fused ``[E, 2I, H]`` / ``[E, H, I]`` weights. Experts of other ranks are skipped.
        """
        expert, part = shard
        full_i, h = self.intermediate_size, self.hidden_size
        if param is self.w13_bias or param is self.w2_bias:
            if expert is None:
                raise CheckpointError("fused expert biases are not supported; expected one bias "
                                      "per expert")
            if self.expert_start <= expert < self.expert_start + self.num_local_experts:
                check_shape(loaded, (h,) if part == DOWN else (full_i,), f"FusedMoE expert {part} bias")
                self._load_expert(param, loaded[:, None], expert, part, True)
            return
        is_scale = param.dim() == 2
        if expert is None:
            if is_scale:
                raise CheckpointError("fused expert scales are not supported; expected one "
                                      "weight_scale per expert")
            if part == FUSED_GATE_UP:
                check_shape(loaded, (self.num_experts, 2 * full_i, h), "FusedMoE gate_up_proj")
            else:
                check_shape(loaded, (self.num_experts, h, full_i), "FusedMoE down_proj")
            for e in range(self.expert_start, self.expert_start + self.num_local_experts):
                if part == FUSED_GATE_UP:
                    self._load_expert(param, loaded[e, :full_i], e, GATE, False)
                    self._load_expert(param, loaded[e, full_i:], e, UP, False)
                else:
                    self._load_expert(param, loaded[e], e, DOWN, False)
            return
        if not self.expert_start <= expert < self.expert_start + self.num_local_experts:
            return  # another rank's expert
        if part in (GATE, UP):
            check_shape(loaded, (full_i, 1) if is_scale else (full_i, h), f"FusedMoE expert {part}")
        else:
            check_shape(loaded, (h, 1) if is_scale else (h, full_i), "FusedMoE expert down")
        self._load_expert(param, loaded, expert, part, is_scale)

    def _load_expert(self, param, loaded, expert: int, part: str, is_scale: bool) -> None:
        e = expert - self.expert_start
        local = self.intermediate_size_per_rank
        start = 0 if self.expert_parallel else self.tp.rank * local
        with torch.no_grad():
            if part == DOWN:
                if is_scale:
                    param[e].copy_(loaded[:, 0])
                else:
                    param[e].copy_(loaded.narrow(1, start, local))
                return
            rows = loaded.narrow(0, start, local)
            offset = 0 if part == GATE else local
            param[e].narrow(0, offset, local).copy_(rows[:, 0] if is_scale else rows)

    # ---- running -------------------------------------------------------------------------
    def experts(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """``x [T, H]``, ``topk_ids [T, k]`` int64 (global ids), ``topk_weights [T, k]`` fp32 ->
        this rank's partial sum ``[T, H]`` (no all-reduce here)."""
        if self.packed is not None:
            return self.packed.forward(x, topk_ids, topk_weights)
        w13, w2 = self.w13_weight, self.w2_weight
        if self.group is not None:  # codes, dequantized per expert used (at load: quantized first)
            self.group.quantize()
            if self.group.stacks is None:
                raise RuntimeError("FusedMoE: the experts' group codes are not loaded")
            w13, w2 = self.group.stacks
        elif x.device.type == "cuda" and w13.dtype != torch.int8 and self.plain_experts:
            from tpserve.kernels.triton_moe import fused_experts  # GPU: grouped Triton GEMMs
            return fused_experts(x, topk_ids, topk_weights, self.w13_weight, self.w2_weight,
                                 self.expert_start)
        act = None
        if self.swiglu_oai is not None:
            alpha, limit = self.swiglu_oai
            act = lambda gate_up: swiglu_oai(gate_up, alpha, limit)  # noqa: E731
        # The down projection's bias joins the partial sums once: on rank 0, or with expert
        # parallelism on the rank that holds the expert.
        w2_bias = self.w2_bias if self.expert_parallel or self.tp.rank == 0 else None
        return experts_reference(x, topk_ids, topk_weights, w13, w2, self.expert_start,
                                 self.w13_weight_scale, self.w2_weight_scale, w13_bias=self.w13_bias,
                                 w2_bias=w2_bias, act=act)

    def prepack_experts(self) -> bool:
        """Hand the weights to the C++ grouped-expert kernel when it is built here (it packs,
        and quantizes when ``quantize_at_load``; group experts: ``moe_group.py``, which may have
        packed a checkpoint's already); frees the dense weights. Returns whether it did (once).
        Without the kernel, ``--quantization int8`` still quantizes the experts of a CPU model
        (the torch path dequantizes an expert when tokens use it), and ``int4`` groups them."""
        if self.prepacked:
            return False
        if self.group is not None:
            if self.packed is None and not self.group.pack():
                return False
        else:
            kernel = _moe_kernel()
            packed = kernel.pack_experts(self) if kernel is not None and kernel.ops_ready() else None
            if packed is None:
                w = self.w13_weight
                if self.quantize_at_load and w.dtype != torch.int8 and w.device.type == "cpu":
                    self._quantize_in_place()
                return False
            self.packed = packed
            for name in ("w13_weight", "w2_weight", "w13_weight_scale", "w2_weight_scale"):
                p = getattr(self, name)
                if p is not None:
                    p.data = p.data.new_empty(0)
        if self.swiglu_oai is not None:  # gpt-oss: biases and the clamped SwiGLU
            w2_bias = self.w2_bias if self.expert_parallel or self.tp.rank == 0 else None
            self.packed.set_swiglu_oai(self.w13_bias.detach(), None if w2_bias is None else w2_bias.detach(),
                                       *self.swiglu_oai)
        self.prepacked = True
        return True

    def _quantize_in_place(self) -> None:
        """Per-output-channel symmetric int8, as the packed linear layers quantize."""
        w13, w2 = self.w13_weight.data, self.w2_weight.data
        self.make_int8()
        with torch.no_grad():
            for e in range(self.num_local_experts):
                for dense, name in ((w13, "w13_weight"), (w2, "w2_weight")):
                    q, scale = quantize_int8(dense[e])
                    getattr(self, name)[e].copy_(q)
                    getattr(self, f"{name}_scale")[e].copy_(scale)

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        return self.experts(x, topk_ids, topk_weights)


class SparseMoeBlock(nn.Module):
    """Router, routed experts and (Qwen2-MoE) the gated shared expert; one all-reduce."""

    def __init__(self, spec, tp: TPContext, expert_parallel: bool = False):
        super().__init__()
        self.tp = tp
        self.top_k = spec.num_experts_per_tok
        self.renormalize = spec.norm_topk_prob
        self.round_weights = spec.round_routing_weights
        self.topk_then_softmax = spec.topk_then_softmax
        self.gate = ReplicatedLinear(spec.hidden_size, spec.num_experts, bias=spec.router_bias)
        swiglu = (spec.swiglu_alpha, spec.swiglu_limit) if spec.expert_act == "swiglu_oai" else None
        self.experts = FusedMoE(spec.num_experts, spec.num_experts_per_tok, spec.hidden_size,
                                spec.moe_intermediate_size, tp, expert_parallel, spec.expert_proj_names,
                                bias=spec.expert_bias, swiglu_oai=swiglu)
        if spec.shared_expert_intermediate_size:
            self.shared_expert = SharedExpertMLP(spec.hidden_size, spec.shared_expert_intermediate_size, tp)
            self.shared_expert_gate = ReplicatedLinear(spec.hidden_size, 1)
        else:
            self.shared_expert = self.shared_expert_gate = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.gate(x)
        packed = self.experts.packed
        if packed is not None and not self.topk_then_softmax:
            # The C++ kernel: its router, and the shared expert joining the experts' fp32 sum
            # (the fused decode's very functions, so both paths give the same bits).
            weights, ids = _moe_kernel().route(logits, self.top_k, self.renormalize, self.round_weights)
            shared = gate = None
            if self.shared_expert is not None:
                shared, gate = self.shared_expert(x), self.shared_expert_gate(x)
            return self.tp.all_reduce(packed.forward(x, ids, weights, shared, gate))
        weights, ids = route(logits, self.top_k, self.renormalize, self.topk_then_softmax)
        if self.round_weights:
            weights = weights.to(x.dtype).float()  # transformers scales by weights in x's dtype
        out = self.experts.experts(x, ids, weights)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return self.tp.all_reduce(out)
