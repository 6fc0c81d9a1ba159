"""Which weights are quantized, and how: ``--quantization`` and a checkpoint's ``quantization_config``.

Several sources, one result (:class:`QuantConfig`):

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
* ``--quantization int4`` (``int4-g128``, ``int4-g32``): a float checkpoint whose linear layers
  are quantized at load to 4-bit codes, round-to-nearest, asymmetric (a scale and a min per
  group of 128 or 32 input features), method ``"group"`` (``tpserve/models/group_quant.py``);
  activations are quantized to int8 per row and group at each matmul (W4A8).
* method ``"group"`` from a checkpoint or file: weights stored as group codes, scales and mins
  (``<module>.weight_codes``, ``weight_group_scales``, ``weight_group_mins``; 4 or 8 bits per
  code, any group size in :data:`GROUP_SIZES`, inferred per layer from the shapes). AWQ and GPTQ
  checkpoints (``quant_method`` ``awq`` / ``gptq``) and compressed-tensors 4-bit group schemes
  (W4A16 / W4A8, format ``pack-quantized``) resolve to it with their ``checkpoint_format`` named
  (``awq``, ``gptq``, ``gptq_v2``, ``compressed-tensors``), for the decoders of
  ``tpserve/models/quant_formats.py`` to turn into those tensors. ``--quantization group`` asserts it.

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

# --quantization none: no quantization at all (a GGUF file's tensors and gpt-oss's MXFP4 experts
# dequantized at load).
NO_QUANTIZATION = "none"
QUANTIZATION_METHODS = ("int8", "compressed-tensors", "int4", "int4-g128", "int4-g32", "group")
# Group sizes of group-quantized weights (a group divides a layer's input size).
GROUP_SIZES = (16, 32, 64, 128, 256)
# An MXFP4 checkpoint's float modules: every one but the experts'.
MXFP4_FLOAT = r"re:(?!.*\.experts\.\d+\.).*"
_INT4_GROUPS = {"int4": 128, "int4-g128": 128, "int4-g32": 32}
_FORMATS = ("int-quantized", "naive-quantized", "pack-quantized")


@dataclass(frozen=True)
class QuantConfig:
    """The quantization scheme of a model's linear layers.

    ``method``: ``int8``, ``compressed-tensors`` (int8 per channel) or ``group`` (group codes,
    ``tpserve/models/group_quant.py``). ``int8_activations``: activations quantized per row
    (W8A8) or kept in the model dtype (W8A16). ``from_checkpoint``: the checkpoint holds int8
    weights and scales (else the float weights are quantized at load). ``packed_int32``: its
    weights come as ``weight_packed`` int32 words (format pack-quantized). ``ignore``: Hugging
    Face module names (or ``re:`` patterns) left in the float dtype. Group method only:
    ``group_size`` (quantized at load: the group; from a checkpoint: 0, each layer's group is
    inferred from its tensors' shapes, or the size the checkpoint's config declares), ``bits``
    (4 or 8; at load: 4), ``checkpoint_format`` ("" for tpserve's tensor names, else the format
    whose decoder maps the checkpoint's tensors onto them: ``awq``, ``gptq``), ``tied_head_codes``
    (the checkpoint gives a tied LM head group codes, ``lm_head.weight_codes`` ..., and the
    embedding looks its rows up in them: a GGUF file's quantized ``token_embd``).
    """

    method: str
    int8_activations: bool
    from_checkpoint: bool
    packed_int32: bool = False
    ignore: tuple[str, ...] = field(default_factory=tuple)
    group_size: int = 0
    bits: int = 0
    checkpoint_format: str = ""
    tied_head_codes: bool = False

    @property
    def grouped(self) -> bool:
        """Whether the weights are group-quantized (codes, scales and mins per group)."""
        return self.method == "group"

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
        weights = group.get("weights")
        fmt = group.get("format") or qc.get("format")
        grouped = _is_ct_group(weights, fmt)
        if grouped:
            if weights.get("num_bits") != 4:
                _fail(f"{where}.weights.num_bits", f"tpserve supports 4-bit group weights, got "
                                                   f"{weights.get('num_bits')!r}")
            group_scheme = _ct_group_weights(weights, f"{where}.weights")
        else:
            _check_args(weights, f"{where}.weights", strategy="channel", dynamic=False)
        acts = group.get("input_activations")
        if acts is not None:
            _check_args(acts, f"{where}.input_activations", strategy="token", dynamic=True)
        if group.get("output_activations") is not None:
            _fail(f"{where}.output_activations", "output quantization is not supported")
        if fmt not in (("pack-quantized",) if grouped else _FORMATS):
            _fail("format", f"tpserve reads {'pack-quantized' if grouped else ', '.join(_FORMATS)}"
                            f"{' 4-bit group weights' if grouped else ''}, got {fmt!r}")
        schemes.add((acts is not None, fmt == "pack-quantized", group_scheme if grouped else None))
    if len(schemes) > 1:
        _fail("config_groups", "all groups must share one scheme (W8A8, W8A16, W4A16 or W4A8) and format")
    for key in ("kv_cache_scheme", "sparsity_config", "transform_config"):
        if qc.get(key):
            _fail(key, "not supported (must be null)")
    ignore = qc.get("ignore") or []
    if not isinstance(ignore, list) or not all(isinstance(x, str) for x in ignore):
        _fail("ignore", f"expected a list of module names, got {ignore!r}")
    status = qc.get("quantization_status", "compressed")
    if status != "compressed":
        _fail("quantization_status", f"the checkpoint must be saved compressed, got {status!r}")
    (int8_acts, packed, group_scheme), = schemes
    if group_scheme is not None:  # W4A16 / W4A8: decoded by tpserve/models/quant_formats.py
        return group_quant_config(group_scheme[0], 4, tuple(ignore), checkpoint_format="compressed-tensors")
    return QuantConfig("compressed-tensors", int8_activations=int8_acts, from_checkpoint=True,
                       packed_int32=packed, ignore=tuple(ignore))


def group_quant_config(group_size: int = 0, bits: int = 0, ignore: tuple[str, ...] = (),
                       checkpoint_format: str = "", tied_head_codes: bool = False) -> QuantConfig:
    """The QuantConfig of a checkpoint (or file) holding group codes; ``group_size`` 0: inferred
    per layer from the tensors' shapes; ``bits`` 0: from each layer's codes."""
    if group_size and group_size not in GROUP_SIZES:
        _fail("group_size", f"tpserve supports groups of {', '.join(map(str, GROUP_SIZES))}, "
                            f"got {group_size!r}")
    if bits not in (0, 4, 8):
        _fail("bits", f"tpserve supports 4- and 8-bit codes, got {bits!r}")
    return QuantConfig("group", int8_activations=True, from_checkpoint=True, ignore=tuple(ignore),
                       group_size=group_size, bits=bits, checkpoint_format=checkpoint_format,
                       tied_head_codes=tied_head_codes)


def _gptq_awq(method: str, qc: dict) -> QuantConfig:
    """AWQ / GPTQ: the fields every such checkpoint shares, checked; the layout is the decoder's
    (``tpserve/models/quant_formats.py``)."""
    bits = qc.get("bits", qc.get("w_bit"))
    if bits not in ((4,) if method == "awq" else (4, 8)):
        _fail("bits", f"tpserve loads {'4' if method == 'awq' else '4- and 8'}-bit {method} checkpoints, "
                      f"got {bits!r}")
    group = _format_group(qc.get("group_size", qc.get("q_group_size")), "group_size")
    ignore = qc.get("modules_to_not_convert") or []
    if not isinstance(ignore, list) or not all(isinstance(x, str) for x in ignore):
        _fail("modules_to_not_convert", f"expected a list of module names, got {ignore!r}")
    # AutoAWQ and GPTQ skip a module whose name contains an entry; both leave the LM head float
    # (GPTQModel quantizes it with "lm_head": true).
    ignore = [f"re:.*{re.escape(x)}.*" for x in ignore]
    if qc.get("lm_head") is not True:
        ignore.append("lm_head")
    for key in ("dynamic", "modules_in_block_to_quantize"):
        if qc.get(key):
            _fail(key, "per-module quantization choices are not supported (must be null)")
    fmt = method
    if method == "awq":
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            _fail("version", f"tpserve reads AWQ's 'gemm' layout, got {qc.get('version')!r}")
        if qc.get("zero_point", True) is not True:
            _fail("zero_point", f"tpserve reads AWQ checkpoints with zero points (true), got "
                                f"{qc.get('zero_point')!r}")
    else:
        fmt = qc.get("checkpoint_format") or "gptq"
        if fmt not in ("gptq", "gptq_v2"):
            _fail("checkpoint_format", f"tpserve reads 'gptq' and 'gptq_v2' layouts, got {fmt!r}")
        if qc.get("is_marlin_format"):
            _fail("is_marlin_format", "Marlin-repacked GPTQ weights are not supported (must be false)")
        if not isinstance(qc.get("sym", True), bool):
            _fail("sym", f"expected true or false, got {qc.get('sym')!r}")
        # desc_act: allowed; a g_idx that reorders the groups is refused when the weights load.
    return group_quant_config(group, bits, tuple(ignore), checkpoint_format=fmt)


def _format_group(value, name: str) -> int:
    """A checkpoint format's group size: one of GROUP_SIZES, or 0 (per layer, from the shapes)
    for per-channel scales (-1) and multiples of a kernel group, which the decoders re-express
    in smaller groups exactly (``tpserve/models/quant_formats.py``)."""
    if value in GROUP_SIZES:
        return value
    if value == -1 or (isinstance(value, int) and value > 0 and any(value % g == 0 for g in GROUP_SIZES)):
        return 0
    _fail(name, f"tpserve supports groups of {', '.join(map(str, GROUP_SIZES))} (or multiples of "
                f"them, or -1 per channel), got {value!r}")


def _ct_group_weights(args: dict, name: str) -> tuple[int, bool]:
    """compressed-tensors 4-bit group weights (W4A16 / W4A8, what llm-compressor writes as
    pack-quantized): ``(group_size, symmetric)``, or a ConfigError naming the field."""
    if args.get("type") != "int":
        _fail(f"{name}.type", f"tpserve supports 'int' 4-bit weights, got {args.get('type')!r}")
    if args.get("strategy") == "channel":  # one scale per output row: groups of the whole row
        if args.get("group_size") is not None:
            _fail(f"{name}.group_size", f"must be null with strategy 'channel', got "
                                        f"{args.get('group_size')!r}")
        group = 0
    else:
        group = _format_group(args.get("group_size"), f"{name}.group_size")
    if not isinstance(args.get("symmetric", True), bool):
        _fail(f"{name}.symmetric", f"expected true or false, got {args.get('symmetric')!r}")
    if args.get("dynamic") not in (None, False):
        _fail(f"{name}.dynamic", f"weights must be static (false), got {args.get('dynamic')!r}")
    # actorder 'weight' / 'static' keeps the groups contiguous; 'group' stores a reordering g_idx.
    if args.get("actorder") not in (None, False, "weight", "static"):
        _fail(f"{name}.actorder", f"tpserve loads contiguous groups only (null, 'weight' or 'static'), "
                                  f"got {args.get('actorder')!r}")
    if args.get("block_structure") is not None:
        _fail(f"{name}.block_structure", f"must be null, got {args.get('block_structure')!r}")
    return group, bool(args.get("symmetric", True))


def _is_ct_group(args, fmt) -> bool:
    """Group weights not of 8 bits (4; other widths are refused naming num_bits) or pack-quantized
    4-bit channel weights: the group-quant layer's, through quant_formats.py."""
    if not isinstance(args, dict):
        return False
    return (args.get("strategy") == "group" and args.get("num_bits") != 8) or \
        (args.get("strategy") == "channel" and args.get("num_bits") == 4 and fmt == "pack-quantized")


def resolve_quantization(requested: str | None, hf_config: dict) -> QuantConfig | None:
    """The QuantConfig of ``--quantization`` (None: as the checkpoint says; ``none``: a float
    checkpoint, or gpt-oss's MXFP4 experts dequantized) and config.json.

    Raises ConfigError("quantization", ...) naming the unsupported or missing field."""
    if requested == NO_QUANTIZATION:
        qc = hf_config.get("quantization_config")
        if qc is None or (isinstance(qc, dict) and qc.get("quant_method") == "mxfp4"):
            return None
        raise ConfigError("quantization", "none: this checkpoint is quantized (its config.json has a "
                                          "quantization_config); none applies to float checkpoints, "
                                          "gpt-oss's MXFP4 experts and GGUF files (dequantized at load)")
    if requested is not None and requested not in QUANTIZATION_METHODS:
        raise ConfigError("quantization", f"must be one of {', '.join(QUANTIZATION_METHODS)} "
                                          f"(or unset), got {requested!r}")
    qc = hf_config.get("quantization_config")
    if qc is None:
        if requested in ("compressed-tensors", "group"):
            raise ConfigError("quantization", f"{requested} needs a checkpoint with a "
                                              "quantization_config in config.json; this one has none")
        if requested == "int8":
            return QuantConfig("int8", int8_activations=True, from_checkpoint=False)
        if requested in _INT4_GROUPS:
            return QuantConfig("group", int8_activations=True, from_checkpoint=False,
                               group_size=_INT4_GROUPS[requested], bits=4)
        return None
    if not isinstance(qc, dict):
        _fail("", f"expected an object, got {qc!r}")
    method = qc.get("quant_method")
    if requested in ("int8", *_INT4_GROUPS):
        raise ConfigError("quantization", f"the checkpoint is already quantized ({method}): "
                                          "leave --quantization unset")
    if method == "group":  # tpserve's own names: weight_codes / weight_group_scales / _mins
        ignore = qc.get("ignore") or []
        if not isinstance(ignore, list) or not all(isinstance(x, str) for x in ignore):
            _fail("ignore", f"expected a list of module names, got {ignore!r}")
        return group_quant_config(qc.get("group_size") or 0, qc.get("bits") or 0, tuple(ignore))
    if method in ("awq", "gptq"):
        return _gptq_awq(method, qc)
    if method == "mxfp4":  # gpt-oss's experts, as exact group codes (models/mxfp4.py); the rest float
        return QuantConfig("group", int8_activations=True, from_checkpoint=True, checkpoint_format="mxfp4",
                           ignore=(MXFP4_FLOAT,))
    if method != "compressed-tensors":
        _fail("quant_method", f"tpserve loads 'compressed-tensors' int8, 'group', 'awq', 'gptq' and "
                              f"gpt-oss's 'mxfp4' checkpoints, got {method!r}")
    if requested == "group":
        raise ConfigError("quantization", "the checkpoint is compressed-tensors: leave --quantization unset "
                                          "or pass compressed-tensors")
    return _compressed_tensors(qc)
