"""Decode at one stream with 4-bit group weights against tpserve's int8: speed and memory.

For one benchmark shape (scripts/bench_models.py: random weights, token ids, greedy,
ignore_eos; default the Qwen3-0.6B shape) each engine runs in a process of its own (so that
its resident memory is its own), and the engines take turns: run r of every engine, then run
r + 1 of every engine. A change in the machine's memory bandwidth during the benchmark (on a
shared VM one engine's runs measured 30% apart a minute apart) then lands on every engine
alike. The engines: tpserve's offline engine in bf16 activations with
``--quantization int8`` (int8 weights per channel, int8 activations) and ``int4`` / ``int4-g32``
(4-bit codes with a scale and a min per group of 128 / 32, int8 activations per group: W4A8,
``tpserve/kernels/csrc/quant_ops.cpp``). Each measures one stream: a 64-token prompt then
``--tokens`` tokens, the median of ``--runs`` runs (prefill included, as bench_latency.py), and
the prefill alone of a 256-token prompt (``prefill_ms``, median). It prints one line per engine
with its tokens per second, the bytes of its packed linear weights (``linear MB``), the whole
model's parameter and packed bytes (``model MB``: the token embedding's 8-bit codes with
``int4``), what loading the engine added to the process's resident memory less its KV pool (``load
MB``: the weights as they run), its resident memory after the runs
(``rss MB``), then the ratios to int8, the ISA and the integer path of each build, and the load
average (a loaded machine makes every figure slower and noisier: compare the ratios).

    python scripts/bench_int4.py [--shape 0.6b|40m|tiny] [--tokens 128] [--runs 3] [--threads N]
                                 [--engines int8,int4,int4-g32]

``--shape tiny`` (2 layers of width 64: int4-g32 only) is a smoke run of seconds
(tests/test_scripts.py), not a measurement.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_models import SHAPE_DIRS, SHAPE_OVERRIDES, build_bench_model  # noqa: E402
from bench_moe import resident_pool_bytes  # noqa: E402
from bench_throughput import cpu_isa  # noqa: E402

PROMPT, PREFILL = 64, 256
DEFAULT_ENGINES = {"tiny": "int8,int4-g32"}


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _pack_bytes(p) -> int:
    return sum(t.nbytes for t in (p.data, p.scales, p.colsum) if t is not None)


def model_bytes(model) -> tuple[int, int]:
    """(bytes of the packed linear weights, bytes of every parameter and packed weight: the
    token embedding's codes included when ``--quantization int4`` holds it so)."""
    seen, linear, params = set(), 0, 0
    for m in model.modules():
        p = getattr(m, "packed", None)
        if p is not None and id(p) not in seen:
            seen.add(id(p))
            linear += _pack_bytes(p)
    for t in model.parameters():
        params += t.nbytes
    table = model.model.embed_tokens.__dict__.get("rows_of")  # a table of codes, not the lm_head
    codes = _pack_bytes(table.packed) if table is not None and table.packed is not None \
        and id(table.packed) not in seen else 0
    return linear, linear + params + codes


def child(args) -> None:
    """One engine, driven over stdin / stdout one JSON line at a time: after loading it prints
    its load figures, then answers each command (``decode``: seconds of one decode run;
    ``prefill``: ms of one prefill; ``done``: its final figures, then it exits)."""
    import numpy as np
    import torch

    from tpserve import LLM, SamplingParams
    torch.set_num_threads(args.threads)
    before = rss_mb()
    llm = LLM(args.path, dtype="bfloat16", quantization=args.engine, max_num_seqs=1,
              kv_cache_memory_gb=0.25, max_model_len=1024)
    load_mb = rss_mb() - before - resident_pool_bytes(llm) / 2**20
    vocab = json.loads((Path(args.path) / "config.json").read_text())["vocab_size"]
    rng = np.random.default_rng(0)

    def run(n_prompt: int, n_out: int) -> float:
        ids = rng.integers(3, vocab, n_prompt).tolist()
        params = SamplingParams(temperature=0, max_tokens=n_out, ignore_eos=True)
        t = time.perf_counter()
        llm.generate([ids], params, use_tqdm=False)
        return time.perf_counter() - t

    def reply(**fields) -> None:
        print(json.dumps(fields), flush=True)

    run(PROMPT, 4)  # warm
    reply(load_mb=load_mb)
    for line in sys.stdin:
        command = line.strip()
        # Each timed run follows an untimed one of its kind: after waiting for its turn a
        # process's first run paid for memory the VM's host had taken back meanwhile (prefill
        # 0.4 -> 0.8 s with three engines taking turns), which a serving engine does not.
        if command == "decode":
            run(PROMPT, 4)
            reply(tok_s=args.tokens / run(PROMPT, args.tokens))
        elif command == "prefill":
            run(PREFILL, 1)
            reply(prefill_ms=run(PREFILL, 1) * 1e3)
        elif command == "done":
            break
        else:
            raise SystemExit(f"bench_int4 child: unknown command {command!r}")
    model = llm.engine.executor.runner.model
    linear, total = model_bytes(model)
    ops = torch.ops.tpserve_cpu
    path = ops.group_linear_path() if hasattr(ops, "group_linear_path") else -1
    reply(linear_mb=linear / 2**20, model_mb=total / 2**20, rss_mb=rss_mb(), path=path)
    llm.shutdown()


class Child:
    """The parent's end of one engine's process (child)."""

    def __init__(self, engine: str, path: Path, args) -> None:
        cmd = [sys.executable, __file__, "--engine", engine, "--path", str(path),
               "--tokens", str(args.tokens), "--threads", str(args.threads)]
        self.engine = engine
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.figures = self._read()  # load_mb, once it has loaded

    def _read(self) -> dict:
        """The child's next reply (lines that are not one, printed by a library, are skipped)."""
        while True:
            line = self.proc.stdout.readline()
            if not line:
                code = self.proc.wait()
                raise SystemExit(f"bench_int4: the {self.engine} engine's process ended (exit {code})")
            if line.startswith("{"):
                return json.loads(line)

    def ask(self, command: str) -> dict:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def measure(engines: list[str], path: Path, args) -> dict[str, dict]:
    """Every engine's figures, their runs taken in turns (module docstring)."""
    children: list[Child] = []
    try:
        for engine in engines:  # one at a time, so that each load is timed and measured alone
            children.append(Child(engine, path, args))
        decode = {c.engine: [] for c in children}
        prefill = {c.engine: [] for c in children}
        for _ in range(args.runs):
            for c in children:
                decode[c.engine].append(c.ask("decode")["tok_s"])
        for _ in range(args.runs):
            for c in children:
                prefill[c.engine].append(c.ask("prefill")["prefill_ms"])
        res = {}
        for c in children:
            res[c.engine] = dict(c.figures, **c.ask("done"), tok_s=statistics.median(decode[c.engine]),
                                 prefill_ms=statistics.median(prefill[c.engine]))
            c.proc.wait()
        return res
    finally:
        for c in children:
            c.close()


PATHS = {0: "scalar", 1: "avx2-maddubs", 2: "avx512-vnni", -1: "n/a"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPE_OVERRIDES), default="0.6b")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--engines", default=None, help="comma-separated --quantization values")
    ap.add_argument("--engine", help=argparse.SUPPRESS)  # the child's engine
    ap.add_argument("--path", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.engine:
        child(args)
        return 0
    path = build_bench_model(Path("/tmp/tpserve-bench") / SHAPE_DIRS[args.shape],
                             **SHAPE_OVERRIDES[args.shape])
    engines = (args.engines or DEFAULT_ENGINES.get(args.shape, "int8,int4,int4-g32")).split(",")
    load = os.getloadavg()[0]
    res = measure(engines, path, args)
    paths = sorted({PATHS[r["path"]] for r in res.values()})
    print(f"int4 shape={args.shape} isa={cpu_isa()} path={','.join(paths)} threads={args.threads} "
          f"prompt={PROMPT} tokens={args.tokens} runs={args.runs} activations=bf16")
    for name, r in res.items():
        dtype = "int8 w/ int8 act" if name == "int8" else f"{name} w/ int8 act per group"
        print(f"tpserve {name:<9} dtype={dtype:<32} tok/s {r['tok_s']:8.2f}  "
              f"prefill_ms {r['prefill_ms']:8.1f}  linear MB {r['linear_mb']:8.1f}  "
              f"model MB {r['model_mb']:8.1f}  load MB {r['load_mb']:8.1f}  rss MB {r['rss_mb']:8.1f}")
    base = res.get("int8")
    if base is not None:
        for name, r in res.items():
            if name != "int8":
                print(f"ratio {name} / int8: tok/s {r['tok_s'] / base['tok_s']:.2f}x  "
                      f"prefill {base['prefill_ms'] / r['prefill_ms']:.2f}x  "
                      f"linear bytes {r['linear_mb'] / base['linear_mb']:.2f}  "
                      f"model bytes {r['model_mb'] / base['model_mb']:.2f}  "
                      f"load rss {r['load_mb'] / base['load_mb']:.2f}  "
                      f"rss {r['rss_mb'] / base['rss_mb']:.2f}")
    print(f"load average {load:.2f} -> {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
