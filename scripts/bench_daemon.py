"""Daemon overhead: the same workload through `tpserve start` + concurrent clients vs the offline API.

    python scripts/bench_daemon.py [--model DIR] [--clients 8] [--requests-per-client 4]
                                   [--max-tokens 16] [--tp 1] [--latency-trials 20]

In one run:
  1. offline: ``LLM(model).generate(prompts)`` on the whole workload -> tokens/s;
     engine time to first token of a short request, stepping the engine directly;
  2. daemon: `tpserve start` with the same engine options; ``--clients`` processes each open
     ``--requests-per-client`` streams at once (token-id prompts, greedy, ignore_eos) -> tokens/s;
     time to first streamed token of the same short request through a Client.
Prints one line: both throughputs, their ratio, and the latency the daemon adds to a short
request (client time to first token minus engine time to first token, medians).

Model: ``--model DIR``, or by default the ~40M-parameter Qwen3-architecture random-weight model
of scripts/bench_models.py (built once under --cache-dir, with a byte-level BPE tokenizer added,
since the daemon streams text).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

TPSERVE = [sys.executable, "-m", "tpserve"]

CLIENT = textwrap.dedent("""
    import json, sys, time
    from tpserve.client.client import Client
    spec = json.loads(sys.stdin.readline())
    with Client(spec["address"], timeout=600) as c:
        c.ping()
        sys.stdout.write("ready\\n"); sys.stdout.flush()
        sys.stdin.readline()  # go
        streams = [c.stream(p, temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=True)
                   for p in spec["prompts"]]
        tokens = 0
        for s in streams:  # streams run concurrently on the daemon; reading order does not matter
            for d in s:
                tokens += len(d.token_ids)
        done = time.time()
    print(json.dumps({"tokens": tokens, "done": done}))
""")


def ensure_tokenizer(path: Path, vocab_size: int) -> None:
    """Give a tokenizer-less benchmark checkpoint a byte-level BPE tokenizer of ``vocab_size``."""
    if (path / "tokenizer.json").exists():
        return
    import random
    import string

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(0)
    letters = string.ascii_lowercase + string.digits
    corpus = [" ".join("".join(rng.choice(letters) for _ in range(rng.randint(2, 9))) for _ in range(50))
              for _ in range(20000)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus, trainer=trainer)
    missing = vocab_size - tok.get_vocab_size()
    if missing > 0:
        tok.add_tokens([f"<|extra_{i}|>" for i in range(missing)])
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                            pad_token="<|endoftext|>").save_pretrained(path)


def default_model(cache_dir: Path) -> Path:
    from bench_models import BENCH_CONFIG, build_bench_model
    path = build_bench_model(cache_dir / "qwen3-40m-bf16")
    ensure_tokenizer(path, BENCH_CONFIG["vocab_size"])
    return path


def workload(n: int, vocab: int, lo: int, hi: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, size=int(rng.integers(lo, hi + 1))).tolist() for _ in range(n)]


def run_offline(model, options, prompts, max_tokens, short_prompt, trials):
    from tpserve import LLM, SamplingParams
    llm = LLM(str(model), **options)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        llm.generate(prompts[:2], params, use_tqdm=False)  # warm-up
        t = time.perf_counter()
        res = llm.generate(prompts, params, use_tqdm=False)
        dt = time.perf_counter() - t
        tokens = sum(len(r.token_ids) for r in res)
        engine = llm.engine
        one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        ttft = []
        for i in range(trials):
            rid = f"latency-{i}"
            t0 = time.perf_counter()
            engine.add_request(rid, short_prompt, one)
            while not any(o.request_id == rid and o.new_token_ids for o in engine.step()):
                pass
            ttft.append(time.perf_counter() - t0)
            while engine.has_unfinished():
                engine.step()
        return tokens / dt, statistics.median(ttft)
    finally:
        llm.shutdown()


def run_daemon(model, config, prompts, clients, max_tokens, short_prompt, trials):
    from tpserve.client.client import Client
    from tpserve.cli.options import options_argv

    rd = tempfile.mkdtemp(prefix="tpb-", dir="/tmp")
    try:
        out = subprocess.run(TPSERVE + ["start", "--runtime-dir", rd, "--log-level", "warning"]
                             + options_argv(config), capture_output=True, text=True)
        if out.returncode != 0:
            raise SystemExit(f"tpserve start failed:\n{out.stderr}")
        address = out.stdout.strip()
        with Client(address, timeout=600) as c:
            c.generate(prompts[0], temperature=0.0, max_tokens=2, ignore_eos=True)  # warm-up
        per = [prompts[i::clients] for i in range(clients)]
        procs = [subprocess.Popen([sys.executable, "-c", CLIENT], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  text=True) for _ in per]
        for p, ps in zip(procs, per):
            p.stdin.write(json.dumps({"address": address, "prompts": ps, "max_tokens": max_tokens}) + "\n")
            p.stdin.flush()
        for p in procs:
            assert p.stdout.readline().strip() == "ready"
        start = time.time()
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        results = []
        for p in procs:
            line = p.stdout.readline()
            p.wait()
            if p.returncode != 0 or not line:
                raise SystemExit("a benchmark client failed")
            results.append(json.loads(line))
        dt = max(r["done"] for r in results) - start
        tokens = sum(r["tokens"] for r in results)
        ttft = []
        with Client(address, timeout=600) as c:
            for _ in range(trials):
                t0 = time.perf_counter()
                stream = c.stream(short_prompt, temperature=0.0, max_tokens=1, ignore_eos=True)
                next(stream)
                ttft.append(time.perf_counter() - t0)
                for _ in stream:
                    pass
        return tokens / dt, statistics.median(ttft)
    finally:
        subprocess.run(TPSERVE + ["stop", "--runtime-dir", rd], capture_output=True)
        shutil.rmtree(rd, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="model directory [default: the ~40M Qwen3 benchmark model]")
    ap.add_argument("--cache-dir", default=os.path.join(tempfile.gettempdir(), "tpserve-bench-models"))
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--requests-per-client", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, nargs=2, default=(16, 64), metavar=("MIN", "MAX"))
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--latency-trials", type=int, default=20)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--kv-cache-memory-gb", type=float, default=1.0)
    ap.add_argument("--attention-backend", default="auto")
    args = ap.parse_args()

    from tpserve.config import EngineConfig

    model = Path(args.model) if args.model else default_model(Path(args.cache_dir))
    n = args.clients * args.requests_per_client
    options = dict(tensor_parallel_size=args.tp, dtype=args.dtype, block_size=args.block_size,
                   kv_cache_memory_gb=args.kv_cache_memory_gb, attention_backend=args.attention_backend,
                   max_num_seqs=max(n, 1))
    config = EngineConfig(model=str(model.resolve()), **options).resolve()
    vocab = int(config.hf_config["vocab_size"])
    prompts = workload(n, vocab, *args.prompt_len)
    short_prompt = workload(1, vocab, 8, 8, seed=1)[0]

    offline_tps, engine_ttft = run_offline(model, options, prompts, args.max_tokens, short_prompt,
                                           args.latency_trials)
    daemon_tps, client_ttft = run_daemon(model, config, prompts, args.clients, args.max_tokens, short_prompt,
                                         args.latency_trials)
    print(f"bench_daemon model={model.name} tp={args.tp} requests={n} clients={args.clients} "
          f"max_tokens={args.max_tokens} offline_tok_s={offline_tps:.1f} daemon_tok_s={daemon_tps:.1f} "
          f"ratio={daemon_tps / offline_tps:.3f} engine_ttft_ms={engine_ttft * 1e3:.2f} "
          f"client_ttft_ms={client_ttft * 1e3:.2f} added_latency_ms={(client_ttft - engine_ttft) * 1e3:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
