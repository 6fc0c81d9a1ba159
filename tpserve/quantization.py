"""Which weights are int8, and how: ``--quantization`` and a checkpoint's ``quantization_config``.

Two sources, one result (:class:`QuantConfig`):

* ``--quantization int8``: a float checkpoint whose linear layers (the LM head included) are
  quantized when the model is loaded, symmetric int8 with one scale per output channel;
  activations are quantized per row at each matmul (int8 x int8 sums, see
  ``tpserve/kernels/csrc/linear_ops.cpp``), which measured faster than bf16 activations at
  every batch size (40M model on a 2-core AVX2 EPYC: bf16 activations ran at 0.87x the speed
  at one stream, 0.81x at 64).
* a checkpoint already quantized in the ``compressed-tensors`` format, as llm-compressor writes
  it (``quantization_config.quant_method == "compressed-tensors"``): W8A8 (int8 weights per
  channel, int8 activations per token, dynamic, symmetric; format ``int-quantized``) and W8A16
  (int8 weights per channel, 16-bit activations; format ``pack-quantized``, four weights per
  int32, or ``naive-quantized``). Detected from config.json; ``--quantization
  compressed-tensors`` only asserts it.

Anything else in a ``quantization_config`` (other methods, bit widths, group or block scales,
asymmetric or static activation scales, sparsity, a KV-cache scheme) is refused when the engine
starts, with the field and what tpserve supports. This module reads dicts only (no torch):
``EngineConfig.resolve`` calls it before any process starts; ``tpserve/models/quantization.py``
applies the result to a model.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from tpserve.errors import ConfigError

QUANTIZATION_METHODS = ("int8", "compressed-tensors")
_FORMATS = ("int-quantized", "naive-quantized", "pack-quantized")


@dataclass(frozen=True)
class QuantConfig:
    """The int8 scheme of a model's linear layers.

    ``int8_activations``: activations quantized per row (W8A8) or kept in the model dtype
    (W8A16). ``from_checkpoint``: the checkpoint holds int8 weights and scales (else the float
    weights are quantized at load). ``packed_int32``: its weights come as ``weight_packed``
    int32 words (format pack-quantized). ``ignore``: Hugging Face module names (or ``re:``
    patterns) left in the float dtype.
    """

    method: str
    int8_activations: bool
    from_checkpoint: bool
    packed_int32: bool = False
    ignore: tuple[str, ...] = field(default_factory=tuple)

    def quantizes(self, module_name: str) -> bool:
        """Whether the Hugging Face linear module ``module_name`` (e.g.
        ``model.layers.0.self_attn.q_proj``, ``lm_head``) has int8 weights."""
        for pattern in self.ignore:
            if pattern.startswith("re:"):
                if re.fullmatch(pattern[3:], module_name):
                    return False
            elif pattern == module_name:
                return False
        return True


def _fail(name: str, reason: str):
    where = f"quantization_config.{name}" if name else "quantization_config"
    raise ConfigError("quantization", f"{where}: {reason}")


def _check_args(args, name: str, *, strategy: str, dynamic: bool) -> None:
    if not isinstance(args, dict):
        _fail(name, f"expected an object, got {args!r}")
    want = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": strategy, "dynamic": dynamic}
    for key, value in want.items():
        if args.get(key) != value:
            _fail(f"{name}.{key}", f"tpserve supports {value!r} here (int8 {'per-token dynamic' if dynamic else 'per-channel'} "
                                   f"symmetric), got {args.get(key)!r}")
    for key in ("group_size", "block_structure", "actorder"):
        if args.get(key) not in (None, False):
            _fail(f"{name}.{key}", f"must be null (no group or block scales), got {args.get(key)!r}")


def _compressed_tensors(qc: dict) -> QuantConfig:
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        _fail("config_groups", "expected a non-empty object of quantization groups")
    schemes = set()
    for gname, group in groups.items():
        where = f"config_groups.{gname}"
        if not isinstance(group, dict):
            _fail(where, f"expected an object, got {group!r}")
        targets = group.get("targets")
        if targets != ["Linear"]:
            _fail(f"{where}.targets", f"tpserve supports ['Linear'] (every linear layer, less "
                                      f"'ignore'), got {targets!r}")
        _check_args(group.get("weights"), f"{where}.weights", strategy="channel", dynamic=False)
        acts = group.get("input_activations")
        if acts is not None:
            _check_args(acts, f"{where}.input_activations", strategy="token", dynamic=True)
        if group.get("output_activations") is not None:
            _fail(f"{where}.output_activations", "output quantization is not supported")
        fmt = group.get("format") or qc.get("format")
        if fmt not in _FORMATS:
            _fail("format", f"tpserve reads {', '.join(_FORMATS)}, got {fmt!r}")
        schemes.add((acts is not None, fmt == "pack-quantized"))
    if len(schemes) > 1:
        _fail("config_groups", "all groups must share one scheme (W8A8 or W8A16) and format")
    for key in ("kv_cache_scheme", "sparsity_config", "transform_config"):
        if qc.get(key):
            _fail(key, "not supported (must be null)")
    ignore = qc.get("ignore") or []
    if not isinstance(ignore, list) or not all(isinstance(x, str) for x in ignore):
        _fail("ignore", f"expected a list of module names, got {ignore!r}")
    status = qc.get("quantization_status", "compressed")
    if status != "compressed":
        _fail("quantization_status", f"the checkpoint must be saved compressed, got {status!r}")
    (int8_acts, packed), = schemes
    return QuantConfig("compressed-tensors", int8_activations=int8_acts, from_checkpoint=True,
                       packed_int32=packed, ignore=tuple(ignore))


def resolve_quantization(requested: str | None, hf_config: dict) -> QuantConfig | None:
    """The QuantConfig of ``--quantization`` (None: as the checkpoint says) and config.json.

    Raises ConfigError("quantization", ...) naming the unsupported or missing field."""
    if requested is not None and requested not in QUANTIZATION_METHODS:
        raise ConfigError("quantization", f"must be one of {', '.join(QUANTIZATION_METHODS)} "
                                          f"(or unset), got {requested!r}")
    qc = hf_config.get("quantization_config")
    if qc is None:
        if requested == "compressed-tensors":
            raise ConfigError("quantization", "compressed-tensors needs a checkpoint with a "
                                              "quantization_config in config.json; this one has none")
        if requested == "int8":
            return QuantConfig("int8", int8_activations=True, from_checkpoint=False)
        return None
    if not isinstance(qc, dict):
        _fail("", f"expected an object, got {qc!r}")
    method = qc.get("quant_method")
    if method != "compressed-tensors":
        _fail("quant_method", f"tpserve loads 'compressed-tensors' int8 checkpoints, got {method!r}")
    if requested == "int8":
        raise ConfigError("quantization", "the checkpoint is already quantized (compressed-tensors): "
                                          "leave --quantization unset or pass compressed-tensors")
    return _compressed_tensors(qc)
