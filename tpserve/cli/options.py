"""The engine options of the CLI as one click decorator, and their mapping to EngineConfig.

``@engine_options`` adds --model, --tp/--tensor-parallel-size, --block-size, ... to a command;
each option also reads ``TPSERVE_<NAME>`` from the environment (e.g. TPSERVE_NUM_KV_BLOCKS).
Defaults come from EngineConfig itself, so the CLI and the Python API cannot drift apart.
``config_from_options`` pops those keyword arguments and builds a validated EngineConfig,
turning ConfigError into click.BadParameter naming the option.
"""
from __future__ import annotations

import json
import os
from dataclasses import fields

import click

from tpserve.config import (ATTENTION_BACKENDS, AUTO, DTYPES, KV_CACHE_DTYPES, NO_QUANTIZATION,
                            SCHEDULING_ORDERS, SCHEDULING_POLICIES, EngineConfig)
from tpserve.pooling import RUNNERS
from tpserve.quantization import QUANTIZATION_METHODS
from tpserve.errors import ConfigError

_DEFAULTS = {f.name: f.default for f in fields(EngineConfig) if f.name in EngineConfig.option_names()}


class JsonMap(click.ParamType):
    """A JSON object given as text (e.g. --speculative-config '{"method": "ngram", ...}')."""

    name = "JSON"

    def convert(self, value, param, ctx):
        if value is None or isinstance(value, dict):
            return value
        try:
            parsed = json.loads(value)
        except ValueError as e:
            self.fail(f"is not valid JSON ({e}): {value!r}", param, ctx)
        if not isinstance(parsed, dict):
            self.fail(f"must be a JSON object ({{...}}), got {value!r}", param, ctx)
        return parsed


NO_LIMIT = "none"


class AutoOrCount(click.ParamType):
    """"auto", "none" (no limit: None) or an integer >= 1."""

    name = "auto|none|N"

    def convert(self, value, param, ctx):
        if value is None or value == AUTO or (isinstance(value, int) and not isinstance(value, bool)):
            return value
        if value == NO_LIMIT:
            return None
        try:
            return int(value)
        except (TypeError, ValueError):
            self.fail(f"must be 'auto', 'none' or an integer >= 1, got {value!r}", param, ctx)


# (EngineConfig field, option declarations, click kwargs). Flags map to booleans in _to_config.
_OPTIONS = [
    ("model", ("--model",), dict(type=str, default=None, metavar="PATH",
                                 help="Hugging Face model directory, or a .gguf file (docs/gguf.md) "
                                      "[default: the bundled default model]")),
    ("tokenizer", ("--tokenizer",), dict(type=str, default=None, metavar="DIR",
                                         help="a .gguf model's tokenizer from this directory instead of "
                                              "the file's metadata")),
    ("tensor_parallel_size", ("--tp", "--tensor-parallel-size"),
     dict(type=int, envvar=["TPSERVE_TENSOR_PARALLEL_SIZE", "TPSERVE_TP"],
          help="number of tensor-parallel ranks (GPUs, or CPU processes without a GPU)")),
    ("block_size", ("--block-size",), dict(type=int, help="tokens per KV-cache block")),
    ("max_num_seqs", ("--max-num-seqs",), dict(type=int, help="most sequences in one batch")),
    ("max_num_batched_tokens", ("--max-num-batched-tokens",),
     dict(type=int, help="most tokens in one engine step (prefill chunks included)")),
    ("max_stall_tokens", ("--max-stall-tokens",),
     dict(type=int, help="mixed steps while d streams decode hold up to max(max-num-batched-tokens, "
                         "this / d) tokens: larger steps when few streams wait on them")),
    ("scheduling_policy", ("--scheduling-policy",),
     dict(type=click.Choice(SCHEDULING_POLICIES),
          help="mixed: running decodes first, then prefill chunks, in one token budget per step; "
               "prefill-first: a step is all prefill while anything can be prefilled")),
    ("scheduling_order", ("--scheduling-order",),
     dict(type=click.Choice(SCHEDULING_ORDERS),
          help="fcfs: first come, first served (a request's priority must be 0); priority: lower "
               "priority values first, and a waiting request preempts running ones of a worse priority")),
    ("max_waiting_requests", ("--max-waiting-requests",),
     dict(type=AutoOrCount(), default=AUTO, show_default=True,
          help="refuse new requests (HTTP 429, ZMQ 'overloaded') while this many wait; auto: "
               "min(max-num-seqs, KV blocks); none: no limit")),
    ("max_waiting_tokens", ("--max-waiting-tokens",),
     dict(type=AutoOrCount(), default=AUTO, show_default=True,
          help="refuse a new request whose prompt would take the waiting prompt tokens past this; "
               "auto: the KV pool's tokens; none: no limit")),
    ("max_model_len", ("--max-model-len",),
     dict(type=int, help="longest prompt + completion [default: the model's max_position_embeddings]")),
    ("kv_cache_memory_gb", ("--kv-cache-memory-gb",), dict(type=float, help="KV-cache size on CPU, GiB")),
    ("kv_offload_host_gb", ("--kv-offload-host-gb",),
     dict(type=float, help="host-RAM KV tier below the pool, GiB (all ranks together): evicted prefix "
                           "blocks are kept there and loaded back instead of recomputed (0: off)")),
    ("kv_offload_dir", ("--kv-offload-dir",),
     dict(type=str, help="disk KV tier: a directory of evicted prefix blocks that outlives the daemon "
                         "(docs/kv_tiers.md); unset: off")),
    ("kv_offload_disk_gb", ("--kv-offload-disk-gb",),
     dict(type=float, help="bound of the disk KV tier, GiB")),
    ("gpu_memory_utilization", ("--gpu-memory-utilization",),
     dict(type=float, help="fraction of GPU memory the engine may use (GPU only)")),
    ("num_kv_blocks", ("--num-kv-blocks",),
     dict(type=int, help="KV-cache blocks, overriding the memory-based size")),
    ("dtype", ("--dtype",), dict(type=click.Choice(DTYPES), help="model weight and activation dtype")),
    ("kv_cache_dtype", ("--kv-cache-dtype",),
     dict(type=click.Choice(KV_CACHE_DTYPES),
          help="KV-cache storage: auto (the model's dtype), int8 (per-token, per-head scales: ~2x the "
               "tokens in the same memory; cpu and torch attention backends), fp8 (GPU only)")),
    ("quantization", ("--quantization",),
     dict(type=click.Choice((*QUANTIZATION_METHODS, NO_QUANTIZATION)),
          help="int8: quantize the linear layers at load (int8 weights per channel, int8 activations "
               "per row); compressed-tensors: an int8 checkpoint (detected from config.json without it); "
               "none: no quantization (a .gguf file's tensors dequantized at load to --dtype)")),
    ("enable_expert_parallel", ("--enable-expert-parallel",),
     dict(is_flag=True, help="mixture-of-experts models: each tensor-parallel rank holds whole experts "
                             "(default: every rank a slice of every expert)")),
    ("attention_backend", ("--attention-backend",),
     dict(type=click.Choice(ATTENTION_BACKENDS), help="attention kernels")),
    ("enforce_eager", ("--enforce-eager",), dict(is_flag=True, help="disable CUDA graphs")),
    ("enable_prefix_caching", ("--no-prefix-caching",),
     dict(is_flag=True, help="disable the prefix cache (reuse of full KV blocks across requests)")),
    ("kv_cache_prefault", ("--no-kv-cache-prefault",),
     dict(is_flag=True, help="CPU: leave the KV pool's pages unwritten until blocks are (resident memory "
                             "grows with use; the first requests pay the page faults)")),
    ("seed", ("--seed",), dict(type=int, help="engine seed (sampling of requests without their own seed)")),
    ("startup_timeout", ("--startup-timeout",),
     dict(type=float, help="seconds the engine may take to start: workers joining, model loading")),
    ("grammar_timeout", ("--grammar-timeout",),
     dict(type=float, help="seconds one request's grammar (structured_outputs, chat tools) may take to "
                           "convert and build, off the serving loop; a grammar over it is refused (HTTP 400)")),
    ("batch_invariant", ("--batch-invariant",),
     dict(is_flag=True, help="a token's logits and log-probabilities independent of the other requests "
                             "in its steps, of prompt chunking, prefix-cache hits, preemption and "
                             "speculation (docs/protocol.md, Reproducibility); paths without such a form "
                             "are refused")),
    ("speculative_config", ("--speculative-config",),
     dict(type=JsonMap(), default=None,
          help='speculative decoding, vLLM\'s keys as JSON, e.g. \'{"method": "ngram", '
               '"num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}\' '
               '[default: off]')),
    ("runner", ("--runner",),
     dict(type=click.Choice(RUNNERS), help="generate: completions; pooling: embeddings and scores "
                                          "(/v1/embeddings, /v1/rerank, /score; vLLM's --runner)")),
    ("pooler_config", ("--pooler-config",),
     dict(type=JsonMap(), default=None,
          help='--runner pooling: vLLM\'s pooler keys as JSON, e.g. \'{"pooling_type": "MEAN", '
               '"normalize": true}\'; a yes/no reranker\'s tokens: "classifier_from_token": ["no", "yes"] '
               '[default: LAST pooling, normalized]')),
]


def _param_name(decls: tuple[str, ...]) -> str:
    return decls[-1].lstrip("-").replace("-", "_")


def engine_options(f):
    """Decorator adding every engine option (with TPSERVE_* environment defaults) to a command."""
    for field_name, decls, kwargs in reversed(_OPTIONS):
        kwargs = dict(kwargs)
        name = _param_name(decls)
        kwargs.setdefault("envvar", f"TPSERVE_{name.upper()}")
        kwargs.setdefault("show_envvar", True)
        if "default" not in kwargs:
            if kwargs.get("is_flag"):
                kwargs["default"] = False
            else:
                kwargs["default"] = _DEFAULTS[field_name]
                kwargs["show_default"] = True
        f = click.option(*decls, name, **kwargs)(f)
    return f


ENGINE_PARAM_NAMES = tuple(_param_name(decls) for _, decls, _ in _OPTIONS)


# Fields whose option is a --no-... flag: the field is True unless it is given.
NEGATED_FLAGS = ("enable_prefix_caching", "kv_cache_prefault")


def config_from_options(kwargs: dict, resolve: bool = True) -> EngineConfig:
    """Pop the engine options out of a command's ``kwargs`` and build an EngineConfig.

    With ``resolve`` the model directory is read too (so a bad --model fails here, before any
    process is started). Raises click.BadParameter naming the offending option.
    """
    values = {name: kwargs.pop(name) for name in ENGINE_PARAM_NAMES if name in kwargs}
    cfg_kwargs = {}
    for field_name, decls, _ in _OPTIONS:
        name = _param_name(decls)
        if name not in values:
            continue
        value = values[name]
        if field_name in NEGATED_FLAGS:
            value = not value
        if field_name in ("model", "tokenizer") and value is not None:
            value = os.path.abspath(os.path.expanduser(value))
        cfg_kwargs[field_name] = value
    try:
        config = EngineConfig(**cfg_kwargs)
        if resolve:
            config.resolve()
    except ConfigError as e:
        reason = e.reason if "." not in e.field else f"{e.field}: {e.reason}"  # a key inside a map
        raise click.BadParameter(reason, param_hint=_hint(e.field)) from None
    return config


def _hint(field_name: str) -> str:
    field_name = field_name.split(".")[0]  # speculative_config.<key> -> the option
    for name, decls, _ in _OPTIONS:
        if name == field_name:
            return "/".join(f"'{d}'" for d in decls)
    return field_name


def options_argv(config: EngineConfig) -> list[str]:
    """Command-line arguments that rebuild ``config``'s options in a child ``tpserve serve``."""
    argv = []
    for field_name, decls, kwargs in _OPTIONS:
        value = getattr(config, field_name)
        if field_name in NEGATED_FLAGS:
            if not value:
                argv.append(decls[0])
        elif kwargs.get("is_flag"):
            if value:
                argv.append(decls[0])
        elif isinstance(value, dict):
            argv += [decls[-1], json.dumps(value)]
        elif value is not None:
            argv += [decls[-1], str(value)]
        elif isinstance(kwargs.get("type"), AutoOrCount):  # None is "no limit", not the default
            argv += [decls[-1], NO_LIMIT]
    return argv
