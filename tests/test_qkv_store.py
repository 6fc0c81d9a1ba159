"""The fused step from the QKV projection to the KV cache on CPU (``qkv_to_cache``): the q/k norms,
the rotary embedding and the store of keys and values in one pass over prompt and decode rows.

It must give the separate operators' bits (rms_norm / gemma_rms_norm on the heads, then
rotary_embedding, then store_kvcache), for every cache dtype, and the engine must generate the
same tokens and logprobs with it as without it."""
from __future__ import annotations

import pytest
import torch

from model_factory import make_tiny_model, tiny_models_root  # noqa: F401
from test_arch_models import CASES, PROMPTS
from tpserve import LLM, SamplingParams
from tpserve.kernels import cpu_extension
from tpserve.kernels.cpu_attention import CpuAttention
from tpserve.models.attention import SelfAttention

assert cpu_extension.available(), cpu_extension._state.get("error")
ops = cpu_extension.ops()


def _inputs(dtype, T=37, Hq=4, Hkv=2, D=64, blocks=16, block=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(T, (Hq + 2 * Hkv) * D, generator=g).to(dtype)
    positions = torch.randint(0, 200, (T,), generator=g)
    slots = torch.randperm(blocks * block, generator=g)[:T]
    slots[3] = -1  # a padding row: computed, not stored
    freqs = torch.arange(256, dtype=torch.float32)[:, None] * (1e-2 * torch.rand(D // 2, generator=g))
    norms = (torch.randn(D, generator=g).to(dtype), torch.randn(D, generator=g).to(dtype))
    return qkv, positions, slots, freqs.cos(), freqs.sin(), norms, (blocks, block, Hkv, D)


def _separate(qkv, positions, slots, cos, sin, norms, cache_shape, Hq, gemma, int8):
    """The unfused path: norm each head, rotate, store (what SelfAttention runs otherwise)."""
    Hkv, D = cache_shape[2], cache_shape[3]
    T = qkv.shape[0]
    q = qkv[:, :Hq * D].view(T, Hq, D)
    k = qkv[:, Hq * D:(Hq + Hkv) * D].view(T, Hkv, D)
    v = qkv[:, (Hq + Hkv) * D:].view(T, Hkv, D).contiguous()
    if norms is not None:
        op = ops.gemma_rms_norm if gemma else ops.rms_norm
        qn, kn = torch.empty(q.shape, dtype=q.dtype), torch.empty(k.shape, dtype=k.dtype)
        op(qn, q, None, None, norms[0], 1e-6)
        op(kn, k, None, None, norms[1], 1e-6)
        q, k = qn, kn
    else:
        q, k = q.contiguous(), k.contiguous()
    ops.rotary_embedding(positions, q, k, cos, sin)
    kc = torch.zeros(cache_shape, dtype=torch.int8 if int8 else qkv.dtype)
    vc = torch.zeros_like(kc)
    scales = (torch.zeros(cache_shape[:3]), torch.zeros(cache_shape[:3])) if int8 else ()
    ops.store_kvcache(k, v, kc, vc, slots, *scales)
    return q, kc, vc, scales


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm", [None, "rms", "gemma"])
@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("D", [64, 256])
def test_qkv_to_cache_gives_the_separate_operators_bits(dtype, norm, int8, D):
    Hq = 4
    qkv, positions, slots, cos, sin, norms, shape = _inputs(dtype, D=D)
    norms = norms if norm else None
    want_q, want_k, want_v, want_s = _separate(qkv, positions, slots, cos, sin, norms, shape, Hq,
                                               norm == "gemma", int8)
    q = torch.empty(qkv.shape[0], Hq, D, dtype=dtype)
    kc = torch.zeros(shape, dtype=torch.int8 if int8 else dtype)
    vc = torch.zeros_like(kc)
    scales = (torch.zeros(shape[:3]), torch.zeros(shape[:3])) if int8 else (None, None)
    ops.qkv_to_cache(qkv, q, kc, vc, positions, slots, cos, sin, *(norms or (None, None)), 1e-6, Hq, shape[2],
                     norm == "gemma", *scales)
    assert torch.equal(q, want_q)
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)
    if int8:
        assert torch.equal(scales[0], want_s[0]) and torch.equal(scales[1], want_s[1])
    assert kc.flatten(0, 1)[slots[slots >= 0]].abs().sum() > 0  # the stored rows are written


@pytest.mark.parametrize("norm", [None, "rms"])
def test_cos_and_sin_without_rows_leave_q_and_k_unrotated(norm):
    """A layer without rotary (SmolLM3's no-rope layers) hands over tables with no rows: the heads
    are normed (or copied) and stored, not rotated, whatever their positions."""
    qkv, positions, slots, _, _, norms, shape = _inputs(torch.bfloat16)
    norms = norms if norm else None
    none = torch.empty(0, 32)
    identity = (torch.ones(256, 32), torch.zeros(256, 32))  # a rotation by 0: the same bits
    want = _separate(qkv, positions, slots, *identity, norms, shape, 4, False, False)
    q = torch.empty(qkv.shape[0], 4, 64, dtype=torch.bfloat16)
    kc, vc = torch.zeros(shape, dtype=torch.bfloat16), torch.zeros(shape, dtype=torch.bfloat16)
    ops.qkv_to_cache(qkv, q, kc, vc, positions + 10**6, slots, none, none, *(norms or (None, None)), 1e-6,
                     4, 2, False)
    assert torch.equal(q, want[0]) and torch.equal(kc, want[1]) and torch.equal(vc, want[2])
    if norm is None:
        assert torch.equal(q, qkv[:, :256].view(-1, 4, 64))


def test_qkv_to_cache_spreads_rows_over_threads_with_the_same_bits():
    """Thousands of rows run in parallel ranges; the bits are those of one row at a time."""
    qkv, positions, slots, cos, sin, norms, shape = _inputs(torch.bfloat16, T=1500, blocks=400, block=4)
    want = _separate(qkv, positions, slots, cos, sin, norms, shape, 4, True, False)
    q = torch.empty(1500, 4, 64, dtype=torch.bfloat16)
    kc, vc = torch.zeros(shape, dtype=torch.bfloat16), torch.zeros(shape, dtype=torch.bfloat16)
    ops.qkv_to_cache(qkv, q, kc, vc, positions, slots, cos, sin, *norms, 1e-6, 4, 2, True)
    assert torch.equal(q, want[0]) and torch.equal(kc, want[1]) and torch.equal(vc, want[2])


def test_qkv_to_cache_refuses_bad_arguments_by_name():
    qkv, positions, slots, cos, sin, norms, shape = _inputs(torch.float32)
    kc, vc = torch.zeros(shape), torch.zeros(shape)
    q = torch.empty(qkv.shape[0], 4, 64)
    with pytest.raises(ValueError, match="q_out"):
        ops.qkv_to_cache(qkv, q[:, :3], kc, vc, positions, slots, cos, sin, None, None, 1e-6, 4, 2)
    with pytest.raises(ValueError, match="qkv"):
        ops.qkv_to_cache(qkv[:, :-64], q, kc, vc, positions, slots, cos, sin, None, None, 1e-6, 4, 2)
    with pytest.raises(ValueError, match="k_scale"):
        ops.qkv_to_cache(qkv, q, kc.to(torch.int8), vc.to(torch.int8), positions, slots, cos, sin, None, None,
                         1e-6, 4, 2)
    with pytest.raises(ValueError, match="positions"):
        ops.qkv_to_cache(qkv, q, kc, vc, positions + 1000, slots, cos, sin, None, None, 1e-6, 4, 2)
    with pytest.raises(ValueError, match="slot_mapping"):
        ops.qkv_to_cache(qkv, q, kc, vc, positions, slots + 1000, cos, sin, None, None, 1e-6, 4, 2)
    assert not kc.any()  # nothing stored by a refused call


def _generate(path, dtype, fused: bool, monkeypatch, **options):
    """Greedy tokens and top-3 logprobs of PROMPTS, and the preemptions; asserts whether the
    fused store ran."""
    monkeypatch.setattr(SelfAttention, "fuse_qkv_store", fused)
    calls = []
    real = CpuAttention.store_qkv
    monkeypatch.setattr(CpuAttention, "store_qkv",
                        lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=3)
    with LLM(str(path), dtype=dtype, block_size=4, **options) as llm:
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        preemptions = llm.stats()["num_preemptions"]
    assert bool(calls) == fused
    return [(o.outputs[0].token_ids, [sorted((k, v.logprob) for k, v in d.items())
                                      for d in o.outputs[0].logprobs]) for o in outs], preemptions


@pytest.mark.parametrize("name,dtype,options", [
    ("qwen3", "bfloat16", {}),  # Qwen3's q/k norms
    ("qwen3", "float32", {"kv_cache_dtype": "int8"}),
    ("gemma3", "bfloat16", {}),  # Gemma's (1 + w) q/k norms; sliding and full groups
    ("gemma3", "float32", {"num_kv_blocks": 34}),  # 33 blocks admit the longest: preemptions
    ("smollm3", "bfloat16", {}),  # layers without rotary take the separate path
])
def test_engine_generates_the_same_with_the_fused_store(tiny_models_root, monkeypatch, name,  # noqa: F811
                                                        dtype, options):
    if name == "qwen3":
        path = make_tiny_model(tiny_models_root, "qwen3")
    else:
        arch, narrow, _ = CASES[name]
        path = make_tiny_model(tiny_models_root, arch, **narrow)
    plain, plain_preempted = _generate(path, dtype, False, monkeypatch, **options)
    fused, preempted = _generate(path, dtype, True, monkeypatch, **options)
    assert fused == plain and preempted == plain_preempted
    assert (preempted > 0) == ("num_kv_blocks" in options)
