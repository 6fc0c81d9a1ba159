"""The StepPlan channel: shared-memory ring (same node) and gloo broadcast (across nodes).

Reader and writer processes are started with the spawn method (as the engine starts its
workers), except where a test needs dozens of short-lived processes. Every test names its
segments with its own prefix and checks that none is left in /dev/shm afterwards.
"""
from __future__ import annotations

import gc
import hashlib
import multiprocessing as mp
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from tpserve.errors import ConfigError
from tpserve.plan import ARRAY_FIELDS, Command, StepPlan
from tpserve.workers.channel import (
    DETACHED, ChannelClosed, ChannelError, ChannelTimeout, PlanReader, PlanWriter, WaitPolicy,
)
from tpserve.workers.shm_ring import (
    SHM_DIR, cleanup_stale_segments, creator_pid, make_segment_name, overflow_name,
)
from tpserve.procs import pid_alive

SPAWN = mp.get_context("spawn")
JOIN_S = 60  # generous: the machine running the tests may be heavily shared


# ---- helpers -------------------------------------------------------------------------------

def random_plan(rng: np.random.Generator, num_seqs: int, max_q: int = 4, width: int = 8,
                step_id: int = 0) -> StepPlan:
    """A consistent plan with every array filled with random values."""
    q = rng.integers(1, max_q + 1, num_seqs).astype(np.int32)
    k = q + rng.integers(0, 50, num_seqs).astype(np.int32)
    t = int(q.sum())
    cu_q = np.zeros(num_seqs + 1, np.int32)
    cu_k = np.zeros(num_seqs + 1, np.int32)
    cu_q[1:] = np.cumsum(q)
    cu_k[1:] = np.cumsum(k)
    i32 = lambda *shape: rng.integers(-2**31, 2**31 - 1, shape, dtype=np.int32)  # noqa: E731
    plan = StepPlan(
        cmd=Command.STEP, is_prefill=bool(rng.integers(2)), has_context=bool(rng.integers(2)),
        max_seqlen_q=int(q.max(initial=0)), max_seqlen_k=int(k.max(initial=0)), step_id=step_id,
        args={"tag": int(rng.integers(1 << 30))},
        input_ids=i32(t), positions=i32(t), slot_mapping=i32(t), cu_seqlens_q=cu_q,
        cu_seqlens_k=cu_k, context_lens=k, block_tables=i32(num_seqs, width),
        logits_indices=cu_q[1:] - 1)
    plan.validate()
    return plan


def digest(plan: StepPlan) -> str:
    """A hash of everything a plan carries: scalars, args, and every array's shape and bytes."""
    h = hashlib.blake2b(digest_size=16)
    h.update(repr((int(plan.cmd), plan.is_prefill, plan.has_context, plan.max_seqlen_q,
                   plan.max_seqlen_k, plan.step_id, sorted(plan.args.items()))).encode())
    for name in ARRAY_FIELDS:
        arr = getattr(plan, name)
        h.update(repr((name, arr.dtype.str, arr.shape)).encode())
        h.update(np.ascontiguousarray(arr).tobytes())
    return h.hexdigest()


def assert_plans_equal(got: StepPlan, want: StepPlan) -> None:
    for attr in ("cmd", "is_prefill", "has_context", "max_seqlen_q", "max_seqlen_k", "step_id",
                 "args"):
        assert getattr(got, attr) == getattr(want, attr), attr
    for name in ARRAY_FIELDS:
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == b.dtype and a.shape == b.shape, name
        np.testing.assert_array_equal(a, b, err_msg=name)


def segments(prefix: str) -> list[str]:
    return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(prefix))


@pytest.fixture
def prefix():
    """A segment-name prefix private to one test; asserts the test left no segment behind."""
    p = f"tpserve-t{secrets.token_hex(3)}-"
    yield p
    left = segments(p)
    cleanup_stale_segments(p)
    for name in segments(p):  # live creator: this process; remove so nothing leaks
        os.unlink(os.path.join(SHM_DIR, name))
    assert left == [], f"segments left in {SHM_DIR}: {left}"


def fast_policy() -> WaitPolicy:
    return WaitPolicy(spin_s=0.0005, liveness_interval_s=0.05)


# ---- process bodies (module level so spawn can import them) ----------------------------------

def reader_digests(name: str, index: int, conn, seed: int = -1) -> None:
    """Receive until SHUTDOWN; send back the digest of every plan received (or the error).
    With seed >= 0, sometimes stall so that the writer meets a full ring."""
    rng = np.random.default_rng(seed) if seed >= 0 else None
    try:
        reader = PlanReader.attach(name, index, fast_policy())
        out = []
        while True:
            plan = reader.receive(timeout=JOIN_S)
            if plan.cmd == Command.SHUTDOWN:
                break
            out.append(digest(plan))
            if rng is not None and rng.random() < 0.02:
                time.sleep(0.002)
        reader.close()
        conn.send(("ok", out))
    except BaseException as e:  # the test reports it
        conn.send(("error", f"{type(e).__name__}: {e}"))


def reader_plans(name: str, index: int, conn) -> None:
    """Receive until SHUTDOWN; send back each plan's encoded bytes."""
    with PlanReader.attach(name, index, fast_policy()) as reader:
        out = []
        while (plan := reader.receive(timeout=JOIN_S)).cmd != Command.SHUTDOWN:
            out.append(plan.to_bytes())
        conn.send(out)


def writer_then_hang(prefix: str, conn) -> None:
    """Publish a small plan and one larger than a slot, report the name, then wait to die."""
    writer = PlanWriter.create(1, num_slots=2, slot_bytes=4096, name=make_segment_name(prefix))
    rng = np.random.default_rng(3)
    writer.publish(random_plan(rng, 4))
    writer.publish(random_plan(rng, 2000))
    conn.send(writer.name)
    time.sleep(600)


def writer_then_crash(prefix: str, conn) -> None:
    """Publish a plan larger than a slot (its overflow segment exists now), then crash."""
    writer = PlanWriter.create(1, num_slots=2, slot_bytes=4096, name=make_segment_name(prefix))
    writer.publish(random_plan(np.random.default_rng(4), 2000))
    conn.send(sorted(n for n in os.listdir(SHM_DIR) if n.startswith(prefix)))
    raise RuntimeError("simulated crash of rank 0")


def attach_and_vanish(name: str, index: int) -> None:
    """Attach as a reader and exit at once without closing, like a crashed worker."""
    PlanReader.attach(name, index)
    os._exit(0)


def gloo_rank(rank: int, port: int, plans: list[bytes], conn, timed_out) -> None:
    """Rank 0 publishes ``plans`` then dies once rank 1 has seen a receive time out; rank 1
    receives until SHUTDOWN, then checks the timeout and the loss of rank 0."""
    import torch.distributed as dist

    from tpserve.workers.broadcast_channel import BroadcastPlanChannel
    from tpserve.workers.process_group import destroy_tp

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    channel = BroadcastPlanChannel(dist.group.WORLD, src=0)
    out = []
    if rank == 0:
        for data in plans:
            channel.publish(StepPlan.from_bytes(data), timeout=JOIN_S)
        try:
            channel.receive()
        except ChannelError as e:
            out.append(f"source receive refused: {e}")
        conn.send(out)
        timed_out.wait(JOIN_S)
        os._exit(0)  # rank 0 dies without tearing anything down
    while True:
        plan = channel.receive(timeout=JOIN_S)
        out.append(plan.to_bytes())
        if plan.cmd == Command.SHUTDOWN:
            break
    try:
        channel.publish(StepPlan())
    except ChannelError as e:
        out.append(f"receiver publish refused: {e}")
    try:
        channel.receive(timeout=0.2)
    except ChannelTimeout as e:
        out.append(f"timeout: {e}")
    timed_out.set()
    try:
        channel.receive(timeout=JOIN_S)
    except ChannelClosed as e:
        out.append(f"closed: {e}")
    channel.close()
    # Without this, gloo's teardown at interpreter exit may abort() now that the peer is gone.
    destroy_tp()
    conn.send(out)


def collect(procs, conns) -> list:
    results = []
    for conn in conns:
        assert conn.poll(JOIN_S), "a channel process sent no result"
        results.append(conn.recv())
    for p in procs:
        p.join(JOIN_S)
        assert p.exitcode == 0, f"{p.name} exited with {p.exitcode}"
    return results


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- same node: shared-memory ring ------------------------------------------------------------

@pytest.mark.parametrize("num_readers", [1, 3])
def test_round_trip_every_array(prefix, num_readers):
    rng = np.random.default_rng(num_readers)
    plans = [random_plan(rng, n, width=w, step_id=i)
             for i, (n, w) in enumerate([(1, 1), (7, 3), (64, 16), (300, 40), (3, 2)])]
    plans.append(StepPlan(step_id=99))  # an empty batch: zero-length arrays
    writer = PlanWriter.create(num_readers, num_slots=4, slot_bytes=8192,
                               name=make_segment_name(prefix))
    pipes = [SPAWN.Pipe(duplex=False) for _ in range(num_readers)]
    procs = [SPAWN.Process(target=reader_plans, args=(writer.name, r, w), name=f"reader-{r}")
             for r, (_, w) in enumerate(pipes)]
    for p in procs:
        p.start()
    try:
        for plan in plans:
            writer.publish(plan, timeout=JOIN_S)
        writer.publish(StepPlan.command(Command.SHUTDOWN), timeout=JOIN_S)
        results = collect(procs, [r for r, _ in pipes])
    finally:
        writer.close()
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
    assert plans[3].nbytes() > 8192  # one of them went through an overflow segment
    for received in results:
        assert len(received) == len(plans)
        for data, want in zip(received, plans):
            assert_plans_equal(StepPlan.from_bytes(data), want)


def test_stress_random_sizes_three_readers(prefix):
    rng = np.random.default_rng(1234)
    num_readers, count, slot_bytes = 3, 2000, 4096
    writer = PlanWriter.create(num_readers, num_slots=4, slot_bytes=slot_bytes,
                               name=make_segment_name(prefix), policy=fast_policy())
    pipes = [SPAWN.Pipe(duplex=False) for _ in range(num_readers)]
    procs = [SPAWN.Process(target=reader_digests, args=(writer.name, r, w, r),
                           name=f"reader-{r}") for r, (_, w) in enumerate(pipes)]
    for p in procs:
        p.start()
    sent, oversized = [], 0
    try:
        for i in range(count):
            # mostly small plans, one in ten larger than a slot
            n = int(rng.integers(100, 400)) if rng.random() < 0.1 else int(rng.integers(0, 40))
            plan = random_plan(rng, n, max_q=3, width=int(rng.integers(1, 9)), step_id=i)
            oversized += plan.nbytes() > slot_bytes
            writer.publish(plan, timeout=JOIN_S)
            sent.append(digest(plan))
        writer.publish(StepPlan.command(Command.SHUTDOWN), timeout=JOIN_S)
        results = collect(procs, [r for r, _ in pipes])
    finally:
        writer.close()
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
    assert oversized > 100
    for r, (status, got) in enumerate(results):
        assert status == "ok", f"reader {r}: {got}"
        assert got == sent, f"reader {r} received different plans"


def test_control_commands_pass_through(prefix):
    with PlanWriter.create(1, name=make_segment_name(prefix)) as writer, \
            PlanReader.attach(writer.name, 0) as reader:
        commands = [StepPlan.command(Command.PROFILE_START, path="/tmp/trace", steps=3),
                    StepPlan.command(Command.PROFILE_STOP, nonce=7),
                    StepPlan.command(Command.SHUTDOWN)]
        for c in commands:
            writer.publish(c)
        for c in commands:
            got = reader.receive(timeout=5)
            assert got.cmd == c.cmd and got.args == c.args
            assert got.num_seqs == 0 and got.num_tokens == 0


def test_received_arrays_are_read_only_views(prefix):
    rng = np.random.default_rng(0)
    with PlanWriter.create(1, name=make_segment_name(prefix)) as writer, \
            PlanReader.attach(writer.name, 0) as reader:
        plan = random_plan(rng, 8)
        writer.publish(plan)
        got = reader.receive(timeout=5)
        assert not got.block_tables.flags.writeable
        with pytest.raises(ValueError):
            got.input_ids[0] = 1
        assert_plans_equal(got, plan)


def test_sleeping_reader_is_woken_by_its_doorbell(prefix):
    # No spinning and 60 s naps: only the doorbell can deliver the plan before join's limit.
    sleepy = WaitPolicy(spin_s=0.0, min_sleep_s=60.0, max_sleep_s=60.0, liveness_interval_s=60.0)
    with PlanWriter.create(1, name=make_segment_name(prefix)) as writer, \
            PlanReader.attach(writer.name, 0, sleepy) as reader:
        got = []
        thread = threading.Thread(target=lambda: got.append(reader.receive()), daemon=True)
        thread.start()
        deadline = time.monotonic() + JOIN_S
        while not writer.reader_status(0).sleeping and time.monotonic() < deadline:
            time.sleep(0.001)
        assert writer.reader_status(0) == (0, os.getpid(), True), "reader never went to sleep"
        writer.publish(StepPlan(step_id=42))
        thread.join(JOIN_S / 2)
        assert not thread.is_alive(), "sleeping reader was not woken by the publish"
        assert [p.step_id for p in got] == [42]
        assert not writer.reader_status(0).sleeping


def test_slow_reader_times_out_publish_naming_it(prefix):
    with PlanWriter.create(3, num_slots=2, slot_bytes=4096,
                           name=make_segment_name(prefix), policy=fast_policy()) as writer:
        fast = PlanReader.attach(writer.name, 0)
        slow = PlanReader.attach(writer.name, 1)
        # reader 2 never attaches
        for i in range(2):
            writer.publish(StepPlan(step_id=i))
            assert fast.receive(timeout=5).step_id == i
        with pytest.raises(ChannelTimeout) as info:
            writer.publish(StepPlan(step_id=2), timeout=0.2)
        msg = str(info.value)
        assert f"reader 1 (pid {os.getpid()})" in msg and "needs 1" in msg
        assert "reader 2 (not attached yet)" in msg
        assert "reader 0" not in msg
        assert writer.num_published == 2  # nothing was published by the failed call
        # once the lagging readers catch up (reader 2 leaves), the publish goes through
        assert slow.receive(timeout=5).step_id == 0
        assert slow.receive(timeout=5).step_id == 1
        PlanReader.attach(writer.name, 2).close()
        assert writer.publish(StepPlan(step_id=2), timeout=5) == 3
        for r in (fast, slow):
            assert r.receive(timeout=5).step_id == 2
            r.close()


def test_dead_reader_makes_publish_raise_channel_closed(prefix):
    with PlanWriter.create(1, num_slots=1, slot_bytes=4096,
                           name=make_segment_name(prefix), policy=fast_policy()) as writer:
        p = mp.get_context("fork").Process(target=attach_and_vanish, args=(writer.name, 0))
        p.start()
        p.join(JOIN_S)
        writer.publish(StepPlan(step_id=0))
        with pytest.raises(ChannelClosed, match=rf"reader 0 \(pid {p.pid}\).*died"):
            writer.publish(StepPlan(step_id=1), timeout=JOIN_S)


def test_receive_timeout_and_writer_close(prefix):
    writer = PlanWriter.create(1, name=make_segment_name(prefix), policy=fast_policy())
    reader = PlanReader.attach(writer.name, 0, fast_policy())
    with pytest.raises(ChannelTimeout, match="no plan 1 within 0.05 s"):
        reader.receive(timeout=0.05)
    writer.publish(StepPlan(step_id=5))
    writer.close()
    assert segments(prefix) == []
    # what was published before the close is still delivered, then the close is reported
    assert reader.receive(timeout=5).step_id == 5
    with pytest.raises(ChannelClosed, match="writer closed"):
        reader.receive(timeout=5)
    reader.close()
    with pytest.raises(ChannelClosed):
        reader.receive()
    with pytest.raises(ChannelClosed):
        writer.publish(StepPlan())
    with pytest.raises(ChannelClosed, match="no plan channel"):
        PlanReader.attach(writer.name, 0)


def test_writer_killed_reader_raises_channel_closed_and_cleaner_unlinks(prefix):
    recv_end, send_end = SPAWN.Pipe(duplex=False)
    proc = SPAWN.Process(target=writer_then_hang, args=(prefix, send_end), name="writer")
    proc.start()
    try:
        assert recv_end.poll(JOIN_S)
        name = recv_end.recv()
        reader = PlanReader.attach(name, 0, fast_policy())
        assert reader.receive(timeout=5).num_seqs == 4
        assert reader.receive(timeout=5).num_seqs == 2000  # held: its overflow stays linked
        assert segments(prefix) == sorted([name, overflow_name(name, 2)])
        assert creator_pid(name, prefix) == proc.pid
        # the cleaner leaves a live writer's segments alone
        assert cleanup_stale_segments(prefix) == []
        os.kill(proc.pid, signal.SIGKILL)
        # not joined: the writer stays a zombie, which must count as dead
        with pytest.raises(ChannelClosed, match=f"writer process {proc.pid} .* died"):
            reader.receive(timeout=JOIN_S)
        reader.close()
        assert not pid_alive(proc.pid)
        assert cleanup_stale_segments(prefix) == sorted([name, overflow_name(name, 2)])
        assert segments(prefix) == []
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join(JOIN_S)


def test_writer_crash_or_garbage_collection_unlinks_segments(prefix):
    recv_end, send_end = SPAWN.Pipe(duplex=False)
    proc = SPAWN.Process(target=writer_then_crash, args=(prefix, send_end), name="writer")
    proc.start()
    assert recv_end.poll(JOIN_S)
    existed = recv_end.recv()
    proc.join(JOIN_S)
    assert proc.exitcode == 1
    assert len(existed) == 2 and existed[1].endswith("-x1")
    assert segments(prefix) == []  # unlinked by the exit handler, no stale cleaner needed

    writer = PlanWriter.create(1, num_slots=2, slot_bytes=4096, name=make_segment_name(prefix))
    writer.publish(random_plan(np.random.default_rng(4), 2000))
    assert len(segments(prefix)) == 2
    del writer
    gc.collect()
    assert segments(prefix) == []


def test_closed_reader_no_longer_holds_the_writer(prefix):
    with PlanWriter.create(2, num_slots=2, slot_bytes=4096,
                           name=make_segment_name(prefix)) as writer:
        live = PlanReader.attach(writer.name, 0)
        PlanReader.attach(writer.name, 1).close()
        assert writer.reader_status(1).released == DETACHED
        for i in range(5):
            writer.publish(StepPlan(step_id=i), timeout=5)
            assert live.receive(timeout=5).step_id == i
        with pytest.raises(ChannelError, match="cannot attach again"):
            PlanReader.attach(writer.name, 1)
        live.close()


def test_overflow_segments_unlinked_once_released(prefix):
    rng = np.random.default_rng(5)
    with PlanWriter.create(1, num_slots=2, slot_bytes=1024,
                           name=make_segment_name(prefix)) as writer, \
            PlanReader.attach(writer.name, 0) as reader:
        big = [random_plan(rng, 200, step_id=i) for i in range(3)]
        for plan in big:
            writer.publish(plan, timeout=5)
            assert_plans_equal(reader.receive(timeout=5), plan)
        # plans 1 and 2 are released by the reader; plan 3 is still held
        writer.publish(StepPlan(step_id=9), timeout=5)
        assert segments(prefix) == [writer.name, overflow_name(writer.name, 3)]
        assert reader.receive(timeout=5).step_id == 9
        writer.publish(StepPlan(step_id=10), timeout=5)
        assert segments(prefix) == [writer.name]


def test_bad_arguments_are_typed_errors(prefix):
    with pytest.raises(ConfigError, match="num_readers"):
        PlanWriter.create(0)
    with pytest.raises(ConfigError, match="num_slots"):
        PlanWriter.create(1, num_slots=0)
    with pytest.raises(ConfigError, match="slot_bytes"):
        PlanWriter.create(1, slot_bytes=8)
    with pytest.raises(ConfigError, match="name"):
        PlanWriter.create(1, name="has/slash")
    with PlanWriter.create(2, num_slots=1, slot_bytes=4096,
                           name=make_segment_name(prefix)) as writer:
        with pytest.raises(ConfigError, match="name"):
            PlanWriter.create(1, name=writer.name)
        with pytest.raises(ConfigError, match=r"reader_index: must be an integer in \[0, 2\)"):
            PlanReader.attach(writer.name, 2)
        with PlanReader.attach(writer.name, 0) as holder:
            writer.publish(StepPlan(step_id=1))
            assert holder.receive(timeout=5).step_id == 1
            p = mp.get_context("fork").Process(target=attach_and_vanish, args=(writer.name, 0))
            p.start()
            p.join(JOIN_S)
            assert p.exitcode != 0  # index 0 is taken by a live process: attach refused
            # ... and the refused attach left the holder's reader line as it was
            assert writer.reader_status(0) == (0, os.getpid(), False)
    not_a_ring = make_segment_name(prefix)
    fd = os.open(os.path.join(SHM_DIR, not_a_ring), os.O_CREAT | os.O_RDWR, 0o600)
    os.ftruncate(fd, 4096)
    os.close(fd)
    try:
        with pytest.raises(ChannelError, match="is not a version-1 plan channel"):
            PlanReader.attach(not_a_ring, 0)
    finally:
        os.unlink(os.path.join(SHM_DIR, not_a_ring))


def test_cleaner_ignores_live_and_foreign_names(prefix):
    live = make_segment_name(prefix)
    foreign = f"{prefix}notapid-0"
    for name in (live, foreign):
        with open(os.path.join(SHM_DIR, name), "wb") as f:
            f.write(b"x")
    try:
        assert cleanup_stale_segments(prefix) == []
        assert segments(prefix) == sorted([live, foreign])
    finally:
        for name in (live, foreign):
            os.unlink(os.path.join(SHM_DIR, name))


def test_cleaner_removes_a_segment_whose_pid_now_belongs_to_a_younger_process(prefix, monkeypatch):
    """The creator's pid was reused: the process holding it started after the segment was
    last changed, so it cannot have made it."""
    from tpserve.workers import shm_ring
    name = make_segment_name(prefix)  # this process's pid: alive
    with open(os.path.join(SHM_DIR, name), "wb") as f:
        f.write(b"x")
    changed = os.stat(os.path.join(SHM_DIR, name)).st_ctime
    monkeypatch.setattr(shm_ring, "process_start_time", lambda pid: changed + 1.0)  # within the slack
    assert cleanup_stale_segments(prefix) == []
    monkeypatch.setattr(shm_ring, "process_start_time", lambda pid: changed + 60.0)
    assert cleanup_stale_segments(prefix) == [name]


def test_process_start_time_is_this_process_start():
    from tpserve.procs import process_start_time
    started = process_start_time(os.getpid())
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert started <= process_start_time(child.pid)
    finally:
        child.kill()
        child.wait()
    assert process_start_time(child.pid) is None


# ---- across nodes: gloo broadcast -----------------------------------------------------------

def test_broadcast_channel_two_gloo_processes():
    rng = np.random.default_rng(77)
    plans = [random_plan(rng, n, width=w, step_id=i)
             for i, (n, w) in enumerate([(3, 2), (500, 64), (1, 1), (40, 8)])]
    plans += [StepPlan(step_id=4), StepPlan.command(Command.PROFILE_START),
              StepPlan.command(Command.SHUTDOWN)]
    payload = [p.to_bytes() for p in plans]
    port = free_port()
    pipes = [SPAWN.Pipe(duplex=False) for _ in range(2)]
    timed_out = SPAWN.Event()
    procs = [SPAWN.Process(target=gloo_rank, args=(rank, port, payload, w, timed_out),
                           name=f"rank-{rank}") for rank, (_, w) in enumerate(pipes)]
    for p in procs:
        p.start()
    try:
        src_out, dst_out = collect(procs, [r for r, _ in pipes])
    finally:
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
    assert len(src_out) == 1 and "source receive refused" in src_out[0]
    assert dst_out[-3].startswith("receiver publish refused")
    assert dst_out[-2].startswith("timeout: rank 1: broadcast of the plan length")
    assert dst_out[-1].startswith("closed: rank 1:")  # rank 0 died: the worker can exit
    received = dst_out[:-3]
    assert len(received) == len(plans)
    for data, want in zip(received, plans):
        assert_plans_equal(StepPlan.from_bytes(data), want)
