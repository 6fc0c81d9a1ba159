"""GGUF quantized blocks -> tpserve's group-quantized representation, without losing anything.

The one entry point is :func:`repack`::

    codes, scales, mins, bits = repack(tensor_type, raw, shape)

``tensor_type``: a ``gguf.GGMLQuantizationType`` (or its int value or name, e.g. ``"Q4_K"``).
``raw``: the tensor's bytes as the ``gguf`` package's reader exposes them
(``ReaderTensor.data``: uint8, ``[..., bytes per row]``; any uint8 array of the right size is
accepted). ``shape``: the tensor's logical shape in numpy/torch order, the last axis being the
one the blocks run along: for a linear weight ``(out, in)``, i.e. ``ReaderTensor.shape``
reversed (GGUF lists ``ne[0]`` = in first). :func:`repack_reader_tensor` does that reversal.

The result is the group-quant layer's checkpoint form (``docs``: the ``weight_codes`` /
``weight_group_scales`` / ``weight_group_mins`` / ``weight_bits`` tensors)::

    w[..., i] = scales[..., i // g] * codes[..., i] + mins[..., i // g]

``codes`` uint8 ``[*shape]``; ``scales`` and ``mins`` float32 ``[*shape[:-1], shape[-1] // g]``;
``bits`` 4 or 8 (5- and 6-bit codes are stored as 8). Per type:

========  =====  ====  ==========================================================
type      group  bits  scale, min
========  =====  ====  ==========================================================
Q8_0      32     8     d, -128 d          (code = q + 128)
Q4_0      32     4     d, -8 d
Q4_1      32     4     d, m
Q5_0      32     8     d, -16 d
Q5_1      32     8     d, m
Q4_K      32     4     d * sc[j], -(dmin * m[j])   (6-bit sc/m of each sub-block)
Q5_K      32     8     d * sc[j], -(dmin * m[j])
Q6_K      16     8     d * sc[j], -32 d * sc[j]    (int8 sc, code = q + 32)
MXFP4     32     8     d, -12 d           (d = 2^(e - 128), code = 2 v + 12)
========  =====  ====  ==========================================================

MXFP4 (gpt-oss's experts) holds e2m1 values v (0, ±0.5, ±1, ±1.5, ±2, ±3, ±4, ±6) with a power
of two per block: 2 v + 12 is an integer in 0..24, so the codes are 5-bit (held in 6 bits by the
kernels, 0.75 bytes per weight against the file's 0.53) and nothing is lost.

Every scale and min is a product of an fp16 value (or a power of two) and a small integer:
exact in float32. And
every ``scale * code`` is exact too (at most 24 significant bits: Q6_K's d * sc * q is the
widest, 11 + 7 + 6), so evaluating the formula in float32 (fused multiply-add or not) gives
``gguf.quants.dequantize``'s float32 result bit for bit; ``tests/test_gguf_repack.py`` checks
each type. Other types raise :class:`UnsupportedGGUFType` naming the type.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from tpserve.models.errors import CheckpointError

QK_K = 256  # elements of a K-quant super-block
K_SCALE_BYTES = 12


class UnsupportedGGUFType(CheckpointError):
    """A GGUF tensor type :func:`repack` does not turn into codes/scales/mins."""


# type name -> (elements per block, bytes per block, group size, bits)
_LAYOUTS = {
    "Q8_0": (32, 34, 32, 8),
    "Q4_0": (32, 18, 32, 4),
    "Q4_1": (32, 20, 32, 4),
    "Q5_0": (32, 22, 32, 8),
    "Q5_1": (32, 24, 32, 8),
    "Q4_K": (QK_K, 144, 32, 4),
    "Q5_K": (QK_K, 176, 32, 8),
    "Q6_K": (QK_K, 210, 16, 8),
    "MXFP4": (32, 17, 32, 8),
}
SUPPORTED_TYPES = tuple(_LAYOUTS)


def _type_name(tensor_type) -> str:
    name = getattr(tensor_type, "name", None)
    if name is None and isinstance(tensor_type, str):
        name = tensor_type.upper()
    if name is None and isinstance(tensor_type, (int, np.integer)):
        try:
            from gguf import GGMLQuantizationType
            name = GGMLQuantizationType(int(tensor_type)).name
        except (ImportError, ValueError):
            name = f"type {int(tensor_type)}"
    return str(name)


def group_size(tensor_type) -> int:
    """The group size :func:`repack` gives ``tensor_type``'s tensors."""
    return _layout(tensor_type)[2]


def _layout(tensor_type) -> tuple[int, int, int, int]:
    name = _type_name(tensor_type)
    if name not in _LAYOUTS:
        raise UnsupportedGGUFType(f"tensor type {name} cannot be repacked into group-quantized weights; "
                                  f"supported: {', '.join(SUPPORTED_TYPES)}")
    return _LAYOUTS[name]


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """The fp16 at byte ``start`` of every block, as float32 ``[n, 1]``."""
    return np.ascontiguousarray(blocks[:, start:start + 2]).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray, run: int) -> np.ndarray:
    """Bytes ``[n, k * run]`` -> 4-bit values ``[n, 2 * k * run]``: each run of ``run`` bytes gives
    its low nibbles, then its high nibbles."""
    n = qs.shape[0]
    chunks = qs.reshape(n, -1, 1, run)
    return np.concatenate([chunks & 0x0F, chunks >> 4], axis=2).reshape(n, -1)


def _q8_0(b):
    d = _f16(b, 0)
    codes = (b[:, 2:34].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
    return codes, d, -128.0 * d


def _q4_0(b):
    d = _f16(b, 0)
    return _nibbles(b[:, 2:18], 16), d, -8.0 * d


def _q4_1(b):
    return _nibbles(b[:, 4:20], 16), _f16(b, 0), _f16(b, 2)


def _high_bits_32(qh: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1's 4 bytes of high bits (little-endian, bit j = element j) -> ``[n, 32]``."""
    return np.unpackbits(np.ascontiguousarray(qh), axis=1, bitorder="little")


def _q5_0(b):
    d = _f16(b, 0)
    codes = _nibbles(b[:, 6:22], 16) | (_high_bits_32(b[:, 2:6]) << 4)
    return codes, d, -16.0 * d


def _q5_1(b):
    codes = _nibbles(b[:, 8:24], 16) | (_high_bits_32(b[:, 4:8]) << 4)
    return codes, _f16(b, 0), _f16(b, 2)


def _k_scales_mins(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 12 bytes of Q4_K/Q5_K sub-block scales and mins -> two ``[n, 8]`` 6-bit arrays.

    Bytes 0-3 hold scales 0-3 (low 6 bits) and the top 2 bits of scales 4-7; bytes 4-7 the
    same for mins; bytes 8-11 the low 4 bits of scale 4+j (low nibble) and min 4+j (high)."""
    a, b, c = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    sc = np.concatenate([a & 0x3F, (c & 0x0F) | ((a >> 6) << 4)], axis=1)
    mn = np.concatenate([b & 0x3F, (c >> 4) | ((b >> 6) << 4)], axis=1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _q4_k(b):
    d, dmin = _f16(b, 0), _f16(b, 2)
    sc, mn = _k_scales_mins(b[:, 4:16])
    return _nibbles(b[:, 16:144], 32), d * sc, -(dmin * mn)


def _q5_k(b):
    d, dmin = _f16(b, 0), _f16(b, 2)
    sc, mn = _k_scales_mins(b[:, 4:16])
    low = _nibbles(b[:, 48:176], 32)
    # qh: 32 bytes; bit j of byte i is the fifth bit of element 32 j + i.
    qh = b[:, 16:48]
    high = ((qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1).reshape(len(b), QK_K)
    return low | (high << 4), d * sc, -(dmin * mn)


def _q6_k(b):
    n = len(b)
    # ql: 128 bytes in two halves of 64 -> each half's low nibbles (64 elements), then high.
    low = _nibbles(b[:, 0:128], 64)
    # qh: 64 bytes in two halves of 32; 2-bit field k of byte i of half h: element 128 h + 32 k + i.
    qh = b[:, 128:192].reshape(n, 2, 1, 32)
    high = ((qh >> (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]) & 3).reshape(n, QK_K)
    sc = b[:, 192:208].view(np.int8).astype(np.float32)
    scale = _f16(b, 208) * sc
    return low | (high << 4), scale, -32.0 * scale


# MXFP4's e2m1 values, doubled, by their 4-bit index (as llama.cpp's kvalues_mxfp4)
_MXFP4_DOUBLED = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=np.int16)


def _mxfp4(b):
    # the block's E8M0 byte e as a float32 d = 2^(e - 128) (half the value MXFP4 means, as the
    # values are doubled; e < 2 gives the subnormals 2^-128 and 2^-127)
    e = b[:, 0:1].astype(np.uint32)
    if e.size and int(e.max()) > 252:  # 12 * 2^(e - 128) would overflow float32
        raise CheckpointError(f"MXFP4 block scale 2^{int(e.max()) - 127}: beyond what float32 scales and "
                              "mins hold (up to 2^125)")
    d = np.where(e < 2, np.uint32(0x00200000) << e, (e - np.uint32(1)) << np.uint32(23)).astype(np.uint32)
    d = d.view(np.float32)
    codes = (_MXFP4_DOUBLED[_nibbles(b[:, 1:17], 16)] + 12).astype(np.uint8)
    return codes, d, np.float32(-12.0) * d


_DECODERS = {"Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1,
             "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k, "MXFP4": _mxfp4}


def repack(tensor_type, raw: np.ndarray, shape: Sequence[int]
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """GGUF blocks -> ``(codes uint8 [*shape], scales f32, mins f32 [*shape[:-1], cols // g], bits)``.

    ``shape``: numpy order (rows..., cols), blocks along the last axis (see the module docstring).
    Raises UnsupportedGGUFType for a type it cannot repack and CheckpointError when ``raw`` does
    not hold exactly ``shape``'s blocks."""
    if isinstance(tensor_type, np.ndarray):
        raise TypeError("repack(tensor_type, raw, shape): the tensor type comes first, then its raw blocks")
    per_block, block_bytes, g, bits = _layout(tensor_type)
    name = _type_name(tensor_type)
    shape = tuple(int(s) for s in shape)
    if not shape or any(s <= 0 for s in shape):
        raise CheckpointError(f"{name} tensor: shape {shape} has no elements")
    cols = shape[-1]
    if cols % per_block:
        raise CheckpointError(f"{name} tensor: a row of {cols} elements is not a whole number of "
                              f"{per_block}-element blocks")
    rows = int(np.prod(shape[:-1], dtype=np.int64))
    n_blocks = rows * (cols // per_block)
    data = np.asarray(raw)
    if data.dtype != np.uint8:
        data = data.view(np.uint8) if data.flags.c_contiguous else np.ascontiguousarray(data).view(np.uint8)
    if data.size != n_blocks * block_bytes:
        raise CheckpointError(f"{name} tensor of shape {shape}: expected {n_blocks * block_bytes} bytes "
                              f"({n_blocks} blocks of {block_bytes}), got {data.size}")
    blocks = np.ascontiguousarray(data).reshape(n_blocks, block_bytes)
    codes, scales, mins = _DECODERS[name](blocks)
    groups = cols // g
    return (np.ascontiguousarray(codes, dtype=np.uint8).reshape(shape),
            np.ascontiguousarray(scales, dtype=np.float32).reshape(*shape[:-1], groups),
            np.ascontiguousarray(mins, dtype=np.float32).reshape(*shape[:-1], groups), bits)


def repack_reader_tensor(tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """:func:`repack` of a ``gguf.ReaderTensor`` (its ``shape`` is GGUF's ``ne`` order, reversed here)."""
    shape = tuple(int(s) for s in reversed(list(tensor.shape)))
    return repack(tensor.tensor_type, tensor.data, shape)


def dequantize(codes: np.ndarray, scales: np.ndarray, mins: np.ndarray) -> np.ndarray:
    """``scales * codes + mins`` in float32, groups broadcast along the last axis (a reference)."""
    g = codes.shape[-1] // scales.shape[-1]
    s = np.repeat(scales.astype(np.float32), g, axis=-1)
    m = np.repeat(mins.astype(np.float32), g, axis=-1)
    return s * codes.astype(np.float32) + m
