"""Group-quantized linear layers: 4- or 8-bit codes with a scale and a min per group of inputs.

The representation (shared with the GGUF and AWQ/GPTQ decoders) of a weight ``[out, in]`` with
group size ``g`` (dividing ``in``, a multiple of 16) and ``bits`` (4 or 8):

    w[o, i] = scales[o, i // g] * codes[o, i] + mins[o, i // g]

``codes`` uint8 ``[out, in]`` (one code per byte, each < 2**bits), ``scales`` and ``mins`` fp32
``[out, in // g]``. A checkpoint holds them as ``<module>.weight_codes``,
``<module>.weight_group_scales`` and ``<module>.weight_group_mins`` (plus an optional
``weight_bits``, 4 or 8, checked and dropped by ``quantization.checkpoint_tensors``: a layer's
codes all below 16 are packed as 4 bits, losslessly, whatever it says).

:func:`make_group_quant` turns a parallel linear layer (column, merged gate/up, q/k/v, row, LM
head) into its group-quantized form, in place (its class gains :class:`GroupQuantMixin`):

* from a checkpoint: ``weight`` is dropped, ``weight_codes`` / ``weight_group_scales`` /
  ``weight_group_mins`` are registered with loaders that shard them like the weight. Column
  layers take their rows of all three; a row-parallel layer takes its columns of the codes and
  the matching group columns of scales and mins: a group the split cuts becomes finer groups of
  its scale and min (exact), which must be whole groups of 16 (else a CheckpointError with the
  sizes). The group size is read from each tensor's shape; parts of a
  packed layer (q/k/v, gate/up) with different groups (a GGUF Q4_K_M file: Q4_K q, Q6_K v)
  share the finest one, coarser scales repeated (exact). 5/6-bit codes come as bits=8.
* quantized at load (``--quantization int4``): the float weight is loaded as usual, then
  quantized round-to-nearest, asymmetric (:func:`quantize_groups`: per group scale =
  (max - min) / 15, min = the group's minimum) when the model is packed or first run; where
  this rank's inputs are not whole groups of the configured size (a tensor-parallel split, a
  narrow model), with the largest multiple of 16 below it that divides them (:func:`fit_group`).

Matmuls: once packed (``prepack``, called by ``prepack_model``) through the C++ kernels of
``tpserve/kernels/csrc/quant_ops.cpp`` (the op ``linear`` of linear_ops.cpp with weight kinds
``GROUP4`` / ``GROUP8``, so the fused decode stack takes these layers as any packed one):
activations quantized to int8 per row and group (scale = absmax / 127), int32 dot products per
group, ``scale * a_scale * dot + min * a_scale * sum(a_q)`` summed in fp32 (W4A8;
:func:`w4a8_reference` is that arithmetic in plain torch). Without the C++ operators (or with
``TPSERVE_PREPACK=0``) the plain-torch path dequantizes the weight and calls ``F.linear``.

Packed layout (built here with torch reshapes; P = ``linear_panel_width()`` output channels, 4
vectors of L = P / 4 int32 lanes): 8-bit ``[N/P][K/4][4][L][4]`` (each lane a quad of inputs,
what vpdpbusd / vpmaddubsw multiply); 4-bit ``[N/P][K/8][4][L][4]`` bytes, each byte's low
nibble the code of input ``8j + q``, its high nibble that of ``8j + 4 + q``; scales and mins
``[N/P][K/g][P]``, fp16 when every value is exactly one, else fp32. 8-bit codes all below 64
(GGUF's Q5_0, Q5_1, Q5_K, Q6_K) are held in 6 bits, ``[N/P][K/16]`` blocks of two 4-bit steps
(the low nibbles, as above) then ``[4][L][4]`` bytes of their 2-bit high parts, field ``f`` of
byte ``q`` the input ``16b + 4f + q``: 0.75 bytes per weight instead of 1. A symmetric weight, every
min ``-c * scale`` for one integer ``c`` (GGUF's Q4_0, Q5_0, Q6_K, Q8_0), keeps no mins: the
kernels subtract ``c * sum(a_q)`` from each group's integer dot (exact in int32) and read 2 or 4
bytes fewer per group and channel (at group 32 and fp16 scales, 0.5625 bytes per weight instead
of 0.625). A symmetric weight whose scales are, run by run of 16 groups, int8 multiples of one
fp32 value (GGUF's Q6_K: d * sc, an fp16 d per 256 inputs and an int8 sc per 16) keeps them so
(:func:`sub_scales`): per panel ``[K/g][P]`` int8, then ``[K/(16g)][P]`` fp32, 1.25 bytes per
group and channel instead of 4 (a Q6_K weight: 0.83 bytes per weight instead of 1.0, as in the
file); every ``int8 * fp32`` product is the scale exactly.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tpserve.models.errors import CheckpointError
from tpserve.models.packed_gemm import PackedWeight, ops_ready

# Weight kinds of the C++ op (linear_ops.h).
GROUP4, GROUP8 = 4, 5
# The largest offset of a symmetric weight (quant_ops.cpp's kMaxOffset).
MAX_OFFSET = 255
# Groups that share one fp32 scale of int8 sub-scales (quant_ops.cpp's kSubGroups).
SUB_GROUPS = 16
_CODES, _SCALES, _MINS = "weight_codes", "weight_group_scales", "weight_group_mins"


# ---- the arithmetic, in plain torch ----------------------------------------------------------

def quantize_groups(weight: torch.Tensor, group_size: int = 128, bits: int = 4, fp16: bool = True
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest asymmetric group quantization of ``weight [out, in]``: ``(codes uint8,
    scales fp32, mins fp32)`` with scale = (max - min) / (2**bits - 1) and min the group's
    minimum (a constant group: scale 1, codes 0). With ``fp16`` scales and mins are rounded to
    fp16 values first (as GGUF stores them; the kernels then read half the bytes of them),
    unless one would not be a positive finite fp16."""
    out, k = weight.shape
    if k % group_size:
        raise ValueError(f"input size {k} is not a multiple of the group size {group_size}")
    w = weight.detach().float().reshape(out, k // group_size, group_size)
    lo, hi = w.amin(-1), w.amax(-1)
    qmax = 2 ** bits - 1
    scale = (hi - lo) / qmax
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    if fp16:
        s16, lo16 = scale.half().float(), lo.half().float()
        if bool(torch.isfinite(s16).all() and (s16 > 0).all() and torch.isfinite(lo16).all()):
            scale, lo = s16, lo16
    codes = torch.round((w - lo[..., None]) / scale[..., None]).clamp_(0, qmax).to(torch.uint8)
    return codes.reshape(out, k), scale.contiguous(), lo.contiguous()


def group_size_of(codes: torch.Tensor, scales: torch.Tensor) -> int:
    return codes.shape[1] // scales.shape[1]


def dequantize(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """The fp32 weight ``[out, in]`` of codes, scales and mins."""
    g = group_size_of(codes, scales)
    out, k = codes.shape
    w = codes.float().view(out, k // g, g) * scales.float()[..., None] + mins.float()[..., None]
    return w.view(out, k)


def quantize_activations(x: torch.Tensor, group_size: int
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows of ``x [M, K]`` quantized per group of ``group_size``, as the kernels do: ``(q int8
    [M, K], a_scale fp32 [M, G], a_sum int32 [M, G])``; a_scale = absmax / 127 (1 for a zero
    group), q = round-half-even(x * (1 / a_scale))."""
    m, k = x.shape
    xg = x.float().view(m, k // group_size, group_size)
    amax = xg.abs().amax(-1)
    s = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    inv = 1.0 / s
    q = torch.round(xg * inv[..., None]).clamp_(-127, 127)
    return q.to(torch.int8).view(m, k), s, q.sum(-1).to(torch.int32)


def w4a8_reference(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """What the C++ kernels compute, in fp64: int8 activations per row and group times the codes,
    ``sum_g a_scale * (scale * dot + min * sum(a_q))`` (+ bias); fp32 ``[M, N]``."""
    g = group_size_of(codes, scales)
    q, s, qsum = quantize_activations(x.reshape(-1, codes.shape[1]), g)
    m, k = q.shape
    n = codes.shape[0]
    dots = torch.einsum("mgi,ngi->mng", q.double().view(m, k // g, g), codes.double().view(n, k // g, g))
    sums = scales.double()[None] * dots + mins.double()[None] * qsum.double()[:, None, :]
    y = s.double()[:, None, :] * sums
    y = y.sum(-1)
    if bias is not None:
        y = y + bias.double()
    return y.float()


# ---- packing for the C++ kernels ---------------------------------------------------------------

def _pad_rows(t: torch.Tensor, n_pad: int) -> torch.Tensor:
    pad = n_pad - t.shape[0]
    return torch.cat([t, t.new_zeros(pad, *t.shape[1:])]) if pad else t


def _exact_fp16(t: torch.Tensor) -> bool:
    t = t.detach().float()
    return bool(torch.equal(t.half().float(), t))


def symmetric_offset(scales: torch.Tensor, mins: torch.Tensor) -> int | None:
    """The integer ``c`` in 0..255 with ``mins == -c * scales`` exactly (in fp32) for every group,
    or None: GGUF's Q4_0 (8), Q5_0 (16), Q6_K (32) and Q8_0 (128) blocks are of this form."""
    s, m = scales.detach().float(), mins.detach().float()
    nonzero = s != 0
    if not bool(nonzero.any()):
        return 0 if not bool(m.any()) else None
    c = -(m[nonzero][0] / s[nonzero][0]).item()
    if not (0 <= c <= MAX_OFFSET) or c != int(c):
        return None
    return int(c) if torch.equal(m, -c * s) else None


def sub_scales(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``scales [N, G]`` as ``(sub int8 [N, G], top fp32 [N, G / 16])`` with ``sub * top ==
    scales`` exactly in fp32, each run of 16 groups sharing one ``top``; None where some run is
    not of that form (or G is not a multiple of 16). A run's top is tried as ``±amax / 128`` and
    ``±amax / 127`` (amax: the run's largest magnitude): llama.cpp's Q6_K quantizer gives the
    largest sub-scale of a block -128, so the block's d is ``-extreme / 128``."""
    n, groups = scales.shape
    if groups % SUB_GROUPS or n == 0:
        return None
    s = scales.detach().float().reshape(n, groups // SUB_GROUPS, SUB_GROUPS)
    amax = s.abs().amax(-1, keepdim=True)
    sub = torch.zeros_like(s)
    top = torch.zeros_like(amax)
    done = amax == 0  # an all-zero run: top 0, sub-scales 0
    for m in (-128.0, 128.0, -127.0, 127.0):
        if bool(done.all()):
            break
        t = torch.where(done, torch.ones_like(amax), amax / m)
        q = torch.round(s / t)
        ok = ((q >= -128) & (q <= 127) & (q * t == s)).all(-1, keepdim=True) & ~done
        sub = torch.where(ok, q, sub)
        top = torch.where(ok, t, top)
        done = done | ok
    if not bool(done.all()):
        return None
    return sub.reshape(n, groups).to(torch.int8), top.reshape(n, groups // SUB_GROUPS).contiguous()


@dataclass(frozen=True)
class GroupLayout:
    """How :func:`pack_group_weight` holds a weight: ``bits`` per code (4, 6 or 8), the ``offset``
    of a symmetric weight (None: its mins are held), its scales as int8 ``sub``-scales, and
    ``fp16`` scales (and mins)."""
    bits: int
    offset: int | None
    sub: bool
    fp16: bool


def group_layout(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
                 bits: int | None = None) -> GroupLayout:
    """The most compact layout that holds ``codes [N, K]`` / ``scales`` / ``mins [N, G]``
    exactly. ``bits`` None: 4 when every code is below 16, 6 when below 64 (GROUP8 in 6 bits:
    Q5/Q6 blocks), else 8; an explicit 8 is also held in 6 bits when the codes allow it. Rows are
    independent, so the layout of a stack of weights (a layer's experts, rows of all of them) is
    one that every weight of it can take."""
    top = int(codes.max())
    if bits is None:
        bits = 4 if top < 16 else 8
    if bits == 8 and top < 64:
        bits = 6
    offset = symmetric_offset(scales, mins)
    exact = (scales,) if offset is not None else (scales, mins)
    return GroupLayout(bits=bits, offset=offset, sub=offset is not None and sub_scales(scales) is not None,
                       fp16=all(_exact_fp16(t) for t in exact))


def pack_group_weight(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
                      bits: int | None = None, layout: GroupLayout | None = None) -> PackedWeight:
    """codes / scales / mins in the kernels' layout (module docstring) as a PackedWeight of kind
    GROUP4 or GROUP8. Its ``colsum`` slot holds the mins, or for a symmetric weight (mins = -c *
    scales, :func:`symmetric_offset`) one int32, ``c``: the kernels then read no mins. The layout
    is :func:`group_layout`'s (of ``bits``), or ``layout`` where given (a stack's, which every
    weight of the stack takes)."""
    n, k = codes.shape
    if layout is None:
        layout = group_layout(codes, scales, mins, bits)
    bits = 8 if layout.bits == 6 else layout.bits
    six = layout.bits == 6
    panel = torch.ops.tpserve_cpu.linear_panel_width()
    lanes = panel // 4
    n_pad = -(-n // panel) * panel
    pn = n_pad // panel
    c = _pad_rows(codes.detach().to(torch.uint8), n_pad)
    if bits == 4:
        c = c.view(pn, 4, lanes, k // 8, 2, 4).permute(0, 3, 1, 2, 4, 5)
        data = (c[..., 0, :] | (c[..., 1, :] << 4)).contiguous().view(-1)
    elif six:  # per 16 inputs: the low nibbles as two 4-bit steps, then the 2-bit high parts
        lo = (c & 15).view(pn, 4, lanes, k // 8, 2, 4).permute(0, 3, 1, 2, 4, 5)
        lo = (lo[..., 0, :] | (lo[..., 1, :] << 4)).reshape(pn, k // 16, 2 * panel * 4)
        hi = (c >> 4).view(pn, 4, lanes, k // 16, 4, 4).permute(0, 3, 1, 2, 5, 4)  # [.., q, field]
        hi = hi[..., 0] | (hi[..., 1] << 2) | (hi[..., 2] << 4) | (hi[..., 3] << 6)
        data = torch.cat([lo, hi.reshape(pn, k // 16, panel * 4)], dim=2).contiguous().view(-1)
    else:
        data = c.view(pn, 4, lanes, k // 4, 4).permute(0, 3, 1, 2, 4).contiguous().view(-1)

    offset = layout.offset
    # fp16 scales and mins when that loses nothing (quant_ops.cpp reads either)
    dtype = torch.float16 if layout.fp16 else torch.float32

    def per_panel(t, to=dtype):
        t = _pad_rows(t.detach(), n_pad).view(pn, panel, t.shape[1])
        return t.permute(0, 2, 1).contiguous().view(-1).to(to)
    factored = sub_scales(scales) if layout.sub else None
    if factored is not None:  # per panel: [G][P] int8, then [G/16][P] fp32 (as bytes)
        sub, top = factored
        top_bytes = per_panel(top, torch.float32).view(torch.int8).view(pn, -1)
        scales_slot = torch.cat([per_panel(sub, torch.int8).view(pn, -1), top_bytes], dim=1).view(-1)
    else:
        scales_slot = per_panel(scales.float())
    mins_slot = torch.tensor([offset], dtype=torch.int32) if offset is not None else per_panel(mins.float())
    return PackedWeight(data=data, kind=GROUP4 if bits == 4 else GROUP8, n=n, k=k,
                        scales=scales_slot, colsum=mins_slot)


def packed_rows(packed: PackedWeight, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows ``ids`` (output channels) of a GROUP4 / GROUP8 pack as ``(codes uint8 [T, K], scales
    fp32 [T, K // g], mins fp32 [T, K // g])``: the inverse of :func:`pack_group_weight` for
    those rows, read from the packed layout in place (an embedding that shares a tied LM head's
    codes looks its rows up here, each step): one C++ call (quant_rows.cpp), or
    :func:`packed_rows_reference`'s torch indexing where that operator is missing."""
    if hasattr(torch.ops.tpserve_cpu, "group_rows"):
        return torch.ops.tpserve_cpu.group_rows(ids.reshape(-1).long(), packed.data, packed.kind, packed.n,
                                                packed.k, packed.scales, packed.colsum)
    return packed_rows_reference(packed, ids)


def packed_rows_reference(packed: PackedWeight, ids: torch.Tensor
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`packed_rows` in torch indexing (the layout's definition, read back)."""
    panel = torch.ops.tpserve_cpu.linear_panel_width()
    lanes = panel // 4
    k = packed.k
    bits = code_bits(packed)
    pn = packed.data.numel() * 8 // (panel * k * bits)
    p, j = ids // panel, ids % panel
    vec, lane = (j // lanes)[:, None], (j % lanes)[:, None]
    if bits == 6:
        data = packed.data.view(pn, k // 16, 3, 4, lanes, 4)
        b = data[p[:, None], torch.arange(k // 16)[None, :], :, vec, lane]  # [T, K/16, 3, 4]
        lo = torch.stack([b[:, :, :2] & 15, b[:, :, :2] >> 4], dim=3)  # [T, K/16, half, nibble, q]
        hi = torch.stack([(b[:, :, 2] >> (2 * f)) & 3 for f in range(4)], dim=2)  # [T, K/16, field, q]
        codes = lo.reshape(len(ids), k) | (hi.reshape(len(ids), k) << 4)
    elif bits == 4:
        data = packed.data.view(pn, k // 8, 4, lanes, 4)
        b = data[p[:, None], torch.arange(k // 8)[None, :], vec, lane]  # [T, K/8, 4]
        codes = torch.stack([b & 15, b >> 4], dim=2)  # inputs 8j + q, then 8j + 4 + q
    else:
        data = packed.data.view(pn, k // 4, 4, lanes, 4)
        codes = data[p[:, None], torch.arange(k // 4)[None, :], vec, lane]  # [T, K/4, 4]
    groups = packed_groups(packed)
    cols = torch.arange(groups)[None, :]

    def per_row(t):
        return t.view(pn, groups, panel)[p[:, None], cols, j[:, None]].float()
    if packed.scales.dtype == torch.int8:  # sub-scales [G][P] then their fp32 tops [G/16][P], per panel
        per = packed.scales.view(pn, -1)
        sub = per[:, :groups * panel].reshape(pn, groups, panel)[p[:, None], cols, j[:, None]]
        tops = per[:, groups * panel:].reshape(pn, groups // SUB_GROUPS, panel, 4)
        top = tops[p[:, None], torch.arange(groups // SUB_GROUPS)[None, :], j[:, None]]
        top = top.contiguous().view(torch.float32).reshape(len(ids), groups // SUB_GROUPS)
        scales = sub.float() * top.repeat_interleave(SUB_GROUPS, dim=1)
    else:
        scales = per_row(packed.scales)
    mins = -float(packed.colsum.item()) * scales if is_symmetric(packed) else per_row(packed.colsum)
    return codes.reshape(len(ids), k), scales, mins


def packed_groups(packed: PackedWeight) -> int:
    """Groups per output channel of a GROUP4 / GROUP8 pack (from its scales' size)."""
    panel = torch.ops.tpserve_cpu.linear_panel_width()
    n_pad = -(-packed.n // panel) * panel
    if packed.scales.dtype == torch.int8:  # 1.25 bytes per group and channel
        return packed.scales.numel() * 4 // (5 * n_pad)
    return packed.scales.numel() // n_pad


def code_bits(packed: PackedWeight) -> int:
    """The bits a GROUP4 / GROUP8 pack holds per code: 4, 6 or 8 (a GROUP8 in 6 bits is 3/4 the
    size)."""
    if packed.kind == GROUP4:
        return 4
    panel = torch.ops.tpserve_cpu.linear_panel_width()
    full = -(-packed.n // panel) * panel * packed.k
    return 6 if packed.data.numel() * 4 == full * 3 else 8


def is_symmetric(packed: PackedWeight) -> bool:
    """Whether a GROUP4 / GROUP8 pack holds an offset (mins = -offset * scales) instead of mins."""
    return packed.colsum.numel() == 1 and packed.colsum.dtype == torch.int32


# The largest group the C++ kernels take (quant_ops.cpp: group_size).
MAX_GROUP = 256


def fit_group(k: int, group_size: int, what: str) -> int:
    """The group a weight of ``k`` inputs (on this rank) is quantized with at load: ``group_size``,
    or the largest multiple of 16 below it that divides ``k``; a CheckpointError naming ``what``
    where none does."""
    for g in range(group_size - group_size % 16, 0, -16):
        if k % g == 0:
            return g
    raise CheckpointError(f"{what}: {k} input features on this rank are not a multiple of 16; they cannot "
                          "be group-quantized")


def group_packable(k: int, group_size: int) -> bool:
    """Whether the C++ kernels take ``k`` inputs in groups of ``group_size`` (else the torch path
    runs the layer)."""
    return 0 < group_size <= MAX_GROUP and group_size % 16 == 0 and k % group_size == 0


# ---- the layer -----------------------------------------------------------------------------------

class GroupQuantMixin:
    """A parallel linear layer with group-quantized weights (see the module docstring); placed
    before the layer's class by :func:`make_group_quant`."""

    group_size: int = 0  # 0: not known yet (a checkpoint's first scales set it)
    group_bits: int = 0  # 0: from the codes when packed
    group_rows: int = 0
    group_in_full: int = 0
    group_in_local: int = 0
    quantize_groups_at_load: bool = False

    # -- state
    def group_tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(codes, scales, mins) of this rank, or None before an at-load layer is quantized."""
        codes = getattr(self, _CODES, None)
        if codes is None or codes.numel() == 0:
            return None
        return codes, getattr(self, _SCALES), getattr(self, _MINS)

    def quantize_now(self, keep_weight: bool = True) -> None:
        """An at-load layer's float weight -> codes, scales, mins (once)."""
        if not self.quantize_groups_at_load or self.group_tensors() is not None:
            return
        codes, scales, mins = quantize_groups(self.weight, self.group_size, self.group_bits or 4)
        for name, t in ((_CODES, codes), (_SCALES, scales), (_MINS, mins)):
            setattr(self, name, t)  # plain tensors (the checkpoint never names them)
        if not keep_weight:
            self.weight.data = self.weight.data.new_empty(0)

    # -- loaders of a checkpoint's codes / scales / mins
    def _set_group(self, g: int) -> None:
        if self.group_in_local % g:
            raise CheckpointError(
                f"{type(self).__name__}: this rank's {self.group_in_local} input features (of "
                f"{self.group_in_full}) are not a whole number of groups of {g}; choose a "
                f"tensor-parallel size that splits the groups evenly")
        for name in (_SCALES, _MINS):
            p = getattr(self, name)
            if self.group_size == 0:
                p.data = torch.zeros(self.group_rows, self.group_in_local // g, dtype=torch.float32,
                                     device=p.device)
            else:  # finer groups: every coarser scale repeated (exact)
                p.data = p.data.repeat_interleave(self.group_size // g, dim=1)
        self.group_size = g

    def _group_loader(self, param: nn.Parameter, loaded: torch.Tensor, *shard) -> None:
        what = f"{type(self).__name__} group scales/mins"
        if loaded.dim() != 2 or loaded.shape[1] == 0 or self.group_in_full % loaded.shape[1]:
            raise CheckpointError(f"{what}: expected [out, in // group] with the group dividing "
                                  f"in={self.group_in_full}, got {tuple(loaded.shape)}")
        g = self.group_in_full // loaded.shape[1]
        if g % 16:
            raise CheckpointError(f"{what}: group size {g} (from shape {tuple(loaded.shape)}) is not a "
                                  f"multiple of 16")
        if self.group_in_local != self.group_in_full:  # a row-parallel layer's share of the inputs
            # A group the split cuts becomes finer groups of its scale and min (exact), as long as
            # those are whole groups of 16; else _set_group names the sizes.
            fine = math.gcd(g, self.group_in_local, self.tp.rank * self.group_in_local)
            if fine < g and fine % 16 == 0:
                loaded = loaded.repeat_interleave(g // fine, dim=1)
                g = fine
        if self.group_size == 0 or g < self.group_size:
            if self.group_size and self.group_size % g:
                raise CheckpointError(f"{what}: group size {g} does not divide {self.group_size}, "
                                      f"the group of this layer's other parts")
            self._set_group(g)
        elif g > self.group_size:
            if g % self.group_size:
                raise CheckpointError(f"{what}: group size {g} is not a multiple of {self.group_size}, "
                                      f"the group of this layer's other parts")
            loaded = loaded.repeat_interleave(g // self.group_size, dim=1)
        loaded = loaded.float()
        self._load_group_cols(param, loaded, *shard)

    def _load_group_cols(self, param, loaded, *shard):
        """Copy this rank's part of a full ``[out, in // g]`` tensor (rows split like the weight)."""
        from tpserve.models.embedding import ParallelLMHead
        from tpserve.models.linear import RowParallelLinear
        g = self.group_size
        if isinstance(self, RowParallelLinear):
            if loaded.shape[0] != self.output_size:
                raise CheckpointError(f"RowParallelLinear group scales: {loaded.shape[0]} rows, the "
                                      f"model config needs {self.output_size}")
            per = self.input_size_per_rank // g
            with torch.no_grad():
                param.copy_(loaded.narrow(1, self.tp.rank * per, per))
            return
        if isinstance(self, ParallelLMHead):
            if loaded.shape[0] != self.num_embeddings:
                raise CheckpointError(f"ParallelLMHead group scales: {loaded.shape[0]} rows, the model "
                                      f"config needs {self.num_embeddings}")
            real = max(0, min(self.vocab_end, self.num_embeddings) - self.vocab_start)
            with torch.no_grad():
                param[:real].copy_(loaded.narrow(0, self.vocab_start, real))
                param[real:].zero_()
            return
        self.weight_loader(param, loaded, *shard)  # column layers: rows, by part

    def _codes_loader(self, param, loaded, *shard):
        if loaded.dtype != torch.uint8:
            raise CheckpointError(f"{type(self).__name__} weight_codes: expected uint8 codes, "
                                  f"got {loaded.dtype}")
        self.weight_loader(param, loaded, *shard)

    def dequantized_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of this rank's weight, dequantized (fp32 ``[T, in]``): from the codes, or
        from the packed layout once packed (the embedding of a tied head reads its rows here)."""
        if self.packed is not None:
            codes, scales, mins = packed_rows(self.packed, ids)
        else:
            self.quantize_now()
            codes, scales, mins = (t[ids] for t in self.group_tensors())
        return dequantize(codes, scales, mins)

    # -- matmul and packing
    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.packed is not None:
            return self.packed.matmul(x, bias)
        self.quantize_now()
        codes, scales, mins = self.group_tensors()
        return F.linear(x, dequantize(codes, scales, mins).to(x.dtype), bias)

    def prepack(self, shared: bool) -> bool:
        """Quantize (at-load layers), then pack for the C++ kernels when they are available;
        the dense tensors are freed once packed (the float weight kept when ``shared``)."""
        if self.packed is not None:
            return False
        self.quantize_now(keep_weight=shared or not ops_ready())
        codes, scales, mins = self.group_tensors()
        if self.group_bits == 4 and int(codes.max()) >= 16:
            raise CheckpointError(f"{type(self).__name__}: 4-bit layer with codes >= 16")
        if (not ops_ready() or codes.device.type != "cpu"
                or not group_packable(codes.shape[1], self.group_size)):
            return False
        self.packed = pack_group_weight(codes, scales, mins)
        del codes, scales, mins
        for name in (_CODES, _SCALES, _MINS):
            t = getattr(self, name)
            if isinstance(t, nn.Parameter):  # a checkpoint's: the parameter stays, empty
                t.data = t.data.new_empty(0)
            else:  # quantized at load: a view would keep its base (all codes) alive
                setattr(self, name, None)
        if not shared and self.weight is not None and self.weight.numel():
            self.weight.data = self.weight.data.new_empty(0)
        return True


def hold_rows_as_codes(embed: nn.Module, bits: int, group_size: int) -> bool:
    """Hold a token embedding's table (``embedding.VocabParallelEmbedding``, this rank's rows) as
    group codes instead of floats: ``bits``-bit, round-to-nearest with a scale and a min per group
    of inputs (:func:`quantize_groups`), packed for the C++ row gather where the operators run,
    and look rows up there (``read_rows_from``). The float table goes, from every module that
    holds it: ``packed_gemm.prepack_model`` calls this (as the embedding's ``prepack_rows``, set by
    ``quantization.prepare_model``) once every linear layer is packed, so a tied LM head has
    quantized its own codes from the table first. Returns whether it did."""
    from tpserve.models.embedding import ParallelLMHead
    weight = embed.weight
    if embed.reads_codes or weight.numel() == 0 or embed.embedding_dim % group_size:
        return False
    with torch.device("meta"):  # no table of its own: it takes the embedding's, then codes
        table = ParallelLMHead(embed.num_embeddings, embed.embedding_dim, embed.tp)
    table.weight = weight
    make_group_quant(table, from_checkpoint=False, group_size=group_size, bits=bits)
    # Quantizes, and packs where the C++ operators run (elsewhere rows come from the codes).
    table.prepack(shared=True)
    weight.data = weight.data.new_empty(0)
    embed.read_rows_from(table)
    return True


_CLASSES: dict[type, type] = {}


def _group_class(cls: type) -> type:
    if issubclass(cls, GroupQuantMixin):
        return cls
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"GroupQuant{cls.__name__}", (GroupQuantMixin, cls), {})
    return _CLASSES[cls]


def make_group_quant(layer: nn.Module, from_checkpoint: bool, group_size: int = 128, bits: int = 0) -> None:
    """Turn ``layer`` (a PackableLinear: column, merged, q/k/v, row or LM head) into its
    group-quantized form, in place. ``from_checkpoint``: its codes, scales and mins come from
    the checkpoint (``group_size`` 0: inferred from their shapes); else its float weight is
    quantized with ``group_size`` and ``bits`` (4 if 0)."""
    rows, in_local = layer.weight.shape
    layer.__class__ = _group_class(type(layer))
    layer.group_rows, layer.group_in_local = rows, in_local
    layer.group_in_full = getattr(layer, "input_size", None) or getattr(layer, "embedding_dim")
    layer.group_bits = bits
    layer.int8_activations = True
    if not from_checkpoint:
        layer.group_size = fit_group(in_local, group_size, type(layer).__name__)
        layer.quantize_groups_at_load = True
        return
    from tpserve.models.weights import attach_loader
    device = layer.weight.device
    layer.weight = None  # no float weight in the checkpoint; `weight` stays an attribute
    codes = nn.Parameter(torch.empty(rows, in_local, dtype=torch.uint8, device=device), requires_grad=False)
    layer.register_parameter(_CODES, attach_loader(codes, layer._codes_loader))
    for name in (_SCALES, _MINS):
        p = nn.Parameter(torch.empty(rows, 0, dtype=torch.float32, device=device), requires_grad=False)
        layer.register_parameter(name, attach_loader(p, layer._group_loader))
    layer.group_size = 0
    if group_size:
        layer._set_group(group_size)
