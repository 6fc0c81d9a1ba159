"""Decode speed where few users wait: tpserve bf16 and int8 against llama.cpp's llama-server.

For one benchmark shape (scripts/bench_models.py: random weights, token-id prompts, greedy,
ignore_eos) it measures generated tokens per second, wall clock from the requests' start to
their last token (the prompt's prefill included), for

  * one stream: a 64-token prompt, 256 tokens, median of 3 runs (different prompts);
  * batch 8 and batch 64 (40m) / batch 8 and 16 (0.6b): that many streams at once, 64-token
    prompts, 128 tokens each, one run;

with tpserve's offline engine in bf16 and with ``--quantization int8``, and, with
``--llamacpp DIR`` (scripts/peer_llamacpp.sh builds it), llama-server on the same model
converted by llama.cpp's own converter, in bf16 and quantized to Q8_0 by llama-quantize,
``--parallel`` slots for the batch, continuous batching, as many threads as tpserve; a server is
stopped (SIGSTOP) while the other engines run, since an idle one keeps polling. Engines
alternate run by run (tpserve bf16, tpserve int8, llama bf16, llama Q8_0, then again), so a
shared machine's drift spreads over all of them. It prints one line per engine and batch, the
ratios, the ISA and the dtypes, and the load average before and after (a loaded machine makes
all figures slower and noisier; compare ratios).

The converter needs a tokenizer: the model directory it reads gets the bundled model's
tokenizer padded with filler tokens to the model's vocabulary, and the converter is told that
its pre-tokenizer is GPT-2's (it is: byte-level, GPT-2 regex). Only token ids are sent, so the
tokenizer never touches the benchmark.

With ``--http`` it also measures tpserve's daemon (``tpserve start --http-port``) asked over HTTP
the way llama-server is (one non-streamed completion per stream): the server a user talks to,
not only the engine.

    python scripts/bench_latency.py [--shape 40m|0.6b|tiny] [--llamacpp .peers/llamacpp] [--runs 3]
                                    [--threads N] [--batches 8,64] [--http]

``--shape tiny`` (2 layers of width 64; batch 8) without ``--llamacpp`` is a smoke run of seconds
(tests/test_scripts.py), not a measurement.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_models import SHAPE_DIRS, SHAPE_OVERRIDES, build_bench_model  # noqa: E402
from bench_throughput import cpu_isa  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
BUNDLED = ROOT / "tpserve" / "assets" / "default-model"
BATCHES = {"40m": (8, 64), "0.6b": (8, 16), "tiny": (8,)}
PROMPT, SINGLE_OUT, BATCH_OUT = 64, 256, 128


def prompts_for(n: int, vocab: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, PROMPT).tolist() for _ in range(n)]


def context_tokens(slots: int) -> int:
    """llama-server's context (``-c``) for ``slots`` streams: every stream's prompt and output."""
    return slots * (PROMPT + SINGLE_OUT + 32)


# ---- tpserve -------------------------------------------------------------------------------

class Tpserve:
    def __init__(self, path: Path, quantization: str | None, max_seqs: int):
        from tpserve import LLM
        self.name = f"tpserve {'int8' if quantization else 'bf16'}"
        self.llm = LLM(str(path), dtype="bfloat16", quantization=quantization, max_num_seqs=max_seqs,
                       kv_cache_memory_gb=1.0, max_model_len=1024)
        self.run([[5] * PROMPT], 4)  # warm

    def run(self, prompts, out: int) -> float:
        from tpserve import SamplingParams
        params = SamplingParams(temperature=0, max_tokens=out, ignore_eos=True)
        t = time.perf_counter()
        res = self.llm.generate(prompts, params, use_tqdm=False)
        dt = time.perf_counter() - t
        return sum(len(r.outputs[0].token_ids) for r in res) / dt

    def close(self):
        self.llm.shutdown()


def concurrent_tok_s(one, prompts, out: int) -> float:
    """Generated tokens per second of ``one(prompt, out, counts, i)`` (it stores its token count
    in counts[i]) for every prompt at once, one client thread each."""
    counts = [0] * len(prompts)
    threads = [threading.Thread(target=one, args=(p, out, counts, i)) for i, p in enumerate(prompts)]
    t = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return sum(counts) / (time.perf_counter() - t)


class TpserveHttp:
    """The daemon (``tpserve start --http-port``), asked over HTTP as llama-server is: one
    non-streamed /v1/completions request per stream, from client threads. The speed one user of
    the server sees, the engine's plus the HTTP front's, the hop between them and the output path."""

    def __init__(self, path: Path, quantization: str | None, max_seqs: int):
        self.name = f"tpserve {'int8' if quantization else 'bf16'} http"
        self.rd = tempfile.mkdtemp(prefix="tpbl-", dir="/tmp")
        cmd = [sys.executable, "-m", "tpserve", "start", "--runtime-dir", self.rd, "--http-port", "0",
               "--served-model-name", "bench", "--model", str(path), "--dtype", "bfloat16",
               "--max-num-seqs", str(max_seqs), "--kv-cache-memory-gb", "1.0", "--max-model-len", "1024"]
        if quantization:
            cmd += ["--quantization", quantization]
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode != 0:
            shutil.rmtree(self.rd, ignore_errors=True)
            raise RuntimeError(f"tpserve start failed: {out.stderr.strip()[-2000:]}")
        self.url = out.stdout.split()[1]
        self.run([[5] * PROMPT], 4)  # warm

    def _one(self, prompt, out: int, counts: list, i: int) -> None:
        body = json.dumps({"model": "bench", "prompt": prompt, "max_tokens": out, "temperature": 0,
                           "ignore_eos": True, "stream": False}).encode()
        req = urllib.request.Request(f"{self.url}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=1800) as r:
            counts[i] = json.loads(r.read())["usage"]["completion_tokens"]

    def run(self, prompts, out: int) -> float:
        return concurrent_tok_s(self._one, prompts, out)

    def close(self):
        subprocess.run([sys.executable, "-m", "tpserve", "stop", "--runtime-dir", self.rd], capture_output=True)
        shutil.rmtree(self.rd, ignore_errors=True)


# ---- llama.cpp -----------------------------------------------------------------------------

CONVERT = r"""
import runpy, sys
src = sys.argv[1]
sys.path.insert(0, src)
import conversion.base as base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
sys.argv = [src + "/convert_hf_to_gguf.py"] + sys.argv[2:]
runpy.run_path(src + "/convert_hf_to_gguf.py", run_name="__main__")
"""


def padded_tokenizer(dst: Path, vocab: int) -> None:
    """The bundled tokenizer with filler tokens up to ``vocab`` entries, written into ``dst``."""
    tok = json.loads((BUNDLED / "tokenizer.json").read_text())
    model_vocab = tok["model"]["vocab"]
    n = len(model_vocab)
    for i in range(n, vocab):
        model_vocab[f"<|filler_{i}|>"] = i
    (dst / "tokenizer.json").write_text(json.dumps(tok))
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(BUNDLED / name, dst / name)


def gguf_models(peer: Path, path: Path, vocab: int) -> dict[str, Path]:
    """bf16 and Q8_0 GGUF files of the benchmark model (converted once, kept beside it)."""
    out = {"bf16": path.parent / f"{path.name}-bf16.gguf", "q8_0": path.parent / f"{path.name}-q8_0.gguf"}
    if not out["bf16"].exists():
        src = path.parent / f"{path.name}-gguf-src"
        shutil.rmtree(src, ignore_errors=True)
        src.mkdir()
        for name in ("config.json", "model.safetensors", "generation_config.json"):
            if (path / name).exists():
                os.symlink(path / name, src / name)
        padded_tokenizer(src, vocab)
        subprocess.run([str(peer / "venv" / "bin" / "python"), "-c", CONVERT, str(peer / "src"), str(src),
                        "--outfile", str(out["bf16"]), "--outtype", "bf16"],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    if not out["q8_0"].exists():
        subprocess.run([str(peer / "bin" / "llama-quantize"), str(out["bf16"]), str(out["q8_0"]), "Q8_0"],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaServer:
    """llama-server on ``gguf``. Its default CPU path repacks weights for the machine (AMX tiles
    where present); where that build crashes at start (seen: Q8_0 on an AMX CPU, a segfault
    right after the thread pool starts), it is started again with ``--no-repack``, and its
    line in the table says so (``note``)."""

    def __init__(self, peer: Path, gguf: Path, kind: str, slots: int, threads: int):
        self.name, self.note = f"llama-server {kind}", ""
        self.log = open(gguf.parent / f"llama-server-{kind}.log", "w")
        if not self._start(peer, gguf, slots, threads, []):
            self.log.write("\n--- the server exited at start; again with --no-repack ---\n")
            self.log.flush()
            if not self._start(peer, gguf, slots, threads, ["--no-repack"]):
                raise RuntimeError(f"llama-server did not start (see {self.log.name})")
            self.note = " (--no-repack)"
            print(f"{self.name}: the default (repacked weights) exited at start; see {self.log.name}",
                  flush=True)
        self.run([[5] * PROMPT], 4)  # warm; leaves the server stopped

    def _start(self, peer: Path, gguf: Path, slots: int, threads: int, extra: list[str]) -> bool:
        """Start the server; True once it answers /health, False if it exited first."""
        self.port = _free_port()
        ctx = context_tokens(slots)
        self.proc = subprocess.Popen(
            [str(peer / "bin" / "llama-server"), "-m", str(gguf), "--host", "127.0.0.1",
             "--port", str(self.port), "-t", str(threads), "-tb", str(threads), "-c", str(ctx),
             "-np", str(slots), "-b", "2048", "--no-webui", *extra],
            stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                    if r.status == 200:
                        return True
            except OSError:
                pass
            if self.proc.poll() is not None:
                return False
            if time.monotonic() > deadline:
                self.proc.kill()
                self.proc.wait()
                raise RuntimeError(f"llama-server did not answer within 300 s (see {self.log.name})")
            time.sleep(0.5)

    # Between its runs a server is stopped (SIGSTOP): an idle llama-server's threads keep
    # polling for work, and while two of them polled, every other engine ran 2-4x slower.
    def pause(self):
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self):
        self.proc.send_signal(signal.SIGCONT)

    def _one(self, prompt, out: int, counts: list, i: int) -> None:
        body = json.dumps({"prompt": prompt, "n_predict": out, "temperature": 0, "ignore_eos": True,
                           "cache_prompt": False, "stream": False}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/completion", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=1800) as r:
            counts[i] = json.loads(r.read())["tokens_predicted"]

    def run(self, prompts, out: int) -> float:
        self.resume()
        try:
            return concurrent_tok_s(self._one, prompts, out)
        finally:
            self.pause()

    def close(self):
        self.resume()
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


# ---- the benchmark -------------------------------------------------------------------------

def measure(engines, vocab: int, batches, runs: int) -> dict:
    """{(engine, batch): tok/s}: the single stream's median of ``runs``, one run per batch."""
    res = {}
    for r in range(runs):  # engines alternate run by run
        for e in engines:
            res.setdefault((e.name, 1), []).append(e.run(prompts_for(1, vocab, seed=r), SINGLE_OUT))
    for b in batches:
        for e in engines:
            res[(e.name, b)] = [e.run(prompts_for(b, vocab, seed=100 + b), BATCH_OUT)]
    return {k: statistics.median(v) for k, v in res.items()}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=sorted(BATCHES), default="40m")
    ap.add_argument("--llamacpp", metavar="DIR", help="llama.cpp peer (scripts/peer_llamacpp.sh)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--batches", default=None,
                    help="comma-separated batch sizes besides the single stream (default: 8,64 for "
                         "40m, 8,16 for 0.6b; empty: the single stream only)")
    ap.add_argument("--skip-tpserve", action="store_true")
    ap.add_argument("--http", action="store_true",
                    help="also tpserve's daemon over HTTP (tpserve start --http-port), asked as llama-server is")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = build_bench_model(f"/tmp/tpserve-bench/{SHAPE_DIRS[args.shape]}", **SHAPE_OVERRIDES[args.shape])
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    batches = BATCHES[args.shape] if args.batches is None else tuple(
        int(b) for b in args.batches.split(",") if b.strip())
    load0 = os.getloadavg()[0]
    engines = []
    try:
        if not args.skip_tpserve:
            engines += [Tpserve(path, None, max(batches, default=1)), Tpserve(path, "int8", max(batches, default=1))]
        if args.http:
            engines += [TpserveHttp(path, None, max(batches, default=1)),
                        TpserveHttp(path, "int8", max(batches, default=1))]
        if args.llamacpp:
            peer = Path(args.llamacpp)
            files = gguf_models(peer, path, vocab)
            engines += [LlamaServer(peer, files[k], k, max(batches, default=1), args.threads)
                        for k in ("bf16", "q8_0")]
        res = measure(engines, vocab, batches, args.runs)
    finally:
        for e in engines:
            e.close()
    isa = cpu_isa()
    print(f"latency shape={args.shape} isa={isa} threads={args.threads} prompt={PROMPT} "
          f"single-stream out={SINGLE_OUT} (median of {args.runs}) batched out={BATCH_OUT} "
          f"load-average {load0:.1f} -> {os.getloadavg()[0]:.1f}")
    dtypes = {"tpserve bf16": "bf16", "tpserve int8": "int8 w/ int8 act", "llama-server bf16": "bf16",
              "llama-server q8_0": "Q8_0", "tpserve bf16 http": "bf16", "tpserve int8 http": "int8 w/ int8 act"}
    for e in engines:
        cells = "  ".join(f"batch {b:>2} {res[(e.name, b)]:8.1f}" for b in (1, *batches))
        print(f"{e.name:20s} dtype={dtypes[e.name]:16s} tok/s: {cells}{getattr(e, 'note', '')}")
    names = [e.name for e in engines]
    for a, b in (("tpserve bf16", "llama-server bf16"), ("tpserve int8", "llama-server q8_0"),
                 ("tpserve int8", "tpserve bf16"), ("tpserve bf16 http", "llama-server bf16"),
                 ("tpserve int8 http", "llama-server q8_0")):
        if a in names and b in names:
            ratios = "  ".join(f"batch {n:>2} {res[(a, n)] / res[(b, n)]:5.2f}x" for n in (1, *batches))
            print(f"ratio {a} / {b}: {ratios}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
