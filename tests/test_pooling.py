"""--runner pooling: embeddings and scores against transformers (fp32, random-weight Qwen3), offline
(LLM.embed / classify / score) and through the daemon (Client / AsyncClient.embed / classify);
MEAN / CLS pooling, ``dimensions``, chunked prompts, the prefix cache, bad input, the wrong runner."""
from __future__ import annotations

import asyncio
import json
import shutil
import time

import numpy as np
import pytest
import torch
import transformers

from model_factory import make_tiny_model, tiny_models_root  # noqa: F401
from test_daemon import ServerThread
from tpserve.client.client import AsyncClient, Client, RequestError
from tpserve.config import OFFLINE_POOLING_MAX_NUM_BATCHED_TOKENS, EngineConfig
from tpserve.engine import Engine
from tpserve.errors import ConfigError, InvalidFieldError, InvalidRequestError
from tpserve.llm import LLM
from tpserve.pooling import MAX_POOLING_INPUTS, PoolerConfig, PoolingParams
from tpserve.sampling import SamplingParams

PROMPTS = [[3, 4, 5, 6, 7, 8], list(range(10, 75)), [9], [3, 4, 5, 6, 7, 8, 20, 21, 22]]
NO, YES = 5, 7  # the score tokens of the tiny models' yes/no reranker


@pytest.fixture(scope="module")
def model(tiny_models_root):  # noqa: F811
    path = make_tiny_model(tiny_models_root, arch="qwen3", max_position_embeddings=128)
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return path, ref


def hidden_states(ref, ids) -> torch.Tensor:
    """The final hidden states [len, hidden] of ``ids`` by transformers."""
    with torch.no_grad():
        return ref(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0]


def reference(ref, ids, pooling="LAST", dims=None, normalize=True) -> np.ndarray:
    h = hidden_states(ref, ids)
    v = {"LAST": h[-1], "MEAN": h.mean(0), "CLS": h[0]}[pooling].double()
    v = v[:dims] if dims else v
    return (v / v.norm() if normalize else v).numpy()


def yes_no(ref, ids) -> float:
    with torch.no_grad():
        logits = ref(torch.tensor([ids])).logits[0, -1].double()
    return float(torch.sigmoid(logits[YES] - logits[NO]))


def cosine(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


def pooling_engine(path, **kw) -> Engine:
    kw.setdefault("num_kv_blocks", 64)
    kw.setdefault("block_size", 4)
    return Engine(EngineConfig(model=str(path), dtype="float32", runner="pooling", **kw))


def run(engine: Engine, rid: str, prompts, params=None, steps=200):
    engine.add_pooling_request(rid, prompts, params)
    for _ in range(steps):
        for out in engine.step():
            if out.request_id == rid:
                return out
    raise AssertionError("no output")


# ---- offline ---------------------------------------------------------------------------------
def test_llm_embed_classify_score_match_transformers(model):
    path, ref = model
    llm = LLM(str(path), runner="pooling", num_kv_blocks=64, dtype="float32",
              pooler_config={"score_token_ids": [NO, YES]})
    try:
        # A pooling engine's offline step budget is its own (prompt rows only; config.py).
        assert llm.engine.scheduler.max_num_batched_tokens == OFFLINE_POOLING_MAX_NUM_BATCHED_TOKENS
        outs = llm.embed(PROMPTS)
        assert [o.prompt_token_ids for o in outs] == PROMPTS
        for ids, o in zip(PROMPTS, outs):
            e = np.array(o.outputs.embedding)
            assert o.outputs.hidden_size == 64 and abs(np.linalg.norm(e) - 1) < 1e-5
            assert cosine(e, reference(ref, ids)) >= 0.9999
        one = llm.embed(PROMPTS[0], dimensions=16)[0].outputs.embedding  # Matryoshka: cut, then normalised
        assert len(one) == 16 and cosine(one, reference(ref, PROMPTS[0], dims=16)) >= 0.9999
        raw = llm.embed([PROMPTS[1]], PoolingParams(normalize=False))[0].outputs.embedding
        assert np.allclose(raw, hidden_states(ref, PROMPTS[1])[-1].numpy(), rtol=1e-4, atol=1e-4)
        text = llm.embed("The quick brown fox")[0]
        assert text.prompt_token_ids == llm.tokenizer.encode("The quick brown fox")
        assert cosine(text.outputs.embedding, reference(ref, text.prompt_token_ids)) >= 0.9999
        probs = llm.classify(PROMPTS)
        for ids, o in zip(PROMPTS, probs):
            assert len(o.outputs.probs) == 1 and abs(o.outputs.probs[0] - yes_no(ref, ids)) < 1e-5
        scores = llm.score([3, 4, 5], [[6, 7], [8, 9, 10]])
        assert [s.prompt_token_ids for s in scores] == [[3, 4, 5, 6, 7], [3, 4, 5, 8, 9, 10]]
        for s in scores:
            assert abs(s.outputs.score - yes_no(ref, s.prompt_token_ids)) < 1e-5
        st = llm.stats()
        assert st["runner"] == "pooling" and st["pooling_requests"] == 6
        assert st["pooling_prompt_tokens"] == (sum(map(len, PROMPTS)) * 2 + len(PROMPTS[0]) + len(PROMPTS[1])
                                               + 5 + 6 + len(text.prompt_token_ids))
        with pytest.raises(InvalidRequestError, match="--runner"):
            llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)
        llm.engine.check_integrity()
    finally:
        llm.shutdown()


@pytest.mark.parametrize("pooling", ["MEAN", "CLS"])
def test_mean_and_cls_pooling_over_chunks(model, pooling):
    """A 65-token prompt in 16-token chunks (MEAN sums every chunk, CLS takes the first row),
    beside short prompts in the same steps; a second run of the same prompts (blocks cached by
    the first) is pooled identically (MEAN and CLS compute every row again)."""
    path, ref = model
    engine = pooling_engine(path, max_num_batched_tokens=16, max_stall_tokens=16,
                            pooler_config={"pooling_type": pooling.lower()})
    try:
        for rid in ("a", "b"):
            out = run(engine, rid, PROMPTS)
            assert out.finished and out.finish_reason == "stop"
            assert out.pooled_prompt_tokens == list(map(len, PROMPTS))
            for ids, vec in zip(PROMPTS, out.pooled):
                assert cosine(vec, reference(ref, ids, pooling)) >= 0.9999, (rid, len(ids))
        engine.check_integrity()
    finally:
        engine.shutdown()


def test_last_pooling_shares_the_prefix_cache_with_generation(model):
    """Pooling requests hash their full blocks: a generation request (on a generate engine
    the cache is the same code) ... here: a second pooling of a shared prefix hits the cache,
    holds no block once done, and still equals transformers."""
    path, ref = model
    engine = pooling_engine(path)
    try:
        base = list(range(20, 52))  # 8 full blocks of 4
        run(engine, "a", [base])
        hits = engine.stats()["prefix_cache_hit_tokens"]
        out = run(engine, "b", [base + [60, 61], base])
        assert engine.stats()["prefix_cache_hit_tokens"] - hits >= 32 + 31
        assert cosine(out.pooled[0], reference(ref, base + [60, 61])) >= 0.9999
        assert cosine(out.pooled[1], reference(ref, base)) >= 0.9999
        assert engine.scheduler.block_manager.num_used_blocks == 0
        engine.check_integrity()
    finally:
        engine.shutdown()


def test_many_short_inputs_are_scheduled_together(model):
    path, ref = model
    engine = pooling_engine(path, num_kv_blocks=256, max_num_batched_tokens=512)
    try:
        prompts = [[10 + i, 11 + i, 12 + i] for i in range(40)]
        engine.add_pooling_request("many", prompts, PoolingParams())
        outs = engine.step()  # one step computes all 40
        assert [o.request_id for o in outs] == ["many"] and len(outs[0].pooled) == 40
        assert engine.num_steps == 1
        for ids, vec in zip(prompts[::13], outs[0].pooled[::13]):
            assert cosine(vec, reference(ref, ids)) >= 0.9999
    finally:
        engine.shutdown()


def test_sequence_classification_checkpoint(tmp_path, model):
    """A Qwen3ForSequenceClassification checkpoint with one label: sigmoid(score . last hidden)."""
    path, _ = model
    cls_dir = tmp_path / "cls"
    shutil.copytree(path, cls_dir)
    cfg = json.loads((cls_dir / "config.json").read_text())
    cfg.update(architectures=["Qwen3ForSequenceClassification"], num_labels=1)
    (cls_dir / "config.json").write_text(json.dumps(cfg))
    torch.manual_seed(3)
    clf = transformers.AutoModelForSequenceClassification.from_pretrained(cls_dir, dtype=torch.float32)
    with torch.no_grad():
        clf.score.weight.normal_(0, 0.3)
    clf.save_pretrained(cls_dir)
    engine = pooling_engine(cls_dir)
    try:
        out = run(engine, "c", PROMPTS, PoolingParams("classify"))
        for ids, (score,) in zip(PROMPTS, out.pooled):
            with torch.no_grad():
                want = torch.sigmoid(clf(torch.tensor([ids])).logits[0, 0]).item()
            assert abs(score - want) < 1e-5
    finally:
        engine.shutdown()


def test_bad_input_names_the_field_and_leaks_nothing(model):
    path, _ = model
    engine = pooling_engine(path, max_model_len=100)
    try:
        cases = [([], "prompts"), ([[1, 2]] * (MAX_POOLING_INPUTS + 1), "prompts"),
                 ([[1, 2], []], "prompts[1]"),
                 ([[1, 2], list(range(101))], "prompts[1]"), ([[1, 10**6]], "prompts[0][1]")]
        for prompts, field in cases:
            with pytest.raises(InvalidFieldError) as e:
                engine.add_pooling_request("bad", prompts)
            assert e.value.field == field
        with pytest.raises(InvalidFieldError, match="dimensions"):
            engine.add_pooling_request("bad", [[1, 2]], PoolingParams(dimensions=65))
        with pytest.raises(InvalidFieldError) as e:
            engine.add_pooling_request("bad", [[1, 2]], PoolingParams("classify"))  # no score tokens
        assert e.value.field == "task"
        with pytest.raises(InvalidRequestError, match="--runner"):
            engine.add_request("gen", [1, 2, 3])
        assert not engine.has_unfinished() and not engine.requests and not engine.families
        engine.check_integrity()
        assert run(engine, "ok", [[1, 2, 3]]).pooled  # still serving
        # past its deadline: one output, finish_reason "timeout", no result; aborted midway: nothing
        engine.add_pooling_request("late", PROMPTS, timeout=1.0, arrival=time.monotonic() - 5)
        (out,) = engine.step()
        assert (out.request_id, out.finished, out.finish_reason) == ("late", True, "timeout")
        assert out.pooled is None
        engine.add_pooling_request("gone", [list(range(1, 99))] * 3)
        engine.step()
        assert engine.abort_request("gone") and not engine.has_unfinished()
        engine.check_integrity()
    finally:
        engine.shutdown()
    with pytest.raises(InvalidFieldError, match="dimensions"):
        PoolingParams("classify", dimensions=4)
    with pytest.raises(ConfigError) as e:
        PoolerConfig.from_value({"pooling_type": "ALL"})
    assert e.value.field == "pooler_config.pooling_type"
    with pytest.raises(ConfigError) as e:
        EngineConfig(pooler_config={"normalise": True}, runner="pooling")
    assert e.value.field == "pooler_config.normalise"


# ---- through the daemon ----------------------------------------------------------------------
def test_client_embed_and_classify_through_the_daemon(model):
    path, ref = model
    engine = pooling_engine(path, pooler_config={"score_token_ids": [NO, YES]})
    try:
        with ServerThread(engine) as s, Client(s.address, timeout=60) as c:
            got = c.embed(PROMPTS)
            assert [r.prompt_tokens for r in got] == list(map(len, PROMPTS))
            for ids, r in zip(PROMPTS, got):
                assert cosine(r.data, reference(ref, ids)) >= 0.9999
            cut = c.embed(PROMPTS[:1], dimensions=8, normalize=False)[0].data
            assert np.allclose(cut, hidden_states(ref, PROMPTS[0])[-1, :8].numpy(), rtol=1e-4, atol=1e-4)
            for ids, r in zip(PROMPTS, c.classify(PROMPTS)):
                assert abs(r.data[0] - yes_no(ref, ids)) < 1e-5
            bad = (([], "prompts"), ([[1], []], "prompts[1]"), ([list(range(200))], "prompts[0]"))
            for prompts, field in bad:
                with pytest.raises(RequestError) as e:
                    c.embed(prompts)
                assert e.value.field == field and e.value.code == "invalid_field"
            with pytest.raises(RequestError) as e:
                c.embed([[1, 2]], dimensions=100)
            assert e.value.field == "dimensions"
            with pytest.raises(RequestError) as e:
                c.generate([1, 2, 3], max_tokens=2)
            assert "--runner" in e.value.message and e.value.code == "invalid_request"

            async def both():
                async with AsyncClient(s.address, timeout=60) as a:
                    return await asyncio.gather(a.embed(PROMPTS[:2]), a.classify(PROMPTS[2:]))
            emb, cls = asyncio.run(both())
            assert cosine(emb[1].data, reference(ref, PROMPTS[1])) >= 0.9999
            assert abs(cls[0].data[0] - yes_no(ref, PROMPTS[2])) < 1e-5
            st = c.status()
            assert st["runner"] == "pooling" and st["pooling_requests"] == 5
            metrics = c.metrics()
            assert "tpserve:pooling_requests_total" in metrics
            assert "tpserve:pooling_prompt_tokens_total" in metrics
            assert st["kv_blocks_used"] == 0
        engine.check_integrity()
    finally:
        engine.shutdown()


def test_pooling_call_to_a_generate_daemon_names_the_runner(model):
    path, _ = model
    engine = Engine(EngineConfig(model=str(path), dtype="float32", num_kv_blocks=32, block_size=4))
    try:
        with ServerThread(engine) as s, Client(s.address, timeout=60) as c:
            with pytest.raises(RequestError) as e:
                c.embed([[1, 2, 3]])
            assert "--runner pooling" in e.value.message
            assert c.generate([1, 2, 3], max_tokens=2).completion_tokens == 2  # still serving
    finally:
        engine.shutdown()


def test_pooling_blocks_are_evicted_before_generation_prefixes():
    """A finished pooling request's blocks stay in the prefix cache but are evicted first (the
    tail before the head); those its admission found cached (a shared prefix) keep their place."""
    from tpserve.blockpool import BlockManager
    from tpserve.scheduler import Sequence

    bm = BlockManager(8, 4, True)

    def done(seq):
        seq.num_cached_tokens = len(seq)
        bm.hash_blocks(seq)
        bm.deallocate(seq)

    def admit(seq):
        n = bm.can_allocate(seq)
        bm.allocate(seq, n)
        return n

    gen = Sequence("g", list(range(8)), SamplingParams(max_tokens=1), block_size=4)
    admit(gen)
    gen_blocks = list(gen.block_table)
    done(gen)
    pool = Sequence("p", list(range(100, 108)), SamplingParams(max_tokens=0), block_size=4)
    pool.pooling = "LAST"
    admit(pool)
    pool_blocks = list(pool.block_table)
    done(pool)
    assert list(bm._free.cached) == [pool_blocks[1], pool_blocks[0], gen_blocks[1], gen_blocks[0]]
    # a pooling request that hits the generation's prefix leaves those blocks last in line
    again = Sequence("q", list(range(8)) + [1, 2, 3, 4], SamplingParams(max_tokens=0), block_size=4)
    again.pooling = "LAST"
    assert admit(again) == 2
    new = again.block_table[2]
    done(again)
    assert list(bm._free.cached) == [new, pool_blocks[1], pool_blocks[0], gen_blocks[1], gen_blocks[0]]
    bm.check_integrity()


def test_tp2_embeddings_and_scores_equal_transformers(model):
    """Two ranks: the forward is sharded, rank 0 pools and scores; a mixed step of embed and
    classify requests; a sequence-classification head and the LM head's rows are rank 0's."""
    path, ref = model
    with LLM(str(path), runner="pooling", dtype="float32", num_kv_blocks=64, tensor_parallel_size=2,
             pooler_config={"classifier_from_token": ["a", "b"]}) as llm:
        tok = llm.tokenizer
        no, yes = tok.convert_tokens_to_ids("a"), tok.convert_tokens_to_ids("b")
        for ids, o in zip(PROMPTS, llm.embed(PROMPTS)):
            assert cosine(o.outputs.embedding, reference(ref, ids)) >= 0.9999
        for ids, o in zip(PROMPTS, llm.classify(PROMPTS)):
            with torch.no_grad():
                logits = ref(torch.tensor([ids])).logits[0, -1].double()
            assert abs(o.outputs.probs[0] - float(torch.sigmoid(logits[yes] - logits[no]))) < 1e-5


def test_tpserve_start_runner_pooling_status_and_stop(model):
    """`tpserve start --runner pooling --pooler-config ...`: embeddings through the client,
    `tpserve status` names the runner and counts the pooling requests; a bad pooler key is
    refused naming the option before anything starts."""
    from test_cli import Daemon, run_cli
    path, ref = model
    bad = run_cli("start", "--model", path, "--runner", "pooling", "--pooler-config", '{"pooling": "MEAN"}',
                  "--runtime-dir", "/tmp/tps-never")
    assert bad.returncode != 0 and "--pooler-config" in bad.stderr and "pooling" in bad.stderr
    d = Daemon(path, "--runner", "pooling", "--dtype", "float32", "--pooler-config",
               json.dumps({"pooling_type": "MEAN", "score_token_ids": [NO, YES]}))
    try:
        with Client(d.address, timeout=60) as c:
            got = c.embed(PROMPTS[:2])
            assert cosine(got[1].data, reference(ref, PROMPTS[1], "MEAN")) >= 0.9999
            assert abs(c.classify(PROMPTS[:1])[0].data[0] - yes_no(ref, PROMPTS[0])) < 1e-5
        status = d.cli("status")
        assert status.returncode == 0, status.stderr
        lines = {line[2:20].strip(): line[20:].strip() for line in status.stdout.splitlines()[1:]}
        assert lines["runner"] == "pooling"
        assert lines["pooling requests"] == f"2 (3 prompts, {len(PROMPTS[0]) * 2 + len(PROMPTS[1])} tokens)"
        d.stop()
        d.assert_gone()
    finally:
        d.kill()


@pytest.mark.parametrize("quantization,tolerance", [(None, 1e-5), ("int8", 2e-2)])
def test_yes_no_head_of_a_tied_model_is_its_own_lm_head(tiny_models_root, quantization,  # noqa: F811
                                                         tolerance):
    """The yes/no score head comes from the loaded LM head (here the tied embedding; also
    quantized to int8 at load): the score is sigmoid(logit[yes] - logit[no]) of the same model's
    next-token log-probabilities (prompt logprobs of the two continuations). With int8 the
    generate path also quantizes the activations, which the score head does not: close, not equal."""
    import math
    path = make_tiny_model(tiny_models_root, arch="qwen3", tie_word_embeddings=True)
    opts = dict(dtype="float32", num_kv_blocks=64, quantization=quantization)
    with LLM(str(path), runner="pooling", pooler_config={"score_token_ids": [NO, YES]}, **opts) as llm:
        scores = [o.outputs.probs[0] for o in llm.classify(PROMPTS)]
    with LLM(str(path), **opts) as gen:  # log p(no | prompt), log p(yes | prompt): prompt logprobs
        params = SamplingParams(max_tokens=1, prompt_logprobs=0)
        outs = gen.generate([p + [t] for p in PROMPTS for t in (NO, YES)], params, use_tqdm=False)
    for i, score in enumerate(scores):
        no, yes = (outs[2 * i + k].prompt_logprobs[-1][t].logprob for k, t in enumerate((NO, YES)))
        assert abs(score - 1 / (1 + math.exp(no - yes))) < tolerance


def test_lm_head_rows_from_the_loaded_head_equal_the_checkpoint(model):
    """The fallback for heads the checkpoint does not hold as float rows (GGUF, quantized): the
    loaded head's logits of the identity matrix give back its rows (packed fp32: exactly)."""
    from tpserve.models import load_model
    from tpserve.models.packed_gemm import prepack_model
    from tpserve.workers.pooler import lm_head_rows
    path, ref = model
    m = load_model(path, dtype="float32")
    prepack_model(m)
    rows = lm_head_rows(m, (NO, YES, 3), torch.device("cpu"))
    want = ref.lm_head.weight[[NO, YES, 3]].float()
    assert rows.shape == want.shape and torch.allclose(rows, want, atol=1e-6)


def test_tp2_daemon_embeds_through_the_client(model):
    path, ref = model
    engine = pooling_engine(path, tensor_parallel_size=2, pooler_config={"score_token_ids": [NO, YES]})
    try:
        with ServerThread(engine) as s, Client(s.address, timeout=120) as c:
            for ids, r in zip(PROMPTS, c.embed(PROMPTS, dimensions=32)):
                assert len(r.data) == 32 and cosine(r.data, reference(ref, ids, dims=32)) >= 0.9999
            for ids, r in zip(PROMPTS, c.classify(PROMPTS)):
                assert abs(r.data[0] - yes_no(ref, ids)) < 1e-5
            assert c.status()["kv_blocks_used"] == 0
    finally:
        engine.shutdown()
