"""Engine step loop with mixed steps: prompts arrive between steps while others decode, and
greedy output still equals transformers' (fp32), under both scheduling policies."""
import pytest

from model_factory import make_tiny_model, tiny_models_root  # noqa: F401
from test_llm import GREEDY, PROMPTS, hf_greedy
from tpserve import SamplingParams
from tpserve.config import EngineConfig
from tpserve.engine import Engine


def count_steps(engine: Engine) -> dict:
    """Wrap the scheduler's schedule() to count pure-decode, prefill and mixed steps."""
    counts = {"decode": 0, "prefill": 0, "mixed": 0}
    schedule = engine.scheduler.schedule

    def counted():
        batch = schedule()
        if batch:
            nd = batch.num_decodes
            counts["decode" if nd == len(batch) else "mixed" if nd else "prefill"] += 1
        return batch

    engine.scheduler.schedule = counted
    return counts


@pytest.mark.parametrize("arch,policy,tp", [("qwen3", "mixed", 1), ("qwen3", "prefill-first", 1),
                                            ("llama", "mixed", 1), ("llama", "prefill-first", 1),
                                            ("qwen3", "mixed", 2)])
def test_arrivals_between_steps_keep_greedy_output(tiny_models_root, arch, policy, tp):  # noqa: F811
    """(With tp=2 the mixed plans also travel through the plan channel to a worker rank.)"""
    path = make_tiny_model(tiny_models_root, arch=arch)
    ref = hf_greedy(path, PROMPTS)
    # (arrival step, prompt index): the 41-token prompt arrives while two streams decode and
    # is prefilled in chunks of what the decodes leave of the 16-token budget.
    arrivals = [(0, 0), (0, 2), (2, 1), (3, 3), (5, 4)]
    config = EngineConfig(model=str(path), dtype="float32", num_kv_blocks=64, block_size=4,
                          max_num_batched_tokens=16, scheduling_policy=policy,
                          tensor_parallel_size=tp)
    got: dict[str, list[int]] = {}
    with Engine(config) as engine:
        counts = count_steps(engine)
        step = 0
        while step < 200 and (arrivals or engine.has_unfinished()):
            while arrivals and arrivals[0][0] <= step:
                _, i = arrivals.pop(0)
                engine.add_request(f"p{i}", PROMPTS[i], GREEDY)
                got[f"p{i}"] = []
            for out in engine.step():
                got[out.request_id] += out.new_token_ids
            step += 1
        assert not engine.has_unfinished()
        assert engine.stats()["kv_blocks_used"] == 0
    assert [got[f"p{i}"] for i in range(len(PROMPTS))] == ref
    if policy == "mixed":
        assert counts["mixed"] >= 3, counts
    else:
        assert counts["mixed"] == 0 and counts["prefill"] >= 3, counts


def test_mixed_steps_with_preemption_keep_greedy_output(tiny_models_root):  # noqa: F811
    path = make_tiny_model(tiny_models_root, arch="qwen3")
    ref = hf_greedy(path, PROMPTS)
    # A pool of 20 blocks of 4 cannot hold every sequence at once: decodes preempt others.
    config = EngineConfig(model=str(path), dtype="float32", num_kv_blocks=20, block_size=4,
                          max_num_batched_tokens=12, scheduling_policy="mixed")
    got = {}
    with Engine(config) as engine:
        counts = count_steps(engine)
        for i, p in enumerate(PROMPTS):
            engine.add_request(f"p{i}", p, SamplingParams(temperature=0.0, max_tokens=10,
                                                          ignore_eos=True))
            got[f"p{i}"] = []
            for out in engine.step():
                got[out.request_id] += out.new_token_ids
        while engine.has_unfinished():
            for out in engine.step():
                got[out.request_id] += out.new_token_ids
        assert engine.stats()["num_preemptions"] > 0
    assert [got[f"p{i}"] for i in range(len(PROMPTS))] == ref
    assert counts["mixed"] > 0


def test_decode_cuda_graphs_refuse_mixed_plans():
    """Graphs are captured for pure-decode shapes only; a mixed step runs eagerly."""
    from types import SimpleNamespace

    import numpy as np
    import torch

    from tpserve.scheduler import Scheduler, Sequence
    from tpserve.workers.cuda_graph import DecodeGraphs
    s = Scheduler(EngineConfig(block_size=16, num_kv_blocks=32, max_num_batched_tokens=8,
                               max_model_len=128, scheduling_policy="mixed"))
    s.add(Sequence("a", [1, 2, 3], SamplingParams(max_tokens=8)))
    s.postprocess(s.schedule(), np.array([4]))
    batch = s.schedule()
    decode = s.build_plan(batch)
    s.postprocess(batch, np.array([5]))
    s.add(Sequence("b", list(range(5, 25)), SamplingParams(max_tokens=8)))
    mixed = s.build_plan(s.schedule())
    assert not decode.is_prefill and mixed.is_prefill and mixed.num_seqs == 2
    graphs = DecodeGraphs(None, SimpleNamespace(device=torch.device("cpu")),
                          SimpleNamespace(block_size=16, max_model_len=128),
                          max_batch=8)                   # nothing captured: can_run only
    assert graphs.can_run(decode) and not graphs.can_run(mixed)
