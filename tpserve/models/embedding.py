"""Vocabulary-parallel token embedding and LM head.

The vocabulary is padded up to a multiple of the TP size and split into equal contiguous
slices: rank r owns token ids ``[r * V_local, (r + 1) * V_local)``. Rows past the real vocabulary
(padding) are zero and never leave the layer: the embedding never looks them up and the LM head
drops their logits.

Invariant: an embedding and an LM head built with the same ``num_embeddings`` and TPContext have
identically shaped and placed shards, which is what lets tied embeddings share one parameter.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tpserve.models.parallel import TPContext
from tpserve.models.packed_gemm import PackableLinear
from tpserve.models.weights import attach_loader, check_shape, new_param


class VocabParallelEmbedding(nn.Module):
    """Token embedding whose rows are split across ranks.

    ``forward(ids [T]) -> [T, embedding_dim]`` on every rank: each rank embeds the ids that fall
    in its slice (others give zero rows) and an all-reduce sums the slices.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, tp: TPContext):
        super().__init__()
        self.tp = tp
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.num_embeddings_padded = -(-num_embeddings // tp.size) * tp.size
        self.num_embeddings_per_rank = self.num_embeddings_padded // tp.size
        self.vocab_start = tp.rank * self.num_embeddings_per_rank
        self.vocab_end = self.vocab_start + self.num_embeddings_per_rank
        self.weight = attach_loader(new_param(self.num_embeddings_per_rank, embedding_dim), self.weight_loader)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        check_shape(loaded_weight, (self.num_embeddings, self.embedding_dim), type(self).__name__)
        real = max(0, min(self.vocab_end, self.num_embeddings) - self.vocab_start)
        with torch.no_grad():
            param[:real].copy_(loaded_weight.narrow(0, self.vocab_start, real))
            param[real:].zero_()

    def read_rows_from(self, head: nn.Module) -> None:
        """Look rows up in a group-quantized layer (``group_quant.GroupQuantMixin
        .dequantized_rows``) instead of a float table of this layer's own: a tied LM head (a GGUF
        file quantizes the table its head shares, and holding it once, as codes, is what keeps a
        4-bit model small) or the table's own codes (``group_quant.hold_rows_as_codes``). The rows
        come back in the dtype the table had."""
        w = self.weight
        del self.weight  # no parameter: the checkpoint's codes load into the head
        # A table of no rows keeps the dtype and device the model reports (decoder.CausalLM).
        self.weight = w.new_empty(0, self.embedding_dim)
        # Not a submodule: a head is the model's lm_head already, a table of codes has no loader
        # and is packed already.
        object.__setattr__(self, "rows_of", head)

    @property
    def reads_codes(self) -> bool:
        """Whether rows come from group codes (``read_rows_from``), not a float table."""
        return "rows_of" in self.__dict__

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if not self.reads_codes:
            return F.embedding(ids, self.weight)
        rows = self.rows_of.dequantized_rows(ids.reshape(-1)).to(self.weight.dtype)
        return rows.view(*ids.shape, self.embedding_dim)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self._lookup(input_ids)
        mine = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local_ids = torch.where(mine, input_ids - self.vocab_start, 0)
        out = self._lookup(local_ids)
        out = out.masked_fill(~mine.unsqueeze(-1), 0)
        return self.tp.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding, PackableLinear):
    """Output projection to vocabulary logits, sharded like :class:`VocabParallelEmbedding`.

    ``forward(hidden [S, H])`` computes this rank's slice of the logits and gathers the slices
    to rank 0, which returns ``[S, num_embeddings]`` (padding columns dropped); every other rank
    returns None. Only rank 0 samples, so the others never need the full logits.
    """

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = self.matmul(hidden, None)
        logits = self.tp.gather_to_rank0(logits, dim=-1)
        if logits is None:
            return None
        return logits[..., : self.num_embeddings]
