"""Engine boundary: requests are checked in one place, and a failed step costs only its requests."""
import pytest

from model_factory import make_tiny_model, tiny_models_root  # noqa: F401
from tpserve import limits as R
from tpserve.config import EngineConfig
from tpserve.engine import Engine
from tpserve.errors import InvalidFieldError, InvalidRequestError, StepFailedError
from tpserve.sampling import SamplingParams


@pytest.fixture(scope="module")
def engine(tiny_models_root):  # noqa: F811
    path = make_tiny_model(tiny_models_root, arch="qwen3")
    with Engine(EngineConfig(model=str(path), dtype="float32", num_kv_blocks=32, block_size=16)) as e:
        yield e


def run(engine, limit=200):
    outs = {}
    for _ in range(limit):
        if not engine.has_unfinished():
            break
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o
    return outs


def idle(engine):
    stats = engine.stats()
    engine.scheduler.block_manager.check_integrity()
    return stats["kv_blocks_used"] == 0 and stats["num_running"] == 0 and not engine.requests


@pytest.mark.parametrize("kwargs,field", [
    (dict(top_k=2**31), "top_k"),
    (dict(top_k=2**63), "top_k"),
    (dict(stop_token_ids=[2**31]), "stop_token_ids[0]"),
    (dict(stop_token_ids=[1, -1]), "stop_token_ids[1]"),
    (dict(max_tokens=2**31), "max_tokens"),
    (dict(seed=2**63), "seed"),
    (dict(temperature=float("inf")), "temperature"),
    (dict(stop=["s"] * (R.MAX_STOP_STRINGS + 1)), "stop"),
])
def test_sampling_params_bound_every_numeric_field(kwargs, field):
    with pytest.raises(InvalidFieldError) as e:
        SamplingParams(**kwargs)
    assert e.value.field == field


def test_the_largest_valid_values_run_a_step(engine):
    params = SamplingParams(top_k=R.MAX_TOP_K, seed=R.MAX_SEED, max_tokens=2,
                            stop_token_ids=[engine.vocab_size - 1], ignore_eos=True)
    engine.add_request("edge", [1, 2, 3], params)
    assert run(engine)["edge"].num_completion_tokens >= 1
    assert idle(engine)


@pytest.mark.parametrize("prompt,params,field", [
    ([1, 10**6], SamplingParams(), "prompt[1]"),
    ([1], SamplingParams(stop_token_ids=[10**6]), "params.stop_token_ids[0]"),
    ([], SamplingParams(), "prompt"),
    ("x" * (R.MAX_PROMPT_CHARS + 1), SamplingParams(), "prompt"),
])
def test_requests_outside_the_model_are_refused_before_queueing(engine, prompt, params, field):
    with pytest.raises(InvalidFieldError) as e:
        engine.add_request("bad", prompt, params)
    assert e.value.field == field
    assert "bad" not in engine.requests and engine.scheduler.get("bad") is None


def test_a_request_id_in_use_is_an_invalid_request(engine):
    engine.add_request("dup", [1, 2], SamplingParams(max_tokens=1))
    with pytest.raises(InvalidRequestError, match="already in use"):
        engine.add_request("dup", [3], SamplingParams(max_tokens=1))
    run(engine)
    assert idle(engine)


@pytest.mark.parametrize("stage", ["build_plan", "execute"])
def test_a_failing_step_aborts_only_its_requests(engine, monkeypatch, stage):
    owner = engine.scheduler if stage == "build_plan" else engine.executor
    real = getattr(owner, stage)
    calls = []

    def fail_once(*args):
        calls.append(1)
        if len(calls) == 1:
            raise OverflowError("Python int too large to convert to C int")
        return real(*args)
    monkeypatch.setattr(owner, stage, fail_once)
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    engine.add_request("victim", [5, 6, 7], greedy)
    with pytest.raises(StepFailedError) as e:
        engine.step()
    assert e.value.request_ids == ["victim"] and isinstance(e.value.__cause__, OverflowError)
    assert idle(engine)  # its blocks are free; the engine is usable
    engine.add_request("next", [5, 6, 7], greedy)
    assert run(engine)["next"].num_completion_tokens == 4
    assert idle(engine)


def test_profile_writes_a_trace_per_rank(engine, tmp_path):
    engine.start_profile()
    engine.add_request("p", [1, 2, 3], SamplingParams(max_tokens=2))
    run(engine)
    files = engine.stop_profile(str(tmp_path / "trace"))
    assert files == [str(tmp_path / "trace.rank0.json")]
    assert (tmp_path / "trace.rank0.json").stat().st_size > 0
    assert idle(engine)



def test_the_idle_check_finds_state_left_behind(engine):
    engine.add_request("r", [1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True))
    engine.check_integrity()  # busy: consistent, with blocks in use
    run(engine)
    engine.check_integrity()
    engine.requests["ghost"] = None
    try:
        with pytest.raises(AssertionError, match="ghost"):
            engine.check_integrity()
    finally:
        del engine.requests["ghost"]
    bm = engine.scheduler.block_manager
    block_id = bm._allocate_block()  # held by no sequence
    try:
        with pytest.raises(AssertionError):
            engine.check_integrity()
    finally:
        bm.blocks[block_id].ref_count = 0
        bm._deallocate_block(block_id)
    engine.check_integrity()


def test_long_token_id_prompts_are_checked_without_a_python_loop(monkeypatch):
    """A prompt of 300k token ids is checked on the serving loop: per-id Python checks would
    hold it (and the GIL) for most of a second."""
    calls = []
    real = R.is_int
    monkeypatch.setattr(R, "is_int", lambda v: calls.append(v) or real(v))
    ids = [i % 1000 for i in range(300_000)]
    assert R.check_token_ids("prompt", ids, R.MAX_PROMPT_TOKENS, 1, vocab_size=1000) == ids
    assert len(calls) == 0
    for bad in (-1, 1000, True, 2.0, 2**70):
        wrong = ids[:123_456] + [bad] + ids[123_456:]
        with pytest.raises(InvalidFieldError, match=f"got {bad!r}$") as e:
            R.check_token_ids("prompt", wrong, R.MAX_PROMPT_TOKENS, 1, vocab_size=1000)
        assert e.value.field == "prompt[123456]"
        if bad in (-1, 1000):  # an int out of range is found by the vector pass too
            assert len(calls) == 0
    assert R.check_token_ids("prompt", ids[:10], 16, 1) == ids[:10]
    # The message says which range: the vocabulary's, or int32's where the vocabulary is unknown.
    with pytest.raises(InvalidFieldError, match=r"must be a token id of the vocabulary in \[0, 999\]"):
        R.check_token_ids("prompt", [1000], 16, 1, vocab_size=1000)
    with pytest.raises(InvalidFieldError, match=r"must be a token id in \[0, 2147483647\], got 2147483648$"):
        R.check_token_ids("stop_token_ids", [2**31], 16)


def test_packed_token_ids_are_checked_as_a_list_is():
    """The ids of a long text come from the tokenizer process packed (array "i"): the same
    checks in one vector pass, and the same list out."""
    import array
    ids = [i % 1000 for i in range(300_000)]
    assert R.check_token_ids("prompt", array.array("i", ids), R.MAX_PROMPT_TOKENS, 1, vocab_size=1000) == ids
    for bad in (-1, 1000):
        wrong = array.array("i", ids[:5] + [bad] + ids[5:])
        with pytest.raises(InvalidFieldError, match=f"got {bad}$") as e:
            R.check_token_ids("prompt", wrong, R.MAX_PROMPT_TOKENS, 1, vocab_size=1000)
        assert e.value.field == "prompt[5]"
    with pytest.raises(InvalidFieldError, match="length"):
        R.check_token_ids("prompt", array.array("i"), R.MAX_PROMPT_TOKENS, 1)
    with pytest.raises(InvalidFieldError, match="array of token ids"):
        R.check_token_ids("prompt", array.array("d", [1.0]), R.MAX_PROMPT_TOKENS, 1)
    assert R.check_request(array.array("i", [1, 2]), None, 1000) == [1, 2]


def test_lent_cores_leave_the_intra_op_pool_and_come_back(engine):
    """While cores are lent (the daemon's tokenizer works) the CPU rank runs on fewer threads,
    one at least, and steps as before; lending 0 gives it its share back."""
    import torch

    def tokens(rid):
        engine.add_request(rid, [1, 2, 3], SamplingParams(max_tokens=4, temperature=0.0))
        out = []
        while engine.has_unfinished():
            out += [t for o in engine.step() for t in o.new_token_ids]
        return out
    own = torch.get_num_threads()
    before = tokens("before")
    try:
        engine.lend_cores(1)
        assert torch.get_num_threads() == max(1, own - 1)
        engine.lend_cores(own + 5)
        assert torch.get_num_threads() == 1
        assert tokens("lent") == before and len(before) == 4
    finally:
        engine.lend_cores(0)
    assert torch.get_num_threads() == own
