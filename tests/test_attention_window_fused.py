"""The fused decode (whole layer stack in one C++ call, or two calls per layer) with per-layer
sliding windows, sinks and soft-caps: bit-identical to the module path."""
from __future__ import annotations

import pytest
import torch

from model_factory import make_tiny_model
from test_fused_decode import run_steps
from test_models import PagedKV, random_prompts, tpserve_model
from tpserve.kernels import cpu_extension
from tpserve.models.fused_decode import why_not_fused
from tpserve.models.packed_gemm import prepack_model

assert cpu_extension.available(), cpu_extension._state.get("error")


def _logits(path, dtype, fused: bool, stack: bool = True, edit=None):
    model = tpserve_model(path, backend="cpu", dtype=dtype)
    if edit is not None:
        edit(model)
    prepack_model(model)
    prompts = random_prompts([9, 4, 17], 384, seed=3)
    kv = PagedKV(model, len(prompts), 40, block_size=4)
    if fused:
        assert why_not_fused(model) is None
        assert model.enable_fused_decode() is None
        if not stack:
            model.fused_decode.stack = None  # the layer-by-layer calls tensor parallelism takes
    return run_steps(model, kv, prompts, fused)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_windowed_model_fused_equals_module_path(tmp_path, dtype):
    path = make_tiny_model(tmp_path, arch="mistral", sliding_window=4)
    plain = _logits(path, dtype, fused=False)
    for stack in (True, False):
        for a, b in zip(plain, _logits(path, dtype, fused=True, stack=stack)):
            assert torch.equal(a, b)
    # The window matters in these steps: without it the decode logits differ.
    wide = _logits(make_tiny_model(tmp_path, arch="mistral", sliding_window=None), dtype, fused=True)
    assert not torch.allclose(plain[-1], wide[-1])


def _mixed_options(model):
    """Layer 0: window 3 with sinks; layer 1: soft-capped, full (a gpt-oss / Gemma 2 mix)."""
    g = torch.Generator().manual_seed(7)
    first, second = (layer.self_attn for layer in model.model.layers[:2])
    first.sliding_window = 3
    first.sinks = torch.nn.Parameter(torch.randn(first.num_heads, generator=g).to(model.dtype),
                                     requires_grad=False)
    second.logit_softcap = 0.7


def test_sinks_and_softcap_fused_equal_module_path(tmp_path):
    path = make_tiny_model(tmp_path)
    assert len(tpserve_model(path, backend="cpu").model.layers) >= 2
    plain = _logits(path, "float32", fused=False, edit=_mixed_options)
    untouched = _logits(path, "float32", fused=False)
    assert not torch.allclose(plain[-1], untouched[-1])
    for stack in (True, False):
        for a, b in zip(plain, _logits(path, "float32", fused=True, stack=stack, edit=_mixed_options)):
            assert torch.equal(a, b)


def test_stack_rejects_bad_attention_options(tmp_path):
    path = make_tiny_model(tmp_path)
    model = tpserve_model(path, backend="cpu")
    prepack_model(model)
    PagedKV(model, 1, 16)
    assert model.enable_fused_decode() is None
    stack = model.fused_decode.stack
    with pytest.raises(ValueError, match="sinks"):
        stack.set_attention_options(0, 0, torch.zeros(1), 0.0)
    with pytest.raises(ValueError, match="layer"):
        stack.set_attention_options(99, 4, None, 0.0)
    with pytest.raises(ValueError, match="window"):
        stack.set_attention_options(0, -2, None, 0.0)
