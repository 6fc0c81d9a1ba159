"""CUDA graphs for decode steps.

A decode step of a small model is dominated by kernel launch overhead, so on CUDA the runner
captures the decode forward once per batch size in ``batch_sizes`` and replays it. Captured
graphs read their inputs from static buffers: a step copies its plan into the first ``B`` rows,
pads the rest (slot -1: nothing is written; context length 1 against block 0: harmless reads),
replays the graph of the smallest captured size >= B, and reads the first B rows of the output.

Only used on an accelerator with ``enforce_eager`` off; CPU runs eager. Capture and replay go
through the runner's ``Accelerator``, so a fake accelerator (whose "graphs" re-run the captured
function) exercises the padding and buffer bookkeeping on CPU. The step's plan arrays arrive
already on the device (staged by the runner), so filling the static buffers is device-to-device.

Ownership: the runner holds a ``DecodeGraphs``; it holds the model, the accelerator and the
config, never the runner, so dropping the runner frees the graphs, their memory pool and the KV
cache at once, without waiting for the cycle collector. ``close()`` releases the graphs and
buffers explicitly (the runner's ``close()`` calls it).
"""
from __future__ import annotations

import torch

from tpserve.kernels.metadata import AttentionMetadata
from tpserve.plan import StepPlan


def graph_batch_sizes(max_batch: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, max_batch + 1, 16))
    return sorted({s for s in sizes if s <= max_batch} | {max_batch})


class DecodeGraphs:
    def __init__(self, model, accel, config, max_batch: int):
        self.model = model
        self.accel = accel
        self.max_model_len = config.max_model_len
        self.max_batch = max_batch
        self.max_blocks = -(-config.max_model_len // config.block_size)
        dev = accel.device
        i32 = dict(dtype=torch.int32, device=dev)
        self.input_ids = torch.zeros(max_batch, **i32)
        self.positions = torch.zeros(max_batch, **i32)
        self.slot_mapping = torch.full((max_batch,), -1, **i32)
        self.context_lens = torch.ones(max_batch, **i32)
        self.block_tables = torch.zeros((max_batch, self.max_blocks), **i32)
        self.cu_seqlens_q = torch.arange(max_batch + 1, **i32)
        self.cu_seqlens_k = torch.zeros(max_batch + 1, **i32)
        self.graphs: dict[int, object] = {}  # batch size -> captured graph (device.py)
        self.batch_sizes = graph_batch_sizes(max_batch)

    def _meta(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(
            is_prefill=False, has_context=False, cu_seqlens_q=self.cu_seqlens_q[:bs + 1],
            cu_seqlens_k=self.cu_seqlens_k[:bs + 1], max_seqlen_q=1,
            max_seqlen_k=self.max_model_len, context_lens=self.context_lens[:bs],
            block_tables=self.block_tables[:bs], slot_mapping=self.slot_mapping[:bs])

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture one graph per batch size, largest first (later ones reuse its memory pool)."""
        model = self.model
        accel = self.accel
        pool = None
        accel.synchronize()
        for bs in reversed(self.batch_sizes):
            meta = self._meta(bs)

            # The closure holds views of the static buffers, not ``self``: a graph that keeps
            # its function (EagerGraph) must not form a cycle with this object.
            def forward(ids=self.input_ids[:bs], pos=self.positions[:bs], meta=meta):
                return model(ids, pos, meta)

            # One eager run first: lazy initialisation (Triton compiles, cuBLAS handles) must not
            # happen inside the capture.
            forward()
            graph = accel.capture_graph(forward, pool)
            pool = graph.pool
            self.graphs[bs] = graph
        accel.synchronize()

    def can_run(self, plan: StepPlan) -> bool:
        return (not plan.is_prefill and 0 < plan.num_seqs <= self.max_batch
                and plan.block_tables.shape[1] <= self.max_blocks)

    def run(self, plan: StepPlan, t: dict[str, torch.Tensor]) -> torch.Tensor:
        """Replay the decode of ``plan``, whose arrays ``t`` are already on the device;
        returns the hidden states of its ``num_seqs`` tokens (a view of a static output)."""
        b = plan.num_seqs
        bs = next(s for s in self.batch_sizes if s >= b)

        def put(dst: torch.Tensor, src: torch.Tensor, pad) -> None:
            dst[:b].copy_(src)
            if bs > b:
                dst[b:bs].fill_(pad)

        put(self.input_ids, t["input_ids"], 0)
        put(self.positions, t["positions"], 0)
        put(self.slot_mapping, t["slot_mapping"], -1)
        put(self.context_lens, t["context_lens"], 1)
        w = plan.block_tables.shape[1]
        self.block_tables[:bs].zero_()
        if w:
            self.block_tables[:b, :w].copy_(t["block_tables"])
        self.cu_seqlens_k[1:bs + 1].copy_(torch.cumsum(self.context_lens[:bs], 0))
        graph = self.graphs[bs]
        graph.replay()
        return graph.output[:b]

    def close(self) -> None:
        """Release every graph (and with the last one its memory pool) and the static buffers.
        The object cannot run afterwards; the caller empties the allocator's cache."""
        for graph in self.graphs.values():
            graph.release()
        self.graphs.clear()
        self.batch_sizes = []
        self.model = None
        self.input_ids = self.positions = self.slot_mapping = self.context_lens = None
        self.block_tables = self.cu_seqlens_q = self.cu_seqlens_k = None
