"""The accelerator start-up path on CPU, through a fake accelerator.

``FakeAccelerator`` is an ``Accelerator`` with ``is_accelerator = True`` whose tensors live on the
CPU. It reports memory figures the test chooses and models the caching allocator: work run
after ``reset_peak_memory_stats`` allocates ``activation`` bytes at its peak, which stay
reserved (and so missing from ``mem_get_info``'s free memory) until ``empty_cache``. Its graphs
replay by re-running the captured function (``EagerGraph``), so decode-graph padding runs here.
"""
from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest
import torch

from model_factory import make_tiny_model, tiny_models_root  # noqa: F401
from tpserve import LLM, SamplingParams
from tpserve.config import EngineConfig
from tpserve.models.parallel import TPContext
from tpserve.workers import device as devices
from tpserve.workers import model_runner as runner_mod
from tpserve.workers.device import Accelerator, EagerGraph, accelerator_for
from tpserve.workers.model_runner import ModelRunner, max_useful_blocks
from tpserve.workers.warmup import warmup_plan

GiB = 1 << 30


class FakeAccelerator(Accelerator):
    is_accelerator = True
    dist_backend = "gloo"

    def __init__(self, total=8 * GiB, in_use=1 * GiB, activation=256 << 20, index=0):
        super().__init__("cpu")
        self.total, self.in_use, self.activation, self.index = total, in_use, activation, index
        self.cached = 0
        self.peak_extra = 0
        self.window_open = False
        self.events: list[str] = []
        self.graphs = 0

    def set_device(self):
        self.events.append(f"set_device:{self.index}")

    def synchronize(self):
        self.events.append("synchronize")
        if self.window_open:  # the work since the reset has run: its peak is known
            self.peak_extra = self.activation
            self.cached = self.activation
            self.window_open = False

    def empty_cache(self):
        self.events.append("empty_cache")
        self.cached = 0

    def reset_peak_memory_stats(self):
        self.events.append("reset_peak")
        self.window_open, self.peak_extra = True, 0

    def mem_get_info(self):
        self.events.append("mem_get_info")
        return self.total - self.in_use - self.cached, self.total

    def peak_extra_bytes(self):
        return self.peak_extra

    def dist_device_id(self):
        return torch.device("cuda", self.index)

    def capture_graph(self, fn, pool=None):
        self.graphs += 1
        return EagerGraph(fn)


@pytest.fixture(scope="module")
def tiny(tiny_models_root):  # noqa: F811
    return make_tiny_model(tiny_models_root, arch="qwen3", max_position_embeddings=128)


def _config(path, **kw):
    opts = dict(model=str(path), max_num_seqs=4, max_model_len=64, max_num_batched_tokens=64,
                dtype="float32", attention_backend="triton")
    opts.update(kw)
    return EngineConfig(**opts).resolve()


# ---- the default device start: warm-up, memory figures, graphs ----------------------------------
def test_default_device_start_sizes_from_memory_and_captures_graphs(tiny):
    cfg = _config(tiny, gpu_memory_utilization=0.5)
    # Memory so small that the budget, not the cap, decides the block count.
    accel = FakeAccelerator(total=1 << 20, in_use=256 << 10, activation=128 << 10)
    runner = ModelRunner(cfg, TPContext(), accel)
    budget = int(accel.total * 0.5) - accel.in_use - accel.activation
    assert runner.kv_budget_bytes == budget  # the activation peak counted once, not twice
    assert runner.num_blocks == min(budget // runner.block_bytes, max_useful_blocks(cfg))
    assert runner.num_blocks < max_useful_blocks(cfg)
    ev = accel.events
    warm = ev.index("reset_peak")
    assert "empty_cache" in ev[warm:ev.index("mem_get_info")]
    assert runner.graphs is not None and accel.graphs == len(runner.graphs.batch_sizes)
    assert runner.kv_caches[0][0].shape[0] == runner.num_blocks


def test_warmup_samples_max_num_seqs_rows_with_top_k_and_top_p(tiny, monkeypatch):
    calls = []

    class Recording(runner_mod.Sampler):
        def sample(self, logits, plan):
            calls.append((logits.shape, plan.top_ks.copy(), plan.top_ps.copy(), plan.temperatures.copy()))
            return super().sample(logits, plan)

    monkeypatch.setattr(runner_mod, "Sampler", Recording)
    cfg = _config(tiny, max_num_seqs=6, max_num_batched_tokens=40, enforce_eager=True)
    ModelRunner(cfg, TPContext(), FakeAccelerator())
    shape, ks, ps, temps = calls[0]
    assert shape[0] == 6
    assert bool((ks > 0).all()) and bool((ps < 1).all()) and bool((temps > 0).all())


def test_warmup_plan_rows_are_distinct_tokens_of_the_batch():
    cfg = EngineConfig(max_num_seqs=256, max_num_batched_tokens=8192, max_model_len=4096)
    plan = warmup_plan(cfg)
    plan.validate()
    assert plan.num_tokens == 8192 and plan.num_samples == 256
    assert len(set(plan.logits_indices.tolist())) == 256
    assert plan.logits_indices.max() < plan.num_tokens
    small = warmup_plan(EngineConfig(max_num_seqs=256, max_num_batched_tokens=100, max_model_len=50,
                                     max_stall_tokens=1))
    assert small.num_samples == 100 and small.num_tokens == 100
    # A mixed step may grow to max_stall_tokens while few streams decode: the warm-up covers it.
    grown = EngineConfig(max_num_seqs=256, max_num_batched_tokens=100, max_model_len=50,
                         max_stall_tokens=1000)
    assert warmup_plan(grown).num_tokens == 1000 == grown.max_step_tokens
    grown.scheduling_policy = "prefill-first"
    assert warmup_plan(grown).num_tokens == 100


# ---- CUDA-graph bookkeeping: padded and exact batches equal eager decode -------------------------
def test_graph_decode_equals_eager_decode(tiny, monkeypatch):
    prompts = [[5, 6, 7, 8, 9], list(range(20, 41)), [100, 3, 4], [7] * 17, [9, 8]]
    params = [SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
              SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=3, max_tokens=6,
                             ignore_eos=True)]
    outs = {}
    for eager in (True, False):
        accel = FakeAccelerator()
        monkeypatch.setattr("tpserve.workers.executor.device_for", lambda rank: accel)
        with LLM(str(tiny), max_num_seqs=4, max_model_len=64, dtype="float32",
                 attention_backend="triton", enforce_eager=eager, block_size=16) as llm:
            runner = llm.engine.executor.runner
            assert (runner.graphs is None) == eager
            res = []
            for p in params:  # batches of 4 (exact), then 1 (padded to 1), 3 (padded to 4) ...
                res.append([o.token_ids for o in llm.generate(prompts, p, use_tqdm=False)])
            outs[eager] = res
    assert outs[False] == outs[True]


# ---- every attention kernel variant is compiled at start ----------------------------------------
class _VariantRecorder:
    """Wraps a Triton kernel; records each launch's compile key as Triton forms it: the
    constexprs, tensor dtypes and 16-byte alignment, and for integers that are specialised
    on, whether they equal 1 and whether 16 divides them."""

    def __init__(self, kernel, seen: list):
        self.kernel, self.seen = kernel, seen
        self.names = kernel.arg_names
        self.unspecialised = set(kernel.kwargs.get("do_not_specialize") or ())

    def _key(self, args, kw):
        key = [self.kernel.fn.__name__]
        for name, a in zip(self.names, args):
            if isinstance(a, torch.Tensor):
                key.append((name, str(a.dtype), a.data_ptr() % 16 == 0))
            elif isinstance(a, int) and not isinstance(a, bool) and name not in self.unspecialised:
                key.append((name, a == 1, a % 16 == 0))
        return tuple(key) + tuple(sorted(kw.items()))

    def __getitem__(self, grid):
        def launch(*args, **kw):
            self.seen.append(self._key(args, kw))
            return self.kernel[grid](*args, **kw)
        return launch


@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
def test_start_launches_every_attention_variant_serving_needs(tiny, monkeypatch, eager):
    from tpserve.kernels import paged_decode, paged_prefill, store_kvcache

    seen: list = []
    for mod, attr in ((paged_prefill, "_prefill_kernel"), (paged_decode, "_paged_decode_kernel"),
                      (store_kvcache, "_store_kvcache_kernel")):
        monkeypatch.setattr(mod, attr, _VariantRecorder(getattr(mod, attr), seen))
    accel = FakeAccelerator()
    monkeypatch.setattr("tpserve.workers.executor.device_for", lambda rank: accel)
    greedy = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    # A small step budget: the long prompts are prefilled in chunks with cached context, next
    # to the decodes of the short ones (mixed steps), short and long chunks; the last prompt
    # re-reads the first one's blocks from the prefix cache.
    with LLM(str(tiny), max_num_seqs=4, max_model_len=64, dtype="float32",
             attention_backend="triton", block_size=16, max_num_batched_tokens=24,
             enforce_eager=eager) as llm:
        started = set(seen)
        seen.clear()
        prompts = [list(range(3, 43)), [5, 6, 7], list(range(50, 71)), [9] * 12]
        llm.generate(prompts, greedy, use_tqdm=False)
        llm.generate([list(range(3, 43)) + [8, 9]], greedy, use_tqdm=False)
    served = set(seen)
    assert any(("PAGED", True) in k for k in served)  # the workload had mixed steps
    assert served <= started, sorted(served - started)


# ---- shutdown frees the device memory (a second engine in the process sizes the same) ----------
class TrackingAccelerator(FakeAccelerator):
    """A fake whose free memory also leaves out the bytes of the tensors ``track`` was given,
    while they are alive: an engine's KV pool, weights and graph outputs, as on a card."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self._tracked: list[tuple[weakref.ref, int]] = []

    def track(self, tensors) -> None:
        self._tracked += [(weakref.ref(t), t.numel() * t.element_size()) for t in tensors]

    def live_bytes(self) -> int:
        return sum(n for ref, n in self._tracked if ref() is not None)

    def mem_get_info(self):
        free, total = super().mem_get_info()
        return free - self.live_bytes(), total


def test_shutdown_frees_device_memory_without_the_cycle_collector(tiny, monkeypatch):
    # Memory so small that the budget decides the block count (as in the start test above).
    accel = TrackingAccelerator(total=1 << 20, in_use=256 << 10, activation=128 << 10)
    monkeypatch.setattr("tpserve.workers.executor.device_for", lambda rank: accel)
    opts = dict(max_num_seqs=4, max_model_len=64, dtype="float32", attention_backend="triton",
                block_size=16, gpu_memory_utilization=0.5)
    llm = LLM(str(tiny), **opts)
    # The Triton interpreter leaves every launch's arguments in a reference cycle of its own
    # (a GPU run has no interpreter): collect those once, then let only reference counting free.
    gc.collect()
    gc.disable()
    try:
        runner = llm.engine.executor.runner
        blocks = runner.num_blocks
        assert runner.graphs is not None
        accel.track([t for kv in runner.kv_caches for t in kv] + list(runner.model.parameters())
                    + [g.output for g in runner.graphs.graphs.values()])
        assert accel.live_bytes() > runner.num_blocks * runner.block_bytes
        graphs = weakref.ref(runner.graphs)
        runner = weakref.ref(runner)
        emptied = accel.events.count("empty_cache")
        llm.shutdown()
        assert runner() is None and graphs() is None
        assert accel.live_bytes() == 0
        assert accel.events.count("empty_cache") > emptied  # the allocator's cache returned too
        # The second engine sees the whole card again: same KV pool, no "no memory left".
        second = LLM(str(tiny), **opts)
        assert second.engine.executor.runner.num_blocks == blocks
        second.shutdown()
    finally:
        gc.enable()


def test_closed_runner_refuses_to_run_and_closes_once(tiny):
    cfg = _config(tiny)
    runner = ModelRunner(cfg, TPContext(), FakeAccelerator())
    graph = next(iter(runner.graphs.graphs.values()))
    runner.close()
    assert runner.graphs is None and runner.kv_caches == [] and graph.output is None
    runner.close()
    with pytest.raises(RuntimeError, match="runner is closed"):
        runner.execute(warmup_plan(cfg))


# ---- the block-count cap ----------------------------------------------------------------------
def test_block_count_is_capped_at_what_the_scheduler_can_use(tiny):
    cfg = _config(tiny, attention_backend="torch", kv_cache_memory_gb=1.0)
    runner = ModelRunner(cfg, TPContext(), "cpu")
    per_seq = -(-64 // 16)
    assert runner.num_blocks == max_useful_blocks(cfg) == 4 * per_seq * 5 // 4
    assert GiB // runner.block_bytes > runner.num_blocks
    fixed = ModelRunner(_config(tiny, attention_backend="torch", num_kv_blocks=500), TPContext())
    assert fixed.num_blocks == 500  # an explicit count is never capped


# ---- set the device before the process group exists ------------------------------------------
def _record_dist(monkeypatch, events):
    import torch.distributed as dist
    from tpserve.workers import process_group as pg

    accels = {}

    def local(local_rank):
        accels.setdefault(local_rank, FakeAccelerator(index=local_rank))
        accels[local_rank].events = events
        return accels[local_rank]

    monkeypatch.setattr(pg.devices, "local_accelerator", local)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group",
                        lambda **kw: events.append(("init_process_group", kw)))
    monkeypatch.setattr(pg, "share_cpu_threads", lambda n: None)


def test_init_tp_sets_the_local_device_first_and_binds_it(monkeypatch):
    from tpserve.workers.process_group import init_tp

    events = []
    _record_dist(monkeypatch, events)
    tp = init_tp(3, 4, None, local_rank=1)
    assert tp.rank == 3 and tp.size == 4
    assert events[0] == "set_device:1"
    name, kw = events[1]
    assert name == "init_process_group" and kw["device_id"] == torch.device("cuda", 1)
    assert kw["rank"] == 3 and kw["world_size"] == 4 and kw["init_method"] == "env://"


def test_torchrun_worker_sets_its_device_before_the_first_collective(tiny, monkeypatch):
    import torch.distributed as dist
    from tpserve.workers.worker import run_torchrun_worker

    events = []
    _record_dist(monkeypatch, events)

    class FirstCollective(Exception):
        pass

    def broadcast(objs, src=0, **kw):
        events.append("broadcast_object_list")
        raise FirstCollective

    monkeypatch.setattr(dist, "broadcast_object_list", broadcast)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    # The worker body reports any failure as exit code 1 (and logs it) instead of raising.
    assert run_torchrun_worker(EngineConfig(model=str(tiny), tensor_parallel_size=2)) == 1
    names = [e if isinstance(e, str) else e[0] for e in events]
    assert names[:3] == ["set_device:1", "init_process_group", "broadcast_object_list"]
    assert events[1][1]["device_id"] == torch.device("cuda", 1)


# ---- the seam itself ----------------------------------------------------------------------------
def test_accelerator_for_maps_devices():
    assert type(accelerator_for("cpu")) is Accelerator
    fake = FakeAccelerator()
    assert accelerator_for(fake) is fake
    with pytest.raises(ValueError, match="device"):
        accelerator_for("no-such-device")
    host = Accelerator()
    assert host.dist_device_id() is None and not host.is_accelerator
    with pytest.raises(RuntimeError, match="no device memory"):
        host.mem_get_info()
    if not torch.cuda.is_available():
        assert type(devices.local_accelerator(1)) is Accelerator


def test_eager_graph_replays_from_its_inputs():
    x = torch.zeros(3)
    g = EagerGraph(lambda: x * 2 + 1)
    x.copy_(torch.tensor([1.0, 2.0, 3.0]))
    out = g.output
    g.replay()
    assert g.output is out and out.tolist() == [3.0, 5.0, 7.0]


def test_empty_plan_arrays_never_break_staging():
    from tpserve.plan import StepPlan
    from tpserve.workers.staging import PlanStager

    stager = PlanStager(Accelerator())
    t = stager.stage(StepPlan())
    assert all(v.numel() == 0 for k, v in t.items() if not k.startswith("cu_"))
    assert t["cu_seqlens_q"].tolist() == [0] and t["cu_seqlens_k"].tolist() == [0]
    assert np.array_equal(t["block_tables"].numpy(), np.zeros((0, 0), np.int32))


# ---- one staging buffer, one copy ----------------------------------------------------------
def _sample_plan() -> "StepPlan":
    from tpserve.plan import StepPlan
    rng = np.random.default_rng(0)
    return StepPlan(is_prefill=True, max_seqlen_q=3, max_seqlen_k=5,
                    input_ids=rng.integers(0, 99, 5, dtype=np.int32),
                    positions=np.arange(5, dtype=np.int32), slot_mapping=np.arange(5, dtype=np.int32),
                    cu_seqlens_q=np.array([0, 3, 5], np.int32), cu_seqlens_k=np.array([0, 3, 5], np.int32),
                    context_lens=np.array([3, 2], np.int32),
                    block_tables=np.array([[4, 1, 7], [2, 0, 0]], np.int32),
                    logits_indices=np.array([2, 4], np.int32), logprob_rows=np.array([1], np.int32))


def test_staged_arrays_equal_the_plan_with_their_dtypes():
    from tpserve.plan import ARRAY_FIELDS
    from tpserve.workers.staging import PlanStager
    plan = _sample_plan()
    stager = PlanStager(Accelerator())
    t = stager.stage(plan)
    for name in ARRAY_FIELDS:
        arr = getattr(plan, name)
        assert t[name].numpy().dtype == arr.dtype and np.array_equal(t[name].numpy(), arr), name
    # A read-only plan (a view into shared memory) stages too, and a bigger one regrows.
    plan.block_tables = np.zeros((2, 900), np.int32)
    plan.block_tables.setflags(write=False)
    assert stager.stage(plan)["block_tables"].shape == (2, 900)


def test_views_made_for_one_set_of_shapes_serve_the_next_plan_of_those_shapes_only():
    from tpserve.plan import ARRAY_FIELDS
    from tpserve.workers.staging import PlanStager
    stager = PlanStager(Accelerator())
    first = _sample_plan()
    stager.stage(first)
    second = _sample_plan()  # the same shapes, other values
    second.input_ids = second.input_ids[::-1].copy()
    second.block_tables = np.array([[9, 8, 7], [6, 5, 4]], np.int32)
    second.logits_indices = np.array([1, 3], np.int32)
    t = stager.stage(second)
    for name in ARRAY_FIELDS:
        assert np.array_equal(t[name].numpy(), getattr(second, name)), name
    third = _sample_plan()  # other shapes: one sequence fewer, a wider table
    third.cu_seqlens_q, third.cu_seqlens_k = np.array([0, 3], np.int32), np.array([0, 3], np.int32)
    third.context_lens, third.block_tables = np.array([3], np.int32), np.array([[1, 2, 3, 4]], np.int32)
    t = stager.stage(third)
    for name in ARRAY_FIELDS:
        assert t[name].shape == getattr(third, name).shape, name
        assert np.array_equal(t[name].numpy(), getattr(third, name)), name


class _CopyingAccelerator(Accelerator):
    """Device buffers on the meta device: the copy path runs, values are not kept."""

    def __init__(self):
        super().__init__("meta")
        self.log = []

    def record_event(self):
        log = self.log
        log.append("record")

        class Event:
            def synchronize(self):
                log.append("wait")
        return Event()


def test_device_staging_makes_one_copy_and_waits_before_reusing_the_host_buffer():
    from tpserve.workers.staging import PlanStager
    accel = _CopyingAccelerator()
    stager = PlanStager(accel)
    t = stager.stage(_sample_plan())
    assert all(v.device.type == "meta" for v in t.values())
    assert t["logits_indices"].dtype == torch.int32 and t["logprob_rows"].shape == (1,)
    assert t["block_tables"].shape == (2, 3)
    storages = {v.untyped_storage()._cdata for v in t.values()}
    assert storages == {stager._device.untyped_storage()._cdata}  # views of one device buffer
    stager.stage(_sample_plan())
    assert accel.log == ["record", "wait", "record"]


# ---- dist.gather as torch 2.4 spells it ---------------------------------------------------------
def test_gather_to_rank0_uses_arguments_torch_2_4_accepts(monkeypatch):
    import torch.distributed as dist

    calls = []

    def gather_2_4(tensor, gather_list=None, dst=0, group=None, async_op=False):
        calls.append(dst)
        for i, part in enumerate(gather_list or []):
            part.copy_(tensor + i)

    monkeypatch.setattr(dist, "gather", gather_2_4)
    tp = TPContext(rank=0, size=2, group=None)
    out = tp.gather_to_rank0(torch.tensor([[1.0, 2.0]]), dim=-1)
    assert out.tolist() == [[1.0, 2.0, 2.0, 3.0]] and calls == [0]
