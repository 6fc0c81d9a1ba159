"""Publish-to-all-readers latency of a decode StepPlan: shared-memory ring vs pickle + Event.

The plan is a 256-sequence decode step (block tables int32 [256, 64] plus every [256]-sized
array, about 80 KB encoded). Latency of one message = time from the writer's call to publish
until the *last* reader has the plan decoded, on the machine's monotonic clock
(``time.perf_counter_ns``, shared by all processes on Linux). The writer waits for every
reader to acknowledge a message before timing the next one, so no queueing is measured.

Peers, in the same run and with the same processes, plan and acknowledgement scheme:

    shm           tpserve.workers.channel: encode in place into a ring slot, readers poll the
                  slot's sequence number and decode numpy views (no copy)
    pickle+event  pickle.dumps(plan as a dict of arrays) copied into a SharedMemory buffer, one
                  multiprocessing.Event per reader; readers pickle.loads the buffer

    .venv/bin/python scripts/bench_channel.py [--messages 2000] [--readers 1 3] [--gap-us 0]

Prints one line per reader count:
    channel readers=R shm median=..us p99=..us | pickle+event median=..us p99=..us | speedup x..
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import pickle
import struct
import sys
import time
from multiprocessing import shared_memory

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tpserve.plan import ARRAY_FIELDS, Command, StepPlan  # noqa: E402
from tpserve.workers.channel import PlanReader, PlanWriter  # noqa: E402

BATCH, WIDTH = 256, 64
CTX = mp.get_context("spawn")
_LEN = struct.Struct("<q")


def decode_plan() -> StepPlan:
    rng = np.random.default_rng(0)
    b = BATCH
    ctx = rng.integers(1, 4096, b).astype(np.int32)
    cu_k = np.zeros(b + 1, np.int32)
    cu_k[1:] = np.cumsum(ctx)
    plan = StepPlan(
        is_prefill=False, max_seqlen_q=1, max_seqlen_k=int(ctx.max()),
        input_ids=rng.integers(0, 150_000, b).astype(np.int32), positions=ctx - 1,
        slot_mapping=rng.integers(0, 1 << 20, b).astype(np.int32),
        cu_seqlens_q=np.arange(b + 1, dtype=np.int32), cu_seqlens_k=cu_k, context_lens=ctx,
        block_tables=rng.integers(0, 1 << 16, (b, WIDTH)).astype(np.int32),
        logits_indices=np.arange(b, dtype=np.int32))
    plan.validate()
    return plan


def as_dict(plan: StepPlan) -> dict:
    d = {k: getattr(plan, k) for k in ("is_prefill", "has_context", "max_seqlen_q",
                                        "max_seqlen_k", "step_id", "args")}
    d["cmd"] = int(plan.cmd)
    d.update({name: getattr(plan, name) for name in ARRAY_FIELDS})
    return d


# ---- reader processes --------------------------------------------------------------------------

def shm_reader(name: str, index: int, acks, stamps, total: int) -> None:
    with PlanReader.attach(name, index) as reader:
        while True:
            plan = reader.receive(timeout=60)
            now = time.perf_counter_ns()
            if plan.cmd == Command.SHUTDOWN:
                return
            i = plan.step_id
            stamps[index * total + i] = now
            acks[index] = i + 1


def pickle_reader(shm_name: str, index: int, event, acks, stamps, total: int) -> None:
    shm = shared_memory.SharedMemory(shm_name)
    buf = shm.buf
    while True:
        if not event.wait(60):
            raise TimeoutError("pickle reader got no message for 60 s")
        event.clear()
        (n,) = _LEN.unpack_from(buf, 0)
        d = pickle.loads(buf[_LEN.size:_LEN.size + n])
        now = time.perf_counter_ns()
        if d["cmd"] == Command.SHUTDOWN:
            break
        i = d["step_id"]
        stamps[index * total + i] = now
        acks[index] = i + 1
    del buf, d
    shm.close()


# ---- writer side -------------------------------------------------------------------------------

def wait_acks(acks, value: int, readers: int) -> None:
    deadline = time.monotonic() + 60
    while any(acks[r] < value for r in range(readers)):
        if time.monotonic() > deadline:
            raise TimeoutError(f"readers stuck before message {value}")
        os.sched_yield()


def pause(gap_s: float) -> None:
    if gap_s > 0:
        end = time.perf_counter() + gap_s
        while time.perf_counter() < end:
            os.sched_yield()


def latencies(t0: np.ndarray, stamps, readers: int, total: int, warmup: int) -> np.ndarray:
    s = np.frombuffer(stamps, dtype=np.int64).reshape(readers, total)
    return (s.max(axis=0) - t0)[warmup:] / 1e3  # microseconds


def run_shm(plan: StepPlan, readers: int, total: int, warmup: int, gap_s: float) -> np.ndarray:
    acks, stamps = CTX.RawArray("q", readers), CTX.RawArray("q", readers * total)
    t0 = np.zeros(total, np.int64)
    with PlanWriter.create(readers) as writer:
        procs = [CTX.Process(target=shm_reader, args=(writer.name, r, acks, stamps, total))
                 for r in range(readers)]
        for p in procs:
            p.start()
        for i in range(total):
            wait_acks(acks, i, readers)
            pause(gap_s)
            plan.step_id = i
            t0[i] = time.perf_counter_ns()
            writer.publish(plan, timeout=60)
        wait_acks(acks, total, readers)
        writer.publish(StepPlan.command(Command.SHUTDOWN), timeout=60)
        for p in procs:
            p.join(60)
    return latencies(t0, stamps, readers, total, warmup)


def run_pickle(plan: StepPlan, readers: int, total: int, warmup: int,
               gap_s: float) -> np.ndarray:
    acks, stamps = CTX.RawArray("q", readers), CTX.RawArray("q", readers * total)
    events = [CTX.Event() for _ in range(readers)]
    t0 = np.zeros(total, np.int64)
    shm = shared_memory.SharedMemory(create=True, size=4 << 20)
    try:
        procs = [CTX.Process(target=pickle_reader,
                             args=(shm.name, r, events[r], acks, stamps, total))
                 for r in range(readers)]
        for p in procs:
            p.start()

        def send(d: dict) -> None:
            data = pickle.dumps(d)
            _LEN.pack_into(shm.buf, 0, len(data))
            shm.buf[_LEN.size:_LEN.size + len(data)] = data
            for e in events:
                e.set()

        for i in range(total):
            wait_acks(acks, i, readers)
            pause(gap_s)
            plan.step_id = i
            t0[i] = time.perf_counter_ns()
            send(as_dict(plan))
        wait_acks(acks, total, readers)
        send({"cmd": int(Command.SHUTDOWN)})
        for p in procs:
            p.join(60)
    finally:
        shm.close()
        shm.unlink()
    return latencies(t0, stamps, readers, total, warmup)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--messages", type=int, default=2000)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--readers", type=int, nargs="+", default=[1, 3])
    ap.add_argument("--gap-us", type=float, default=0.0,
                    help="idle time before each publish (readers fall back to sleeping when "
                         "it exceeds the wait policy's spin time)")
    args = ap.parse_args()
    plan = decode_plan()
    total = args.messages + args.warmup
    print(f"# decode plan: {BATCH} seqs, block_tables [{BATCH}, {WIDTH}], {plan.nbytes()} B; "
          f"{args.messages} messages after {args.warmup} warm-up; gap {args.gap_us} us; "
          f"{os.cpu_count()} CPUs")
    for readers in args.readers:
        shm = run_shm(plan, readers, total, args.warmup, args.gap_us * 1e-6)
        base = run_pickle(plan, readers, total, args.warmup, args.gap_us * 1e-6)
        sm, sp = np.median(shm), np.percentile(shm, 99)
        bm, bp = np.median(base), np.percentile(base, 99)
        print(f"channel readers={readers} shm median={sm:.1f}us p99={sp:.1f}us | "
              f"pickle+event median={bm:.1f}us p99={bp:.1f}us | speedup x{bm / sm:.2f}",
              flush=True)


if __name__ == "__main__":
    main()
