"""The gRPC front (grpc_front.py, grpc_api.py): vLLM's gRPC engine service, the contract smg
routes to, in front of a daemon loop with a real tiny engine; then the front as the daemon's
child process (`tpserve start --grpc-port`)."""
from __future__ import annotations

import asyncio
import hashlib
import io
import os
import signal
import subprocess
import sys
import threading
import time
import zipfile
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest
from smg_grpc_proto.generated import common_pb2 as C
from smg_grpc_proto.generated import vllm_engine_pb2 as V
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as VG

from model_factory import make_tiny_model, tiny_models_root  # noqa: F401
from test_daemon import ServerThread
from test_grpc_relay import ProtoView
from test_kv_events import _free_tcp
from tpserve.client.client import Client
from tpserve.fronts.grpc.api import Refused, sampling_params
from tpserve.fronts.grpc.front import serve
from tpserve.server.kv_events import KVEventsOptions
from tpserve.fronts.grpc.kv_relay import wire_hash
from tpserve.server.server import ServerOptions
from tpserve.sampling import SamplingParams

ROOT = Path(__file__).resolve().parents[1]
BUNDLED = ROOT / "tpserve" / "assets" / "default-model"


# ---- the request's translation ---------------------------------------------------------------

def test_unset_proto_fields_mean_vllms_defaults():
    p = sampling_params(V.GenerateRequest(sampling_params=V.SamplingParams()))
    assert (p.temperature, p.top_p, p.top_k, p.repetition_penalty, p.n) == (1.0, 1.0, -1, 1.0, 1)
    # max_tokens unset: the rest of the context, as vLLM's servicer (None, resolved by the engine)
    assert p.max_tokens is None and p.seed is None and p.logprobs is None
    assert p.structured_outputs is None and p.logit_bias is None
    p = sampling_params(V.GenerateRequest(sampling_params=V.SamplingParams(
        temperature=0.0, top_p=0.5, top_k=3, max_tokens=7, n=2, seed=11, logprobs=2, prompt_logprobs=1,
        stop=["x"], stop_token_ids=[5], ignore_eos=True, min_tokens=2, logit_bias={4: -100.0},
        repetition_penalty=1.2, frequency_penalty=0.5, presence_penalty=0.25, include_stop_str_in_output=True,
        skip_special_tokens=True, truncate_prompt_tokens=9, regex="[ab]+")))
    assert (p.temperature, p.top_p, p.top_k, p.max_tokens, p.n, p.seed, p.logprobs, p.prompt_logprobs) == \
        (0.0, 0.5, 3, 7, 2, 11, 2, 1)
    assert (p.stop, p.stop_token_ids, p.ignore_eos, p.min_tokens, p.logit_bias) == (["x"], [5], True, 2, {4: -100.0})
    assert (p.repetition_penalty, p.frequency_penalty, p.presence_penalty) == pytest.approx((1.2, 0.5, 0.25))
    assert p.include_stop_str_in_output and p.truncate_prompt_tokens == 9
    assert p.structured_outputs.regex == "[ab]+"
    for proto, field in ((V.SamplingParams(json_schema='{"type": "object"}'), "json"),
                         (V.SamplingParams(choice=V.ChoiceConstraint(choices=["a", "b"])), "choice"),
                         (V.SamplingParams(json_object=True), "json_object")):
        assert getattr(sampling_params(V.GenerateRequest(sampling_params=proto)).structured_outputs, field)


@pytest.mark.parametrize("request_, field", [
    (V.GenerateRequest(mm_inputs=V.MultimodalInputs(im_token_id=3)), "mm_inputs"),
    (V.GenerateRequest(media_refs=V.MediaRefs(items=[V.MediaRef(url="http://x")])), "media_refs"),
    (V.GenerateRequest(kv_transfer_params=V.KvTransferParams(remote_host="h")), "kv_transfer_params"),
    (V.GenerateRequest(kv_transfer_params_json="{}"), "kv_transfer_params"),
    (V.GenerateRequest(data_parallel_rank=1), "data_parallel_rank"),
    (V.GenerateRequest(sampling_params=V.SamplingParams(structural_tag="{}")), "sampling_params.structural_tag"),
    (V.GenerateRequest(sampling_params=V.SamplingParams(top_p=2.0)), "sampling_params.top_p"),
    (V.GenerateRequest(sampling_params=V.SamplingParams(logprobs=-1)), "sampling_params.logprobs"),
    (V.GenerateRequest(sampling_params=V.SamplingParams(min_p=2.0)), "sampling_params.min_p"),
])
def test_what_tpserve_cannot_honour_is_refused_naming_the_field(request_, field):
    with pytest.raises(Refused) as e:
        sampling_params(request_)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert str(e.value).startswith(field + ":"), str(e.value)


# ---- the service in front of a daemon loop -----------------------------------------------------

class GrpcThread:
    """grpc_front.serve on a thread of its own, in front of ``address``."""

    def __init__(self, address: str, model_path: Path, kv: KVEventsOptions | None = None,
                 api_key: str | None = None, upstream_timeout: float = 30.0):
        self.args = SimpleNamespace(upstream_timeout=upstream_timeout,
            address=address, host="127.0.0.1", port=0, model_path=str(model_path), model_name="tiny",
            max_model_len=256, server_key=None, ready_fd=None, restarts=0, last_exit=None,
            kv_events_endpoint=kv.endpoint if kv else None,
            kv_events_replay_endpoint=kv.replay_endpoint if kv else None, kv_events_topic="")
        self.api_key = api_key
        self.ready = threading.Event()
        self.port = None
        self.code = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        assert self.ready.wait(30), "the gRPC front did not listen"
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.port}")
        self.stub = VG.VllmEngineStub(self.channel)

    def _run(self):
        async def main():
            self.loop = asyncio.get_running_loop()
            self.stop_event = asyncio.Event()

            def on_ready(port):
                self.port = port
                self.ready.set()
            return await serve(self.args, self.api_key, stop=self.stop_event, on_ready=on_ready)
        self.code = asyncio.run(main())

    def stop(self):
        self.channel.close()
        self.loop.call_soon_threadsafe(self.stop_event.set)
        self.thread.join(15)
        assert not self.thread.is_alive()
        assert self.code == 0


@pytest.fixture(scope="module")
def served(tiny_models_root):  # noqa: F811
    from tpserve.config import EngineConfig
    from tpserve.engine import Engine
    path = make_tiny_model(tiny_models_root)
    engine = Engine(EngineConfig(model=str(path), dtype="float32", num_kv_blocks=64, block_size=4,
                                 max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256))
    opts = ServerOptions(shutdown_grace=0.0, kv_events=KVEventsOptions(_free_tcp(), replay_endpoint=_free_tcp()))
    server = ServerThread(engine, opts)
    front = GrpcThread(server.address, path, opts.kv_events)
    yield SimpleNamespace(engine=engine, server=server, front=front, stub=front.stub, path=path)
    front.stop()
    server.stop()
    engine.shutdown()


LONG_TOKENS = 4000  # a request of seconds on the tiny model: a test looks at it while it runs


@pytest.fixture(scope="module")
def long_served(tiny_models_root):  # noqa: F811
    from tpserve.config import EngineConfig
    from tpserve.engine import Engine
    path = make_tiny_model(tiny_models_root, max_position_embeddings=LONG_TOKENS + 64)
    engine = Engine(EngineConfig(model=str(path), dtype="float32", num_kv_blocks=(LONG_TOKENS + 64) // 4 + 8,
                                 block_size=4, max_num_seqs=2, max_model_len=LONG_TOKENS + 64))
    server = ServerThread(engine, ServerOptions(shutdown_grace=0.0))
    front = GrpcThread(server.address, path)
    yield SimpleNamespace(engine=engine, server=server, front=front, stub=front.stub, path=path)
    front.stop()
    server.stop()
    engine.shutdown()


def gen(ids, stream, rid, **sp):
    return V.GenerateRequest(request_id=rid, tokenized=V.TokenizedInput(input_ids=ids), stream=stream,
                             sampling_params=V.SamplingParams(**sp))


def in_flight(served) -> int:
    with Client(served.server.address, timeout=10) as c:
        return c.status()["requests_in_flight"]


def wait_until(cond, what: str, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


def test_probes_answer_from_the_model_and_the_daemon(served):
    stub = served.stub
    health = stub.HealthCheck(V.HealthCheckRequest())
    assert health.healthy and health.message == "ok"
    info = stub.GetModelInfo(V.GetModelInfoRequest())
    assert (info.model_path, info.tokenizer_path, info.served_model_name) == (str(served.path),) * 2 + ("tiny",)
    assert info.is_generation and info.max_context_length == 256 and info.vocab_size > 0
    assert list(info.architectures) == ["Qwen3ForCausalLM"]
    server = stub.GetServerInfo(V.GetServerInfoRequest())
    assert server.block_size == 4 and server.max_num_seqs == 4 and server.data_parallel_size == 1
    assert server.server_type == "tpserve-grpc" and not server.is_paused
    (load,) = stub.GetLoads(V.GetLoadsRequest()).loads
    assert load.max_total_num_tokens == 64 * 4 and load.max_running_requests == 4
    with pytest.raises(grpc.RpcError) as e:
        stub.GetLoads(V.GetLoadsRequest(dp_rank=1))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    chunks = list(stub.GetTokenizer(C.GetTokenizerRequest()))
    data = b"".join(c.data for c in chunks)
    assert chunks[-1].sha256 == hashlib.sha256(data).hexdigest() and all(not c.sha256 for c in chunks[:-1])
    names = zipfile.ZipFile(io.BytesIO(data)).namelist()
    assert "tokenizer.json" in names and "config.json" in names
    for call, req in ((stub.Embed, V.EmbedRequest()), (stub.FlushCache, C.FlushCacheRequest()),
                      (stub.StartProfile, C.StartProfileRequest())):
        with pytest.raises(grpc.RpcError) as e:
            call(req)
        assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED and e.value.details()


def test_streamed_and_whole_generations_carry_the_daemons_tokens(served):
    ids = list(range(10, 30))
    with Client(served.server.address, timeout=60) as c:
        want = c.generate(ids, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)).token_ids
    out = list(served.stub.Generate(gen(ids, True, "s1", temperature=0.0, max_tokens=6, ignore_eos=True,
                                        logprobs=2)))
    chunks, (done,) = out[:-1], out[-1:]
    assert all(r.WhichOneof("response") == "chunk" for r in chunks)
    assert [t for r in chunks for t in r.chunk.token_ids] == want
    assert sum(r.chunk.completion_tokens for r in chunks) == 6
    for r in chunks:  # the sampled token's logprob and the top 2
        lp = r.chunk.output_logprobs
        assert list(lp.token_ids) == list(r.chunk.token_ids)
        assert len(lp.token_logprobs) == len(r.chunk.token_ids) and all(len(t.values) == 2 for t in lp.top_logprobs)
    assert done.complete.finish_reason == "length" and done.complete.prompt_tokens == 20
    assert done.complete.completion_tokens == 6 and not done.complete.output_ids
    (whole,) = served.stub.Generate(gen(ids, False, "w1", temperature=0.0, max_tokens=6, ignore_eos=True))
    assert list(whole.complete.output_ids) == want and whole.complete.completion_tokens == 6
    assert whole.complete.cached_tokens == 19  # all 5 blocks cached by now; the last token is recomputed
    two = list(served.stub.Generate(gen(ids, False, "w2", temperature=0.0, max_tokens=6, ignore_eos=True, n=2)))
    assert sorted(r.complete.index for r in two) == [0, 1]
    assert all(list(r.complete.output_ids) == want for r in two)  # greedy: both the same
    streamed_two = list(served.stub.Generate(gen(ids, True, "s2", temperature=0.0, max_tokens=3,
                                                 ignore_eos=True, n=2)))
    assert sorted(r.complete.index for r in streamed_two if r.WhichOneof("response") == "complete") == [0, 1]
    for i in (0, 1):
        assert [t for r in streamed_two if r.WhichOneof("response") == "chunk" and r.chunk.index == i
                for t in r.chunk.token_ids] == want[:3]


def test_streamed_n_reports_each_index_complete_as_it_ends(served):
    """vLLM's stream reports each index's completion as it comes: with n=2 and completions of
    different lengths (sampled, half the byte tokens stop), the shorter one's complete comes
    before the longer one's last chunk."""
    ids = list(range(10, 30))
    for seed in range(16):
        out = list(served.stub.Generate(gen(ids, True, f"early{seed}", temperature=1.0, seed=seed,
                                            max_tokens=16, n=2, stop_token_ids=list(range(3, 200)))))
        kinds = [(r.WhichOneof("response"), r.chunk.index if r.HasField("chunk") else r.complete.index)
                 for r in out]
        counts = [sum(len(r.chunk.token_ids) for r in out if r.HasField("chunk") and r.chunk.index == i)
                  for i in (0, 1)]
        completes = {r.complete.index: r.complete for r in out if r.HasField("complete")}
        assert sorted(completes) == [0, 1] and len(completes) == sum(k == "complete" for k, _ in kinds)
        for i in (0, 1):
            assert kinds[-1] == ("complete", i) or kinds.index(("complete", i)) > max(
                k for k, e in enumerate(kinds) if e == ("chunk", i))  # after its own chunks
            assert completes[i].completion_tokens == counts[i] and completes[i].finish_reason == "stop"
            assert completes[i].prompt_tokens == 20
        # index 1 starts a step after index 0: these end at least two steps apart
        if counts[0] + 2 <= counts[1] or counts[1] + 3 <= counts[0]:
            break
    else:
        pytest.fail("no seed made the two completions end apart")
    early = 0 if counts[0] < counts[1] else 1
    assert kinds.index(("complete", early)) < max(k for k, e in enumerate(kinds) if e == ("chunk", 1 - early))


def test_unset_max_tokens_is_the_rest_of_the_context_and_n_the_engines(served):
    """As vLLM's gRPC service: max_tokens unset generates up to max_model_len (256 here);
    n completions come from the engine, each with its index (docs/protocol.md)."""
    ids = list(range(10, 40))
    (done,) = served.stub.Generate(gen(ids, False, "rest", temperature=0.0, ignore_eos=True))
    assert done.complete.finish_reason == "length"
    assert done.complete.completion_tokens == len(done.complete.output_ids) == 256 - len(ids)
    three = list(served.stub.Generate(gen(ids, False, "n3", temperature=0.0, max_tokens=2, ignore_eos=True, n=3)))
    assert sorted(r.complete.index for r in three) == [0, 1, 2]
    assert all(list(r.complete.output_ids) == list(done.complete.output_ids[:2]) for r in three)


def test_the_daemons_refusals_become_status_codes_and_it_keeps_serving(served):
    stub = served.stub
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(gen(list(range(5, 300)), True, "long", max_tokens=4)))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details().startswith("admission:") and "max_model_len" in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(gen([], False, "empty")))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details().startswith("tokenized.input_ids")
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(gen([5, 6], False, "big-vocab", max_tokens=2, logit_bias={10**6: 1.0})))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as e:  # the daemon compiles grammars
        list(stub.Generate(gen([5, 6], False, "bad-regex", max_tokens=2, regex="(")))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "regex" in e.value.details()
    (ok,) = stub.Generate(gen([5, 6, 7], False, "after", max_tokens=2, ignore_eos=True))
    assert len(ok.complete.output_ids) == 2
    assert in_flight(served) == 0


def generated(served) -> int:
    with Client(served.server.address, timeout=10) as c:
        return c.status()["generation_tokens"]


def test_a_cancelled_call_and_an_abort_rpc_end_their_requests(long_served):
    served = long_served
    stub = served.stub
    before = generated(served)
    call = stub.Generate(gen([5, 6, 7], True, "cancel-me", max_tokens=LONG_TOKENS, ignore_eos=True))
    next(call)
    assert in_flight(served) == 1
    call.cancel()
    wait_until(lambda: in_flight(served) == 0, "the cancelled call's request still runs")
    assert generated(served) - before < LONG_TOKENS  # it was aborted, not run to its end
    got = []
    reader = threading.Thread(target=lambda: got.extend(stub.Generate(
        gen([5, 6, 7], False, "abort-me", max_tokens=LONG_TOKENS, ignore_eos=True))))
    reader.start()
    wait_until(lambda: in_flight(served) == 1, "the request never started")
    stub.Abort(V.AbortRequest(request_ids=["abort-me", "never-was"]))
    reader.join(60)
    assert not reader.is_alive()
    (done,) = got
    assert done.complete.finish_reason == "abort"
    assert len(done.complete.output_ids) < LONG_TOKENS
    assert in_flight(served) == 0


def test_kv_event_subscribers_hold_exactly_the_engines_cached_hashes(served):
    """A subscriber from the start while requests share prefixes on a pool too small for all
    of them (hits, preemptions, evictions), and one that subscribes afterwards (a snapshot):
    both hold the keys of the engine's hash_to_block_id, and a resumed one continues without
    a gap."""
    stub = served.stub
    live, view = [], ProtoView()
    call = stub.SubscribeKvEvents(C.SubscribeKvEventsRequest(start_sequence_number=0))
    def read():
        try:
            for b in call:
                live.append(b)
        except grpc.RpcError as e:  # the cancel below
            assert e.code() == grpc.StatusCode.CANCELLED
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    base = [40 + i % 50 for i in range(100)]
    prompts = [base + [100 + i] * (30 + 5 * i) for i in range(4)] + [base[:37] + list(range(150, 210))]

    def one(i, p):
        list(stub.Generate(gen(p, True, f"kv{i}", temperature=0.0, max_tokens=40, ignore_eos=True)))
    for round_ in range(2):
        threads = [threading.Thread(target=one, args=(f"{round_}-{i}", p)) for i, p in enumerate(prompts)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    with Client(served.server.address, timeout=10) as c:
        stats = c.status()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hit_rate"] > 0
    last = stats["kv_events_next_seq"]  # the relay's number of the daemon's last batch
    wait_until(lambda: live and live[-1].sequence_number == last, "the relay did not pass on every batch")
    call.cancel()
    want = {wire_hash(h) for h in served.engine.scheduler.block_manager.hash_to_block_id}
    for b in live:
        view.apply(b)
    assert set(view.blocks) == want and want
    assert any(e.WhichOneof("data") == "removed" for b in live for e in b.events), "nothing was evicted"
    snap_view = ProtoView()
    snap_call = stub.SubscribeKvEvents(C.SubscribeKvEventsRequest(start_sequence_number=0))
    snap_view.apply(next(snap_call))
    snap_call.cancel()
    assert snap_view.blocks == view.blocks
    resumed = stub.SubscribeKvEvents(C.SubscribeKvEventsRequest(start_sequence_number=last - 2))
    assert [next(resumed).sequence_number for _ in range(2)] == [last - 1, last]
    resumed.cancel()


def test_an_api_key_is_required_as_bearer_metadata(served):
    front = GrpcThread(served.server.address, served.path, None, api_key="s3cret-key")
    try:
        with pytest.raises(grpc.RpcError) as e:
            front.stub.HealthCheck(V.HealthCheckRequest())
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as e:
            front.stub.HealthCheck(V.HealthCheckRequest(), metadata=[("authorization", "Bearer wrong")])
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        ok = front.stub.HealthCheck(V.HealthCheckRequest(), metadata=[("authorization", "Bearer s3cret-key")])
        assert ok.healthy
        with pytest.raises(grpc.RpcError) as e:  # no relay without the daemon's events
            next(front.stub.SubscribeKvEvents(C.SubscribeKvEventsRequest(),
                                              metadata=[("authorization", "Bearer s3cret-key")]))
        assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED
    finally:
        front.stop()


def test_calls_end_unavailable_when_the_daemon_does_not_answer(tmp_path, tiny_models_root):  # noqa: F811
    """No daemon behind the front (as one stopped with SIGSTOP): its ping goes unanswered and
    the call in flight ends with UNAVAILABLE instead of waiting forever."""
    front = GrpcThread(f"ipc://{tmp_path}/nobody.sock", make_tiny_model(tiny_models_root), upstream_timeout=1.0)
    try:
        with pytest.raises(grpc.RpcError) as e:
            list(front.stub.Generate(gen([5, 6, 7], True, "lost", max_tokens=4), timeout=60))
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "did not answer" in e.value.details()
        health = front.stub.HealthCheck(V.HealthCheckRequest(), timeout=60)
        assert not health.healthy and "does not answer" in health.message
    finally:
        front.stop()


# ---- the front as the daemon's child ---------------------------------------------------------

def status_of(rd: Path) -> dict:
    with Client(f"ipc://{rd}/tpserve.sock", timeout=30) as c:
        return c.status()


def _front_pids(rd: Path) -> list[int]:
    pids = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                cmd = (p / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"tpserve.fronts.grpc.front" in cmd and any(str(rd).encode() in a for a in cmd):
                pids.append(int(p.name))
    return pids


def test_tpserve_start_with_a_grpc_port_serves_reports_and_stops_the_front(tmp_path):
    rd = tmp_path / "rd"
    tp = [sys.executable, "-m", "tpserve"]
    out = subprocess.run(tp + ["start", "--runtime-dir", str(rd), "--grpc-port", "0", "--num-kv-blocks", "64",
                               "--dtype", "float32", "--log-level", "warning"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    url = out.stdout.split()[-1]
    assert url.startswith("grpc://127.0.0.1:")
    try:
        status = status_of(rd)
        assert status["grpc_front"] == "running" and status["grpc_url"] == url
        assert status["kv_events_next_seq"] == 0  # the daemon publishes for the front
        shown = subprocess.run(tp + ["status", "--runtime-dir", str(rd)], capture_output=True, text=True, timeout=60)
        assert f"running (restarts: 0) at {url}" in shown.stdout, shown.stdout
        assert (rd / "kv-events.sock").exists()
        (pid,) = _front_pids(rd)
        with grpc.insecure_channel(url[len("grpc://"):]) as ch:
            stub = VG.VllmEngineStub(ch)
            assert stub.HealthCheck(V.HealthCheckRequest()).healthy
            (done,) = stub.Generate(gen(list(range(5, 40)), False, "r", max_tokens=4, ignore_eos=True))
            assert len(done.complete.output_ids) == 4
            events = stub.SubscribeKvEvents(C.SubscribeKvEventsRequest())
            first = next(events)  # the snapshot: the prompt's two full blocks
            assert sum(len(e.stored.blocks) for e in first.events if e.WhichOneof("data") == "stored") == 2
            events.cancel()
        # A front that dies is restarted on the same port, and the status map says so.
        os.kill(pid, signal.SIGKILL)

        def restarted():
            s = status_of(rd)
            return s["grpc_front"] == "running" and s["grpc_front_restarts"] == 1 and _front_pids(rd)
        wait_until(restarted, "the gRPC front was not restarted")
        assert "SIGKILL" in status_of(rd)["grpc_front_last_exit"]
        with grpc.insecure_channel(url[len("grpc://"):]) as ch:
            assert VG.VllmEngineStub(ch).HealthCheck(V.HealthCheckRequest(), timeout=30).healthy
        (pid,) = _front_pids(rd)
    finally:
        stop = subprocess.run(tp + ["stop", "--runtime-dir", str(rd)], capture_output=True, text=True, timeout=120)
    assert stop.returncode == 0, stop.stderr
    assert not _front_pids(rd) and not os.path.exists(f"/proc/{pid}")
    assert not (rd / "kv-events.sock").exists() and not (rd / "kv-events-replay.sock").exists()


@pytest.mark.parametrize("extra, says", [(["--grpc-host", "0.0.0.0"], "needs an API key"),
                                         (["--api-key", "ключ"], "non-ASCII")])
def test_start_refuses_a_front_nobody_could_safely_reach(tmp_path, extra, says):
    out = subprocess.run([sys.executable, "-m", "tpserve", "start", "--runtime-dir", str(tmp_path / "rd"),
                          "--grpc-port", "0", *extra], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "--grpc-host" in out.stderr and says in out.stderr, out.stderr
    assert not (tmp_path / "rd" / "tpserve.pid").exists()
