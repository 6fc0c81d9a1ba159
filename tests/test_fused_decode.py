"""The fused decode path (two C++ calls per layer): bit-identical to the module path for every
weight kind, used exactly for pure decode steps, refused for models it cannot run."""
from __future__ import annotations

import pytest
import torch

from model_factory import make_tiny_model
from test_models import PagedKV, random_prompts, tpserve_model
from tpserve.kernels import cpu_extension
from tpserve.models.fused_decode import why_not_fused
from tpserve.models.packed_gemm import prepack_model

# The C++ operators are under test: `make test` builds them, so their absence is a failure.
assert cpu_extension.available(), cpu_extension._state.get("error")

CASES = {  # name: (make_tiny_model overrides, dtype, --quantization)
    "qwen3-fp32": (dict(), "float32", None),
    "qwen3-bf16": (dict(), "bfloat16", None),
    "qwen3-int8": (dict(), "float32", "int8"),
    "llama-bias-bf16": (dict(arch="llama", attention_bias=True, mlp_bias=True), "bfloat16", None),
    # SmolLM3: layers 1 and 3 without rotary
    "smollm3-bf16": (dict(arch="smollm3", num_hidden_layers=4, no_rope_layers=[1, 0, 1, 0]), "bfloat16", None),
}


def _decode_logits(path, dtype, quant, fused: bool, stack: bool = True):
    model = tpserve_model(path, backend="cpu", dtype=dtype, quantization=quant)
    prepack_model(model)
    prompts = random_prompts([9, 4, 17], 384, seed=3)
    kv = PagedKV(model, len(prompts), 40)
    if fused:
        assert model.enable_fused_decode() is None
        assert model.fused_decode.stack is not None  # one process: the whole stack in one call
        if not stack:
            model.fused_decode.stack = None  # the layer-by-layer calls tensor parallelism takes
    return run_steps(model, kv, prompts, fused)


def run_steps(model, kv, prompts, fused: bool) -> list:
    """The logits of a prefill of ``prompts`` and three decode steps; asserts that exactly the
    decode steps went through the fused decode when ``fused``."""
    out = []
    for new in [prompts] + [[[t] for t in row] for row in ([5, 7, 9], [11, 13, 15], [2, 3, 4])]:
        ids, pos, meta = kv.step(new)
        calls = []
        if model.fused_decode is not None:
            real = model.fused_decode
            model.fused_decode = lambda *a, _r=real: calls.append(1) or _r(*a)
        out.append(model.compute_logits(model.forward(ids, pos, meta)))
        if model.fused_decode is not None:
            model.fused_decode = real
        assert len(calls) == (1 if fused and not meta.is_prefill else 0)  # decode steps only
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_fused_decode_equals_the_module_path_bit_for_bit(tmp_path, name):
    overrides, dtype, quant = CASES[name]
    path = make_tiny_model(tmp_path, **overrides)
    plain = _decode_logits(path, dtype, quant, fused=False)
    for stack in (True, False):
        fused = _decode_logits(path, dtype, quant, fused=True, stack=stack)
        for a, b in zip(plain, fused):
            assert torch.equal(a, b)


def _fused_model_at_a_decode_step(tmp_path):
    """A packed tiny model with the fused path on, a 3-token prompt run, and the inputs of the
    decode step after it."""
    path = make_tiny_model(tmp_path)
    model = tpserve_model(path, backend="cpu")
    prepack_model(model)
    kv = PagedKV(model, 1, 32)
    assert model.enable_fused_decode() is None
    ids, pos, meta = kv.step([[5, 6, 7]])
    model.forward(ids, pos, meta)
    return (model, *kv.step([[8]]))


def test_the_stack_follows_a_reallocated_kv_cache(tmp_path):
    model, ids, pos, meta = _fused_model_at_a_decode_step(tmp_path)
    want = model.compute_logits(model.forward(ids, pos, meta))
    old = model.fused_decode.stack
    caches = []
    for layer in model.model.layers:  # the same contents in new tensors; the old ones zeroed
        a = layer.self_attn
        caches.append((a.k_cache.clone(), a.v_cache.clone()))
        a.k_cache.zero_()
        a.v_cache.zero_()
    model.set_kv_caches(caches)
    got = model.compute_logits(model.forward(ids, pos, meta))
    assert model.fused_decode.stack is not old
    assert torch.equal(got, want)


def test_models_the_fused_path_cannot_run(tmp_path):
    path = make_tiny_model(tmp_path)
    model = tpserve_model(path, backend="cpu")
    assert "KV cache" in why_not_fused(model)
    PagedKV(model, 1, 16)
    assert "packed" in why_not_fused(model)
    torch_backend = tpserve_model(path, backend="torch")
    prepack_model(torch_backend)
    PagedKV(torch_backend, 1, 16)
    assert "cpu attention backend" in torch_backend.enable_fused_decode()
    assert torch_backend.fused_decode is None


@pytest.mark.parametrize("stack", [True, False])
def test_a_bad_block_id_is_refused_before_any_layer(tmp_path, stack):
    model, ids, pos, meta = _fused_model_at_a_decode_step(tmp_path)
    if not stack:
        model.fused_decode.stack = None
    meta.block_tables[0, 0] = 10_000
    with pytest.raises(ValueError, match="block_tables: a block"):
        model.forward(ids, pos, meta)


def test_a_decode_layer_with_no_rows_is_refused_not_divided_by(tmp_path):
    model, ids, pos, meta = _fused_model_at_a_decode_step(tmp_path)
    attn, attn_args, _ = model.fused_decode.layers[0]
    empty = torch.empty(0, model.model.embed_tokens.embedding_dim)
    none = torch.empty(0, dtype=torch.int32)
    with pytest.raises(ValueError, match="at least one row"):
        torch.ops.tpserve_cpu.decode_attention(
            torch.empty_like(empty), torch.empty_like(empty), empty, True, none.long(), attn.k_cache,
            attn.v_cache, none.long(), torch.empty(0, meta.block_tables.shape[1], dtype=torch.int32),
            none, *attn_args)


@pytest.mark.parametrize("stack", [True, False])
def test_a_token_id_outside_the_vocabulary_is_refused(tmp_path, stack):
    model, ids, pos, meta = _fused_model_at_a_decode_step(tmp_path)
    if not stack:
        model.fused_decode.stack = None
    ids = torch.full_like(ids, model.model.embed_tokens.num_embeddings)
    with pytest.raises(IndexError):
        model.forward(ids, pos, meta)


@pytest.mark.parametrize("stack", [True, False])
@pytest.mark.parametrize("bad", ["position", "slot"])
def test_a_bad_position_or_slot_is_refused_before_the_cache_is_written(tmp_path, stack, bad):
    model, ids, pos, meta = _fused_model_at_a_decode_step(tmp_path)
    if not stack:
        model.fused_decode.stack = None
    caches = [(layer.self_attn.k_cache.clone(), layer.self_attn.v_cache.clone()) for layer in model.model.layers]
    if bad == "position":
        pos = torch.full_like(pos, model.model.layers[0].self_attn.rotary.cos.shape[0])
        match = "positions: outside"
    else:
        meta.slot_mapping[0] = model.model.layers[0].self_attn.k_cache.shape[0] * \
            model.model.layers[0].self_attn.k_cache.shape[1]
        match = "slot_mapping: slot past the end"
    with pytest.raises(ValueError, match=match):
        model.forward(ids, pos, meta)
    for layer, (k, v) in zip(model.model.layers, caches):
        assert torch.equal(layer.self_attn.k_cache, k) and torch.equal(layer.self_attn.v_cache, v)
