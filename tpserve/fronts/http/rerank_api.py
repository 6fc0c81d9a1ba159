"""Reranking and scoring on the HTTP front: ``POST /rerank``, ``/v1/rerank``, ``/v2/rerank``
(Cohere's and Jina's shape, as vLLM serves it) and ``POST /score``, ``/v1/score`` (vLLM's)
(docs/embeddings.md).

Translators onto the daemon's pooling calls, like embeddings_api.py (whose body checks, runner
check and daemon call they share). How a (query, document) pair is scored depends on the
model the pooling daemon serves:

* a reranker (a ``*ForSequenceClassification`` checkpoint with one label, or a causal LM read as
  a yes/no reranker, Qwen3-Reranker's way): the pair is one prompt, tokenized as a pair by the
  model's tokenizer (its pair template: a cross-encoder's separator; a decoder's tokenizer
  just follows the query's tokens with the document's), as vLLM and ``LLM.score`` do; a model's
  prompt format, e.g. Qwen3-Reranker's instruction around them, is the client's to write; the
  score is ``Client.classify``'s;
* a model the daemon cannot classify with (no score head, no score tokens: its refusal names
  ``task``): the cosine similarity of the two texts' embeddings (one ``Client.embed`` call for
  all of them), as vLLM scores with an embedding model.

Rerank body: ``query`` (a string), ``documents`` (strings, or objects with ``text``: Cohere v1
and Jina), ``top_n`` (0 or absent: all), ``return_documents`` (default true: vLLM always returns
them), Cohere v2's ``max_tokens_per_doc`` (each document cut to that many tokens), Cohere v1's
``rank_fields`` (only ``["text"]``) and ``max_chunks_per_doc`` (refused: no chunking), vLLM's
``truncate_prompt_tokens``, ``truncation_side``, ``priority``, ``request_id``, ``use_activation``
(and its old names ``softmax`` / ``activation``: only true, the score is the sigmoid's).
Results are sorted by ``relevance_score``, best first (ties by index), each with the document's
``index`` in the request.

Score body: ``text_1`` and ``text_2`` (vLLM's; also its ``queries`` + ``documents`` / ``items``
and ``data_1`` + ``data_2`` spellings), each a string or an array of strings: one to one
(equal lengths) or one to many (``text_1`` a single text); the same vLLM fields otherwise.
"""
from __future__ import annotations

import math
import time

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from tpserve.fronts.http import openai_api as O
from tpserve.fronts.http.agent_common import new_id
from tpserve.fronts.http.embeddings_api import (
    COMMON_FIELDS, PoolJob, call_daemon, check_body, classify_call, embed_call, read_common, require_pooling,
    tokenize, too_long, truncated, usage)
from tpserve.request import REST_OF_CONTEXT, Api

MAX_DOCUMENTS = 1024  # documents of one rerank request, pairs of one score request
#: How the rerank and score endpoints spell a pooling request (tpserve/request.py): its prompts
#: are the documents (score: the second texts, as the body names them).
RERANK = Api("rerank", REST_OF_CONTEXT, names={"prompt": "documents"})
_ACTIVATION = ("use_activation", "softmax", "activation")
_RERANK_FIELDS = COMMON_FIELDS + _ACTIVATION + (
    "query", "documents", "top_n", "return_documents", "max_tokens_per_doc", "rank_fields",
    "max_chunks_per_doc")
_PAIRS = (("text_1", "text_2"), ("queries", "documents"), ("queries", "items"), ("data_1", "data_2"))
_SCORE_FIELDS = COMMON_FIELDS + _ACTIVATION + tuple(name for pair in _PAIRS for name in pair)


def _activation(body: dict) -> None:
    """vLLM's ``use_activation`` (and its deprecated names): the score is always the sigmoid's."""
    for name in _ACTIVATION:
        v = body.get(name)
        if v is None:
            continue
        if not isinstance(v, bool):
            raise O.bad(name, f"must be a boolean, got {type(v).__name__}")
        if not v:
            raise O.bad(name, "only true is supported: scores are the model's probabilities",
                        code="unsupported_parameter")


def _text(name: str, v) -> str:
    if not isinstance(v, str):
        raise O.bad(name, f"must be a string, got {type(v).__name__}")
    if not v:
        raise O.bad(name, "must not be empty")
    return v


def parse_rerank(body, served_name: str) -> tuple[PoolJob, str, list[str], int, bool, int | None]:
    """(job, query, documents, top_n (0: all), return_documents, max_tokens_per_doc) of a rerank body."""
    body = check_body(body, served_name, _RERANK_FIELDS)
    job = read_common(body, PoolJob([], api=RERANK, names={"prompt": "documents"}))
    _activation(body)
    if body.get("query") is None:
        raise O.bad("query", "is required", code="missing_required_parameter")
    query = _text("query", body["query"])
    docs = body.get("documents")
    if docs is None:
        raise O.bad("documents", "is required", code="missing_required_parameter")
    if not isinstance(docs, list) or not docs:
        raise O.bad("documents", "must be a non-empty array of strings or of objects with text")
    if len(docs) > MAX_DOCUMENTS:
        raise O.bad("documents", f"at most {MAX_DOCUMENTS} documents per request, got {len(docs)}")
    texts = []
    for i, d in enumerate(docs):
        if isinstance(d, dict):
            if "text" not in d:
                raise O.bad(f"documents[{i}].text", "is required in a document object",
                            code="missing_required_parameter")
            texts.append(_text(f"documents[{i}].text", d["text"]))
        else:
            texts.append(_text(f"documents[{i}]", d))
    fields = body.get("rank_fields")
    if fields is not None and fields != ["text"]:
        raise O.bad("rank_fields", "only [\"text\"] is supported: documents are ranked by their text",
                    code="unsupported_parameter")
    if body.get("max_chunks_per_doc") is not None:
        raise O.bad("max_chunks_per_doc", "is not supported (documents are not chunked; "
                                          "use max_tokens_per_doc or truncate_prompt_tokens)",
                    code="unsupported_parameter")
    top_n = O._int(body, "top_n", 0, 2**31 - 1, 0)
    per_doc = O._int(body, "max_tokens_per_doc", 1, 2**31 - 1, None)
    return job, query, texts, top_n, O._bool(body, "return_documents", True), per_doc


def _texts(name: str, v) -> list[str]:
    if isinstance(v, str):
        return [_text(name, v)]
    if not isinstance(v, list) or not v:
        raise O.bad(name, "must be a string or a non-empty array of strings")
    return [_text(f"{name}[{i}]", t) for i, t in enumerate(v)]


def parse_score(body, served_name: str) -> tuple[PoolJob, list[tuple[str, str]]]:
    """(job, the (text_1, text_2) pairs) of a score body."""
    body = check_body(body, served_name, _SCORE_FIELDS)
    present = [name for pair in _PAIRS for name in pair if body.get(name) is not None]
    if not present:
        raise O.bad("text_1", "is required (with text_2)", code="missing_required_parameter")
    first = present[0] if present[0] != "documents" else "queries"
    second = {"text_1": "text_2", "data_1": "data_2", "text_2": "text_2", "data_2": "data_2"}.get(first)
    if first in ("text_2", "data_2"):
        first = second.replace("2", "1")
    if second is None:  # vLLM's queries with documents or items
        first, second = "queries", "items" if body.get("items") is not None else "documents"
    stray = [name for name in present if name not in (first, second)]
    if stray:
        raise O.bad(stray[0], f"send one pair of fields ({first}, {second}), not two")
    for name in (first, second):
        if body.get(name) is None:
            raise O.bad(name, "is required", code="missing_required_parameter")
    job = read_common(body, PoolJob([], api=RERANK, names={"prompt": second}))
    _activation(body)
    left, right = _texts(first, body[first]), _texts(second, body[second])
    if len(left) == 1:
        left = left * len(right)
    elif len(left) != len(right):
        raise O.bad(first, f"must be one text, or as many as {second} ({len(right)}), got {len(left)}")
    if len(right) > MAX_DOCUMENTS:
        raise O.bad(second, f"at most {MAX_DOCUMENTS} pairs per request, got {len(right)}")
    return job, list(zip(left, right))


# ---- scoring ---------------------------------------------------------------------------------
def scores_by_embedding(info: dict) -> bool:
    """Whether the daemon's model scores pairs by the cosine of embeddings (an embedding model)
    rather than by ``classify`` (a reranker); ``info``: Front.daemon_info, whose
    ``pooling_score`` is set once the daemon refused classify for want of a score head."""
    return info.get("pooling_score") == "embed"


def cosine(a, b) -> float:
    dot = sum(x * y for x, y in zip(a, b))
    na = math.sqrt(sum(x * x for x in a))
    nb = math.sqrt(sum(y * y for y in b))
    return dot / (na * nb) if na and nb else 0.0


async def score_pairs(front, request: Request, job: PoolJob, pairs: list[tuple[str, str]], info: dict,
                      daemon_error, daemon_errors) -> tuple[list[float], int]:
    """The score of each (text_1, text_2) pair and the prompt tokens the daemon read: by
    ``classify``, or by the cosine of embeddings on a model without a score head (the daemon's
    refusal of classify names ``task``; remembered in ``info``)."""
    field = job.names["prompt"]

    async def run(texts: list[str], call):
        job.build(texts)
        prompts = await tokenize(front, texts, True, field)
        prompts = truncated(job, prompts, front.max_model_len)
        too_long(job, prompts, front.max_model_len)
        return await call_daemon(front, request, job, call(front, job, prompts), daemon_error, daemon_errors)

    if not scores_by_embedding(info):
        try:
            if front.tokenizer is None:
                raise O.bad(field, "this model has no tokenizer: send token ids")
            tok, firsts, seconds = front.tokenizer, [a for a, _ in pairs], [b for _, b in pairs]
            job.build([a + b for a, b in pairs])
            prompts = [list(ids) for ids in await front._in_pool(lambda: tok(firsts, seconds)["input_ids"])]
            prompts = truncated(job, prompts, front.max_model_len)
            too_long(job, prompts, front.max_model_len)
            results = await call_daemon(front, request, job, classify_call(front, job, prompts), daemon_error,
                                        daemon_errors)
            return [float(r.data[0]) for r in results], sum(r.prompt_tokens for r in results)
        except O.OpenAIError as e:
            if e.param != "task":  # anything but "this model has no score head"
                raise
            info["pooling_score"] = "embed"
    firsts = list(dict.fromkeys(a for a, _ in pairs))
    results = await run(firsts + [b for _, b in pairs], embed_call)
    vectors = {a: r.data for a, r in zip(firsts, results)}
    scores = [cosine(vectors[a], r.data) for (a, _), r in zip(pairs, results[len(firsts):])]
    return scores, sum(r.prompt_tokens for r in results)


async def cut_documents(front, docs: list[str], limit: int | None) -> list[str]:
    """Each document cut to its first ``limit`` tokens (Cohere's max_tokens_per_doc)."""
    if limit is None:
        return docs
    ids = await tokenize(front, docs, False, "documents")
    return [await front.decode(t[:limit]) if len(t) > limit else d for d, t in zip(docs, ids)]


def rerank_response(job: PoolJob, docs: list[str], scores: list[float], tokens: int, top_n: int,
                    return_documents: bool, model: str) -> dict:
    order = sorted(range(len(scores)), key=lambda i: (-scores[i], i))
    if top_n:
        order = order[:top_n]
    results = []
    for i in order:
        item = {"index": i, "relevance_score": scores[i]}
        if return_documents:
            item["document"] = {"text": docs[i]}
        results.append(item)
    return {"id": f"rerank-{job.request_id}" if job.request_id else new_id("rerank-"), "model": model,
            "usage": usage(tokens), "results": results}


def score_response(job: PoolJob, scores: list[float], tokens: int, model: str) -> dict:
    return {"id": f"score-{job.request_id}" if job.request_id else new_id("score-"), "object": "list",
            "created": int(time.time()), "model": model,
            "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
            "usage": {**usage(tokens), "completion_tokens": 0}}


# ---- routes ----------------------------------------------------------------------------------
def make_rerank_router(front, authorize, read_json, daemon_error, daemon_errors) -> APIRouter:
    """The rerank and score routes of one front (app.Front); ``authorize``: its API-key check."""
    router = APIRouter(dependencies=[Depends(authorize)])

    async def rerank(request: Request):
        body = await read_json(request)
        job, query, docs, top_n, return_documents, per_doc = parse_rerank(body, front.model_name)
        info = await require_pooling(front, request.url.path, daemon_error, daemon_errors)
        ranked = await cut_documents(front, docs, per_doc)
        scores, tokens = await score_pairs(front, request, job, [(query, d) for d in ranked], info,
                                           daemon_error, daemon_errors)
        return JSONResponse(rerank_response(job, docs, scores, tokens, top_n, return_documents,
                                            front.model_name))

    async def score(request: Request):
        body = await read_json(request)
        job, pairs = parse_score(body, front.model_name)
        info = await require_pooling(front, request.url.path, daemon_error, daemon_errors)
        scores, tokens = await score_pairs(front, request, job, pairs, info, daemon_error, daemon_errors)
        return JSONResponse(score_response(job, scores, tokens, front.model_name))

    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        router.add_api_route(path, rerank, methods=["POST"])
    for path in ("/score", "/v1/score"):
        router.add_api_route(path, score, methods=["POST"])
    return router
