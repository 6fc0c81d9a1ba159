"""The gRPC front's service: ``vllm.grpc.engine.VllmEngine``, the contract smg routes to.

smg (the SGLang model gateway) speaks gRPC to its workers: it tokenizes and renders chat
itself, sends token ids, detokenizes what comes back, and -- the reason to use it -- can
subscribe to each worker's KV-cache events for event-driven cache-aware routing. It detects
the worker's kind by which health check answers; tpserve answers vLLM's service
(``vllm_engine.proto`` and ``common.proto`` of the ``smg-grpc-proto`` package), whose messages
map onto tpserve's protocol one to one. Every RPC becomes a request of the front's one
AsyncClient to the daemon (grpc_front.py):

* ``Generate``: ``tokenized.input_ids`` (or ``text``, tokenized by the daemon) and
  ``SamplingParams`` become a ``generate``. Unset proto3 scalars mean vLLM's defaults, as
  vLLM's own servicer reads them (``top_p`` 0 → 1, ``repetition_penalty`` 0 → 1, ``n`` 0 → 1,
  ``max_tokens`` unset → the rest of the context, as vLLM resolves its None). The request is
  validated by tpserve's request model (tpserve/request.py), errors naming ``sampling_params.*``. The constraint oneof becomes
  ``structured_outputs``; tpserve constrains from the first token (it has no engine-side
  reasoning parser to wait for), which is what ``grammar_from_first_token`` asks, set or not.
  ``tokenized.original_text`` is for reference only, as the proto says. Streamed: one ``chunk`` per delta (its token ids, ``completion_tokens``
  the delta's count, logprobs, prompt logprobs in the first), and one ``complete`` per
  completion as soon as it ended, while its siblings (n > 1) run on (finish reason, counts; its
  ``output_ids`` empty: the chunks carried them).
  Not streamed: one ``complete`` per completion with every token. Fields tpserve has nothing
  for (multimodal inputs, media refs, KV transfer, a data-parallel rank other than 0,
  ``structural_tag``) are refused with INVALID_ARGUMENT naming the field, as is any value
  SamplingParams refuses. A cancelled call aborts its request.
* ``Abort``: aborts the ids in flight (unknown ones are ignored, as vLLM does).
* ``HealthCheck``: healthy while the daemon serves (not while draining or failed).
* ``GetModelInfo``, ``GetServerInfo``, ``GetLoads``: from config.json and the daemon's status
  (router_api.load_snapshot gives the load in SGLang's names, which the proto shares).
* ``GetTokenizer``: the model directory's tokenizer files as one zip, in 64 KiB chunks, the
  SHA-256 of the zip on the last.
* ``SubscribeKvEvents``: the relay's stream (kv_relay.py).
* ``Embed``, ``FlushCache``, ``StartProfile``, ``StopProfile``: UNIMPLEMENTED, saying so.
"""
from __future__ import annotations

import asyncio
import hashlib
import io
import logging
import time
import zipfile
from pathlib import Path

import grpc
from smg_grpc_proto.generated import common_pb2 as C
from smg_grpc_proto.generated import vllm_engine_pb2 as V
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as VG

import tpserve
from tpserve.client.client import AsyncClient, ClientTimeout, GenerateResult, RequestError
from tpserve.fronts.grpc.kv_relay import KvRelay
from tpserve.fronts.http.router_api import load_snapshot, model_json
from tpserve.errors import InvalidFieldError
from tpserve.request import REST_OF_CONTEXT, Api
from tpserve.request import sampling_params as request_sampling_params
from tpserve.sampling import SamplingParams

log = logging.getLogger("tpserve.grpc")

CHUNK_BYTES = 64 * 1024
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "config.json",
                   "generation_config.json", "vocab.json", "merges.txt", "tokenizer.model",
                   "chat_template.json", "chat_template.jinja")
_STATUS_TIMEOUT = 5.0

#: How vLLM's gRPC service spells a request (tpserve/request.py): sampling fields under
#: ``sampling_params``; max_tokens unset is the rest of the context, as vLLM's servicer leaves
#: it None and vLLM resolves None.
GRPC = Api("grpc", REST_OF_CONTEXT, params_prefix="sampling_params.")

# The daemon's error codes as gRPC status codes.
_CODES = {"invalid_field": grpc.StatusCode.INVALID_ARGUMENT, "invalid_request": grpc.StatusCode.INVALID_ARGUMENT,
          "admission": grpc.StatusCode.INVALID_ARGUMENT, "duplicate_id": grpc.StatusCode.ALREADY_EXISTS,
          "overloaded": grpc.StatusCode.RESOURCE_EXHAUSTED, "too_many_requests": grpc.StatusCode.RESOURCE_EXHAUSTED,
          "shutting_down": grpc.StatusCode.UNAVAILABLE, "step_failed": grpc.StatusCode.INTERNAL,
          "internal": grpc.StatusCode.INTERNAL}


class Refused(Exception):
    """A request the front refuses before it reaches the daemon: a gRPC status and why."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


def _bad(field: str, reason: str) -> Refused:
    return Refused(grpc.StatusCode.INVALID_ARGUMENT, f"{field}: {reason}")


def sampling_params(req: V.GenerateRequest) -> SamplingParams:
    """A GenerateRequest's SamplingParams as tpserve's (Refused when tpserve cannot honour it)."""
    if req.HasField("mm_inputs") or len(req.extra_mm_inputs):
        raise _bad("mm_inputs", "tpserve serves text models only")
    if req.HasField("media_refs") and len(req.media_refs.items):
        raise _bad("media_refs", "tpserve serves text models only")
    if req.HasField("kv_transfer_params") or req.HasField("kv_transfer_params_json"):
        raise _bad("kv_transfer_params", "tpserve has no KV transfer (prefill/decode disaggregation)")
    if req.HasField("data_parallel_rank") and req.data_parallel_rank != 0:
        raise _bad("data_parallel_rank", f"tpserve has one data-parallel rank (0), got {req.data_parallel_rank}")
    p = req.sampling_params
    structured = None
    kind = p.WhichOneof("constraint")
    if kind == "structural_tag":
        raise _bad("sampling_params.structural_tag", "not supported; use json_schema, regex, grammar or choice")
    if kind == "json_schema":
        structured = {"json": p.json_schema}
    elif kind in ("regex", "grammar"):
        structured = {kind: getattr(p, kind)}
    elif kind == "json_object":
        structured = {"json_object": p.json_object} if p.json_object else None
    elif kind == "choice":
        structured = {"choice": list(p.choice.choices)}
    # Unset proto3 scalars mean vLLM's defaults, as vLLM's servicer reads them; max_tokens
    # unset is left out: GRPC's default (the rest of the context) applies.
    sampling = dict(
        temperature=p.temperature if p.HasField("temperature") else 1.0,
        top_p=p.top_p if p.top_p != 0.0 else 1.0,
        top_k=p.top_k if p.top_k > 0 else -1,
        min_p=p.min_p,
        frequency_penalty=p.frequency_penalty,
        presence_penalty=p.presence_penalty,
        repetition_penalty=p.repetition_penalty if p.repetition_penalty != 0.0 else 1.0,
        min_tokens=p.min_tokens,
        stop=list(p.stop),
        stop_token_ids=list(p.stop_token_ids),
        skip_special_tokens=p.skip_special_tokens,
        spaces_between_special_tokens=p.spaces_between_special_tokens,
        ignore_eos=p.ignore_eos,
        n=p.n if p.n > 0 else 1,
        logprobs=p.logprobs if p.HasField("logprobs") else None,
        prompt_logprobs=p.prompt_logprobs if p.HasField("prompt_logprobs") else None,
        seed=p.seed if p.HasField("seed") else None,
        include_stop_str_in_output=p.include_stop_str_in_output,
        logit_bias={int(k): float(v) for k, v in p.logit_bias.items()} or None,
        truncate_prompt_tokens=p.truncate_prompt_tokens if p.HasField("truncate_prompt_tokens") else None,
        structured_outputs=structured)
    if p.HasField("max_tokens"):
        sampling["max_tokens"] = p.max_tokens
    try:
        return request_sampling_params(GRPC, sampling)
    except InvalidFieldError as e:
        raise _bad(e.field, e.reason) from None


def prompt_of(req: V.GenerateRequest) -> list[int] | str:
    kind = req.WhichOneof("input")
    if kind == "tokenized":
        ids = list(req.tokenized.input_ids)
        if not ids:
            raise _bad("tokenized.input_ids", "empty")
        return ids
    if kind == "text":
        if not req.text:
            raise _bad("text", "empty")
        return req.text
    raise _bad("input", "set tokenized or text")


def output_logprobs(entries: list | None) -> V.OutputLogProbs | None:
    """tpserve's ``[logprob, [[id, logprob], ...]]`` per token as OutputLogProbs (the token ids
    are the sampled ones, which the caller adds)."""
    if not entries:
        return None
    out = V.OutputLogProbs()
    for lp, top in entries:
        out.token_logprobs.append(lp)
        out.top_logprobs.append(V.TopLogProbs(values=[t[1] for t in top], token_ids=[t[0] for t in top]))
    return out


def input_logprobs(entries: list | None, prompt: list[int] | str) -> V.InputLogProbs | None:
    """The prompt logprobs (nil for the first token, then one entry per token) as InputLogProbs."""
    if not entries:
        return None
    out = V.InputLogProbs()
    if isinstance(prompt, list):
        out.token_ids.extend(prompt[:len(entries)])
    for e in entries:
        if e is None:
            out.token_logprobs.append(V.InputTokenLogProb())
            out.top_logprobs.append(V.TopLogProbs())
        else:
            out.token_logprobs.append(V.InputTokenLogProb(value=e[0]))
            out.top_logprobs.append(V.TopLogProbs(values=[t[1] for t in e[1]], token_ids=[t[0] for t in e[1]]))
    return out


def tokenizer_zip(model_dir: str | Path) -> bytes:
    buf = io.BytesIO()
    d = Path(model_dir)
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        for name in TOKENIZER_FILES:
            if (d / name).is_file():
                zf.write(d / name, name)
    return buf.getvalue()


class GrpcFront:
    """What the servicer needs of the daemon and the model: the client, config, relay."""

    KIND = "gRPC"

    def __init__(self, client: AsyncClient, model_path: str, model_name: str, max_model_len: int,
                 relay: KvRelay | None):
        self.client = client
        self.model_path = model_path
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.relay = relay
        self.started = time.time()
        self.last_receive = 0.0
        self.in_flight_calls: dict[asyncio.Queue, tuple[float, asyncio.Future]] = {}  # -> loop time began, pump
        self.restarts = 0
        self.last_exit: str | None = None
        self._tokenizer: tuple[bytes, str] | None = None
        self.config = model_json(model_path)
        self.generation = model_json(model_path, "generation_config.json")

    async def status(self, context) -> dict:
        try:
            return await self.client.status(timeout=_STATUS_TIMEOUT)
        except (ClientTimeout, RequestError) as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"the tpserve daemon does not answer: {e}")

    def in_flight(self) -> int:
        return len(self.in_flight_calls)

    def fail_requests(self, exc: Exception, before: float) -> int:
        """End the Generate calls in flight since before loop time ``before`` with ``exc``
        (UNAVAILABLE); their requests are aborted (UpstreamWatch calls this)."""
        ended = [q for q, (began, _) in self.in_flight_calls.items() if began < before]
        for q in ended:
            _, pump = self.in_flight_calls.pop(q)
            pump.cancel()
            q.put_nowait(exc)
        return len(ended)

    def tokenizer(self) -> tuple[bytes, str]:
        if self._tokenizer is None:
            data = tokenizer_zip(self.model_path)
            self._tokenizer = data, hashlib.sha256(data).hexdigest()
        return self._tokenizer

    def eos_ids(self) -> list[int]:
        ids = self.generation.get("eos_token_id", self.config.get("eos_token_id"))
        if ids is None:
            return []
        return [int(i) for i in (ids if isinstance(ids, list) else [ids])]


class VllmEngineService(VG.VllmEngineServicer):
    """``vllm.grpc.engine.VllmEngine`` over one GrpcFront (see the module doc)."""

    def __init__(self, front: GrpcFront):
        self.front = front

    # ---- generation ------------------------------------------------------------------------
    async def Generate(self, request, context):
        front = self.front
        front.last_receive = time.time()
        try:
            prompt = prompt_of(request)
            params = sampling_params(request)
        except Refused as e:
            await context.abort(e.code, str(e))
        # A task reads the daemon's replies into a queue, which UpstreamWatch can also end
        # (Front.fail_requests); cancelling the task aborts the request in the daemon.
        queue: asyncio.Queue = asyncio.Queue()
        pump = asyncio.ensure_future(self._pump(prompt, params, request.request_id or None, request.stream, queue))
        front.in_flight_calls[queue] = (asyncio.get_running_loop().time(), pump)
        try:
            while True:
                item = await queue.get()
                if item is None:
                    return
                if isinstance(item, RequestError):
                    await context.abort(_CODES.get(item.code, grpc.StatusCode.INTERNAL), str(item))  # "code: field: why"
                if isinstance(item, Exception):  # the daemon does not answer, or the upstream was lost
                    await context.abort(grpc.StatusCode.UNAVAILABLE, str(item))
                yield item
        finally:
            front.in_flight_calls.pop(queue, None)
            pump.cancel()

    async def _pump(self, prompt, params, rid, stream: bool, queue: asyncio.Queue) -> None:
        try:
            async for response in self._responses(prompt, params, rid, stream):
                queue.put_nowait(response)
            queue.put_nowait(None)
        except (RequestError, ClientTimeout) as e:
            queue.put_nowait(e)

    async def _responses(self, prompt, params, rid, stream: bool):
        """The GenerateResponses of one request: streamed, a chunk per delta and a complete per
        completion as soon as it ended (n > 1: its last delta says so; vLLM's stream reports each
        index's end as it comes), the others' with the request's end; whole, a complete per
        completion with all its tokens."""
        n_prompt = len(prompt) if isinstance(prompt, list) else 0
        tokens: dict[int, list[int]] = {}
        logprobs: dict[int, list] = {}
        prompt_lp = None
        completed: set[int] = set()  # streamed: indices whose complete was sent
        call = self.front.client.stream(prompt, params, request_id=rid, final=True, timeout=None)
        try:
            async for item in call:
                if isinstance(item, GenerateResult):  # the last one: finish reasons and counts
                    for c in (item.completions or [item]):
                        if c.index in completed:
                            continue
                        done = V.GenerateComplete(finish_reason=c.finish_reason, prompt_tokens=item.prompt_tokens,
                                                  completion_tokens=len(tokens.get(c.index, ())), index=c.index,
                                                  cached_tokens=item.cached_tokens)
                        if not stream:
                            done.output_ids.extend(tokens.get(c.index, ()))
                            lp = output_logprobs(logprobs.get(c.index))
                            if lp is not None:
                                lp.token_ids.extend(tokens[c.index])
                                done.output_logprobs.CopyFrom(lp)
                            if prompt_lp is not None:
                                done.input_logprobs.CopyFrom(input_logprobs(prompt_lp, prompt))
                        yield V.GenerateResponse(complete=done)
                    return
                first = prompt_lp is None and item.prompt_logprobs
                if first:
                    prompt_lp = item.prompt_logprobs
                tokens.setdefault(item.index, []).extend(item.token_ids)
                if item.logprobs:
                    logprobs.setdefault(item.index, []).extend(item.logprobs)
                if not stream:
                    continue
                if item.token_ids or first or item.finish_reason is None:
                    chunk = V.GenerateStreamChunk(token_ids=item.token_ids,
                                                  completion_tokens=len(item.token_ids),
                                                  prompt_tokens=n_prompt, index=item.index)
                    lp = output_logprobs(item.logprobs)
                    if lp is not None:
                        lp.token_ids.extend(item.token_ids)
                        chunk.output_logprobs.CopyFrom(lp)
                    if first:
                        chunk.input_logprobs.CopyFrom(input_logprobs(prompt_lp, prompt))
                    yield V.GenerateResponse(chunk=chunk)
                if item.finish_reason is not None:  # this completion ended; its siblings run on
                    completed.add(item.index)
                    yield V.GenerateResponse(complete=V.GenerateComplete(
                        finish_reason=item.finish_reason, prompt_tokens=item.prompt_tokens or 0,
                        completion_tokens=len(tokens.get(item.index, ())), index=item.index,
                        cached_tokens=item.cached_tokens or 0))
        finally:
            await call.aclose()  # not finished (cancelled, failed): the client aborts the request

    async def Abort(self, request, context):
        for rid in request.request_ids:
            try:
                await self.front.client.abort(rid, timeout=_STATUS_TIMEOUT)
            except (RequestError, ClientTimeout) as e:
                log.debug("abort of %s: %s", rid, e)
        return V.AbortResponse()

    # ---- probes ------------------------------------------------------------------------------
    async def HealthCheck(self, request, context):
        try:
            stats = await self.front.client.status(timeout=_STATUS_TIMEOUT)
        except (ClientTimeout, RequestError) as e:
            return V.HealthCheckResponse(healthy=False, message=f"the tpserve daemon does not answer: {e}")
        state = stats.get("state")
        if state != "running":
            return V.HealthCheckResponse(healthy=False, message=stats.get("failure") or f"the daemon is {state}")
        return V.HealthCheckResponse(healthy=True, message="ok")

    async def GetModelInfo(self, request, context):
        f = self.front
        cfg = f.config
        return V.GetModelInfoResponse(
            model_path=f.model_path, tokenizer_path=f.model_path, is_generation=True,
            max_context_length=f.max_model_len, vocab_size=int(cfg.get("vocab_size") or 0),
            supports_vision=False, served_model_name=f.model_name, model_type=cfg.get("model_type") or "",
            architectures=cfg.get("architectures") or [], eos_token_ids=f.eos_ids(),
            pad_token_id=int(cfg.get("pad_token_id") or 0), bos_token_id=int(cfg.get("bos_token_id") or 0),
            max_req_input_len=f.max_model_len)

    async def GetServerInfo(self, request, context):
        stats = await self.front.status(context)
        return V.GetServerInfoResponse(
            active_requests=int(stats.get("requests_in_flight") or 0), is_paused=stats.get("state") != "running",
            last_receive_timestamp=self.front.last_receive, uptime_seconds=time.time() - self.front.started,
            server_type="tpserve-grpc", data_parallel_size=1, kv_cache_dtype="auto",
            block_size=int(stats.get("block_size") or 0), model_dtype=str(stats.get("dtype") or ""),
            max_num_seqs=int(stats.get("max_num_seqs") or 0))

    async def GetLoads(self, request, context):
        if request.HasField("dp_rank") and request.dp_rank != 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"dp_rank: tpserve has rank 0 only, got {request.dp_rank}")
        stats = await self.front.status(context)
        load = load_snapshot(stats)
        return V.GetLoadsResponse(timestamp=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                  version=tpserve.__version__, dp_rank_count=1,
                                  loads=[V.SchedulerLoad(**load)])

    async def GetTokenizer(self, request, context):
        data, digest = await asyncio.get_running_loop().run_in_executor(None, self.front.tokenizer)
        for off in range(0, max(len(data), 1), CHUNK_BYTES):
            last = off + CHUNK_BYTES >= len(data)
            yield C.GetTokenizerChunk(data=data[off:off + CHUNK_BYTES], sha256=digest if last else "")

    # ---- KV events ---------------------------------------------------------------------------
    async def SubscribeKvEvents(self, request, context):
        relay = self.front.relay
        if relay is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "this daemon publishes no KV events")
        sub = relay.subscribe(request.start_sequence_number)
        # Headers now, not with the first batch (which an idle engine may not send for long):
        # the subscriber then knows its stream is up.
        await context.send_initial_metadata(())
        try:
            for batch in sub.initial:
                yield batch
            while True:
                batch = await sub.queue.get()
                if batch is None:
                    await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                        f"this subscriber fell {relay.queue_size} batches behind; "
                                        "resubscribe from its last sequence number")
                yield batch
        finally:
            relay.unsubscribe(sub)

    # ---- what tpserve does not do ------------------------------------------------------------
    async def Embed(self, request, context):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "tpserve serves generation models only (no Embed)")

    async def FlushCache(self, request, context):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "FlushCache: tpserve's prefix cache is not flushed on request")

    async def StartProfile(self, request, context):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "StartProfile: use `tpserve profile` (the ZMQ profile request)")

    async def StopProfile(self, request, context):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "StopProfile: use `tpserve profile` (the ZMQ profile request)")
