"""EngineConfig: the options shared by the offline API, `tpserve start/serve` and workers.

Validation happens here, at the boundary, and raises ConfigError naming the field. Nothing in
this module imports torch or transformers: the scheduler side reads it too.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from tpserve.errors import ConfigError
from tpserve.gguf_file import GGUFFileError, is_gguf, materialize, model_dir, model_stem
from tpserve.pooling import PoolerConfig, check_runner
from tpserve.quantization import NO_QUANTIZATION, QUANTIZATION_METHODS, resolve_quantization
from tpserve.spec_config import SpeculativeConfig

DEFAULT_MODEL_DIR = Path(__file__).resolve().parent / "assets" / "default-model"
ATTENTION_BACKENDS = ("auto", "flash", "triton", "cpu", "torch")
DTYPES = ("auto", "float32", "bfloat16", "float16")
# The KV cache's storage (vLLM's --kv-cache-dtype): auto = the model's dtype; int8 = int8 codes with a
# float32 scale per token and KV head (docs/kv_int8.md); fp8 is for GPUs, refused on CPU by the runner.
KV_CACHE_DTYPES = ("auto", "int8", "fp8")
SCHEDULING_POLICIES = ("mixed", "prefill-first")
SCHEDULING_ORDERS = ("fcfs", "priority")
#: max_waiting_requests / max_waiting_tokens: sized from the KV pool when the engine starts.
AUTO = "auto"
# Tokens per engine step. Serving: small enough that one step (a prefill chunk plus every
# running decode) stays short, so running streams keep their inter-token latency while a long
# prompt is prefilled. Offline (the LLM API): large, for throughput.
SERVING_MAX_NUM_BATCHED_TOKENS = 256
OFFLINE_MAX_NUM_BATCHED_TOKENS = 8192
# Offline pooling (LLM(runner="pooling")): prompt rows only, whose matmul outputs at 8,192 rows
# leave the caches (0.6B shape, 200 texts of 32-512 tokens, bf16, two threads: ~9% more
# embeddings/s at 4,096 than at 8,192; medians of three noisy runs).
OFFLINE_POOLING_MAX_NUM_BATCHED_TOKENS = 4096
DEFAULT_MAX_STALL_TOKENS = 4096
DEFAULT_GRAMMAR_TIMEOUT = 5.0


@dataclass
class EngineConfig:
    """Engine options. ``model`` None means the bundled default model.

    ``num_kv_blocks`` overrides the KV pool size (tests, capacity planning); otherwise the
    runner sizes the pool from ``kv_cache_memory_gb`` (CPU) or ``gpu_memory_utilization`` (GPU).
    ``max_model_len`` None means the model's ``max_position_embeddings``.
    ``startup_timeout``: seconds the engine may take to start (workers joining and loading the
    model); `tpserve start` waits as long for the daemon to be ready.
    ``quantization``: None (the checkpoint as it is, int8 if its config.json says
    compressed-tensors), "int8" (quantize the linear layers at load) or "compressed-tensors";
    see tpserve/quantization.py; "none": no quantization (a GGUF file's tensors dequantized at
    load, docs/gguf.md). ``resolve`` refuses a quantization it cannot load.

    ``scheduling_policy``: "mixed" (default) fills each step's ``max_num_batched_tokens``
    budget with every running decode first, then prefill chunks, so running streams never wait
    for a whole prefill; "prefill-first" is the seed's policy (a step is all prefill while
    anything can be prefilled, else all decode).

    ``max_num_batched_tokens`` bounds one step's tokens. The default (256) is a serving budget
    chosen by measurement on the 40M-parameter CPU benchmark model (bf16, one thread, 16 streams
    decoding when a 3,000-token prompt arrives; a busy shared machine, so ratios matter more
    than times): the longest stall of a stream was 0.75 / 0.89 / 1.74 / 3.0 s at budgets
    128 / 256 / 512 / 1,024 under "mixed", against 6.4 s (the whole prefill) under
    "prefill-first"; the prompt's first token came after 11.2 / 7.3 / 7.9 / 7.2 s. 256 keeps
    a stall near 1/7 of the prefill at a small cost in time to first token. (vLLM serves
    with 2,048 on GPUs, where a prompt token costs far less.) The offline ``LLM`` API
    defaults to 8,192, which favours throughput.

    ``max_stall_tokens`` lets a mixed step grow past that budget while few streams decode: a
    step with ``d`` decode rows holds up to ``max(max_num_batched_tokens, max_stall_tokens // d)``
    tokens (``max_stall_tokens`` when nothing decodes). The time a step takes is a stall every
    decoding stream pays, so what is bounded is prompt tokens times the streams waiting on
    them: with the defaults, one step of up to 4,096 tokens when one stream decodes, 1,024 with
    four, and the 256-token budget from sixteen streams on. Fewer, larger steps at light load
    mean fewer stalled tokens and an earlier first token; under load the small budget keeps
    every stall short. Measured on the same model (bf16, scripts/bench_serving.py, 20 requests
    at 0.5 requests/s): inter-token latency p99 84 ms with a fixed 256-token budget, 13 ms with
    this rule; first-token p99 2.36 -> 1.57 s; the 16-stream stall (0.17 s) is unchanged. Set
    it to ``max_num_batched_tokens`` (or lower) for a fixed budget.

    ``speculative_config`` (None: off) turns on speculative decoding with vLLM's keys, e.g.
    ``{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
    "prompt_lookup_min": 2}`` (tpserve/spec_config.py); validation fills in the defaults.

    ``scheduling_order``: "fcfs" (default, the seed: first come, first served, tail
    preemption) or "priority" (requests carry a ``priority``, lower first; better ones are
    admitted first and preempt worse running ones for blocks; scheduler/ordering.py). Under
    "fcfs" a request with a priority other than 0 is refused (as vLLM does), not ignored.

    ``max_waiting_requests`` / ``max_waiting_tokens`` bound the waiting queue: a new request is
    refused (OverloadedError; the daemon answers ``overloaded``, HTTP 429) when the queue
    already holds that many sequences, or when its prompt would take the queue's prompt
    tokens past the limit (a request into an empty queue is never refused for its length).
    None: no limit (the offline API's default: it queues a whole batch at once). "auto" (the
    daemon's default) sizes them from the KV pool once it is known: as many requests as one
    full batch in the pool (``min(max_num_seqs, num_kv_blocks)``: a sequence holds a block at
    least) and the pool's tokens (``num_kv_blocks * block_size``), i.e. what one turnover of
    the running batch can take in; anything queued beyond that waits for
    more than a full turnover, and its client learns nothing meanwhile.

    ``grammar_timeout``: seconds the grammar of one request (``structured_outputs``, chat tools)
    may take to be parsed, converted and built; that work runs in a child process, off the
    serving loop, and a grammar over the budget is refused with an error naming its field. The
    default bounds the worst input the request limits allow (a GBNF grammar of 20,000 rules
    converts for minutes) while common schemas, regexes and grammars compile in milliseconds.

    ``batch_invariant``: a token's logits (so its greedy or seeded choice and its logprobs) do
    not depend on the other requests of its steps, on how its prompt was chunked, on prefix-cache
    hits, preemption or speculative verification (docs/protocol.md "Reproducibility" states the
    guarantee; tpserve/workers/invariance.py puts the engine's paths in the mode). A path that has
    no invariant form is refused with a ConfigError naming it (``TPSERVE_PREPACK=0``, the torch
    and flash attention backends, fp16 or unpacked layers on CPU, CUDA's matrix libraries).
    """

    model: str | None = None
    # A .gguf model's tokenizer from this directory instead of the file's metadata (docs/gguf.md).
    tokenizer: str | None = None
    tensor_parallel_size: int = 1
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = SERVING_MAX_NUM_BATCHED_TOKENS
    scheduling_policy: str = "mixed"
    scheduling_order: str = "fcfs"
    max_stall_tokens: int = DEFAULT_MAX_STALL_TOKENS
    max_model_len: int | None = None
    kv_cache_memory_gb: float = 1.0
    # CPU: write the KV pool's pages at start (as vLLM and llama.cpp do), so that no serving step
    # pays their first-touch faults; False leaves them to the blocks' first writes
    # (workers/zero_pages.py).
    kv_cache_prefault: bool = True
    gpu_memory_utilization: float = 0.9
    num_kv_blocks: int | None = None
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    # None: as the checkpoint's quantization_config says (tpserve/quantization.py).
    quantization: str | None = None
    # Mixtures of experts: each rank holds whole experts (vLLM's --enable-expert-parallel)
    # instead of a slice of every expert's intermediate dimension (tpserve/models/moe.py).
    enable_expert_parallel: bool = False
    attention_backend: str = "auto"
    enforce_eager: bool = False
    enable_prefix_caching: bool = True
    seed: int = 0
    startup_timeout: float = 600.0
    speculative_config: dict | None = None
    max_waiting_requests: int | str | None = None
    max_waiting_tokens: int | str | None = None
    grammar_timeout: float = DEFAULT_GRAMMAR_TIMEOUT
    batch_invariant: bool = False
    # "generate" (default) or "pooling": embeddings and scores instead of tokens (vLLM's
    # --runner; tpserve/pooling.py), with the pooler of ``pooler_config`` (vLLM's keys).
    runner: str = "generate"
    pooler_config: dict | str | None = None
    # KV tiers below the pool (tpserve/kv_tiers, docs/kv_tiers.md): host RAM (GiB, all ranks
    # together; 0: none) and a disk directory (None: none) bounded by ``kv_offload_disk_gb``.
    kv_offload_host_gb: float = 0.0
    kv_offload_dir: str | None = None
    kv_offload_disk_gb: float = 16.0
    # Filled in by resolve() from the model directory.
    eos_token_ids: list[int] = field(default_factory=list)
    hf_config: dict = field(default_factory=dict, repr=False)

    def __post_init__(self):
        self.validate()

    # ---- validation ----------------------------------------------------------------------
    def validate(self) -> None:
        def pos_int(name, lo=1):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ConfigError(name, f"must be an integer >= {lo}, got {v!r}")

        for name in ("tensor_parallel_size", "block_size", "max_num_seqs", "max_num_batched_tokens",
                     "max_stall_tokens"):
            pos_int(name)
        if self.max_model_len is not None:
            pos_int("max_model_len")
        if self.num_kv_blocks is not None:
            pos_int("num_kv_blocks")
        if self.seed is not None:
            pos_int("seed", 0)
        if not isinstance(self.kv_cache_memory_gb, (int, float)) or self.kv_cache_memory_gb <= 0:
            raise ConfigError("kv_cache_memory_gb", f"must be > 0, got {self.kv_cache_memory_gb!r}")
        if not isinstance(self.gpu_memory_utilization, (int, float)) or not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError("gpu_memory_utilization",
                              f"must be in (0, 1], got {self.gpu_memory_utilization!r}")
        if isinstance(self.startup_timeout, bool) or not isinstance(self.startup_timeout, (int, float)) \
                or not 0 < self.startup_timeout < float("inf"):
            raise ConfigError("startup_timeout", f"must be a number of seconds > 0, got {self.startup_timeout!r}")
        if isinstance(self.grammar_timeout, bool) or not isinstance(self.grammar_timeout, (int, float)) \
                or not 0 < self.grammar_timeout <= 3600:
            raise ConfigError("grammar_timeout",
                              f"must be a number of seconds in (0, 3600], got {self.grammar_timeout!r}")
        if self.dtype not in DTYPES:
            raise ConfigError("dtype", f"must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError("kv_cache_dtype", f"must be one of {', '.join(KV_CACHE_DTYPES)}, "
                              f"got {self.kv_cache_dtype!r}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ConfigError("scheduling_policy", f"must be one of {', '.join(SCHEDULING_POLICIES)}, "
                              f"got {self.scheduling_policy!r}")
        if self.scheduling_order not in SCHEDULING_ORDERS:
            raise ConfigError("scheduling_order", f"must be one of {', '.join(SCHEDULING_ORDERS)}, "
                              f"got {self.scheduling_order!r}")
        for name in ("max_waiting_requests", "max_waiting_tokens"):
            if getattr(self, name) not in (None, AUTO):
                pos_int(name)
        if self.quantization not in (None, *QUANTIZATION_METHODS, NO_QUANTIZATION):
            raise ConfigError("quantization", f"must be one of {', '.join(QUANTIZATION_METHODS)}, none "
                                              f"(or unset), got {self.quantization!r}")
        if not isinstance(self.kv_cache_prefault, bool):
            raise ConfigError("kv_cache_prefault", f"must be true or false, got {self.kv_cache_prefault!r}")
        if not isinstance(self.enable_expert_parallel, bool):
            raise ConfigError("enable_expert_parallel",
                              f"must be true or false, got {self.enable_expert_parallel!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ConfigError("attention_backend",
                              f"must be one of {', '.join(ATTENTION_BACKENDS)}, got {self.attention_backend!r}")
        if self.model is not None and not isinstance(self.model, (str, os.PathLike)):
            raise ConfigError("model", f"must be a path, got {type(self.model).__name__}")
        if self.tokenizer is not None:
            if not isinstance(self.tokenizer, (str, os.PathLike)):
                raise ConfigError("tokenizer", f"must be a path, got {type(self.tokenizer).__name__}")
            if not is_gguf(self.model):
                raise ConfigError("tokenizer", "applies to a .gguf model only (a model directory "
                                               "holds its own tokenizer)")
            if not Path(self.tokenizer).is_dir():
                raise ConfigError("tokenizer", f"{self.tokenizer} is not a directory")
        if self.speculative_config is not None:
            self.speculative_config = SpeculativeConfig.from_dict(self.speculative_config).to_dict()
        if not isinstance(self.batch_invariant, bool):
            raise ConfigError("batch_invariant", f"must be true or false, got {self.batch_invariant!r}")
        if self.batch_invariant:
            self._check_invariant_options()
        check_runner(self.runner)
        self._check_kv_offload()
        if self.pooler_config is not None:
            self.pooler_config = PoolerConfig.from_value(self.pooler_config).to_dict()
            if self.runner != "pooling":
                raise ConfigError("pooler_config", "applies to --runner pooling only")
        if self.runner == "pooling" and self.speculative_config is not None:
            raise ConfigError("speculative_config",
                              "a --runner pooling engine generates no token to speculate")

    def _check_kv_offload(self) -> None:
        for name in ("kv_offload_host_gb", "kv_offload_disk_gb"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < float("inf"):
                raise ConfigError(name, f"must be a number of GiB >= 0, got {v!r}")
        d = self.kv_offload_dir
        if d is not None:
            if not isinstance(d, (str, os.PathLike)) or not str(d):
                raise ConfigError("kv_offload_dir", f"must be a directory path, got {d!r}")
            self.kv_offload_dir = str(d)
            if Path(d).exists() and not Path(d).is_dir():
                raise ConfigError("kv_offload_dir", f"{d} exists and is not a directory")
            if self.kv_offload_disk_gb <= 0:
                raise ConfigError("kv_offload_disk_gb", "must be > 0 with kv_offload_dir set")
        if (self.kv_offload_host_gb or d is not None) and not self.enable_prefix_caching:
            raise ConfigError("kv_offload_host_gb" if self.kv_offload_host_gb else "kv_offload_dir",
                              "KV tiers serve prefix-cache misses: they need the prefix cache on")
        if (self.kv_offload_host_gb or d is not None) and self.runner != "generate":
            raise ConfigError("kv_offload_host_gb" if self.kv_offload_host_gb else "kv_offload_dir",
                              "KV tiers apply to --runner generate")

    @property
    def pooler(self) -> PoolerConfig:
        """The parsed ``pooler_config`` (defaults when unset)."""
        return PoolerConfig.from_value(self.pooler_config)

    def _check_invariant_options(self) -> None:
        """The options whose paths have no batch-invariant form (the runner checks the rest once
        the model is loaded: tpserve/workers/invariance.py)."""
        if self.attention_backend in ("torch", "flash"):
            raise ConfigError("attention_backend",
                              f"{self.attention_backend!r} has no batch-invariant mode (its kernels split "
                              f"a row's work by the batch's shape); with batch_invariant use auto, cpu "
                              f"or triton")
        if os.environ.get("TPSERVE_PREPACK", "1") == "0":
            raise ConfigError("batch_invariant",
                              "TPSERVE_PREPACK=0 runs the matmuls through torch's F.linear, whose "
                              "blocking follows the row count; unset it to use the mode")

    @property
    def speculative(self) -> SpeculativeConfig | None:
        """The parsed ``speculative_config`` (None when speculative decoding is off)."""
        c = self.speculative_config
        return None if c is None else SpeculativeConfig(**c)

    # ---- model directory -----------------------------------------------------------------
    @property
    def model_path(self) -> Path:
        """The model directory; for a .gguf model the one made from the file's metadata
        (tpserve/gguf_file/model_dir.py), which ``resolve`` writes if it is not there yet."""
        if is_gguf(self.model):
            try:
                return model_dir(self.model, self.tokenizer)
            except GGUFFileError as e:
                raise ConfigError("model", str(e)) from None
        return Path(self.model) if self.model is not None else DEFAULT_MODEL_DIR

    @property
    def model_name(self) -> str:
        """The name the APIs know the model by (unless --served-model-name): a GGUF file's
        stem, else the model directory's name."""
        if is_gguf(self.model):
            return model_stem(self.model)
        return os.path.basename(os.path.normpath(str(self.model_path)))

    def resolve(self) -> "EngineConfig":
        """Read config.json (and generation_config.json) of the model; fill derived fields."""
        if is_gguf(self.model):
            try:
                materialize(self.model, self.tokenizer)
            except GGUFFileError as e:
                raise ConfigError("model", str(e)) from None
        path = self.model_path
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise ConfigError("model", f"{path} is not a Hugging Face model directory (no config.json)")
        self.hf_config = json.loads(cfg_file.read_text())
        # A multimodal checkpoint (Gemma3ForConditionalGeneration) keeps it in its text_config.
        text = self.hf_config.get("text_config") or {}
        limit = int(self.hf_config.get("max_position_embeddings", text.get("max_position_embeddings", 2048)))
        if self.max_model_len is None:
            self.max_model_len = limit
        elif self.max_model_len > limit:
            raise ConfigError("max_model_len",
                              f"{self.max_model_len} exceeds the model's max_position_embeddings {limit}")
        self.max_num_batched_tokens = max(self.max_num_batched_tokens, 1)
        if not self.eos_token_ids:
            self.eos_token_ids = _eos_ids(path, self.hf_config)
        resolve_quantization(self.quantization, self.hf_config)  # refuses what cannot be loaded
        tp = self.tensor_parallel_size
        heads = int(self.hf_config.get("num_attention_heads", tp))
        if heads % tp:
            raise ConfigError("tensor_parallel_size",
                              f"{tp} does not divide num_attention_heads={heads}")
        return self

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("hf_config")
        return d

    @property
    def max_step_tokens(self) -> int:
        """The most tokens one engine step can hold under the configured policy."""
        if self.scheduling_policy == "mixed":
            return max(self.max_num_batched_tokens, self.max_stall_tokens)
        return self.max_num_batched_tokens

    def queue_limits(self) -> tuple[int | None, int | None]:
        """(max_waiting_requests, max_waiting_tokens) with "auto" sized from the KV pool
        (``num_kv_blocks`` must be known); None: no limit."""
        pool_tokens = (self.num_kv_blocks or 0) * self.block_size
        requests, tokens = self.max_waiting_requests, self.max_waiting_tokens
        if AUTO in (requests, tokens):
            assert self.num_kv_blocks, "auto queue limits need the KV pool's size"
        if requests == AUTO:
            requests = min(self.max_num_seqs, self.num_kv_blocks)
        if tokens == AUTO:
            tokens = pool_tokens
        return requests, tokens

    @classmethod
    def option_names(cls) -> list[str]:
        return [f.name for f in fields(cls) if f.name not in ("eos_token_ids", "hf_config")]


def _eos_ids(path: Path, hf_config: dict) -> list[int]:
    ids = []
    gen = path / "generation_config.json"
    for source in ([json.loads(gen.read_text())] if gen.is_file() else []) + [hf_config]:
        eos = source.get("eos_token_id")
        if eos is None:
            continue
        ids = list(eos) if isinstance(eos, list) else [eos]
        break
    return [int(i) for i in ids]
