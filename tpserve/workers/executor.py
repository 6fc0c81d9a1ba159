"""Executors: how rank 0 runs a plan on every rank.

``UniProcExecutor``   tensor_parallel_size 1: the runner lives in this process.
``MultiProcExecutor`` N > 1: rank 0's runner lives here; ranks 1..N-1 are worker processes
                      (spawned here, or started by torchrun). Each plan is published on the
                      plan channel first, then run locally; the collectives inside the forward
                      keep the ranks in step.

Faults: a watchdog thread waits on the workers' process sentinels, busy or idle. When one
exits, the executor records which rank and its exit code, tears the remaining workers down and
makes ``health_fd()`` readable, so a caller sleeping in ``poll`` (the daemon's serving loop)
wakes at once; ``check_health()`` and the next (or current) execute raise WorkerDiedError
naming the rank.
"""
from __future__ import annotations

import logging
import os
import multiprocessing as mp
import threading
import time
from multiprocessing.connection import wait

import numpy as np

from tpserve.config import EngineConfig
from tpserve.errors import WorkerDiedError
from tpserve.models.parallel import TPContext
from tpserve.plan import Command, StepPlan
from tpserve.workers.process_group import StoreListener, destroy_tp, device_for, init_tp, torchrun_env
from tpserve.workers.shm_ring import cleanup_stale_segments

log = logging.getLogger("tpserve.executor")


def make_executor(config: EngineConfig):
    """The executor for ``config``. Every start first removes the plan rings that killed
    engines left in /dev/shm (whatever their tensor-parallel degree and this one's)."""
    removed = cleanup_stale_segments()
    if removed:
        log.info("removed %d plan-channel segment(s) of dead processes: %s", len(removed), ", ".join(removed))
    if config.tensor_parallel_size == 1:
        return UniProcExecutor(config)
    return MultiProcExecutor(config)


class UniProcExecutor:
    def __init__(self, config: EngineConfig):
        from tpserve.workers.model_runner import ModelRunner
        self.runner = ModelRunner(config, TPContext(), device_for(0))
        self.num_blocks = self.runner.num_blocks

    def execute(self, plan: StepPlan, sample=None):
        """Rank 0's StepOutput of one step (``sample``: its SamplePlan, see ModelRunner)."""
        return self.runner.execute(plan, sample)

    def control(self, cmd: Command, **args) -> None:
        self.runner.handle(StepPlan.command(cmd, **args))

    def check_health(self) -> None:
        pass

    def health_fd(self) -> int | None:
        return None  # no other process can die under this one

    def shutdown(self) -> None:
        if self.runner is not None:
            self.runner.close()
            self.runner = None


class MultiProcExecutor:
    def __init__(self, config: EngineConfig):
        from tpserve.workers.model_runner import ModelRunner
        from tpserve.workers.rendezvous import create_ring

        self.world = config.tensor_parallel_size
        self.startup_timeout = config.startup_timeout
        self.procs: list[mp.Process] = []
        self.channel = None
        self.dead: tuple[int, int | None] | None = None
        self._closing = threading.Event()
        # The watchdog writes one byte here when a worker dies; never drained, so it stays readable.
        self._dead_r, self._dead_w = os.pipe()
        os.set_blocking(self._dead_r, False)
        self._pipe_lock = threading.Lock()  # the watchdog's write vs shutdown's close
        env = torchrun_env()
        store_listener = None
        try:
            if env is not None:
                self._init_torchrun(config, env)
            else:
                self.channel = create_ring(num_readers=self.world - 1)
                store_listener = StoreListener()
                init_method = store_listener.init_method
                ctx = mp.get_context("spawn")
                conns = []
                for rank in range(1, self.world):
                    parent, child = ctx.Pipe(duplex=False)
                    p = ctx.Process(target=_worker_entry, name=f"tpserve-worker-{rank}",
                                    args=(rank, self.world, config.to_dict(), init_method,
                                          self.channel.name, child), daemon=True)
                    p.start()
                    child.close()
                    self.procs.append(p)
                    conns.append(parent)
                self._watch()
                tp = init_tp(0, self.world, init_method, timeout_s=self.startup_timeout,
                             store_listener=store_listener)
                self.runner = ModelRunner(config, tp, device_for(0))
                self._wait_ready(conns)
        except BaseException:
            if store_listener is not None:
                store_listener.close()
            self.shutdown()
            if self.dead is not None:
                raise WorkerDiedError(*self.dead)
            raise
        self.num_blocks = self.runner.num_blocks

    def _init_torchrun(self, config: EngineConfig, env) -> None:
        """Rank 0 under torchrun: workers already exist; share the channel with them."""
        from tpserve.workers.model_runner import ModelRunner
        from tpserve.workers.rendezvous import share_channel

        rank, world, local_rank, local_world = env
        assert rank == 0 and world == self.world, "torchrun world size must equal --tp"
        tp = init_tp(0, world, None, timeout_s=self.startup_timeout, local_rank=local_rank)
        self.channel = share_channel(world, local_world)
        self.runner = ModelRunner(config, tp, device_for(local_rank))

    # ---- health --------------------------------------------------------------------------
    def _watch(self) -> None:
        def watchdog():
            sentinels = {p.sentinel: r for r, p in enumerate(self.procs, start=1)}
            while sentinels and not self._closing.is_set():
                for s in wait(list(sentinels), timeout=0.5):
                    rank = sentinels.pop(s)
                    if self._closing.is_set():
                        return
                    proc = self.procs[rank - 1]
                    proc.join(timeout=2.0)  # the sentinel fires before the exit status is reaped
                    self.dead = (rank, proc.exitcode)
                    log.error("tensor-parallel worker rank %d exited with code %s", *self.dead)
                    # Tear the others down: peers blocked in a collective with the dead rank
                    # then fail fast instead of waiting for a timeout.
                    for p in self.procs:
                        if p.is_alive():
                            p.kill()
                    with self._pipe_lock:
                        if self._dead_w >= 0:
                            os.write(self._dead_w, b"x")
                    return
        threading.Thread(target=watchdog, name="tpserve-watchdog", daemon=True).start()

    def _wait_ready(self, conns) -> None:
        deadline = time.monotonic() + self.startup_timeout
        pending = {c: r for r, c in enumerate(conns, start=1)}
        while pending:
            if self.dead is not None:
                raise WorkerDiedError(*self.dead)
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"tensor-parallel ranks {sorted(pending.values())} did not become "
                                   f"ready within {self.startup_timeout:g} s")
            for c in wait(list(pending), timeout=min(left, 0.5)):
                rank = pending.pop(c)
                try:
                    kind, payload = c.recv()
                except EOFError:
                    kind, payload = "error", "exited before reporting"
                if kind != "ready":
                    raise RuntimeError(f"tensor-parallel rank {rank} failed to start: {payload}")

    def check_health(self) -> None:
        """Raise WorkerDiedError if a worker has exited."""
        if self.dead is not None:
            raise WorkerDiedError(*self.dead)

    def health_fd(self) -> int | None:
        """A file descriptor that becomes readable (and stays so) when a worker dies.

        None under torchrun, where this process has no handle on the other ranks.
        """
        return self._dead_r if self.procs else None

    # ---- steps ---------------------------------------------------------------------------
    def _publish(self, plan: StepPlan) -> None:
        self.check_health()
        self.channel.publish(plan)

    def execute(self, plan: StepPlan, sample=None):
        self._publish(plan)
        try:
            out = self.runner.execute(plan, sample)
        except Exception:
            # Give the watchdog a moment: a collective usually fails just before the sentinel fires.
            for _ in range(50):
                if self.dead is not None:
                    break
                time.sleep(0.1)
            self.check_health()
            raise
        return out

    def control(self, cmd: Command, **args) -> None:
        plan = StepPlan.command(cmd, **args)
        self._publish(plan)
        self.runner.handle(plan)

    def shutdown(self) -> None:
        if self._closing.is_set():
            return
        self._closing.set()
        if self.channel is not None and self.dead is None:
            try:
                self.channel.publish(StepPlan.command(Command.SHUTDOWN), timeout=5.0)
            except Exception as e:  # workers that cannot take it are killed below
                log.warning("could not send shutdown to workers: %s", e)
        for rank, p in enumerate(self.procs, start=1):
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
            if self.dead is None:
                (log.info if p.exitcode == 0 else log.warning)(
                    "tensor-parallel worker rank %d exited with code %s", rank, p.exitcode)
        runner = getattr(self, "runner", None)
        if runner is not None:
            runner.close()
            self.runner = None
        destroy_tp()
        if self.channel is not None:
            self.channel.close()
            self.channel = None
        with self._pipe_lock:
            os.close(self._dead_r)
            os.close(self._dead_w)
            self._dead_w = -1


def _worker_entry(*args) -> None:
    from tpserve.workers.worker import worker_main
    worker_main(*args)
