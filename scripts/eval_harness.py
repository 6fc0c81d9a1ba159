#!/usr/bin/env python3
"""lm-evaluation-harness against tpserve, unchanged, and against lm-eval's own hf backend.

    python scripts/eval_harness.py [--lm-eval .peers/lm-eval/bin/lm_eval] [--model DIR]

Starts a daemon (float32, HTTP front) on the model (default: the bundled one), then runs the
local tasks of scripts/eval_tasks/ (YAML + local JSON lines: no dataset downloads):

* ``tpserve_mc`` (multiple choice: log-likelihood of each choice; echo + logprobs + token ids,
  what lm-eval's local-completions sends), ``tpserve_rolling`` (rolling log-likelihood of whole
  texts) and ``tpserve_gen`` (generate_until) through ``local-completions``;
* ``tpserve_gen`` through ``local-chat-completions`` (chat template applied);
* the same three through ``hf`` on the same model directory, in float32: the reference.

Prints one line per (backend, task) with its metrics, then the comparison: the largest
difference of a per-item log-likelihood between tpserve and hf, and whether accuracies and
exact matches are identical. Exit status 1 if they are not (log-likelihoods within 1e-3).
lm-eval lives in its own virtualenv (scripts/peer_lm_eval.sh).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TASKS = ROOT / "scripts" / "eval_tasks"
BUNDLED = ROOT / "tpserve" / "assets" / "default-model"
TOLERANCE = 1e-3


def tpserve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tpserve", *args], capture_output=True, text=True, timeout=600)


def run_lm_eval(lm_eval: str, out: Path, model: str, model_args: str, tasks: str, chat: bool = False) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    cmd = [lm_eval, "--model", model, "--model_args", model_args, "--tasks", tasks, "--include_path", str(TASKS),
           "--output_path", str(out), "--log_samples", "--batch_size", "1", "--seed", "0", "--device", "cpu"]
    if chat:
        cmd.append("--apply_chat_template")
    env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               OPENAI_API_KEY="unused")
    proc = subprocess.run(cmd, cwd=TASKS, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"lm_eval {model} failed:\n" + "\n".join((proc.stdout + proc.stderr).splitlines()[-40:]))
    results = sorted(out.rglob("results_*.json"))[-1]
    samples = {}
    for f in out.rglob("samples_*.jsonl"):
        task = f.name[len("samples_"):].rsplit("_", 1)[0]
        samples[task] = [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
    return {"results": json.loads(results.read_text())["results"], "samples": samples}


def lls(samples: list[dict]) -> dict[int, list[float]]:
    """doc id -> the log-likelihoods lm-eval computed for it (one per choice or per text)."""
    out = {}
    for s in samples:
        vals = []
        for r in s["filtered_resps"]:
            vals.append(float(r[0] if isinstance(r, list) else r))
        out[s["doc_id"]] = vals
    return out


def metrics(res: dict, task: str) -> str:
    r = res["results"][task]
    return " ".join(f"{k.split(',')[0]}={v:.4f}" for k, v in sorted(r.items())
                    if isinstance(v, float) and "stderr" not in k)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lm-eval", default=os.environ.get("TPSERVE_LM_EVAL",
                                                       str(ROOT / ".peers" / "lm-eval" / "bin" / "lm_eval")))
    ap.add_argument("--model", default=str(BUNDLED))
    args = ap.parse_args()
    name = "tpserve-eval"
    with tempfile.TemporaryDirectory(prefix="tpserve-eval-") as tmp:
        rd = Path(tmp) / "rd"
        out = tpserve("start", "--model", args.model, "--runtime-dir", str(rd), "--dtype", "float32",
                      "--http-port", "0", "--served-model-name", name, "--kv-cache-memory-gb", "0.1")
        if out.returncode != 0:
            print(out.stdout + out.stderr, file=sys.stderr)
            return 1
        url = out.stdout.split()[-1]
        try:
            tok = f"tokenizer_backend=huggingface,tokenizer={args.model},tokenized_requests=True"
            ours = run_lm_eval(args.lm_eval, Path(tmp) / "ours", "local-completions",
                               f"model={name},base_url={url}/v1/completions,num_concurrent=1,max_retries=1,{tok}",
                               "tpserve_mc,tpserve_rolling,tpserve_gen")
            chat = run_lm_eval(args.lm_eval, Path(tmp) / "chat", "local-chat-completions",
                               f"model={name},base_url={url}/v1/chat/completions,num_concurrent=1,max_retries=1",
                               "tpserve_gen", chat=True)
        finally:
            tpserve("stop", "--runtime-dir", str(rd))
        ref = run_lm_eval(args.lm_eval, Path(tmp) / "hf", "hf", f"pretrained={args.model},dtype=float32",
                          "tpserve_mc,tpserve_rolling,tpserve_gen")
    for label, res, tasks in (("local-completions", ours, ("tpserve_mc", "tpserve_rolling", "tpserve_gen")),
                              ("local-chat-completions", chat, ("tpserve_gen",)),
                              ("hf", ref, ("tpserve_mc", "tpserve_rolling", "tpserve_gen"))):
        for task in tasks:
            print(f"eval backend={label} task={task} {metrics(res, task)}", flush=True)
    worst = 0.0
    for task in ("tpserve_mc", "tpserve_rolling"):
        a, b = lls(ours["samples"][task]), lls(ref["samples"][task])
        assert a.keys() == b.keys(), f"{task}: different documents"
        worst = max([worst] + [abs(x - y) for d in a for x, y in zip(a[d], b[d])])
    same = {t: ours["results"][t] == ref["results"][t] or
            {k: v for k, v in ours["results"][t].items() if "stderr" not in k and k != "alias"} ==
            {k: v for k, v in ref["results"][t].items() if "stderr" not in k and k != "alias"}
            for t in ("tpserve_mc", "tpserve_gen")}
    ok = worst <= TOLERANCE and all(same.values())
    print(f"eval compare loglikelihood_max_abs_diff={worst:.2e} (tolerance {TOLERANCE:g}) "
          f"mc_acc_identical={same['tpserve_mc']} gen_exact_match_identical={same['tpserve_gen']} "
          f"{'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
