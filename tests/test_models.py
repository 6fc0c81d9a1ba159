"""tpserve's decoder (TP=1, fp32, CPU, torch attention backend) against Hugging Face transformers.

Each model is fed several sequences of different lengths as one flat prefill batch, then a few
decode steps through a paged KV cache; every logit row must equal transformers' (with its own
KV cache for the decode steps). Also: chunked prefill over cached context, the cache-less
warm-up path, tied embeddings, sharded checkpoints, dtype selection and loader errors.
"""
from __future__ import annotations

import functools
import inspect
import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from model_factory import LLAMA3_ROPE_SCALING, make_tiny_model, tiny_models_root  # noqa: F401
from tpserve.kernels import AttentionMetadata, cpu_extension, get_backend
from tpserve.models import CausalLM, CheckpointError, TPContext, UnsupportedModelError, load_model
from tpserve.models.rotary import rope_inv_freq

ATOL = 1e-4
RTOL = 1e-4
BLOCK_SIZE = 4  # small, so sequences cross several block boundaries


class PagedKV:
    """A trivial paged KV cache: sequence i owns blocks ``[i * W, (i + 1) * W)`` in order.

    ``step(new_tokens)`` appends each sequence's new tokens and returns the model inputs
    ``(input_ids, positions, meta)`` for one forward pass over all of them (flat rows).
    """

    def __init__(self, model: CausalLM, num_seqs: int, max_len: int, block_size: int = BLOCK_SIZE):
        self.block_size = block_size
        width = math.ceil(max_len / block_size)
        shape = (num_seqs * width, block_size, model.num_kv_heads_per_rank, model.head_dim)
        self.caches = [(torch.zeros(shape, dtype=model.dtype), torch.zeros(shape, dtype=model.dtype))
                       for _ in range(model.num_layers)]
        model.set_kv_caches(self.caches)
        self.block_tables = torch.arange(num_seqs * width, dtype=torch.int32).view(num_seqs, width)
        self.lens = [0] * num_seqs

    def step(self, new_tokens: list[list[int]]):
        is_prefill = any(len(t) != 1 for t in new_tokens) or all(n == 0 for n in self.lens)
        ids, positions, slots, cu_q, cu_k, ctx = [], [], [], [0], [0], []
        for i, toks in enumerate(new_tokens):
            start = self.lens[i]
            for p in range(start, start + len(toks)):
                positions.append(p)
                slots.append(int(self.block_tables[i, p // self.block_size]) * self.block_size + p % self.block_size)
            ids += toks
            self.lens[i] += len(toks)
            ctx.append(self.lens[i])
            cu_q.append(cu_q[-1] + len(toks))
            cu_k.append(cu_k[-1] + self.lens[i])
        has_context = is_prefill and any(c > len(t) for c, t in zip(ctx, new_tokens))
        meta = AttentionMetadata.from_arrays(
            is_prefill=is_prefill, has_context=has_context, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
            context_lens=ctx, block_tables=self.block_tables, slot_mapping=slots)
        return torch.tensor(ids), torch.tensor(positions), meta


def random_prompts(lengths, vocab_size, seed=0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab_size, (n,), generator=g).tolist() for n in lengths]


@functools.lru_cache(maxsize=None)
def hf_model(path):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


def _cache_kwarg(hf) -> str:
    # transformers renamed past_key_values -> cache; support both spellings.
    return "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"


class HFSequence:
    """Runs one sequence through transformers with its own KV cache."""

    def __init__(self, hf):
        self.hf = hf
        self.cache = None

    @torch.no_grad()
    def feed(self, tokens: list[int]) -> torch.Tensor:
        kw = {_cache_kwarg(self.hf): self.cache} if self.cache is not None else {}
        out = self.hf(input_ids=torch.tensor([tokens]), use_cache=True, **kw)
        self.cache = getattr(out, "past_key_values", None) or getattr(out, "cache")
        return out.logits[0].float()


def tpserve_model(path, tp: TPContext | None = None, backend: str = "torch", **kw) -> CausalLM:
    return load_model(path, tp or TPContext(), backend=get_backend(backend, block_size=BLOCK_SIZE), **kw)


# The C++ CPU backend where it builds (the torch backend is the fallback and always tested).
BACKENDS = ["torch"] + (["cpu"] if cpu_extension.available() else [])


def run_prefill_then_decode(model: CausalLM, prompts, decode_tokens) -> list[torch.Tensor | None]:
    """Prefill all prompts in one batch, then one decode step per row of ``decode_tokens``.

    Returns the logits of each forward (all rows of the prefill; one row per sequence for a
    decode step); None entries on ranks other than 0.
    """
    kv = PagedKV(model, len(prompts), max(map(len, prompts)) + len(decode_tokens))
    results = []
    for new in [prompts] + [[[t] for t in row] for row in decode_tokens]:
        ids, pos, meta = kv.step(new)
        results.append(model.compute_logits(model.forward(ids, pos, meta)))
    return results


def reference_prefill_then_decode(path, prompts, num_steps):
    """transformers' logits for the same schedule, decoding its own greedy tokens.

    Returns ``(logits per forward, decode tokens [num_steps][num_seqs])``.
    """
    seqs = [HFSequence(hf_model(path)) for _ in prompts]
    prefill = [s.feed(p) for s, p in zip(seqs, prompts)]
    results = [torch.cat(prefill)]
    last = [lg[-1] for lg in prefill]
    decode_tokens = []
    for _ in range(num_steps):
        row = [int(lg.argmax()) for lg in last]
        decode_tokens.append(row)
        last = [s.feed([t])[-1] for s, t in zip(seqs, row)]
        results.append(torch.stack(last))
    return results, decode_tokens


CASES = {
    "qwen3": ("qwen3", {}),
    "llama": ("llama", {}),
    "llama3-rope": ("llama", {"rope_scaling": LLAMA3_ROPE_SCALING}),
    "qwen2": ("qwen2", {}),
    "llama-bias": ("llama", {"attention_bias": True, "mlp_bias": True}),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(CASES))
def test_prefill_and_decode_match_transformers(tiny_models_root, case, backend):
    arch, overrides = CASES[case]
    path = make_tiny_model(tiny_models_root, arch, **overrides)
    # Positions past original_max_position_embeddings (64) exercise every llama3 frequency band.
    lengths = [5, 11, 70] if case == "llama3-rope" else [5, 11, 17]
    prompts = random_prompts(lengths, 384)
    expected, decode_tokens = reference_prefill_then_decode(path, prompts, num_steps=3)
    got = run_prefill_then_decode(tpserve_model(path, backend=backend), prompts, decode_tokens)
    assert len(got) == len(expected) == 4
    assert got[0].shape == (sum(lengths), 384) and got[0].dtype == torch.float32
    for step, (g, e) in enumerate(zip(got, expected)):
        torch.testing.assert_close(g, e, atol=ATOL, rtol=RTOL, msg=lambda m: f"forward {step}: {m}")
    # The random weights must make outputs depend on the input, or this test proves little.
    assert len({int(t) for t in expected[0].argmax(-1)}) > 5


@pytest.mark.parametrize("backend", BACKENDS)
def test_chunked_prefill_over_cached_context(tiny_models_root, backend):
    """A prompt prefilled in two chunks (the second attending to cached keys) gives HF's logits."""
    path = make_tiny_model(tiny_models_root, "qwen3")
    model = tpserve_model(path, backend=backend)
    a, b = random_prompts([13, 6], 384, seed=1)
    kv = PagedKV(model, 2, 32)
    ids, pos, meta = kv.step([a[:7], b])
    first = model.compute_logits(model.forward(ids, pos, meta))
    ids, pos, meta = kv.step([a[7:], [5]])
    assert meta.is_prefill and meta.has_context
    second = model.compute_logits(model.forward(ids, pos, meta))
    ref_a = HFSequence(hf_model(path)).feed(a)
    ref_b = HFSequence(hf_model(path)).feed(b + [5])
    torch.testing.assert_close(torch.cat([first[:7], second[:6]]), ref_a, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(torch.cat([first[7:], second[6:]]), ref_b, atol=ATOL, rtol=RTOL)


def test_prefill_without_kv_cache(tiny_models_root):
    """The warm-up path (no caches set) attends over the batch's own keys only."""
    path = make_tiny_model(tiny_models_root, "qwen2")
    model = tpserve_model(path)
    prompts = random_prompts([4, 9], 384, seed=2)
    ids = torch.tensor(prompts[0] + prompts[1])
    pos = torch.tensor(list(range(4)) + list(range(9)))
    meta = AttentionMetadata.from_arrays(
        is_prefill=True, has_context=False, cu_seqlens_q=[0, 4, 13], cu_seqlens_k=[0, 4, 13],
        context_lens=[4, 9], block_tables=torch.zeros(2, 0, dtype=torch.int32), slot_mapping=[-1] * 13)
    got = model.compute_logits(model.forward(ids, pos, meta))
    expected = torch.cat([HFSequence(hf_model(path)).feed(p) for p in prompts])
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=RTOL)


def test_tied_embeddings(tiny_models_root):
    path = make_tiny_model(tiny_models_root, "qwen3", tie_word_embeddings=True)
    assert "lm_head.weight" not in load_file(path / "model.safetensors")
    model = tpserve_model(path)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    prompts = random_prompts([6, 3], 384, seed=3)
    expected, decode_tokens = reference_prefill_then_decode(path, prompts, num_steps=2)
    got = run_prefill_then_decode(model, prompts, decode_tokens)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, atol=ATOL, rtol=RTOL)


def test_model_attributes(tiny_models_root):
    path = make_tiny_model(tiny_models_root, "qwen3", num_key_value_heads=1, vocab_size=301)
    model = tpserve_model(path)
    assert (model.num_layers, model.num_kv_heads_per_rank, model.head_dim, model.vocab_size) == (2, 1, 16, 301)
    assert model.dtype == torch.float32
    with pytest.raises(ValueError, match="set_kv_caches: got 1"):
        model.set_kv_caches([(torch.zeros(1), torch.zeros(1))])


def test_llama3_rope_frequencies_match_transformers():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = LlamaConfig(hidden_size=64, num_attention_heads=1, head_dim=64, rope_theta=500000.0,
                         max_position_embeddings=131072,
                         rope_scaling=dict(LLAMA3_ROPE_SCALING, original_max_position_embeddings=8192))
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    got = rope_inv_freq(64, 500000.0, dict(LLAMA3_ROPE_SCALING, original_max_position_embeddings=8192))
    torch.testing.assert_close(got, expected, atol=0, rtol=1e-6)
    plain = rope_inv_freq(64, 500000.0)
    # High frequencies are kept, the lowest are divided by the factor, the middle band interpolates.
    assert got[0] == plain[0] and torch.isclose(got[-1], plain[-1] / 8)
    assert ((got < plain) & (got > plain / 8)).any()


def test_sharded_checkpoint_loads_like_single_file(tiny_models_root, tmp_path):
    src = make_tiny_model(tiny_models_root, "llama")
    tensors = load_file(src / "model.safetensors")
    names = sorted(tensors)
    half = len(names) // 2
    dst = tmp_path / "sharded"
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    weight_map = {}
    for i, part in enumerate([names[:half], names[half:]]):
        fname = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, dst / fname)
        weight_map.update({n: fname for n in part})
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    single, sharded = tpserve_model(src), tpserve_model(dst, progress=True)
    for (n1, p1), (n2, p2) in zip(single.named_parameters(), sharded.named_parameters()):
        assert n1 == n2
        torch.testing.assert_close(p1, p2, atol=0, rtol=0)


def test_dtype_selection(tiny_models_root):
    path = make_tiny_model(tiny_models_root, "qwen3")
    assert tpserve_model(path).dtype == torch.float32  # "auto": config.json says float32
    model = tpserve_model(path, dtype="bfloat16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    prompts = random_prompts([7], 384, seed=4)
    got = run_prefill_then_decode(model, prompts, [])[0]
    expected = HFSequence(hf_model(path)).feed(prompts[0])
    assert got.dtype == torch.bfloat16 and torch.isfinite(got).all()  # logits in the model dtype
    got = got.float()
    # bf16 keeps ~3 significant digits: the logits stay close, not equal.
    assert (got - expected).abs().max() < 0.1 * expected.abs().max()
    with pytest.raises(ValueError, match="dtype: 'int8' is not supported"):
        tpserve_model(path, dtype="int8")


def _copy_checkpoint(src, dst, edit_tensors=None, edit_config=None):
    dst.mkdir()
    config = json.loads((src / "config.json").read_text())
    if edit_config:
        edit_config(config)
    (dst / "config.json").write_text(json.dumps(config))
    tensors = load_file(src / "model.safetensors")
    if edit_tensors:
        edit_tensors(tensors)
    save_file(tensors, dst / "model.safetensors")
    return dst


def test_missing_weight_is_reported(tiny_models_root, tmp_path):
    src = make_tiny_model(tiny_models_root, "qwen3")
    dst = _copy_checkpoint(src, tmp_path / "m", edit_tensors=lambda t: (
        t.pop("model.layers.1.self_attn.k_proj.weight"), t.pop("model.norm.weight")))
    with pytest.raises(CheckpointError, match="missing weights") as err:
        tpserve_model(dst)
    assert "model.layers.1.self_attn.k_proj.weight" in str(err.value)
    assert "model.norm.weight" in str(err.value)


def test_untied_model_without_lm_head_is_reported(tiny_models_root, tmp_path):
    src = make_tiny_model(tiny_models_root, "qwen3")
    dst = _copy_checkpoint(src, tmp_path / "m", edit_tensors=lambda t: t.pop("lm_head.weight"))
    with pytest.raises(CheckpointError, match=r"missing weights: lm_head\.weight"):
        tpserve_model(dst)


def test_unexpected_weight_is_reported(tiny_models_root, tmp_path):
    src = make_tiny_model(tiny_models_root, "qwen3")
    dst = _copy_checkpoint(src, tmp_path / "m", edit_tensors=lambda t: t.update(
        {"model.layers.0.mlp.extra_proj.weight": torch.zeros(2, 2)}))
    with pytest.raises(CheckpointError, match=r"unexpected weights .*model\.layers\.0\.mlp\.extra_proj\.weight"):
        tpserve_model(dst)


def test_misshaped_weight_is_reported(tiny_models_root, tmp_path):
    src = make_tiny_model(tiny_models_root, "qwen3")
    dst = _copy_checkpoint(src, tmp_path / "m", edit_tensors=lambda t: t.update(
        {"model.layers.0.mlp.up_proj.weight": torch.zeros(100, 64)}))
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.mlp\.up_proj\.weight: .*shape \(100, 64\).*\(128, 64\)"):
        tpserve_model(dst)


def test_unknown_architecture_is_rejected(tiny_models_root, tmp_path):
    src = make_tiny_model(tiny_models_root, "llama")
    dst = _copy_checkpoint(src, tmp_path / "m",
                           edit_config=lambda c: c.update(architectures=["FalconForCausalLM"]))
    with pytest.raises(UnsupportedModelError, match="architectures") as err:
        tpserve_model(dst)
    for name in ("Qwen3ForCausalLM", "LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM"):
        assert name in str(err.value)


def test_unsupported_config_values_are_rejected(tiny_models_root, tmp_path):
    src = make_tiny_model(tiny_models_root, "llama")
    gelu = _copy_checkpoint(src, tmp_path / "gelu", edit_config=lambda c: c.update(hidden_act="gelu"))
    with pytest.raises(UnsupportedModelError, match="hidden_act: 'gelu' is not supported"):
        tpserve_model(gelu)
    dynamic = _copy_checkpoint(src, tmp_path / "dynamic", edit_config=lambda c: c.update(
        rope_parameters={"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0}))
    with pytest.raises(UnsupportedModelError, match="'dynamic' is not supported"):
        tpserve_model(dynamic)
    with pytest.raises(CheckpointError, match="no config.json"):
        tpserve_model(tmp_path)


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_tiny_model_factory(tiny_models_root, arch):
    from transformers import AutoTokenizer, GenerationConfig

    path = make_tiny_model(tiny_models_root, arch, vocab_size=301, generation_config={"eos_token_id": [2, 7]})
    assert make_tiny_model(tiny_models_root, arch, vocab_size=301, generation_config={"eos_token_id": [2, 7]}) == path
    tok = AutoTokenizer.from_pretrained(path)
    assert len(tok) == 301 and (tok.bos_token_id, tok.eos_token_id) == (1, 2)
    text = "Hello world, the quick fox!"
    assert tok.decode(tok(text).input_ids) == text
    assert GenerationConfig.from_pretrained(path).eos_token_id == [2, 7]
    # Greedy continuations of the random model vary rather than repeating one token.
    out = hf_model(path).generate(torch.tensor([tok(text).input_ids]), max_new_tokens=12, do_sample=False,
                                  eos_token_id=None, pad_token_id=0)
    assert len(set(out[0, -12:].tolist())) > 4


def test_loading_without_progress_creates_no_semaphore(tiny_models_root, monkeypatch):
    """Worker ranks load without a progress bar and leave with os._exit: tqdm's multiprocessing
    lock (a named semaphore) made while loading would be reported leaked at every
    tensor-parallel shutdown."""
    from tqdm import tqdm as std_tqdm
    from tqdm.auto import tqdm
    from tqdm.std import TqdmDefaultWriteLock

    from tpserve.models.loader import iter_safetensors
    path = make_tiny_model(tiny_models_root, "qwen3")
    for cls in (tqdm, std_tqdm):  # as in a fresh worker process
        monkeypatch.delattr(cls, "_lock", raising=False)
    monkeypatch.delattr(TqdmDefaultWriteLock, "mp_lock", raising=False)
    names = [name for name, _ in iter_safetensors(sorted(path.glob("*.safetensors")))]
    assert names and not hasattr(TqdmDefaultWriteLock, "mp_lock")
