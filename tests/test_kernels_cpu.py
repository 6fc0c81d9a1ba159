"""The C++ CPU attention backend against the dense reference; the KV store; selection/fallback."""
from __future__ import annotations

import pytest
import torch

from tpserve.kernels import backend_factory as backend_mod
from tpserve.kernels import cpu_extension
from tpserve.kernels.backend_factory import get_backend
from tpserve.kernels.reference import backend_vs_reference, random_paged_batch

# The install builds the C++ operators (make install); a machine where that build failed
# fails these tests rather than skipping them: the fallback has tests of its own.

TOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2, torch.float16: 5e-3}

CASES = {
    # name: (context_lens (cached keys), new_lens (query rows), is_prefill)
    "decode": ([0, 5, 15, 16, 31, 300], [1] * 6, False),
    "prefill": ([0, 0, 0], [5, 17, 33], True),
    "prefill_context": ([3, 0, 20, 16, 31], [4, 6, 1, 9, 40], True),
    # Decode rows (one new token over a long context) beside prefill chunks in one plan.
    "mixed": ([40, 0, 17, 255, 3], [1, 12, 1, 1, 30], True),
    # Chunks longer than the kernel's 16-row work unit, crossing block boundaries.
    "long_chunks": ([17, 250], [37, 70], True),
    # One stream decoding: fewer sequences than threads, so its KV heads are split between them.
    "one_decode": ([300], [1], False),
}


def run(case, *, block_size, heads, head_dim=32, dtype=torch.float32, seed=0):
    ctx, new, is_prefill = CASES[case]
    return backend_vs_reference(get_backend("cpu", "cpu", block_size), ctx, new,
                                is_prefill=is_prefill, num_heads=heads[0], num_kv_heads=heads[1],
                                head_dim=head_dim, dtype=dtype, seed=seed)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("block_size", [1, 16, 256])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (8, 1)], ids=["gqa1", "gqa2", "gqa8"])
def test_matches_reference_fp32(case, block_size, heads):
    batch, out, ref = run(case, block_size=block_size, heads=heads)
    assert out.shape == batch.q.shape and out.dtype == torch.float32
    # The cache holds NaN in every slot no sequence owns: a stray read would show here.
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref, atol=TOL[torch.float32], rtol=0)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_matches_reference_half_precision(case, dtype):
    batch, out, ref = run(case, block_size=16, heads=(4, 2), dtype=dtype)
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), ref, atol=TOL[dtype], rtol=0)


@pytest.mark.parametrize("head_dim", [64, 128, 48])  # specialised sizes and the generic loop
def test_head_dims(head_dim):
    batch, out, ref = run("mixed", block_size=16, heads=(4, 2), head_dim=head_dim)
    torch.testing.assert_close(out.double(), ref, atol=TOL[torch.float32], rtol=0)


# Decode plans (one row per sequence) take the kernel's decode path when head_dim % 16 == 0 and
# the dtype is fp32/bf16: specialised for 64/128/256, a generic loop for other multiples of 16,
# and the general kernel otherwise (40) and for fp16.
@pytest.mark.parametrize("head_dim", [64, 128, 256, 48, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_decode_path_head_dims_and_dtypes(head_dim, dtype):
    batch, out, ref = run("decode", block_size=16, heads=(8, 2), head_dim=head_dim, dtype=dtype)
    assert out.dtype == dtype and torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref, atol=TOL[dtype], rtol=0)


# The decode path sums the values for runs of 4, 2 or 1 query heads of a KV head (by the group's
# size) over chunks of the head dimension; bf16 scores come from the query's own bf16 pairs.
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (8, 1), (6, 2), (12, 4)],
                         ids=["gqa1", "gqa2", "gqa8", "gqa3", "gqa3x4"])
@pytest.mark.parametrize("head_dim", [64, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [1, 16])
def test_decode_path_query_groups(heads, head_dim, dtype, block_size):
    batch, out, ref = run("decode", block_size=block_size, heads=heads, head_dim=head_dim, dtype=dtype)
    assert out.dtype == dtype and torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref, atol=TOL[dtype], rtol=0)


# Prompt rows take the operator's tiled path when head_dim % 16 == 0 and the dtype is fp32/bf16
# (specialised for 64/128/256, a generic loop for 48), torch's SDPA paths otherwise (40, fp16).
@pytest.mark.parametrize("head_dim", [64, 128, 256, 48, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", ["prefill", "prefill_context", "long_chunks"])
def test_prompt_path_head_dims_and_dtypes(case, head_dim, dtype):
    batch, out, ref = run(case, block_size=16, heads=(8, 2), head_dim=head_dim, dtype=dtype)
    assert out.dtype == dtype and torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref, atol=TOL[dtype], rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [1, 16])
def test_prompt_rows_do_not_depend_on_how_the_prompt_is_split(dtype, block_size):
    """A prompt row computes the same bits whether the rows before it are new in this call or
    read from the cache, whatever else shares the call: the promise of docs/protocol.md."""
    ops = cpu_extension.ops()
    heads, d, n = (8, 2), 64, 75
    whole = random_paged_batch([0, 0], [n, 40], num_heads=heads[0], num_kv_heads=heads[1],
                               head_dim=d, block_size=block_size, dtype=dtype, seed=3)
    m = whole.meta
    backend = get_backend("cpu", "cpu", block_size)
    backend.store(whole.k, whole.v, whole.k_cache, whole.v_cache, m.slot_mapping)

    def attend(q, cu, ctx, tables):
        out = torch.empty_like(q)
        ops.paged_attention(out, q, whole.k_cache, whole.v_cache, tables,
                            torch.tensor(cu, dtype=torch.int32), torch.tensor(ctx, dtype=torch.int32),
                            d ** -0.5, True)
        return out

    first = whole.q[:n]
    all_new = attend(whole.q, [0, n, n + 40], [n, 40], m.block_tables)[:n]
    for cached in (1, 16, 31, 47, 74):  # the first `cached` positions come from the cache
        rest = attend(first[cached:], [0, n - cached], [n], m.block_tables[:1])
        assert torch.equal(rest, all_new[cached:]), cached
        # beside other rows: a 5-row chunk of the second sequence, then this prompt's rest
        mixed = attend(torch.cat([whole.q[n + 35:], first[cached:]]), [0, 5, 5 + n - cached],
                       [40, n], m.block_tables.flip(0))
        assert torch.equal(mixed[5:], all_new[cached:]), cached


@pytest.mark.parametrize("case,heads", [("mixed", (4, 2)), ("one_decode", (8, 4)), ("one_decode", (4, 1))])
def test_thread_count_does_not_change_the_result(case, heads):
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        _, one, _ = run(case, block_size=16, heads=heads)
        torch.set_num_threads(2)
        _, two, _ = run(case, block_size=16, heads=heads)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


def test_store_writes_exactly_the_mapped_slots():
    """Slot -1 skips a token (a prefix-cache hit); every other cache row is left as it was."""
    batch = random_paged_batch([3, 0], [4, 6], num_heads=4, num_kv_heads=2, head_dim=16,
                               block_size=4)
    slots = batch.meta.slot_mapping.clone()
    slots[1] = -1
    k_before = batch.k_cache.clone()
    k = batch.k[:, :, :]  # a view, as the QKV split hands it over
    cpu_extension.ops().store_kvcache(k, batch.v, batch.k_cache, batch.v_cache, slots)
    flat = batch.k_cache.view(-1, 2, 16)
    kept = slots >= 0
    assert torch.equal(flat[slots[kept].long()], batch.k[kept])
    assert torch.equal(batch.v_cache.view(-1, 2, 16)[slots[kept].long()], batch.v[kept])
    untouched = torch.ones(flat.shape[0], dtype=torch.bool)
    untouched[slots[kept].long()] = False
    torch.testing.assert_close(flat[untouched], k_before.view(-1, 2, 16)[untouched],
                               equal_nan=True, rtol=0, atol=0)


def test_store_accepts_strided_rows():
    qkv = torch.randn(5, 3 * 2 * 8)
    k = qkv[:, 16:32].view(5, 2, 8)
    v = qkv[:, 32:].view(5, 2, 8)
    kc, vc = torch.zeros(2, 4, 2, 8), torch.zeros(2, 4, 2, 8)
    slots = torch.tensor([7, 0, 3, -1, 4], dtype=torch.int32)
    cpu_extension.ops().store_kvcache(k, v, kc, vc, slots)
    assert torch.equal(kc.view(8, 2, 8)[[7, 0, 3, 4]], k[[0, 1, 2, 4]])
    assert torch.equal(vc.view(8, 2, 8)[[7, 0, 3, 4]], v[[0, 1, 2, 4]])


def test_bad_metadata_raises_value_error_and_writes_nothing():
    batch = random_paged_batch([3, 20], [1, 1], num_heads=4, num_kv_heads=2, head_dim=16,
                               block_size=4, is_prefill=False)
    ops = cpu_extension.ops()
    out = torch.zeros_like(batch.q)
    tables = batch.meta.block_tables.clone()
    tables[1, 2] = -1  # a block the second sequence's keys need
    with pytest.raises(ValueError, match="block_tables: a block a sequence's keys need"):
        ops.paged_attention(out, batch.q, batch.k_cache, batch.v_cache, tables,
                            batch.meta.cu_seqlens_q, batch.meta.context_lens, 0.25)
    assert not out.any()
    with pytest.raises(ValueError, match="context_lens"):
        ops.paged_attention(out, batch.q, batch.k_cache, batch.v_cache, batch.meta.block_tables,
                            batch.meta.cu_seqlens_q, torch.zeros(2, dtype=torch.int32), 0.25)
    with pytest.raises(ValueError, match="q: expected float32, bfloat16 or float16"):
        ops.paged_attention(out.double(), batch.q.double(), batch.k_cache, batch.v_cache,
                            batch.meta.block_tables, batch.meta.cu_seqlens_q,
                            batch.meta.context_lens, 0.25)
    k_before = batch.k_cache.clone()
    with pytest.raises(ValueError, match="slot_mapping: slot past the end"):
        ops.store_kvcache(batch.k, batch.v, batch.k_cache, batch.v_cache,
                          torch.tensor([0, 10**6], dtype=torch.int32))
    torch.testing.assert_close(batch.k_cache, k_before, equal_nan=True, rtol=0, atol=0)


def test_auto_on_cpu_picks_cpu_and_falls_back_to_torch(monkeypatch):
    for bs in (1, 16, 256):
        be = get_backend("auto", "cpu", bs)
        assert be.name == "cpu" and be.block_size == bs and not be.supports_cuda_graphs
    monkeypatch.setattr(cpu_extension, "available", lambda: False)
    assert get_backend("auto", "cpu", 16).name == "torch"
    with pytest.raises(ValueError, match="C\\+\\+ CPU operators could not be built"):
        get_backend("cpu", "cpu", 16)


def test_cpu_backend_refuses_cuda_devices():
    with pytest.raises(ValueError, match="cpu backend runs on CPU tensors, got device cuda"):
        get_backend("cpu", "cuda", 16)
    assert "cpu" in backend_mod.BACKEND_NAMES


def test_failed_build_logs_one_warning_and_reports_unavailable(monkeypatch, caplog):
    monkeypatch.setattr(cpu_extension, "_state", {})

    def broken():
        raise RuntimeError("c++: command not found")

    monkeypatch.setattr(cpu_extension, "_build", broken)
    with caplog.at_level("WARNING", logger="tpserve.kernels"):
        assert not cpu_extension.available()
        assert not cpu_extension.available()
    warnings = [r for r in caplog.records if "C++ CPU operators are unavailable" in r.getMessage()]
    assert len(warnings) == 1 and "command not found" in warnings[0].getMessage()


def test_env_switch_disables_the_operators(monkeypatch):
    monkeypatch.setattr(cpu_extension, "_state", {})
    monkeypatch.setenv("TPSERVE_CPU_OPS", "0")
    assert not cpu_extension.available()


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("block_size", [1, 16])
def test_operator_alone_handles_every_plan_shape(case, block_size):
    """The operator alone takes whole plans: decode and prompt rows in one call."""
    batch, _, ref = run(case, block_size=block_size, heads=(4, 2))  # forward stored the new K/V
    m = batch.meta
    out = torch.empty_like(batch.q)
    cpu_extension.ops().paged_attention(out, batch.q, batch.k_cache, batch.v_cache, m.block_tables,
                                        m.cu_seqlens_q, m.context_lens, 1 / 32 ** 0.5)
    torch.testing.assert_close(out.double(), ref, atol=TOL[torch.float32], rtol=0)


def test_each_row_kind_takes_its_path(monkeypatch):
    """Decode rows and (fp32/bf16, head_dim % 16 == 0) prompt rows take the operator, in separate
    calls in a mixed plan; other prompt rows take torch's SDPA paths."""
    backend = get_backend("cpu", "cpu", 16)
    kernel_rows, torch_rows = [], []
    ops, torch_attend = backend._ops, backend._torch.attend

    class Spy:
        def paged_attention(self, out, q, *args):
            kernel_rows.append(q.shape[0])
            return ops.paged_attention(out, q, *args)

        def __getattr__(self, name):
            return getattr(ops, name)

    def spy_attend(q, *args):
        torch_rows.append(q.shape[0])
        return torch_attend(q, *args)

    monkeypatch.setattr(backend, "_ops", Spy())
    monkeypatch.setattr(backend._torch, "attend", spy_attend)
    for case, head_dim, dtype, want_kernel, want_torch in (
            ("decode", 32, torch.float32, [6], []),
            ("mixed", 32, torch.bfloat16, [1, 44], []),
            ("prefill", 32, torch.float32, [55], []),
            ("prefill_context", 32, torch.float32, [60], []),
            ("mixed", 40, torch.float32, [1], [44]),
            ("prefill", 32, torch.float16, [], [55])):
        kernel_rows.clear()
        torch_rows.clear()
        ctx, new, is_prefill = CASES[case]
        _, out, ref = backend_vs_reference(backend, ctx, new, is_prefill=is_prefill, num_heads=4,
                                           num_kv_heads=2, head_dim=head_dim, dtype=dtype)
        torch.testing.assert_close(out.double(), ref, atol=TOL[dtype], rtol=0)
        assert (kernel_rows, torch_rows) == (want_kernel, want_torch), (case, head_dim, dtype)


def test_cpu_arch_override_changes_flags_and_build_name(monkeypatch):
    monkeypatch.delenv("TPSERVE_CPU_ARCH", raising=False)
    native = cpu_extension.build_name()
    assert "-march=native" in cpu_extension.cflags()
    monkeypatch.setenv("TPSERVE_CPU_ARCH", "haswell")
    assert "-march=haswell" in cpu_extension.cflags() and "-march=native" not in cpu_extension.cflags()
    assert cpu_extension.build_name() != native  # never loads the other ISA's build


AVX2_CHECK = r"""
import sys
import torch
from tpserve.kernels import cpu_extension
from tpserve.kernels.backend_factory import get_backend
from tpserve.kernels.reference import backend_vs_reference
from tpserve.workers.sampler import argmax_rows
assert cpu_extension.available(), cpu_extension._state.get("error")
for dtype, tol in ((torch.float32, 2e-5), (torch.bfloat16, 3e-2)):
    for ctx, new, pre, d in (([0, 5, 300], [1, 1, 1], False, 64), ([0, 20], [37, 9], True, 64),
                             ([40, 0], [1, 70], True, 128), ([3, 0], [4, 33], True, 48)):
        _, out, ref = backend_vs_reference(get_backend("cpu", "cpu", 16), ctx, new, is_prefill=pre,
                                           num_heads=8, num_kv_heads=2, head_dim=d, dtype=dtype)
        assert (out.double() - ref).abs().max() <= tol, (dtype, ctx, new, d)
    for ctx, new, pre in (([0, 5, 300], [1, 1, 1], False), ([30, 0], [37, 70], True)):  # window, sinks, cap
        _, out, ref = backend_vs_reference(get_backend("cpu", "cpu", 16), ctx, new, is_prefill=pre,
                                           num_heads=8, num_kv_heads=2, head_dim=64, dtype=dtype, window=21,
                                           sinks=torch.linspace(-1.0, 1.0, 8), softcap=2.0)
        assert (out.double() - ref).abs().max() <= tol, (dtype, ctx, new, "options")
    x = torch.randn(5, 1000).to(dtype)
    assert torch.equal(argmax_rows(x), x.float().argmax(-1))
    h = torch.randn(7, 512).to(dtype)
    w = torch.rand(512).to(dtype)
    out = torch.empty_like(h)
    cpu_extension.ops().rms_norm(out, h, None, None, w, 1e-6)
    ref = (h.float() * torch.rsqrt(h.float().pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype) * w
    assert (out.float() - ref.float()).abs().max() <= tol * 4
sys.path.insert(0, TESTS_DIR)
from test_packed_gemm import check_linear_kinds
check_linear_kinds()  # the packed linear kernels: 8-float vectors, the AVX2 int8 path
print("ok")
"""


def test_an_avx2_build_of_the_operators_is_correct(tmp_path):
    """The operators built for an AVX2-only CPU (8-float vectors instead of 16) against the
    dense reference: decode and prompt paths, argmax, RMSNorm, the packed linear kernels of
    every weight kind. Runs on any x86-64 CPU."""
    import os
    import subprocess
    import sys
    env = dict(os.environ, TPSERVE_CPU_ARCH="haswell")
    check = AVX2_CHECK.replace("TESTS_DIR", repr(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run([sys.executable, "-c", check], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


def test_a_one_token_prefill_row_after_decode_rows_takes_the_prompt_path():
    """The plan says how many leading rows are decode rows: a prefill chunk of one token that
    follows them (a prefix hit leaving one prompt token) is a prompt row, which must compute
    the bits the prompt path gives (docs/protocol.md), not those of the decode path."""
    backend = get_backend("cpu", "cpu", 4)
    batch = random_paged_batch([9, 20, 30, 6], [1, 1, 1, 5], num_heads=4, num_kv_heads=2,
                               head_dim=16, block_size=4, is_prefill=True)
    meta = batch.meta
    meta.has_context, meta.num_decodes = True, 2
    out = backend.forward(batch.q, batch.k, batch.v, batch.k_cache, batch.v_cache, meta, 0.25)
    ops = cpu_extension.ops()
    prompt_way = torch.empty_like(batch.q[2:])
    ops.paged_attention(prompt_way, batch.q[2:], batch.k_cache, batch.v_cache, meta.block_tables[2:],
                        torch.tensor([0, 1, 6], dtype=torch.int32), meta.context_lens[2:], 0.25, True)
    decode_way = torch.empty_like(batch.q[2:3])
    ops.paged_attention(decode_way, batch.q[2:3], batch.k_cache, batch.v_cache, meta.block_tables[2:3],
                        torch.tensor([0, 1], dtype=torch.int32), meta.context_lens[2:3], 0.25, False)
    assert not torch.equal(decode_way, prompt_way[:1])  # the two paths are told apart by their bits
    assert torch.equal(out[2:], prompt_way)


def test_block_tables_are_checked_once_per_step(tmp_path, monkeypatch):
    """Every layer reads the same block tables: the cpu backend checks them on the step's first
    layer only, and still refuses a bad block id."""
    from model_factory import make_tiny_model
    from test_models import PagedKV, tpserve_model
    model = tpserve_model(make_tiny_model(tmp_path, num_hidden_layers=3), backend="cpu")
    kv = PagedKV(model, 2, 16)
    backend = model.model.layers[0].self_attn.backend
    calls = []

    class CountingOps:
        def __getattr__(self, name):
            op = getattr(cpu_extension.ops(), name)
            return (lambda *a: calls.append(1) or op(*a)) if name == "check_block_tables" else op

    monkeypatch.setattr(backend, "_ops", CountingOps())
    for new in ([[5, 6, 7], [8, 9]], [[1], [2]]):
        ids, pos, meta = kv.step(new)
        model.forward(ids, pos, meta)
    assert len(calls) == 2  # one per step, three layers each
    ids, pos, meta = kv.step([[3], [4]])
    meta.block_tables[1, 0] = 999
    with pytest.raises(ValueError, match="block_tables: a block"):
        model.forward(ids, pos, meta)
