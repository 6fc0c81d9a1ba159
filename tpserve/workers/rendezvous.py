"""How rank 0 and the workers agree on the plan channel: both halves of the handshake.

    spawned workers   rank 0 creates the shared-memory ring before spawning them and passes
                      its name as an argument; each worker attaches as reader ``rank - 1``.
    torchrun          every rank is already in the process group. Rank 0 broadcasts the ring's
                      name when all ranks share its node, else None, and then every rank builds
                      a gloo group for the broadcast channel. Both sides make the same
                      collective calls in the same order, before building their runners.
"""
from __future__ import annotations

import torch.distributed as dist

from tpserve.workers.broadcast_channel import BroadcastPlanChannel
from tpserve.workers.channel import PlanReader, PlanWriter


def create_ring(num_readers: int) -> PlanWriter:
    """Rank 0 before spawning workers: a fresh ring."""
    return PlanWriter.create(num_readers=num_readers)


def share_channel(world: int, local_world: int):
    """Rank 0 under torchrun: the channel it publishes on, announced to every other rank."""
    if local_world == world:
        channel = PlanWriter.create(num_readers=world - 1)
        dist.broadcast_object_list([channel.name], src=0)
        return channel
    dist.broadcast_object_list([None], src=0)
    return BroadcastPlanChannel(dist.new_group(backend="gloo"), src=0)


def join_channel(rank: int, ring_name: str | None):
    """A worker's end: attach to ``ring_name`` (spawned), or, when None (torchrun), take what
    rank 0's ``share_channel`` announces."""
    if ring_name is None:
        box = [None]
        dist.broadcast_object_list(box, src=0)
        if box[0] is None:
            return BroadcastPlanChannel(dist.new_group(backend="gloo"), src=0)
        ring_name = box[0]
    return PlanReader.attach(ring_name, rank - 1)
