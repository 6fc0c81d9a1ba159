"""Embeddings, rerank and score on the HTTP front (docs/embeddings.md).

In process, against a stand-in daemon client (``FakePool``: embed / classify / status with
known answers): the translation of every body form through the official `openai` client's
``embeddings.create`` (float and base64, ``dimensions``, every input form) and httpx for
rerank / score (ordering, top_n, return_documents, pairing), and the refusals: a 400 naming the
field for bad input, unknown fields and the wrong runner, the front still answering after them.
"""
from __future__ import annotations

import base64
import json
import math
import struct

import httpx
import openai
import pytest
from fastapi.testclient import TestClient

from model_factory import make_tiny_model, make_tokenizer, tiny_models_root  # noqa: F401 (a fixture)
from tpserve.client import protocol as P
from tpserve.client.client import RequestError
from tpserve.fronts.http.app import Front, create_app

MODEL = "m"
KEY = "k-123"
MAX_MODEL_LEN = 64


class Result:
    def __init__(self, data, prompt_tokens):
        self.data, self.prompt_tokens = data, prompt_tokens


def vector(ids: list[int]) -> list[float]:
    """The stand-in embedding of a prompt: a function of its token ids, L2-normalised."""
    v = [float(len(ids)), float(sum(ids) % 97), float(ids[0]), float(ids[-1]) + 0.5]
    n = math.sqrt(sum(x * x for x in v))
    return [x / n for x in v]


class FakePool:
    """The daemon client's pooling calls, recorded, with known answers."""

    def __init__(self, runner="pooling", task="embed"):
        self.runner, self.task = runner, task
        self.calls = []

    async def status(self, timeout=None):
        return {"runner": self.runner, "state": "running"}

    async def embed(self, prompts, *, dimensions=None, normalize=None, priority=0, timeout=None):
        self.calls.append(("embed", prompts,
                           dict(dimensions=dimensions, normalize=normalize, priority=priority)))
        if self.runner != "pooling":
            raise RequestError(P.INVALID_REQUEST, "this daemon runs --runner generate")
        if dimensions is not None and (not isinstance(dimensions, int) or dimensions > 4):
            raise RequestError(P.INVALID_FIELD, "the model has 4 dimensions", field="pooling.dimensions")
        out = []
        for p in prompts:
            v = vector(p)[:dimensions] if dimensions else vector(p)
            out.append(Result(v, len(p)))
        return out

    async def classify(self, prompts, *, priority=0, timeout=None):
        self.calls.append(("classify", prompts, dict(priority=priority)))
        if self.task == "embed":  # as the engine refuses it for a model without a score head
            raise RequestError(P.INVALID_FIELD, "this model has no score head", field="task")
        return [Result([1 / (1 + math.exp(-(sum(p) % 13 - 6)))], len(p)) for p in prompts]


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer(384)


def make(tokenizer, **kw):
    pool = FakePool(**kw)
    front = Front("ipc:///nonexistent/s.sock", "unused", MODEL, MAX_MODEL_LEN, api_key=KEY,
                  tokenizer=tokenizer)
    front._client = pool
    return pool, TestClient(create_app(front))


@pytest.fixture()
def served(tokenizer):
    return make(tokenizer)


def oai(http):
    return openai.OpenAI(base_url="http://testserver/v1", api_key=KEY, http_client=http, max_retries=0)


def post(http, path, body, key=KEY):
    return http.post(path, json=body, headers={"Authorization": f"Bearer {key}"} if key else {})


def ids_of(tokenizer, text, pair=None):
    return tokenizer(text, pair, add_special_tokens=True)["input_ids"]


# ---- /v1/embeddings through the openai client -------------------------------------------------
@pytest.mark.parametrize("fmt", ["float", "base64", None])
def test_every_input_form_through_the_openai_client(served, tokenizer, fmt):
    pool, http = served
    client = oai(http)
    texts = ["The quick brown fox", "Hello world!"]
    ids = [ids_of(tokenizer, t) for t in texts]
    kw = {} if fmt is None else {"encoding_format": fmt}  # None: the client's default (base64)
    for given, want in [(texts[0], ids[:1]), (texts, ids), (ids[1], ids[1:]), (ids, ids)]:
        reply = client.embeddings.create(model=MODEL, input=given, **kw)
        assert [d.index for d in reply.data] == list(range(len(want)))
        for d, p in zip(reply.data, want):
            assert d.object == "embedding"
            got = d.embedding
            if fmt == "base64":  # asked for explicitly, the client leaves it encoded
                got = list(struct.unpack(f"<{len(got) * 3 // 16}f", base64.b64decode(got)))
            assert got == pytest.approx(vector(p), rel=1e-6)
        assert reply.usage.prompt_tokens == reply.usage.total_tokens == sum(map(len, want))
        assert reply.model == MODEL
        assert pool.calls[-1][1] == want  # all inputs in one call: one batch on the daemon


def test_base64_is_little_endian_float32_bytes(served, tokenizer):
    _, http = served
    r = post(http, "/v1/embeddings", {"input": "Hello world!", "encoding_format": "base64"})
    assert r.status_code == 200, r.text
    raw = base64.b64decode(r.json()["data"][0]["embedding"])
    want = vector(ids_of(tokenizer, "Hello world!"))
    assert raw == struct.pack(f"<{len(want)}f", *want)  # exact: float32 bytes of each value
    big = post(http, "/v1/embeddings", {"input": "Hello world!", "encoding_format": "base64",
                                        "endianness": "big"}).json()["data"][0]["embedding"]
    assert base64.b64decode(big) == struct.pack(f">{len(want)}f", *want)
    floats = post(http, "/v1/embeddings", {"input": "Hello world!"}).json()
    assert floats["data"][0]["embedding"] == want  # the daemon's values as they are
    assert floats["object"] == "list" and floats["id"].startswith("embd-")


def test_dimensions_and_vllm_fields_reach_the_daemon(served, tokenizer):
    pool, http = served
    reply = oai(http).embeddings.create(model=MODEL, input="Hello world!", dimensions=2, user="me",
                                        extra_body={"priority": 3, "normalize": False})
    assert len(reply.data[0].embedding) == 2
    assert pool.calls[-1][2] == dict(dimensions=2, normalize=False, priority=3)
    r = post(http, "/v1/embeddings", {"input": "Hello", "use_activation": True, "request_id": "abc"})
    assert r.json()["id"] == "embd-abc" and pool.calls[-1][2]["normalize"] is True


def test_truncate_prompt_tokens_keeps_the_last_tokens_unless_told(served, tokenizer):
    pool, http = served
    ids = list(range(10, 30))
    assert post(http, "/v1/embeddings", {"input": ids, "truncate_prompt_tokens": 5}).status_code == 200
    assert pool.calls[-1][1] == [ids[-5:]]
    post(http, "/v1/embeddings", {"input": ids, "truncate_prompt_tokens": 5, "truncation_side": "right"})
    assert pool.calls[-1][1] == [ids[:5]]
    long = list(range(3, 3 + MAX_MODEL_LEN + 10))
    assert post(http, "/v1/embeddings", {"input": long, "truncate_prompt_tokens": -1}).status_code == 200
    assert pool.calls[-1][1] == [long[-MAX_MODEL_LEN:]]


def test_messages_are_rendered_by_the_chat_template():
    tokenizer = make_tokenizer(384)
    tokenizer.chat_template = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    pool, http = make(tokenizer)
    r = post(http, "/v1/embeddings", {"messages": [{"role": "user", "content": "Hello"}]})
    assert r.status_code == 200, r.text
    assert pool.calls[-1][1] == [tokenizer("user: Hello\n", add_special_tokens=False)["input_ids"]]


# ---- the request model ---------------------------------------------------------------------------
@pytest.mark.parametrize("pooling,prompts,priority,field", [
    ({"dimensions": 0}, ["a"], None, "dimensions"),
    ({"normalize": "yes"}, ["a"], None, "normalize"),
    ({"dimension": 2}, ["a"], None, None),
    ({}, [], None, "input"),
    ({}, ["a", ""], None, "input"),  # an item of a mapped field names the field
    ({}, [[1, -2]], None, "input"),
    ({}, ["a"] * 2049, None, "input"),
    ({}, ["a"], "high", "priority"),
])
def test_make_pooling_request_names_the_callers_field(pooling, prompts, priority, field):
    from tpserve.errors import InvalidFieldError
    from tpserve.fronts.http.embeddings_api import EMBEDDINGS
    from tpserve.request import make_pooling_request
    with pytest.raises(InvalidFieldError) as e:
        make_pooling_request(EMBEDDINGS, pooling, prompts, priority=priority)
    assert e.value.field == field
    ok = make_pooling_request(EMBEDDINGS, {"dimensions": 8, "normalize": False}, ["a", [5, 6]], priority=2)
    assert (ok.params.dimensions, ok.params.normalize) == (8, False)
    assert (ok.prompts, ok.priority) == (["a", [5, 6]], 2)


# ---- refusals ------------------------------------------------------------------------------------
@pytest.mark.parametrize("body,param", [
    ({}, "input"),
    ({"input": ""}, "input"),
    ({"input": []}, "input"),
    ({"input": [[]]}, "input"),
    ({"input": ["a", [1, 2]]}, "input"),
    ({"input": ["x"] * 2049}, "input"),
    ({"input": list(range(3, 3 + MAX_MODEL_LEN + 1))}, "input"),
    ({"input": "hi", "encoding_format": "bytes"}, "encoding_format"),
    ({"input": "hi", "embed_dtype": "float16"}, "embed_dtype"),
    ({"input": "hi", "dimensions": 9}, "dimensions"),
    ({"input": "hi", "dimension": 2}, "dimension"),
    ({"input": "hi", "cache_salt": "s"}, "cache_salt"),
    ({"input": "hi", "padding": "max_length"}, "padding"),
    ({"input": "hi", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"input": "hi", "user": 5}, "user"),
    ({"input": "hi", "normalize": True, "use_activation": False}, "use_activation"),
    ({"input": "hi", "messages": [{"role": "user", "content": "x"}]}, "messages"),
])
def test_bad_embedding_bodies_are_400s_naming_the_field(served, body, param):
    _, http = served
    r = post(http, "/v1/embeddings", body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
    assert post(http, "/v1/embeddings", {"input": "still serving"}).status_code == 200


def test_openai_client_raises_bad_request_for_empty_input(served):
    _, http = served
    with pytest.raises(openai.BadRequestError) as e:
        oai(http).embeddings.create(model=MODEL, input=[])
    assert e.value.body["param"] == "input"
    with pytest.raises(openai.NotFoundError):
        oai(http).embeddings.create(model="other", input="x")


def test_api_key_is_required(served):
    _, http = served
    for path, body in [("/v1/embeddings", {"input": "x"}), ("/v1/rerank", {"query": "q", "documents": ["d"]}),
                       ("/score", {"text_1": "a", "text_2": "b"})]:
        assert post(http, path, body, key=None).status_code == 401
        assert post(http, path, body, key="wrong").status_code == 401


def test_a_generate_daemon_refuses_pooling_naming_runner(tokenizer):
    pool, http = make(tokenizer, runner="generate")
    for path, body in [("/v1/embeddings", {"input": "x"}), ("/v2/rerank", {"query": "q", "documents": ["d"]}),
                       ("/score", {"text_1": "a", "text_2": "b"})]:
        r = post(http, path, body)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "--runner" and "--runner pooling" in r.json()["error"]["message"]
    assert pool.calls == []  # refused before anything was sent


# ---- rerank and score ----------------------------------------------------------------------------
def pair_score(tokenizer, a, b):
    p = ids_of(tokenizer, a, b)
    return 1 / (1 + math.exp(-(sum(p) % 13 - 6)))


@pytest.mark.parametrize("path", ["/rerank", "/v1/rerank", "/v2/rerank"])
def test_rerank_orders_by_the_pair_score(tokenizer, path):
    pool, http = make(tokenizer, task="classify")
    docs = ["A paged KV cache", "Hello world!", "The lazy dog", "Tensor parallel serving", "Once upon a time"]
    r = post(http, path, {"model": MODEL, "query": "What is a cache? ", "documents": docs})
    assert r.status_code == 200, r.text
    body = r.json()
    want = [pair_score(tokenizer, "What is a cache? ", d) for d in docs]
    order = sorted(range(len(docs)), key=lambda i: (-want[i], i))
    assert [x["index"] for x in body["results"]] == order
    assert [x["relevance_score"] for x in body["results"]] == pytest.approx([want[i] for i in order])
    assert [x["document"]["text"] for x in body["results"]] == [docs[i] for i in order]
    assert body["usage"]["total_tokens"] == sum(len(ids_of(tokenizer, "What is a cache? ", d)) for d in docs)
    assert pool.calls[-1][0] == "classify" and len(pool.calls[-1][1]) == len(docs)
    top = post(http, path, {"query": "What is a cache? ", "documents": [{"text": d} for d in docs],
                            "top_n": 2, "return_documents": False}).json()
    assert [x["index"] for x in top["results"]] == order[:2]
    assert all("document" not in x for x in top["results"])


def test_max_tokens_per_doc_cuts_each_document(tokenizer):
    pool, http = make(tokenizer, task="classify")
    doc = "Prefix caching lets requests that share a prompt share its blocks."
    r = post(http, "/v2/rerank", {"query": "q", "documents": [doc], "max_tokens_per_doc": 3})
    assert r.status_code == 200, r.text
    cut = tokenizer.decode(tokenizer(doc, add_special_tokens=False)["input_ids"][:3])
    assert pool.calls[-1][1] == [ids_of(tokenizer, "q" + cut)]


def test_an_embedding_model_scores_by_cosine(served, tokenizer):
    pool, http = served
    r = post(http, "/score", {"text_1": "Hello world!", "text_2": ["Hello world!", "The lazy dog"]})
    assert r.status_code == 200, r.text
    data = r.json()["data"]
    assert [d["index"] for d in data] == [0, 1] and data[0]["object"] == "score"
    q, d = vector(ids_of(tokenizer, "Hello world!")), vector(ids_of(tokenizer, "The lazy dog"))
    assert data[0]["score"] == pytest.approx(1.0)
    assert data[1]["score"] == pytest.approx(sum(a * b for a, b in zip(q, d)))
    assert pool.calls[-1][0] == "embed" and len(pool.calls[-1][1]) == 3  # the query embedded once
    assert [c[0] for c in pool.calls] == ["classify", "embed"]  # refused once, then remembered
    r = post(http, "/v1/rerank", {"query": "Hello world!", "documents": ["The lazy dog"]})
    assert r.status_code == 200, r.text
    assert [c[0] for c in pool.calls] == ["classify", "embed", "embed"]


@pytest.mark.parametrize("body,pairs", [
    ({"text_1": "a ", "text_2": "b"}, [("a ", "b")]),
    ({"text_1": ["a ", "c "], "text_2": ["b", "d"]}, [("a ", "b"), ("c ", "d")]),
    ({"text_1": ["a "], "text_2": ["b", "d"]}, [("a ", "b"), ("a ", "d")]),
    ({"queries": "a ", "documents": ["b", "d"]}, [("a ", "b"), ("a ", "d")]),
    ({"queries": "a ", "items": ["b"]}, [("a ", "b")]),
    ({"data_1": "a ", "data_2": ["b"]}, [("a ", "b")]),
])
def test_score_pairs_one_to_one_and_one_to_many(tokenizer, body, pairs):
    pool, http = make(tokenizer, task="classify")
    r = post(http, "/score", body)
    assert r.status_code == 200, r.text
    want = [pair_score(tokenizer, a, b) for a, b in pairs]
    assert [d["score"] for d in r.json()["data"]] == pytest.approx(want)
    assert pool.calls[-1][1] == [ids_of(tokenizer, a, b) for a, b in pairs]


@pytest.mark.parametrize("path,body,param", [
    ("/v1/rerank", {"documents": ["d"]}, "query"),
    ("/v1/rerank", {"query": "q"}, "documents"),
    ("/v1/rerank", {"query": "q", "documents": []}, "documents"),
    ("/v1/rerank", {"query": "q", "documents": [{"title": "t"}]}, "documents[0].text"),
    ("/v1/rerank", {"query": "q", "documents": ["d", 3]}, "documents[1]"),
    ("/v1/rerank", {"query": "q", "documents": ["d"] * 1025}, "documents"),
    ("/v1/rerank", {"query": "q", "documents": ["d"], "top_n": -1}, "top_n"),
    ("/v1/rerank", {"query": "q", "documents": ["d"], "max_chunks_per_doc": 2}, "max_chunks_per_doc"),
    ("/v1/rerank", {"query": "q", "documents": ["d"], "rank_fields": ["title"]}, "rank_fields"),
    ("/v1/rerank", {"query": "q", "documents": ["d"], "use_activation": False}, "use_activation"),
    ("/v1/rerank", {"query": "q", "documents": ["d"], "topn": 1}, "topn"),
    ("/v1/rerank", {"query": "q", "documents": ["x" * 200]}, "documents"),
    ("/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_1"),
    ("/score", {"text_1": "a"}, "text_2"),
    ("/score", {"text_1": "a", "text_2": []}, "text_2"),
    ("/score", {"text_1": "a", "text_2": "b", "queries": "c"}, "queries"),
    ("/score", {"text_1": "a", "text_2": "b", "softmax": False}, "softmax"),
])
def test_bad_rerank_and_score_bodies_are_400s_naming_the_field(tokenizer, path, body, param):
    pool, http = make(tokenizer, task="classify")
    r = post(http, path, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
    assert post(http, path, {"query": "q", "documents": ["d"]} if "rerank" in path
                else {"text_1": "a", "text_2": "b"}).status_code == 200


def test_errors_of_the_daemon_name_the_body_field(served):
    _, http = served
    r = post(http, "/v1/embeddings", {"input": "hi", "dimensions": 7})
    assert r.status_code == 400 and r.json()["error"]["param"] == "dimensions"


# ---- a real daemon -----------------------------------------------------------------------------
# A tiny random-weight Qwen3 model served with --runner pooling and two of its token ids as the
# yes/no score tokens (a reranker read from the LM head's rows); references from transformers, fp32.
DAEMON_LEN = 96  # --max-model-len
NO_ID, YES_ID = 300, 301
TEXTS = ["The quick brown fox jumps over the lazy dog.", "Hello world!",
         "A paged KV cache stores keys and values in fixed-size blocks."]


@pytest.fixture(scope="module")
def pooled(tiny_models_root):
    from test_http import HttpDaemon
    path = make_tiny_model(tiny_models_root, max_position_embeddings=256)
    env = {"TPSERVE_MODEL": str(path), "TPSERVE_RUNNER": "pooling", "TPSERVE_MAX_MODEL_LEN": str(DAEMON_LEN),
           "TPSERVE_DTYPE": "float32",
           "TPSERVE_POOLER_CONFIG": json.dumps({"score_token_ids": [NO_ID, YES_ID]})}
    d = HttpDaemon(api_key=KEY, env=env)
    d.path = path
    yield d
    d.stop()


@pytest.fixture(scope="module")
def reference(pooled):
    """transformers' fp32 model and tokenizer of the daemon's checkpoint."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(pooled.path, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(pooled.path)


def hf_embedding(reference, ids: list[int], dims: int | None = None) -> list[float]:
    import torch
    model, _ = reference
    with torch.inference_mode():
        h = model.model(input_ids=torch.tensor([ids])).last_hidden_state[0, -1].double()
    h = h[:dims] if dims else h
    return (h / h.norm()).tolist()


def hf_yes_no(reference, ids: list[int]) -> float:
    import torch
    model, _ = reference
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([ids])).logits[0, -1].double()
    return float(torch.sigmoid(logits[YES_ID] - logits[NO_ID]))


def cos(a, b) -> float:
    return sum(x * y for x, y in zip(a, b)) / math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))


def real_client(d):
    return openai.OpenAI(base_url=d.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def real_post(d, path, body):
    return httpx.post(d.url + path, json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=120)


def test_embeddings_equal_transformers_for_every_input_form(pooled, reference):
    client = real_client(pooled)
    tok = reference[1]
    ids = [tok(t)["input_ids"] for t in TEXTS]
    want = [hf_embedding(reference, p) for p in ids]
    for fmt in ("float", None):  # None: the client's default, base64
        kw = {} if fmt is None else {"encoding_format": fmt}
        for given, expect in [(TEXTS[0], want[:1]), (TEXTS, want), (ids[1], want[1:2]), (ids, want)]:
            reply = client.embeddings.create(model=pooled.path.name, input=given, **kw)
            assert len(reply.data) == len(expect)
            for d, w in zip(reply.data, expect):
                assert cos(d.embedding, w) >= 0.9999
                assert abs(sum(x * x for x in d.embedding) - 1) < 1e-4
    dims = client.embeddings.create(model=pooled.path.name, input=ids[0], dimensions=16)
    assert len(dims.data[0].embedding) == 16
    assert cos(dims.data[0].embedding, hf_embedding(reference, ids[0], 16)) >= 0.9999
    assert dims.usage.prompt_tokens == len(ids[0])


def test_base64_decodes_to_the_float_answer(pooled):
    floats = real_post(pooled, "/v1/embeddings", {"input": TEXTS[2]}).json()["data"][0]["embedding"]
    b64 = real_post(pooled, "/v1/embeddings", {"input": TEXTS[2], "encoding_format": "base64"}).json()
    raw = base64.b64decode(b64["data"][0]["embedding"])
    assert list(struct.unpack(f"<{len(raw) // 4}f", raw)) == floats


def test_rerank_and_score_equal_the_yes_no_formula(pooled, reference):
    tok = reference[1]
    query = "Which text is about caches? "
    r = real_post(pooled, "/v1/rerank", {"query": query, "documents": TEXTS, "top_n": 2})
    assert r.status_code == 200, r.text
    want = [hf_yes_no(reference, tok(query, t)["input_ids"]) for t in TEXTS]
    order = sorted(range(3), key=lambda i: -want[i])
    results = r.json()["results"]
    assert [x["index"] for x in results] == order[:2]
    for x in results:
        assert x["relevance_score"] == pytest.approx(want[x["index"]], abs=1e-4)
    s = real_post(pooled, "/score", {"text_1": query, "text_2": TEXTS}).json()
    assert [d["score"] for d in s["data"]] == pytest.approx(want, abs=1e-4)


@pytest.mark.parametrize("path,body,param", [
    ("/v1/embeddings", {"input": ""}, "input"),
    ("/v1/embeddings", {"input": []}, "input"),
    ("/v1/embeddings", {"input": ["x"] * 2049}, "input"),
    ("/v1/embeddings", {"input": list(range(3, 3 + DAEMON_LEN + 1))}, "input"),
    ("/v1/embeddings", {"input": [[5, 6], [7, 10**6]]}, "input"),
    ("/v1/embeddings", {"input": "hi", "dimensions": 10**4}, "dimensions"),
    ("/v1/embeddings", {"input": "hi", "encodingformat": "float"}, "encodingformat"),
    ("/v1/rerank", {"query": "q", "documents": ["d"], "top": 1}, "top"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2}, "--runner"),
    ("/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 1, "stream": True}, "--runner"),
])
def test_bad_input_is_a_400_naming_the_field_and_the_daemon_serves_on(pooled, path, body, param):
    r = real_post(pooled, path, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
    if param == "--runner":
        assert "--runner" in r.json()["error"]["message"]
    assert real_post(pooled, "/v1/embeddings", {"input": "still serving"}).status_code == 200
