"""Structured output (``structured_outputs``) through the offline API, the engine and the ZMQ
client, on the bundled model: its free text is near-random, so only the constraint can make an
output valid. One engine for the module (float32, so greedy runs compare exactly)."""
from __future__ import annotations

import json
import random
import re
import threading
from pathlib import Path

import jsonschema
import pytest

from test_daemon import ServerThread
from tpserve import LLM, SamplingParams
from tpserve.client import protocol as P
from tpserve.client.client import Client, RequestError
from tpserve.errors import InvalidFieldError
from tpserve.grammar import compiler as grammar_compiler
from tpserve.sampling import StructuredOutputsParams as SO

BUNDLED = Path(__file__).resolve().parent.parent / "tpserve" / "assets" / "default-model"
PROMPT = "def parse(text):\n    "


@pytest.fixture(scope="module")
def llm():
    with LLM(str(BUNDLED), dtype="float32", num_kv_blocks=256, block_size=4, max_num_seqs=24) as llm:
        yield llm


def assert_clean(llm):
    e = llm.engine
    assert not e.families and not e.requests and not e.has_unfinished()
    e.scheduler.check_integrity()
    assert e.scheduler.block_manager.num_used_blocks == 0


def random_schema(rng: random.Random) -> dict:
    """An object of 2-4 bounded properties: integers with bounds, enums, short strings, arrays
    of integers, one nested object; no additional properties."""
    def leaf(depth):
        kind = rng.choice(["int", "enum", "str", "array"] + (["object"] if depth == 0 else []))
        if kind == "int":
            lo = rng.randint(-50, 50)
            return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 100)}
        if kind == "enum":
            return {"enum": rng.sample(["red", "green", "blue", "cyan", 7, True, None], rng.randint(1, 4))}
        if kind == "str":
            return {"type": "string", "minLength": rng.randint(0, 2), "maxLength": rng.randint(3, 8)}
        if kind == "array":
            return {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                    "minItems": rng.randint(0, 1), "maxItems": rng.randint(2, 4)}
        return obj(depth + 1)

    def obj(depth):
        names = rng.sample(["id", "name", "tags", "kind", "size", "meta", "x", "y"], rng.randint(2, 4))
        props = {n: leaf(depth) for n in names}
        return {"type": "object", "properties": props, "required": names, "additionalProperties": False}
    return obj(0)


def test_twenty_random_schemas_all_validate(llm):
    rng = random.Random(2024)
    schemas = [random_schema(rng) for _ in range(20)]
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=160, structured_outputs=SO(json=s))
              for i, s in enumerate(schemas)]
    outs = llm.generate([PROMPT] * 20, params, use_tqdm=False)
    for schema, out in zip(schemas, outs):
        assert out.finish_reason == "stop", (out.text, schema)
        jsonschema.validate(json.loads(out.text), schema)
        # Compact separators: no whitespace outside strings.
        assert json.dumps(json.loads(out.text), separators=(",", ":"), ensure_ascii=False) == out.text
    assert_clean(llm)


def test_regex_choice_grammar_and_json_object(llm):
    patterns = [r"[a-z]{2,5}@[a-z]{3}\.(com|org)", r"\d{3}-\d{4}", r"(yes|no)!"]
    params = [SamplingParams(temperature=1.0, seed=7, max_tokens=40, structured_outputs=SO(regex=p))
              for p in patterns]
    params.append(SamplingParams(temperature=1.0, seed=3, max_tokens=10,
                                 structured_outputs=SO(choice=["alpha", "beta gamma", "δ"])))
    lark = 'start: "(" num ("+" num)* ")"\nnum: /[1-9][0-9]?/'
    params.append(SamplingParams(temperature=1.0, seed=5, max_tokens=40, structured_outputs=SO(grammar=lark)))
    params.append(SamplingParams(temperature=0.0, max_tokens=60, structured_outputs={"json_object": True}))
    outs = llm.generate([PROMPT] * len(params), params, use_tqdm=False)
    for p, out in zip(patterns, outs):
        assert re.fullmatch(p, out.text) and out.finish_reason == "stop", (p, out.text)
    assert outs[3].text in ("alpha", "beta gamma", "δ") and outs[3].finish_reason == "stop"
    assert re.fullmatch(r"\(([1-9][0-9]?)(\+[1-9][0-9]?)*\)", outs[4].text), outs[4].text
    # Any JSON object; the greedy string may run to max_tokens ("length": it need not parse).
    assert outs[5].text.startswith("{")
    if outs[5].finish_reason == "stop":
        assert isinstance(json.loads(outs[5].text), dict)
    else:
        assert outs[5].finish_reason == "length" and len(outs[5].token_ids) == 60


def test_flexible_whitespace_is_an_option_and_length_may_cut_a_grammar(llm):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    out, = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=3,
                                               structured_outputs=SO(json=schema)), use_tqdm=False)
    assert out.finish_reason == "length" and len(out.token_ids) == 3
    assert '{"a":'.startswith(out.text) or out.text.startswith('{"a":')
    flex = SO(json=schema, disable_any_whitespace=False, whitespace_pattern=r" ",
              disable_additional_properties=True)
    outs = llm.generate([PROMPT] * 4, [SamplingParams(temperature=1.0, seed=s, max_tokens=40,
                                                      structured_outputs=flex) for s in range(4)],
                        use_tqdm=False)
    for o in outs:  # only the pattern's single spaces between tokens, and no other property
        assert re.fullmatch(r' ?\{ ?"a" ?: ?-?\d+ ?\}', o.text) or o.finish_reason == "length", o.text


def test_unconstrained_neighbours_keep_their_greedy_output(llm):
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = ["import os\n", "class A:\n    def", "for i in range("]
    solo = [o.token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["n"], "additionalProperties": False}
    mixed = [greedy, SamplingParams(temperature=0.0, max_tokens=30, structured_outputs=SO(json=schema)), greedy,
             SamplingParams(temperature=1.0, seed=1, max_tokens=10, structured_outputs=SO(regex="[0-9]{4}")), greedy]
    outs = llm.generate([prompts[0], PROMPT, prompts[1], PROMPT, prompts[2]], mixed, use_tqdm=False)
    assert [outs[0].token_ids, outs[2].token_ids, outs[4].token_ids] == solo
    jsonschema.validate(json.loads(outs[1].text), schema)
    assert re.fullmatch("[0-9]{4}", outs[3].text)
    # Greedy constrained output is reproducible, and n completions each get their own matcher.
    again, = llm.generate(PROMPT, mixed[1], use_tqdm=False)
    assert again.token_ids == outs[1].token_ids
    two, = llm.generate(PROMPT, SamplingParams(n=2, temperature=1.0, seed=9, max_tokens=10,
                                               structured_outputs=SO(choice=["ab", "cd", "ef"])), use_tqdm=False)
    assert all(c.text in ("ab", "cd", "ef") and c.finish_reason == "stop" for c in two.outputs)


def test_preempted_constrained_requests_stay_valid():
    """A pool too small for all of them: requests are preempted and recomputed, and their
    matchers continue where their kept tokens end."""
    schema = {"type": "object", "properties": {"k": {"type": "array", "items": {"enum": ["aa", "bb"]},
                                                     "minItems": 3, "maxItems": 6}},
              "required": ["k"], "additionalProperties": False}
    with LLM(str(BUNDLED), dtype="float32", num_kv_blocks=14, block_size=4) as small:
        params = [SamplingParams(temperature=1.0, seed=i, max_tokens=40, structured_outputs=SO(json=schema))
                  for i in range(4)]
        outs = small.generate([PROMPT] * 4, params, use_tqdm=False)
        assert small.stats()["num_preemptions"] > 0
        for o in outs:
            jsonschema.validate(json.loads(o.text), schema)
        assert_clean(small)


@pytest.mark.parametrize("so,field", [
    (dict(regex="a(b"), "params.structured_outputs.regex"),
    (dict(json={"type": "array", "uniqueItems": True}), "params.structured_outputs.json"),
    (dict(json={"type": "integer", "minimum": 5, "maximum": 1}), "params.structured_outputs.json"),
    (dict(grammar="start: undefined_rule"), "params.structured_outputs.grammar"),
    (dict(json="{not json}"), "params.structured_outputs.json"),  # parsed in the grammar process
    (dict(json='{"a": ' * 3000 + "1" + "}" * 3000), "params.structured_outputs.json"),  # RecursionError there
    (dict(regex="[a&&b]"), "params.structured_outputs.regex"),  # no text matches it
    (dict(grammar="start: A\nA: /[a&&b]/\n"), "params.structured_outputs.grammar"),
])
def test_a_grammar_the_engine_rejects_raises_naming_the_field(llm, so, field):
    ok = SamplingParams(temperature=0.0, max_tokens=4)
    with pytest.raises(InvalidFieldError) as e:
        llm.generate([PROMPT, PROMPT], [ok, SamplingParams(max_tokens=8, structured_outputs=so)], use_tqdm=False)
    assert e.value.field == field
    assert re.search("grammar engine rejects|not JSON text|nested too deeply|no text satisfies", e.value.reason)
    assert_clean(llm)
    assert llm.generate(PROMPT, ok, use_tqdm=False)[0].finish_reason == "length"  # still serving


def test_a_mask_with_no_token_left_ends_the_request_with_error(llm):
    """allowed_token_ids (applied with the grammar's mask) leaves only EOS, which "ab" cannot
    take first; a complete grammar ends the request even before min_tokens."""
    dead, done = llm.generate([PROMPT, PROMPT], [
        SamplingParams(max_tokens=5, allowed_token_ids=[0], structured_outputs=SO(choice=["ab"])),
        SamplingParams(max_tokens=20, min_tokens=10, temperature=0.0, structured_outputs=SO(choice=["ab"]))],
        use_tqdm=False)
    assert dead.finish_reason == "error" and dead.token_ids == []
    assert done.text == "ab" and done.finish_reason == "stop"
    assert_clean(llm)


@pytest.mark.parametrize("so,field,match", [
    (dict(choice=[]), "structured_outputs.choice", "1 to"),
    (dict(choice=["a", ""]), "structured_outputs.choice[1]", "non-empty"),
    (dict(json={"type": "object"}, regex="x"), "structured_outputs", "exactly one"),
    ({}, "structured_outputs", "exactly one"),
    (dict(json="[1, 2]"), "structured_outputs.json", "schema object"),
    (dict(json="{not json"), "structured_outputs.json", "schema object"),
    (dict(json_object=False), "structured_outputs.json_object", "must be true"),
    (dict(regex=""), "structured_outputs.regex", "length"),
    (dict(regex="x", whitespace_pattern=" "), "structured_outputs.whitespace_pattern", "json"),
    (dict(json={"type": "object"}, disable_any_whitespace="yes"), "structured_outputs.disable_any_whitespace", "bool"),
    (dict(structural_tag="{}"), "structured_outputs.structural_tag", "not supported"),
])
def test_bad_structured_outputs_are_refused_at_construction(so, field, match):
    with pytest.raises(InvalidFieldError, match=match) as e:
        SamplingParams(structured_outputs=so)
    assert e.value.field == field


def test_compilation_runs_off_the_step_loop(llm, monkeypatch):
    """While a grammar compiles its request waits outside the queue; the others keep stepping."""
    gate = threading.Event()
    build = grammar_compiler.GrammarCompiler._build

    def held_build(self, job):
        assert gate.wait(30)
        return build(self, job)
    monkeypatch.setattr(grammar_compiler.GrammarCompiler, "_build", held_build)
    e = llm.engine
    e.add_request("free", PROMPT, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    e.add_request("held", PROMPT, SamplingParams(temperature=0.0, max_tokens=20,
                                                 structured_outputs=SO(regex="[a-c]{5} held")))
    got = {}
    for _ in range(6):
        for out in e.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert len(got["free"]) == 6 and "held" not in got
    assert e.scheduler.get("held") in e.scheduler.grammars.compiling
    gate.set()
    text = ""
    while e.has_unfinished():
        text += "".join(o.new_text for o in e.step() if o.request_id == "held")
    assert re.fullmatch("[a-c]{5} held", text)
    # The same grammar again is served from the cache: no new compilation.
    n = e._grammars.num_compiled
    llm.generate(PROMPT, SamplingParams(max_tokens=20, structured_outputs=SO(regex="[a-c]{5} held")),
                 use_tqdm=False)
    assert e._grammars.num_compiled == n
    assert_clean(llm)


def test_the_wire_carries_structured_outputs_as_a_map():
    props = {f"p{i}": {"type": "integer"} for i in range(100)}  # more entries than a wire map may hold
    sp = SamplingParams(structured_outputs=SO(json={"type": "object", "properties": props},
                                              disable_any_whitespace=False))
    wire = P.params_to_wire(sp)
    assert wire["structured_outputs"] == {"json": json.dumps(sp.structured_outputs.json, separators=(",", ":")),
                                          "disable_any_whitespace": False}
    msg = P.decode(P.encode(P.GenerateRequest("r", "x", sp)))
    assert msg.params.structured_outputs.json == wire["structured_outputs"]["json"]
    assert msg.params.structured_outputs.disable_any_whitespace is False
    with pytest.raises(P.ProtocolError) as e:
        P.sampling_params("params", {"structured_outputs": {"choice": []}})
    assert e.value.code == P.INVALID_FIELD and e.value.field == "params.structured_outputs.choice"


def test_zmq_client_structured_outputs(llm):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},
              "required": ["ok", "n"], "additionalProperties": False}
    with ServerThread(llm.engine) as srv, Client(srv.address, timeout=60) as c:
        res = c.generate(PROMPT, max_tokens=30, temperature=1.0, seed=4, structured_outputs={"json": schema})
        jsonschema.validate(json.loads(res.text), schema)
        assert res.finish_reason == "stop"
        streamed = "".join(d.text for d in c.stream(PROMPT, max_tokens=12, temperature=1.0, seed=5,
                                                     structured_outputs=SO(choice=["left", "right"])))
        assert streamed in ("left", "right")
        with pytest.raises(RequestError) as e:
            c.generate(PROMPT, max_tokens=5, structured_outputs={"regex": "(("})
        assert e.value.code == P.INVALID_FIELD and e.value.field == "params.structured_outputs.regex"
        with pytest.raises(InvalidFieldError) as e:  # caught by the client before sending
            c.generate(PROMPT, max_tokens=5, structured_outputs={"json": {"type": "object"}, "grammar": "x"})
        assert e.value.field == "structured_outputs"
        assert c.generate(PROMPT, max_tokens=3, temperature=0.0).finish_reason == "length"
        srv.stop()
    assert_clean(llm)


def test_tp2_constrained_outputs_equal_tp1(llm):
    rng = random.Random(11)
    schemas = [random_schema(rng) for _ in range(3)]
    params = [SamplingParams(temperature=0.0 if i == 0 else 1.0, seed=i, max_tokens=80,
                             structured_outputs=SO(json=s)) for i, s in enumerate(schemas)]
    params.append(SamplingParams(temperature=1.0, seed=3, max_tokens=12, structured_outputs=SO(regex=r"\w{3} \d\d")))
    tp1 = [o.token_ids for o in llm.generate([PROMPT] * 4, params, use_tqdm=False)]
    with LLM(str(BUNDLED), dtype="float32", num_kv_blocks=256, block_size=4, tensor_parallel_size=2) as tp:
        outs = tp.generate([PROMPT] * 4, params, use_tqdm=False)
    assert [o.token_ids for o in outs] == tp1
    for schema, o in zip(schemas, outs):
        jsonschema.validate(json.loads(o.text), schema)
    assert re.fullmatch(r"\w{3} \d\d", outs[3].text)


def test_constrained_requests_get_no_drafts_beside_speculating_neighbours(llm):
    """With ngram speculation on, grammar-constrained rows stay plain decode rows (no drafts:
    a mask per draft position is not built), while their unconstrained neighbours verify
    drafts; every output equals the one without speculation."""
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999}},
              "required": ["n"], "additionalProperties": False}
    loop = "x = 1\nx = 1\nx = 1\nx = 1\n"  # a copy-heavy prompt: the proposer finds drafts
    prompts = [loop, PROMPT, loop + "y", PROMPT]
    params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=30, structured_outputs=SO(json=schema)),
              SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=4, max_tokens=12, structured_outputs=SO(regex="[a-c]{3,9}"))]
    plain = llm.generate(prompts, params, use_tqdm=False)
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    with LLM(str(BUNDLED), dtype="float32", num_kv_blocks=256, block_size=4, max_num_seqs=24,
             speculative_config=spec) as sllm:
        drafted: list[str] = []
        speculator = sllm.engine.scheduler.speculator
        add = speculator.add_drafts

        def spy(batch, *a, **k):
            add(batch, *a, **k)
            for seq, d in zip(batch.seqs, batch.drafts or []):
                if d:
                    drafted.append(seq.request_id)
        speculator.add_drafts = spy
        outs = sllm.generate(prompts, params, use_tqdm=False)
        stats = sllm.stats()
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert stats["spec_decode_num_drafts"] > 0
    jsonschema.validate(json.loads(outs[1].text), schema)
    assert re.fullmatch("[a-c]{3,9}", outs[3].text)
    assert drafted and not set(drafted) & {outs[1].request_id, outs[3].request_id}, drafted
