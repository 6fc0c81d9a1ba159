"""Build a tensor-parallel model shard from a Hugging Face checkpoint directory.

A checkpoint directory holds ``config.json`` and safetensors weights: one ``model.safetensors``,
or several shards listed by ``model.safetensors.index.json``. Every rank reads the full tensors
(memory-mapped) and keeps its own slice through each parameter's ``weight_loader``; with expert
parallelism the experts other ranks hold are not read at all.

Checkpoint names map 1:1 onto module names except packed modules (``q/k/v_proj`` ->
``qkv_proj`` with shard ids "q"/"k"/"v", ``gate/up_proj`` -> ``gate_up_proj`` with 0/1). With
``tie_word_embeddings`` the LM head shares the embedding and ``lm_head.weight`` is not needed
(and ignored if present).

Mixture-of-experts layers (``moe.py``) take each expert's tensors,
``<block>.experts.{e}.{gate_proj,up_proj,down_proj}.weight`` (Mixtral: ``w1``/``w3``/``w2``
under ``block_sparse_moe``), or the fused ``<block>.experts.gate_up_proj [E, 2I, H]`` and
``<block>.experts.down_proj [E, H, I]`` that transformers holds in memory; Mixtral's block may
also be called ``mlp`` (transformers' in-memory name). gpt-oss's router (``mlp.router``) and
experts (transposed and interleaved, float or MXFP4) are renamed and split per expert by
``mxfp4.py``; each expert's biases load as ``experts.{e}.<proj>.bias``.

Phi-3 checkpoints store each layer's q/k/v as one ``self_attn.qkv_proj`` tensor (rows: q, k, v; its bias
and int8 ``weight_scale`` rows alike)
and gate/up as one ``mlp.gate_up_proj`` (rows: gate, up); they are split into the per-module
names above as they are read. A ``Gemma3ForConditionalGeneration`` checkpoint's language model
lives under ``language_model.model.`` / ``language_model.lm_head.`` (or transformers' newer
``model.language_model.``); those prefixes are dropped and its vision tower and projector
(``vision_tower.``, ``multi_modal_projector.``) are not read.

Every parameter (and every part of a packed one) must be loaded
exactly from the checkpoint, and every checkpoint tensor must land somewhere: otherwise
:class:`CheckpointError` lists the offending names.
"""
from __future__ import annotations

import json
import re
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from huggingface_hub.errors import StrictDataclassError
from safetensors import safe_open
from tqdm.auto import tqdm
from transformers import AutoConfig

from tpserve.gguf_file import gguf_files
from tpserve.kernels.backend_factory import get_backend
from tpserve.models.decoder import CausalLM
from tpserve.models.errors import CheckpointError, UnsupportedModelError
from tpserve.models.gguf import gguf_quant_config, gguf_weights
from tpserve.models.moe import DOWN, FUSED_DOWN, FUSED_GATE_UP, FusedMoE
from tpserve.models.mxfp4 import gpt_oss_names
from tpserve.models.parallel import TPContext
from tpserve.models.quant_formats import decoded_tensors
from tpserve.models.quantization import checkpoint_tensors, prepare_model
from tpserve.models.spec import ModelSpec, model_spec
from tpserve.models.weights import default_weight_loader
from tpserve.quantization import resolve_quantization

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
}
# Buffers some older checkpoints saved; derived from config here.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_MAX_LISTED = 10


def resolve_dtype(dtype: torch.dtype | str, config=None) -> torch.dtype:
    """``"auto"`` -> the config's ``dtype``/``torch_dtype`` (float32 if it names none); else parse."""
    if dtype == "auto":
        found = getattr(config, "dtype", None) if hasattr(config, "dtype") else getattr(config, "torch_dtype", None)
        if found is None:
            return torch.float32
        dtype = found
    if isinstance(dtype, torch.dtype):
        if dtype in _DTYPES.values():
            return dtype
    elif isinstance(dtype, str) and dtype.removeprefix("torch.") in _DTYPES:
        return _DTYPES[dtype.removeprefix("torch.")]
    raise ValueError(f"dtype: {dtype!r} is not supported; allowed: 'auto', {', '.join(repr(k) for k in _DTYPES)} "
                     f"or the matching torch dtypes")


def load_config(path: str | Path):
    """Read ``path/config.json`` with transformers' AutoConfig (config classes only, no code)."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise CheckpointError(f"{path}: no config.json; expected a Hugging Face model directory")
    try:
        return AutoConfig.from_pretrained(path)
    except StrictDataclassError as e:  # transformers' own validation of a field's value
        raise UnsupportedModelError("config.json", f"{path}: transformers refuses it: {e}") from None
    except (ValueError, KeyError) as e:  # unknown model_type and friends
        raise UnsupportedModelError("model_type", f"config.json in {path} cannot be read: {e}") from None


def load_model(path: str | Path, tp: TPContext | None = None, dtype: torch.dtype | str = "auto",
               backend=None, device: str | torch.device = "cpu", progress: bool | None = None,
               block_size: int = 16, quantization: str | None = None,
               enable_expert_parallel: bool = False) -> CausalLM:
    """Build this rank's shard of the model in ``path`` and load its weights.

    ``backend`` is the attention backend shared by all layers (default:
    ``get_backend("auto", device=device, block_size=block_size)``; ``block_size`` is used for
    nothing else). ``dtype``: "auto" (config.json's), a name such as "bfloat16", or a torch
    dtype. ``progress``: show a tqdm bar over checkpoint tensors; None shows it on rank 0 for
    multi-file checkpoints. ``quantization``: ``--quantization`` (None: as config.json's
    ``quantization_config`` says; see tpserve/quantization.py); the weights are packed (and
    quantized at load) by ``prepack_model`` afterwards. ``enable_expert_parallel``: a mixture of
    experts' ranks hold whole experts (else a slice of each). Raises UnsupportedModelError,
    CheckpointError (both ValueError) or ConfigError (an unsupported quantization).
    """
    tp = tp or TPContext()
    path = Path(path)
    config = load_config(path)
    spec = model_spec(config)
    torch_dtype = resolve_dtype(dtype, config)
    device = torch.device(device)
    if backend is None:
        backend = get_backend("auto", device=device, block_size=block_size)
    hf_config = json.loads((path / "config.json").read_text())
    gguf = gguf_files(path)  # a model directory made from a GGUF file (tpserve/gguf_file/)
    if gguf is not None:
        qc = gguf_quant_config(gguf, quantization, spec, hf_config)
    else:
        qc = resolve_quantization(quantization, hf_config)
    with _default_dtype(torch_dtype), device:
        model = CausalLM(spec, tp, backend, expert_parallel=enable_expert_parallel)
        if qc is not None:
            prepare_model(model, qc)
    if gguf is not None:
        tensors = gguf_weights(gguf, spec, qc, torch_dtype, skip=_other_ranks_experts(model))
    else:
        files = checkpoint_files(path)
        show = progress if progress is not None else (tp.rank == 0 and len(files) > 1)
        tensors = iter_safetensors(files, show, skip=_other_ranks_experts(model))
        tensors = decoded_tensors(tensors, qc, hf_config)  # AWQ, GPTQ, compressed-tensors 4-bit
        mxfp4_codes = qc is not None and qc.checkpoint_format == "mxfp4"
        tensors = architecture_names(tensors, spec, _other_ranks_experts(model), mxfp4_codes)
    load_weights(model, checkpoint_tensors(tensors) if qc is not None and qc.from_checkpoint else tensors)
    return model.eval()


_TEXT_TOWER_PREFIXES = (("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."),
                        ("model.language_model.", "model."))
_VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                    "model.multi_modal_projector.")


def architecture_names(tensors: Iterable[tuple[str, torch.Tensor | None]], spec: ModelSpec,
                       skip: Callable[[str], bool] | None = None, mxfp4_codes: bool = False
                       ) -> Iterator[tuple[str, torch.Tensor | None]]:
    """Checkpoint tensors under the decoder's names: a multimodal checkpoint's text tower without
    its prefix (vision weights dropped), Phi-3's fused q/k/v and gate/up split per module,
    gpt-oss's experts per expert (``skip``: the expert weights other ranks hold, not dequantized;
    ``mxfp4_codes``: MXFP4 experts as group codes, not dequantized)."""
    if spec.architecture == "GptOssForCausalLM":
        tensors = gpt_oss_names(tensors, skip, codes=mxfp4_codes)
    q_rows, kv_rows = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    for key, tensor in tensors:
        if spec.text_tower:
            if key.startswith(_VISION_PREFIXES):
                continue
            for old, new in _TEXT_TOWER_PREFIXES:
                if key.startswith(old):
                    key = new + key[len(old):]
                    break
        if (spec.fused_checkpoint and tensor is not None
                and key.endswith((".weight", ".bias", ".weight_scale"))):
            owner, _, leaf = key.rpartition(".")
            if owner.endswith(".self_attn.qkv_proj"):
                base = owner[:-len("qkv_proj")]
                _check_rows(key, tensor, q_rows + 2 * kv_rows)
                for name, part in zip(("q_proj", "k_proj", "v_proj"),
                                      tensor.split([q_rows, kv_rows, kv_rows])):
                    yield f"{base}{name}.{leaf}", part
                continue
            if owner.endswith(".mlp.gate_up_proj"):
                base = owner[:-len("gate_up_proj")]
                _check_rows(key, tensor, 2 * spec.intermediate_size)
                gate, up = tensor.split(spec.intermediate_size)
                yield f"{base}gate_proj.{leaf}", gate
                yield f"{base}up_proj.{leaf}", up
                continue
        yield key, tensor


def _check_rows(key: str, tensor: torch.Tensor, rows: int) -> None:
    if tensor.dim() < 1 or tensor.shape[0] != rows:
        raise CheckpointError(f"{key}: expected {rows} rows (a fused tensor), "
                              f"got shape {tuple(tensor.shape)}")


@contextmanager
def _default_dtype(dtype: torch.dtype):
    # Parameters are created with torch.empty in the default dtype: building them directly in the
    # target dtype avoids materialising a float32 copy of a large model first.
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def checkpoint_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint, in index order (or the single file)."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index}: has no 'weight_map' object of tensor name -> file")
        files = [path / name for name in sorted(set(weight_map.values()))]
        absent = [str(f.name) for f in files if not f.is_file()]
        if absent:
            raise CheckpointError(f"{index} lists files that do not exist: {absent}")
        return files
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    found = sorted(path.glob("*.safetensors"))
    if not found:
        raise CheckpointError(f"{path}: no *.safetensors weights (only safetensors checkpoints are supported)")
    return found


def iter_safetensors(files: list[Path], progress: bool = False,
                     skip: Callable[[str], bool] | None = None) -> Iterator[tuple[str, torch.Tensor | None]]:
    """Yield ``(name, tensor on CPU)`` for every tensor of every file; ``(name, None)``, without
    reading it, for a name ``skip`` says this rank does not need."""
    total = None
    if progress:  # headers only: cheap, and gives the bar a length
        total = 0
        for f in files:
            with safe_open(f, framework="pt", device="cpu") as st:
                total += len(list(st.keys()))
    # No bar at all without progress: even a disabled tqdm creates its multiprocessing lock, a
    # named semaphore that a worker rank (which leaves with os._exit) would leak.
    bar = tqdm(total=total, unit="tensor", desc="loading weights") if progress else None
    try:
        for f in files:
            with safe_open(f, framework="pt", device="cpu") as st:
                for key in st.keys():
                    yield key, (None if skip is not None and skip(key) else st.get_tensor(key))
                    if bar is not None:
                        bar.update(1)
    finally:
        if bar is not None:
            bar.close()


def _target(key: str, mapping: dict) -> tuple[str, object]:
    """Checkpoint name -> (parameter name, shard id or None)."""
    parts = key.split(".")
    for i, part in enumerate(parts[:-1]):
        if part in mapping:
            packed, shard = mapping[part]
            parts[i] = packed
            return ".".join(parts), shard
    return key, None


# <block>.experts.{e}.<proj>.<leaf>, or the fused <block>.experts.<gate_up|down>_proj; the leaves:
# a float or int8 weight, its scale, a bias, group codes, scales and mins (moe_group.py)
_EXPERT_LEAVES = "weight|weight_scale|bias|weight_codes|weight_group_scales|weight_group_mins"
_EXPERT_KEY = re.compile(r"(?P<moe>.+)\.experts\."
                         rf"(?:(?P<e>\d+)\.(?P<proj>\w+)\.(?P<leaf>{_EXPERT_LEAVES})"
                         r"|(?P<fused>gate_up_proj|down_proj))")


_ONE_EXPERT_KEY = re.compile(r"(?P<moe>.+)\.experts\.(?P<e>\d+)\.\w+\."
                             rf"(?:{_EXPERT_LEAVES}|weight_packed)")


def _other_ranks_experts(model: CausalLM) -> Callable[[str], bool] | None:
    """With expert parallelism, a test of the checkpoint names of experts held by other ranks
    (not read here: at TP=N a rank reads 1/N of the expert weights); else None."""
    ranges = {name: (m.expert_start, m.expert_start + m.num_local_experts)
              for name, m in model.named_modules()
              if isinstance(m, FusedMoE) and m.num_local_experts < m.num_experts}
    if not ranges:
        return None
    moe_module = model.spec.moe_module

    def skip(key: str) -> bool:
        m = _ONE_EXPERT_KEY.fullmatch(key)
        if m is None:
            return False
        block = m["moe"]
        if moe_module != "mlp" and block.endswith(".mlp"):
            block = block[:-len("mlp")] + moe_module
        span = ranges.get(f"{block}.experts")
        return span is not None and not span[0] <= int(m["e"]) < span[1]
    return skip


def _expert_target(key: str, model: CausalLM):
    """An expert weight's ``(parameter name, shard id, pieces it covers)``, or None."""
    m = _EXPERT_KEY.fullmatch(key)
    if m is None:
        return None
    prefix = f"{m['moe']}.experts"
    try:
        module = model.get_submodule(prefix)
    except AttributeError:
        return None
    if not isinstance(module, FusedMoE):
        return None
    if m["fused"]:
        part = FUSED_GATE_UP if m["fused"] == "gate_up_proj" else FUSED_DOWN
        name = "w13_weight" if part == FUSED_GATE_UP else "w2_weight"
        return f"{prefix}.{name}", (None, part), module.needed_shards(name)
    part = module.proj_names.get(m["proj"])
    if part is None or int(m["e"]) >= module.num_experts:
        return None
    name = ("w2_" if part == DOWN else "w13_") + m["leaf"]
    shard = (int(m["e"]), part)
    return f"{prefix}.{name}", shard, {shard}


def _listing(names: Iterable[str]) -> str:
    names = sorted(names)
    more = f" ... and {len(names) - _MAX_LISTED} more" if len(names) > _MAX_LISTED else ""
    return ", ".join(names[:_MAX_LISTED]) + more


def load_weights(model: CausalLM, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Load full checkpoint tensors into the model's (sharded) parameters; raise on any mismatch."""
    params = dict(model.named_parameters())  # a tied lm_head.weight appears once, as the embedding
    experts = {name: module for name, module in model.named_modules() if isinstance(module, FusedMoE)}
    needed: dict[str, set] = {}
    for name in params:
        owner, _, leaf = name.rpartition(".")
        if owner in experts:
            needed[name] = experts[owner].needed_shards(leaf)
            continue
        module = name.split(".")[-2] if "." in name else ""
        needed[name] = {shard for packed, shard in model.packed_modules_mapping.values() if packed == module} or {None}
    loaded: dict[str, set] = defaultdict(set)
    unexpected = []
    spec = model.spec
    for key, tensor in weights:
        if key.endswith(_IGNORED_SUFFIXES) or (key == "lm_head.weight" and spec.tie_word_embeddings):
            continue
        if spec.sequence_classification and key.startswith("score."):  # the pooler's (workers/pooler.py)
            continue
        if spec.moe_module != "mlp" and ".mlp." in key:  # Mixtral under transformers' in-memory name
            key = key.replace(".mlp.", f".{spec.moe_module}.")
        expert = _expert_target(key, model) if experts else None
        if expert is not None:
            name, shard, covers = expert
            param = params.get(name)
            if param is None:  # e.g. a weight_scale of float experts
                unexpected.append(key)
                continue
            try:
                if tensor is not None:  # None: another rank's expert, not read
                    param.weight_loader(param, tensor, shard)
            except CheckpointError as e:
                raise CheckpointError(f"{key}: {e}") from None
            loaded[name] |= covers
            continue
        name, shard = _target(key, model.packed_modules_mapping)
        param = params.get(name)
        if param is None:
            unexpected.append(key)
            continue
        loader = getattr(param, "weight_loader", default_weight_loader)
        try:
            loader(param, tensor) if shard is None else loader(param, tensor, shard)
        except CheckpointError as e:
            raise CheckpointError(f"{key}: {e}") from None
        loaded[name].add(shard)
    checkpoint_name = {(packed, shard): module for module, (packed, shard) in model.packed_modules_mapping.items()}
    missing = []
    for name, shards in needed.items():
        owner, _, leaf = name.rpartition(".")
        if owner in experts:
            missing += [experts[owner].checkpoint_name(owner, s, leaf)
                        for s in sorted(shards - loaded[name])]
            continue
        for shard in shards - loaded[name]:
            if shard is None:
                missing.append(name)
            else:  # report the name the checkpoint should have had
                *prefix, packed, leaf = name.split(".")
                missing.append(".".join([*prefix, checkpoint_name[(packed, shard)], leaf]))
    problems = []
    if missing:
        problems.append(f"missing weights: {_listing(missing)}")
    if unexpected:
        problems.append(f"unexpected weights (no such parameter in {model.spec.architecture}): {_listing(unexpected)}")
    if problems:
        raise CheckpointError("checkpoint does not match config.json: " + "; ".join(problems))
