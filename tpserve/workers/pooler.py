"""Pooler: what the pooling rank (rank 0) does with a step's pooling rows (--runner pooling).

The forward's final hidden states are identical on every rank, so only rank 0 pools: the
SamplePlan (rank 0's alone) names each span of rows (``pool_starts``/``pool_ends``), this
module sums each span in float32 (one row for LAST, SCORE and CLS; a chunk's rows for MEAN)
and, for classify, applies the score head. The engine finishes the vectors in numpy
(tpserve/pooling.py: mean, dimensions, normalisation, sigmoid). No LM head runs.

The score head ``[labels, hidden]`` (float32, rank 0 only) is read straight from the
checkpoint, so no other rank takes part:

- a ``*ForSequenceClassification`` checkpoint: its ``score.weight``;
- a causal LM read as a yes/no reranker: ``W[yes] - W[no]`` from the LM head's rows of the
  two score tokens (``lm_head.weight``, or the embedding when tied), since
  ``logit[yes] - logit[no] = (W[yes] - W[no]) . h``.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open

from tpserve.models.loader import checkpoint_files

log = logging.getLogger("tpserve.pooler")


def _read_rows(path: Path, names: tuple[str, ...], rows: list[int] | None) -> torch.Tensor | None:
    """Rows ``rows`` (None: all) of the first tensor of ``names`` found in the checkpoint."""
    for f in checkpoint_files(path):
        with safe_open(f, framework="pt", device="cpu") as st:
            keys = set(st.keys())
            for name in names:
                if name in keys:
                    if rows is None:
                        return st.get_tensor(name).float()
                    sl = st.get_slice(name)
                    return torch.stack([sl[r:r + 1][0] for r in rows]).float()
    return None


def load_score_head(path: Path, hf_config: dict, score_token_ids) -> torch.Tensor | None:
    """The score head of the model in ``path`` as float32 ``[labels, hidden]``, or None when it
    has none (an embedding model without score tokens)."""
    archs = hf_config.get("architectures") or []
    if any(a.endswith("ForSequenceClassification") for a in archs):
        head = _read_rows(path, ("score.weight",), None)
        if head is None:
            raise ValueError(f"{path}: a {archs[0]} checkpoint without score.weight")
        return head.reshape(head.shape[0], -1)
    if score_token_ids is None:
        return None
    no, yes = (int(t) for t in score_token_ids)
    names = ("lm_head.weight", "model.embed_tokens.weight")
    if hf_config.get("tie_word_embeddings"):
        names = names[1:]
    w = _read_rows(path, names, [no, yes])
    if w is None:
        raise ValueError(f"{path}: no LM head to read the score tokens' rows from")
    return (w[1] - w[0]).reshape(1, -1)


class Pooler:
    """Rank 0's pooling of a step's spans (see the module docstring)."""

    def __init__(self, path: Path, hf_config: dict, pooler_config: dict | None, device: torch.device):
        self.device = device
        ids = (pooler_config or {}).get("score_token_ids")
        head = load_score_head(Path(path), hf_config, ids)
        self.score_head = None if head is None else head.to(device)

    @staticmethod
    def from_config(config, device: torch.device) -> "Pooler":
        hf = config.hf_config or json.loads((Path(config.model_path) / "config.json").read_text())
        return Pooler(config.model_path, hf, config.pooler_config, device)

    def pool(self, hidden: torch.Tensor, starts: np.ndarray, ends: np.ndarray,
             scores: bool) -> tuple[np.ndarray, np.ndarray | None]:
        """(float32 [P, hidden] each span's rows summed, float32 [P, labels] their scores or None)."""
        lens = ends - starts
        if (lens == 1).all():
            pooled = hidden[torch.from_numpy(starts.astype(np.int64)).to(hidden.device)].float()
        else:
            offsets = np.concatenate(([0], np.cumsum(lens)[:-1]))
            rows = np.repeat(starts - offsets, lens) + np.arange(int(lens.sum()))
            device = hidden.device
            seg = torch.from_numpy(np.repeat(np.arange(len(lens)), lens)).to(device)
            pooled = torch.zeros((len(lens), hidden.shape[-1]), dtype=torch.float32, device=device)
            pooled.index_add_(0, seg, hidden[torch.from_numpy(rows.astype(np.int64)).to(device)].float())
        out_scores = None
        if scores:
            if self.score_head is None:
                raise RuntimeError("a classify step on a model without a score head")
            out_scores = (pooled @ self.score_head.T).cpu().numpy()
        return pooled.cpu().numpy(), out_scores
