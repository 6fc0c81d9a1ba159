"""Reading a GGUF tensor's bytes and dequantizing them.

:func:`raw_blocks` is a read-only numpy view of one tensor's bytes in the memory-mapped file:
float32 / float16 values in the tensor's shape, or (BF16 and every block type) one row of bytes
per row of the tensor. :func:`dequantize` turns that view into float32 values with the
``gguf`` package's reference dequantizer (``gguf.quants.dequantize``, numpy), the same code
transformers' GGUF loader runs, so ``--quantization none`` reproduces that reference exactly.
"""
from __future__ import annotations

import numpy as np

from tpserve.gguf_file.reader import GGUFFileError, TensorEntry


def _sizes(type_name: str) -> tuple[int, int]:
    import gguf
    return gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]]


def raw_blocks(buf: np.ndarray, t: TensorEntry) -> np.ndarray:
    """The bytes of ``t`` in ``buf`` (the whole file as uint8), shaped per row (see above)."""
    data = buf[t.offset:t.offset + t.nbytes]
    if data.size != t.nbytes:
        raise GGUFFileError(f"{t.file}: tensor {t.name!r}: {t.nbytes} bytes expected, "
                            f"{data.size} in the file")
    if t.type_name == "F32":
        return data.view(np.float32).reshape(t.shape)
    if t.type_name == "F16":
        return data.view(np.float16).reshape(t.shape)
    block, type_size = _sizes(t.type_name)
    return data.reshape(*t.shape[:-1], t.shape[-1] // block * type_size)


def dequantize(raw: np.ndarray, t: TensorEntry) -> np.ndarray:
    """Float32 values of ``t`` (shape ``t.shape``) from its :func:`raw_blocks` view."""
    if t.type_name == "F32":
        return np.array(raw, dtype=np.float32)
    if t.type_name == "F16":
        return raw.astype(np.float32)
    import gguf
    out = gguf.quants.dequantize(np.asarray(raw), gguf.GGMLQuantizationType[t.type_name])
    if tuple(out.shape) != tuple(t.shape):
        raise GGUFFileError(f"{t.file}: tensor {t.name!r} dequantizes to shape {list(out.shape)}, "
                            f"expected {list(t.shape)}")
    return out.astype(np.float32, copy=False)
