"""Tensor parallelism: sharded layers and a TP=2 model equal the unsharded ones.

The layer tests shard one layer for every rank inside this process and recombine the shards by
hand (concatenating column outputs, summing row partials), so they need no process group. The
model test runs two CPU processes over gloo, each loading its shard of the same checkpoint; rank
0's logits must equal a TP=1 model's for a batched prefill and decode steps.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import tempfile
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from model_factory import make_tiny_model, tiny_models_root  # noqa: F401
from test_models import random_prompts, run_prefill_then_decode, tpserve_model
from tpserve.models import TPContext
from tpserve.models.embedding import ParallelLMHead, VocabParallelEmbedding
from tpserve.models.linear import (ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear,
                                   RowParallelLinear)
from tpserve.workers.process_group import destroy_tp

ATOL = 1e-4
RTOL = 1e-4


@dataclasses.dataclass(frozen=True)
class PartialTP(TPContext):
    """A rank's view without a process group: collectives return the local part unchanged,
    so a test can combine the parts of all ranks itself."""

    def all_reduce(self, x):
        return x

    def gather_to_rank0(self, x, dim=-1):
        return x


def shards(cls, size, *args, **kwargs):
    return [cls(*args, PartialTP(rank=r, size=size), **kwargs) for r in range(size)]


def test_column_and_row_parallel_recombine_to_the_full_linear():
    torch.manual_seed(0)
    w1, b1 = torch.randn(12, 8), torch.randn(12)
    w2, b2 = torch.randn(8, 12), torch.randn(8)
    x = torch.randn(5, 8)
    full = (x @ w1.T + b1) @ w2.T + b2
    cols = shards(ColumnParallelLinear, 2, 8, 12, bias=True)
    rows = shards(RowParallelLinear, 2, 12, 8, bias=True)
    for c, r in zip(cols, rows):
        c.weight_loader(c.weight, w1)
        c.weight_loader(c.bias, b1)
        r.weight_loader(r.weight, w2)
        r.weight_loader(r.bias, b2)
        assert c.weight.shape == (6, 8) and r.weight.shape == (8, 6)
    # Column outputs feed the row layer directly; the row partials sum (bias counted once).
    total = sum(r(c(x)) for c, r in zip(cols, rows))
    torch.testing.assert_close(total, full)
    torch.testing.assert_close(torch.cat([c(x) for c in cols], -1), x @ w1.T + b1)


def test_merged_gate_up_keeps_each_ranks_gate_before_its_up():
    torch.manual_seed(0)
    gate, up = torch.randn(8, 4), torch.randn(8, 4)
    parts = shards(MergedColumnParallelLinear, 2, 4, [8, 8])
    for p in parts:
        p.weight_loader(p.weight, gate, 0)
        p.weight_loader(p.weight, up, 1)
    for r, p in enumerate(parts):
        torch.testing.assert_close(p.weight, torch.cat([gate[4 * r:4 * r + 4], up[4 * r:4 * r + 4]]))


@pytest.mark.parametrize("num_heads,num_kv_heads,size", [(4, 2, 2), (4, 1, 2), (8, 2, 4), (4, 4, 2), (4, 2, 1)])
def test_qkv_sharding_gives_each_rank_the_kv_heads_its_query_heads_use(num_heads, num_kv_heads, size):
    d, hidden = 3, 6
    torch.manual_seed(0)
    wq = torch.randn(num_heads * d, hidden)
    wk, wv = torch.randn(num_kv_heads * d, hidden), torch.randn(num_kv_heads * d, hidden)
    bq, bk, bv = torch.randn(num_heads * d), torch.randn(num_kv_heads * d), torch.randn(num_kv_heads * d)
    group = num_heads // num_kv_heads
    for r, layer in enumerate(shards(QKVParallelLinear, size, hidden, d, num_heads, num_kv_heads, bias=True)):
        for shard_id, w, b in (("q", wq, bq), ("k", wk, bk), ("v", wv, bv)):
            layer.weight_loader(layer.weight, w, shard_id)
            layer.weight_loader(layer.bias, b, shard_id)
        sizes = [layer.q_size, layer.kv_size, layer.kv_size]
        q, k, v = layer.weight.split(sizes)
        qb, kb, vb = layer.bias.split(sizes)
        hq, hkv = layer.num_heads_per_rank, layer.num_kv_heads_per_rank
        assert hq == num_heads // size and hkv == max(1, num_kv_heads // size)
        q_heads = range(r * hq, (r + 1) * hq)
        # The kv heads of this rank are exactly those its query heads map to under global GQA.
        kv_heads = sorted({h // group for h in q_heads})
        assert len(kv_heads) == hkv
        rows = lambda heads: torch.cat([torch.arange(h * d, (h + 1) * d) for h in heads])  # noqa: E731
        torch.testing.assert_close(q, wq[rows(q_heads)])
        torch.testing.assert_close(k, wk[rows(kv_heads)])
        torch.testing.assert_close(v, wv[rows(kv_heads)])
        torch.testing.assert_close(torch.cat([qb, kb, vb]), torch.cat([bq[rows(q_heads)], bk[rows(kv_heads)], bv[rows(kv_heads)]]))


def test_vocab_parallel_embedding_and_lm_head_with_padded_vocab():
    vocab, dim, size = 301, 4, 2
    torch.manual_seed(0)
    w = torch.randn(vocab, dim)
    embeds = shards(VocabParallelEmbedding, size, vocab, dim)
    heads = shards(ParallelLMHead, size, vocab, dim)
    for e, h in zip(embeds, heads):
        e.weight_loader(e.weight, w)
        h.weight_loader(h.weight, w)
        assert e.weight.shape == (151, dim)
    assert (embeds[1].weight[-1] == 0).all()  # the padding row
    ids = torch.tensor([0, 150, 151, 300, 7])
    torch.testing.assert_close(sum(e(ids) for e in embeds), w[ids])
    hidden = torch.randn(3, dim)
    # The full logits are the rank slices in rank order, padding column dropped.
    logits = torch.cat([hd(hidden) for hd in heads], -1)[:, :vocab]
    torch.testing.assert_close(logits, hidden @ w.T)
    single = VocabParallelEmbedding(vocab, dim, TPContext())
    single.weight_loader(single.weight, w)
    head = ParallelLMHead(vocab, dim, TPContext())
    head.weight_loader(head.weight, w)
    torch.testing.assert_close(head(hidden), hidden @ w.T)
    torch.testing.assert_close(single(ids), w[ids])


def test_model_rejects_tp_size_that_does_not_divide_heads(tiny_models_root):
    path = make_tiny_model(tiny_models_root, "qwen3")
    with pytest.raises(ValueError, match="num_attention_heads: 4 is not divisible by tensor_parallel_size=3"):
        tpserve_model(path, TPContext(rank=0, size=3))


# ---------------------------------------------------------------- two processes over gloo

TP_CASES = {
    # kv heads (1) < TP size, odd vocabulary (padded), tied embeddings: all in one model.
    "qwen3-kv1-vocab301-tied": ("qwen3", dict(num_key_value_heads=1, vocab_size=301, tie_word_embeddings=True)),
    "qwen2-bias": ("qwen2", {}),
    "llama-row-bias": ("llama", dict(attention_bias=True, mlp_bias=True)),
}
LENGTHS = [5, 9, 3]
DECODE_STEPS = 2


def _schedule(vocab):
    prompts = random_prompts(LENGTHS, vocab, seed=5)
    g = torch.Generator().manual_seed(6)
    decode = torch.randint(3, vocab, (DECODE_STEPS, len(LENGTHS)), generator=g).tolist()
    return prompts, decode


def run_two_ranks(worker, *args, timeout: float = 150) -> None:
    """``worker(rank, store, *args)`` in two spawned processes; both must exit with status 0.
    ``store``: a fresh file for the group's rendezvous (a port picked here could be taken before
    rank 0 binds it)."""
    store = tempfile.mktemp(prefix="tpserve-test-store-")
    ctx = mp.spawn(worker, args=(store, *args), nprocs=2, join=False)
    deadline = time.monotonic() + timeout
    try:
        while not ctx.join(timeout=1):  # raises ProcessRaisedException if a rank failed
            assert time.monotonic() < deadline, f"TP workers did not finish in {timeout:.0f} s"
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
            p.join()
    assert [p.exitcode for p in ctx.processes] == [0, 0]


@contextlib.contextmanager
def gloo_group(rank: int, store: str):
    """A two-rank gloo group (file rendezvous) for the body (one thread per rank), destroyed after."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    try:
        yield TPContext(rank=rank, size=2)
        dist.barrier()
    finally:
        destroy_tp()  # frees the group now, not during interpreter exit (process_group.py)


def _tp_worker(rank: int, store: str, cases: list, out_dir: str) -> None:
    with gloo_group(rank, store) as tp:
        for name, path, vocab in cases:
            prompts, decode = _schedule(vocab)
            model = tpserve_model(path, tp)
            sharded = run_prefill_then_decode(model, prompts, decode)
            info = {"kv_heads": model.num_kv_heads_per_rank,
                    "embed_rows": model.model.embed_tokens.weight.shape[0],
                    "tied": model.lm_head.weight is model.model.embed_tokens.weight,
                    "all_gather": tp.all_gather(torch.tensor([[rank, 10 + rank]]), dim=0).tolist()}
            if rank == 0:
                reference = run_prefill_then_decode(tpserve_model(path), prompts, decode)
                torch.save({"sharded": sharded, "reference": reference, "info": info},
                           os.path.join(out_dir, f"{name}.pt"))
            else:
                torch.save({"sharded": sharded, "info": info}, os.path.join(out_dir, f"{name}.rank1.pt"))


@pytest.mark.timeout(180)
def test_tp2_logits_equal_tp1(tiny_models_root, tmp_path):
    cases = [(name, str(make_tiny_model(tiny_models_root, arch, **kw)), kw.get("vocab_size", 384))
             for name, (arch, kw) in TP_CASES.items()]
    run_two_ranks(_tp_worker, cases, str(tmp_path))
    for name, _, vocab in cases:
        r0 = torch.load(tmp_path / f"{name}.pt")
        r1 = torch.load(tmp_path / f"{name}.rank1.pt")
        assert len(r0["sharded"]) == 1 + DECODE_STEPS
        for step, (got, expected) in enumerate(zip(r0["sharded"], r0["reference"])):
            assert got.shape == expected.shape == ((sum(LENGTHS) if step == 0 else len(LENGTHS)), vocab)
            torch.testing.assert_close(got, expected, atol=ATOL, rtol=RTOL,
                                       msg=lambda m: f"{name} forward {step}: {m}")
        assert all(x is None for x in r1["sharded"]), "only rank 0 receives logits"
        assert r0["info"]["embed_rows"] == r1["info"]["embed_rows"] == -(-vocab // 2)
        assert r0["info"]["all_gather"] == r1["info"]["all_gather"] == [[0, 10], [1, 11]]
    kv1 = "qwen3-kv1-vocab301-tied"
    info = torch.load(tmp_path / f"{kv1}.pt")["info"]
    assert (info["kv_heads"], info["embed_rows"], info["tied"]) == (1, 151, True)
