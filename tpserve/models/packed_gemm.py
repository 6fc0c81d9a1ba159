"""Packed weights for the matmuls of a model on CPU: tpserve's own kernels (``csrc/linear_ops.cpp``).

After loading, each linear layer's ``[out, in]`` weight is rearranged once into panels of
output channels (``linear_ops.cpp`` describes the layout), in its dtype: fp32, bf16, or int8
with a scale per output channel (``--quantization int8`` or an int8 checkpoint, see
``quantization.py``). One kernel serves every row count: a decode step's single row reads each
weight once, front to back; a prompt's rows stream past each panel while it sits in L2. A
row's sums run in the same order whatever the row count, so a result does not depend on the
rows that share its call.

Why not oneDNN (what this replaced): its packed bf16 linear reads a weight at about half the
memory bandwidth when there is one row, and fp32 through ``F.linear`` goes to MKL, which is
2-4x slower on the AMD CPUs measured. Measured on the 40M benchmark model's 33 matmuls per step
(84 MB of bf16 weights, distinct so they stream from memory; AVX512-BF16 CPU, one thread, a
loaded shared machine, medians): 1 row 10.1 -> 5.3 ms, 8 rows 8.0 -> 6.1, 64 rows 53 -> 34,
256 rows 276 -> 273, 1024 rows 1228 -> 1305 (oneDNN -> these kernels). int8 weights with int8
activations (AVX512-VNNI): 1 row 3.1 ms, 64 rows 35 ms, 1024 rows 822 ms.

Packing needs the C++ operators; without them (or with ``TPSERVE_PREPACK=0``) layers call
``F.linear`` on their dense weights (int8 ones dequantized first). A packed layer frees its dense
weight; a weight shared with another module (a tied LM head) stays dense beside its packed copy.
"""
from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tpserve.kernels import cpu_extension

# Weight kinds, as the C++ operator numbers them (linear_ops.h).
FLOAT32, BFLOAT16, INT8, INT8_DYNAMIC = 0, 1, 2, 3
_K_MULTIPLE = {FLOAT32: 1, BFLOAT16: 2, INT8: 1, INT8_DYNAMIC: 4}
# How many input features one packed group holds: pairs for bf16, quads for int8 x int8.
_GROUP = {FLOAT32: 1, BFLOAT16: 2, INT8: 1, INT8_DYNAMIC: 4}


def ops_ready() -> bool:
    """Whether weights can be packed here: the C++ operators built, packing not turned off."""
    return os.environ.get("TPSERVE_PREPACK", "1") != "0" and cpu_extension.available()


@dataclass
class PackedWeight:
    """One layer's weight in the operator's layout, with what its kind needs beside it."""

    data: torch.Tensor
    kind: int
    n: int  # output features
    k: int  # input features
    scales: torch.Tensor | None = None  # int8: fp32 [N padded to a panel]
    colsum: torch.Tensor | None = None  # INT8_DYNAMIC: int32 [N padded]

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x [..., K] @ W^T + bias`` in x's dtype."""
        x2 = x.reshape(-1, self.k) if x.dim() != 2 else x
        if x2.stride(1) != 1:
            x2 = x2.contiguous()
        out = torch.empty(x2.shape[0], self.n, dtype=x.dtype)
        torch.ops.tpserve_cpu.linear(out, x2, self.data, self.kind, self.n, self.scales,
                                     self.colsum, bias)
        return out if x.dim() == 2 else out.view(*x.shape[:-1], self.n)


def _panel_rows(t: torch.Tensor, panel: int) -> torch.Tensor:
    """``t`` with zero rows appended up to a whole number of panels."""
    pad = -t.shape[0] % panel
    return torch.cat([t, t.new_zeros(pad, *t.shape[1:])]) if pad else t


def pack_weight(weight: torch.Tensor, kind: int, scales: torch.Tensor | None = None) -> PackedWeight:
    """Pack a dense ``[N, K]`` weight (fp32 or bf16 for the float kinds, int8 for the int8 ones;
    ``scales`` fp32 [N] for int8) into panels: ``[N/P][K/g][P][g]`` with g the kind's group."""
    if not cpu_extension.available():
        raise RuntimeError("packing a weight needs tpserve's C++ CPU operators, which are unavailable")
    panel = torch.ops.tpserve_cpu.linear_panel_width()
    n, k = weight.shape
    g = _GROUP[kind]
    w = _panel_rows(weight.detach(), panel)
    data = w.view(-1, panel, k // g, g).permute(0, 2, 1, 3).contiguous().view(-1)
    packed = PackedWeight(data=data, kind=kind, n=n, k=k)
    if kind in (INT8, INT8_DYNAMIC):
        packed.scales = _panel_rows(scales.detach().float().reshape(n), panel).contiguous()
    if kind == INT8_DYNAMIC:
        packed.colsum = _panel_rows(weight.detach().to(torch.int32).sum(1), panel).to(torch.int32)
    return packed


def packable(weight: torch.Tensor, kind: int, any_dtype: bool = False) -> bool:
    """Whether a weight can take the packed path as ``kind``: a CPU matrix of the kind's dtype
    (any dtype with ``any_dtype``: it is quantized first) whose input size is a multiple of the
    kind's group."""
    want = {FLOAT32: torch.float32, BFLOAT16: torch.bfloat16}.get(kind, torch.int8)
    return (weight.device.type == "cpu" and weight.dim() == 2 and (any_dtype or weight.dtype == want)
            and weight.shape[1] % _K_MULTIPLE[kind] == 0 and weight.numel() > 0)


def float_kind(dtype: torch.dtype) -> int | None:
    return {torch.float32: FLOAT32, torch.bfloat16: BFLOAT16}.get(dtype)


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: ``(q int8 [N, K], scale fp32 [N])`` with
    ``weight ~= q * scale[:, None]``, ``|q| <= 127``, scale = max |row| / 127 (1 for a zero row)."""
    w = weight.detach().float()
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


class PackableLinear(nn.Module):
    """Mixin of a layer whose ``weight`` may be packed: ``forward`` calls ``self.matmul``.

    A ``weight_scale`` parameter (fp32 [out, 1]) is registered on layers whose weight is int8 (see
    quantization.py); ``int8_activations`` says whether their activations are quantized too.
    """

    packed: PackedWeight | None = None
    int8_activations: bool = False
    quantize_at_load: bool = False  # --quantization int8: quantize the float weight when packing

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.packed is not None:
            return self.packed.matmul(x, bias)
        w = self.weight
        if w.dtype == torch.int8:  # unpacked int8 (no C++ operators): dequantize
            w = (w.float() * self.weight_scale.float()).to(x.dtype)
        return F.linear(x, w, bias)

    def _int8_kind(self) -> int:
        return INT8_DYNAMIC if self.int8_activations else INT8

    def prepack(self, shared: bool) -> bool:
        """Pack ``weight`` (quantizing it first if ``quantize_at_load``); free the dense copy
        unless it is ``shared``. Returns whether it was packed."""
        if self.packed is not None or not ops_ready():
            return False
        w = self.weight
        if w.dtype == torch.int8:
            kind = self._int8_kind()
            if not packable(w, kind):
                return False
            self.packed = pack_weight(w, kind, self.weight_scale)
        elif self.quantize_at_load and packable(w, self._int8_kind(), any_dtype=True):
            q, scale = quantize_int8(w)
            self.packed = pack_weight(q, self._int8_kind(), scale)
        else:
            kind = float_kind(w.dtype)
            if kind is None or not packable(w, kind):
                return False
            self.packed = pack_weight(w, kind)
        if not shared:
            self.weight.data = self.weight.data.new_empty(0)
            if getattr(self, "weight_scale", None) is not None:
                self.weight_scale.data = self.weight_scale.data.new_empty(0)
        return True


_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14  # Linux


def huge_page_buffer(nbytes: int) -> torch.Tensor:
    """An uninitialised uint8 tensor of ``nbytes`` whose memory the kernel is asked to back with
    2 MB pages (``madvise(MADV_HUGEPAGE)`` before any page is touched; a no-op where the call
    is unavailable, or transparent huge pages are off)."""
    buf = torch.empty(nbytes + _HUGE_PAGE, dtype=torch.uint8)
    addr = buf.data_ptr()
    start = -(-addr // _HUGE_PAGE) * _HUGE_PAGE
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(nbytes // _HUGE_PAGE * _HUGE_PAGE),
                     _MADV_HUGEPAGE)
    except (OSError, AttributeError):
        pass
    return buf[start - addr:start - addr + nbytes]


def _gather_in_huge_pages(packs: list[PackedWeight]) -> None:
    """Move every packed weight into one buffer of 2 MB pages, each weight's scales and colsum
    (a group weight's scales and mins) after its data. A decode step streams all the weights
    once: with 4 KB pages that is ~20,000 TLB misses per step on the 40M model, and the matmuls
    of a step (84 MB of bf16, one thread) took 9.3 -> 3.6 ms with huge pages (loaded machine,
    minimum of 30). A group weight reads its scales and mins as a stream of their own, one row
    per group: at group 32 (fp16, 1/8 of the codes' bytes) the 0.6B shape's layers at one row
    went 7.87 -> 7.36 ms with them in huge pages too (Zen 4, two threads, medians of 8
    alternations in one process; group 128: no change)."""
    parts = [t for p in packs for t in (p.data, p.scales, p.colsum) if t is not None]
    arena = huge_page_buffer(sum(-(-t.nbytes // 64) * 64 for t in parts))
    off = 0

    def place(t: torch.Tensor) -> torch.Tensor:
        nonlocal off
        view = arena[off:off + t.nbytes].view(t.dtype).view(t.shape)
        view.copy_(t)
        off += -(-t.nbytes // 64) * 64
        return view

    for p in packs:
        p.data = place(p.data)
        if p.scales is not None:
            p.scales = place(p.scales)
        if p.colsum is not None:
            p.colsum = place(p.colsum)


def prepack_model(model: nn.Module) -> int:
    """Pack every packable layer's weight (after loading), into huge pages, and every
    mixture-of-experts layer's experts (a module with ``prepack_experts``, moe.py); returns how
    many layers and expert sets were packed.

    The linear layers' packs are gathered into one buffer (the arena costs a second copy of them
    while it fills). The experts, most of an MoE model's bytes, are not: ``moe_kernel`` packs
    each projection of a layer's experts straight into a buffer of 2 MB pages of its own, so the
    peak stays one layer's experts above the weights."""
    counts: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        counts[id(p)] = counts.get(id(p), 0) + 1
    packs = []
    expert_sets = 0
    for m in model.modules():
        if isinstance(m, PackableLinear) and m.prepack(shared=counts.get(id(m.weight), 0) > 1):
            packs.append(m.packed)
        elif callable(getattr(m, "prepack_experts", None)) and m.prepack_experts():
            expert_sets += 1
    if packs:
        _gather_in_huge_pages(packs)
    # Tables held as codes (group_quant.hold_rows_as_codes), once the tied heads are packed.
    for m in model.modules():
        if callable(getattr(m, "prepack_rows", None)):
            m.prepack_rows()
    return len(packs) + expert_sets
