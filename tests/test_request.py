"""The request model (tpserve/request.py): each API's translation into one Request, its one
validation with errors in the caller's spelling, each API's default for an unset max_tokens
(docs/protocol.md), and ``n`` run by the engine -- offline and over ZMQ here; the HTTP endpoints
in test_http.py, gRPC in test_grpc_front.py."""
from __future__ import annotations

import pytest

from model_factory import make_tiny_model, tiny_models_root  # noqa: F401
from test_daemon import ServerThread
from tpserve.client import protocol as P
from tpserve.client.client import Client, RequestError
from tpserve.errors import InvalidFieldError
from tpserve.fronts.grpc.api import GRPC
from tpserve.fronts.http import openai_api as O
from tpserve.request import OFFLINE, Api, make_request, rest_of_context
from tpserve.sampling import SamplingParams
from tpserve.server.server import ServerOptions

MAX_MODEL_LEN = 48


# ---- the model, without an engine ---------------------------------------------------------------
@pytest.mark.parametrize("api,unset", [(O.COMPLETIONS, 16), (O.CHAT, None), (GRPC, None), (P.ZMQ, 16),
                                       (OFFLINE, 16)])
def test_each_api_declares_its_unset_max_tokens(api, unset):
    """None is "the rest of the context", which the engine resolves once the prompt is tokenized."""
    assert api.default_max_tokens == unset
    assert make_request(api, {}).params.max_tokens == unset
    assert make_request(api, {"max_tokens": 5}).params.max_tokens == 5
    assert make_request(api, {"max_tokens": None}).params.max_tokens is None  # asked for explicitly


def test_the_rest_of_the_context_is_at_least_one_token():
    assert rest_of_context(48, 10) == 38
    assert rest_of_context(48, 48) == 1 and rest_of_context(48, 60) == 1  # admission then names the prompt


@pytest.mark.parametrize("api,field,spelled", [
    (O.COMPLETIONS, "stop[1]", "stop[1]"),
    (P.ZMQ, "stop[1]", "params.stop[1]"),
    (GRPC, "top_p", "sampling_params.top_p"),
    (O.CHAT, "prompt", "messages"),
    (O.CHAT, "priority", "priority"),
    (P.ZMQ, "priority", "priority"),
])
def test_an_api_spells_the_canonical_fields(api, field, spelled):
    assert api.spell(field) == spelled


def test_one_validation_names_the_field_as_each_caller_spells_it():
    cases = [(O.COMPLETIONS, {}, "top_p"), (P.ZMQ, {}, "params.top_p"), (GRPC, {}, "sampling_params.top_p"),
             (OFFLINE, {}, "top_p")]
    for api, names, want in cases:
        with pytest.raises(InvalidFieldError) as e:
            make_request(api, {"top_p": 2.0}, names=names)
        assert e.value.field == want
    # a request's own spellings: where its structured output (or max_tokens) came from
    names = {"structured_outputs": "response_format.json_schema.schema",
             "max_tokens": "max_completion_tokens"}
    with pytest.raises(InvalidFieldError) as e:
        make_request(O.CHAT, {"structured_outputs": {"json": [1]}}, names=names)
    assert e.value.field == "response_format.json_schema.schema"
    with pytest.raises(InvalidFieldError) as e:
        make_request(O.CHAT, {"max_tokens": "5"}, names=names)
    assert e.value.field == "max_completion_tokens"
    with pytest.raises(InvalidFieldError) as e:  # vLLM's own field keeps its sub-field
        make_request(O.CHAT, {"structured_outputs": {"regex": "a", "choice": ["b"]}})
    assert e.value.field == "structured_outputs"
    with pytest.raises(InvalidFieldError) as e:
        make_request(O.CHAT, {"structured_outputs": {"structural_tag": "{}"}})
    assert e.value.field == "structured_outputs.structural_tag"
    with pytest.raises(InvalidFieldError) as e:  # request-level fields, also validated once
        make_request(P.ZMQ, {}, priority=2**40)
    assert e.value.field == "priority"
    with pytest.raises(InvalidFieldError) as e:
        make_request(GRPC, {}, timeout=-1)
    assert e.value.field == "timeout"


def test_the_least_max_tokens_of_an_api():
    with pytest.raises(InvalidFieldError, match="only allowed with echo") as e:
        make_request(O.COMPLETIONS, {"max_tokens": 0})
    assert e.value.field == "max_tokens"
    assert make_request(O.COMPLETIONS, {"max_tokens": 0}, score_prompt=True).params.max_tokens == 0
    with pytest.raises(InvalidFieldError):
        make_request(O.CHAT, {"max_tokens": 0})
    assert make_request(P.ZMQ, {"max_tokens": 0}).params.max_tokens == 0  # scores the prompt


def test_a_new_api_is_a_declaration():
    """What a new front adds: its Api (no change to the validation)."""
    api = Api("example", 7, min_max_tokens=1, params_prefix="options.", names={"prompt": "input"})
    assert make_request(api, {}).params.max_tokens == 7
    with pytest.raises(InvalidFieldError) as e:
        make_request(api, {"temperature": -1})
    assert e.value.field == "options.temperature"
    with pytest.raises(InvalidFieldError) as e:
        make_request(api, {}, prompt="")
    assert e.value.field == "input"


def test_the_wire_carries_an_unset_and_a_rest_of_context_max_tokens():
    """ZMQ: a params map without max_tokens means 16, nil means the rest of the context."""
    def decoded(params):
        return P.decode({"v": 1, "type": "generate", "id": "a", "prompt": [1, 2], "params": params})
    assert decoded({}).params.max_tokens == 16
    assert decoded({"max_tokens": None}).params.max_tokens is None
    frame = P.encode(P.GenerateRequest("a", [1, 2], SamplingParams(max_tokens=None)))
    assert P.decode(frame).params.max_tokens is None
    with pytest.raises(P.ProtocolError) as e:
        decoded({"max_tokens": -1})
    assert (e.value.code, e.value.field) == (P.INVALID_FIELD, "params.max_tokens")
    req = decoded({"n": 3}).to_request()
    assert (req.n, req.api, req.request_id, req.prompt) == (3, P.ZMQ, "a", [1, 2])


def test_the_limits_and_sampling_modules_import_each_other_no_more():
    import tpserve.limits
    source = open(tpserve.limits.__file__).read()
    assert "tpserve.sampling" not in source and "import sampling" not in source


# ---- through the engine: offline and ZMQ ----------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tiny_models_root):  # noqa: F811
    return make_tiny_model(tiny_models_root)


@pytest.fixture(scope="module")
def llm(tiny):
    from tpserve import LLM
    with LLM(str(tiny), dtype="float32", num_kv_blocks=64, block_size=4, max_model_len=MAX_MODEL_LEN) as llm:
        yield llm


PROMPT = [5, 6, 7, 8, 9, 10]


def test_offline_max_tokens_unset_is_16_and_none_the_rest_of_the_context(llm):
    (default,) = llm.generate([PROMPT], SamplingParams(temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert len(default.outputs[0].token_ids) == 16 and default.outputs[0].finish_reason == "length"
    (rest,) = llm.generate([PROMPT], SamplingParams(max_tokens=None, temperature=0.0, ignore_eos=True),
                           use_tqdm=False)
    assert len(rest.outputs[0].token_ids) == MAX_MODEL_LEN - len(PROMPT)
    assert rest.outputs[0].token_ids[:16] == default.outputs[0].token_ids


def test_offline_n_completions_come_from_the_engine(llm):
    params = SamplingParams(n=3, max_tokens=4, temperature=1.0, seed=9, ignore_eos=True)
    (out,) = llm.generate([PROMPT], params, use_tqdm=False)
    assert len(out.outputs) == 3 and all(len(c.token_ids) == 4 for c in out.outputs)
    (again,) = llm.generate([PROMPT], SamplingParams(n=3, max_tokens=4, temperature=1.0, seed=9,
                                                     ignore_eos=True), use_tqdm=False)
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]  # seed + i each


@pytest.fixture(scope="module")
def served(tiny):
    from tpserve.config import EngineConfig
    from tpserve.engine import Engine
    engine = Engine(EngineConfig(model=str(tiny), dtype="float32", num_kv_blocks=64, block_size=4,
                                 max_model_len=MAX_MODEL_LEN))
    server = ServerThread(engine, ServerOptions(shutdown_grace=0.0))
    yield server
    server.stop()
    engine.shutdown()


def test_zmq_max_tokens_unset_is_16_and_nil_the_rest_of_the_context(served):
    with Client(served.address, timeout=60) as c:
        default = c.generate(PROMPT, SamplingParams(temperature=0.0, ignore_eos=True))
        rest = c.generate(PROMPT, SamplingParams(max_tokens=None, temperature=0.0, ignore_eos=True))
    assert default.completion_tokens == 16 and default.finish_reason == "length"
    assert rest.completion_tokens == MAX_MODEL_LEN - len(PROMPT) and rest.finish_reason == "length"
    assert rest.token_ids[:16] == default.token_ids


def test_zmq_n_completions_come_from_the_engine_with_their_index(served):
    params = SamplingParams(n=2, max_tokens=3, temperature=0.0, ignore_eos=True)
    with Client(served.address, timeout=60) as c:
        whole = c.generate(PROMPT, params)
        deltas = list(c.stream(PROMPT, params))
    assert sorted(x.index for x in whole.completions) == [0, 1] and whole.completion_tokens == 6
    assert all(x.token_ids == whole.token_ids for x in whole.completions)  # greedy: the same tokens
    for i in (0, 1):
        assert [t for d in deltas if d.index == i for t in d.token_ids] == whole.token_ids


def test_zmq_model_checks_name_the_wire_field(served):
    """What depends on the model is the engine's check, named as the wire spells it."""
    with Client(served.address, timeout=60) as c:
        with pytest.raises(RequestError) as e:
            c.generate(PROMPT, SamplingParams(stop_token_ids=[10**6]))
    assert (e.value.code, e.value.field) == (P.INVALID_FIELD, "params.stop_token_ids[0]")
