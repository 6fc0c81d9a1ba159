"""Prepacked oneDNN weights (fp32, and bf16 with native support, on CPU): what gets packed, and
that results do not change (bf16: bit for bit; fp32: within fp32 rounding of MKL's sums)."""
from __future__ import annotations

import pytest
import torch

from model_factory import make_tiny_model
from tpserve.models import packed_gemm
from tpserve.models.linear import ColumnParallelLinear, RowParallelLinear
from tpserve.models.parallel import TPContext

NATIVE_BF16 = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def _layers(dtype):
    torch.manual_seed(0)
    tp = TPContext()
    col = ColumnParallelLinear(48, 80, tp, bias=True).to(dtype)
    row = RowParallelLinear(80, 48, tp).to(dtype)
    with torch.no_grad():
        for p in (*col.parameters(), *row.parameters()):
            p.normal_(0, 0.1)
    return torch.nn.Sequential(col, row)


def test_packed_layers_compute_bit_identical_results():
    model = _layers(torch.bfloat16)
    x = torch.randn(7, 48).bfloat16()
    want = model(x)
    packed = packed_gemm.prepack_model(model)
    # A CPU without native bf16 keeps F.linear: nothing is packed there, and nothing may be.
    assert packed == (2 if NATIVE_BF16 else 0)
    if NATIVE_BF16:
        assert model[0].weight.numel() == 0 and model[0].packed is not None  # dense copy freed
    for rows in (7, 1, 0):  # decode batches of any size, the empty batch included
        assert torch.equal(model(x[:rows]), want[:rows])


def test_fp32_layers_are_packed_and_agree_with_f_linear():
    model = _layers(torch.float32)
    x = torch.randn(7, 48)
    want = model(x)
    assert packed_gemm.prepack_model(model) == 2
    assert model[0].weight.numel() == 0 and model[0].packed is not None
    for rows in (7, 1, 0):
        torch.testing.assert_close(model(x[:rows]), want[:rows], rtol=1e-5, atol=1e-6)


def test_what_is_packed(monkeypatch):
    assert packed_gemm.can_prepack(torch.zeros(4, 4))  # fp32
    assert packed_gemm.can_prepack(torch.zeros(4, 4, dtype=torch.bfloat16)) == NATIVE_BF16
    assert not packed_gemm.can_prepack(torch.zeros(4, 4, dtype=torch.float16))
    assert not packed_gemm.can_prepack(torch.zeros(4, dtype=torch.bfloat16))  # not a matrix
    monkeypatch.setenv("TPSERVE_PREPACK", "0")
    assert not packed_gemm.can_prepack(torch.zeros(4, 4))
    assert not packed_gemm.can_prepack(torch.zeros(4, 4, dtype=torch.bfloat16))
    model = _layers(torch.bfloat16)
    assert packed_gemm.prepack_model(model) == 0 and model[0].packed is None
    assert model[0].weight.shape == (80, 48)


def test_a_shared_weight_stays_dense(monkeypatch):
    monkeypatch.setattr(packed_gemm, "can_prepack", lambda w: True)
    monkeypatch.setattr(packed_gemm, "pack", lambda w: w.detach().clone())  # any opaque copy
    model = _layers(torch.float32)
    model[1].weight = model[0].weight  # the two layers share one parameter (a tied LM head)
    assert packed_gemm.prepack_model(model) == 2
    assert model[0].weight.shape == (80, 48)  # still dense: the other user reads it


@pytest.mark.parametrize("tie", [False, True])
def test_bf16_model_generates_the_same_with_and_without_packing(tmp_path, monkeypatch, tie):
    from tpserve import LLM, SamplingParams
    path = make_tiny_model(tmp_path, tie_word_embeddings=tie)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    prompts = [[5, 9, 11, 3, 8], [7, 2]]
    outs = {}
    for flag in ("0", "1"):
        monkeypatch.setenv("TPSERVE_PREPACK", flag)
        llm = LLM(str(path), dtype="bfloat16", kv_cache_memory_gb=0.05)
        res = llm.generate(prompts, params)
        outs[flag] = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in res]
        llm.shutdown()
    assert outs["0"] == outs["1"]
