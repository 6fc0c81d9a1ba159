"""llama.cpp's tensor names as Hugging Face names, and the reverse of its q/k row permutation.

A GGUF tensor maps to one Hugging Face tensor, or to several, each with the index of its part:
a mixture of experts' stacked ``ffn_{gate,up,down}_exps`` [E, ...] to one per expert (an
index into the first dimension), Phi-3's fused ``attn_qkv`` and ``ffn_up`` (gate and up) to
one per projection (a slice of the rows).

llama.cpp's converter reorders the rows of a llama-architecture model's q and k projections
(Mixtral's too: it is written as ``llama``; SmolLM3's as well): within each head of ``d`` rows,
Hugging Face's order (the first halves of the rotary pairs, then the second halves) becomes
interleaved pairs, row ``h*d + 2*i + j`` holding Hugging Face's row ``h*d + j*d/2 + i``. Qwen and Gemma models
are written unpermuted (their rope kernel takes halves). :meth:`TensorNames.row_permutation`
gives the index array that puts the rows back, for a weight, a bias, or group codes, scales and
mins. Gemma's (1 + w) norm weights are written as 1 + w; :meth:`TensorNames.norm_shift` takes
them back.
"""
from __future__ import annotations

import re

import numpy as np

from tpserve.gguf_file.reader import TensorEntry
from tpserve.models.spec import ModelSpec

_GLOBAL = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
           "output.weight": "lm_head.weight"}
# blk.N.<gguf> -> model.layers.N.<hf>; "{moe}" is the spec's sparse block (mlp / block_sparse_moe).
_LAYER = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "post_attention_norm": "post_attention_layernorm",  # gpt-oss's norm before its experts
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "{moe}.gate",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate", "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj", "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
# Gemma's layer: ffn_norm is the norm before the MLP, and post_attention_norm (as gpt-oss's
# name) and post_ffw_norm follow attention and MLP.
_GEMMA_LAYER = dict(_LAYER, ffn_norm="pre_feedforward_layernorm", post_ffw_norm="post_feedforward_layernorm")
# Tensors that are the config's, read with the metadata (tpserve/gguf_file/config.py), not weights.
CONFIG_TENSORS = frozenset({"rope_factors_long.weight", "rope_factors_short.weight"})
_EXPERTS = {"ffn_gate_exps": 0, "ffn_up_exps": 1, "ffn_down_exps": 2}  # index into expert_proj_names
_LAYER_KEY = re.compile(r"blk\.(?P<layer>\d+)\.(?P<name>[a-z_]+?)(?:\.(?P<expert>\d+))?"
                        r"\.(?P<leaf>weight|bias)")
_MERGED = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up", "up_proj": "gate_up"}


def qk_row_permutation(rows: int, heads: int) -> np.ndarray:
    """Index array ``p`` with ``hf = gguf[p]`` for a permuted q (or k) projection of
    ``heads`` heads."""
    d = rows // heads
    return np.arange(rows).reshape(heads, d // 2, 2).swapaxes(1, 2).reshape(-1)


class TensorNames:
    """The name mapping of one model (its architecture, experts and heads)."""

    def __init__(self, spec: ModelSpec):
        self.spec = spec
        self.permuted = spec.architecture in ("LlamaForCausalLM", "MixtralForCausalLM", "SmolLM3ForCausalLM")
        # llama.cpp writes Gemma's (1 + w) norm weights as 1 + w: taken back to w (norm_shift)
        self.gemma = spec.gemma_norms
        self._layer = _GEMMA_LAYER if self.gemma else _LAYER
        self.fused = spec.architecture == "Phi3ForCausalLM"
        self._perms: dict[tuple[int, int], np.ndarray] = {}

    def hf_names(self, t: TensorEntry) -> list[tuple[str, int | slice | None]]:
        """``[(hf name, part)]`` for the GGUF tensor ``t`` ([] if unknown): part None (the whole
        tensor), an expert's index, or a slice of rows (a fused projection's part)."""
        if t.name in _GLOBAL:
            return [(_GLOBAL[t.name], None)]
        m = _LAYER_KEY.fullmatch(t.name)
        if m is None:
            return []
        prefix = f"model.layers.{m['layer']}"
        spec, name, leaf = self.spec, m["name"], m["leaf"]
        if name == "attn_sinks" and leaf == "weight":  # gpt-oss: a parameter of its own, no leaf
            return [(f"{prefix}.self_attn.sinks", None)]
        if name in _EXPERTS:
            if m["expert"] is not None or len(t.shape) != (3 if leaf == "weight" else 2):
                return []
            proj = spec.expert_proj_names[_EXPERTS[name]]
            return [(f"{prefix}.{spec.moe_module}.experts.{e}.{proj}.{leaf}", e) for e in range(t.shape[0])]
        if m["expert"] is not None:  # older Mixtral files: blk.N.ffn_gate.E.weight, one per expert
            index = {"ffn_gate": 0, "ffn_up": 1, "ffn_down": 2}.get(name)
            if index is None:
                return []
            proj = spec.expert_proj_names[index]
            return [(f"{prefix}.{spec.moe_module}.experts.{m['expert']}.{proj}.{leaf}", None)]
        if self.fused and name in ("attn_qkv", "ffn_up"):  # Phi-3: q/k/v and gate/up rows in one
            q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
            ffn = spec.intermediate_size
            parts = ((("self_attn.q_proj", q), ("self_attn.k_proj", kv), ("self_attn.v_proj", kv))
                     if name == "attn_qkv" else (("mlp.gate_proj", ffn), ("mlp.up_proj", ffn)))
            if len(t.shape) < 1 or t.shape[0] != sum(rows for _, rows in parts):
                return []
            out, row = [], 0
            for module, rows in parts:
                out.append((f"{prefix}.{module}.{leaf}", slice(row, row + rows)))
                row += rows
            return out
        hf = self._layer.get(name)
        if hf is None:
            return []
        return [(f"{prefix}.{hf.format(moe=spec.moe_module)}.{leaf}", None)]

    def norm_shift(self, hf_name: str) -> float:
        """What to add to the file's values of ``hf_name``: -1 for a Gemma norm weight (llama.cpp's
        converter stores Gemma's 1 + w), else 0."""
        return -1.0 if self.gemma and hf_name.endswith("norm.weight") else 0.0

    def row_permutation(self, hf_name: str) -> np.ndarray | None:
        """The reverse of llama.cpp's q/k row permutation for ``hf_name``, or None."""
        if not self.permuted:
            return None
        if ".self_attn.q_proj." in hf_name:
            heads = self.spec.num_heads
        elif ".self_attn.k_proj." in hf_name:
            heads = self.spec.num_kv_heads
        else:
            return None
        rows = heads * self.spec.head_dim
        key = (rows, heads)
        if key not in self._perms:
            self._perms[key] = qk_row_permutation(rows, heads)
        return self._perms[key]

    def linear_modules(self, tensors: list[TensorEntry]) -> set[str]:
        """The HF names of the linear layers' modules among ``tensors`` (2-D weights, less the
        embedding and norms)."""
        out = set()
        for t in tensors:
            if t.name == "token_embd.weight" or not t.name.endswith(".weight") or len(t.shape) < 2:
                continue
            out.update(hf.removesuffix(".weight") for hf, _ in self.hf_names(t))
        return out

    @staticmethod
    def packed_module(hf_module: str) -> str:
        """The merged layer a HF module is part of (itself when it is not merged)."""
        head, _, last = hf_module.rpartition(".")
        return f"{head}.{_MERGED[last]}" if last in _MERGED else hf_module
