"""The main function of a tensor-parallel worker process (ranks 1..N-1).

Life cycle: join the process group, build this rank's ModelRunner (its model shard and KV
cache), attach to the plan channel, tell rank 0 it is ready, then run every plan rank 0
publishes until a SHUTDOWN command arrives or rank 0 disappears.
"""
from __future__ import annotations

import logging
import os
import signal
import traceback

from tpserve.config import EngineConfig
from tpserve.plan import Command, StepPlan
from tpserve.workers.process_group import destroy_tp, device_for, init_tp

log = logging.getLogger("tpserve.worker")


def serve_plans(runner, channel) -> None:
    """Execute plans from ``channel`` until SHUTDOWN; raises ChannelClosed if rank 0 dies."""
    while True:
        plan: StepPlan = channel.receive()
        if plan.cmd == Command.SHUTDOWN:
            return
        runner.handle(plan)


def worker_main(rank: int, world_size: int, config: dict, init_method: str | None,
                channel_name: str | None, ready_conn) -> None:
    """Entry point of a spawned worker. Reports ("ready", blocks) or ("error", text) on ready_conn."""
    # Ctrl-C in a terminal reaches the whole process group; rank 0 decides how to stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from tpserve.workers.channel import ChannelClosed, PlanReader
    from tpserve.workers.model_runner import ModelRunner

    reader = None
    code = 0
    try:
        local_rank = rank if init_method else int(os.environ.get("LOCAL_RANK", rank))
        tp = init_tp(rank, world_size, init_method, local_rank=local_rank)
        cfg = EngineConfig(**config).resolve()
        runner = ModelRunner(cfg, tp, device_for(local_rank))
        reader = PlanReader.attach(channel_name, rank - 1)
        ready_conn.send(("ready", runner.num_blocks))
        ready_conn.close()
        serve_plans(runner, reader)
    except ChannelClosed:
        log.warning("rank %d: rank 0 is gone, exiting", rank)
        code = 1
    except BaseException:
        text = traceback.format_exc()
        try:
            ready_conn.send(("error", text))
        except (OSError, ValueError):
            pass
        log.error("rank %d failed:\n%s", rank, text)
        code = 1
    finally:
        if reader is not None:
            reader.close()
        destroy_tp()
    os._exit(code)
