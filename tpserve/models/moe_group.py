"""Group-quantized experts of a mixture-of-experts layer (``moe.py``'s FusedMoE): 4-, 6- or 8-bit
codes with a scale and a min per group of inputs, ``group_quant.py``'s representation, run by the
C++ grouped-expert kernel with int8 activations per group (``moe_kernel.pack_group_experts``).

Two sources, as for the dense group layers:

* a checkpoint (a GGUF file's quantized ``ffn_{gate,up,down}_exps``, split per expert by the
  GGUF loader): each expert's ``experts.{e}.{proj}.weight_codes`` / ``weight_group_scales`` /
  ``weight_group_mins``. This rank keeps its share: intermediate-parallel, its rows of gate and
  up and its columns of down (a group the split cuts becomes finer groups of its scale and min,
  exact; a share that is not whole groups of 16 is a CheckpointError naming the sizes);
  expert-parallel, its whole experts. Once a layer has every piece, they are stacked (gate and
  up of different groups, a Q4_K gate beside a Q6_K up, share the finer group, coarser scales
  repeated: exact) and, where the kernel runs, packed at once: loading holds one layer's codes
  (a byte per weight) beside the packed model, not the whole model's. gpt-oss's experts (biases,
  clamped SwiGLU) are packed by ``prepack_experts``, once their biases are loaded too.
* quantized at load (``--quantization int4``): the float experts load as usual and each is
  quantized when packed (``group_quant.quantize_groups``: round-to-nearest, asymmetric), with
  the configured group, or, where a projection's inputs on this rank are not a whole number of
  such groups (a tensor-parallel split of the intermediate size), the largest multiple of 16
  below it that divides them (``group_quant.fit_group``, as for the dense layers).

Where the kernel cannot run (no C++ operators, ``TPSERVE_PREPACK=0``, a GPU) the stacked codes
stay, and the torch path (``moe.experts_reference``) dequantizes each expert its tokens use.
"""
from __future__ import annotations

import functools
import math

import torch
from torch import nn

from tpserve.models.errors import CheckpointError
from tpserve.models.group_quant import dequantize, fit_group, quantize_groups
from tpserve.models.weights import attach_loader, check_shape

# The parts of one expert, as FusedMoE's loader names them.
GATE, UP, DOWN = "gate", "up", "down"
LEAVES = ("weight_codes", "weight_group_scales", "weight_group_mins")
Triple = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # codes, scales, mins


class GroupStack:
    """One projection of every local expert as codes ``[E, N, K]``, scales and mins ``[E, N, G]``;
    indexing gives an expert's dequantized fp32 weight (what ``experts_reference`` multiplies)."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor):
        self.codes, self.scales, self.mins = codes, scales, mins
        self.shape = codes.shape

    def __getitem__(self, e: int) -> torch.Tensor:
        return dequantize(self.codes[e], self.scales[e], self.mins[e])

    def parts(self) -> Triple:
        return self.codes, self.scales, self.mins


def finest_group(parts: list[Triple], what: str) -> list[Triple]:
    """``parts`` (codes, scales, mins of weights with the same inputs) with every scale and min
    at the finest group among them (coarser ones repeated: exact); a CheckpointError where a
    group does not divide the others."""
    k = parts[0][0].shape[-1]
    groups = [k // p[1].shape[-1] for p in parts]
    g = min(groups)
    out = []
    for (codes, scales, mins), own in zip(parts, groups):
        if own % g:
            raise CheckpointError(f"{what}: group sizes {sorted(set(groups))} do not divide one another")
        r = own // g
        out.append((codes, scales.repeat_interleave(r, dim=-1), mins.repeat_interleave(r, dim=-1))
                   if r > 1 else (codes, scales, mins))
    return out


def _stack(parts: list[Triple], what: str) -> Triple:
    parts = finest_group(parts, what)
    return tuple(torch.stack([p[i] for p in parts]) for i in range(3))


class GroupExperts:
    """The group codes of one FusedMoE (``moe.group``): its checkpoint loaders, the stacking,
    and the packing (see the module docstring)."""

    def __init__(self, moe: nn.Module, from_checkpoint: bool, group_size: int, bits: int, kernel=None):
        self.moe = moe
        self.kernel = kernel  # tpserve.models.moe_kernel, or None where it is not built
        self.from_checkpoint = from_checkpoint
        self.group_size, self.bits = group_size, bits or 4
        self.pieces: dict[tuple[int, str, str], torch.Tensor] = {}
        self.stacks: tuple[GroupStack, GroupStack] | None = None  # unpacked codes (torch path)
        self.device = device = moe.w13_weight.device
        if from_checkpoint:
            moe.w13_weight = moe.w2_weight = None  # no float experts in the checkpoint
            for proj in ("w13", "w2"):
                for leaf in LEAVES:
                    p = nn.Parameter(torch.empty(0, dtype=torch.uint8, device=device), requires_grad=False)
                    setattr(moe, f"{proj}_{leaf}", attach_loader(p, functools.partial(self.load, leaf)))

    # ---- a checkpoint's pieces -----------------------------------------------------------
    def load(self, leaf: str, param: nn.Parameter, loaded: torch.Tensor, shard: tuple) -> None:
        """Keep this rank's share of one expert's codes, scales or mins (``leaf``); ``shard``:
        ``(expert id, GATE | UP | DOWN)``."""
        moe = self.moe
        expert, part = shard
        if expert is None:
            raise CheckpointError("fused expert codes are not supported; expected one tensor per expert")
        if not moe.expert_start <= expert < moe.expert_start + moe.num_local_experts:
            return  # another rank's expert
        full_i, h = moe.intermediate_size, moe.hidden_size
        rows, cols = (h, full_i) if part == DOWN else (full_i, h)
        what = f"FusedMoE expert {part} {leaf}"
        if leaf == "weight_codes":
            if loaded.dtype != torch.uint8:
                raise CheckpointError(f"{what}: expected uint8 codes, got {loaded.dtype}")
            check_shape(loaded, (rows, cols), what)
        else:
            groups = loaded.shape[1] if loaded.dim() == 2 else 0
            whole = groups > 0 and cols % groups == 0 and (cols // groups) % 16 == 0
            if loaded.dim() != 2 or loaded.shape[0] != rows or not whole:
                raise CheckpointError(f"{what}: expected [{rows}, {cols} // group] with a group that is a "
                                      f"multiple of 16 dividing {cols}, got {tuple(loaded.shape)}")
            g = cols // groups
            loaded = loaded.float()
        local = moe.intermediate_size_per_rank
        if local != full_i:
            start = moe.tp.rank * local
            if part != DOWN:
                loaded = loaded.narrow(0, start, local)
            elif leaf == "weight_codes":
                loaded = loaded.narrow(1, start, local)
            else:
                # A group cut by the split becomes finer groups with its scale and min (exact).
                fine = math.gcd(g, start, local)
                if fine % 16:
                    raise CheckpointError(
                        f"{what}: this rank's {local} of the {full_i} intermediate features (from {start}) "
                        f"are not whole groups of 16 or of {g}; choose a tensor-parallel size that splits "
                        "them so, or --enable-expert-parallel")
                if fine < g:
                    loaded = loaded.repeat_interleave(g // fine, dim=1)
                loaded = loaded.narrow(1, start // fine, local // fine)
            loaded = loaded.clone(memory_format=torch.contiguous_format)  # not the whole tensor's
        self.pieces[(expert - moe.expert_start, part, leaf)] = loaded
        if len(self.pieces) == 3 * len(LEAVES) * moe.num_local_experts:
            self._stack_pieces()

    def _piece(self, e: int, part: str) -> Triple:
        return tuple(self.pieces[(e, part, leaf)] for leaf in LEAVES)

    def _stack_pieces(self) -> None:
        E = self.moe.num_local_experts
        w13 = []
        for e in range(E):
            gate, up = finest_group([self._piece(e, GATE), self._piece(e, UP)], "FusedMoE expert gate/up")
            w13.append(tuple(torch.cat([a, b]) for a, b in zip(gate, up)))
        w2 = [self._piece(e, DOWN) for e in range(E)]
        self.pieces.clear()
        named = ((w13, "FusedMoE experts' gate/up"), (w2, "FusedMoE experts' down"))
        self.stacks = tuple(GroupStack(*(t.to(self.device) for t in _stack(parts, what)))
                            for parts, what in named)
        if self.moe.plain_experts:  # (biased experts wait for their biases: prepack_experts)
            self.pack()

    # ---- quantizing at load, packing -----------------------------------------------------
    def quantize(self) -> None:
        """At load: the float experts -> stacked codes (once), the float weights freed."""
        moe = self.moe
        if self.from_checkpoint or self.stacks is not None or moe.w13_weight.numel() == 0:
            return
        w13, w2 = moe.w13_weight.detach(), moe.w2_weight.detach()
        g13, g2 = (fit_group(w.shape[2], self.group_size, "FusedMoE") for w in (w13, w2))
        stacks = []
        for w, g in ((w13, g13), (w2, g2)):
            parts = [quantize_groups(w[e], g, self.bits) for e in range(w.shape[0])]
            stacks.append(GroupStack(*(torch.stack([p[i] for p in parts]) for i in range(3))))
        self.stacks = tuple(stacks)
        for p in (moe.w13_weight, moe.w2_weight):
            p.data = p.data.new_empty(0)

    def pack(self) -> bool:
        """Hand the stacked codes to the C++ kernel where it runs (freeing them); whether it did."""
        self.quantize()
        if self.stacks is None or self.kernel is None or not self.kernel.ops_ready():
            return False
        w13, w2 = self.stacks
        packed = self.kernel.pack_group_experts(w13.parts(), w2.parts(), int(self.moe.num_experts),
                                                int(self.moe.expert_start))
        if packed is None:
            return False
        self.moe.packed = packed
        self.stacks = None
        return True
