"""Agent sessions against the KV tiers: prefill computed and time to first token, with and
without --kv-offload-host-gb / --kv-offload-dir, and the first turn after a restart.

    python scripts/bench_agent.py [--shape 40m] [--sessions 16] [--system-tokens 8000] [--turns 6]
                                  [--user-tokens 200] [--reply-tokens 32] [--pool-sessions 2]

Workload (token ids, greedy, ignore_eos; the in-process Engine with the serving defaults): each
session has one of 4 distinct system prompts (session i: prompt i mod 4) and a history that
grows every turn by a user message (``--user-tokens``) and the model's reply
(``--reply-tokens``); every turn resends the whole conversation. Turns go round-robin over the
sessions, one request at a time, so a request's time to first token is its own admission, load
and prefill. The KV pool holds about ``--pool-sessions`` whole sessions, so without tiers the
pool's prefix cache keeps losing the prefixes the next sessions need.

Lines (the CPU's ISA and the dtype in the first):
  * ``tiers=off`` and ``tiers=on`` (host tier sized to hold every session, and a disk tier in a
    temporary directory): TTFT p50/p99 over all turns and the prompt tokens computed;
  * ``ratio``: tiers on / off for prefill tokens computed (target <= 0.3) and TTFT p50 (<= 0.4);
  * ``restart``: a new engine on the tiers run's directory (disk tier only) serves a new
    session's first turn (a system prompt and a user message) against a freshly started engine
    without tiers (target <= 0.25).
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_models import SHAPE_DIRS, SHAPE_OVERRIDES, build_bench_model  # noqa: E402
from bench_throughput import cpu_isa  # noqa: E402

BLOCK = 16


def one_request(eng, rid: str, prompt: list[int], max_tokens: int) -> tuple[float, list[int]]:
    """(seconds to the first token, the generated tokens) of one request run to the end."""
    from tpserve.sampling import SamplingParams
    t0 = time.perf_counter()
    eng.add_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
                    detokenize=False)
    ttft, tokens = None, []
    while eng.has_unfinished():
        for out in eng.step():
            if out.request_id == rid and out.new_token_ids:
                if ttft is None:
                    ttft = time.perf_counter() - t0
                tokens += out.new_token_ids
    return ttft, tokens


def make_engine(path: Path, args, pool_blocks: int, max_len: int, **tiers):
    from tpserve.config import EngineConfig
    from tpserve.engine import Engine
    return Engine(EngineConfig(model=str(path), block_size=BLOCK, num_kv_blocks=pool_blocks,
                               max_model_len=max_len, max_num_seqs=8, **tiers))


def workload(args, vocab: int):
    rng = np.random.default_rng(0)
    systems = [rng.integers(3, vocab, size=args.system_tokens).tolist() for _ in range(min(4, args.sessions))]
    users = [[rng.integers(3, vocab, size=args.user_tokens).tolist() for _ in range(args.turns)]
             for _ in range(args.sessions)]
    return systems, users


def run(path: Path, args, systems, users, pool_blocks: int, max_len: int, **tiers) -> dict:
    history = [[] for _ in range(args.sessions)]
    ttfts = []
    with make_engine(path, args, pool_blocks, max_len, **tiers) as eng:
        dtype = str(eng.executor.runner.dtype).replace("torch.", "")
        for t in range(args.turns):
            for s in range(args.sessions):
                prompt = systems[s % len(systems)] + history[s] + users[s][t]
                ttft, reply = one_request(eng, f"s{s}t{t}", prompt, args.reply_tokens)
                ttfts.append(ttft)
                history[s] += users[s][t] + reply
        eng.check_integrity()
        stats = eng.stats()
    return {"ttfts": ttfts, "computed": stats["prompt_tokens_computed"], "stats": stats, "dtype": dtype}


def pct(xs, q) -> float:
    return float(np.percentile(np.asarray(xs) * 1000, q))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="40m", choices=sorted(SHAPE_OVERRIDES))
    ap.add_argument("--sessions", type=int, default=16)
    ap.add_argument("--system-tokens", type=int, default=8000)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--user-tokens", type=int, default=200)
    ap.add_argument("--reply-tokens", type=int, default=32)
    ap.add_argument("--pool-sessions", type=float, default=2.0)
    ap.add_argument("--model-dir", default=None)
    args = ap.parse_args()
    if min(args.sessions, args.system_tokens, args.turns, args.user_tokens, args.reply_tokens) < 1:
        ap.error("--sessions, --system-tokens, --turns, --user-tokens and --reply-tokens must be >= 1")

    session_tokens = args.system_tokens + args.turns * (args.user_tokens + args.reply_tokens)
    max_len = session_tokens + BLOCK
    ctx = max(2048, -(-max_len // 1024) * 1024)
    path = build_bench_model(args.model_dir or f"/tmp/tpserve-bench/{SHAPE_DIRS[args.shape]}-ctx{ctx}",
                             max_position_embeddings=ctx, **SHAPE_OVERRIDES[args.shape])
    from transformers import AutoConfig
    cfg = AutoConfig.from_pretrained(path)
    vocab = cfg.vocab_size
    pool_blocks = int(args.pool_sessions * -(-session_tokens // BLOCK)) + 2
    # The host tier holds every session (KV bytes per token: 2 x layers x KV heads x head size x 4).
    kv_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 4
    host_gb = 1.25 * (args.sessions * session_tokens) * kv_token / (1 << 30)
    systems, users = workload(args, vocab)

    off = run(path, args, systems, users, pool_blocks, max_len)
    tmp = tempfile.mkdtemp(prefix="tpserve-bench-agent-")
    try:
        on = run(path, args, systems, users, pool_blocks, max_len, kv_offload_host_gb=host_gb,
                 kv_offload_dir=tmp)
        new_user = np.random.default_rng(1).integers(3, vocab, size=args.user_tokens).tolist()
        first = systems[0] + new_user
        with make_engine(path, args, pool_blocks, max_len) as eng:
            cold, _ = one_request(eng, "cold", first, args.reply_tokens)
        with make_engine(path, args, pool_blocks, max_len, kv_offload_dir=tmp) as eng:
            warm, _ = one_request(eng, "restart", first, args.reply_tokens)
            restart_stats = eng.stats()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    print(f"bench_agent shape={args.shape} isa={cpu_isa()} dtype={off['dtype']} sessions={args.sessions} "
          f"system_tokens={args.system_tokens} distinct_systems={len(systems)} turns={args.turns} "
          f"user_tokens={args.user_tokens} reply_tokens={args.reply_tokens} pool_blocks={pool_blocks} "
          f"block_size={BLOCK} host_tier_gb={host_gb:.2f}")
    for name, r in (("off", off), ("on", on)):
        s = r["stats"]
        extra = "" if name == "off" else (
            f" host_loads={s['kv_offload_host_loads']} disk_loads={s['kv_offload_disk_loads']}"
            f" tier_hit_tokens={s['kv_offload_hit_tokens']}"
            f" load_ms_avg={s['kv_offload_host_load_ms_avg']:.1f}")
        print(f"bench_agent tiers={name} requests={len(r['ttfts'])} ttft_p50_ms={pct(r['ttfts'], 50):.1f} "
              f"ttft_p99_ms={pct(r['ttfts'], 99):.1f} prefill_tokens_computed={r['computed']}{extra}")
    prefill_ratio = on["computed"] / max(off["computed"], 1)
    ttft_ratio = statistics.median(on["ttfts"]) / statistics.median(off["ttfts"])
    print(f"bench_agent ratio prefill_computed={prefill_ratio:.3f} (target <= 0.3) "
          f"ttft_p50={ttft_ratio:.3f} (target <= 0.4)")
    print(f"bench_agent restart first_turn_ttft_ms={warm * 1000:.1f} cold_start_ttft_ms={cold * 1000:.1f} "
          f"ratio={warm / cold:.3f} (target <= 0.25) disk_loads={restart_stats['kv_offload_disk_loads']} "
          f"disk_corrupt={restart_stats['kv_offload_disk_corrupt']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
