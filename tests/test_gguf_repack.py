"""GGUF quantized blocks repacked into codes/scales/mins (tpserve/models/gguf/repack.py):
dequantizing the repacked tensors equals the ``gguf`` package's own dequantization exactly, for
every supported type, on blocks its quantizers write and on random valid blocks built byte-wise;
a GGUF file written and read back by the ``gguf`` package repacks the same way; bad input is
refused with the type or size named. With llama.cpp's build (``peers``): every tensor of a tiny
model that ``llama-quantize`` writes in each file type (K-quant mixes included) repacks exactly."""
from __future__ import annotations

import collections
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader, GGUFWriter
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize, quantize

from tpserve.models.errors import CheckpointError
from tpserve.models.gguf.repack import (SUPPORTED_TYPES, UnsupportedGGUFType, group_size, repack,
                                        repack_reader_tensor)
from tpserve.models.gguf.repack import dequantize as group_dequantize
from tpserve.models.group_quant import sub_scales

TYPES = [T[name] for name in SUPPORTED_TYPES]
assert {"Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K"} <= set(SUPPORTED_TYPES)
# Byte offsets of each block's fp16 fields (d, and dmin/m where the type has one).
F16_FIELDS = {T.Q8_0: [0], T.Q4_0: [0], T.Q4_1: [0, 2], T.Q5_0: [0], T.Q5_1: [0, 2],
              T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208], T.MXFP4: []}


def random_blocks(qtype, shape, seed=0) -> np.ndarray:
    """A tensor of random valid blocks (every bit pattern of the codes and sub-block scales, finite
    random fp16 super-scales of both signs), uint8 ``[*shape[:-1], bytes per row]``."""
    per_block, block_bytes = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    n = int(np.prod(shape)) // per_block
    blocks = rng.integers(0, 256, size=(n, block_bytes), dtype=np.uint8)
    for off in F16_FIELDS[qtype]:
        vals = rng.normal(size=n) * 10.0 ** rng.integers(-6, 2, size=n)
        blocks[:, off:off + 2] = vals.astype(np.float16).reshape(n, 1).view(np.uint8)
    if qtype == T.MXFP4:  # its E8M0 scale byte: every exponent float32 holds 12 * 2^(e - 128) at
        blocks[:, 0] = rng.integers(0, 253, size=n, dtype=np.uint8)
        blocks[:2, 0] = (0, 1)[:n]  # the subnormal ones
    return blocks.reshape(*shape[:-1], shape[-1] // per_block * block_bytes)


def assert_exact(qtype, raw, shape):
    codes, scales, mins, bits = repack(qtype, raw, shape)
    g = group_size(qtype)
    assert codes.dtype == np.uint8 and codes.shape == tuple(shape)
    assert scales.dtype == mins.dtype == np.float32
    assert scales.shape == mins.shape == (*shape[:-1], shape[-1] // g)
    assert bits in (4, 8) and int(codes.max()) < 2 ** bits
    want = dequantize(raw, qtype)
    assert want.dtype == np.float32 and want.shape == tuple(shape)
    got = group_dequantize(codes, scales, mins)
    np.testing.assert_array_equal(got, want)  # exact (+0 and -0 compare equal)
    # The same in torch, with fused multiply-adds: a product scale * code is exact, so no difference.
    t = torch.addcmul(torch.from_numpy(np.repeat(mins, g, -1)), torch.from_numpy(np.repeat(scales, g, -1)),
                      torch.from_numpy(codes).float())
    assert torch.equal(t, torch.from_numpy(want))
    return codes, scales, mins, bits


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_random_blocks_repack_exactly(qtype):
    per_block = GGML_QUANT_SIZES[qtype][0]
    for seed, shape in enumerate([(3, 2 * per_block), (2, 3, per_block)]):
        codes, scales, mins, bits = assert_exact(qtype, random_blocks(qtype, shape, seed), shape)
    wanted_bits = {T.Q4_0: 4, T.Q4_1: 4, T.Q4_K: 4}.get(qtype, 8)
    assert bits == wanted_bits
    assert group_size(qtype) == (16 if qtype == T.Q6_K else 32)


@pytest.mark.parametrize("qtype", [t for t in TYPES if t in (T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1)],
                         ids=lambda t: t.name)
def test_blocks_from_gguf_quantizers_repack_exactly(qtype):
    rng = np.random.default_rng(7)
    w = rng.normal(size=(8, 96)).astype(np.float32)
    w[0, :32] = 0.0  # an all-zero block (scale 0)
    raw = quantize(w, qtype)
    codes, scales, mins, _ = assert_exact(qtype, raw, w.shape)
    # Repacked, not requantized: the block scales are the file's fp16 scales.
    d = raw.reshape(-1, GGML_QUANT_SIZES[qtype][1])[:, :2].copy().view(np.float16).astype(np.float32)
    np.testing.assert_array_equal(scales.reshape(-1), d.reshape(-1))
    assert np.abs(group_dequantize(codes, scales, mins) - w).max() < 0.2 * np.abs(w).max()


def test_mxfp4_blocks_repack_exactly_as_5_bit_codes():
    """gpt-oss's experts: MXFP4 blocks from gguf's quantizer (tiny, huge and zero blocks) become
    the codes 2 v + 12 with a power-of-two scale, symmetric about 12; a scale float32's mins cannot
    hold is refused by name."""
    rng = np.random.default_rng(3)
    w = (rng.normal(size=(6, 64)) * np.exp2(rng.integers(-40, 40, size=(6, 1)))).astype(np.float32)
    w[0, :32] = 0.0
    codes, scales, mins, bits = assert_exact(T.MXFP4, quantize(w, T.MXFP4), w.shape)
    assert bits == 8 and 16 <= int(codes.max()) <= 24
    assert np.array_equal(mins, -12 * scales) and np.all(np.log2(scales) == np.round(np.log2(scales)))
    raw = random_blocks(T.MXFP4, (1, 32))
    raw[0, 0] = 253
    with pytest.raises(CheckpointError, match=r"MXFP4 block scale 2\^126"):
        repack(T.MXFP4, raw, (1, 32))


def test_a_gguf_file_read_back_repacks_like_its_blocks(tmp_path):
    """Written by GGUFWriter, read by GGUFReader: ReaderTensor.data and the reversed
    ReaderTensor.shape are what repack takes."""
    path = tmp_path / "t.gguf"
    writer = GGUFWriter(str(path), "llama")
    tensors = {}
    for i, qtype in enumerate(TYPES):
        per_block = GGML_QUANT_SIZES[qtype][0]
        shape = (4, 2 * per_block)  # [out, in]
        tensors[f"w{i}"] = (qtype, random_blocks(qtype, shape, seed=10 + i), shape)
        writer.add_tensor(f"w{i}", tensors[f"w{i}"][1], raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    for t in GGUFReader(str(path)).tensors:
        qtype, raw, shape = tensors[t.name]
        assert t.tensor_type == qtype and tuple(reversed(t.shape.tolist())) == shape
        codes, scales, mins, _ = repack_reader_tensor(t)
        ref = repack(qtype, raw, shape)
        assert np.array_equal(codes, ref[0]) and np.array_equal(scales, ref[1])
        np.testing.assert_array_equal(group_dequantize(codes, scales, mins), dequantize(t.data, qtype))


def test_unsupported_types_and_bad_sizes_are_refused():
    for qtype in (T.Q2_K, T.IQ4_NL, T.F16):
        with pytest.raises(UnsupportedGGUFType, match="cannot be repacked"):
            repack(qtype, np.zeros(64, np.uint8), (1, 256))
    assert issubclass(UnsupportedGGUFType, CheckpointError)
    raw = random_blocks(T.Q4_K, (2, 256))
    with pytest.raises(CheckpointError, match=r"expected 288 bytes \(2 blocks of 144\), got 287"):
        repack(T.Q4_K, raw.reshape(-1)[:-1], (2, 256))
    with pytest.raises(CheckpointError, match="not a whole number of 256-element blocks"):
        repack("q4_k", raw, (3, 96))
    codes, *_ = repack(int(T.Q4_K), raw, (2, 256))  # by name, by value
    with pytest.raises(TypeError, match="the tensor type comes first"):
        repack(raw, "Q4_K", (2, 256))
    assert codes.shape == (2, 256)


LLAMACPP = Path(os.environ.get("TPSERVE_LLAMACPP_DIR")
                or Path(__file__).resolve().parents[1] / ".peers" / "llamacpp")


def write_tiny_llama(path: Path, hidden=256, ffn=512, layers=2, vocab=512, heads=4) -> None:
    """A float32 llama-architecture GGUF of random weights (rows multiples of 256, so every
    K-quant applies): enough metadata for llama-quantize, no tokenizer."""
    w = GGUFWriter(str(path), "llama")
    w.add_block_count(layers)
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(heads)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_dimension_count(hidden // heads)
    w.add_file_type(0)
    rng = np.random.default_rng(0)

    def add(name, *shape):
        w.add_tensor(name, (rng.standard_normal(shape) * 0.1).astype(np.float32))
    add("token_embd.weight", vocab, hidden)
    add("output_norm.weight", hidden)
    add("output.weight", vocab, hidden)
    for i in range(layers):
        add(f"blk.{i}.attn_norm.weight", hidden)
        add(f"blk.{i}.ffn_norm.weight", hidden)
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            add(f"blk.{i}.{name}.weight", hidden, hidden)
        add(f"blk.{i}.ffn_gate.weight", ffn, hidden)
        add(f"blk.{i}.ffn_up.weight", ffn, hidden)
        add(f"blk.{i}.ffn_down.weight", hidden, ffn)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.llamacpp
@pytest.mark.timeout(300)
def test_llama_quantize_files_repack_exactly(tmp_path):
    """llama.cpp's own quantizer (scripts/peer_llamacpp.sh builds it): each file type's tensors,
    the Q6_K output layer of the K-quant mixes included, dequantize from codes/scales/mins to
    exactly the ``gguf`` package's values."""
    quantize = LLAMACPP / "bin" / "llama-quantize"
    assert quantize.is_file(), f"{quantize}: missing; run scripts/peer_llamacpp.sh"
    src = tmp_path / "tiny-f32.gguf"
    write_tiny_llama(src)
    seen = collections.Counter()
    for ftype in ("Q4_K_M", "Q5_K_M", "Q6_K", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"):
        out = tmp_path / f"tiny-{ftype}.gguf"
        run = subprocess.run([str(quantize), str(src), str(out), ftype, "1"], capture_output=True, text=True,
                             timeout=120)
        assert run.returncode == 0, run.stderr[-2000:]
        for t in GGUFReader(str(out)).tensors:
            if t.tensor_type.name in ("F32", "F16"):
                continue
            codes, scales, mins, _ = repack_reader_tensor(t)
            np.testing.assert_array_equal(group_dequantize(codes, scales, mins),
                                          dequantize(t.data, t.tensor_type),
                                          err_msg=f"{ftype}: {t.name} ({t.tensor_type.name})")
            if t.tensor_type.name == "Q6_K":  # d * sc: packed as int8 sub-scales of an fp32 d
                sub = sub_scales(torch.from_numpy(scales.reshape(-1, scales.shape[-1])))
                assert sub is not None, f"{ftype}: {t.name}: Q6_K scales not int8 multiples of one d"
            seen[t.tensor_type.name] += 1
    # (MXFP4 is written for a mixture of experts' experts only: test_mxfp4_blocks_...)
    assert set(seen) == set(SUPPORTED_TYPES) - {"MXFP4"}, seen
