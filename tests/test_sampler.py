import numpy as np
import pytest
import torch

from tpserve.kernels import cpu_extension
from tpserve.sample_plan import SamplePlan
from tpserve.workers.sampler import Sampler, TOP_CANDIDATES, _top_k_top_p_sorted, apply_top_k_top_p, argmax_rows, uniform


def args(n, temp=1.0, k=-1, p=1.0, seeds=None, steps=None, **controls):
    """A SamplePlan of ``n`` rows: each per-row value a scalar or ``n`` values; ``controls``:
    its other fields."""
    return SamplePlan.rows(np.broadcast_to(np.asarray(temp, np.float32), (n,)), top_ks=k, top_ps=p,
                           seeds=np.arange(n) if seeds is None else np.asarray(seeds),
                           steps=0 if steps is None else np.asarray(steps), **controls)


def test_uniform_is_in_range_and_depends_on_seed_and_step():
    u = uniform(torch.tensor([1, 1, 2]), torch.tensor([0, 1, 0]), 5000)
    assert u.min() > 0 and u.max() < 1
    assert abs(u.mean().item() - 0.5) < 0.02
    assert not torch.equal(u[0], u[1]) and not torch.equal(u[0], u[2])
    again = uniform(torch.tensor([1]), torch.tensor([0]), 5000)
    assert torch.equal(u[0], again[0])


def test_greedy_rows_take_argmax():
    logits = torch.randn(6, 50)
    out = Sampler()(logits, args(6, temp=0.0))
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
    out = Sampler()(logits.expand(n, 8), args(n))
    freq = torch.bincount(out, minlength=8).float() / n
    assert torch.allclose(freq, logits.softmax(-1)[0], atol=0.015)


@pytest.mark.parametrize("seed", range(4))
def test_top_k_top_p_through_candidates_keeps_what_the_full_sort_keeps(seed):
    gen = torch.Generator().manual_seed(seed)
    vocab = 20 * TOP_CANDIDATES  # room for both candidate counts (c and 8c) before the sort
    # Peaked rows (the nucleus within the first candidates), a flatter one (within 8 times as
    # many), flat ones (past those too: the full sort).
    scale = torch.tensor([6.0, 6.0, 6.0, 0.3, 6.0, 0.3, 6.0, 6.0, 2.2])[:, None]
    x = torch.randn(9, vocab, generator=gen) * scale
    ks = torch.tensor([0, 40, 0, 0, 0, 0, 2 * TOP_CANDIDATES, 1, 0], dtype=torch.int32)
    ps = torch.tensor([0.9, 1.0, 0.5, 0.9, 1.0, 1.0, 0.95, 0.3, 0.9])
    got = apply_top_k_top_p(x, ks, ps)
    k = torch.where(ks > 0, ks.long(), torch.full_like(ks, vocab).long())
    want = _top_k_top_p_sorted(x, k, ps, True)
    assert torch.equal(torch.isfinite(got), torch.isfinite(want))
    assert torch.equal(got[torch.isfinite(got)], x[torch.isfinite(got)])
    kept = torch.isfinite(got).sum(-1)
    # top_p 1 filters nothing, also beside rows that need top-p; top-k alone is exact
    assert kept[1] == 40 and kept[4] == vocab and kept[5] == vocab and kept[7] == 1
    assert kept[3] > 8 * TOP_CANDIDATES  # the flat row went to the full sort
    assert TOP_CANDIDATES < kept[8] <= 8 * TOP_CANDIDATES  # the second candidate count


def test_top_k_and_top_p_restrict_the_support():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    n = 4000
    out = Sampler()(logits.expand(n, 5), args(n, k=2))
    assert set(out.tolist()) == {0, 1}
    probs = logits.softmax(-1)[0]  # ~[.64, .24, .09, .03, .01]
    out = Sampler()(logits.expand(n, 5), args(n, p=0.8))
    assert set(out.tolist()) == {0, 1}
    masked = apply_top_k_top_p(logits, torch.tensor([-1]), torch.tensor([0.5]))
    assert torch.isinf(masked[0, 1:]).all() and masked[0, 0] == 4.0
    assert probs[0] > 0.5


def test_seeded_rows_do_not_depend_on_batch_composition():
    torch.manual_seed(1)
    logits = torch.randn(5, 100)
    seeds = torch.tensor([11, 22, 33, 44, 55])
    steps = torch.tensor([0, 3, 1, 7, 2], dtype=torch.int32)
    full = Sampler()(logits, args(5, temp=0.9, seeds=seeds, steps=steps))
    for i in range(5):
        one = Sampler()(logits[i:i + 1], args(1, temp=0.9, seeds=seeds[i:i + 1], steps=steps[i:i + 1]))
        assert one.item() == full[i].item()
    shuffled = torch.tensor([3, 0, 4, 1, 2])
    out = Sampler()(logits[shuffled], args(5, temp=0.9, seeds=seeds[shuffled], steps=steps[shuffled]))
    assert torch.equal(out, full[shuffled])


def test_mixed_greedy_and_sampled_rows():
    logits = torch.randn(4, 30)
    temps = torch.tensor([0.0, 1.0, 0.0, 1.0])
    out = Sampler()(logits, args(4, temp=temps))
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_greedy_argmax_operator_says_whether_every_row_is_greedy(dtype):
    assert cpu_extension.available()
    x = torch.randn(5, 300).to(dtype)
    ops = torch.ops.tpserve_cpu
    for temps, want in (([0.0, 0.0, -1.0, 0.0, 0.0], True), ([0.0, 0.0, 0.0, 0.7, 0.0], False),
                        ([1e-6] * 5, False)):
        out = torch.full((5,), -7, dtype=torch.long)
        assert ops.argmax_rows_greedy(out, x, torch.tensor(temps)) is want
        assert torch.equal(out, x.float().argmax(-1))  # the argmax either way
    with pytest.raises(ValueError, match="temperatures"):
        ops.argmax_rows_greedy(out, x, torch.zeros(5, dtype=torch.float64))
    with pytest.raises(ValueError, match="temperatures"):
        ops.argmax_rows_greedy(out, x, torch.zeros(4))


def test_all_greedy_batch_does_no_full_vocabulary_float_work():
    logits = torch.randn(4, 1000).to(torch.bfloat16)
    with _FloatWork() as rec:
        out = Sampler()(logits, args(4, temp=0.0))
    assert torch.equal(out, logits.float().argmax(-1))
    assert max(rec.sizes, default=0) < 1000
    with _FloatWork() as rec:
        Sampler()(logits, args(4, temp=[0.0, 1.0, 0.0, 0.0]))
    assert max(rec.sizes) >= 4000  # a sampled row does go through float32 (the recorder works)


def test_seeded_draws_are_a_pure_function_of_seed_and_step():
    logits = torch.randn(3, 500)
    seeds, steps = torch.tensor([5, 5, 6]), torch.tensor([2, 2, 2], dtype=torch.int32)
    a = Sampler()(logits[[0, 0, 0]], args(3, temp=1.0, seeds=seeds, steps=steps))
    assert a[0] == a[1]
    b = Sampler()(logits[[0, 0, 0]], args(3, temp=1.0, seeds=seeds, steps=steps))
    assert torch.equal(a, b)


# ---- the logits pipeline ------------------------------------------------------------------------

from tpserve.workers.penalties import PenaltyState  # noqa: E402
from tpserve.workers.sampler import race, race_reference, unpack_bitmask  # noqa: E402


def i32(*v):
    return np.asarray(v, dtype=np.int32)


def f32(*v):
    return np.asarray(v, dtype=np.float32)


@pytest.mark.parametrize("vocab", [1, 7, 300, 32000])
def test_race_operator_draws_what_the_torch_reference_draws(vocab):
    assert cpu_extension.available()
    gen = torch.Generator().manual_seed(vocab)
    x = torch.randn(12, vocab, generator=gen) * 4
    x[3, : vocab // 2] = float("-inf")  # a top-k/top-p style mask
    x[4, 1:] = float("-inf")            # one token left
    seeds = torch.arange(12, dtype=torch.long) * 1_000_003
    steps = torch.arange(12, dtype=torch.long) % 3
    got = race(x, seeds, steps)
    assert torch.equal(got, race_reference(x, seeds, steps))
    assert int(got[4]) == 0


def test_race_samples_the_softmax_distribution():
    """Draws over many seeds follow softmax(x): a chi-square bound a wrong transform fails."""
    x = torch.tensor([[2.0, 1.0, 0.0, -1.0, float("-inf"), 0.5]])
    n = 20000
    seeds = torch.arange(n, dtype=torch.long)
    draws = race(x.expand(n, -1).contiguous(), seeds, torch.zeros(n, dtype=torch.long))
    counts = torch.bincount(draws, minlength=6).double()
    p = torch.softmax(x[0].double(), dim=0)
    assert counts[4] == 0
    keep = p > 0
    chi2 = (((counts - n * p) ** 2)[keep] / (n * p[keep])).sum().item()
    assert chi2 < 20.5  # p = 0.001 for 4 degrees of freedom is 18.5; a biased race is far beyond


def reference_penalties(x, prompt, output, rep, freq, pres):
    """vLLM's formulas, written out per token."""
    x = x.clone()
    for r in range(x.shape[0]):
        counts = np.bincount(output[r], minlength=x.shape[1]) if len(output[r]) else np.zeros(x.shape[1])
        seen = set(prompt[r]) | set(output[r])
        for t in range(x.shape[1]):
            if t in seen:
                x[r, t] = x[r, t] * (1.0 / rep[r]) if x[r, t] > 0 else x[r, t] * rep[r]
            x[r, t] -= freq[r] * counts[t] + pres[r] * (counts[t] > 0)
    return x


def test_penalties_follow_the_repetition_frequency_presence_formulas():
    torch.manual_seed(0)
    vocab = 40
    x = torch.randn(3, vocab)
    prompts = [[1, 2, 3, 3], [5], [7, 8]]
    outputs = [[3, 9, 9, 12], [], [8, 8, 8]]
    rep, freq, pres = f32(1.3, 0.7, 1.0), f32(0.5, 0.0, -0.4), f32(0.25, 1.0, 0.6)
    state = PenaltyState(vocab)
    slots = i32(5, 0, 2)  # any slot ids
    lens = [len(p) + len(o) for p, o in zip(prompts, outputs)]
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    state.start(slots, cu, i32(*map(len, prompts)), i32(*[t for p, o in zip(prompts, outputs) for t in p + o]))
    got = x.clone()
    state.apply(got, torch.tensor([0, 1, 2]), torch.from_numpy(slots), torch.from_numpy(rep),
                torch.from_numpy(freq), torch.from_numpy(pres))
    torch.testing.assert_close(got, reference_penalties(x, prompts, outputs, rep, freq, pres))
    # Counting a sampled token moves only that slot's row.
    state.count(torch.tensor([2]), torch.tensor([30]))
    assert int(state.output[2, 30]) == 1 and int(state.output[5, 30]) == 0


def test_bias_allowed_bans_and_bitmask_apply_before_greedy_and_dead_rows_get_minus_one():
    x = torch.zeros(5, 70)
    x[:, 10] = 5.0  # the greedy token everywhere
    words = -(-70 // 32)
    bitmask = np.zeros((1, words), dtype=np.int32)
    bitmask[0, 40 // 32] |= 1 << (40 % 32)
    bitmask[0, 41 // 32] |= 1 << (41 % 32)
    plan = args(5, temp=0.0, bias_rows=i32(0), bias_tokens=i32(3), bias_values=f32(7.5),
                allow_rows=i32(1, 4), allow_index=i32(0, 0, 1), allow_tokens=i32(20, 21, 10),
                ban_rows=i32(2, 4), ban_tokens=i32(10, 10),
                mask_rows=i32(3), bitmask=bitmask)
    x[1, 21] = 1.0
    x[3, 41] = 2.0
    out = Sampler()(x, plan)
    # row 0: bias makes 3 the best; row 1: only 20/21 allowed; row 2: 10 banned, first of the
    # zeros; row 3: only the bitmask's 40/41; row 4: its one allowed token banned -> -1.
    assert out.tolist() == [3, 21, 0, 41, -1]


def test_unpack_bitmask_reads_bit_t_of_word_t_over_32():
    words = np.array([[1 | (1 << 31), 1 << 2]], dtype=np.uint32).view(np.int32)  # bit 31: the sign
    allowed = unpack_bitmask(torch.from_numpy(words), 40)
    assert allowed[0].nonzero().flatten().tolist() == [0, 31, 34]


def test_min_p_keeps_tokens_within_the_ratio_of_the_best():
    x = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    n = 4000
    plan = args(n, min_p_rows=i32(*range(n)), min_ps=np.full(n, 0.35, np.float32))
    out = Sampler()(x.expand(n, -1).contiguous(), plan)
    # p >= 0.35 * 0.5 keeps tokens 0 and 1 only, in the ratio 5:3
    assert set(out.tolist()) == {0, 1}
    assert abs((out == 0).float().mean().item() - 0.625) < 0.03


def test_plain_path_is_unchanged_by_controls_that_leave_the_logits_alone():
    torch.manual_seed(3)
    x = torch.randn(8, 500)
    a = Sampler()(x, args(8, temp=0.9, k=50, p=0.8))
    b = Sampler()(x, args(8, temp=0.9, k=50, p=0.8, num_logprobs=3, prompt_targets=i32(1)))
    assert torch.equal(a, b)


@pytest.mark.parametrize("shape", [(5, 7), (4, 2500), (2, 1)])
def test_triton_race_kernel_draws_what_the_torch_reference_draws(shape):
    """The GPU's fused race, run by Triton's interpreter on CPU tensors."""
    from tpserve.kernels.sample_race import race_argmax
    gen = torch.Generator().manual_seed(shape[1])
    x = torch.randn(*shape, generator=gen) * 3
    if shape[1] > 10:
        x[1, : shape[1] // 2] = float("-inf")
    x[-1] = float("-inf") if shape[1] == 1 else x[-1]
    seeds = torch.arange(shape[0], dtype=torch.long) * 977
    steps = torch.arange(shape[0], dtype=torch.long) % 2
    assert torch.equal(race_argmax(x, seeds, steps), race_reference(x, seeds, steps))


def test_penalty_operators_equal_the_torch_expressions():
    """The seen-token pass (what a CPU step runs), the dense pass and the torch expressions give
    the same bits, after starts and counts that keep the seen lists current."""
    assert cpu_extension.available()
    gen = torch.Generator().manual_seed(5)
    rng = np.random.default_rng(5)
    vocab = 3001
    state = PenaltyState(vocab)
    assert state.seen is not None  # the CPU operators keep seen lists
    slots = i32(1, 5, 3, 0)
    prompts = [rng.integers(0, vocab, int(n)).tolist() for n in (40, 1, 300, 7)]
    outputs = [rng.integers(0, vocab, int(n)).tolist() for n in (12, 0, 50, 3)]
    lens = [len(p) + len(o) for p, o in zip(prompts, outputs)]
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    state.start(slots, cu, i32(*map(len, prompts)), i32(*[t for p, o in zip(prompts, outputs) for t in p + o]))
    # sampled tokens: new ones, repeats of the output, prompt tokens, one slot twice in a call
    more = torch.tensor([5, 5, 1, 3, 3, 3]), torch.tensor([prompts[1][0], 77, 77, 9, outputs[2][0], 9])
    state.count(*more)
    for s_, t in zip(*more):
        outputs[slots.tolist().index(int(s_))].append(int(t))
    for i, s_ in enumerate(slots.tolist()):
        listed = state.seen[s_, :int(state.seen_len[s_])].tolist()
        assert sorted(listed) == sorted(set(prompts[i]) | set(outputs[i]))  # each seen token once
        assert int(state.output[s_].sum()) == len(outputs[i])
    x = torch.randn(5, vocab, generator=gen) * 4
    rows, sl = torch.tensor([4, 0, 2, 1]), torch.from_numpy(slots.astype(np.int64))
    rep, freq = torch.tensor([1.3, 1.0, 0.5, 2.0]), torch.tensor([0.0, 0.7, -0.3, 0.2])
    pres = torch.tensor([0.4, 0.0, 1.1, -0.5])
    a, b, c = x.clone(), x.clone(), x.clone()
    state.apply(a, rows, sl, rep, freq, pres)
    state.apply_reference(b, rows, sl, rep, freq, pres)
    cpu_extension.ops().apply_penalties(c, rows, sl, state.output, state.prompt, rep, freq, pres)
    assert torch.equal(a, b) and torch.equal(a, c) and not torch.equal(a, x)
    expect = reference_penalties(x[rows], prompts, outputs, rep.numpy(), freq.numpy(), pres.numpy())
    torch.testing.assert_close(a[rows], expect)


@pytest.mark.parametrize("vocab", [5, 64, 70, 32768])
def test_bitmask_operator_masks_what_the_torch_reference_masks(vocab):
    from tpserve.workers import sampler as S
    assert cpu_extension.available()
    rng = np.random.default_rng(vocab)
    words = -(-vocab // 32)
    bitmask = rng.integers(-2**31, 2**31, size=(4, words), dtype=np.int64).astype(np.int32)
    bitmask[1] = 0                  # nothing allowed
    bitmask[2] = -1                 # everything allowed
    bitmask[3, ::2] = 0             # runs of 32 banned tokens
    x = torch.randn(6, vocab)
    rows = torch.tensor([5, 0, 3, 2])
    ref = x.clone()
    allowed = unpack_bitmask(torch.from_numpy(bitmask), vocab)
    ref[rows] = ref[rows].masked_fill(~allowed, float("-inf"))
    S.apply_token_bitmask(x, rows, torch.from_numpy(bitmask))
    assert torch.equal(x, ref)


@pytest.mark.parametrize("vocab", [3000, 40000])
def test_filtered_race_samples_what_the_masked_race_samples(vocab):
    """The C++ filtered_race (histogram of each row's distance below its max, survivors sorted and
    raced) draws the token race(apply_top_k_top_p(x / t)) draws, for peaked, flat and partly
    masked rows, top-k, top-p, both and neither, over many seeds."""
    from tpserve.workers.sampler import race
    assert cpu_extension.available()  # the operator, not torch's fallback, is under test
    gen = torch.Generator().manual_seed(vocab)
    rows = []
    for scale in (8.0, 3.0, 0.3, 0.02):  # 0.02: the nucleus lies past the histogram's last bin
        for k in (0, 1, 7, 300):
            for p in (1.0, 0.95, 0.6, 0.2):
                rows.append((scale, k, p))
    S = len(rows)
    x = torch.stack([torch.randn(vocab, generator=gen) * sc for sc, _, _ in rows])
    x[::5, : vocab // 3] = float("-inf")  # masked tokens (bans, a grammar's bitmask)
    ks = torch.tensor([k for _, k, _ in rows], dtype=torch.int32)
    ps = torch.tensor([p for _, _, p in rows])
    temps = torch.tensor([(0.5, 1.0, 1.3)[i % 3] for i in range(S)])
    ops = torch.ops.tpserve_cpu
    for step in range(6):
        seeds, steps = torch.arange(S) * 7919 + 1, torch.full((S,), step, dtype=torch.long)
        want = race(apply_top_k_top_p(x / temps[:, None], ks, ps), seeds, steps)
        got = torch.empty(S, dtype=torch.long)
        ops.filtered_race(got, x, temps, ks, ps, seeds, steps)
        assert torch.equal(got, want), (got != want).nonzero().squeeze(1).tolist()


def test_sampling_takes_the_filtered_race_and_refuses_what_it_cannot_sample(monkeypatch):
    import tpserve.workers.sampler as sm
    assert cpu_extension.available()
    x = torch.randn(4, 500) * 4
    calls = []
    real = sm._filtered_race_ops
    monkeypatch.setattr(sm, "_filtered_race_ops", lambda *a: calls.append(1) or real(*a))
    tokens = Sampler(500)(x, args(4, temp=[0.0, 0.8, 1.0, 0.7], k=[0, 5, 0, 0], p=[1.0, 1.0, 0.9, 1.0]))
    assert len(calls) == 1 and tokens[0] == x[0].argmax()
    with pytest.raises(ValueError, match="temps: expected > 0"):
        torch.ops.tpserve_cpu.filtered_race(torch.empty(1, dtype=torch.long), x[:1], torch.zeros(1),
                                            torch.zeros(1, dtype=torch.int32), torch.ones(1),
                                            torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long))


# ---- the one plan ----------------------------------------------------------------------------
def test_sample_plan_rows_broadcast_scalars_and_fix_the_dtypes():
    plan = SamplePlan.rows([0.5, 0.0, 1.0], top_ks=[3, -1, 0], top_ps=0.9, seeds=7, steps=[0, 1, 2],
                           num_logprobs=2)
    assert plan.num_samples == 3 and plan.num_logprobs == 2
    assert [plan.temperatures.dtype, plan.top_ks.dtype, plan.top_ps.dtype, plan.seeds.dtype,
            plan.steps.dtype] == [np.float32, np.int32, np.float32, np.int64, np.int32]
    assert plan.seeds.tolist() == [7, 7, 7] and plan.top_ks.tolist() == [3, -1, 0]
    plan.check(3, 10)
    with pytest.raises(AssertionError, match="temperatures"):
        plan.check(4, 10)  # per-row arrays of another length
    greedy = SamplePlan.greedy(2)
    assert greedy.temperatures.tolist() == [0.0, 0.0] and not greedy.processes_logits


def test_packed_rows_for_a_device_copy_unpack_to_the_plan():
    """The device path stages the per-row arrays in one buffer; run here on CPU tensors."""
    from tpserve.workers.sampler import pack_rows, unpack_rows
    plan = SamplePlan.rows([0.25, 0.0, 2.0], top_ks=[1, 0, 9], top_ps=[1.0, 0.5, 0.75],
                           seeds=[(1 << 40) + 3, -5, 0], steps=[4, 0, 9])
    buf = pack_rows(plan)
    assert buf.dtype == np.uint8 and buf.size == 3 * 24
    rows = unpack_rows(torch.from_numpy(buf), 3)
    for name in ("temperatures", "top_ks", "top_ps", "seeds", "steps"):
        assert rows[name].numpy().dtype == getattr(plan, name).dtype, name
        assert np.array_equal(rows[name].numpy(), getattr(plan, name)), name
    assert all(v.numel() == 0 for v in unpack_rows(torch.from_numpy(pack_rows(SamplePlan())), 0).values())


def test_read_only_row_arrays_are_read_in_place_without_a_warning():
    """A decode step over an unchanged running set passes the same read-only arrays again."""
    import warnings
    plan = args(4, temp=[0.0, 0.7, 0.0, 1.0], k=[0, 3, 0, 0])
    for name in ("temperatures", "top_ks", "top_ps", "seeds", "steps"):
        getattr(plan, name).flags.writeable = False
    x = torch.randn(4, 300)
    sampler = Sampler()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        first = sampler(x, plan)
        again = sampler(x, args(4, temp=[0.0, 0.7, 0.0, 1.0], k=[0, 3, 0, 0]))
        assert torch.equal(sampler(x, plan), first)
    assert torch.equal(first, again)
    assert sampler._rows["seeds"][0] is plan.seeds  # its tensor kept for the next step
    greedy = args(4, temp=0.0)
    greedy.temperatures.flags.writeable = False
    other = Sampler()
    assert torch.equal(other(x, greedy), x.argmax(-1))
    assert list(other._rows) == ["temperatures"]  # an all-greedy step reads nothing else


def test_off_the_cpu_the_per_row_arrays_go_in_one_copy_per_plan(monkeypatch):
    """The device branch, on the meta device (shapes and dtypes, no values)."""
    import tpserve.workers.sampler as sm
    packs = []
    real = sm.pack_rows
    monkeypatch.setattr(sm, "pack_rows", lambda plan: packs.append(plan) or real(plan))
    sampler = Sampler(device="meta")
    plan = args(3, temp=[0.5, 0.0, 1.0], k=[0, 2, 0])
    got = {name: sampler._row(plan, name) for name in ("temperatures", "top_ks", "top_ps", "seeds", "steps")}
    assert {n: (t.device.type, t.dtype, tuple(t.shape)) for n, t in got.items()} == {
        "temperatures": ("meta", torch.float32, (3,)), "top_ks": ("meta", torch.int32, (3,)),
        "top_ps": ("meta", torch.float32, (3,)), "seeds": ("meta", torch.int64, (3,)),
        "steps": ("meta", torch.int32, (3,))}
    assert packs == [plan]  # five arrays, one packed copy
    sampler._row(args(3), "seeds")
    assert len(packs) == 2  # the next step's plan is copied again
