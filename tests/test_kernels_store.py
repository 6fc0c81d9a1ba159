"""store_kvcache (Triton, under the interpreter on CPU) and its torch fallback."""
from __future__ import annotations

import pytest
import torch

from tpserve.kernels.torch_store import store_kvcache_torch


def _triton_store():
    # Imported lazily: tests/conftest.py must have chosen the interpreter before decoration.
    from tpserve.kernels.store_kvcache import store_kvcache
    return store_kvcache


STORES = {"torch": lambda: store_kvcache_torch, "triton": _triton_store}


def _setup(num_blocks=4, block_size=16, h=2, d=8, slots=(5, -1, 17, 63, 0, -1, 32),
           dtype=torch.float32, fused=False):
    gen = torch.Generator().manual_seed(1)
    t = len(slots)
    if fused:  # key/value as slices of a fused [T, 3, h, d] projection: token stride 3*h*d
        qkv = torch.randn(t, 3, h, d, generator=gen).to(dtype)
        key, value = qkv[:, 1], qkv[:, 2]
    else:
        key = torch.randn(t, h, d, generator=gen).to(dtype)
        value = torch.randn(t, h, d, generator=gen).to(dtype)
    k_cache = torch.randn(num_blocks, block_size, h, d, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, h, d, generator=gen).to(dtype)
    return key, value, k_cache, v_cache, torch.tensor(slots, dtype=torch.int32)


def _expected(key, value, k_cache, v_cache, slots):
    k_want, v_want = k_cache.clone(), v_cache.clone()
    kf, vf = k_want.view(-1, *k_cache.shape[2:]), v_want.view(-1, *v_cache.shape[2:])
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            kf[s], vf[s] = key[t], value[t]
    return k_want, v_want


@pytest.mark.parametrize("impl", list(STORES))
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_writes_slots_skips_minus_one_leaves_rest(impl, block_size, dtype):
    store = STORES[impl]()
    num_blocks = 64 // block_size
    key, value, kc, vc, slots = _setup(num_blocks=num_blocks, block_size=block_size, dtype=dtype)
    k_want, v_want = _expected(key, value, kc, vc, slots)
    store(key, value, kc, vc, slots)
    assert torch.equal(kc, k_want) and torch.equal(vc, v_want)
    # Tokens with slot -1 left no trace: their rows appear nowhere in the cache.
    for t in (1, 5):
        assert not (kc.view(-1, 2, 8) == key[t]).all(-1).all(-1).any()


@pytest.mark.parametrize("impl", list(STORES))
def test_store_accepts_strided_token_dim_and_int64_slots(impl):
    store = STORES[impl]()
    key, value, kc, vc, slots = _setup(h=3, d=12, fused=True)  # row of 36: not a power of 2
    assert not key.is_contiguous()
    k_want, v_want = _expected(key, value, kc, vc, slots)
    store(key, value, kc, vc, slots.long())
    assert torch.equal(kc, k_want) and torch.equal(vc, v_want)


@pytest.mark.parametrize("impl", list(STORES))
def test_store_of_no_tokens_is_a_no_op(impl):
    key, value, kc, vc, slots = _setup(slots=())
    before = kc.clone()
    STORES[impl]()(key, value, kc, vc, slots)
    assert torch.equal(kc, before)


@pytest.mark.parametrize("impl", list(STORES))
@pytest.mark.parametrize("mutate,msg", [
    (lambda a: a.update(value=a["value"][:, :1]), "value: shape"),
    (lambda a: a.update(key=a["key"].double(), value=a["value"].double()),
     "k_cache: expected dtype torch.float64"),
    (lambda a: a.update(slot_mapping=a["slot_mapping"][:3]), "slot_mapping: expected 7 entries"),
    (lambda a: a.update(slot_mapping=a["slot_mapping"].float()),
     "slot_mapping: expected dtype torch.int32 or torch.int64"),
    (lambda a: a.update(k_cache=a["k_cache"][..., :4]), "k_cache: expected shape"),
    (lambda a: a.update(v_cache=a["v_cache"][:2]), "v_cache: shape"),
    (lambda a: a.update(key=a["key"][None]), "key: expected 3 dimensions"),
])
def test_store_rejects_bad_arguments(impl, mutate, msg):
    key, value, kc, vc, slots = _setup()
    args = dict(key=key, value=value, k_cache=kc, v_cache=vc, slot_mapping=slots)
    mutate(args)
    with pytest.raises(ValueError, match=msg):
        STORES[impl]()(**args)


def test_triton_store_rejects_non_contiguous_token_rows():
    key, value, kc, vc, slots = _setup()
    key_t = key.transpose(1, 2).contiguous().transpose(1, 2)  # strides (16, 1, 2)
    with pytest.raises(ValueError, match=r"key: each token's \[2, 8\] rows must be contiguous"):
        _triton_store()(key_t, value, kc, vc, slots)
