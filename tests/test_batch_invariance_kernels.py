"""The batch-invariant mode's kernels, row by row (tests/test_batch_invariance.py runs the engine).

One sequence's query row must come out with the same bits alone, in a batch beside a long
sequence and prompt rows, and as the last row of a prompt chunk (a prefix hit's remainder, a
preempted sequence's recomputation, a draft being verified): the C++ operator with ``rows``
and the Triton backend (under ``TRITON_INTERPRET=1`` on CPU tensors) in the mode. Without the
mode the same comparisons differ (the prompt path's sums, the Triton decode kernel's split count
that follows the batch's block-table width), so these tests can fail. Also: TPContext's
fixed-order all-reduce.
"""
import pytest
import torch

from tpserve.kernels import cpu_extension
from tpserve.kernels.metadata import AttentionMetadata
from tpserve.models.parallel import TPContext

HQ, HKV, BLOCK = 4, 2, 16
A_KEYS = 45        # the sequence under test: its row is its 45th key's query
LONG_KEYS = 600    # a neighbour whose block table widens the batch's (Triton: more splits)


class Cache:
    """A paged cache filled at random; sequence A in blocks 0.., the long one after it."""

    def __init__(self, dtype: torch.dtype, head_dim: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        blocks = 64
        shape = (blocks, BLOCK, HKV, head_dim)
        self.k = torch.randn(shape, generator=g).to(dtype)
        self.v = torch.randn(shape, generator=g).to(dtype)
        self.queries = torch.randn(LONG_KEYS + 64, HQ, head_dim, generator=g).to(dtype)
        a_blocks = -(-A_KEYS // BLOCK)
        self.tables = {"a": list(range(a_blocks)),
                       "long": list(range(a_blocks, a_blocks + -(-LONG_KEYS // BLOCK)))}
        self.keys = {"a": A_KEYS, "long": LONG_KEYS}

    def step(self, rows: list[tuple[str, int]]):
        """(q, meta) of a step whose sequence ``name`` has ``n`` new rows (its last n keys)."""
        n_rows = [n for _, n in rows]
        width = max(len(self.tables[name]) for name, _ in rows)
        tables = [self.tables[name] + [-1] * (width - len(self.tables[name])) for name, _ in rows]
        ctx = [self.keys[name] for name, _ in rows]
        cu_q = [0]
        for n in n_rows:
            cu_q.append(cu_q[-1] + n)
        cu_k = [0]
        for c in ctx:
            cu_k.append(cu_k[-1] + c)
        q = torch.cat([self.queries[c - n:c] for (_, n), c in zip(rows, ctx)])
        prefill = any(n > 1 for n in n_rows)
        decodes = 0
        while decodes < len(n_rows) and n_rows[decodes] == 1:
            decodes += 1
        meta = AttentionMetadata.from_arrays(
            is_prefill=prefill, has_context=prefill, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, context_lens=ctx,
            block_tables=tables, slot_mapping=[-1] * cu_q[-1])
        meta.num_decodes = decodes if prefill else len(n_rows)
        return q, meta


def _a_last_row(backend, cache: Cache, rows: list[tuple[str, int]]) -> torch.Tensor:
    """Sequence A's last query row's output in a step of ``rows``."""
    q, meta = cache.step(rows)
    out = backend.attend(q, None, None, cache.k, cache.v, meta, scale=0.25)
    end = 0
    for name, n in rows:
        end += n
        if name == "a":
            return out[end - 1].clone()
    raise AssertionError("no row of a")


SITUATIONS = {
    "alone": [("a", 1)],
    "beside a long prompt chunk": [("a", 1), ("long", 70)],
    "beside a long decode": [("long", 1), ("a", 1)],
    "as a prompt chunk's last row": [("a", 5)],
    "as a whole prompt's last row, batched": [("long", 3), ("a", A_KEYS)],
}


def _outputs(backend, cache) -> dict[str, torch.Tensor]:
    return {name: _a_last_row(backend, cache, rows) for name, rows in SITUATIONS.items()}


def _moved(outs: dict[str, torch.Tensor]) -> list[str]:
    return [name for name, o in outs.items() if not torch.equal(o, outs["alone"])]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_operator_rows_are_invariant(dtype):
    assert cpu_extension.available(), cpu_extension.status()
    from tpserve.kernels.cpu_attention import CpuAttention
    cache = Cache(dtype, head_dim=64)
    default = CpuAttention(BLOCK)
    if dtype == torch.float32:  # (in bf16 one row's rounding to bf16 mostly hides the last bits)
        assert _moved(_outputs(default, cache)), "the default paths should differ (prompt vs decode sums)"
    invariant = CpuAttention(BLOCK)
    invariant.set_batch_invariant(dtype, 64)
    outs = _outputs(invariant, cache)
    assert _moved(outs) == []
    # ... and equal to what the default decode path (the fused decode stack's) computes alone.
    assert torch.equal(outs["alone"], _outputs(default, cache)["alone"])


def test_cpu_operator_refuses_rows_it_cannot_take():
    from tpserve.kernels.cpu_attention import CpuAttention
    with pytest.raises(ValueError, match="head_dim"):
        CpuAttention(BLOCK).set_batch_invariant(torch.bfloat16, 24)
    with pytest.raises(ValueError, match="float16"):
        CpuAttention(BLOCK).set_batch_invariant(torch.float16, 64)


def test_triton_backend_rows_are_invariant():
    """Under the interpreter (tests/conftest.py sets TRITON_INTERPRET=1 without a GPU)."""
    from tpserve.kernels.triton_attention import TritonAttention
    cache = Cache(torch.float32, head_dim=16, seed=1)
    default = TritonAttention(BLOCK)
    situations = {k: SITUATIONS[k] for k in ("alone", "beside a long decode", "as a prompt chunk's last row")}
    default_outs = {name: _a_last_row(default, cache, rows) for name, rows in situations.items()}
    # Alone: one split (a 48-key table); beside the 600-key sequence: two (decode_splits).
    assert not torch.equal(default_outs["alone"], default_outs["beside a long decode"])
    invariant = TritonAttention(BLOCK)
    invariant.set_batch_invariant(torch.float32, 16)
    outs = {name: _a_last_row(invariant, cache, rows) for name, rows in situations.items()}
    assert _moved(outs) == []


def test_other_backends_refuse_the_mode():
    from tpserve.kernels.torch_attention import TorchAttention
    with pytest.raises(ValueError, match="no batch-invariant mode"):
        TorchAttention(BLOCK).set_batch_invariant(torch.bfloat16, 64)


@pytest.mark.parametrize("rows", [1, 7, 64])
def test_fixed_order_all_reduce_sums_in_rank_order(monkeypatch, rows):
    """Three ranks' parts summed ((x0 + x1) + x2) element by element, whatever the row count."""
    g = torch.Generator().manual_seed(rows)
    parts = [torch.randn(rows, 33, generator=g) * 10 ** (3 * r) for r in range(3)]

    def all_gather(out, x, group=None):
        for o, p in zip(out, parts):
            o.copy_(p)

    monkeypatch.setattr(torch.distributed, "all_gather", all_gather)
    x = parts[1].clone()
    TPContext(rank=1, size=3, fixed_order=True).all_reduce(x)
    assert torch.equal(x, (parts[0] + parts[1]) + parts[2])
    assert torch.equal(x[:1], (parts[0][:1] + parts[1][:1]) + parts[2][:1])
