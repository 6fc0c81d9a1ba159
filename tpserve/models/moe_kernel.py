"""The routed experts of a mixture-of-experts layer on CPU: tpserve's grouped-expert kernel
(``csrc/moe_ops.cpp``).

:func:`pack_experts` packs one layer's experts (a ``FusedMoE``, moe.py: ``w13_weight
[E_local, 2I, H]``, ``w2_weight [E_local, H, I]``) once, after loading, into the packed linear
layers' panel layout (``packed_gemm.py``), all experts of a projection stacked in one tensor of
2 MB pages: fp32, bf16, or int8 with a scale per output channel (an int8 checkpoint's, or
quantized here under ``--quantization int8``, with int8 activations where the module's
``int8_activations`` says so, as ``PackableLinear.prepack`` chooses). :meth:`PackedExperts.forward`
then runs a step's tokens through them in one C++ call: the (token, choice) pairs grouped by
expert, each selected expert's gate/up, SiLU-and-mul and down over its rows, and each token's
weighted sum in fp32. Only the selected experts' weights are read, each once per call; the
matmuls are the packed linear layers' kernels (AVX-512 or AVX2, as the build's instruction set
gives), all selected experts' panels in one parallel loop per projection.

:func:`route` is the router's softmax / top-k / renormalisation in C++ (the fused decode path
routes with the same function, so a module path that calls it gives the same bits).

Measured on the Qwen3-30B-A3B expert shape (hidden 2048, 768 per expert, 128 experts, top-8; one
layer, random routing, bf16 activations; Xeon with AVX512-BF16/VNNI, a 2-vCPU VM shared with other
jobs, so one thread, medians of 30-60 calls): bf16 weights at 1 / 8 / 32 rows 6.95 / 46.7 / 117
ms, reading only the selected experts (8 / 51 / 112 of 128: 75 / 481 / 1056 MB) at 10.9 / 10.3 /
9.0 GB/s; int8 (quantized at load, int8 activations) 2.90 / 18.8 / 47.0 ms, 13.0 / 12.9 / 11.2
GB/s of 38 / 242 / 524 MB. The dense packed linear layers read 75 MB of bf16 at one row at
~10-12 GB/s on the same thread, so the experts run at the linear kernels' bandwidth. The
plain-torch loop over the selected experts (moe.py's ``experts_reference``: oneDNN bf16 matmuls)
took 11.3 / 66.1 / 150 ms in bf16 and, dequantizing each expert, 52.9 / 288 / 656 ms in int8
(15-18x the kernel). One ``linear_into`` per selected expert instead of the grouped loops (the
same kernels, driven from Python): bf16 7.9 / 54 / 199 ms and int8 6.8 / 37 / 94 ms on one
thread; on two threads
(loaded machine, best of 30) bf16 at one row 11.6 against 3.5 ms and at 8 rows 118 against 47 ms,
as a thread descheduled by another job stalls each of its 16 parallel regions per call.

Remeasured on a quiet machine after the linear kernels began prefetching each panel 1 KB ahead
(the same shapes, random routing, medians of 35 calls): bf16 at 1 / 8 / 32 rows 5.05 / 35.5 /
84.4 ms on one thread (one row: 75 MB at 15.0 GB/s) and 3.57 / 19.4 / 43.1 ms on two; int8
2.73 / 18.2 / 39.9 ms on one thread and 1.41 / 9.35 / 20.6 ms on two.
"""
from __future__ import annotations

import torch

from tpserve.kernels import cpu_extension
from tpserve.models import packed_gemm
from tpserve.models.group_quant import group_layout, group_packable, pack_group_weight
from tpserve.models.packed_gemm import BFLOAT16, FLOAT32, INT8, INT8_DYNAMIC

_DTYPE = {FLOAT32: torch.float32, BFLOAT16: torch.bfloat16, INT8: torch.int8, INT8_DYNAMIC: torch.int8}
_GROUP = {FLOAT32: 1, BFLOAT16: 2, INT8: 1, INT8_DYNAMIC: 4}


def ops_ready() -> bool:
    """Whether experts can be packed here: the C++ operators built, packing not turned off
    (``TPSERVE_PREPACK=0``)."""
    return packed_gemm.ops_ready()


class PackedStack:
    """One projection of every local expert, packed: ``data [E, panels * P * K]`` (expert e's
    panels in row e), and for the int8 kinds ``scales`` fp32 ``[E, N_pad]`` (and ``colsum``
    int32 ``[E, N_pad]`` with int8 activations); for the group kinds ``data`` uint8 codes and
    ``scales`` / ``colsum`` each expert's group scales and mins (:func:`_group_stack`)."""

    def __init__(self, data: torch.Tensor, kind: int, n: int, k: int,
                 scales: torch.Tensor | None, colsum: torch.Tensor | None):
        self.data, self.kind, self.n, self.k = data, kind, n, k
        self.scales, self.colsum = scales, colsum

    @property
    def nbytes_per_expert(self) -> int:
        """Bytes one expert's projection reads: its panels, scales and colsums (or mins)."""
        return sum(t[0].nbytes for t in (self.data, self.scales, self.colsum) if t is not None)


def _pack_stack(weight: torch.Tensor, kind: int, scales: torch.Tensor | None,
                quantize: bool) -> PackedStack:
    """Pack ``weight [E, N, K]`` (float, or int8 with ``scales [E, N]``) as ``kind`` into one
    buffer of 2 MB pages, an expert at a time (quantizing it first when ``quantize``)."""
    panel = torch.ops.tpserve_cpu.linear_panel_width()
    E, n, k = weight.shape
    g = _GROUP[kind]
    n_pad = -(-n // panel) * panel
    dtype = _DTYPE[kind]
    itemsize = torch.empty(0, dtype=dtype).element_size()
    data = packed_gemm.huge_page_buffer(E * n_pad * k * itemsize).view(dtype).view(E, n_pad * k)
    int8 = kind in (INT8, INT8_DYNAMIC)
    out_scales = torch.zeros(E, n_pad) if int8 else None
    colsum = torch.zeros(E, n_pad, dtype=torch.int32) if kind == INT8_DYNAMIC else None
    for e in range(E):
        w = weight[e].detach().contiguous()
        if quantize:
            w, scale = packed_gemm.quantize_int8(w)
        elif int8:
            scale = scales[e].detach().float()
        if n_pad != n:
            w = torch.cat([w, w.new_zeros(n_pad - n, k)])
        data[e].view(n_pad // panel, k // g, panel, g).copy_(
            w.view(n_pad // panel, panel, k // g, g).permute(0, 2, 1, 3))
        if int8:
            out_scales[e, :n] = scale.reshape(n)
        if colsum is not None:
            colsum[e] = w.to(torch.int32).sum(1)
    return PackedStack(data, kind, n, k, out_scales, colsum)


class PackedExperts:
    """A layer's local experts packed for the C++ kernel (see the module docstring)."""

    def __init__(self, w13: PackedStack, w2: PackedStack, num_experts: int, expert_start: int):
        self.w13, self.w2 = w13, w2
        self.hidden, self.inter = w13.k, w2.k
        self.num_experts, self.expert_start = num_experts, expert_start
        self.num_local = w13.data.shape[0]
        self.native = torch.classes.tpserve_cpu.MoeExperts(*self.stack_args())

    def stack_args(self) -> tuple:
        """The C++ constructor's arguments (``MoeExperts``, and a ``DecodeStack``'s MoE layer)."""
        a, b = self.w13, self.w2
        return (a.data, a.kind, a.scales, a.colsum, b.data, b.kind, b.scales, b.colsum,
                self.hidden, self.inter, self.num_experts, self.expert_start)

    def set_swiglu_oai(self, w13_bias: torch.Tensor, w2_bias: torch.Tensor | None, alpha: float,
                       limit: float) -> None:
        """gpt-oss's experts: biases (``w13_bias [E_local, 2I]`` gate then up, ``w2_bias
        [E_local, H]`` or None where this rank must not add it; the activations' dtype) added by
        the matmuls, and the clamped SwiGLU instead of SiLU-and-mul. Not for a DecodeStack (the
        fused decode refuses these layers)."""
        self.native.set_swiglu_oai(w13_bias.contiguous(), None if w2_bias is None else w2_bias.contiguous(),
                                   float(alpha), float(limit))

    @property
    def kind(self) -> int:
        return self.w13.kind

    def bytes_per_expert(self) -> int:
        """Bytes of packed weights one selected expert reads (its gate/up and down)."""
        return self.w13.nbytes_per_expert + self.w2.nbytes_per_expert

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                shared: torch.Tensor | None = None, shared_gate: torch.Tensor | None = None) -> torch.Tensor:
        """``x [T, H]`` (fp32 or bf16), ``topk_ids [T, k]`` int64 (global expert ids),
        ``topk_weights [T, k]`` fp32 -> ``[T, H]`` in x's dtype: this rank's partial sum over its
        local experts (ids of experts held elsewhere contribute nothing; an id outside
        ``[0, num_experts)`` is an IndexError). With ``shared [T, H]`` (and its gate logits
        ``shared_gate [T, 1]``, x's dtype), ``sigmoid(shared_gate) * shared`` joins the same fp32
        sum (Qwen2-MoE's shared expert)."""
        T = x.shape[0] if x.dim() == 2 else -1
        _check(x.dim() == 2 and x.shape[1] == self.hidden and x.device.type == "cpu"
               and x.dtype in (torch.float32, torch.bfloat16),
               "x", f"expected a CPU float32/bfloat16 [T, {self.hidden}], got {x.dtype} {tuple(x.shape)}")
        want = {FLOAT32: torch.float32, BFLOAT16: torch.bfloat16}.get(self.kind, x.dtype)
        _check(x.dtype == want, "x", f"experts packed as {want} take {want} activations, got {x.dtype}")
        _check(topk_ids.dim() == 2 and topk_ids.shape[0] == T and topk_ids.dtype == torch.int64,
               "topk_ids", f"expected int64 [T={T}, k], got {topk_ids.dtype} {tuple(topk_ids.shape)}")
        _check(topk_weights.shape == topk_ids.shape and topk_weights.dtype == torch.float32,
               "topk_weights", f"expected float32 {tuple(topk_ids.shape)}, got {topk_weights.dtype} "
                               f"{tuple(topk_weights.shape)}")
        if x.stride(1) != 1:
            x = x.contiguous()
        out = torch.empty(x.shape[0], self.hidden, dtype=x.dtype)
        self.native.forward(out, x, topk_ids.contiguous(), topk_weights.contiguous(),
                            None if shared is None else shared.contiguous(),
                            None if shared_gate is None else shared_gate.contiguous())
        return out


def _check(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{field}: {message}")


def _kinds(module) -> tuple[int, bool] | None:
    """The packed kind of a FusedMoE's experts and whether they are quantized when packed, as
    ``PackableLinear.prepack`` chooses for a linear layer; None when they cannot be packed."""
    w13 = module.w13_weight
    int8_kind = INT8_DYNAMIC if getattr(module, "int8_activations", False) else INT8
    if w13.dtype == torch.int8:
        return int8_kind, False
    if getattr(module, "quantize_at_load", False):
        return int8_kind, True
    kind = packed_gemm.float_kind(w13.dtype)
    return None if kind is None else (kind, False)


def pack_experts(module) -> PackedExperts | None:
    """Pack a ``FusedMoE``'s experts (see the module docstring); None when they cannot take
    the kernel here (no C++ operators, not on CPU, a dtype or size the kernels do not take).
    The module's dense weights are left to the caller to free."""
    if not ops_ready():
        return None
    w13, w2 = module.w13_weight, module.w2_weight
    chosen = _kinds(module)
    if chosen is None or w13.device.type != "cpu" or w13.dim() != 3 or w2.dim() != 3:
        return None
    kind, quantize = chosen
    E, two_i, hidden = w13.shape
    inter = two_i // 2
    if (w2.shape != (E, hidden, inter) or two_i % 2 or w13.numel() == 0
            or hidden % _GROUP[kind] or inter % _GROUP[kind]):
        return None
    if kind in (INT8, INT8_DYNAMIC) and not quantize:
        s13, s2 = module.w13_weight_scale, module.w2_weight_scale
        _check(s13 is not None and tuple(s13.shape) == (E, two_i), "w13_weight_scale",
               f"expected fp32 [{E}, {two_i}] with int8 experts")
        _check(s2 is not None and tuple(s2.shape) == (E, hidden), "w2_weight_scale",
               f"expected fp32 [{E}, {hidden}] with int8 experts")
    else:
        s13 = s2 = None
    packed13 = _pack_stack(w13, kind, s13, quantize)
    packed2 = _pack_stack(w2, kind, s2, quantize)
    return PackedExperts(packed13, packed2, int(module.num_experts), int(module.expert_start))


def _group_stack(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> PackedStack:
    """One projection of every local expert as group codes (``codes [E, N, K]`` uint8, ``scales``
    / ``mins [E, N, K // g]``), packed by ``group_quant.pack_group_weight`` an expert at a time
    in the one layout all of them can take (``group_layout`` of the stack), so the stacked
    tensors have rows of one size: ``data`` in 2 MB pages, ``scales`` (fp16, fp32 or int8
    sub-scales) and ``colsum`` (the mins, or ``[E, 1]`` int32 offsets of a symmetric stack)."""
    E, n, k = codes.shape
    groups = scales.shape[2]
    layout = group_layout(codes.reshape(E * n, k), scales.reshape(E * n, groups),
                          mins.reshape(E * n, groups))
    data = slot_scales = slot_mins = None
    for e in range(E):
        w = pack_group_weight(codes[e], scales[e], mins[e], layout=layout)
        if data is None:
            data = packed_gemm.huge_page_buffer(E * w.data.numel()).view(E, -1)
            slot_scales = w.scales.new_empty(E, w.scales.numel())
            slot_mins = w.colsum.new_empty(E, w.colsum.numel())
        data[e].copy_(w.data)
        slot_scales[e].copy_(w.scales)
        slot_mins[e].copy_(w.colsum)
    return PackedStack(data, w.kind, n, k, slot_scales, slot_mins)


def pack_group_experts(w13: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                       w2: tuple[torch.Tensor, torch.Tensor, torch.Tensor], num_experts: int,
                       expert_start: int) -> PackedExperts | None:
    """A layer's group-quantized experts (``(codes, scales, mins)`` of ``w13 [E, 2I, H]`` and
    ``w2 [E, H, I]``, group_quant.py's representation) packed for the C++ kernel, which runs
    them with int8 activations per group (quant_ops.cpp); None where it cannot take them (no
    C++ operators, a group that is not a multiple of 16 dividing the inputs)."""
    if not ops_ready():
        return None
    for codes, scales, _ in (w13, w2):
        k = codes.shape[2]
        if codes.device.type != "cpu" or not group_packable(k, k // scales.shape[2]):
            return None
    return PackedExperts(_group_stack(*w13), _group_stack(*w2), num_experts, expert_start)


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool,
          round_weights: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``router_logits [T, E]`` -> ``(topk_weights fp32 [T, k], topk_ids int64 [T, k])``, as
    ``moe.route`` (softmax in fp32, top-k with ties to the lower id, optional renormalisation),
    then, with ``round_weights``, the weights rounded to the logits' dtype (transformers' Qwen
    routers). In C++ on CPU (the fused decode's function), else in torch."""
    T, E = router_logits.shape
    if not 1 <= top_k <= E:
        raise ValueError(f"top_k: expected 1 <= top_k <= num_experts={E}, got {top_k}")
    ops = cpu_extension.ops_for(router_logits)
    if ops is None or router_logits.dtype == torch.float16:
        probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, top_k, dim=-1)
        if renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if round_weights:
            weights = weights.to(router_logits.dtype).float()
        return weights, ids
    ids = torch.empty(T, top_k, dtype=torch.int64)
    weights = torch.empty(T, top_k, dtype=torch.float32)
    logits = router_logits if router_logits.stride(-1) == 1 else router_logits.contiguous()
    ops.moe_route(ids, weights, logits, renormalize, round_weights and router_logits.dtype == torch.bfloat16)
    return weights, ids
