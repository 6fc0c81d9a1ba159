"""Tensor parallelism across CPU processes (gloo): same greedy output, clean life cycle."""
import os
import signal
import subprocess
import sys

import pytest

from model_factory import make_tiny_model, tiny_models_root  # noqa: F401
from test_llm import hf_greedy
from tpserve import LLM, SamplingParams, WorkerDiedError

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], list(range(20, 61)), [100, 3, 4]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def shm_segments() -> set[str]:
    """This process's plan-ring segments (other processes on the machine may run tpserve too)."""
    return {f for f in os.listdir("/dev/shm") if f.startswith(f"tpserve-{os.getpid()}-")}


def child_pids() -> set[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(os.getpid())], capture_output=True, text=True)
    return {int(x) for x in out.stdout.split()} - {os.getpid()}


@pytest.mark.parametrize("arch,overrides", [
    ("qwen3", {}),
    ("llama", {}),
    # fewer KV heads than ranks, and a vocabulary that 2 does not divide
    ("qwen3", {"num_key_value_heads": 1, "vocab_size": 385}),
    ("llama", {"tie_word_embeddings": True, "vocab_size": 387}),
])
def test_tp2_greedy_equals_tp1_and_transformers(tiny_models_root, arch, overrides):  # noqa: F811
    path = make_tiny_model(tiny_models_root, arch=arch, **overrides)
    ref = hf_greedy(path, PROMPTS, max_tokens=8)
    before = shm_segments()
    with LLM(str(path), dtype="float32", num_kv_blocks=64, tensor_parallel_size=2) as llm:
        tp2 = [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    with LLM(str(path), dtype="float32", num_kv_blocks=64) as llm:
        tp1 = [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert tp2 == tp1 == ref
    assert shm_segments() <= before
    assert not any(p for p in child_pids() if _is_worker(p))


def _is_worker(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"spawn_main" in f.read()
    except OSError:
        return False


def test_killed_worker_makes_generate_raise_and_cleans_up(tiny_models_root):  # noqa: F811
    path = make_tiny_model(tiny_models_root, arch="qwen3")
    before = shm_segments()
    llm = LLM(str(path), dtype="float32", num_kv_blocks=64, tensor_parallel_size=2)
    worker = llm.engine.executor.procs[0]
    step = llm.engine.step

    def step_then_kill():
        if llm.engine.num_steps == 3:
            os.kill(worker.pid, signal.SIGKILL)
        return step()

    llm.engine.step = step_then_kill
    with pytest.raises(WorkerDiedError, match="rank 1") as info:
        llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=200, ignore_eos=True), use_tqdm=False)
    assert info.value.rank == 1 and info.value.exitcode == -signal.SIGKILL
    llm.shutdown()
    assert not worker.is_alive()
    assert shm_segments() <= before


def test_torchrun_launch_generates_and_exits_zero(tiny_models_root):  # noqa: F811
    path = make_tiny_model(tiny_models_root, arch="qwen3")
    ref = hf_greedy(path, [PROMPTS[0]], max_tokens=8)[0]
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [torchrun, "--standalone", "--nproc-per-node", "2", "-m", "tpserve.launch",
         "--model", str(path), "--num-kv-blocks", "64", "--max-tokens", "8", "--dtype", "float32", "--ignore-eos",
         "--token-ids", ",".join(map(str, PROMPTS[0]))],
        capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"token_ids={ref}" in proc.stdout


def test_torchrun_two_nodes_use_the_broadcast_channel(tiny_models_root):  # noqa: F811
    """Two single-process 'nodes' on loopback: plans cross over the gloo broadcast channel."""
    path = make_tiny_model(tiny_models_root, arch="qwen3")
    ref = hf_greedy(path, [PROMPTS[1]], max_tokens=6)[0]
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen(
        [torchrun, "--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(node),
         "--master-addr", "127.0.0.1", "--master-port", str(port), "-m", "tpserve.launch",
         "--model", str(path), "--num-kv-blocks", "64", "--max-tokens", "6", "--dtype", "float32",
         "--ignore-eos", "--token-ids", ",".join(map(str, PROMPTS[1]))],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for node in (0, 1)]
    outs = [p.communicate(timeout=240) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs[0][1][-2000:] + outs[1][1][-2000:]
    assert f"token_ids={ref}" in outs[0][0]


def _listening(pid: int) -> list[tuple[str, int]]:
    """(address as /proc/net writes it, port) of every TCP socket ``pid`` listens on."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    out = []
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}") as f:
            for line in f.read().splitlines()[1:]:
                cols = line.split()
                if cols[3] == "0A" and cols[9] in inodes:  # LISTEN
                    address, port = cols[1].split(":")
                    out.append((address, int(port, 16)))
    return out


_LOOPBACK = ("0100007F", "00000000000000000000000001000000", "0000000000000000FFFF00000100007F")


def test_tp_ranks_listen_on_loopback_only_and_the_store_closes(tiny_models_root, monkeypatch):  # noqa: F811
    """The rendezvous store (and gloo) are not reachable from other machines, and nobody can
    connect to the store once the group is up."""
    import socket

    from tpserve.workers import executor, process_group
    listeners = []

    class Recorded(process_group.StoreListener):
        def __init__(self):
            super().__init__()
            listeners.append(self)
    monkeypatch.setattr(executor, "StoreListener", Recorded)
    path = make_tiny_model(tiny_models_root, arch="qwen3")
    with LLM(str(path), dtype="float32", num_kv_blocks=64, tensor_parallel_size=2) as llm:
        pids = [os.getpid()] + [p.pid for p in llm.engine.executor.procs]
        sockets = {pid: _listening(pid) for pid in pids}
        assert all(address in _LOOPBACK for s in sockets.values() for address, _ in s), sockets
        (store,) = listeners
        assert all(port != store.port for s in sockets.values() for _, port in s), sockets
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", store.port), timeout=5).close()
        assert llm.generate([PROMPTS[0]], GREEDY, use_tqdm=False)[0].token_ids
