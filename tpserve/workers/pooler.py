"""Pooler: what the pooling rank (rank 0) does with a step's pooling rows (--runner pooling).

The forward's final hidden states are identical on every rank, so only rank 0 pools: the
SamplePlan (rank 0's alone) names each span of rows (``pool_starts``/``pool_ends``), this
module sums each span in float32 (one row for LAST, SCORE and CLS; a chunk's rows for MEAN)
and, for classify, applies the score head. The engine finishes the vectors in numpy
(tpserve/pooling.py: mean, dimensions, normalisation, sigmoid). No LM head runs in a step.

The score head ``[labels, hidden]`` (float32, kept by rank 0) is made once, at start:

- a ``*ForSequenceClassification`` checkpoint: its ``score.weight``, read by rank 0 alone;
- a causal LM read as a yes/no reranker: ``W[yes] - W[no]``, since
  ``logit[yes] - logit[no] = (W[yes] - W[no]) . h``. When the checkpoint's safetensors hold the
  head in a float dtype, rank 0 reads the two rows from it (a slice read, no other rank
  involved). Otherwise (a GGUF file's model directory, a quantized head) they are taken from
  the loaded LM head itself -- its logits of the identity matrix, in chunks of rows, two columns
  kept: H x V x H multiply-adds once, right whatever form the head has. Every rank decides the
  same way from the same files, and resolves the same two tokens (``resolve_score_tokens``).
"""
from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open

from tpserve.models.errors import UnsupportedModelError
from tpserve.models.loader import checkpoint_files
from tpserve.pooling import is_sequence_classifier, resolve_score_tokens
from tpserve.tokenizer import load_tokenizer

log = logging.getLogger("tpserve.pooler")

# Rows of the identity matrix run through the LM head at once when its two rows are read.
_EYE_CHUNK = 256


_FLOAT_DTYPES = ("F32", "F16", "BF16")


def _read_tensor(path: Path, name: str) -> torch.Tensor | None:
    for f in checkpoint_files(path):
        with safe_open(f, framework="pt", device="cpu") as st:
            if name in set(st.keys()):
                return st.get_tensor(name).float()
    return None


def _float_rows(path: Path, names: tuple[str, ...], rows: tuple[int, ...], read: bool):
    """True (or, with ``read``, the rows as float32) when the first of ``names`` that the
    checkpoint's safetensors hold is a float matrix; None when there is no such tensor (no
    safetensors at all, or a quantized one). Reads headers only, unless ``read``."""
    try:
        files = checkpoint_files(path)
    except ValueError:  # no safetensors: e.g. a GGUF file's model directory
        return None
    for f in files:
        with safe_open(f, framework="pt", device="cpu") as st:
            keys = set(st.keys())
            for name in names:
                if name in keys:
                    sl = st.get_slice(name)
                    if sl.get_dtype() not in _FLOAT_DTYPES or len(sl.get_shape()) != 2:
                        return None
                    return torch.stack([sl[r:r + 1][0] for r in rows]).float() if read else True
    return None


@torch.inference_mode()
def lm_head_rows(model, token_ids: tuple[int, ...], device: torch.device) -> torch.Tensor | None:
    """The LM head's rows of ``token_ids`` as float32 ``[len(token_ids), hidden]`` on rank 0 (None
    on the others, which must call it too): its logits of the identity matrix's rows."""
    hidden = model.spec.hidden_size
    cols = torch.tensor(token_ids, dtype=torch.long, device=device)
    parts = []
    for a in range(0, hidden, _EYE_CHUNK):
        n = min(_EYE_CHUNK, hidden - a)
        eye = torch.zeros((n, hidden), dtype=model.dtype, device=device)
        eye[torch.arange(n, device=device), torch.arange(a, a + n, device=device)] = 1
        logits = model.compute_logits(eye)
        if logits is not None:
            parts.append(logits.index_select(1, cols).float())
    return torch.cat(parts).T.contiguous() if parts else None


def build_score_head(config, model, tp, device: torch.device) -> torch.Tensor | None:
    """The score head on rank 0 (None elsewhere, and for a model without one). Every rank calls
    it at the same point of its start (a yes/no head runs the sharded LM head)."""
    hf = config.hf_config
    if is_sequence_classifier(hf):
        if not tp.is_first:
            return None
        head = _read_tensor(Path(config.model_path), "score.weight")
        if head is None:
            raise ValueError(f"{config.model_path}: a sequence-classification checkpoint without score.weight")
        return head.reshape(head.shape[0], -1).to(device)
    pooler = config.pooler
    tokenizer = None
    if pooler.score_token_ids is None:  # a torchrun rank: find the tokens as the engine did
        tokenizer = load_tokenizer(config.model_path)
    ids = resolve_score_tokens(pooler, tokenizer, int(hf.get("vocab_size") or 0) or None)
    if ids is None:
        return None
    if model.spec.final_logit_softcap is not None:
        # The head is two rows of the LM head, a linear score; capped logits are not.
        raise UnsupportedModelError("final_logit_softcapping", "a yes/no score head scores with the LM "
                                                               "head's rows; soft-capped logits are not "
                                                               "supported there")
    names = ("lm_head.weight", "model.embed_tokens.weight")
    if hf.get("tie_word_embeddings") or model.spec.tie_word_embeddings:
        names = names[1:]
    path = Path(config.model_path)
    if _float_rows(path, names, ids, read=False):  # same files, same answer on every rank
        rows = _float_rows(path, names, ids, read=True) if tp.is_first else None
    else:
        rows = lm_head_rows(model, ids, device)
    return None if rows is None else (rows[1] - rows[0]).reshape(1, -1).to(device)


class Pooler:
    """Rank 0's pooling of a step's spans (see the module docstring)."""

    def __init__(self, score_head: torch.Tensor | None):
        self.score_head = score_head

    def pool(self, hidden: torch.Tensor, starts: np.ndarray, ends: np.ndarray,
             scores: bool) -> tuple[np.ndarray, np.ndarray | None]:
        """(float32 [P, hidden] each span's rows summed, float32 [P, labels] their scores or None)."""
        lens = ends - starts
        device = hidden.device
        if (lens == 1).all():
            pooled = hidden[torch.from_numpy(starts.astype(np.int64)).to(device)].float()
        else:
            offsets = np.concatenate(([0], np.cumsum(lens)[:-1]))
            rows = np.repeat(starts - offsets, lens) + np.arange(int(lens.sum()))
            seg = torch.from_numpy(np.repeat(np.arange(len(lens)), lens)).to(device)
            pooled = torch.zeros((len(lens), hidden.shape[-1]), dtype=torch.float32, device=device)
            pooled.index_add_(0, seg, hidden[torch.from_numpy(rows.astype(np.int64)).to(device)].float())
        out_scores = None
        if scores:
            if self.score_head is None:
                raise RuntimeError("a classify step on a model without a score head")
            out_scores = (pooled @ self.score_head.T).cpu().numpy()
        return pooled.cpu().numpy(), out_scores
