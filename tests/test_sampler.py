import pytest
import torch

from tpserve.kernels import cpu_extension
from tpserve.workers.sampler import Sampler, apply_top_k_top_p, argmax_rows, uniform


def args(n, temp=1.0, k=-1, p=1.0, seeds=None, steps=None):
    return (torch.full((n,), temp), torch.full((n,), k, dtype=torch.int32), torch.full((n,), p),
            torch.arange(n) if seeds is None else seeds,
            torch.zeros(n, dtype=torch.int32) if steps is None else steps)


def test_uniform_is_in_range_and_depends_on_seed_and_step():
    u = uniform(torch.tensor([1, 1, 2]), torch.tensor([0, 1, 0]), 5000)
    assert u.min() > 0 and u.max() < 1
    assert abs(u.mean().item() - 0.5) < 0.02
    assert not torch.equal(u[0], u[1]) and not torch.equal(u[0], u[2])
    again = uniform(torch.tensor([1]), torch.tensor([0]), 5000)
    assert torch.equal(u[0], again[0])


def test_greedy_rows_take_argmax():
    logits = torch.randn(6, 50)
    out = Sampler()(logits, *args(6, temp=0.0))
    assert torch.equal(out, logits.argmax(-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [1, 5, 16, 17, 100, 32768])
def test_argmax_rows_picks_torch_argmax_including_ties_nan_and_inf(dtype, vocab):
    assert cpu_extension.available()  # the operator, not torch's fallback, is under test
    gen = torch.Generator().manual_seed(vocab)
    x = torch.randn(9, vocab + 3, generator=gen).to(dtype)[:, :vocab]  # strided rows
    x[1] = 0.0  # all tied: index 0
    x[2] = float("-inf")
    if vocab > 3:
        x[3, [1, vocab - 2]] = 50.0  # tie across lanes: the first
        x[4, vocab - 1] = float("nan")  # a NaN counts as the maximum
        x[5, [vocab // 2, vocab - 1]] = float("nan")  # the first NaN
        x[6, vocab - 1] = float("inf")
        x[7, :] = x[7, :].abs() * 0 - 1
        x[7, vocab - 3] = 2.0
    assert torch.equal(argmax_rows(x), x.float().argmax(-1))


def test_sampling_follows_the_distribution():
    torch.manual_seed(0)
    logits = torch.randn(1, 8)
    n = 20000
    out = Sampler()(logits.expand(n, 8), *args(n))
    freq = torch.bincount(out, minlength=8).float() / n
    assert torch.allclose(freq, logits.softmax(-1)[0], atol=0.015)


def test_top_k_and_top_p_restrict_the_support():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    n = 4000
    out = Sampler()(logits.expand(n, 5), *args(n, k=2))
    assert set(out.tolist()) == {0, 1}
    probs = logits.softmax(-1)[0]  # ~[.64, .24, .09, .03, .01]
    out = Sampler()(logits.expand(n, 5), *args(n, p=0.8))
    assert set(out.tolist()) == {0, 1}
    masked = apply_top_k_top_p(logits, torch.tensor([-1]), torch.tensor([0.5]))
    assert torch.isinf(masked[0, 1:]).all() and masked[0, 0] == 4.0
    assert probs[0] > 0.5


def test_seeded_rows_do_not_depend_on_batch_composition():
    torch.manual_seed(1)
    logits = torch.randn(5, 100)
    seeds = torch.tensor([11, 22, 33, 44, 55])
    steps = torch.tensor([0, 3, 1, 7, 2], dtype=torch.int32)
    full = Sampler()(logits, *args(5, temp=0.9, seeds=seeds, steps=steps))
    for i in range(5):
        one = Sampler()(logits[i:i + 1], *args(1, temp=0.9, seeds=seeds[i:i + 1], steps=steps[i:i + 1]))
        assert one.item() == full[i].item()
    shuffled = torch.tensor([3, 0, 4, 1, 2])
    out = Sampler()(logits[shuffled], *args(5, temp=0.9, seeds=seeds[shuffled], steps=steps[shuffled]))
    assert torch.equal(out, full[shuffled])


def test_mixed_greedy_and_sampled_rows():
    logits = torch.randn(4, 30)
    temps = torch.tensor([0.0, 1.0, 0.0, 1.0])
    out = Sampler()(logits, temps, *args(4)[1:])
    assert out[0] == logits[0].argmax() and out[2] == logits[2].argmax()


def test_uniform_is_float32_and_its_noise_is_finite():
    u = uniform(torch.arange(16), torch.zeros(16, dtype=torch.int32), 1 << 16)
    assert u.dtype == torch.float32
    assert u.min() > 0 and u.max() < 1
    assert torch.isfinite(u.log().neg().log()).all()
    # The extreme draws: 23 random bits plus one half are exact in float32 and stay inside (0, 1).
    k = torch.tensor([0.0, float((1 << 23) - 1)])
    edges = (k + 0.5) * (1.0 / (1 << 23))
    assert edges[0] > 0 and edges[1] < 1 and torch.isfinite(edges.log().neg().log()).all()


class _FloatWork(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the float32/float64 tensors that ops produce."""

    def __init__(self):
        super().__init__()
        self.sizes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.dtype in (torch.float32, torch.float64):
                self.sizes.append(t.numel())
        return out


def test_all_greedy_batch_does_no_full_vocabulary_float_work():
    logits = torch.randn(4, 1000).to(torch.bfloat16)
    temps, ks, ps, seeds, steps = args(4, temp=0.0)
    with _FloatWork() as rec:
        out = Sampler()(logits, temps, ks, ps, seeds, steps)
    assert torch.equal(out, logits.float().argmax(-1))
    assert max(rec.sizes, default=0) < 1000
    with _FloatWork() as rec:
        Sampler()(logits, torch.tensor([0.0, 1.0, 0.0, 0.0]), ks, ps, seeds, steps)
    assert max(rec.sizes) >= 4000  # a sampled row does go through float32 (the recorder works)


def test_seeded_draws_are_a_pure_function_of_seed_and_step():
    logits = torch.randn(3, 500)
    seeds, steps = torch.tensor([5, 5, 6]), torch.tensor([2, 2, 2], dtype=torch.int32)
    a = Sampler()(logits[[0, 0, 0]], *args(3, temp=1.0, seeds=seeds, steps=steps))
    assert a[0] == a[1]
    b = Sampler()(logits[[0, 0, 0]], *args(3, temp=1.0, seeds=seeds, steps=steps))
    assert torch.equal(a, b)
