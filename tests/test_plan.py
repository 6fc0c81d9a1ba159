import numpy as np
import pytest

from tpserve.plan import ARRAY_FIELDS, Command, StepPlan


def random_plan(rng, b=5, t=23, s=4, w=7) -> StepPlan:
    def ints(*shape, lo=-1, hi=1000):
        return rng.integers(lo, hi, size=shape).astype(np.int32)
    cu = np.zeros(b + 1, np.int32)
    cu[1:] = np.sort(rng.integers(0, t, size=b)).astype(np.int32)
    return StepPlan(is_prefill=True, has_context=True, max_seqlen_q=9, max_seqlen_k=40, step_id=77, num_decodes=2,
                    input_ids=ints(t), positions=ints(t), slot_mapping=ints(t), cu_seqlens_q=cu,
                    cu_seqlens_k=cu * 2, context_lens=ints(b), block_tables=ints(b, w),
                    logits_indices=ints(s), logprob_rows=ints(3))


def assert_same(a: StepPlan, b: StepPlan):
    for name in ARRAY_FIELDS:
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and x.shape == y.shape, name
        np.testing.assert_array_equal(x, y, err_msg=name)
    for name in ("cmd", "is_prefill", "has_context", "max_seqlen_q", "max_seqlen_k", "step_id",
                 "num_decodes", "args"):
        assert getattr(a, name) == getattr(b, name), name


def test_round_trip_all_fields():
    rng = np.random.default_rng(0)
    plan = random_plan(rng)
    plan.validate()
    back = StepPlan.from_bytes(plan.to_bytes())
    assert_same(plan, back)
    assert back.num_seqs == 5 and back.num_tokens == 23 and back.num_samples == 4
    assert back.num_decodes == 2 and StepPlan.from_bytes(StepPlan().to_bytes()).num_decodes == -1


def test_read_from_is_zero_copy_and_arrays_aligned():
    plan = random_plan(np.random.default_rng(1))
    buf = bytearray(plan.nbytes() + 100)
    n = plan.write_into(buf)
    assert n == plan.nbytes()
    back = StepPlan.read_from(memoryview(buf))
    assert back.input_ids.base is not None  # a view, not a copy
    buf_addr = np.frombuffer(buf, np.uint8).ctypes.data
    for name in ARRAY_FIELDS:
        arr = getattr(back, name)
        if arr.size:
            assert (arr.ctypes.data - buf_addr) % 8 == 0, name


def test_empty_and_command_plans():
    plan = StepPlan.command(Command.PROFILE_STOP, path="/tmp/x")
    back = StepPlan.from_bytes(plan.to_bytes())
    assert back.cmd == Command.PROFILE_STOP and back.args == {"path": "/tmp/x"}
    assert back.num_tokens == 0 and back.block_tables.shape == (0, 0)


def test_too_small_buffer_and_bad_magic():
    plan = random_plan(np.random.default_rng(2))
    with pytest.raises(ValueError, match="too small"):
        plan.write_into(bytearray(10))
    with pytest.raises(ValueError, match="not a StepPlan"):
        StepPlan.from_bytes(b"\0" * 64)


def test_validate_names_the_field():
    plan = random_plan(np.random.default_rng(3))
    plan.positions = plan.positions[:-1]
    with pytest.raises(ValueError, match="positions"):
        plan.validate()
    plan = random_plan(np.random.default_rng(3))
    plan.logits_indices = plan.logits_indices.astype(np.int64)
    with pytest.raises(ValueError, match="logits_indices"):
        plan.validate()
