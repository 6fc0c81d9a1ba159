"""Tiny Hugging Face checkpoints with random weights, built locally for tests.

``make_tiny_model(root, arch="qwen3", **overrides) -> Path`` returns a directory that
``transformers.AutoModelForCausalLM.from_pretrained``, ``AutoTokenizer.from_pretrained`` and
``tpserve.models.load_model`` all accept: config.json, model.safetensors (float32),
generation_config.json and a byte-level BPE tokenizer whose vocabulary size equals the model's.

Weights are re-drawn with a large std (``init_std``, default 0.25) so greedy decoding varies
instead of repeating one token. Models are cached under ``root`` by their parameters: asking
twice for the same model returns the same directory without rebuilding it.

Overrides (all optional):
- any config field: ``hidden_size``, ``num_hidden_layers``, ``num_attention_heads``,
  ``num_key_value_heads``, ``head_dim``, ``intermediate_size``, ``vocab_size`` (>= 259, odd
  sizes allowed), ``max_position_embeddings``, ``tie_word_embeddings``, ``rope_theta``,
  the MoE fields of ``qwen3_moe``/``qwen2_moe``/``mixtral``/``gpt_oss`` (:data:`MOE_DEFAULTS`),
  ``rope_scaling`` (e.g. :data:`LLAMA3_ROPE_SCALING`), ``attention_bias``, ``mlp_bias`` ...
- ``seed`` (default 0) and ``init_std`` (default 0.25) for the random weights;
- ``generation_config``: a dict merged into the saved generation config, which always has
  ``bos_token_id`` and ``eos_token_id`` (e.g. ``{"eos_token_id": [1, 42]}``).

Token ids: 0 ``<|endoftext|>`` (pad), 1 ``<s>`` (bos), 2 ``</s>`` (eos), then the 256 byte tokens, then merges
(and filler tokens ``<|extra_i|>`` if the merges run out) up to ``vocab_size``. The tokenizer adds
no bos automatically.
"""
from __future__ import annotations

import copy
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

ARCHS = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM"),
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM"),
}
# Mixtures of experts: 8 small experts, top-2 (any of these can be overridden).
MOE_DEFAULTS = {
    "qwen3_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True),
    "qwen2_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=48),
    "mixtral": dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=32),
    "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32),
}
DEFAULTS = dict(
    hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    intermediate_size=128, vocab_size=384, max_position_embeddings=512, rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)
LLAMA3_ROPE_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                       "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
# The pad token doubles as unk under the name Qwen2Tokenizer expects, which transformers forces
# for qwen2 checkpoints: with it already in the vocabulary, no token is added on load.
PAD, BOS, EOS = "<|endoftext|>", "<s>", "</s>"
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
# Bumped whenever the construction below changes, so cached models are rebuilt.
_FACTORY_VERSION = 2
_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! Tensor parallel serving splits every layer across ranks.",
    "A paged KV cache stores keys and values in fixed-size blocks.",
    "Prefix caching lets requests that share a prompt share its blocks.",
    "When memory runs out the scheduler preempts the latest request and recomputes it later.",
    "Once upon a time there was a small model that said many different words.",
    "0123456789 + - * / = ( ) [ ] { } < > , ; : ' \" ? !",
] * 4


def make_tiny_model(tmp_path, arch: str = "qwen3", **overrides) -> Path:
    """Build (or reuse) a tiny random checkpoint of ``arch`` under ``tmp_path``; return its directory."""
    if arch not in ARCHS:
        raise ValueError(f"arch: {arch!r} is not one of {sorted(ARCHS)}")
    root = Path(tmp_path)
    key = json.dumps({"arch": arch, "v": _FACTORY_VERSION, **overrides}, sort_keys=True, default=str)
    out = root / f"tiny-{arch}-{hashlib.sha1(key.encode()).hexdigest()[:12]}"
    if (out / "config.json").is_file():
        return out
    root.mkdir(parents=True, exist_ok=True)
    # Build in a scratch directory and rename: a concurrent builder never sees a half-written model.
    scratch = Path(tempfile.mkdtemp(prefix=".build-", dir=root))
    try:
        # Deep copy: transformers config classes edit dicts such as rope_scaling in place.
        _build(scratch, arch, copy.deepcopy(overrides))
        try:
            os.rename(scratch, out)
        except OSError:  # another process won the race; its model is identical
            shutil.rmtree(scratch, ignore_errors=True)
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    return out


def _build(out: Path, arch: str, overrides: dict) -> None:
    import torch
    import transformers

    seed = overrides.pop("seed", 0)
    init_std = overrides.pop("init_std", 0.25)
    gen_overrides = overrides.pop("generation_config", None) or {}
    fields = {**DEFAULTS, **MOE_DEFAULTS.get(arch, {}), **overrides}
    config_cls, model_cls = ARCHS[arch]
    config = getattr(transformers, config_cls)(
        **fields, bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID, architectures=[model_cls])
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).to(torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                # Around 1 like a trained norm, but not exactly, so a misplaced norm shows.
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, init_std)
    model.save_pretrained(out, safe_serialization=True)
    gen = transformers.GenerationConfig(bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID)
    for k, v in gen_overrides.items():
        setattr(gen, k, v)
    gen.save_pretrained(out)
    make_tokenizer(fields["vocab_size"]).save_pretrained(out)


def make_tokenizer(vocab_size: int):
    """A byte-level BPE ``PreTrainedTokenizerFast`` with exactly ``vocab_size`` tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    base = 3 + len(alphabet)
    if vocab_size < base:
        raise ValueError(f"vocab_size: {vocab_size} is too small for a byte-level tokenizer; need >= {base}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[PAD, BOS, EOS],
                                  initial_alphabet=alphabet, show_progress=False)
    tok.train_from_iterator(_CORPUS, trainer=trainer)
    missing = vocab_size - tok.get_vocab_size()
    if missing > 0:  # the corpus ran out of merges: fill with plain added tokens
        tok.add_tokens([f"<|extra_{i}|>" for i in range(missing)])
    assert tok.get_vocab_size() == vocab_size, (tok.get_vocab_size(), vocab_size)
    assert [tok.token_to_id(t) for t in (PAD, BOS, EOS)] == [PAD_ID, BOS_ID, EOS_ID]
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD, unk_token=PAD)


def _session_root(tmp_path_factory) -> Path:
    return tmp_path_factory.getbasetemp() / "tiny_models"


try:
    import pytest

    @pytest.fixture(scope="session")
    def tiny_models_root(tmp_path_factory) -> Path:
        """One directory per test session where every test file's tiny models are cached.

        Use ``from model_factory import tiny_models_root`` in a test module, then
        ``make_tiny_model(tiny_models_root, ...)``.
        """
        return _session_root(tmp_path_factory)
except ImportError:  # the factory also works outside pytest (scripts)
    pass
