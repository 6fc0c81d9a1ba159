"""CUDA graphs for decode steps.

A decode step of a small model is dominated by kernel launch overhead, so on CUDA the runner
captures the decode forward once per batch size in ``batch_sizes`` and replays it. Captured
graphs read their inputs from static buffers: a step copies its plan into the first ``B`` rows,
pads the rest (slot -1: nothing is written; context length 1 against block 0: harmless reads),
replays the graph of the smallest captured size >= B, and reads the first B rows of the output.

Only used on CUDA with ``enforce_eager`` off; CPU runs eager.
"""
from __future__ import annotations

import numpy as np
import torch

from tpserve.kernels.metadata import AttentionMetadata
from tpserve.plan import StepPlan


def graph_batch_sizes(max_batch: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, max_batch + 1, 16))
    return sorted({s for s in sizes if s <= max_batch} | {max_batch})


class DecodeGraphs:
    def __init__(self, runner, max_batch: int):
        self.runner = runner
        cfg = runner.config
        self.max_batch = max_batch
        self.max_blocks = -(-cfg.max_model_len // cfg.block_size)
        dev = runner.device
        i32 = dict(dtype=torch.int32, device=dev)
        self.input_ids = torch.zeros(max_batch, **i32)
        self.positions = torch.zeros(max_batch, **i32)
        self.slot_mapping = torch.full((max_batch,), -1, **i32)
        self.context_lens = torch.ones(max_batch, **i32)
        self.block_tables = torch.zeros((max_batch, self.max_blocks), **i32)
        self.cu_seqlens_q = torch.arange(max_batch + 1, **i32)
        self.cu_seqlens_k = torch.zeros(max_batch + 1, **i32)
        self.hidden = None
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.batch_sizes = graph_batch_sizes(max_batch)

    def _meta(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(
            is_prefill=False, has_context=False, cu_seqlens_q=self.cu_seqlens_q[:bs + 1],
            cu_seqlens_k=self.cu_seqlens_k[:bs + 1], max_seqlen_q=1,
            max_seqlen_k=self.runner.config.max_model_len, context_lens=self.context_lens[:bs],
            block_tables=self.block_tables[:bs], slot_mapping=self.slot_mapping[:bs])

    @torch.inference_mode()
    def capture(self) -> None:
        model = self.runner.model
        pool = None
        torch.cuda.synchronize(self.runner.device)
        for bs in reversed(self.batch_sizes):
            meta = self._meta(bs)
            # One eager run first: lazy initialisation (Triton compiles, cuBLAS handles) must not
            # happen inside the capture.
            out = model(self.input_ids[:bs], self.positions[:bs], meta)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = model(self.input_ids[:bs], self.positions[:bs], meta)
            if self.hidden is None:
                self.hidden = out
            pool = graph.pool()
            self.graphs[bs] = (graph, out)
        torch.cuda.synchronize(self.runner.device)

    def can_run(self, plan: StepPlan) -> bool:
        return (not plan.is_prefill and 0 < plan.num_seqs <= self.max_batch
                and plan.block_tables.shape[1] <= self.max_blocks)

    def run(self, plan: StepPlan) -> torch.Tensor:
        b = plan.num_seqs
        bs = next(s for s in self.batch_sizes if s >= b)
        dev = self.runner.device

        def put(dst: torch.Tensor, arr: np.ndarray, pad) -> None:
            dst[:b].copy_(torch.from_numpy(np.array(arr, copy=True)).to(dev, non_blocking=True))
            if bs > b:
                dst[b:bs].fill_(pad)

        put(self.input_ids, plan.input_ids, 0)
        put(self.positions, plan.positions, 0)
        put(self.slot_mapping, plan.slot_mapping, -1)
        put(self.context_lens, plan.context_lens, 1)
        w = plan.block_tables.shape[1]
        self.block_tables[:bs].zero_()
        if w:
            self.block_tables[:b, :w].copy_(
                torch.from_numpy(np.array(plan.block_tables, copy=True)).to(dev, non_blocking=True))
        self.cu_seqlens_k[1:bs + 1].copy_(torch.cumsum(self.context_lens[:bs], 0))
        graph, out = self.graphs[bs]
        graph.replay()
        return out[:b]
