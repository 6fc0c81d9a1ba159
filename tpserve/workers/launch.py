"""Launch paths for ranks started by torchrun, and an offline entry point.

    torchrun --nproc-per-node 2 -m tpserve.workers.launch --model DIR --prompt "def f(" ...

Every rank runs this module. Rank 0 builds the engine (scheduler + its runner) and generates;
the other ranks call ``run_torchrun_worker`` and serve plans until rank 0 shuts them down.
``tpserve serve`` under torchrun uses the same function for ranks > 0.
"""
from __future__ import annotations

import argparse
import logging
import sys

from tpserve.config import EngineConfig
from tpserve.workers.process_group import destroy_tp, device_for, init_tp, torchrun_env

log = logging.getLogger("tpserve.launch")


def run_torchrun_worker(config: EngineConfig) -> int:
    """Body of a rank > 0 started by torchrun. Returns the process exit code."""
    import torch.distributed as dist
    from tpserve.workers.broadcast_channel import BroadcastPlanChannel
    from tpserve.workers.channel import ChannelClosed, PlanReader
    from tpserve.workers.model_runner import ModelRunner
    from tpserve.workers.worker import serve_plans

    env = torchrun_env()
    if env is None:
        raise RuntimeError("run_torchrun_worker needs RANK and WORLD_SIZE (start it with torchrun)")
    rank, world, local_rank, local_world = env
    if world != config.tensor_parallel_size:
        config.tensor_parallel_size = world
    config.resolve()
    tp = init_tp(rank, world, None, local_rank=local_rank)
    box = [None]
    dist.broadcast_object_list(box, src=0)
    if box[0] is not None:
        channel = PlanReader.attach(box[0], rank - 1)
    else:
        channel = BroadcastPlanChannel(dist.new_group(backend="gloo"), src=0)
    runner = ModelRunner(config, tp, device_for(local_rank))
    try:
        serve_plans(runner, channel)
        return 0
    except ChannelClosed:
        log.warning("rank %d: rank 0 is gone, exiting", rank)
        return 1
    finally:
        channel.close()
        destroy_tp()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Offline tensor-parallel generation (run under torchrun).")
    ap.add_argument("--model", default=None)
    ap.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    ap.add_argument("--token-ids", action="append", default=[],
                    help="a prompt given as comma-separated token ids (repeatable)")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--ignore-eos", action="store_true")
    ap.add_argument("--num-kv-blocks", type=int, default=None)
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    env = torchrun_env()
    world = env[1] if env else 1
    cfg = dict(model=args.model, tensor_parallel_size=world, num_kv_blocks=args.num_kv_blocks,
               dtype=args.dtype)
    if env is not None and env[0] != 0:
        return run_torchrun_worker(EngineConfig(**cfg))
    from tpserve.llm import LLM
    from tpserve.sampling import SamplingParams
    prompts = args.prompt + [[int(t) for t in ids.split(",")] for ids in args.token_ids]
    prompts = prompts or ["def fibonacci(n):"]
    with LLM(**cfg) as llm:
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=args.max_tokens,
                                                     ignore_eos=args.ignore_eos),
                            use_tqdm=False)
    for p, o in zip(prompts, outs):
        print(f"--- prompt {p!r}\ntoken_ids={o.token_ids}\n{o.text}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
