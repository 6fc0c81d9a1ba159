"""Offline tensor-parallel generation under torchrun: every rank runs this module.

    torchrun --nproc-per-node 2 -m tpserve.launch --model DIR --prompt "def f(" ...

Rank 0 builds the offline ``LLM`` (scheduler + its runner) and generates; the other ranks are
workers (``run_torchrun_worker``) serving plans until rank 0 shuts them down.
"""
from __future__ import annotations

import argparse
import logging
import sys

from tpserve.config import EngineConfig
from tpserve.workers.process_group import torchrun_env
from tpserve.workers.worker import run_torchrun_worker


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
