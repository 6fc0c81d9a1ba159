"""ModelRunner: one rank's model shard, its KV cache, and the step that runs a StepPlan.

Every rank (the scheduler's rank 0 and each worker) owns one runner. A runner never sees a
Sequence: it gets a StepPlan, copies its arrays to the device once, runs the forward, and on
rank 0 samples one token per sampled row (and, with draft tokens, says how many rows each
sequence keeps: StepOutput.accepted). Ranks > 0 run the same forward (their shards take
part in the collectives) and return None.

Device calls go through an ``Accelerator`` (``device.py``); ``is_accelerator`` selects the
device path (CUDA, or a fake accelerator in tests).

Start-up order: load the model; size the KV cache (on a device this runs a warm-up step, which
needs the eager path, so ``graphs`` is None until the cache exists); allocate the cache; on a
device, run one small step per attention kernel variant (``warmup.py``: Triton compiles them
now, not in the first mixed step); then capture decode graphs. ``close()`` frees all of it
again (executors and workers call it on shutdown); nothing the runner owns points back at it,
so dropping it frees the memory too.

KV cache storage (``config.kv_cache_dtype``): ``auto`` keeps K and V in the model's dtype; ``int8``
keeps int8 codes and, per layer, float32 scales ``[num_blocks, block_size, kv_heads]`` for K and V
(tpserve/kernels/kv_quant.py), so a block costs ~half a bf16 block and the budgets below buy ~2x
the blocks; ``fp8`` is refused on CPU, and by the GPU backends, which read caches of the model's
dtype only.

KV cache sizing:
    * ``config.num_kv_blocks`` set: exactly that many blocks.
    * CPU: ``config.kv_cache_memory_gb`` of memory per rank.
    * device: a fraction ``gpu_memory_utilization`` of device memory, minus what is in use after
      the warm-up (weights, context) and the warm-up's activation peak. The warm-up is a prefill
      of ``max_step_tokens`` that samples ``max_num_seqs`` rows with top-k/top-p on (the
      sampler's largest footprint). The allocator's cached blocks are released after the
      warm-up: otherwise they would be counted once as "in use" and again as the peak.
    * Both budgets are capped at ``max_useful_blocks``: ``max_num_seqs`` sequences of
      ``max_model_len`` tokens, plus a quarter. Running sequences can never hold more; the extra
      quarter keeps finished requests' prompts in the prefix cache under full load. Beyond
      that, a small model on a large card would only buy millions of idle ``Block`` objects
      on the scheduler (slow start, GBs of host memory).
    With several ranks the smallest pool wins, so every rank agrees on the block count.
    Decode graphs are captured after sizing, so their memory pool (decode activations at up to
    ``max_num_seqs`` tokens, small next to the KV pool) comes out of the remaining
    ``1 - gpu_memory_utilization``; ``scripts/gpu_check.sh`` reports free memory after start.

A step's plan arrays reach the device through ``PlanStager``: one host buffer, one copy.
"""
from __future__ import annotations

import logging
import os

import numpy as np
import torch
import torch.distributed as dist

from tpserve.config import EngineConfig
from tpserve.errors import ConfigError
from tpserve.kernels.backend_factory import get_backend
from tpserve.kernels.metadata import AttentionMetadata
from tpserve.models.packed_gemm import prepack_model
from tpserve.models.loader import load_config, load_model, resolve_dtype
from tpserve.models.parallel import TPContext
from tpserve.plan import Command, StepPlan
from tpserve.procs import keep_step_heap, release_freed_heap
from tpserve.sample_plan import SamplePlan, StepOutput
from tpserve.workers.cuda_graph import DecodeGraphs
from tpserve.workers.kv_group_runner import KVGroupLayout
from tpserve.workers.kv_transfer import KVTransfer, kv_layout
from tpserve.workers.device import Accelerator, accelerator_for
from tpserve.workers import invariance
from tpserve.workers.pooler import Pooler, build_score_head
from tpserve.workers.sampler import Sampler, compute_logprobs
from tpserve.workers.staging import PlanStager
from tpserve.workers.thread_governor import ThreadGovernor, enabled as governor_enabled
from tpserve.workers.warmup import kernel_warmup_plans, warmup_plan, warmup_sample
from tpserve.workers.zero_pages import lazy_zeros

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


def kv_cache_dtype(name: str, model_dtype: torch.dtype, device: torch.device, backend) -> torch.dtype:
    """The KV cache's torch dtype for ``--kv-cache-dtype name``; ConfigError naming the field when
    this device or attention backend cannot run it."""
    if name == "auto":
        return model_dtype
    if name == "fp8":
        if device.type == "cpu":
            raise ConfigError("kv_cache_dtype", "fp8 needs a GPU; on CPU use int8 (or auto)")
        raise ConfigError("kv_cache_dtype", f"fp8: the {backend.name} attention backend reads KV caches of "
                                            "the model's dtype only; use auto")
    if not getattr(backend, "int8_kv", False):
        raise ConfigError("kv_cache_dtype", f"int8 needs the cpu or torch attention backend, not "
                                            f"{backend.name}")
    return torch.int8


def max_useful_blocks(config: EngineConfig) -> int:
    """The most KV blocks the scheduler can use: every sequence slot at ``max_model_len``,
    plus a quarter for the prefix cache (see the module docstring)."""
    per_seq = -(-config.max_model_len // config.block_size)
    return config.max_num_seqs * per_seq * 5 // 4


class ModelRunner:
    def __init__(self, config: EngineConfig, tp: TPContext,
                 device: torch.device | str | Accelerator = "cpu"):
        if not config.hf_config:
            config.resolve()
        self.config = config
        self.tp = tp = invariance.tp_context(config, tp)  # batch_invariant: fixed-order all-reduce
        self.accel = accelerator_for(device)
        self.device = self.accel.device
        self.dtype = compute_dtype(resolve_dtype(config.dtype, load_config(config.model_path)),
                                   self.device, explicit=config.dtype != "auto")
        self.backend = get_backend(config.attention_backend, self.device, config.block_size,
                                   dtype=self.dtype)
        self.kv_dtype = kv_cache_dtype(config.kv_cache_dtype, self.dtype, self.device, self.backend)
        self.model = load_model(config.model_path, tp, dtype=self.dtype, backend=self.backend,
                                device=self.device, quantization=config.quantization,
                                enable_expert_parallel=config.enable_expert_parallel)
        prepack_model(self.model)  # CPU: packed (and int8-quantized) weights, models/packed_gemm.py
        release_freed_heap()  # what loading and packing freed (procs.py)
        # KV-cache groups (kv_group_runner.py): sliding-window layers share cache slabs by group.
        self.kv_group_layout = KVGroupLayout(self.model, config.block_size)
        self.kv_groups = self.kv_group_layout.groups
        # batch_invariant: every path in its invariant form, or a ConfigError (invariance.py)
        invariance.enable(config, self.model, self.backend, self.device, self.dtype)
        self.sampler = Sampler(device=self.device)
        # --runner pooling: rank 0 pools the forward's rows and scores them (pooler.py); every
        # rank takes part in making the score head of a yes/no reranker
        self.pooler = None
        if config.runner == "pooling":
            head = build_score_head(config, self.model, self.tp, self.device)
            self.pooler = Pooler(head) if self.tp.is_first else None
        self.stager = PlanStager(self.accel)
        self._own_threads = torch.get_num_threads()  # the cores this rank runs on (share_cpu_threads)
        # Fewer threads while other processes busy this rank's cores (thread_governor.py).
        self.governor = ThreadGovernor(self._own_threads) \
            if self.device.type == "cpu" and governor_enabled() else None
        self.graphs = None  # the warm-up inside the sizing runs eagerly
        self.kv_tiers = None  # the KV tiers' worker side (kv_transfer.py), with tiers configured
        self.kv_budget_bytes: int | None = None  # set when sized from device memory
        self.num_blocks = self._size_kv_cache()
        self._allocate_kv_cache()
        if self.device.type == "cpu":
            keep_step_heap()  # steps reuse their activations' pages (procs.py)
        if config.kv_offload_host_gb or config.kv_offload_dir:
            m = self.model
            self.kv_layout = kv_layout(config, self.dtype, tp.size, m.num_layers, m.num_kv_heads_per_rank,
                                       m.head_dim, self.kv_dtype,
                                       self.kv_group_layout.groups if self.kv_group_layout.split else None)
            self.kv_tiers = KVTransfer(config, tp.rank, tp.group if tp.size > 1 else None, self.kv_layout)
            self.kv_tiers.register_kv_caches(self.kv_caches)
        if os.environ.get("TPSERVE_FUSED_DECODE", "1") != "0":
            reason = self.model.enable_fused_decode()  # CPU decode steps: 2 C++ calls per layer
            if reason is not None and self.device.type == "cpu":
                log.info("decode steps run layer by layer: the fused decode %s", reason)
        if self.accel.is_accelerator:
            # Triton compiles a kernel variant on its first launch: here, not in a serving step.
            for plan in kernel_warmup_plans(config):
                self.execute(plan, warmup_sample(plan.num_samples))
        if self.accel.is_accelerator and not config.enforce_eager and self.backend.supports_cuda_graphs \
                and not self.kv_group_layout.split:
            graphs = DecodeGraphs(self.model, self.accel, config, max_batch=config.max_num_seqs)
            graphs.capture()
            self.graphs = graphs

    def close(self) -> None:
        """Free this rank's device memory now: decode graphs and their pool, the KV cache, the
        weights and the staging buffers, then the allocator's cached blocks, so that another
        engine started in this process sizes its KV pool against free memory. The runner
        cannot run afterwards; closing twice is harmless."""
        if self.model is None:
            return
        if self.kv_tiers is not None:
            self.kv_tiers.close()  # pending disk writes first: they read from host copies only
            self.kv_tiers = None
        self.accel.synchronize()  # nothing queued may still read what is freed below
        if self.graphs is not None:
            self.graphs.close()
            self.graphs = None
        self.model.set_kv_caches([(None, None)] * self.model.num_layers)
        self.kv_caches = []
        self.model = None
        self.stager = None
        self._profiler = None
        self.accel.empty_cache()

    # ---- KV cache ------------------------------------------------------------------------
    @property
    def block_bytes(self) -> int:
        """One block of every layer's K and V on this rank (an int8 cache's scales included)."""
        m = self.model
        per_head = m.head_dim * torch.empty((), dtype=self.kv_dtype).element_size()
        if self.kv_dtype == torch.int8:
            per_head += 4  # its float32 scale
        slabs = self.kv_group_layout.num_slabs  # layers sharing a block's memory: all, or a group's
        return 2 * slabs * m.num_kv_heads_per_rank * per_head * self.config.block_size

    def _size_kv_cache(self) -> int:
        cfg = self.config
        if cfg.num_kv_blocks is not None:
            return cfg.num_kv_blocks
        if self.accel.is_accelerator:
            budget = self._device_kv_budget()
        else:
            budget = int(cfg.kv_cache_memory_gb * (1 << 30))
        blocks = min(max(budget // self.block_bytes, 0), max_useful_blocks(cfg) * len(self.kv_groups))
        if self.tp.size > 1:
            t = torch.tensor([blocks], dtype=torch.int64, device=self.device)
            dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.tp.group)
            blocks = int(t.item())
        if blocks < 1:
            raise RuntimeError(f"no memory left for the KV cache (a block needs {self.block_bytes} bytes)")
        return blocks

    def _device_kv_budget(self) -> int:
        accel = self.accel
        accel.synchronize()
        accel.empty_cache()
        accel.reset_peak_memory_stats()
        self._warmup()
        accel.synchronize()
        accel.empty_cache()  # cached warm-up blocks would be counted in `used` and in the peak
        free, total = accel.mem_get_info()
        used = total - free
        peak_extra = accel.peak_extra_bytes()
        self.kv_budget_bytes = int(total * self.config.gpu_memory_utilization - used - peak_extra)
        return self.kv_budget_bytes

    def _warmup(self) -> None:
        """One step at the scheduler's largest batch, without a KV cache, to find peak memory."""
        self.model.set_kv_caches([(None, None)] * self.model.num_layers)
        plan = warmup_plan(self.config)
        self.execute(plan, warmup_sample(plan.num_samples))

    def _allocate_kv_cache(self) -> None:
        m = self.model
        shape = (self.num_blocks, self.config.block_size, m.num_kv_heads_per_rank, m.head_dim)

        def layer():
            # CPU: a mapping of its own in 2 MB pages, written now (kv_cache_prefault) or where
            # blocks are first written (zero_pages.py)
            prefault = self.config.kv_cache_prefault
            caches = [lazy_zeros(shape, self.kv_dtype, self.device, prefault) for _ in range(2)]
            if self.kv_dtype == torch.int8:  # per-slot, per-head scales (kernels/kv_quant.py)
                caches += [lazy_zeros(shape[:3], torch.float32, self.device, prefault) for _ in range(2)]
            return tuple(caches)

        self.kv_caches = self.kv_group_layout.layer_caches(layer)
        m.set_kv_caches(self.kv_caches)
        self.kv_group_layout.wrap_backends(m)
        if self.tp.rank == 0:
            log.info("KV cache (%s): %d blocks of %d tokens (%.2f GiB per rank), max %d concurrent tokens",
                     str(self.kv_dtype).replace("torch.", ""), self.num_blocks, self.config.block_size,
                     self.num_blocks * self.block_bytes / (1 << 30),
                     self.num_blocks * self.config.block_size)

    # ---- one step ------------------------------------------------------------------------
    @staticmethod
    def metadata(plan: StepPlan, t: dict[str, torch.Tensor]) -> AttentionMetadata:
        """Attention metadata of ``plan`` over its staged device arrays ``t``."""
        return AttentionMetadata(
            is_prefill=bool(plan.is_prefill), has_context=bool(plan.has_context),
            cu_seqlens_q=t["cu_seqlens_q"], cu_seqlens_k=t["cu_seqlens_k"],
            max_seqlen_q=int(plan.max_seqlen_q), max_seqlen_k=int(plan.max_seqlen_k),
            context_lens=t["context_lens"], block_tables=t["block_tables"],
            slot_mapping=t["slot_mapping"],
            num_decodes=plan.num_decodes if plan.num_decodes >= 0 else None)

    @torch.inference_mode()
    def execute(self, plan: StepPlan, sample: SamplePlan | None = None) -> StepOutput | None:
        """Run one step; rank 0 returns a StepOutput, other ranks None.

        ``sample`` (rank 0 only: sampling never leaves rank 0, so the plan does not carry it)
        holds every control of the step's sample rows (temperature, top-k, top-p, seed, the
        logits controls, logprobs requests, drafts); None samples every row greedily.
        """
        if self.model is None:
            raise RuntimeError("ModelRunner.execute: the runner is closed")
        kv = (self.kv_tiers.handle(plan.args["kv"]) if self.kv_tiers is not None and "kv" in plan.args
              else None)
        out = self._execute(plan, sample)
        if kv is not None and out is not None:
            out.kv = kv
        return out

    def _execute(self, plan: StepPlan, sample: SamplePlan | None) -> StepOutput | None:
        if sample is None:
            sample = SamplePlan.greedy(plan.num_samples) if self.tp.is_first else _NOT_SAMPLED
        elif self.tp.is_first and sample.num_samples != plan.num_samples:
            raise ValueError(f"sample: a SamplePlan of {sample.num_samples} rows for a plan that samples "
                             f"{plan.num_samples}")
        if plan.num_tokens == 0:
            return _empty_output(sample) if self.tp.is_first else None
        if self.governor is not None:
            threads = self.governor.tick()
            if threads != torch.get_num_threads():
                torch.set_num_threads(threads)
        t = self.stager.stage(plan)
        if self.graphs is not None and self.graphs.can_run(plan):
            hidden = self.graphs.run(plan, t)
        else:
            meta = self.kv_group_layout.with_groups(self.metadata(plan, t), t["positions"])
            hidden = self.model(t["input_ids"], t["positions"], meta)
        prompt_lp = self._prompt_logprobs(hidden, t["logprob_rows"], sample) \
            if plan.logprob_rows.shape[0] else None
        if plan.num_samples == 0:  # e.g. only pooling rows: no LM head on any rank
            if not self.tp.is_first:
                return None
            out = _empty_output(sample)
            out.prompt_logprobs = prompt_lp
            self._pool(hidden, sample, out)
            return out
        if plan.num_decodes == plan.num_tokens == plan.num_samples:
            rows = hidden  # one sampled row per sequence, in order: logits_indices is arange
        else:
            rows = hidden[t["logits_indices"].long()]
        logits = self.model.compute_logits(rows)
        if not self.tp.is_first:
            return None
        tokens, accepted = self.sampler.sample(logits, sample)
        out = StepOutput(tokens.cpu().numpy(), prompt_logprobs=prompt_lp, accepted=accepted)
        self._pool(hidden, sample, out)
        if sample.num_logprobs >= 0:
            out.logprobs = tuple(None if a is None else a.cpu().numpy() for a in
                                 compute_logprobs(logits, tokens.clamp(min=0), sample.num_logprobs,
                                                  sample.logprob_ranks))
        return out

    def _pool(self, hidden: torch.Tensor, sample: SamplePlan, out: StepOutput) -> None:
        """Rank 0: the step's pooling spans (SamplePlan.pool_starts) into ``out.pooled`` /
        ``out.scores``."""
        if sample.pool_starts is None or not len(sample.pool_starts):
            return
        if self.pooler is None:
            raise RuntimeError("pooling rows in a plan of a --runner generate engine")
        out.pooled, out.scores = self.pooler.pool(hidden, sample.pool_starts, sample.pool_ends,
                                                  sample.pool_scores)

    def _prompt_logprobs(self, hidden: torch.Tensor, rows: torch.Tensor, sample: SamplePlan):
        """Log-probabilities of the prompt tokens that ``rows`` predict, in chunks of
        PROMPT_LOGPROBS_CHUNK rows so a long prompt never holds a [rows, vocab] float32 tensor
        at once. Every rank runs the LM head (it is sharded); rank 0 returns the arrays."""
        n, k = rows.shape[0], sample.num_prompt_logprobs
        first = self.tp.is_first
        if first:
            targets = torch.from_numpy(sample.prompt_targets).to(self.device).long()
            lp = np.zeros(n, np.float32)
            ids, tops = np.zeros((n, k), np.int64), np.zeros((n, k), np.float32)
            ranks = np.zeros(n, np.int32) if sample.logprob_ranks else None
        for a in range(0, n, PROMPT_LOGPROBS_CHUNK):
            b = min(a + PROMPT_LOGPROBS_CHUNK, n)
            logits = self.model.compute_logits(hidden[rows[a:b].long()])
            if first:
                got, top_ids, top_lp, rank = compute_logprobs(logits, targets[a:b], k, sample.logprob_ranks)
                lp[a:b], ids[a:b], tops[a:b] = got.cpu().numpy(), top_ids.cpu().numpy(), top_lp.cpu().numpy()
                if rank is not None:
                    ranks[a:b] = rank.cpu().numpy()
        return (lp, ids, tops, ranks) if first else None

    # ---- control commands ----------------------------------------------------------------
    def lend_cores(self, cores: int) -> None:
        """Run the intra-op pool on ``cores`` fewer threads (one at least) than this rank's
        share, until lent 0. A CPU rank has one thread per core, and each parallel region waits
        at its barrier for its slowest thread: a thread that shares its core with another busy
        process (the daemon's tokenizer process) stalls every layer of every step, whatever that
        process's priority. Ranks on an accelerator ignore it."""
        if self.device.type == "cpu":
            threads = max(1, self._own_threads - max(0, cores))
            torch.set_num_threads(self.governor.set_max(threads) if self.governor is not None else threads)

    def handle(self, plan: StepPlan) -> np.ndarray | None:
        """Run a plan of any command; STEP returns tokens on rank 0."""
        if plan.cmd == Command.STEP:
            return self.execute(plan)
        if plan.cmd == Command.PROFILE_START:
            self._profiler = torch.profiler.profile(record_shapes=False)
            self._profiler.__enter__()
        elif plan.cmd == Command.LEND_CORES:
            self.lend_cores(int(plan.args.get("cores", 0)))
        elif plan.cmd == Command.PROFILE_STOP and getattr(self, "_profiler", None) is not None:
            self._profiler.__exit__(None, None, None)
            path = plan.args.get("path")
            if path:
                self._profiler.export_chrome_trace(f"{path}.rank{self.tp.rank}.json")
            self._profiler = None
        return None


# Rows of prompt logits computed at once: 512 x 152k fp32 is 311 MB.
PROMPT_LOGPROBS_CHUNK = 512
# The SamplePlan of ranks > 0, which run the forward but never sample.
_NOT_SAMPLED = SamplePlan()


def _empty_output(sample: SamplePlan) -> StepOutput:
    k = max(sample.num_logprobs, 0)
    out = StepOutput(np.zeros(0, dtype=np.int64))
    if sample.num_logprobs >= 0:
        out.logprobs = (np.zeros(0, np.float32), np.zeros((0, k), np.int64), np.zeros((0, k), np.float32),
                        np.zeros(0, np.int32) if sample.logprob_ranks else None)
    return out
