"""A GGUF file's tensors as the loader's Hugging Face-named checkpoint tensors.

``tpserve/gguf_file/`` makes a model directory from a GGUF file's metadata (config, tokenizer)
and lists the file(s) in its ``gguf.json``; ``tpserve/models/loader.py`` then reads the weights
through this package instead of safetensors:

* names: llama.cpp's ``token_embd``, ``blk.N.attn_q``, ``blk.N.ffn_gate_exps``, ... become
  ``model.embed_tokens``, ``model.layers.N.self_attn.q_proj``, one
  ``...experts.E.gate_proj`` per expert (``names.py``);
* llama.cpp's converter permutes the rows of a llama-architecture (and Mixtral) model's q and
  k projections (rotary pairs interleaved, for its rope kernel); the reverse permutation
  restores the Hugging Face order (``names.py``), for float weights and for the rows of
  group codes, scales and mins alike; Gemma's norm weights, written as 1 + w, become w again;
* ``--quantization none``: every tensor is dequantized at load (``dequant.py``: numpy, equal to
  the ``gguf`` package's reference dequantizer) and cast to ``--dtype``;
* default (native): each quantized linear weight is handed to ``repack.py``, which turns its
  blocks (Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K) into group codes, scales and mins without
  requantizing, and yielded as ``<module>.weight_codes`` / ``weight_group_scales`` /
  ``weight_group_mins`` / ``weight_bits`` for the group-quantized layer
  (``tpserve/models/group_quant.py``, which gives the parts of a merged layer the finest group
  among them). A merged layer (q/k/v, gate/up) with a float part is dequantized whole. An
  untied embedding table is dequantized (a lookup, not a matmul); a quantized ``token_embd``
  that the LM head shares (no ``output.weight``) becomes the head's group codes, yielded as
  ``lm_head.weight_codes`` ..., and the embedding looks its rows up in them
  (``QuantConfig.tied_head_codes``): the table is held once, at its file's size, and the head
  runs on the 4-bit kernels instead of reading a float table each token. Float tensors stay
  float. A mixture of experts' stacked ``ffn_{gate,up,down}_exps`` are split per expert
  (``experts.{e}.<proj>.weight_codes`` ...) for the group-quantized experts of
  ``tpserve/models/moe_group.py``; gpt-oss's MXFP4 experts become exact 5-bit codes.
"""
from __future__ import annotations

import dataclasses
import importlib.util
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch

from tpserve.errors import ConfigError
from tpserve.gguf_file.reader import FLOAT_TYPES, GGUFFileError, TensorEntry, scan
from tpserve.models.errors import CheckpointError
from tpserve.models.gguf.dequant import dequantize, raw_blocks
from tpserve.models.gguf.names import CONFIG_TENSORS, TensorNames
from tpserve.models.spec import ModelSpec
from tpserve.quantization import NO_QUANTIZATION, QuantConfig, resolve_quantization



def gguf_tensors(files: list[Path]) -> list[TensorEntry]:
    """Every tensor of the model's GGUF file(s), checked (``tpserve/gguf_file/reader.py``)."""
    out = []
    try:
        for f in files:
            out += scan(f)
    except GGUFFileError as e:
        raise CheckpointError(str(e)) from None
    return out


def native_modules(tensors: list[TensorEntry], names: TensorNames) -> set[str]:
    """The HF linear modules whose weights run as group codes: quantized in the file, and so
    are the other parts of their merged layer (a q/k/v or gate/up layer with a float part is
    dequantized whole: exact, as float; a layer's experts are all one such layer)."""
    quantized: dict[str, bool] = {}
    merged: dict[str, bool] = {}
    for t in tensors:
        if t.name == "token_embd.weight" or not t.name.endswith(".weight") or len(t.shape) < 2:
            continue
        for hf, _ in names.hf_names(t):
            module = hf.removesuffix(".weight")
            quantized[module] = t.type_name not in FLOAT_TYPES
            packed = names.packed_module(module)
            merged[packed] = merged.get(packed, True) and quantized[module]
    # A layer's experts are one fused layer: group codes only where every projection of every
    # expert is quantized, else all of them dequantized.
    float_experts = {m.partition(".experts.")[0] for m, q in quantized.items() if ".experts." in m and not q}
    return {m for m, q in quantized.items() if q and merged[names.packed_module(m)]
            and m.partition(".experts.")[0] not in float_experts}


TIED_HEAD = "lm_head"


def tied_head_codes(tensors: list[TensorEntry], spec: ModelSpec) -> bool:
    """Whether the LM head is tied to a quantized ``token_embd`` that can run as its group
    codes (a type ``repack`` takes, the hidden size a whole number of its groups)."""
    if not spec.tie_word_embeddings:
        return False
    from tpserve.models.gguf.repack import SUPPORTED_TYPES
    embd = next((t for t in tensors if t.name == "token_embd.weight"), None)
    return embd is not None and embd.type_name in SUPPORTED_TYPES


def gguf_quant_config(files: list[Path], quantization: str | None, spec: ModelSpec,
                      hf_config: dict) -> QuantConfig | None:
    """The QuantConfig a GGUF model loads with: ``none`` -> None (every tensor dequantized);
    unset -> the group layout for the quantized linear weights (None for an all-float file);
    ``int8`` / ``int4`` -> that, quantized at load from the dequantized weights."""
    if quantization == NO_QUANTIZATION:
        return None
    if quantization is not None and quantization != "group":
        return resolve_quantization(quantization, hf_config)
    tensors = gguf_tensors(files)
    names = TensorNames(spec)
    native = native_modules(tensors, names)
    tied = tied_head_codes(tensors, spec)
    if not native and not tied:
        return None
    if importlib.util.find_spec("tpserve.models.gguf.repack") is None:
        raise ConfigError(
            "quantization", f"{files[0]}: running its quantized tensors natively (repacked onto tpserve's "
                            "group-quantized layers) is not available in this build; pass --quantization "
                            "none to dequantize them at load")
    from tpserve.quantization import group_quant_config

    ignore = tuple(sorted(names.linear_modules(tensors) - native))
    return group_quant_config(0, 0, ignore, tied_head_codes=tied)


def gguf_weights(files: list[Path], spec: ModelSpec, qc: QuantConfig | None, dtype: torch.dtype,
                 skip: Callable[[str], bool] | None = None) -> Iterator[tuple[str, torch.Tensor | None]]:
    """Yield ``(Hugging Face name, tensor)`` for every tensor of the GGUF model: dequantized to
    ``dtype``, or (``qc`` a group config from the file) quantized linear weights as group
    codes, scales, mins and bits. A stacked expert tensor is read one expert at a time, and an
    expert's weight that ``skip`` names (another expert-parallel rank's) comes as ``(name,
    None)``, neither dequantized nor repacked."""
    tensors = gguf_tensors(files)
    names = TensorNames(spec)
    native = native_modules(tensors, names) if qc is not None and qc.grouped and qc.from_checkpoint else set()
    maps: dict[Path, np.memmap] = {}
    try:
        for t in tensors:
            if t.name in CONFIG_TENSORS:
                continue
            targets = names.hf_names(t)
            if not targets:
                raise CheckpointError(f"{t.file}: tensor {t.name!r} has no place in a "
                                      f"{spec.architecture} model")
            buf = maps.get(t.file)
            if buf is None:
                buf = maps[t.file] = np.memmap(t.file, dtype=np.uint8, mode="r")
            raw = raw_blocks(buf, t)
            if isinstance(targets[0][1], int):  # stacked experts
                yield from _experts(t, raw, targets, native, names, dtype, skip)
                continue
            if targets[0][0].removesuffix(".weight") in native:
                yield from _native(t, raw, targets, names)
                continue
            if t.name == "token_embd.weight" and qc is not None and qc.tied_head_codes:
                yield from _native(t, raw, [(f"{TIED_HEAD}.weight", None)], names)
                continue
            full = dequantize(raw, t)
            for hf, index in targets:
                part = full if index is None else full[index]
                part = _permute(part, hf, names)
                if shift := names.norm_shift(hf):
                    part = part + np.float32(shift)
                if part.ndim == 1 and hf.endswith("shared_expert_gate.weight"):
                    part = part.reshape(1, -1)  # [H] in the file, a [1, H] linear in the model
                yield hf, torch.from_numpy(np.ascontiguousarray(part)).to(dtype)
    except GGUFFileError as e:
        raise CheckpointError(str(e)) from None
    finally:
        maps.clear()


def _experts(t: TensorEntry, raw, targets, native: set[str], names: TensorNames, dtype: torch.dtype,
             skip: Callable[[str], bool] | None) -> Iterator[tuple[str, torch.Tensor | None]]:
    """A stacked ``[E, ...]`` expert tensor's per-expert tensors (weights or biases)."""
    one = dataclasses.replace(t, shape=t.shape[1:])
    for hf, e in targets:
        module = hf.removesuffix(".weight")
        codes = module in native
        if skip is not None and skip(hf):
            leaves = ("weight_codes", "weight_group_scales", "weight_group_mins", "weight_bits")
            yield from ((f"{module}.{leaf}", None) for leaf in leaves) if codes else ((hf, None),)
        elif codes:
            yield from _native(one, raw[e], [(hf, None)], names)
        else:
            yield hf, torch.from_numpy(np.ascontiguousarray(dequantize(raw[e], one))).to(dtype)


def _permute(array, hf: str, names: TensorNames):
    perm = names.row_permutation(hf)
    return array if perm is None else array[perm]


def _native(t: TensorEntry, raw, targets, names: TensorNames) -> Iterator[tuple[str, torch.Tensor]]:
    from tpserve.models.gguf.repack import repack

    try:
        codes, scales, mins, bits = repack(t.type_name, raw, t.shape)
    except CheckpointError as e:
        raise CheckpointError(f"{t.file}: tensor {t.name!r}: {e}") from None
    for hf, part in targets:  # the whole tensor, or a fused one's rows
        module = hf.removesuffix(".weight")
        c, s, m = (codes, scales, mins) if part is None else (codes[part], scales[part], mins[part])
        perm = names.row_permutation(hf)
        if perm is not None:
            c, s, m = c[perm], s[perm], m[perm]
        yield f"{module}.weight_codes", torch.from_numpy(np.ascontiguousarray(c))
        yield f"{module}.weight_group_scales", torch.from_numpy(np.ascontiguousarray(s))
        yield f"{module}.weight_group_mins", torch.from_numpy(np.ascontiguousarray(m))
        yield f"{module}.weight_bits", torch.tensor([bits], dtype=torch.int64)
