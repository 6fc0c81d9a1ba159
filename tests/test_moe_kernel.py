"""The grouped-expert kernel of mixture-of-experts layers on CPU (``moe_kernel.py``,
``csrc/moe_ops.cpp``): every weight kind against a plain float64 reference, experts with no,
one and many tokens, k=1 and k=8, tokens routed to experts held on another rank; bit-equality
with the packed linear layers it is made of; the router; the typed errors. The AVX2 build runs
the same checks (``test_an_avx2_build_runs_the_experts``)."""
from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from tpserve.kernels import cpu_extension
from tpserve.models import moe_kernel, packed_gemm
from tpserve.models.packed_gemm import BFLOAT16, FLOAT32, INT8, INT8_DYNAMIC

H, I = 64, 48  # hidden, one expert's intermediate size (a partial panel of gate/up outputs)

# (name, activation dtype, the experts as stored, int8_activations, quantize_at_load)
KINDS = (("fp32", torch.float32, torch.float32, False, False),
         ("bf16", torch.bfloat16, torch.bfloat16, False, False),
         ("int8-quantized-at-load", torch.bfloat16, torch.bfloat16, True, True),
         ("int8-checkpoint-w8a16", torch.float32, torch.int8, False, False),
         ("int8-checkpoint-w8a8", torch.bfloat16, torch.int8, True, False))


def fake_experts(num_local: int, dtype: torch.dtype, stored: torch.dtype, int8_acts: bool,
                 quantize: bool, num_experts: int | None = None, expert_start: int = 0, seed: int = 0):
    """The attributes pack_experts reads of a FusedMoE (moe.py), with random weights."""
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(num_local, 2 * I, H, generator=g) / 6
    w2 = torch.randn(num_local, H, I, generator=g) / 6
    s13 = s2 = None
    if stored == torch.int8:
        q13, s13 = packed_gemm.quantize_int8(w13.reshape(-1, H))
        q2, s2 = packed_gemm.quantize_int8(w2.reshape(-1, I))
        w13, w2 = q13.view(w13.shape), q2.view(w2.shape)
        s13, s2 = s13.view(num_local, 2 * I), s2.view(num_local, H)
    else:
        w13, w2 = w13.to(stored), w2.to(stored)
    return SimpleNamespace(w13_weight=w13, w2_weight=w2, w13_weight_scale=s13, w2_weight_scale=s2,
                           num_experts=num_experts or num_local, expert_start=expert_start,
                           num_local_experts=num_local, int8_activations=int8_acts,
                           quantize_at_load=quantize)


def dense_weights(m) -> tuple[torch.Tensor, torch.Tensor]:
    """The experts' weights as the kernel multiplies them (quantized ones dequantized), fp64."""
    w13, w2 = m.w13_weight, m.w2_weight
    if m.quantize_at_load:
        q13, s13 = packed_gemm.quantize_int8(w13.reshape(-1, H))
        q2, s2 = packed_gemm.quantize_int8(w2.reshape(-1, I))
        return ((q13.double() * s13.double()[:, None]).view(w13.shape),
                (q2.double() * s2.double()[:, None]).view(w2.shape))
    if w13.dtype == torch.int8:
        return (w13.double() * m.w13_weight_scale.double()[..., None],
                w2.double() * m.w2_weight_scale.double()[..., None])
    return w13.double(), w2.double()


def _quantized_rows(x: torch.Tensor) -> torch.Tensor:
    s = x.abs().amax(1).clamp(min=1e-30) / 127
    return torch.round(x / s[:, None]).clamp(-127, 127) * s[:, None]


def reference(x, ids, weights, m) -> torch.Tensor:
    """Plain float64: each token's sum over its choices held here of weight * expert(x)."""
    w13, w2 = dense_weights(m)
    start, num_local = m.expert_start, m.w13_weight.shape[0]
    out = torch.zeros(x.shape, dtype=torch.float64)
    xd = _quantized_rows(x.double()) if m.int8_activations else x.double()
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j]) - start
            if 0 <= e < num_local:
                gu = w13[e] @ xd[t]
                h = (F.silu(gu[:I]) * gu[I:])[None]
                h = _quantized_rows(h) if m.int8_activations else h
                out[t] += float(weights[t, j]) * (w2[e] @ h[0])
    return out


def routing(T: int, k: int, num_experts: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Choices of T tokens: expert 0 picked by every token (every other one when k=1; more rows
    than a row block of the kernel), expert 1 by token 0 only, expert 2 by nobody, the rest at
    random."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.empty(T, k, dtype=torch.int64)
    others = [e for e in range(num_experts) if e not in (0, 1, 2)]
    for t in range(T):
        perm = torch.randperm(len(others), generator=g)[:k].tolist()
        row = [others[i] for i in perm]
        if k > 1 or t % 2 == 0:
            row[0] = 0
        if t == 0 and k > 1:
            row[1] = 1
        ids[t] = torch.tensor(row)
    return ids, torch.rand(T, k, generator=g) + 0.1


TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def check_moe_kinds() -> None:
    """Every kind against ``reference`` (also run on an AVX2 build of the operators)."""
    for name, dtype, stored, int8_acts, quantize in KINDS:
        for T, k, num_local, start, num_experts in ((70, 8, 12, 0, 12), (3, 1, 6, 0, 6), (9, 2, 5, 4, 16)):
            m = fake_experts(num_local, dtype, stored, int8_acts, quantize, num_experts, start)
            packed = moe_kernel.pack_experts(m)
            assert packed is not None, name
            ids, weights = routing(T, k, num_experts, seed=T)
            x = torch.randn(T, H).to(dtype)
            out = packed.forward(x, ids, weights)
            assert out.dtype == dtype and out.shape == (T, H)
            ref = reference(x, ids, weights, m)
            tol = 3e-2 if int8_acts else TOL[dtype]  # int8 activations: a rounding flip is 1/127
            err = ((out.double() - ref).abs().max() / ref.abs().max()).item()
            assert err < tol, (name, T, k, start, err)
            here = ((ids >= start) & (ids < start + num_local)).any(1)
            assert torch.equal(out[~here], torch.zeros_like(out[~here]))  # nothing held here


# The C++ operators are under test: `make test` builds them, so their absence is a failure.
assert cpu_extension.available(), cpu_extension._state.get("error")


def test_every_kind_computes_the_experts():
    check_moe_kinds()


def test_the_expected_kind_is_packed():
    want = {"fp32": FLOAT32, "bf16": BFLOAT16, "int8-quantized-at-load": INT8_DYNAMIC,
            "int8-checkpoint-w8a16": INT8, "int8-checkpoint-w8a8": INT8_DYNAMIC}
    for name, dtype, stored, int8_acts, quantize in KINDS:
        packed = moe_kernel.pack_experts(fake_experts(3, dtype, stored, int8_acts, quantize))
        assert packed.kind == want[name] and packed.w2.kind == want[name]
        assert packed.w13.data.shape[0] == 3 and packed.num_local == 3


@pytest.mark.parametrize("name", [k[0] for k in KINDS])
def test_a_token_gets_the_bits_of_the_packed_linear_layers(name):
    """k=1 with weight 1: a token's result is its expert's down(silu_and_mul(gate_up(x))) through
    the packed linear layers bit for bit, whatever the other tokens of the call."""
    _, dtype, stored, int8_acts, quantize = next(k for k in KINDS if k[0] == name)
    m = fake_experts(4, dtype, stored, int8_acts, quantize, seed=5)
    packed = moe_kernel.pack_experts(m)
    kind = packed.kind
    layers = []
    for e in range(4):
        w13, w2 = m.w13_weight[e], m.w2_weight[e]
        if quantize:
            (q13, s13), (q2, s2) = packed_gemm.quantize_int8(w13), packed_gemm.quantize_int8(w2)
            layers.append((packed_gemm.pack_weight(q13, kind, s13), packed_gemm.pack_weight(q2, kind, s2)))
        elif stored == torch.int8:
            layers.append((packed_gemm.pack_weight(w13, kind, m.w13_weight_scale[e]),
                           packed_gemm.pack_weight(w2, kind, m.w2_weight_scale[e])))
        else:
            layers.append((packed_gemm.pack_weight(w13, kind), packed_gemm.pack_weight(w2, kind)))
    T = 67
    x = torch.randn(T, H).to(dtype)
    ids = torch.randint(0, 4, (T, 1))
    ids[:5] = 3  # one expert with several rows, others with many
    out = packed.forward(x, ids, torch.ones(T, 1))
    ops = cpu_extension.ops()
    for t in (0, 4, 30, 66):
        gu13, down = layers[int(ids[t, 0])]
        gu = gu13.matmul(x[t:t + 1], None)
        act = torch.empty(1, I, dtype=dtype)
        ops.silu_and_mul(act, gu)
        assert torch.equal(out[t:t + 1], down.matmul(act, None)), t
    assert torch.equal(packed.forward(x[30:31], ids[30:31], torch.ones(1, 1)), out[30:31])


def test_shared_expert_joins_the_sum():
    m = fake_experts(6, torch.float32, torch.float32, False, False, seed=2)
    packed = moe_kernel.pack_experts(m)
    x = torch.randn(6, H)
    ids, weights = routing(6, 2, 6, seed=1)
    shared, gate = torch.randn(6, H), torch.randn(6, 1)
    out = packed.forward(x, ids, weights, shared, gate)
    want = reference(x, ids, weights, m) + torch.sigmoid(gate.double()) * shared.double()
    assert (out.double() - want).abs().max().item() < 1e-5
    ungated = packed.forward(x, ids, weights, shared)
    assert (ungated.double() - reference(x, ids, weights, m) - shared.double()).abs().max().item() < 1e-5


def test_no_token_held_here_and_no_tokens():
    m = fake_experts(2, torch.bfloat16, torch.bfloat16, False, False, num_experts=8, expert_start=6)
    packed = moe_kernel.pack_experts(m)
    x = torch.randn(3, H).to(torch.bfloat16)
    out = packed.forward(x, torch.tensor([[0, 5], [1, 2], [3, 4]]), torch.rand(3, 2))
    assert torch.equal(out, torch.zeros_like(out))
    empty = packed.forward(x[:0], torch.empty(0, 2, dtype=torch.int64), torch.empty(0, 2))
    assert empty.shape == (0, H)


def test_bad_inputs_are_typed_errors_naming_the_field():
    packed = moe_kernel.pack_experts(fake_experts(4, torch.float32, torch.float32, False, False,
                                                  num_experts=8))
    x, ids, w = torch.randn(2, H), torch.tensor([[0, 1], [2, 3]]), torch.rand(2, 2)
    with pytest.raises(ValueError, match="x:"):
        packed.forward(torch.randn(2, H + 1), ids, w)
    with pytest.raises(ValueError, match="x: experts packed as torch.float32"):
        packed.forward(x.bfloat16(), ids, w)
    with pytest.raises(ValueError, match="topk_ids"):
        packed.forward(x, ids.int(), w)
    with pytest.raises(ValueError, match="topk_weights"):
        packed.forward(x, ids, w.double())
    with pytest.raises(IndexError, match="topk_ids: expert id 8"):
        packed.forward(x, torch.tensor([[0, 8], [1, 2]]), w)
    with pytest.raises(ValueError, match="shared"):
        packed.forward(x, ids, w, torch.randn(3, H))
    m = fake_experts(2, torch.float32, torch.int8, False, False)
    m.w2_weight_scale = None
    with pytest.raises(ValueError, match="w2_weight_scale"):
        moe_kernel.pack_experts(m)


def test_what_cannot_be_packed_is_left_to_the_torch_path(monkeypatch):
    assert moe_kernel.pack_experts(fake_experts(2, torch.float16, torch.float16, False, False)) is None
    odd = fake_experts(2, torch.bfloat16, torch.bfloat16, False, False)
    odd.w2_weight = odd.w2_weight[..., :I - 1]  # I odd: no bf16 pairs
    odd.w13_weight = odd.w13_weight[:, :2 * (I - 1)]
    assert moe_kernel.pack_experts(odd) is None
    monkeypatch.setenv("TPSERVE_PREPACK", "0")
    assert not moe_kernel.ops_ready()
    assert moe_kernel.pack_experts(fake_experts(2, torch.float32, torch.float32, False, False)) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("renormalize", [False, True])
def test_route_is_softmax_top_k(dtype, renormalize):
    torch.manual_seed(3)
    perms = torch.stack([torch.randperm(16) for _ in range(33)])
    logits = (perms.float() * 0.37 - 3).to(dtype)  # no ties, in bf16 too
    weights, ids = moe_kernel.route(logits, 4, renormalize)
    probs = torch.softmax(logits.double(), -1)
    want_w, want_ids = torch.topk(probs, 4, -1)
    if renormalize:
        want_w = want_w / want_w.sum(-1, keepdim=True)
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32
    assert torch.equal(ids, want_ids)
    assert (weights.double() - want_w).abs().max().item() < 1e-6
    rounded, _ = moe_kernel.route(logits, 4, renormalize, round_weights=True)
    assert torch.equal(rounded, weights.to(dtype).float())
    with pytest.raises(ValueError, match="top_k"):
        moe_kernel.route(logits, 17, renormalize)


def test_route_breaks_ties_to_the_lower_id():
    weights, ids = moe_kernel.route(torch.zeros(2, 8), 3, True)
    assert ids.tolist() == [[0, 1, 2]] * 2
    assert torch.allclose(weights, torch.full((2, 3), 1 / 3))



def test_route_of_nan_logits_still_names_experts():
    logits = torch.zeros(2, 8)
    logits[0, 3] = float("nan")  # a broken model's row: no crash, ids within range
    _, ids = moe_kernel.route(logits, 2, False)
    assert ((ids >= 0) & (ids < 8)).all() and ids[1].tolist() == [0, 1]


AVX2_CHECK = r"""
import sys
from tpserve.kernels import cpu_extension
assert cpu_extension.available(), cpu_extension._state.get("error")
sys.path.insert(0, TESTS_DIR)
from MODULE import FUNCTION
FUNCTION()
print("ok")
"""


def run_on_an_avx2_build(module: str, function: str) -> None:
    """``module.function()`` in a process whose operators are built for an AVX2-only CPU (runs on
    any x86-64 CPU; the build is the one test_kernels_cpu's AVX2 test uses)."""
    env = dict(os.environ, TPSERVE_CPU_ARCH="haswell")
    check = (AVX2_CHECK.replace("TESTS_DIR", repr(os.path.dirname(os.path.abspath(__file__))))
             .replace("MODULE", module).replace("FUNCTION", function))
    proc = subprocess.run([sys.executable, "-c", check], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


def test_an_avx2_build_runs_the_experts():
    """The experts on the operators built for an AVX2-only CPU (8-float vectors, the AVX2 int8
    path), against the reference."""
    run_on_an_avx2_build("test_moe_kernel", "check_moe_kinds")


def test_prepack_model_packs_the_experts_in_pages_of_their_own():
    from torch import nn

    from tpserve.models.linear import ColumnParallelLinear
    from tpserve.models.moe import FusedMoE, experts_reference
    from tpserve.models.parallel import TPContext
    torch.manual_seed(4)
    model = nn.Module()
    model.experts = FusedMoE(6, 2, H, I, TPContext())
    model.proj = ColumnParallelLinear(H, 32, TPContext())
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape) / 6)
    x = torch.randn(5, H)
    ids, weights = routing(5, 2, 6, seed=9)
    want = experts_reference(x, ids, weights, model.experts.w13_weight.detach().clone(),
                             model.experts.w2_weight.detach().clone())
    assert packed_gemm.prepack_model(model) == 2  # the linear layer and one set of experts
    packed = model.experts.packed
    assert packed is not None and model.experts.w13_weight.numel() == 0  # the dense copy freed
    assert model.proj.packed is not None
    # not gathered into the linear layers' arena: each projection in a 2 MB-aligned buffer
    assert packed.w13.data.data_ptr() % (2 << 20) == 0 and packed.w2.data.data_ptr() % (2 << 20) == 0
    assert (model.experts(x, ids, weights) - want).abs().max().item() < 1e-5
