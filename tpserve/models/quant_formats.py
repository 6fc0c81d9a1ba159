"""4- and 8-bit safetensors checkpoint formats decoded into tpserve's group-quantized tensors.

A decoder reads the tensors a quantization library saved for each linear module and yields,
under the module's Hugging Face name, what the group-quant layer loads
(``tpserve/models/group_quant.py``)::

    <module>.weight_codes         uint8   [out, in]       one code per byte, < 2**bits
    <module>.weight_group_scales  float32 [out, in // g]
    <module>.weight_group_mins    float32 [out, in // g]
    <module>.weight_bits          int64   []              only for 8-bit codes
    w[o, i] = scales[o, i // g] * codes[o, i] + mins[o, i // g]

Every other tensor passes through unchanged. The formats (``QuantConfig.checkpoint_format``):

``awq`` (AutoAWQ, ``version: gemm``)
    ``qweight`` int32 ``[in, out / 8]``, ``qzeros`` int32 ``[in / g, out / 8]``, ``scales`` fp16
    ``[in / g, out]``. Eight 4-bit values per word along the output axis, in AWQ's interleaved
    order: the nibble at bits ``4 k`` holds output column ``8 c + (0, 2, 4, 6, 1, 3, 5, 7)[k]``.
    ``w = (q - z) * s``: code ``q``, min ``-z * s``.
``gptq`` / ``gptq_v2`` (AutoGPTQ, GPTQModel, optimum)
    ``qweight`` int32 ``[in / (32 / bits), out]`` packed along the *input* axis, value ``j`` of a
    word at bits ``bits * j``; ``qzeros`` int32 ``[in / g, out / (32 / bits)]`` packed along the
    output axis the same way; ``scales`` fp16 ``[in / g, out]``; ``g_idx`` int32 ``[in]``.
    ``w = (q - z) * s`` where the stored zero is ``z - 1`` in the original format (``gptq``,
    ``checkpoint_format: gptq``) and ``z`` in GPTQModel's ``gptq_v2``. A ``g_idx`` other than
    ``i // g`` (``desc_act`` with reordered groups) is refused naming ``g_idx``: the groups would
    not be contiguous input ranges.
``compressed-tensors`` (llm-compressor, format ``pack-quantized``, strategy ``group``)
    ``weight_packed`` int32 ``[out, ceil(in / (32 / bits))]`` (value ``j`` of a word at bits
    ``bits * j``, stored plus ``2**(bits - 1)``), ``weight_shape`` ``[2]``, ``weight_scale``
    ``[out, in / g]``, for asymmetric schemes ``weight_zero_point`` (int32 packed along the
    *output* axis the same way, or unpacked int8 ``[out, in / g]`` in older files), optional
    ``weight_g_idx`` (must be trivial). ``w = (q - zp) * s`` with signed ``q``, ``zp``: code
    ``q + 2**(bits-1)``, min ``-(zp + 2**(bits-1)) * s``.

A group size the kernels do not have (GPTQ's per-channel ``group_size: -1``, compressed-tensors'
4-bit ``channel`` strategy, groups of 512...) is re-expressed in the largest of
``GROUP_SIZES`` that divides it, each scale and min repeated: the same weights.

Every product above is of a 16-bit float scale and an integer below 2**9: exact in float32, so
the decoded tensors dequantize to exactly the weights the format's own dequantization gives (in
float32). Row (TP) sharding is the loader's: every rank decodes the full tensors.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from tpserve.models.errors import CheckpointError
from tpserve.quantization import GROUP_SIZES

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble k of a word holds column AWQ_ORDER[k]
FORMATS = ("awq", "gptq", "gptq_v2", "compressed-tensors")
# The tensors each format stores per linear module (leaf names), and those it needs.
_LEAVES = {
    "awq": ({"qweight", "qzeros", "scales"}, {"qweight", "qzeros", "scales"}),
    "gptq": ({"qweight", "qzeros", "scales", "g_idx"}, {"qweight", "qzeros", "scales"}),
    "gptq_v2": ({"qweight", "qzeros", "scales", "g_idx"}, {"qweight", "qzeros", "scales"}),
    "compressed-tensors": ({"weight_packed", "weight_shape", "weight_scale", "weight_zero_point",
                            "weight_g_idx"}, {"weight_packed", "weight_shape", "weight_scale"}),
}


def unpack_words(words: torch.Tensor, bits: int, dim: int, order=None) -> torch.Tensor:
    """int32 words -> uint8 values, ``32 // bits`` per word laid out along ``dim`` (0 or 1).

    Value ``j`` of a word sits at bits ``bits * k`` where ``order[k] == j`` (default: ``k == j``)."""
    if words.dtype != torch.int32 or words.dim() != 2:
        raise CheckpointError(f"expected a 2-D int32 tensor of packed {bits}-bit values, "
                              f"got {words.dtype} {tuple(words.shape)}")
    per = 32 // bits
    mask = (1 << bits) - 1
    order = tuple(range(per)) if order is None else tuple(order)
    rows, cols = words.shape
    out = torch.empty((rows, cols, per) if dim == 1 else (rows, per, cols), dtype=torch.uint8)
    for k, j in enumerate(order):
        # An arithmetic shift fills with sign bits, which the mask drops.
        value = torch.bitwise_and(torch.bitwise_right_shift(words, bits * k), mask).to(torch.uint8)
        if dim == 1:
            out[:, :, j] = value
        else:
            out[:, j, :] = value
    return out.reshape(rows, cols * per) if dim == 1 else out.reshape(rows * per, cols)


def _float(t: torch.Tensor, what: str, shape: tuple[int, ...]) -> torch.Tensor:
    if not t.is_floating_point():
        raise CheckpointError(f"{what}: expected a float tensor, got {t.dtype}")
    if tuple(t.shape) != shape:
        raise CheckpointError(f"{what}: expected shape {shape}, got {tuple(t.shape)}")
    return t.to(torch.float32)


def _check_codes(codes: torch.Tensor, what: str, shape: tuple[int, int]) -> torch.Tensor:
    if tuple(codes.shape) != shape:
        raise CheckpointError(f"{what}: unpacks to shape {tuple(codes.shape)}, expected {shape}")
    return codes.contiguous()


def _groups(in_features: int, n_groups: int, what: str) -> int:
    if n_groups <= 0 or in_features % n_groups:
        raise CheckpointError(f"{what}: {n_groups} groups do not divide {in_features} input features")
    return in_features // n_groups


def decode_awq(prefix: str, t: dict[str, torch.Tensor], bits: int = 4) -> dict[str, torch.Tensor]:
    """One AWQ GEMM module's ``qweight``/``qzeros``/``scales`` -> codes, scales, mins."""
    if bits != 4:
        raise CheckpointError(f"{prefix}: AWQ checkpoints are 4-bit, got bits={bits}")
    codes = unpack_words(t["qweight"], 4, 1, AWQ_ORDER).t()  # [out, in]
    out, in_features = codes.shape
    scales = _float(t["scales"], f"{prefix}.scales", (t["scales"].shape[0], out)).t()
    _groups(in_features, scales.shape[1], f"{prefix}.scales")
    zeros = unpack_words(t["qzeros"], 4, 1, AWQ_ORDER).t()
    zeros = _check_codes(zeros, f"{prefix}.qzeros", tuple(scales.shape))
    return _result(codes, scales, -zeros.to(torch.float32) * scales, bits)


def decode_gptq(prefix: str, t: dict[str, torch.Tensor], bits: int, zero_offset: int
                ) -> dict[str, torch.Tensor]:
    """One GPTQ module's ``qweight``/``qzeros``/``scales``[/``g_idx``] -> codes, scales, mins;
    ``zero_offset``: 1 for the original format (zeros stored minus one), 0 for gptq_v2."""
    if bits not in (4, 8):
        raise CheckpointError(f"{prefix}: tpserve decodes 4- and 8-bit GPTQ weights, got bits={bits}")
    codes = unpack_words(t["qweight"], bits, 0).t()  # [out, in]
    out, in_features = codes.shape
    scales = _float(t["scales"], f"{prefix}.scales", (t["scales"].shape[0], out)).t()
    g = _groups(in_features, scales.shape[1], f"{prefix}.scales")
    zeros = _check_codes(unpack_words(t["qzeros"], bits, 1).t(), f"{prefix}.qzeros", tuple(scales.shape))
    _check_g_idx(t.get("g_idx"), in_features, g, f"{prefix}.g_idx")
    mins = -(zeros.to(torch.float32) + zero_offset) * scales
    return _result(codes, scales, mins, bits)


def _check_g_idx(g_idx: torch.Tensor | None, in_features: int, g: int, what: str) -> None:
    if g_idx is None:
        return
    trivial = torch.arange(in_features, dtype=torch.int64) // g
    if tuple(g_idx.shape) != (in_features,) or not torch.equal(g_idx.to(torch.int64), trivial):
        raise CheckpointError(
            f"{what}: input features are not in contiguous groups of {g} (act-order / desc_act "
            "reordering); tpserve cannot load such weights exactly: quantize without desc_act "
            "(or with static groups)")


def decode_compressed(prefix: str, t: dict[str, torch.Tensor], bits: int) -> dict[str, torch.Tensor]:
    """One compressed-tensors pack-quantized module -> codes, scales, mins."""
    if bits not in (4, 8):
        raise CheckpointError(f"{prefix}: tpserve decodes 4- and 8-bit packed weights, got num_bits={bits}")
    shape = t["weight_shape"]
    if shape.numel() != 2:
        raise CheckpointError(f"{prefix}.weight_shape: expected 2 values, got {shape.tolist()}")
    out, in_features = (int(v) for v in shape.reshape(-1).tolist())
    per = 32 // bits
    packed = t["weight_packed"]
    if tuple(packed.shape) != (out, -(-in_features // per)):
        raise CheckpointError(f"{prefix}.weight_packed: expected [{out}, {-(-in_features // per)}] words "
                              f"for weight_shape [{out}, {in_features}], got {tuple(packed.shape)}")
    codes = unpack_words(packed, bits, 1)[:, :in_features].contiguous()
    scale = t["weight_scale"]
    if scale.dim() != 2 or scale.shape[0] != out:
        raise CheckpointError(f"{prefix}.weight_scale: expected [{out}, groups], got {tuple(scale.shape)}")
    scales = _float(scale, f"{prefix}.weight_scale", tuple(scale.shape))
    g = _groups(in_features, scales.shape[1], f"{prefix}.weight_scale")
    offset = 1 << (bits - 1)
    zp = t.get("weight_zero_point")
    if zp is None:
        stored_zero = torch.full_like(scales, float(offset))
    elif zp.dtype == torch.int32 and tuple(zp.shape) == (-(-out // per), scales.shape[1]):
        stored_zero = unpack_words(zp, bits, 0)[:out].to(torch.float32)  # packed: zero + offset
    elif tuple(zp.shape) == tuple(scales.shape) and not zp.is_floating_point():
        stored_zero = zp.to(torch.float32) + offset  # unpacked, signed
    else:
        raise CheckpointError(f"{prefix}.weight_zero_point: expected int32 [{-(-out // per)}, "
                              f"{scales.shape[1]}] (packed) or int8 {tuple(scales.shape)}, got "
                              f"{zp.dtype} {tuple(zp.shape)}")
    _check_g_idx(t.get("weight_g_idx"), in_features, g, f"{prefix}.weight_g_idx")
    return _result(codes, scales, -stored_zero * scales, bits)


def _result(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, bits: int
            ) -> dict[str, torch.Tensor]:
    g = codes.shape[1] // scales.shape[1]
    if g not in GROUP_SIZES:  # per channel (GPTQ's group_size -1) or a multiple of a kernel group
        finer = [s for s in GROUP_SIZES if g % s == 0]
        if not finer:
            raise CheckpointError(f"groups of {g} inputs cannot be expressed as groups of "
                                  f"{', '.join(map(str, GROUP_SIZES))}")
        # The same scale and min repeated over each smaller group: the same weights, exactly.
        scales = scales.repeat_interleave(g // finer[-1], dim=1)
        mins = mins.repeat_interleave(g // finer[-1], dim=1)
    out = {"weight_codes": codes.contiguous(), "weight_group_scales": scales.contiguous(),
           "weight_group_mins": mins.contiguous()}
    if bits != 4:
        out["weight_bits"] = torch.tensor(bits, dtype=torch.int64)
    return out


def _decode(fmt: str, prefix: str, parts: dict[str, torch.Tensor], bits: int) -> dict[str, torch.Tensor]:
    if fmt == "awq":
        return decode_awq(prefix, parts, bits)
    if fmt in ("gptq", "gptq_v2"):
        return decode_gptq(prefix, parts, bits, zero_offset=1 if fmt == "gptq" else 0)
    return decode_compressed(prefix, parts, bits)


def decoded_tensors(weights: Iterable[tuple[str, torch.Tensor | None]], qc, hf_config: dict
                    ) -> Iterable[tuple[str, torch.Tensor | None]]:
    """The loader's hook: ``weights`` decoded when ``qc`` (a QuantConfig) names a checkpoint
    format of this module and config.json (``hf_config``) says how; else ``weights`` as they are."""
    if qc is None or not getattr(qc, "grouped", False) or qc.checkpoint_format not in FORMATS:
        return weights
    args = checkpoint_decoding(hf_config.get("quantization_config"))
    return weights if args is None else decode_checkpoint(weights, **args)


def checkpoint_decoding(quantization_config: dict | None) -> dict | None:
    """The :func:`decode_checkpoint` arguments (``fmt``, ``bits``, ``zero_points``) for a
    checkpoint's ``quantization_config`` (already validated by ``tpserve/quantization.py``), or
    None when its tensors need no decoder (tpserve's own names, or int8 compressed-tensors)."""
    qc = quantization_config or {}
    method = qc.get("quant_method")
    if method == "awq":
        return {"fmt": "awq", "bits": int(qc.get("bits", qc.get("w_bit", 4)))}
    if method == "gptq":
        fmt = "gptq_v2" if qc.get("checkpoint_format") == "gptq_v2" else "gptq"
        return {"fmt": fmt, "bits": int(qc.get("bits", 4))}
    if method == "compressed-tensors":
        groups = [g for g in (qc.get("config_groups") or {}).values() if isinstance(g, dict)]
        schemes = {(g["weights"].get("num_bits"), bool(g["weights"].get("symmetric", True)))
                   for g in groups if isinstance(g.get("weights"), dict)
                   and g["weights"].get("strategy") == "group"}
        if not schemes:
            return None  # int8 per channel: tpserve/models/quantization.py's checkpoint_tensors
        (bits, sym), = schemes
        return {"fmt": "compressed-tensors", "bits": int(bits), "zero_points": not sym}
    return None


def decode_checkpoint(weights: Iterable[tuple[str, torch.Tensor | None]], fmt: str, bits: int = 4,
                      zero_points: bool = False) -> Iterator[tuple[str, torch.Tensor | None]]:
    """A checkpoint's tensors with each quantized module's format tensors (``fmt``: one of
    :data:`FORMATS`) replaced by codes/scales/mins; the rest unchanged.

    A module's tensors are gathered until it has all it needs (in any order; ``zero_points``:
    a compressed-tensors scheme is asymmetric, so its modules need ``weight_zero_point``); a
    ``None`` tensor (one the loader did not read: another rank's expert) makes the module's
    outputs ``None`` too. A ``g_idx`` that comes after its module was decoded is still checked.
    Raises CheckpointError naming the tensor when one is malformed or a module lacks one."""
    if fmt not in _LEAVES:
        raise CheckpointError(f"checkpoint format {fmt!r} has no decoder; known: {', '.join(FORMATS)}")
    leaves, needed = _LEAVES[fmt]
    if zero_points and fmt == "compressed-tensors":
        needed = needed | {"weight_zero_point"}
    pending: dict[str, dict[str, torch.Tensor | None]] = {}
    done: dict[str, tuple[set[str], int, int]] = {}  # decoded modules: leaves seen, in, group
    for key, tensor in weights:
        prefix, _, leaf = key.rpartition(".")
        if leaf not in leaves:
            yield key, tensor
            continue
        if prefix in done:
            seen, in_features, g = done[prefix]
            if leaf in seen:
                raise CheckpointError(f"{key}: appears twice in the checkpoint")
            seen.add(leaf)
            if leaf in ("g_idx", "weight_g_idx"):
                if tensor is not None and in_features:
                    _check_g_idx(tensor, in_features, g, key)
            elif tensor is not None and (leaf != "weight_zero_point" or bool(tensor.any())):
                raise CheckpointError(f"{key}: comes after {prefix}'s weights were decoded without it "
                                      "(config.json's quantization_config does not declare it)")
            continue
        parts = pending.setdefault(prefix, {})
        if leaf in parts:
            raise CheckpointError(f"{key}: appears twice in the checkpoint")
        parts[leaf] = tensor
        if not needed <= parts.keys():
            continue
        del pending[prefix]
        if any(v is None for v in parts.values()):
            done[prefix] = (set(parts), 0, 0)
            for name in ("weight_codes", "weight_group_scales", "weight_group_mins"):
                yield f"{prefix}.{name}", None
            continue
        try:
            decoded = _decode(fmt, prefix, parts, bits)
        except CheckpointError as e:
            msg = str(e)
            raise CheckpointError(msg if msg.startswith(prefix) else f"{prefix}: {msg}") from None
        in_features = decoded["weight_codes"].shape[1]
        done[prefix] = (set(parts), in_features, in_features // decoded["weight_group_scales"].shape[1])
        for name, value in decoded.items():
            yield f"{prefix}.{name}", value
    for prefix, parts in pending.items():
        missing = sorted(needed - parts.keys())
        raise CheckpointError(f"{prefix}: the checkpoint has {', '.join(sorted(parts))} but no "
                              f"{', '.join(missing)} ({fmt} format)")
