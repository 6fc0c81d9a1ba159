"""The serving features on a mixture-of-experts model (a tiny random Qwen3-MoE: 8 experts,
top-2), beyond the greedy-equality tests of test_models_moe.py: structured output, the
sampling penalties, logit_bias and min_tokens (against a transformers decode loop with each
control applied by hand, test_sampling_controls' reference), the speculative decoding's
batch-size rule, the daemon with its HTTP front and /metrics, and bf16 against transformers
where routing is not near a tie.

One engine serves the module, with n-gram speculation at every batch size, so that the
controls are also checked on draft rows and constrained rows beside speculating ones.
"""
from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoModelForCausalLM

from model_factory import make_tiny_model, tiny_models_root  # noqa: F401
from test_http import HttpDaemon, idle
from test_llm import hf_greedy
from test_models import HFSequence, random_prompts, tpserve_model
from test_models_moe import moe_blocks, pack, run
from test_sampling_controls import penalize, reference
from tpserve import LLM, SamplingParams
from tpserve.kernels import cpu_extension
from tpserve.sampling import StructuredOutputsParams as SO

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], list(range(20, 45)), [100, 3, 4, 3, 100]]
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1,
        "disable_by_batch_size": None}


@pytest.fixture(scope="module")
def moe(tiny_models_root):  # noqa: F811
    path = make_tiny_model(tiny_models_root, "qwen3_moe")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with LLM(str(path), dtype="float32", num_kv_blocks=256, block_size=4, speculative_config=SPEC) as llm:
        yield path, hf, llm


def greedy(llm, prompts, max_tokens=10, **kw):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)
    return [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def test_structured_output_on_moe(moe):
    """JSON schemas and a regex, greedy and seeded, beside unconstrained greedy neighbours that
    verify drafts (their output stays transformers')."""
    path, _, llm = moe
    schema = {"type": "object", "additionalProperties": False, "required": ["id", "tags", "kind"],
              "properties": {"id": {"type": "integer", "minimum": -5, "maximum": 120},
                             "tags": {"type": "array", "items": {"type": "string", "maxLength": 4},
                                      "minItems": 1, "maxItems": 3},
                             "kind": {"enum": ["fox", "dog", 7, None]}}}
    nested = {"type": "object", "additionalProperties": False, "required": ["p"],
              "properties": {"p": {"type": "object", "required": ["x", "y"], "additionalProperties": False,
                                   "properties": {"x": {"type": "boolean"},
                                                  "y": {"type": "string", "minLength": 1, "maxLength": 6}}}}}
    pattern = r"[a-f]{2,4}-\d{3}( ok)?"
    loop = [7] * 16 + [9, 7, 7]  # copy-heavy: the proposer finds drafts
    prompts = ["The quick brown fox", "Hello world!", loop, "A paged KV cache", loop[:-1], "0123"]
    plain = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    params = [SamplingParams(temperature=0.0, max_tokens=120, structured_outputs=SO(json=schema)),
              SamplingParams(temperature=1.0, seed=3, max_tokens=120, structured_outputs=SO(json=nested)),
              plain,
              SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=SO(regex=pattern)),
              plain,
              SamplingParams(temperature=0.8, seed=5, max_tokens=120, structured_outputs=SO(json=schema))]
    stats = llm.stats()
    outs = llm.generate(prompts, params, use_tqdm=False)
    for i, s in ((0, schema), (1, nested), (5, schema)):
        assert outs[i].finish_reason == "stop", outs[i].text
        jsonschema.validate(json.loads(outs[i].text), s)
    assert re.fullmatch(pattern, outs[3].text) and outs[3].finish_reason == "stop", outs[3].text
    assert [outs[2].token_ids, outs[4].token_ids] == hf_greedy(path, [loop, loop[:-1]], max_tokens=12)
    assert llm.stats()["spec_decode_num_drafts"] > stats["spec_decode_num_drafts"]


def test_the_batch_size_rule_turns_drafts_off_on_moe(moe):
    """The default ``disable_by_batch_size`` (spec_config.py: measured to hold on MoE too): a
    step with more decode rows than it proposes no drafts, smaller ones do, and the greedy
    output stays transformers'."""
    from tpserve.spec_config import DEFAULT_DISABLE_BY_BATCH_SIZE as LIMIT
    path = moe[0]
    prompts = [[7] * 12 + [i + 3, 7, 7] for i in range(LIMIT + 2)]
    lengths = [3, 4, 5, 16, 16, 16]
    spec = {k: v for k, v in SPEC.items() if k != "disable_by_batch_size"}
    steps = []
    with LLM(str(path), dtype="float32", num_kv_blocks=256, block_size=4, speculative_config=spec) as llm:
        speculator = llm.engine.scheduler.speculator
        add = speculator.add_drafts

        def spy(batch, *a, **k):
            add(batch, *a, **k)
            if batch.num_decodes:
                steps.append((batch.num_decodes, bool(batch.drafts)))
        speculator.add_drafts = spy
        outs = llm.generate(prompts, [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
                                      for n in lengths], use_tqdm=False)
    assert [o.token_ids for o in outs] == [r[:n] for r, n in zip(hf_greedy(path, prompts, 16), lengths)]
    assert any(n > LIMIT for n, _ in steps) and not any(d for n, d in steps if n > LIMIT), steps
    assert any(d for n, d in steps if n <= LIMIT), steps


@pytest.mark.parametrize("kw", [dict(repetition_penalty=1.8),
                                dict(frequency_penalty=-0.8, presence_penalty=0.9, repetition_penalty=1.2)])
def test_penalties_on_moe_equal_the_reference(moe, kw):
    _, hf, llm = moe
    proc = penalize(kw.get("repetition_penalty", 1.0), kw.get("frequency_penalty", 0.0),
                    kw.get("presence_penalty", 0.0))
    got = greedy(llm, PROMPTS, **kw)
    assert got == [reference(hf, p, proc) for p in PROMPTS]
    assert got != greedy(llm, PROMPTS)  # the penalty changed something


def test_logit_bias_and_min_tokens_on_moe(moe):
    _, hf, llm = moe
    base = greedy(llm, PROMPTS[:1])[0]
    bias = {base[0]: -100.0, 77: 30.0}

    def biased(x, *_):
        for t, b in bias.items():
            x[t] += b
        return x
    assert greedy(llm, PROMPTS[:1], logit_bias=bias) == [reference(hf, PROMPTS[0], biased)]
    stop = [base[0], base[2]]
    assert greedy(llm, PROMPTS[:1], stop_token_ids=stop) == [base[:1]]

    def ban_until(x, prompt, out):
        if len(out) < 4:
            x[stop] = float("-inf")
        return x
    got = greedy(llm, PROMPTS[:1], stop_token_ids=stop, min_tokens=4)[0]
    assert got == reference(hf, PROMPTS[0], ban_until, stop_ids=stop)
    assert len(got) >= 4 and not set(got[:4]) & set(stop)


def test_daemon_streams_a_moe_completion_and_metrics_count_it(moe, monkeypatch):
    """``tpserve start --model <MoE>`` with its HTTP front: a streamed greedy completion equals
    the offline one, and /metrics counts its tokens."""
    path, _, llm = moe
    monkeypatch.setenv("TPSERVE_MODEL", str(path))
    monkeypatch.setenv("TPSERVE_SERVED_MODEL_NAME", "tiny-moe")
    prompt = "Prefix caching lets"
    want, = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                         use_tqdm=False)
    daemon = HttpDaemon(api_key=None, num_kv_blocks=128)
    try:
        def scrape():
            text = httpx.get(daemon.url + "/metrics", timeout=30).text
            return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
                    if s.labels.get("model_name") == "tiny-moe" and "le" not in s.labels}
        before = scrape()
        client = openai.OpenAI(base_url=daemon.url + "/v1", api_key="none", max_retries=0, timeout=120)
        assert [m.id for m in client.models.list().data] == ["tiny-moe"]
        chunks = list(client.completions.create(model="tiny-moe", prompt=prompt, max_tokens=8, temperature=0,
                                                stream=True, stream_options={"include_usage": True},
                                                extra_body={"ignore_eos": True}))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == want.text
        assert chunks[-1].usage.completion_tokens == 8
        idle(daemon)
        after = scrape()
        assert after["tpserve:generation_tokens_total"] - before["tpserve:generation_tokens_total"] == 8
        assert after["tpserve:prompt_tokens_total"] - before["tpserve:prompt_tokens_total"] == \
            len(want.prompt_token_ids)
        assert after["tpserve:e2e_request_latency_seconds_count"] == \
            before["tpserve:e2e_request_latency_seconds_count"] + 1
    finally:
        daemon.stop()


def _hf_bf16_routing(hf):
    """Hooks every router of a transformers Qwen3-MoE; returns one list per layer that fills
    with each forward's router logits (fp32)."""
    seen = []
    for layer in hf.model.layers:
        logits: list[torch.Tensor] = []
        seen.append(logits)
        layer.mlp.gate.register_forward_hook(lambda m, a, out, logits=logits: logits.append(out[0].float()))
    return seen


def test_bf16_moe_agrees_with_transformers_where_routing_is_clear(tiny_models_root,  # noqa: F811
                                                                   monkeypatch):
    """bf16 through the packed experts, the C++ router and the fused decode (the torch path
    where the C++ operators are not built), against
    transformers in bf16: on every token whose router has a clear margin between its k-th and
    (k+1)-th expert, tpserve picks the same experts; logits stay close and the top-1 tokens
    agree wherever transformers' own top two are not near a tie. A routing bug in bf16 (a
    wrong expert, weights rounded or renormalised differently) moves whole rows and shows."""
    from tpserve.models import moe as moe_module, moe_kernel
    path = make_tiny_model(tiny_models_root, "qwen3_moe", hidden_size=128, num_hidden_layers=3,
                           num_experts=16, num_experts_per_tok=4, init_std=0.1)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    hf_routing = _hf_bf16_routing(hf)
    prompts = random_prompts([9, 23, 14], 384, seed=5)
    seqs = [HFSequence(hf) for _ in prompts]
    expected = [torch.cat([s.feed(p) for s, p in zip(seqs, prompts)])]
    prefill_routing = [torch.cat(layer) for layer in hf_routing]
    last, decode = [e[-1] for e in torch.split(expected[0], [len(p) for p in prompts])], []
    for _ in range(4):
        row = [int(lg.argmax()) for lg in last]
        decode.append(row)
        last = [s.feed([t])[-1] for s, t in zip(seqs, row)]
        expected.append(torch.stack(last))

    kernels = cpu_extension.available()
    model = tpserve_model(path, backend="cpu" if kernels else "torch", dtype="bfloat16")
    pack(model)
    assert all((b.experts.packed is not None) == kernels for b in moe_blocks(model))
    chosen: list[torch.Tensor] = []
    for module in (moe_module, moe_kernel):
        def spy(logits, *a, real=module.route, **k):
            weights, ids = real(logits, *a, **k)
            chosen.append(ids)
            return weights, ids
        monkeypatch.setattr(module, "route", spy)
    got = run(model, prompts, decode, fused=True)

    # The prefill's routing, layer by layer (tpserve's prefill runs the block's router in Python;
    # the fused decode routes inside its C++ stack).
    k = 4
    assert len(chosen) >= 3
    clear = 0
    for layer, (ids, ref_logits) in enumerate(zip(chosen[:3], prefill_routing)):
        top = ref_logits.topk(k + 1, dim=-1)
        ok = top.values[:, k - 1] - top.values[:, k] > 0.05 * ref_logits.abs().amax(-1)
        clear += int(ok.sum())
        want = top.indices[:, :k].sort(-1).values
        assert torch.equal(ids[ok].sort(-1).values, want[ok]), f"layer {layer}: experts differ"
        assert len(set(want.flatten().tolist())) >= 12  # the routers spread the tokens
    assert clear >= 0.4 * 3 * sum(map(len, prompts))
    # Logits: bf16 noise is ~1% of a row's scale; a token routed differently (a near tie, or
    # a bug) moves its row by several percent.
    errors, agree, total = [], 0, 0
    for step, (g, e) in enumerate(zip(got, expected)):
        g, e = g.float(), e.float()
        scale = e.abs().amax(-1)
        errors.append((g - e).abs().amax(-1) / scale)
        top2 = e.topk(2, dim=-1)
        sure = top2.values[:, 0] - top2.values[:, 1] > 0.02 * scale
        same = g.argmax(-1) == top2.indices[:, 0]
        assert bool(same[sure].all()), f"forward {step}: top-1 differs on a row with a clear margin"
        agree, total = agree + int(same.sum()), total + len(e)
    errors = torch.cat(errors)
    assert (errors < 0.03).float().mean() >= 0.9 and errors.max() < 0.2, errors
    assert agree >= 0.9 * total
