"""gpt-oss checkpoints under the decoder's names, MXFP4 expert weights dequantized as they are read.

A gpt-oss layer's sparse block is stored as (E experts, H hidden, I one expert's intermediate
size)::

    mlp.router.weight [E, H], mlp.router.bias [E]          -> mlp.gate.weight / .bias
    mlp.experts.gate_up_proj [E, H, 2I]                    transposed; columns gate, up, gate, ...
    mlp.experts.gate_up_proj_bias [E, 2I]                  interleaved alike
    mlp.experts.down_proj [E, I, H], down_proj_bias [E, H]

or, in the released MXFP4 checkpoints, each projection as ``<proj>_blocks`` (uint8
``[E, rows, cols / 32, 16]``: two 4-bit e2m1 codes a byte, the low nibble first) and
``<proj>_scales`` (uint8 ``[E, rows, cols / 32]``: the e8m0 exponent, biased by 127, of each 32
values), with rows the output features (gate_up: 2I rows, gate and up interleaved; down: H) and
cols the input features. Value ``j`` of a group is ``E2M1[code_j] * 2 ** (scale - 127)``.

:func:`gpt_oss_names` yields them as one expert's tensors, ``mlp.experts.{e}.gate_proj.weight
[I, H]``, ``up_proj``, ``down_proj.weight [H, I]`` and the matching ``.bias``, in float32
(e2m1 times a power of two is exact in bf16 and fp16 alike unless it leaves their range), one
expert at a time, so that a layer's experts are never all dequantized at once; or, with
``codes`` (the default for an MXFP4 checkpoint: ``tpserve/quantization.py``), as the
group-quantized experts' codes, scales and mins (:func:`mxfp4_codes`: exact, 5-bit codes that
the grouped-expert kernel holds in 6 bits, ``tpserve/models/moe_group.py``).
"""
from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator

import torch

from tpserve.models.errors import CheckpointError

# e2m1 codes 0..15: sign bit 3, then the magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
GROUP = 32  # values per scale

_EXPERTS = re.compile(r"(?P<block>.+\.mlp)\.experts\.(?P<proj>gate_up_proj|down_proj)"
                      r"(?P<leaf>|_bias|_blocks|_scales)")


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``blocks [..., G, 16]`` uint8 and ``scales [..., G]`` uint8 -> float32 ``[..., G * 32]``."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise CheckpointError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if (blocks.dim() < 2 or blocks.shape[-1] != GROUP // 2
            or tuple(blocks.shape[:-1]) != tuple(scales.shape)):
        raise CheckpointError(f"MXFP4 blocks {tuple(blocks.shape)} do not match scales "
                              f"{tuple(scales.shape)}: "
                              f"expected blocks [..., G, {GROUP // 2}] and scales [..., G]")
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32)
    codes = torch.stack(((blocks & 0x0F).long(), (blocks >> 4).long()), dim=-1)  # [..., G, 16, 2]
    values = lut[codes].flatten(-2)  # [..., G, 32]: low nibble, high nibble, ...
    values = torch.ldexp(values, scales.to(torch.int32)[..., None] - 127)
    return values.flatten(-2)


def mxfp4_codes(blocks: torch.Tensor, scales: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``blocks [..., G, 16]`` / ``scales [..., G]`` (uint8) as group codes, scales and mins (group
    32, ``group_quant.py``'s representation) of exactly the values :func:`dequantize_mxfp4`
    gives: code ``2 v + 12`` (0..24) for the e2m1 value v, scale ``2^(s - 128)``, min ``-12``
    scales. An exponent above 252 (values beyond 2^125) is refused: its min overflows float32."""
    values = dequantize_mxfp4(blocks, torch.full_like(scales, 128))  # 2 v: the exponent 1
    if scales.numel() and int(scales.max()) > 252:
        raise CheckpointError(f"MXFP4 scale exponent {int(scales.max()) - 127}: beyond what float32 scales "
                              "and mins hold (up to 125)")
    codes = (values + 12).to(torch.uint8)
    group_scales = torch.ldexp(torch.ones(scales.shape), scales.to(torch.int32) - 128)
    return codes, group_scales, -12 * group_scales


def gpt_oss_names(tensors: Iterable[tuple[str, torch.Tensor | None]],
                  skip: Callable[[str], bool] | None = None, codes: bool = False
                  ) -> Iterator[tuple[str, torch.Tensor | None]]:
    """gpt-oss checkpoint tensors as the decoder's per-expert names (see the module docstring);
    every other tensor passes unchanged. ``skip``: a test of the per-expert weight names this
    rank does not hold (expert parallelism); they come as ``(name, None)``, not dequantized.
    ``codes``: MXFP4 experts as group codes, scales and mins (:func:`mxfp4_codes`)."""
    pending: dict[str, tuple[str, torch.Tensor]] = {}  # MXFP4 halves waiting for their pair
    for key, tensor in tensors:
        if ".mlp.router." in key:
            yield key.replace(".mlp.router.", ".mlp.gate."), tensor
            continue
        m = _EXPERTS.fullmatch(key)
        if m is None:
            yield key, tensor
            continue
        if tensor is None:
            raise CheckpointError(f"{key}: gpt-oss experts are stored together and must be read")
        block, proj, leaf = m["block"], m["proj"], m["leaf"]
        if leaf in ("_blocks", "_scales"):
            base = f"{block}.experts.{proj}"
            other = pending.pop(base, None)
            if other is None:
                pending[base] = (leaf, tensor)
                continue
            blocks, scales = (tensor, other[1]) if leaf == "_blocks" else (other[1], tensor)
            if blocks.dim() != 4 or scales.dim() != 3 or blocks.shape[0] != scales.shape[0]:
                raise CheckpointError(f"{base}_blocks / _scales: expected [E, rows, G, 16] and [E, rows, G], "
                                      f"got {tuple(blocks.shape)} and {tuple(scales.shape)}")
            for e in range(blocks.shape[0]):
                if skip is not None and all(skip(name) for name in _expert_names(block, proj, e)):
                    yield from ((name, None) for name in _expert_names(block, proj, e))
                    continue
                try:
                    if codes:  # [rows, cols] codes, [rows, cols / 32] scales and mins
                        parts = dict(zip(_GROUP_LEAVES, mxfp4_codes(blocks[e], scales[e])))
                    else:  # [rows, cols]: out x in
                        parts = {"weight": dequantize_mxfp4(blocks[e], scales[e])}
                except CheckpointError as err:
                    raise CheckpointError(f"{base}_blocks: {err}") from None
                for leaf_name, part in parts.items():
                    yield from _expert_weights(block, proj, e, part, key, leaf_name)
            continue
        if leaf == "_bias":
            if tensor.dim() != 2:
                raise CheckpointError(f"{key}: expected [E, features], got {tuple(tensor.shape)}")
            for e in range(tensor.shape[0]):
                if proj == "gate_up_proj":
                    yield f"{block}.experts.{e}.gate_proj.bias", tensor[e, 0::2]
                    yield f"{block}.experts.{e}.up_proj.bias", tensor[e, 1::2]
                else:
                    yield f"{block}.experts.{e}.down_proj.bias", tensor[e]
            continue
        if tensor.dim() != 3:
            raise CheckpointError(f"{key}: expected [E, in, out], got {tuple(tensor.shape)}")
        for e in range(tensor.shape[0]):  # stored input-major: one expert's weight transposed
            yield from _expert_weights(block, proj, e, tensor[e].t(), key)
    if pending:
        names = ", ".join(f"{base}{leaf}" for base, (leaf, _) in sorted(pending.items()))
        raise CheckpointError(f"MXFP4 tensors without their pair (_blocks needs _scales): {names}")


_GROUP_LEAVES = ("weight_codes", "weight_group_scales", "weight_group_mins")


def _expert_names(block: str, proj: str, e: int) -> tuple[str, ...]:
    parts = ("down_proj",) if proj == "down_proj" else ("gate_proj", "up_proj")
    return tuple(f"{block}.experts.{e}.{part}.weight" for part in parts)


def _expert_weights(block: str, proj: str, e: int, weight: torch.Tensor, key: str,
                    leaf: str = "weight") -> Iterator[tuple[str, torch.Tensor]]:
    """One expert's ``[out, in]`` weight of ``proj`` (or its codes, scales or mins: ``leaf``)
    under its per-expert names."""
    if proj == "down_proj":
        yield f"{block}.experts.{e}.down_proj.{leaf}", weight
        return
    if weight.shape[0] % 2:
        raise CheckpointError(f"{key}: gate_up_proj needs an even number of output features, "
                              f"got {weight.shape[0]}")
    yield f"{block}.experts.{e}.gate_proj.{leaf}", weight[0::2]
    yield f"{block}.experts.{e}.up_proj.{leaf}", weight[1::2]
