"""The offline API returns vLLM's output shapes, as vLLM documents them.

vLLM's ``LLM.generate`` returns ``list[RequestOutput]`` (``vllm.outputs``): ``request_id``,
``prompt``, ``prompt_token_ids``, ``prompt_logprobs``, ``outputs: list[CompletionOutput]``,
``finished``. A CompletionOutput has ``index``, ``text``, ``token_ids``,
``cumulative_logprob`` (None unless logprobs were requested), ``logprobs``,
``finish_reason`` and ``stop_reason`` ("the stop string or token id that caused the
completion to stop, None if the completion finished for some other reason including
encountering the EOS token"). ``SamplingParams.logprobs`` = k: "the log probabilities of the
specified number of most likely tokens, as well as the chosen tokens", as
``SampleLogprobs = list[dict[int, Logprob]]``; ``prompt_logprobs`` = k: the same per prompt
token, ``PromptLogprobs = list[dict[int, Logprob] | None]`` whose first entry is None.
``Logprob(logprob, rank, decoded_token)`` (``vllm.logprobs``): rank is the token's vocab rank,
>= 1; decoded_token its text decoded alone.

Each test below reads the outputs the way vLLM code reads them, and checks the values against
transformers on the same tiny checkpoint (fp32).
"""
from __future__ import annotations

import dataclasses
import math
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from model_factory import make_tiny_model, tiny_models_root  # noqa: F401
import tpserve
from tpserve import LLM, SamplingParams
from tpserve.outputs import Logprob, TokenLogprobs, to_logprob_dict

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]
K = 3


@pytest.fixture(scope="module")
def setup(tiny_models_root):  # noqa: F811
    path = make_tiny_model(tiny_models_root, arch="qwen3")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with LLM(str(path), dtype="float32", num_kv_blocks=128, block_size=4) as llm:
        yield hf, llm


def ref_logprobs(hf, ids: list[int]) -> torch.Tensor:
    """log_softmax of transformers' logits: row i is the distribution of token i + 1."""
    with torch.inference_mode():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)


def vocab_rank(row: torch.Tensor, token: int) -> int:
    """1 + the tokens more likely than ``token`` (no exact ties in random fp32 logits)."""
    return int((row > row[token]).sum()) + 1


def chosen_sum(c) -> float:
    """The sum of the chosen tokens' logprobs, read from vLLM's per-position dicts."""
    return sum(d[t].logprob for t, d in zip(c.token_ids, c.logprobs))


def check_position(d: dict, token: int, row: torch.Tensor, k: int, decode) -> None:
    """One position's dict: the top k by rank 1..k and the chosen token, values as transformers."""
    assert isinstance(d, dict) and all(isinstance(t, int) and isinstance(e, Logprob) for t, e in d.items())
    assert token in d
    top = row.topk(k).indices.tolist()
    assert [t for t in d if d[t].rank <= k] == [t for t in d if t in top]
    assert sorted((e.rank, t) for t, e in d.items() if e.rank <= k) == list(enumerate(top, 1))
    assert len(d) == (k if token in top else k + 1)
    for t, e in d.items():
        assert math.isclose(e.logprob, float(row[t]), abs_tol=2e-4)
        assert e.decoded_token == decode([t])
    assert d[token].rank == vocab_rank(row, token)


def test_the_documented_vllm_reading_works(setup):
    """The reading that raised ``TypeError: 'TokenLogprobs' object is not subscriptable``."""
    _, llm = setup
    outputs = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=2),
                           use_tqdm=False)
    out = outputs[0].outputs[0]
    for i, token_id in enumerate(out.token_ids):
        assert outputs[0].outputs[0].logprobs[i][token_id].logprob <= 0.0
    assert type(outputs[0]).__name__ == "RequestOutput" and type(out).__name__ == "CompletionOutput"
    assert isinstance(outputs[0], tpserve.RequestOutput) and isinstance(out, tpserve.CompletionOutput)


def test_greedy_logprobs_k(setup):
    hf, llm = setup
    tok = llm.tokenizer
    res = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=K),
                       use_tqdm=False)
    assert isinstance(res, list) and len(res) == 1
    r = res[0]
    assert r.request_id and r.prompt is None and r.prompt_token_ids == PROMPT and r.finished is True
    assert r.prompt_logprobs is None and r.metrics is None and isinstance(r.num_cached_tokens, int)
    assert len(r.outputs) == 1
    c = r.outputs[0]
    assert c.index == 0 and c.finish_reason == "length" and c.stop_reason is None and c.finished()
    assert len(c.token_ids) == len(c.logprobs) == 6
    assert c.text == tok.decode(c.token_ids, skip_special_tokens=True)
    ref = ref_logprobs(hf, PROMPT + c.token_ids)
    for i, (t, d) in enumerate(zip(c.token_ids, c.logprobs)):
        row = ref[len(PROMPT) - 1 + i]
        check_position(d, t, row, K, tok.decode)
        assert d[t].rank == 1 and len(d) == K  # greedy: the chosen token is the best one
        assert next(iter(d)) == t  # vLLM's order: the chosen token's entry first
    assert math.isclose(c.cumulative_logprob, chosen_sum(c), rel_tol=1e-6)


def test_sampled_logprobs_hold_the_sampled_token_outside_the_top(setup):
    """Sampled tokens outside the top k still have their entry (k + 1 entries), with their
    true vocab rank; k = 0 gives the sampled token alone."""
    hf, llm = setup
    tok = llm.tokenizer
    sp = [SamplingParams(temperature=3.0, seed=s, max_tokens=12, ignore_eos=True, logprobs=k)
          for s, k in ((1, 1), (2, 0))]
    res = llm.generate([PROMPT, PROMPT], sp, use_tqdm=False)
    outside = 0
    for r, k in zip(res, (1, 0)):
        c = r.outputs[0]
        assert len(c.logprobs) == len(c.token_ids) == 12
        ref = ref_logprobs(hf, PROMPT + c.token_ids)
        for i, (t, d) in enumerate(zip(c.token_ids, c.logprobs)):
            row = ref[len(PROMPT) - 1 + i]
            if k:
                check_position(d, t, row, k, tok.decode)
            else:
                assert list(d) == [t] and d[t].rank == vocab_rank(row, t)
                assert math.isclose(d[t].logprob, float(row[t]), abs_tol=2e-4)
                assert d[t].decoded_token == tok.decode([t])
            outside += d[t].rank > max(k, 1)
        assert c.cumulative_logprob == pytest.approx(chosen_sum(c))
    assert outside > 0  # the case of a sampled token below the top k was exercised


def test_prompt_logprobs_k(setup):
    hf, llm = setup
    tok = llm.tokenizer
    sp = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=K)
    r = llm.generate([PROMPT], sp, use_tqdm=False)[0]
    lps = r.prompt_logprobs
    assert isinstance(lps, list) and len(lps) == len(PROMPT) and lps[0] is None
    ref = ref_logprobs(hf, PROMPT)
    for i in range(1, len(PROMPT)):
        check_position(lps[i], PROMPT[i], ref[i - 1], K, tok.decode)
    # Sample logprobs were not asked for: vLLM's None for both.
    assert r.outputs[0].logprobs is None and r.outputs[0].cumulative_logprob is None


def test_n_completions_each_with_index_and_logprobs(setup):
    _, llm = setup
    text = llm.tokenizer.decode(PROMPT)
    sp = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=5, ignore_eos=True, logprobs=1,
                        prompt_logprobs=1)
    r = llm.generate(text, sp, use_tqdm=False)[0]
    assert r.prompt == text and r.prompt_token_ids and r.finished
    assert [c.index for c in r.outputs] == [0, 1, 2]
    assert len(r.prompt_logprobs) == len(r.prompt_token_ids) and r.prompt_logprobs[0] is None
    assert len({tuple(c.token_ids) for c in r.outputs}) > 1  # distinct seeds per completion
    for c in r.outputs:
        assert len(c.logprobs) == len(c.token_ids) == 5
        assert all(t in d and 1 <= len(d) <= 2 for t, d in zip(c.token_ids, c.logprobs))
        assert c.cumulative_logprob == pytest.approx(chosen_sum(c))


def test_no_logprobs_asked(setup):
    _, llm = setup
    r = llm.generate([PROMPT, "a b"], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    assert [x.prompt for x in r] == [None, "a b"]
    for x in r:
        assert x.prompt_logprobs is None and x.finished
        c = x.outputs[0]
        assert c.logprobs is None and c.cumulative_logprob is None and c.index == 0


def test_stop_reason_names_the_stop_token_or_string(setup):
    _, llm = setup
    tok = llm.tokenizer
    plain = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    base = llm.generate([PROMPT], plain, use_tqdm=False)[0]
    ids = base.outputs[0].token_ids
    stop_id = ids[2]
    by_id = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                                  stop_token_ids=[stop_id]), use_tqdm=False)[0].outputs[0]
    assert by_id.finish_reason == "stop" and by_id.stop_reason == stop_id
    assert by_id.token_ids == ids[:ids.index(stop_id) + 1]
    text = tok.decode(ids, skip_special_tokens=True)
    stop = text[len(text) // 2:len(text) // 2 + 2]
    by_str = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, stop=[stop]),
                          use_tqdm=False)[0].outputs[0]
    assert by_str.finish_reason == "stop" and by_str.stop_reason == stop
    assert by_str.text == text[:text.index(stop)]
    assert base.outputs[0].stop_reason is None


def test_to_logprob_dict_orders_and_ranks_like_vllm():
    dec = {1: "a", 2: "b", 3: "c", 9: "z"}.get
    outside = to_logprob_dict(9, TokenLogprobs(-5.0, [(1, -0.1), (2, -0.2)], rank=7), dec)
    assert list(outside) == [9, 1, 2]
    assert outside[9] == Logprob(-5.0, 7, "z") and outside[1] == Logprob(-0.1, 1, "a")
    assert outside[2] == Logprob(-0.2, 2, "b")
    inside = to_logprob_dict(2, TokenLogprobs(-0.2, [(1, -0.1), (2, -0.2), (3, -0.3)], rank=2), dec)
    assert list(inside) == [2, 1, 3] and inside[2] == Logprob(-0.2, 2, "b")
    alone = to_logprob_dict(3, TokenLogprobs(-0.3, [], rank=3), lambda t: None)
    assert alone == {3: Logprob(-0.3, 3, None)}


def test_classes_have_vllms_fields_in_vllms_order():
    assert [f.name for f in dataclasses.fields(Logprob)] == ["logprob", "rank", "decoded_token"]
    assert Logprob(-1.0) == Logprob(-1.0, None, None)
    names = [f.name for f in dataclasses.fields(tpserve.CompletionOutput)]
    assert names[:7] == ["index", "text", "token_ids", "cumulative_logprob", "logprobs", "finish_reason",
                         "stop_reason"]
    c = tpserve.CompletionOutput(0, "x", [1], None, None)  # vLLM's positional form
    assert c.finish_reason is None and not c.finished()
    r = tpserve.RequestOutput("r", "p", [1, 2], None, [c], True, num_cached_tokens=0)
    assert (r.request_id, r.prompt, r.prompt_token_ids, r.prompt_logprobs, r.outputs, r.finished) == \
        ("r", "p", [1, 2], None, [c], True)
    assert r.lora_request is None and r.encoder_prompt is None and r.kv_transfer_params is None


def test_output_classes_import_from_the_package_without_torch():
    code = ("import sys, tpserve; from tpserve import RequestOutput, CompletionOutput, Logprob; "
            "import tpserve.outputs as o; assert RequestOutput is o.RequestOutput; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
