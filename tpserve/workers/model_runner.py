"""ModelRunner: one rank's model shard, its KV cache, and the step that runs a StepPlan.

Every rank (the scheduler's rank 0 and each worker) owns one runner. A runner never sees a
Sequence: it gets a StepPlan, copies its arrays to the device once, runs the forward, and on
rank 0 samples one token per sampled row. Ranks > 0 run the same forward (their shards take
part in the collectives) and return None.

KV cache sizing:
    * ``config.num_kv_blocks`` set: exactly that many blocks.
    * CPU: ``config.kv_cache_memory_gb`` of memory per rank.
    * CUDA: a fraction ``gpu_memory_utilization`` of the device, minus the weights and the peak
      activation memory of a warm-up forward at the largest batch the scheduler can build.
    With several ranks the smallest pool wins, so every rank agrees on the block count.
"""
from __future__ import annotations

import logging

import numpy as np
import torch
import torch.distributed as dist

from tpserve.config import EngineConfig
from tpserve.kernels.backend import get_backend
from tpserve.kernels.metadata import AttentionMetadata
from tpserve.models.loader import load_config, load_model, resolve_dtype
from tpserve.models.parallel import TPContext
from tpserve.plan import Command, StepPlan
from tpserve.workers.cuda_graph import DecodeGraphs
from tpserve.workers.sampler import Sampler, compute_logprobs

log = logging.getLogger("tpserve.runner")

def cpu_has_fast_bf16() -> bool:
    """True when this CPU multiplies bf16 natively (AVX512-BF16 or AMX)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def compute_dtype(dtype: torch.dtype, device: torch.device, explicit: bool) -> torch.dtype:
    """The dtype the model runs in. With dtype "auto", a half-precision checkpoint runs in
    float32 on a CPU without native bf16: emulated bf16 matmuls are ~30x slower than fp32 there."""
    if (not explicit and device.type == "cpu" and dtype in (torch.bfloat16, torch.float16)
            and not cpu_has_fast_bf16()):
        log.info("CPU has no native bf16: running the %s checkpoint in float32", dtype)
        return torch.float32
    return dtype


class ModelRunner:
    def __init__(self, config: EngineConfig, tp: TPContext, device: torch.device | str = "cpu"):
        if not config.hf_config:
            config.resolve()
        self.config = config
        self.tp = tp
        self.device = torch.device(device)
        self.dtype = compute_dtype(resolve_dtype(config.dtype, load_config(config.model_path)),
                                   self.device, explicit=config.dtype != "auto")
        self.backend = get_backend(config.attention_backend, self.device, config.block_size,
                                   dtype=self.dtype)
        self.model = load_model(config.model_path, tp, dtype=self.dtype, backend=self.backend,
                                device=self.device)
        self.sampler = Sampler()
        self.num_blocks = self._size_kv_cache()
        self._allocate_kv_cache()
        self.graphs = None
        if self.device.type == "cuda" and not config.enforce_eager and self.backend.supports_cuda_graphs:
            self.graphs = DecodeGraphs(self, max_batch=config.max_num_seqs)
            self.graphs.capture()

    # ---- KV cache ------------------------------------------------------------------------
    @property
    def block_bytes(self) -> int:
        m = self.model
        per_token = 2 * m.num_layers * m.num_kv_heads_per_rank * m.head_dim
        return per_token * self.config.block_size * torch.empty((), dtype=self.dtype).element_size()

    def _size_kv_cache(self) -> int:
        cfg = self.config
        if cfg.num_kv_blocks is not None:
            return cfg.num_kv_blocks
        if self.device.type == "cuda":
            budget = self._cuda_kv_budget()
        else:
            budget = int(cfg.kv_cache_memory_gb * (1 << 30))
        blocks = max(budget // self.block_bytes, 0)
        if self.tp.size > 1:
            t = torch.tensor([blocks], dtype=torch.int64, device=self.device)
            dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.tp.group)
            blocks = int(t.item())
        if blocks < 1:
            raise RuntimeError(f"no memory left for the KV cache (a block needs {self.block_bytes} bytes)")
        return blocks

    def _cuda_kv_budget(self) -> int:
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self._warmup()
        free, total = torch.cuda.mem_get_info(self.device)
        stats = torch.cuda.memory_stats(self.device)
        used = total - free
        peak_extra = stats["allocated_bytes.all.peak"] - stats["allocated_bytes.all.current"]
        return int(total * self.config.gpu_memory_utilization - used - peak_extra)

    def _warmup(self) -> None:
        """A prefill at the scheduler's largest batch, without a KV cache, to find peak memory."""
        cfg = self.config
        num_tokens = min(cfg.max_num_batched_tokens, cfg.max_num_seqs * cfg.max_model_len)
        num_seqs = max(1, min(cfg.max_num_seqs, num_tokens // max(cfg.max_model_len, 1)))
        lens = np.full(num_seqs, num_tokens // num_seqs, dtype=np.int32)
        lens[-1] += num_tokens - int(lens.sum())
        cu = np.zeros(num_seqs + 1, dtype=np.int32)
        np.cumsum(lens, out=cu[1:])
        plan = StepPlan(is_prefill=True, max_seqlen_q=int(lens.max()), max_seqlen_k=int(lens.max()),
                        input_ids=np.zeros(num_tokens, np.int32),
                        positions=np.concatenate([np.arange(n, dtype=np.int32) for n in lens]),
                        slot_mapping=np.full(num_tokens, -1, np.int32), cu_seqlens_q=cu,
                        cu_seqlens_k=cu.copy(), context_lens=lens,
                        block_tables=np.zeros((num_seqs, 0), np.int32),
                        logits_indices=cu[1:] - 1, temperatures=np.ones(num_seqs, np.float32),
                        top_ks=np.full(num_seqs, -1, np.int32), top_ps=np.ones(num_seqs, np.float32),
                        seeds=np.zeros(num_seqs, np.int64), sample_steps=np.zeros(num_seqs, np.int32))
        self.model.set_kv_caches([(None, None)] * self.model.num_layers)
        self.execute(plan)

    def _allocate_kv_cache(self) -> None:
        m = self.model
        shape = (self.num_blocks, self.config.block_size, m.num_kv_heads_per_rank, m.head_dim)
        self.kv_caches = [(torch.zeros(shape, dtype=self.dtype, device=self.device),
                           torch.zeros(shape, dtype=self.dtype, device=self.device))
                          for _ in range(m.num_layers)]
        m.set_kv_caches(self.kv_caches)
        if self.tp.rank == 0:
            log.info("KV cache: %d blocks of %d tokens (%.2f GiB per rank), max %d concurrent tokens",
                     self.num_blocks, self.config.block_size,
                     self.num_blocks * self.block_bytes / (1 << 30),
                     self.num_blocks * self.config.block_size)

    # ---- one step ------------------------------------------------------------------------
    def _tensor(self, arr: np.ndarray) -> torch.Tensor:
        # Plans may be read-only views into shared memory: copy once, then move to the device.
        t = torch.from_numpy(np.array(arr, copy=True))
        return t.to(self.device, non_blocking=True) if self.device.type != "cpu" else t

    def metadata(self, plan: StepPlan) -> AttentionMetadata:
        return AttentionMetadata(
            is_prefill=bool(plan.is_prefill), has_context=bool(plan.has_context),
            cu_seqlens_q=self._tensor(plan.cu_seqlens_q), cu_seqlens_k=self._tensor(plan.cu_seqlens_k),
            max_seqlen_q=int(plan.max_seqlen_q), max_seqlen_k=int(plan.max_seqlen_k),
            context_lens=self._tensor(plan.context_lens), block_tables=self._tensor(plan.block_tables),
            slot_mapping=self._tensor(plan.slot_mapping))

    @torch.inference_mode()
    def execute(self, plan: StepPlan, num_logprobs: int = -1):
        """Run one step; rank 0 returns the sampled token ids (int64 [S]), others None.

        With ``num_logprobs`` >= 0 (rank 0 only: sampling never leaves rank 0, so the plan does
        not carry it) rank 0 returns ``(tokens, (logprob [S], top_ids [S, k], top_logprobs [S, k]))``
        with k = num_logprobs, as numpy arrays (see sampler.compute_logprobs).
        """
        if plan.num_tokens == 0:
            if not self.tp.is_first:
                return None
            empty = np.zeros(0, dtype=np.int64)
            if num_logprobs < 0:
                return empty
            k = max(num_logprobs, 0)
            return empty, (np.zeros(0, np.float32), np.zeros((0, k), np.int64), np.zeros((0, k), np.float32))
        if self.graphs is not None and self.graphs.can_run(plan):
            hidden = self.graphs.run(plan)
        else:
            hidden = self.model(self._tensor(plan.input_ids), self._tensor(plan.positions),
                                self.metadata(plan))
        rows = hidden[self._tensor(plan.logits_indices).long()]
        logits = self.model.compute_logits(rows)
        if not self.tp.is_first:
            return None
        tokens = self.sampler(logits, self._tensor(plan.temperatures), self._tensor(plan.top_ks),
                              self._tensor(plan.top_ps), self._tensor(plan.seeds),
                              self._tensor(plan.sample_steps))
        if num_logprobs < 0:
            return tokens.cpu().numpy()
        lp, top_ids, top_lp = compute_logprobs(logits, tokens, num_logprobs)
        return tokens.cpu().numpy(), (lp.cpu().numpy(), top_ids.cpu().numpy(), top_lp.cpu().numpy())

    # ---- control commands ----------------------------------------------------------------
    def handle(self, plan: StepPlan) -> np.ndarray | None:
        """Run a plan of any command; STEP returns tokens on rank 0."""
        if plan.cmd == Command.STEP:
            return self.execute(plan)
        if plan.cmd == Command.PROFILE_START:
            self._profiler = torch.profiler.profile(record_shapes=False)
            self._profiler.__enter__()
        elif plan.cmd == Command.PROFILE_STOP and getattr(self, "_profiler", None) is not None:
            self._profiler.__exit__(None, None, None)
            path = plan.args.get("path")
            if path:
                self._profiler.export_chrome_trace(f"{path}.rank{self.tp.rank}.json")
            self._profiler = None
        # RESET_PREFIX_CACHE and PING need nothing from a runner: block state lives on rank 0.
        return None
