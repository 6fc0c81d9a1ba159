"""How much ``--quantization int8`` changes a model's outputs, measured against bf16.

For the bundled model (prompts from its held-out stdlib files) and the random-weight 40M
benchmark model (random token prompts), 20 prompts of 32 tokens, 64 greedy tokens each:

  * free-running agreement: the fraction of the 64 positions where int8's greedy token equals
    bf16's (each model generating from its own previous tokens, so one early difference
    changes the rest of the completion);
  * same-prefix agreement: both models read bf16's completion; the fraction of positions where
    their next-token argmax agrees;
  * mean KL(bf16 || int8) of the next-token distributions over those positions (nats);
  * the same three figures for fp32 against bf16: how far bf16's own rounding moves the
    outputs, the scale to read int8's figures on (random weights give next-token
    distributions so flat that any rounding flips many greedy choices).

For the bundled model also the held-out loss (nats/token) in bf16 and int8, on the held-out
text and windows ``scripts/train_default_model.py`` evaluates (its training report has the
figure of the fp32 reference with bf16-rounded weights). Targets: agreement >= 90%, loss
within 1% of bf16.

    python scripts/quality_int8.py [--skip-40m] [--llamacpp .peers/llamacpp] [--smoke]

``--smoke``: 2 prompts x 8 tokens, the held-out loss over 2 windows, and the benchmark models'
tiny shape (2 layers of width 64) in place of the 40M model: every step in seconds
(tests/test_scripts.py), not a measurement.

It also simulates int8 formats in fp32 against fp32 on the same positions: per-channel weights
with activations unquantized, per row (tpserve's int8) and in blocks of 32, per-channel weights
rounded by GPTQ (calibrated on other sequences than the measured ones), and a Q8_0-like blocked
format. That is the agreement each format allows before any kernel is involved; the GPTQ line is
the best-known rounding of per-channel int8 weights, with no activation error at all.

With ``--llamacpp`` it also measures llama.cpp's Q8_0 against llama.cpp's bf16 on the 40M model
(the same prompts and agreements): how far the field's int8 format moves this model.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_models import SHAPE_DIRS, SHAPE_OVERRIDES, build_bench_model  # noqa: E402
from bench_throughput import cpu_isa  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
BUNDLED = ROOT / "tpserve" / "assets" / "default-model"
PROMPTS, PROMPT_LEN, OUT = 20, 32, 64
CALIBRATION_LEN = 128
SMOKE_PROMPTS, SMOKE_OUT, SMOKE_WINDOWS = 2, 8, 2  # --smoke: prompts, tokens each, held-out windows


def load(path: Path, quantization: str | None, dtype: str = "bfloat16"):
    from tpserve.kernels.backend_factory import get_backend
    from tpserve.models.loader import load_model
    from tpserve.models.packed_gemm import prepack_model
    model = load_model(path, dtype=dtype, quantization=quantization,
                       backend=get_backend("auto", "cpu", 16))
    prepack_model(model)
    return model


@torch.inference_mode()
def logits_of(model, seqs: list[list[int]]) -> torch.Tensor:
    """fp32 logits [sum of lengths, vocab] of whole sequences in one cache-less forward."""
    from tpserve.kernels.metadata import AttentionMetadata
    lens = [len(s) for s in seqs]
    cu = np.concatenate([[0], np.cumsum(lens)])
    meta = AttentionMetadata.from_arrays(
        is_prefill=True, has_context=False, cu_seqlens_q=cu, cu_seqlens_k=cu, context_lens=lens,
        block_tables=np.zeros((len(seqs), 0), np.int32), slot_mapping=np.full(int(cu[-1]), -1))
    ids = torch.tensor([t for s in seqs for t in s])
    pos = torch.tensor([p for n in lens for p in range(n)])
    return model.compute_logits(model.forward(ids, pos, meta)).float()


def generate(path: Path, quantization: str | None, prompts, out: int,
             dtype: str = "bfloat16") -> list[list[int]]:
    from tpserve import LLM, SamplingParams
    # A KV pool that holds every sequence at once, and no more: allocating one costs seconds.
    blocks = len(prompts) * -(-(PROMPT_LEN + out) // 16) + 16
    llm = LLM(str(path), dtype=dtype, quantization=quantization, block_size=16, num_kv_blocks=blocks)
    try:
        res = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=out, ignore_eos=True),
                           use_tqdm=False)
        return [r.outputs[0].token_ids for r in res]
    finally:
        llm.shutdown()


def generated_rows(seqs, out: int) -> torch.Tensor:
    """Rows of the concatenated sequences' logits that predict one of the ``out`` generated
    tokens: the last prompt token onwards, less the end."""
    return torch.tensor([start + PROMPT_LEN - 1 + i for start in np.cumsum([0] + [len(s) for s in seqs[:-1]])
                         for i in range(out)])


def agreement(path: Path, prompts, ref_out, ref_logits, other: dict) -> tuple[float, float, float]:
    """(free-running, same-prefix agreement, mean KL(ref || other)) of the engine ``other``
    (LLM/load keyword arguments) against the reference outputs and logits."""
    out = generate(path, prompts=prompts, out=len(ref_out[0]), **other)
    free = float(np.mean([np.mean(np.array(a) == np.array(b)) for a, b in zip(ref_out, out)]))
    seqs = [p + o for p, o in zip(prompts, ref_out)]
    rows = generated_rows(seqs, len(ref_out[0]))
    lp_ref = ref_logits[rows].log_softmax(-1)
    lp = logits_of(load(path, **other), seqs)[rows].log_softmax(-1)
    same = float((lp_ref.argmax(-1) == lp.argmax(-1)).float().mean())
    kl = float((lp_ref.exp() * (lp_ref - lp)).sum(-1).mean())
    return free, same, kl


def _fake_int8(x: torch.Tensor, group: int | None) -> torch.Tensor:
    """x rounded to symmetric int8 with one absmax scale per row (group None) or per block of
    ``group`` along the last dimension, and scaled back (fp32)."""
    g = x.reshape(*x.shape[:-1], -1, group) if group else x
    s = g.abs().amax(-1, keepdim=True).clamp(min=1e-30) / 127
    return ((g / s).round().clamp(-127, 127) * s).reshape(x.shape)


def _gptq_int8(w: torch.Tensor, hessian: torch.Tensor, damp: float = 0.01) -> torch.Tensor:
    """w rounded to symmetric int8 with one absmax scale per row (output channel), column by
    column, each column's rounding error spread over the columns not yet rounded as the input
    second moments ``hessian`` (E[x x^T]) say (GPTQ's update): the best-known rounding of a
    per-channel int8 weight for inputs like the calibration ones. fp32 result."""
    w = w.double().clone()
    k = w.shape[1]
    scale = w.abs().amax(1, keepdim=True).clamp(min=1e-30) / 127
    h = hessian.double() + damp * hessian.diagonal().mean() * torch.eye(k, dtype=torch.float64)
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    out = torch.empty_like(w)
    for i in range(k):
        q = (w[:, i:i + 1] / scale).round().clamp(-127, 127) * scale
        out[:, i:i + 1] = q
        w[:, i + 1:] -= ((w[:, i:i + 1] - q) / hinv[i, i]) @ hinv[i:i + 1, i + 1:]
    return out.float()


@torch.inference_mode()
def format_ceilings(name: str, path: Path, seqs, rows: torch.Tensor, calibration) -> None:
    """Same-prefix agreement of int8 schemes simulated in fp32 (Hugging Face's model, every
    linear layer's weight rounded, and its input too where the scheme quantizes activations)
    against the fp32 model: how close each format can come, apart from any kernel. The GPTQ
    line rounds the weights with the second moments of each layer's inputs on ``calibration``
    (other sequences than the measured ones)."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    dense = [m.weight.data for m in linears]

    moments = [torch.zeros(m.in_features, m.in_features, dtype=torch.float64) for m in linears]
    counts = [0] * len(linears)

    def collect(i):
        def hook(_m, a):
            x = a[0].reshape(-1, a[0].shape[-1]).double()
            moments[i].add_(x.T @ x)
            counts[i] += x.shape[0]
        return hook
    hooks = [m.register_forward_pre_hook(collect(i)) for i, m in enumerate(linears)]
    for s in calibration:
        model(torch.tensor([s]))
    for h in hooks:
        h.remove()
    gptq = [_gptq_int8(w, h / n) for w, h, n in zip(dense, moments, counts)]

    def argmax_rows(weights, act_group, quantize_acts: bool) -> torch.Tensor:
        hooks = []
        for m, w in zip(linears, weights):
            m.weight.data = w
            if quantize_acts:
                hooks.append(m.register_forward_pre_hook(lambda _m, a: (_fake_int8(a[0], act_group),)))
        try:
            return torch.cat([model(torch.tensor([s])).logits[0] for s in seqs])[rows].argmax(-1)
        finally:
            for h in hooks:
                h.remove()
    ref = argmax_rows(dense, None, False)
    per_channel = [_fake_int8(w, None) for w in dense]
    for label, weights, ag, acts in (
            ("int8 weights per channel, activations unquantized", per_channel, None, False),
            (f"int8 weights per channel by GPTQ ({len(calibration)} calibration sequences), activations "
             "unquantized", gptq, None, False),
            ("int8 weights per channel, int8 activations per row (tpserve's int8)", per_channel, None, True),
            ("int8 weights per channel, int8 activations in blocks of 32", per_channel, 32, True),
            ("Q8_0-like: int8 weights and activations in blocks of 32", [_fake_int8(w, 32) for w in dense],
             32, True)):
        same = float((argmax_rows(weights, ag, acts) == ref).float().mean())
        print(f"quality {name}, simulated in fp32 against fp32: {label}: same-prefix {same:.1%}", flush=True)


def compare(name: str, path: Path, prompts, calibration, out: int, llamacpp: Path | None = None) -> None:
    bf16_out = generate(path, None, prompts, out)
    seqs = [p + o for p, o in zip(prompts, bf16_out)]
    ref = logits_of(load(path, None), seqs)
    for label, other in (("int8", dict(quantization="int8")), ("fp32", dict(quantization=None, dtype="float32"))):
        free, same, kl = agreement(path, prompts, bf16_out, ref, other)
        print(f"quality {name}, {label} against bf16: greedy agreement free-running {free:.1%}, "
              f"same-prefix {same:.1%}; mean KL(bf16||{label}) {kl:.4f} nats "
              f"({len(prompts)} prompts x {out} tokens)", flush=True)
    format_ceilings(name, path, seqs, generated_rows(seqs, out), calibration)
    if llamacpp is not None:
        llamacpp_agreement(llamacpp, name, path, prompts, bf16_out)


def llamacpp_agreement(peer: Path, name: str, path: Path, prompts, ref_out) -> None:
    """llama.cpp's Q8_0 against its own bf16 on the same model and prompts, the same two
    agreements (same-prefix: both read tpserve bf16's completions, one greedy token per position
    asked of llama-server with the prefix cached): the figure int8's is to be read beside."""
    import bench_latency as bl
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    files = bl.gguf_models(peer, path, vocab)
    got = {}
    for kind in ("bf16", "q8_0"):
        server = bl.LlamaServer(peer, files[kind], kind, slots=1, threads=2)
        server.resume()
        try:
            def ask(prompt, n):
                body = json.dumps({"prompt": prompt, "n_predict": n, "temperature": 0, "ignore_eos": True,
                                   "cache_prompt": True, "stream": False, "return_tokens": True}).encode()
                req = bl.urllib.request.Request(f"http://127.0.0.1:{server.port}/completion", data=body,
                                                headers={"Content-Type": "application/json"})
                with bl.urllib.request.urlopen(req, timeout=600) as r:
                    return json.loads(r.read())["tokens"]
            free = [ask(p, len(o)) for p, o in zip(prompts, ref_out)]
            same = [[ask(p + o[:i], 1)[0] for i in range(len(o))] for p, o in zip(prompts, ref_out)]
            got[kind] = free, same
        finally:
            server.close()
    (free_b, same_b), (free_q, same_q) = got["bf16"], got["q8_0"]
    free = float(np.mean([np.mean(np.array(a) == np.array(b)) for a, b in zip(free_b, free_q)]))
    same = float(np.mean(np.array(same_b) == np.array(same_q)))
    ref = float(np.mean(np.array(same_b) == np.array(ref_out)))
    print(f"quality {name}, llama.cpp Q8_0 against llama.cpp bf16: greedy agreement free-running {free:.1%}, "
          f"same-prefix {same:.1%} (llama.cpp bf16 against tpserve bf16, same-prefix: {ref:.1%})", flush=True)


def heldout(path: Path) -> tuple[torch.Tensor, int]:
    """The held-out token stream and window of scripts/train_default_model.py."""
    import train_default_model as t
    from tokenizers import Tokenizer
    s = t.Sizes()
    texts = t.read_texts(t.stdlib_files(int(s.max_corpus_mb * 1e6), s.max_file_kb * 1000))
    _, held = t.split_heldout(texts)
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    ids = t.encode_stream(tok, held, tok.token_to_id(t.EOS))
    n = min(len(ids) - 1, s.eval_tokens) // s.context * s.context
    return ids[:n + 1], s.context


def heldout_loss(model, ids: torch.Tensor, context: int) -> float:
    n = len(ids) - 1
    windows = ids[:n].view(-1, context)
    targets = ids[1:n + 1].view(-1, context)
    total = 0.0
    for i in range(0, windows.shape[0], 16):
        logits = logits_of(model, windows[i:i + 16].tolist())
        total += torch.nn.functional.cross_entropy(logits, targets[i:i + 16].reshape(-1), reduction="sum").item()
    return total / n


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--skip-40m", action="store_true")
    ap.add_argument("--llamacpp", type=Path, default=None,
                    help="llama.cpp's build (scripts/peer_llamacpp.sh): also measure its Q8_0 against its bf16")
    ap.add_argument("--smoke", action="store_true",
                    help="2 prompts x 8 tokens, 2 held-out windows, the tiny shape for the 40M model")
    args = ap.parse_args()
    n_prompts, out = (SMOKE_PROMPTS, SMOKE_OUT) if args.smoke else (PROMPTS, OUT)
    shape = "tiny" if args.smoke else "40m"
    torch.set_num_threads(2)
    print(f"isa {cpu_isa()}; int8 = --quantization int8 (per-channel int8 weights, int8 activations per row) "
          f"against bf16", flush=True)
    ids, context = heldout(BUNDLED)
    starts = np.linspace(0, len(ids) - PROMPT_LEN - 1, n_prompts).astype(int)
    bundled = [ids[s:s + PROMPT_LEN].tolist() for s in starts]
    # calibration windows (for the GPTQ ceiling): two in each gap between prompts, apart from them
    gap = starts[1] - starts[0]
    calibration = [ids[s + f * gap // 3:s + f * gap // 3 + CALIBRATION_LEN].tolist()
                   for s in starts[:-1] for f in (1, 2)]
    compare("bundled model", BUNDLED, bundled, calibration, out)
    report = json.loads((BUNDLED / "training_report.json").read_text())
    held = ids[:SMOKE_WINDOWS * context + 1] if args.smoke else ids
    loss_bf16 = heldout_loss(load(BUNDLED, None), held, context)
    loss_int8 = heldout_loss(load(BUNDLED, "int8"), held, context)
    print(f"quality bundled model held-out loss ({len(held) - 1} tokens): bf16 {loss_bf16:.4f}, int8 "
          f"{loss_int8:.4f} ({loss_int8 / loss_bf16 - 1:+.2%}); training report {report['heldout_loss']:.4f}")
    if not args.skip_40m:
        path = build_bench_model(f"/tmp/tpserve-bench/{SHAPE_DIRS[shape]}", **SHAPE_OVERRIDES[shape])
        rng = np.random.default_rng(0)
        prompts = [rng.integers(3, 32768, PROMPT_LEN).tolist() for _ in range(n_prompts)]
        calibration = [rng.integers(3, 32768, CALIBRATION_LEN).tolist() for _ in range(2 * (n_prompts - 1))]
        compare(f"{shape} random-weight model", path, prompts, calibration, out, args.llamacpp)
    return 0

if __name__ == "__main__":
    sys.exit(main())
