"""The body of a tensor-parallel worker (ranks 1..N-1), spawned by rank 0 or started by torchrun.

Life cycle: join the process group, join the plan channel (see rendezvous.py), build this
rank's ModelRunner (its model shard and KV cache), tell rank 0 it is ready (spawned workers
only; torchrun ranks meet in the collectives), then run every plan rank 0 publishes until a
SHUTDOWN command arrives or rank 0 disappears.
"""
from __future__ import annotations

import logging
import os
import signal
import traceback

from tpserve.config import EngineConfig
from tpserve.plan import Command, StepPlan
from tpserve.procs import freeze_heap
from tpserve.workers.process_group import destroy_tp, device_for, init_tp, torchrun_env

log = logging.getLogger("tpserve.worker")


def serve_plans(runner, channel) -> None:
    """Execute plans from ``channel`` until SHUTDOWN; raises ChannelClosed if rank 0 dies."""
    while True:
        plan: StepPlan = channel.receive()
        if plan.cmd == Command.SHUTDOWN:
            return
        runner.handle(plan)


def run_worker(rank: int, world_size: int, config: EngineConfig, init_method: str | None,
               ring_name: str | None, local_rank: int, ready_conn=None) -> int:
    """Serve plans as ``rank``; returns the exit code (0 after SHUTDOWN, 1 on any failure).

    ``init_method`` and ``ring_name`` None mean torchrun (env:// rendezvous, channel announced
    by rank 0). ``ready_conn`` gets ("ready", num_blocks) or ("error", traceback text).
    """
    from tpserve.workers.channel import ChannelClosed
    from tpserve.workers.model_runner import ModelRunner
    from tpserve.workers.rendezvous import join_channel

    channel = runner = None
    try:
        tp = init_tp(rank, world_size, init_method, local_rank=local_rank)
        channel = join_channel(rank, ring_name)
        runner = ModelRunner(config.resolve(), tp, device_for(local_rank))
        if ready_conn is not None:
            ready_conn.send(("ready", runner.num_blocks))
            ready_conn.close()
        freeze_heap()  # a full collection here would stall every rank's collective
        serve_plans(runner, channel)
        return 0
    except ChannelClosed:
        log.warning("rank %d: rank 0 is gone, exiting", rank)
        return 1
    except BaseException:
        text = traceback.format_exc()
        if ready_conn is not None:
            try:
                ready_conn.send(("error", text))
            except (OSError, ValueError):
                pass
        log.error("rank %d failed:\n%s", rank, text)
        return 1
    finally:
        if runner is not None:
            runner.close()
        if channel is not None:
            channel.close()
        destroy_tp()


def worker_main(rank: int, world_size: int, config: dict, init_method: str,
                ring_name: str, ready_conn) -> None:
    """Entry point of a worker spawned by rank 0 (never returns)."""
    # Ctrl-C in a terminal reaches the whole process group; rank 0 decides how to stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os._exit(run_worker(rank, world_size, EngineConfig(**config), init_method, ring_name,
                        local_rank=rank, ready_conn=ready_conn))


def run_torchrun_worker(config: EngineConfig) -> int:
    """Body of a rank > 0 started by torchrun (RANK, WORLD_SIZE, LOCAL_RANK). Returns the exit code."""
    env = torchrun_env()
    if env is None:
        raise RuntimeError("run_torchrun_worker needs RANK and WORLD_SIZE (start it with torchrun)")
    rank, world, local_rank, _ = env
    config.tensor_parallel_size = world
    return run_worker(rank, world, config, None, None, local_rank)
