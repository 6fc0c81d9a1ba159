"""Applying a QuantConfig (``tpserve/quantization.py``) to a model shard: int8 parameters, their
loaders, and the compressed-tensors tensors read from a checkpoint.

Before loading, :func:`prepare_model` marks every linear layer that the config quantizes:

* quantized at load (``--quantization int8``): the layer keeps its float weight and is told to
  quantize it when it is packed (``PackableLinear.quantize_at_load``);
* int8 in the checkpoint: the layer's ``weight`` becomes an int8 parameter and it gains
  ``weight_scale`` (fp32 ``[out, 1]``). Both are sharded exactly like the float weight: a
  column-parallel layer (q/k/v, gate/up, the LM head) splits the output channels, so each rank
  takes its rows of the weight and of the scales; a row-parallel layer (o_proj, down_proj)
  splits the input features, so each rank takes its columns of the weight and all the scales.

Mixture-of-experts layers (``moe.py``): a FusedMoE's experts are quantized together (an
``ignore`` list naming some of a layer's expert projections but not all is refused). At load
they get ``quantize_at_load`` (the grouped-expert kernel quantizes when it packs them, or
``prepack_experts`` in place without it); from a checkpoint ``w13_weight``/``w2_weight``
become int8 with ``w13_weight_scale [E, 2I]`` / ``w2_weight_scale [E, H]`` filled from each
expert's ``weight_scale [out, 1]`` (sharded like the rows of the weight). Routers
(``mlp.gate``, ``shared_expert_gate``) stay float under ``--quantization int8`` (small, and
the choice of experts is sensitive to them); an int8 checkpoint's routers are loaded as it
stores them (llm-compressor's recipes usually ``ignore`` them).

Packed modules (``qkv_proj``, ``gate_up_proj``) are quantized only as a whole: an ``ignore``
list naming some of their parts but not all is refused. The LM head of a model with tied
embeddings can be int8 only when quantized at load (the embedding keeps the float table).

:func:`checkpoint_tensors` turns compressed-tensors names into tpserve's: ``weight_packed``
(four int8 weights per int32, each stored + 128, low byte first) with its ``weight_shape``
becomes ``weight``; a ``weight_zero_point`` must be all zeros (symmetric) and is dropped.

Group-quantized layers (method ``"group"``: ``--quantization int4``, or a checkpoint holding
``weight_codes`` / ``weight_group_scales`` / ``weight_group_mins``) are made by
``group_quant.make_group_quant``, which also gives them their TP loaders (group-aligned row
sharding). Their routers stay float; a mixture of experts' experts are group codes too
(``moe.FusedMoE.make_group``, ``moe_group.py``): quantized at load with ``--quantization int4``,
or a checkpoint's (a GGUF file's quantized experts). A tied LM head stays the float embedding
with a group checkpoint, unless the checkpoint gives the head codes (``tied_head_codes``: a GGUF
file's quantized ``token_embd``): then the head is group-quantized and the embedding looks its
rows up in the head's codes, so the table is held once, as codes. With ``--quantization int4`` a
tied head is quantized from the embedding's float table, and the table itself is then held as
8-bit codes with a scale and a min per group of 32 (``EMBEDDING_CODES``,
``group_quant.hold_rows_as_codes``): the float table would be a third of a small model's bytes
(the 0.6B shape: 297 of 599 MiB) for rows whose codes lose less than the 4-bit layers that read
them. A checkpoint's ``<module>.weight_bits`` is checked (4 or 8) and dropped here.
"""
from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from tpserve.models.embedding import ParallelLMHead
from tpserve.models.errors import CheckpointError, UnsupportedModelError
from tpserve.models.group_quant import hold_rows_as_codes, make_group_quant
from tpserve.models.linear import RowParallelLinear
from tpserve.models.moe import FusedMoE
from tpserve.models.packed_gemm import PackableLinear
from tpserve.models.weights import attach_loader, check_shape
from tpserve.quantization import QuantConfig


# --quantization int4's token embedding: 8-bit codes with a scale and a min per group of 32 inputs.
EMBEDDING_CODES = (8, 32)


def _hf_parts(name: str, mapping: dict) -> list[str]:
    """The checkpoint modules a tpserve module holds (``...qkv_proj`` -> its q/k/v_proj)."""
    *prefix, leaf = name.split(".")
    parts = [module for module, (packed, _) in mapping.items() if packed == leaf] or [leaf]
    return [".".join([*prefix, p]) for p in parts]


def _scale_loader(layer: PackableLinear):
    """The loader of ``layer.weight_scale`` (full checkpoint tensor ``[out, 1]``)."""
    if isinstance(layer, RowParallelLinear):
        def replicated(param, loaded):
            check_shape(loaded, (layer.output_size, 1), "RowParallelLinear weight_scale")
            with torch.no_grad():
                param.copy_(loaded)
        return replicated
    if isinstance(layer, ParallelLMHead):
        def vocab_rows(param, loaded):
            check_shape(loaded, (layer.num_embeddings, 1), "ParallelLMHead weight_scale")
            real = max(0, min(layer.vocab_end, layer.num_embeddings) - layer.vocab_start)
            with torch.no_grad():
                param[:real].copy_(loaded.narrow(0, layer.vocab_start, real))
                param[real:].fill_(1.0)
        return vocab_rows
    return layer.weight_loader  # column-parallel: rows of the scales, like rows of the weight


def prepare_model(model: nn.Module, qc: QuantConfig) -> int:
    """Mark (and, for int8 checkpoints, re-type) the layers ``qc`` quantizes; returns how many."""
    mapping = model.packed_modules_mapping
    count = 0
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if qc.grouped and not qc.from_checkpoint and embed is not None:
        # packed with the model, after the linear layers (packed_gemm.prepack_model)
        embed.prepack_rows = functools.partial(hold_rows_as_codes, embed, *EMBEDDING_CODES)
    for name, layer in model.named_modules():
        if isinstance(layer, FusedMoE):
            count += _prepare_experts(name, layer, qc)
            continue
        if not isinstance(layer, PackableLinear):
            continue
        if getattr(layer, "is_router", False) and (qc.grouped or not qc.from_checkpoint):
            continue
        parts = _hf_parts(name, mapping)
        flags = {qc.quantizes(p) for p in parts}
        if len(flags) > 1:
            raise UnsupportedModelError(
                "quantization_config.ignore", f"{', '.join(parts)} are one fused layer in tpserve: "
                                              "ignore all of them or none")
        if not flags.pop():
            continue
        tied = isinstance(layer, ParallelLMHead) and model.spec.tie_word_embeddings
        if qc.grouped:
            if tied and qc.from_checkpoint and not qc.tied_head_codes:
                continue  # the head is the (float) embedding
            make_group_quant(layer, qc.from_checkpoint, qc.group_size, qc.bits)
            if tied and qc.from_checkpoint:  # the embedding reads the head's codes
                model.model.embed_tokens.read_rows_from(layer)
            count += 1
            continue
        if tied and qc.from_checkpoint:
            raise UnsupportedModelError(
                "quantization_config.ignore", "an int8 lm_head with tie_word_embeddings is not "
                                              "supported; add 'lm_head' to ignore")
        layer.int8_activations = qc.int8_activations
        count += 1
        if not qc.from_checkpoint:
            layer.quantize_at_load = True
            continue
        loader = layer.weight.weight_loader
        weight = torch.empty(layer.weight.shape, dtype=torch.int8, device=layer.weight.device)
        layer.weight = attach_loader(nn.Parameter(weight, requires_grad=False), loader)
        scale = torch.empty(layer.weight.shape[0], 1, dtype=torch.float32, device=weight.device)
        layer.weight_scale = attach_loader(nn.Parameter(scale, requires_grad=False), _scale_loader(layer))
    return count


def _prepare_experts(name: str, layer: FusedMoE, qc: QuantConfig) -> int:
    """Mark one layer's experts for int8 or group codes (all or none of them); returns 1 if
    quantized."""
    parts = [f"{name}.{e}.{proj}" for e in range(layer.num_experts) for proj in layer.proj_names]
    flags = {qc.quantizes(p) for p in parts}
    if len(flags) > 1:
        raise UnsupportedModelError(
            "quantization_config.ignore", f"the experts of {name} are one fused layer in tpserve: "
                                          "ignore all of their projections or none")
    if not flags.pop():
        return 0
    if qc.grouped:
        layer.make_group(qc.from_checkpoint, qc.group_size, qc.bits)
        return 1
    layer.int8_activations = qc.int8_activations
    if qc.from_checkpoint:
        layer.make_int8()
    else:
        layer.quantize_at_load = True
    return 1


def unpack_int32(packed: torch.Tensor, shape: torch.Tensor, key: str) -> torch.Tensor:
    """compressed-tensors' pack-quantized 8-bit weights -> int8 ``[N, K]``."""
    n, k = (int(v) for v in shape.tolist())
    if packed.dtype != torch.int32 or packed.dim() != 2 or packed.shape[0] != n or packed.shape[1] != -(-k // 4):
        raise CheckpointError(f"{key}: expected int32 [{n}, {-(-k // 4)}] for weight_shape "
                              f"[{n}, {k}], got {packed.dtype} {tuple(packed.shape)}")
    # Little-endian words: byte j of a word is weight 4i + j, stored + 128.
    u8 = packed.contiguous().view(torch.uint8)[:, :k]
    return (u8.to(torch.int16) - 128).to(torch.int8)


def checkpoint_tensors(weights: Iterable[tuple[str, torch.Tensor]]
                       ) -> Iterator[tuple[str, torch.Tensor]]:
    """A checkpoint's tensors with compressed-tensors names mapped onto tpserve's parameters."""
    packed: dict[str, torch.Tensor] = {}
    shapes: dict[str, torch.Tensor] = {}
    for key, tensor in weights:
        prefix, _, leaf = key.rpartition(".")
        if leaf == "weight_bits":
            bits = tensor.reshape(-1).tolist() if tensor is not None else [4]
            if len(bits) != 1 or bits[0] not in (4, 8):
                raise CheckpointError(f"{key}: expected one value, 4 or 8, got {bits}")
            continue
        if leaf == "weight_zero_point":
            if bool(tensor.any()):
                raise CheckpointError(f"{key}: non-zero zero points (asymmetric int8) are not supported")
            continue
        if leaf in ("weight_packed", "weight_shape"):
            (packed if leaf == "weight_packed" else shapes)[prefix] = tensor
            if prefix in packed and prefix in shapes:
                words, shape = packed.pop(prefix), shapes.pop(prefix)
                # words None: a tensor the loader did not read (another rank's expert)
                yield f"{prefix}.weight", None if words is None else unpack_int32(words, shape, key)
            continue
        yield key, tensor
    for prefix in packed:
        raise CheckpointError(f"{prefix}.weight_packed: no {prefix}.weight_shape in the checkpoint")
    for prefix in shapes:
        raise CheckpointError(f"{prefix}.weight_shape: no {prefix}.weight_packed in the checkpoint")
