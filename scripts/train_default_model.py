"""Train tpserve's bundled default model: a small Qwen3 causal LM over Python source.

The model lets tpserve run end to end on a machine with no model hub. It is trained on CPU,
reproducibly, from the Python standard library installed on the machine:

- corpus: the sorted ``*.py`` files under ``sysconfig.get_paths()["stdlib"]``, without test
  directories, site-packages, generated tables (encodings/, pydoc_data/) and files larger than
  ``Sizes.max_file_kb``; the total is capped at ``Sizes.max_corpus_mb``. Every ``HELDOUT_EVERY``-th file
  is held out (split by file, so held-out loss measures generalisation to unseen modules).
- tokenizer: byte-level BPE (``tokenizers``), one special token ``<|endoftext|>`` that is bos,
  eos and pad. Documents are joined with it during training. Byte-level pre-tokenizing and
  decoding with ``add_prefix_space=False`` make decode(encode(text)) == text for any text,
  indentation included.
- model: ``Qwen3ForCausalLM`` of about a million parameters (see ``Sizes``), plain PyTorch
  AdamW, linear warmup then cosine decay, gradient clipping, random fixed-length windows of the
  token stream.

Output (``--out``, default ``tpserve/assets/default-model``): config.json, model.safetensors
(bfloat16), generation_config.json, tokenizer.json, tokenizer_config.json,
special_tokens_map.json and training_report.json.

Reproducibility: seeds for python/numpy/torch, a sorted file list, deterministic torch
algorithms and a fixed thread count. The number of optimizer steps is fixed by ``--steps``;
``--minutes`` is only a safety cap on training wall time (hitting it is recorded in the report
as ``stopped_early`` and makes the run machine-dependent).

Usage::

    python scripts/train_default_model.py                 # the real run
    python scripts/train_default_model.py --quick --out /tmp/m   # seconds-long smoke run
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import sysconfig
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

# On a shared machine, OpenMP threads that spin while waiting for a descheduled peer burn the
# CPU the other thread needs; passive waiting doubled training throughput under load. It must be
# set before torch loads its OpenMP runtime.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402
import torch  # noqa: E402

EOS = "<|endoftext|>"
HELDOUT_EVERY = 20
# Test suites are not representative code, site-packages is not the stdlib, and encodings/ and
# pydoc_data/ are generated tables and prose that would eat model capacity.
EXCLUDED_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "encodings", "pydoc_data"})
PROMPTS = ("def fibonacci(n):", "import os\n", "class Stack:")
REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "tpserve" / "assets" / "default-model"


@dataclass
class Sizes:
    """Everything that decides the size and length of a run.

    The defaults were chosen by equal-CPU-time trials on 2 shared cores: at this budget
    (~1-2M training tokens) the number of optimizer steps limits quality more than width, so a
    128-wide model with small batches beat a 256-wide one (held-out 5.64 vs 6.40 nats/token
    after 100-120 CPU-seconds). 4 query / 2 KV heads keep tensor parallelism of 2 possible.
    """

    vocab_size: int = 4096
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    intermediate_size: int = 384
    max_position_embeddings: int = 1024
    context: int = 256
    batch_size: int = 4
    steps: int = 2200
    warmup_steps: int = 50
    lr: float = 6e-3
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    max_corpus_mb: float = 12.0
    max_file_kb: int = 200
    eval_tokens: int = 200_000
    sample_tokens: int = 48


QUICK = Sizes(vocab_size=384, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
              head_dim=16, intermediate_size=64, max_position_embeddings=128, context=32,
              batch_size=4, steps=8, warmup_steps=2, max_corpus_mb=0.1, max_file_kb=8, eval_tokens=2_000,
              sample_tokens=8)


# ---- corpus ------------------------------------------------------------------------------
def stdlib_files(max_bytes: int, max_file_bytes: int) -> list[Path]:
    """Sorted stdlib sources to train on, at most ``max_bytes`` in total.

    When the cap bites, files are taken at an even stride over the sorted list so the corpus
    still spans the whole library rather than its alphabetical beginning.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if EXCLUDED_DIRS.intersection(rel.parts[:-1]) or not path.is_file():
            continue
        if path.stat().st_size > max_file_bytes:
            continue
        files.append(path)
    sizes = [p.stat().st_size for p in files]
    if sum(sizes) <= max_bytes:
        return files
    stride = sum(sizes) / max_bytes
    chosen, total = [], 0
    for i in range(len(files)):
        j = int(i * stride)
        if j >= len(files) or total + sizes[j] > max_bytes:
            break
        chosen.append(files[j])
        total += sizes[j]
    return chosen


def read_texts(files: list[Path]) -> list[str]:
    texts = []
    for path in files:
        try:
            texts.append(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            continue  # a handful of stdlib files use other encodings; they are not needed
    return texts


def split_heldout(texts: list[str]) -> tuple[list[str], list[str]]:
    """Every HELDOUT_EVERY-th file is held out; at least one file is, whatever the count."""
    if len(texts) < 2:
        raise SystemExit(f"need at least 2 corpus files to hold one out, found {len(texts)}")
    held_idx = {i for i in range(len(texts)) if i % HELDOUT_EVERY == HELDOUT_EVERY - 1} or {len(texts) - 1}
    train = [t for i, t in enumerate(texts) if i not in held_idx]
    held = [t for i, t in enumerate(texts) if i in held_idx]
    return train, held


# ---- tokenizer ---------------------------------------------------------------------------
def train_tokenizer(texts: list[str], vocab_size: int):
    """Byte-level BPE whose decode inverts encode exactly (no prefix space, no normalizer)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


# A plain-text chat format the code model can continue: "# role:" headers, one per message; with
# tools, the Hermes/Qwen convention: the signatures in <tools>, calls as <tool_call> JSON blocks,
# results as <tool_response> (tpserve/fronts/http/tool_calls.py).
CHAT_TEMPLATE = (
    '{%- if tools %}{{ \'# system:\\n\' }}{% if messages[0][\'role\'] == \'system\' %}{{ messages[0][\'content\'] }}{{ \'\\n\\n\' }}{% endif %}{{ \'You may call one or more functions. Their signatures are within <tools></tools>:\\n<tools>\' }}{% for tool in tools %}{{ \'\\n\' }}{{ tool | tojson }}{% endfor %}{{ \'\\n</tools>\\nFor each call, answer with a JSON object of the function name and arguments within <tool_call></tool_call> tags:\\n<tool_call>\\n{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call>\\n\' }}'
    '{%- endif %}'
    '{%- for message in messages %}'
    "{%- if tools and loop.first and message['role'] == 'system' %}"
    '{%- elif message[\'role\'] == \'assistant\' and message[\'tool_calls\'] is defined and message[\'tool_calls\'] %}{{ \'# assistant:\\n\' }}{% if message[\'content\'] %}{{ message[\'content\'] }}{{ \'\\n\' }}{% endif %}{% for tc in message[\'tool_calls\'] %}{{ \'<tool_call>\\n{"name": "\' }}{{ tc[\'function\'][\'name\'] }}{{ \'", "arguments": \' }}{% if tc[\'function\'][\'arguments\'] is string %}{{ tc[\'function\'][\'arguments\'] }}{% else %}{{ tc[\'function\'][\'arguments\'] | tojson }}{% endif %}{{ \'}\\n</tool_call>\\n\' }}{% endfor %}'
    "{%- elif message['role'] == 'tool' %}{{ '# tool:\\n<tool_response>\\n' }}{{ message['content'] }}{{ '\\n</tool_response>\\n' }}"
    "{%- else %}{{ '# ' }}{{ message['role'] }}{{ ':\\n' }}{{ message['content'] }}{{ '\\n' }}"
    '{%- endif %}'
    '{%- endfor %}'
    "{%- if add_generation_prompt %}{{ '# assistant:\\n' }}{% endif %}"
)


def wrap_tokenizer(tok, max_len: int):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=EOS, eos_token=EOS, pad_token=EOS,
        clean_up_tokenization_spaces=False, model_max_length=max_len,
    )


def encode_stream(tok, texts: list[str], eos_id: int) -> torch.Tensor:
    """All documents as one token stream, each followed by EOS."""
    ids: list[int] = []
    for enc in tok.encode_batch(texts):
        ids.extend(enc.ids)
        ids.append(eos_id)
    return torch.tensor(ids, dtype=torch.long)


# ---- model -------------------------------------------------------------------------------
def build_model(s: Sizes, eos_id: int):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=s.vocab_size, hidden_size=s.hidden_size, num_hidden_layers=s.num_layers,
        num_attention_heads=s.num_heads, num_key_value_heads=s.num_kv_heads,
        head_dim=s.head_dim, intermediate_size=s.intermediate_size,
        max_position_embeddings=s.max_position_embeddings, tie_word_embeddings=True,
        bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id,
        attention_dropout=0.0, use_cache=True,
    )
    return Qwen3ForCausalLM(config)


def lr_at(step: int, s: Sizes) -> float:
    """Linear warmup to ``lr``, then cosine decay to ``lr * min_lr_ratio`` at ``steps``."""
    if step < s.warmup_steps:
        return s.lr * (step + 1) / s.warmup_steps
    progress = (step - s.warmup_steps) / max(1, s.steps - s.warmup_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return s.lr * (s.min_lr_ratio + (1.0 - s.min_lr_ratio) * cosine)


def make_optimizer(model, s: Sizes):
    # Norm weights (1-D) are not decayed; the tied embedding is.
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": s.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=s.lr, betas=(0.9, 0.95), eps=1e-8,
    )


def train(model, data: torch.Tensor, s: Sizes, seed: int, max_seconds: float, log) -> dict:
    gen = torch.Generator().manual_seed(seed)
    opt = make_optimizer(model, s)
    model.train()
    n_windows = len(data) - s.context - 1
    offsets = torch.arange(s.context + 1)
    start = time.perf_counter()
    steps_done, smooth = 0, None
    for step in range(s.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, s)
        starts = torch.randint(0, n_windows, (s.batch_size,), generator=gen)
        batch = data[starts[:, None] + offsets]
        logits = model(input_ids=batch[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), s.grad_clip)
        opt.step()
        steps_done = step + 1
        smooth = loss.item() if smooth is None else 0.95 * smooth + 0.05 * loss.item()
        elapsed = time.perf_counter() - start
        if step % 50 == 0 or steps_done == s.steps:
            log(f"step {steps_done:5d}/{s.steps}  loss {smooth:.3f}  lr {lr_at(step, s):.2e}  "
                f"{elapsed:6.0f}s  {steps_done * s.batch_size * s.context / elapsed:6.0f} tok/s")
        if elapsed > max_seconds and steps_done < s.steps:
            log(f"time cap of {max_seconds:.0f}s reached after {steps_done} steps; stopping early")
            break
    model.eval()
    return {"steps": steps_done, "stopped_early": steps_done < s.steps,
            "train_seconds": round(time.perf_counter() - start, 1),
            "final_train_loss_smoothed": round(smooth, 4)}


@torch.no_grad()
def heldout_loss(model, data: torch.Tensor, s: Sizes) -> tuple[float, torch.Tensor]:
    """Mean next-token cross-entropy over non-overlapping windows; also returns the targets."""
    n = min(len(data) - 1, s.eval_tokens) // s.context * s.context
    inputs = data[:n].view(-1, s.context)
    targets = data[1 : n + 1].view(-1, s.context)
    total = 0.0
    for i in range(0, inputs.size(0), 8):
        logits = model(input_ids=inputs[i : i + 8]).logits.float()
        total += torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.size(-1)), targets[i : i + 8].reshape(-1), reduction="sum").item()
    return total / n, targets.reshape(-1)


def unigram_loss(train_ids: torch.Tensor, targets: torch.Tensor, vocab_size: int) -> float:
    """Cross-entropy of the training token distribution (add-one smoothed) on ``targets``."""
    counts = torch.bincount(train_ids, minlength=vocab_size).double() + 1.0
    logp = torch.log(counts / counts.sum())
    return float(-logp[targets].mean())


@torch.no_grad()
def completions(model, tokenizer, s: Sizes, seed: int) -> list[dict]:
    out = []
    for prompt in PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        mask = torch.ones_like(ids)
        greedy = model.generate(ids, attention_mask=mask, max_new_tokens=s.sample_tokens, do_sample=False,
                                pad_token_id=tokenizer.eos_token_id)
        torch.manual_seed(seed)
        sampled = model.generate(ids, attention_mask=mask, max_new_tokens=s.sample_tokens, do_sample=True,
                                 temperature=0.8, top_k=40, top_p=1.0,
                                 pad_token_id=tokenizer.eos_token_id)
        out.append({
            "prompt": prompt,
            "greedy": tokenizer.decode(greedy[0, ids.size(1):]),
            "sampled": tokenizer.decode(sampled[0, ids.size(1):]),
        })
    return out


# ---- saving ------------------------------------------------------------------------------
def save(model, tokenizer, out: Path, eos_id: int) -> None:
    """Write the HF directory: bf16 weights, configs and tokenizer files."""
    from transformers import GenerationConfig

    out.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16)
    model.config.use_cache = True
    model.save_pretrained(out)
    # Older readers of config.json look for these keys; newer transformers writes
    # "dtype" and "rope_parameters" instead. Writing both keeps every reader working.
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["architectures"] = ["Qwen3ForCausalLM"]
    cfg["torch_dtype"] = "bfloat16"
    cfg.setdefault("dtype", "bfloat16")
    rope = cfg.get("rope_parameters") or {}
    cfg.setdefault("rope_theta", rope.get("rope_theta", 10000.0))
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    GenerationConfig(bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id,
                     do_sample=False).save_pretrained(out)
    tokenizer.save_pretrained(out)
    # transformers 5 records its own class name; the 4.x-compatible name loads in both.
    tok_cfg_path = out / "tokenizer_config.json"
    tok_cfg = json.loads(tok_cfg_path.read_text())
    tok_cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    tok_cfg["chat_template"] = CHAT_TEMPLATE
    tok_cfg_path.write_text(json.dumps(tok_cfg, indent=2, sort_keys=True) + "\n")
    special = out / "special_tokens_map.json"
    if not special.exists():
        special.write_text(json.dumps({"bos_token": EOS, "eos_token": EOS, "pad_token": EOS}, indent=2) + "\n")
    for path in out.iterdir():
        if path.is_file():
            path.chmod(0o644)  # save_pretrained may create private temp files; the asset is public


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.iterdir() if p.is_file())


# ---- main --------------------------------------------------------------------------------
def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output model directory")
    ap.add_argument("--minutes", type=float, default=25.0, help="wall-time cap on training (safety net)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="tiny smoke run (seconds)")
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps (overrides the default)")
    ap.add_argument("--batch-size", type=int, default=None)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    if args.minutes <= 0:
        ap.error(f"--minutes must be > 0, got {args.minutes}")
    if args.steps is not None and args.steps < 1:
        ap.error(f"--steps must be >= 1, got {args.steps}")
    if args.batch_size is not None and args.batch_size < 1:
        ap.error(f"--batch-size must be >= 1, got {args.batch_size}")
    if args.threads < 1:
        ap.error(f"--threads must be >= 1, got {args.threads}")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    s = replace(QUICK) if args.quick else Sizes()
    if args.steps is not None:
        s.steps = args.steps
        s.warmup_steps = min(s.warmup_steps, max(1, s.steps // 10))
    if args.batch_size is not None:
        s.batch_size = args.batch_size

    def log(msg):
        print(msg, flush=True)

    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(args.threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    t0 = time.perf_counter()

    files = stdlib_files(int(s.max_corpus_mb * 1e6), s.max_file_kb * 1000)
    texts = read_texts(files)
    train_texts, held_texts = split_heldout(texts)
    log(f"corpus: {len(texts)} files, {sum(map(len, texts)) / 1e6:.2f}M chars; "
        f"{len(train_texts)} train / {len(held_texts)} held-out")

    tok = train_tokenizer(train_texts, s.vocab_size)
    tokenizer = wrap_tokenizer(tok, s.max_position_embeddings)
    eos_id = tok.token_to_id(EOS)
    s.vocab_size = tok.get_vocab_size()
    train_ids = encode_stream(tok, train_texts, eos_id)
    held_ids = encode_stream(tok, held_texts, eos_id)
    log(f"tokenizer: vocab {s.vocab_size}, eos id {eos_id}; {len(train_ids)} train tokens, "
        f"{len(held_ids)} held-out tokens ({time.perf_counter() - t0:.0f}s)")

    model = build_model(s, eos_id)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"model: {n_params / 1e6:.2f}M parameters; {s.steps} steps x {s.batch_size} x {s.context} tokens")

    run = train(model, train_ids, s, args.seed, args.minutes * 60, log)
    # Measure what ships: the weights rounded to bf16, evaluated in fp32.
    model.to(torch.bfloat16).to(torch.float32)
    loss, targets = heldout_loss(model, held_ids, s)
    base = unigram_loss(train_ids, targets, s.vocab_size)
    log(f"held-out loss {loss:.4f} nats/token vs unigram baseline {base:.4f} "
        f"({len(targets)} held-out tokens)")
    samples = completions(model, tokenizer, s, args.seed)
    for sample in samples:
        log(f"--- prompt {sample['prompt']!r}\n[greedy]\n{sample['prompt']}{sample['greedy']}\n"
            f"[sampled T=0.8 top_k=40]\n{sample['prompt']}{sample['sampled']}")

    save(model, tokenizer, args.out, eos_id)
    report = {
        "sizes": asdict(s), "seed": args.seed, "threads": args.threads, "parameters": n_params,
        "corpus_files": len(texts), "train_files": len(train_texts), "heldout_files": len(held_texts),
        "train_tokens": len(train_ids), "heldout_tokens_evaluated": len(targets),
        "heldout_loss": round(loss, 4), "unigram_baseline_loss": round(base, 4),
        **run, "total_seconds": round(time.perf_counter() - t0, 1),
        "python": sys.version.split()[0], "torch": torch.__version__,
        "samples": samples,
    }
    (args.out / "training_report.json").write_text(json.dumps(report, indent=2) + "\n")
    log(f"wrote {args.out} ({dir_bytes(args.out) / 1e6:.2f} MB) in {report['total_seconds']:.0f}s")
    return report


if __name__ == "__main__":
    main()
