"""Process groups for tensor parallelism: NCCL on CUDA, gloo on CPU; loopback rendezvous.

Rendezvous of spawned (single-node) ranks: rank 0 serves the group's c10d TCPStore, which has
no authentication. Left to itself the store listens on every interface for the life of the
process; here rank 0 binds its listening socket to 127.0.0.1 (``StoreListener``, made before
the workers are spawned so they know the port), the store waits until every rank has
connected, and the socket then stops accepting: the ranks keep their connections, and nobody
else, local or remote, can reach the store afterwards. Gloo's own connections between the
ranks are made on the loopback interface too. Under torchrun (env://) the rendezvous is
torchrun's.

Start-up order on CUDA: a rank makes ``cuda:local_rank`` its current device *before* it joins
the group, and passes it as ``device_id``. NCCL binds a communicator to the current device when
it is created (eagerly with ``device_id``, else at the first collective); a rank that has not
set its device yet would join on cuda:0, so every rank of a node would share one GPU.

Tear-down: ``destroy_tp`` must really free the group, or its gloo worker threads outlive it
and the interpreter's exit aborts the process. ``torch.distributed.nn.functional`` binds
``group.WORLD`` into its functions' default arguments when it is first imported; imported while
a group exists (transformers imports it, through torch.distributed.fsdp, when it reads a Llama
config) it holds that group forever. A gloo worker thread then finishes destroying the last
collective's work during interpreter finalization, drops a tensor whose Python object needs the
GIL, is exited by Python (pthread_exit), and the unwind through a noexcept destructor calls
std::terminate: "terminate called without an active exception", SIGABRT, in about one run in
six. So ``init_tp`` imports that module before the group exists, and ``destroy_tp`` drops any
default argument still holding the group before releasing it.
"""
from __future__ import annotations

import datetime
import os
import socket
import sys
import types

import torch
import torch.distributed as dist

from tpserve.models.parallel import TPContext
from tpserve.workers import device as devices
from tpserve.workers.shm_allreduce import ShmAllReduce


class StoreListener:
    """Rank 0's listening socket for the group's store, on loopback, on a port the kernel picks.

    ``init_method`` names it for the workers; ``close`` stops it accepting (the store's
    established connections stay)."""

    def __init__(self):
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(128)
        self.port = self._sock.getsockname()[1]
        self.init_method = f"tcp://127.0.0.1:{self.port}"

    def store_fd(self) -> int:
        """A descriptor of the socket for the store to own (it closes its copy itself)."""
        return os.dup(self._sock.fileno())

    def close(self) -> None:
        if self._sock.fileno() < 0:
            return
        try:
            # The store's copy of the socket shares the listening state: this ends it for both.
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()


def free_port() -> int:
    """A TCP port free on the loopback interface right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def device_for(local_rank: int) -> torch.device:
    """This process's device (cuda:local_rank, or the CPU), made current."""
    accel = devices.local_accelerator(local_rank)
    accel.set_device()
    return accel.device


def init_tp(rank: int, world_size: int, init_method: str | None = None,
            timeout_s: float = 120.0, local_rank: int | None = None,
            store_listener: StoreListener | None = None) -> TPContext:
    """Join the default process group; ``init_method`` None means torchrun's env://.

    A ``tcp://127.0.0.1:PORT`` init method is the single-node rendezvous of the module
    docstring: rank 0 passes the ``store_listener`` whose port it names, and closes it once
    every rank has connected. ``local_rank`` (default ``rank``, right for single-node spawns)
    picks this rank's device, which is made current before the group exists and bound to it
    through ``device_id``.
    """
    if world_size == 1:
        return TPContext()
    accel = devices.local_accelerator(rank if local_rank is None else local_rank)
    accel.set_device()
    if not accel.is_accelerator:
        share_cpu_threads(world_size)
    import torch.distributed.nn  # noqa: F401  (before the group: see the module docstring)
    if not dist.is_initialized():
        kwargs = {}
        if accel.dist_device_id() is not None:
            kwargs["device_id"] = accel.dist_device_id()
        timeout = datetime.timedelta(seconds=timeout_s)
        single_node = init_method is not None and init_method.startswith("tcp://")
        if single_node:
            kwargs["store"] = _loopback_store(rank, world_size, init_method, timeout, store_listener)
        else:
            kwargs["init_method"] = init_method or "env://"
        # Gloo picks its interface when the group is made (from the host name unless told):
        # ranks of one machine talk over loopback only.
        loopback_gloo = (single_node and accel.dist_backend == "gloo" and sys.platform.startswith("linux")
                         and "GLOO_SOCKET_IFNAME" not in os.environ)
        if loopback_gloo:
            os.environ["GLOO_SOCKET_IFNAME"] = "lo"
        try:
            dist.init_process_group(backend=accel.dist_backend, rank=rank, world_size=world_size,
                                    timeout=timeout, **kwargs)
        finally:
            if loopback_gloo:
                del os.environ["GLOO_SOCKET_IFNAME"]
    shm = None
    if not accel.is_accelerator and _one_machine(init_method, world_size) and \
            os.environ.get("TPSERVE_SHM_ALLREDUCE", "1") != "0":
        shm = ShmAllReduce.join(rank, world_size, timeout_s=timeout_s)
    return TPContext(rank=rank, size=world_size, group=None, shm=shm)


def _one_machine(init_method: str | None, world_size: int) -> bool:
    """Whether every rank runs on this machine: tpserve's own spawn (a tcp:// rendezvous), or
    torchrun with all of its ranks local."""
    if init_method is not None:
        return init_method.startswith("tcp://")
    return os.environ.get("LOCAL_WORLD_SIZE") == str(world_size)


def _loopback_store(rank: int, world_size: int, init_method: str, timeout: datetime.timedelta,
                    listener: StoreListener | None) -> dist.TCPStore:
    host, port = init_method[len("tcp://"):].rsplit(":", 1)
    if rank != 0:
        return dist.TCPStore(host, int(port), world_size, is_master=False, timeout=timeout)
    assert listener is not None and listener.port == int(port), "rank 0 serves the store it names"
    try:
        # Returns once all world_size ranks are connected; none connects again afterwards.
        return dist.TCPStore(host, int(port), world_size, is_master=True, timeout=timeout,
                             wait_for_workers=True, master_listen_fd=listener.store_fd(), use_libuv=True)
    finally:
        listener.close()


def share_cpu_threads(world_size: int) -> None:
    """Split this machine's cores between the ranks of a CPU tensor-parallel group.

    Every rank runs its own intra-op thread pool; with more threads than cores, each parallel
    region waits for descheduled threads at its barrier (measured: a 1024x512 matmul went from
    0.4 ms to 16 ms), so each rank takes its share of the cores only.
    """
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    torch.set_num_threads(max(1, cores // world_size))


def destroy_tp() -> None:
    """Destroy the default group and free it now: its gloo threads are joined here, while the
    interpreter is alive, never during its finalization (module docstring)."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    group = dist.group.WORLD
    try:
        dist.destroy_process_group()
    except Exception:  # a peer may already be gone; nothing left to release
        pass
    _drop_default_arguments(group)
    del group  # the last reference: the C++ group joins its worker threads now


def _drop_default_arguments(group) -> None:
    """Replace ``group`` by None in the default arguments of the functions and methods of the
    loaded ``torch.distributed`` modules: a destroyed group is no use to them, and None means
    the default group again. (The garbage collector cannot find these holders: a defaults tuple
    of untracked objects, such as a group, is itself untracked.)"""
    def fix(fn) -> None:
        if type(fn) is not types.FunctionType:
            return
        if fn.__defaults__ and any(d is group for d in fn.__defaults__):
            fn.__defaults__ = tuple(None if d is group else d for d in fn.__defaults__)
        if fn.__kwdefaults__ and any(d is group for d in fn.__kwdefaults__.values()):
            fn.__kwdefaults__ = {k: None if d is group else d for k, d in fn.__kwdefaults__.items()}

    for name, module in list(sys.modules.items()):
        if not name.startswith("torch.distributed") or type(module) is not types.ModuleType:
            continue
        for value in list(vars(module).values()):
            if type(value) is type:
                for member in list(vars(value).values()):
                    fix(member)
            else:
                fix(value)


def torchrun_env() -> tuple[int, int, int, int] | None:
    """(rank, world_size, local_rank, local_world_size) when started by torchrun, else None."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    world = int(os.environ["WORLD_SIZE"])
    return (int(os.environ["RANK"]), world, int(os.environ.get("LOCAL_RANK", 0)),
            int(os.environ.get("LOCAL_WORLD_SIZE", world)))
