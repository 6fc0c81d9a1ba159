"""The torch attention backend against a dense per-sequence reference; metadata and selection."""
from __future__ import annotations

import pytest
import torch

from tpserve.kernels import backend_factory as backend_mod
from tpserve.kernels.backend_factory import get_backend
from tpserve.kernels.metadata import AttentionMetadata
from tpserve.kernels.reference import backend_vs_reference, random_paged_batch, reference_attention
from tpserve.kernels.torch_attention import TorchAttention

TOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2}

CASES = {
    # name: (context_lens, new_lens, is_prefill)
    "prefill": ([0, 0, 0, 0], [5, 17, 1, 33], True),  # three length groups
    "prefill_one_group": ([0, 0], [8, 7], True),
    "prefill_uniform": ([0, 0, 0], [8, 8, 8], True),
    "prefill_context": ([3, 0, 20, 16, 31], [4, 6, 1, 9, 40], True),
    "decode": ([0, 5, 31, 16, 300], [1, 1, 1, 1, 1], False),
    # A mixed step: decode rows (one query over their whole context) first, then prefill
    # chunks with and without cached context, in one prefill plan with context.
    "mixed": ([5, 31, 16, 300, 0, 20, 17], [1, 1, 1, 1, 9, 40, 1], True),
}


def run_case(case, *, block_size, heads=(4, 2), head_dim=16, dtype=torch.float32, seed=0):
    ctx, new, is_prefill = CASES[case]
    return backend_vs_reference(TorchAttention(block_size), ctx, new, is_prefill=is_prefill,
                                num_heads=heads[0], num_kv_heads=heads[1], head_dim=head_dim,
                                dtype=dtype, seed=seed)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("block_size", [1, 16, 256])
@pytest.mark.parametrize("heads", [(4, 2), (2, 2), (4, 1)], ids=["gqa", "mha", "mqa"])
def test_torch_backend_matches_reference_fp32(case, block_size, heads):
    batch, out, ref = run_case(case, block_size=block_size, heads=heads)
    assert out.shape == batch.q.shape and out.dtype == torch.float32
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref, atol=TOL[torch.float32], rtol=0)


@pytest.mark.parametrize("case", list(CASES))
def test_torch_backend_matches_reference_bf16(case):
    batch, out, ref = run_case(case, block_size=16, dtype=torch.bfloat16, head_dim=32)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), ref, atol=TOL[torch.bfloat16], rtol=0)


@pytest.mark.parametrize("case", ["prefill", "prefill_context", "decode", "mixed"])
def test_forward_stores_new_tokens_into_their_slots(case):
    batch, _, _ = run_case(case, block_size=16)
    slots = batch.meta.slot_mapping.long()
    assert torch.equal(batch.k_cache.view(-1, 2, 16)[slots], batch.k)
    assert torch.equal(batch.v_cache.view(-1, 2, 16)[slots], batch.v)
    # Every slot a sequence owns now holds its key; nothing else was written.
    written = torch.zeros(batch.k_cache.shape[0] * 16, dtype=torch.bool)
    for i, kk in enumerate(batch.keys):
        pos = torch.arange(kk.shape[0])
        slot = batch.meta.block_tables[i, pos // 16].long() * 16 + pos % 16
        assert torch.equal(batch.k_cache.view(-1, 2, 16)[slot], kk)
        written[slot] = True
    assert torch.isnan(batch.k_cache.view(-1, 2, 16)[~written]).all()


def test_without_cache_attends_over_new_tokens_only():
    """A warm-up/profiling run passes no cache: plain causal varlen attention."""
    new = [7, 1, 12]
    batch = random_paged_batch([0, 0, 0], new, num_heads=4, num_kv_heads=2, head_dim=16,
                               block_size=16)
    ref = reference_attention(batch.q, batch.keys, batch.values, new, 0.25)
    for empty in (None, torch.empty(0)):
        out = TorchAttention(16).forward(batch.q, batch.k, batch.v, empty, empty, batch.meta, 0.25)
        torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=0)
    assert torch.isnan(batch.k_cache).all()  # nothing stored anywhere


def test_decode_after_prefill_equals_one_long_prefill():
    """Prefill 10 tokens, then decode token 11: the same as prefilling 11 tokens at once."""
    hq, hkv, d, bs = 4, 2, 16, 4
    full = random_paged_batch([0], [11], num_heads=hq, num_kv_heads=hkv, head_dim=d,
                              block_size=bs, seed=3)
    be = TorchAttention(bs)
    want = be.forward(full.q, full.k, full.v, full.k_cache.clone(), full.v_cache.clone(),
                      full.meta, 0.3)
    tables = full.meta.block_tables
    slots = full.meta.slot_mapping
    kc, vc = torch.zeros_like(full.k_cache), torch.zeros_like(full.v_cache)
    pre = AttentionMetadata.from_arrays(
        is_prefill=True, has_context=False, cu_seqlens_q=[0, 10], cu_seqlens_k=[0, 10],
        context_lens=[10], block_tables=tables, slot_mapping=slots[:10])
    be.forward(full.q[:10], full.k[:10], full.v[:10], kc, vc, pre, 0.3)
    dec = AttentionMetadata.from_arrays(
        is_prefill=False, has_context=False, cu_seqlens_q=[0, 1], cu_seqlens_k=[0, 11],
        context_lens=[11], block_tables=tables, slot_mapping=slots[10:])
    got = be.forward(full.q[10:], full.k[10:], full.v[10:], kc, vc, dec, 0.3)
    torch.testing.assert_close(got, want[10:], atol=1e-5, rtol=0)


# ---- argument checks --------------------------------------------------------------------

def _args():
    batch = random_paged_batch([2, 0], [3, 4], num_heads=4, num_kv_heads=2, head_dim=16,
                               block_size=16)
    return dict(q=batch.q, k=batch.k, v=batch.v, k_cache=batch.k_cache, v_cache=batch.v_cache,
                meta=batch.meta, scale=0.25)


@pytest.mark.parametrize("field,bad,msg", [
    ("q", lambda a: a["q"][:, :3], "num_kv_heads=2 must divide"),
    ("q", lambda a: a["q"][0], "q: expected 3 dimensions"),
    ("k", lambda a: a["k"].double(), "k: expected dtype torch.float32"),
    ("v", lambda a: a["v"][:, :1], "v: shape"),
    ("k", lambda a: a["k"][:5], "k: expected shape [7"),
    ("k_cache", lambda a: a["k_cache"][:, :, :, :8], "k_cache: expected shape"),
    ("v_cache", lambda a: a["v_cache"].transpose(0, 1), "v_cache"),
    ("k_cache", lambda a: a["k_cache"][:, :8], "k_cache: must be contiguous"),
    ("scale", lambda a: -1.0, "scale: expected a positive float"),
    ("meta", lambda a: "meta", "meta: expected AttentionMetadata"),
])
def test_forward_rejects_bad_arguments(field, bad, msg):
    args = _args()
    args[field] = bad(args)
    with pytest.raises(ValueError, match=msg.replace("[", r"\[")):
        TorchAttention(16).forward(**args)


def test_forward_rejects_cache_of_another_block_size():
    with pytest.raises(ValueError, match="k_cache: block_size 16 differs from the torch "
                                         "backend's block_size 32"):
        TorchAttention(32).forward(**_args())


def test_forward_rejects_token_count_mismatch():
    args = _args()
    for name in ("q", "k", "v"):
        args[name] = args[name][:6]
    with pytest.raises(ValueError, match="meta: slot_mapping has 7 tokens but q has 6"):
        TorchAttention(16).forward(**args)


# ---- metadata ---------------------------------------------------------------------------

def test_metadata_from_arrays_converts_and_derives_max_lengths():
    import numpy as np
    meta = AttentionMetadata.from_arrays(
        is_prefill=True, has_context=True, cu_seqlens_q=np.array([0, 3, 4], dtype=np.int64),
        cu_seqlens_k=np.array([0, 5, 12]), context_lens=np.array([5, 7]),
        block_tables=np.array([[0, -1], [1, 2]]), slot_mapping=np.array([2, 3, 4, 22]))
    assert meta.max_seqlen_q == 3 and meta.max_seqlen_k == 7
    assert meta.num_seqs == 2 and meta.num_tokens == 4
    assert all(t.dtype == torch.int32 for t in (meta.cu_seqlens_q, meta.block_tables))
    assert "block_tables=(2, 2)" in repr(meta)


@pytest.mark.parametrize("change,msg", [
    (dict(cu_seqlens_q=[0, 3]), r"cu_seqlens_q: expected shape \[3\]"),
    (dict(block_tables=[[0, 1]]), r"block_tables: expected shape \[2, W\]"),
    (dict(slot_mapping=[[1, 2]]), r"slot_mapping: expected shape \[T\]"),
    (dict(context_lens=[1.5, 2.0]), "context_lens: expected integers"),
    (dict(is_prefill=False), "decode has one token per sequence"),
])
def test_metadata_rejects_inconsistent_arrays(change, msg):
    args = dict(is_prefill=True, has_context=False, cu_seqlens_q=[0, 3, 4],
                cu_seqlens_k=[0, 3, 4], context_lens=[3, 1], block_tables=[[0], [1]],
                slot_mapping=[0, 1, 2, 16])
    args.update(change)
    with pytest.raises(ValueError, match=msg):
        AttentionMetadata.from_arrays(**args)


def test_forward_validates_hand_built_metadata():
    args = _args()
    m = args["meta"]
    args["meta"] = AttentionMetadata(
        is_prefill=True, has_context=True, cu_seqlens_q=m.cu_seqlens_q.long(),
        cu_seqlens_k=m.cu_seqlens_k, max_seqlen_q=m.max_seqlen_q, max_seqlen_k=m.max_seqlen_k,
        context_lens=m.context_lens, block_tables=m.block_tables, slot_mapping=m.slot_mapping)
    with pytest.raises(ValueError, match="cu_seqlens_q: expected dtype torch.int32"):
        TorchAttention(16).forward(**args)


# ---- backend selection ------------------------------------------------------------------

def test_auto_on_cpu_is_torch_without_the_cpu_operators(monkeypatch):
    from tpserve.kernels import cpu_extension
    monkeypatch.setattr(cpu_extension, "available", lambda: False)
    for bs in (1, 16, 256):
        be = get_backend("auto", "cpu", bs)
        assert isinstance(be, TorchAttention) and be.name == "torch" and be.block_size == bs
    assert get_backend("torch", "cpu", 3).name == "torch"
    assert not get_backend("torch").supports_cuda_graphs


@pytest.mark.parametrize("kwargs,msg", [
    (dict(name="cuda-fast"), "name: unknown attention backend 'cuda-fast'"),
    (dict(name="flash"), "flash backend needs a CUDA device, got cpu"),
    (dict(name="triton", block_size=8), "multiple of 16, got 8"),
    (dict(name="torch", block_size=0), "block_size: expected an int >= 1"),
    (dict(name="torch", device="warp-drive"), "device: not a torch device"),
])
def test_get_backend_errors_say_why(kwargs, msg):
    with pytest.raises(ValueError, match=msg):
        get_backend(**kwargs)


def test_flash_backend_refuses_fp32_before_importing_flash_attn():
    from tpserve.kernels.flash_attention import FlashAttention
    args = _args()
    with pytest.raises(ValueError, match="q: the flash backend computes in float16/bfloat16"):
        FlashAttention(16).forward(**args)


def test_triton_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        get_backend("triton", "cpu", 16)


def test_auto_on_cuda_prefers_flash_then_triton(monkeypatch):
    """Selection only (nothing runs): flash needs flash_attn and pages of 256 tokens."""
    monkeypatch.setattr(backend_mod, "flash_attn_available", lambda: True)
    assert get_backend("auto", "cuda", 256).name == "flash"
    assert get_backend("auto", "cuda", 256).supports_cuda_graphs
    assert get_backend("auto", "cuda", 16).name == "triton"
    assert get_backend("auto", "cuda", 8).name == "torch"
    with pytest.raises(ValueError, match="multiple of 256"):
        get_backend("flash", "cuda", 16)
    assert get_backend("auto", "cuda", 256, dtype=torch.bfloat16).name == "flash"
    assert get_backend("auto", "cuda", 256, dtype=torch.float32).name == "triton"
    with pytest.raises(ValueError, match="float16/bfloat16 only, got torch.float32"):
        get_backend("flash", "cuda", 256, dtype=torch.float32)
    with pytest.raises(ValueError, match="dtype: expected a floating torch.dtype"):
        get_backend("auto", "cuda", 256, dtype=torch.int32)
    monkeypatch.setattr(backend_mod, "flash_attn_available", lambda: False)
    assert get_backend("auto", "cuda", 256).name == "triton"
    with pytest.raises(ValueError, match="flash_attn package, which is not installed"):
        get_backend("flash", "cuda", 256)


class FakeFlashAttn:
    """flash-attn 2's two entry points as documented (paged K/V through ``block_table``, causal
    mask aligned to the bottom-right corner), in plain torch, checking the documented argument
    shapes. It lets a CPU test check how the flash backend maps plans onto those calls."""

    def __init__(self):
        self.calls = []

    @staticmethod
    def _gather(cache, table, n):
        bs = cache.shape[1]
        pos = torch.arange(n)
        return cache[table[pos // bs].long(), pos % bs]

    def flash_attn_varlen_func(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                               max_seqlen_k, dropout_p=0.0, softmax_scale=None, causal=False,
                               block_table=None):
        self.calls.append(("varlen", block_table is not None))
        assert causal and dropout_p == 0.0 and q.dim() == 3
        assert cu_seqlens_q.dtype == cu_seqlens_k.dtype == torch.int32
        b = cu_seqlens_q.shape[0] - 1
        assert cu_seqlens_k.shape == (b + 1,)
        cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
        q_lens = [cq[i + 1] - cq[i] for i in range(b)]
        k_lens = [ck[i + 1] - ck[i] for i in range(b)]
        assert max(q_lens) <= max_seqlen_q and max(k_lens) <= max_seqlen_k
        if block_table is not None:
            # Paged: k/v are the caches (num_blocks, page_block_size, nheads_k, headdim).
            assert k.dim() == 4 and block_table.dtype == torch.int32
            assert block_table.shape[0] == b
            keys = [self._gather(k, block_table[i], k_lens[i]) for i in range(b)]
            values = [self._gather(v, block_table[i], k_lens[i]) for i in range(b)]
        else:
            keys = [k[ck[i]:ck[i + 1]] for i in range(b)]
            values = [v[ck[i]:ck[i + 1]] for i in range(b)]
        return reference_attention(q, keys, values, q_lens, softmax_scale).to(q.dtype)

    def flash_attn_with_kvcache(self, q, k_cache, v_cache, cache_seqlens=None, block_table=None,
                                softmax_scale=None, causal=False):
        self.calls.append(("kvcache", block_table is not None))
        assert causal and q.dim() == 4 and q.shape[1] == 1
        lens = cache_seqlens.tolist()
        keys = [self._gather(k_cache, block_table[i], n) for i, n in enumerate(lens)]
        values = [self._gather(v_cache, block_table[i], n) for i, n in enumerate(lens)]
        out = reference_attention(q[:, 0], keys, values, [1] * len(lens), softmax_scale)
        return out.to(q.dtype).unsqueeze(1)


@pytest.mark.parametrize("case,call", [("mixed", ("varlen", True)),
                                       ("prefill_context", ("varlen", True)),
                                       ("prefill", ("varlen", False)),
                                       ("decode", ("kvcache", True))])
def test_flash_backend_maps_plans_onto_flash_attn_calls(case, call):
    """A mixed step is one paged varlen call whose decode rows have a query length of 1."""
    from tpserve.kernels.flash_attention import FlashAttention
    from tpserve.kernels.torch_store import store_kvcache_torch
    ctx, new, is_prefill = CASES[case]
    batch = random_paged_batch(ctx, new, num_heads=4, num_kv_heads=2, head_dim=32, block_size=16,
                               dtype=torch.bfloat16, is_prefill=is_prefill, seed=3)
    store_kvcache_torch(batch.k, batch.v, batch.k_cache, batch.v_cache, batch.meta.slot_mapping)
    backend = FlashAttention(16)
    backend._flash = fake = FakeFlashAttn()
    out = backend.attend(batch.q, batch.k, batch.v, batch.k_cache, batch.v_cache, batch.meta, 0.2)
    assert fake.calls == [call]
    ref = reference_attention(batch.q, batch.keys, batch.values, new, 0.2)
    torch.testing.assert_close(out.double(), ref, atol=TOL[torch.bfloat16], rtol=0)


def test_mixed_plan_attends_decode_rows_apart_from_chunks():
    """The decode rows of a mixed plan are not padded to the chunks' query length."""
    batch, out, ref = run_case("mixed", block_size=16)
    (dmeta, dq), (pmeta, pq) = batch.meta.derived("torch.mixed_parts", lambda: None)
    assert (dq, pq) == (4, 9 + 40 + 1) and dmeta.max_seqlen_q == 1 and not dmeta.is_prefill
    assert pmeta.cu_seqlens_q.tolist() == [0, 9, 49, 50] and pmeta.context_lens.tolist() == [9, 60, 18]
    torch.testing.assert_close(out.double(), ref, atol=TOL[torch.float32], rtol=0)
