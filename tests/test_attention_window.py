"""Per-layer attention options (sliding window, sinks, logit soft-cap): the interface."""
from __future__ import annotations

import pytest
import torch

from tpserve.kernels.attention_options import PLAIN, AttentionOptions
from tpserve.kernels.reference import random_paged_batch, reference_attention
from tpserve.kernels.torch_attention import TorchAttention
from tpserve.models.attention import SelfAttention
from tpserve.models.parallel import TPContext
from tpserve.models.rotary import RotaryEmbedding


class Recording(TorchAttention):
    """Records the options each call passes down to ``attend``."""

    options = frozenset({"window", "sinks", "softcap"})

    def __init__(self):
        super().__init__(16)
        self.seen: list[AttentionOptions] = []

    def attend(self, q, k, v, k_cache, v_cache, meta, scale, opts=PLAIN):
        self.seen.append((scale, opts))
        return torch.zeros_like(q)


def _batch():
    return random_paged_batch([0], [3], num_heads=4, num_kv_heads=2, head_dim=16, block_size=16)


@pytest.mark.parametrize("kwargs, msg", [
    ({"window": 0}, "window"), ({"window": True}, "window"), ({"window": 2.0}, "window"),
    ({"sinks": torch.zeros(3)}, "sinks"), ({"sinks": [0.0] * 4}, "sinks"),
    ({"sinks": torch.zeros(4, dtype=torch.int64)}, "sinks"),
    ({"softcap": 0.0}, "softcap"), ({"softcap": -1.0}, "softcap"), ({"softcap": "5"}, "softcap"),
])
def test_forward_rejects_bad_options_naming_them(kwargs, msg):
    b = _batch()
    with pytest.raises(ValueError, match=msg):
        Recording().forward(b.q, b.k, b.v, b.k_cache, b.v_cache, b.meta, 0.25, **kwargs)


def test_backend_refuses_options_it_lacks():
    class Plain(Recording):
        options = frozenset({"window"})

    b = _batch()
    Plain().forward(b.q, b.k, b.v, b.k_cache, b.v_cache, b.meta, 0.25, window=2)
    with pytest.raises(ValueError, match="sinks/softcap: the torch attention backend"):
        Plain().forward(b.q, b.k, b.v, b.k_cache, b.v_cache, b.meta, 0.25, window=2,
                        sinks=torch.zeros(4), softcap=30.0)


def test_options_reach_attend_and_plain_calls_stay_plain():
    b, backend = _batch(), Recording()
    backend.forward(b.q, b.k, b.v, b.k_cache, b.v_cache, b.meta, 0.25)
    sinks = torch.ones(4)
    backend.forward(b.q, b.k, b.v, b.k_cache, b.v_cache, b.meta, 0.25, window=5, sinks=sinks,
                    softcap=50)
    (_, first), (_, second) = backend.seen
    assert first is PLAIN and first.plain
    assert second.window == 5 and second.sinks is sinks and second.softcap == 50.0
    assert second.names() == {"window", "sinks", "softcap"}
    assert [second.keys_from(p) for p in (0, 4, 5, 9)] == [0, 0, 1, 5]


def _layer(tp, backend, **kwargs):
    rope = RotaryEmbedding(16, max_position=64, base=10_000.0)
    return SelfAttention(64, 4, 2, 16, tp, rope, backend, **kwargs)


def test_self_attention_passes_its_options_and_scale():
    backend = Recording()
    layer = _layer(TPContext(), backend, sliding_window=8, sinks=True, logit_softcap=20.0, scale=0.125)
    assert layer.sinks.shape == (4,) and layer.scale == 0.125
    with torch.no_grad():
        layer.sinks.copy_(torch.arange(4.0))
    b = _batch()
    layer(torch.arange(3), torch.randn(3, 64), b.meta)
    scale, opts = backend.seen[0]
    assert scale == 0.125 and opts.window == 8 and opts.softcap == 20.0
    assert torch.equal(opts.sinks, torch.arange(4.0))
    plain = _layer(TPContext(), Recording())
    assert plain.sinks is None and plain.scale == 16 ** -0.5
    assert "sinks" not in dict(plain.named_parameters())


def test_sinks_loader_keeps_this_ranks_heads():
    layer = _layer(TPContext(rank=1, size=2), Recording(), sinks=True)
    assert layer.sinks.shape == (2,)
    layer.sinks.weight_loader(layer.sinks, torch.tensor([1.0, 2.0, 3.0, 4.0]))
    assert torch.equal(layer.sinks, torch.tensor([3.0, 4.0]))
    with pytest.raises(Exception, match="sinks"):
        layer.sinks.weight_loader(layer.sinks, torch.zeros(3))


@pytest.mark.parametrize("kwargs, msg", [({"sliding_window": 0}, "sliding_window"),
                                         ({"logit_softcap": 0}, "logit_softcap"),
                                         ({"scale": -1.0}, "scale")])
def test_self_attention_rejects_bad_options(kwargs, msg):
    with pytest.raises(ValueError, match=msg):
        _layer(TPContext(), Recording(), **kwargs)


def test_reference_window_sinks_softcap_change_the_answer():
    b = random_paged_batch([20], [4], num_heads=2, num_kv_heads=1, head_dim=8, block_size=16)
    plain = reference_attention(b.q, b.keys, b.values, [4], 0.3)
    wide = reference_attention(b.q, b.keys, b.values, [4], 0.3, window=24)
    assert torch.equal(plain, wide)  # a window covering every key changes nothing
    one = reference_attention(b.q, b.keys, b.values, [4], 0.3, window=1)
    torch.testing.assert_close(one, b.values[0][20:].double().repeat_interleave(2, dim=1))
    assert not torch.allclose(reference_attention(b.q, b.keys, b.values, [4], 0.3, window=5), plain)
    sunk = reference_attention(b.q, b.keys, b.values, [4], 0.3, sinks=torch.tensor([0.5, -1.0]))
    assert not torch.allclose(sunk, plain)
    huge = reference_attention(b.q, b.keys, b.values, [4], 0.3, sinks=torch.full((2,), 60.0))
    assert huge.abs().max() < 1e-12  # a dominant sink leaves almost nothing of the values
    capped = reference_attention(b.q, b.keys, b.values, [4], 0.3, softcap=0.5)
    assert not torch.allclose(capped, plain)


# Backend equality with the reference --------------------------------------------------------

CASES = {
    # name: (context_lens, new_lens, is_prefill)
    "prefill": ([0, 0, 0], [5, 40, 17], True),
    "prefill_context": ([3, 0, 37, 16], [4, 6, 21, 9], True),  # chunked prefill over a context
    "decode": ([0, 5, 31, 16, 70], [1, 1, 1, 1, 1], False),
    "mixed": ([5, 44, 0, 20], [1, 1, 9, 30], True),
}
OPTIONS = {
    # name: (window, sinks?, softcap)
    "window4": (4, False, None), "window13": (13, False, None), "window_wide": (500, False, None),
    "window1": (1, False, None), "sinks": (None, True, None), "softcap": (None, False, 0.8),
    "all": (7, True, 1.5),
}


def sinks_for(heads: int) -> torch.Tensor:
    return torch.linspace(-1.5, 2.0, heads)


def check_backend(backend, case, option, *, heads=(4, 2), head_dim=16, dtype=torch.float32,
                  atol=2e-5, seed=0):
    from tpserve.kernels.reference import backend_vs_reference
    ctx, new, is_prefill = CASES[case]
    window, sinks, softcap = OPTIONS[option]
    batch, out, ref = backend_vs_reference(
        backend, ctx, new, is_prefill=is_prefill, num_heads=heads[0], num_kv_heads=heads[1],
        head_dim=head_dim, dtype=dtype, seed=seed, window=window,
        sinks=sinks_for(heads[0]) if sinks else None, softcap=softcap)
    assert out.shape == batch.q.shape and out.dtype == dtype
    torch.testing.assert_close(out.double().cpu(), ref, atol=atol, rtol=0)
    return out


@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("block_size", [1, 16])
def test_torch_backend_options_match_reference(case, option, block_size):
    check_backend(TorchAttention(block_size), case, option)


@pytest.mark.parametrize("option", ["window13", "all"])
def test_torch_backend_options_bf16_and_mqa(option):
    check_backend(TorchAttention(16), "mixed", option, heads=(4, 1), dtype=torch.bfloat16,
                  head_dim=32, atol=3e-2)


def test_window_options_change_the_backend_answer():
    plain = check_backend(TorchAttention(16), "decode", "window_wide")
    assert not torch.allclose(plain, check_backend(TorchAttention(16), "decode", "window4"))


def test_explicit_scores_are_computed_in_chunks_of_query_rows(monkeypatch):
    """Sinks / soft-cap take explicit scores; a long prompt's are bounded by chunks of rows."""
    from tpserve.kernels import torch_attention
    whole = check_backend(TorchAttention(16), "prefill", "all")
    monkeypatch.setattr(torch_attention, "SCORE_CHUNK_ELEMENTS", 1)  # one query row at a time
    torch.testing.assert_close(check_backend(TorchAttention(16), "prefill", "all"), whole, atol=1e-6, rtol=0)
