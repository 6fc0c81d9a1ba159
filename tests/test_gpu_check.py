"""scripts/gpu_check.py's CPU-runnable parts: arguments, reporting, the workload, checkpoint
building, and the kernel and graph checks themselves at tiny shapes (Triton interpreted, a fake
accelerator for the graphs), so the GPU script is exercised code, not dead code; and
scripts/gpu_check.sh's orchestration in its CPU dry-run mode: one process, one timeout and one
log per stage, a hung or crashed stage failing alone, the summary."""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import gpu_check  # noqa: E402

TINY = gpu_check.DRY_RUN_MODEL


def _report():
    return gpu_check.Report(out=io.StringIO())


def test_arguments():
    args = gpu_check.parse_args([])
    assert args.sections == list(gpu_check.SECTIONS) and args.requests == 256
    assert not args.dry_run and gpu_check.parse_args(["--dry-run"]).dry_run
    assert "hf" in gpu_check.SECTIONS
    assert gpu_check.parse_args(["--sections", "kernels, e2e"]).sections == ["kernels", "e2e"]
    with pytest.raises(SystemExit):
        gpu_check.parse_args(["--sections", "kernels,warp"])
    with pytest.raises(SystemExit):
        gpu_check.parse_args(["--requests", "0"])


def test_sections_name_the_modules_they_need():
    assert set(gpu_check.NEEDS) == set(gpu_check.SECTIONS)
    assert gpu_check.missing_modules(gpu_check.NEEDS["e2e"]) == []  # the test env has them all
    assert gpu_check.missing_modules(["json", "no_such_module_xyz"]) == ["no_such_module_xyz"]


def test_report_counts_and_lines():
    r = _report()
    assert r.check("a", True, "fine") and not r.check("b", False)
    r.skip("c", "no GPU")
    try:
        raise RuntimeError("boom")
    except RuntimeError as e:
        r.crashed("d", e)
    line = r.summary(3.2)
    assert line == "gpu_check: 1 PASS, 2 FAIL, 1 SKIP in 3 s" and not r.ok
    assert r.lines[:3] == ["PASS a: fine", "FAIL b", "SKIP c: no GPU"]
    assert r.lines[3] == "FAIL d: raised RuntimeError: boom"
    assert any("boom" in l and l.startswith("       |") for l in r.lines[4:])


def test_nano_vllm_workload_is_seeded_and_in_range():
    prompts, outs = gpu_check.nano_vllm_workload(256)
    again = gpu_check.nano_vllm_workload(256)
    assert (prompts, outs) == again and len(prompts) == len(outs) == 256
    assert all(100 <= len(p) <= 1024 for p in prompts) and all(100 <= n <= 1024 for n in outs)
    assert all(0 <= t <= 10000 for p in prompts for t in p)
    assert gpu_check.nano_vllm_workload(256, seed=1) != (prompts, outs)


def test_free_fraction_window():
    total = 100 << 30
    assert gpu_check.free_fraction_ok(11 << 30, total, 0.9)[0]
    assert not gpu_check.free_fraction_ok(5 << 30, total, 0.9)[0]    # the pool overshot
    assert not gpu_check.free_fraction_ok(30 << 30, total, 0.9)[0]   # memory left unused


def test_checkpoint_is_qwen3_06b_shaped_unless_shrunk(tmp_path):
    assert gpu_check.QWEN3_06B["num_hidden_layers"] == 28
    assert gpu_check.QWEN3_06B_HEADS == (16, 8, 128)
    path = gpu_check.build_checkpoint(tmp_path / "ckpt", dtype="float32", **TINY)
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["hidden_size"] == 64 and cfg["tie_word_embeddings"] is True
    assert cfg["architectures"] == ["Qwen3ForCausalLM"]


def test_kernel_checks_pass_at_tiny_shapes_on_cpu():
    r = _report()
    gpu_check.check_kernels(r, "cpu", dtypes=("float32",), block_sizes=(16,), heads=(4, 2, 16),
                            cases={"decode": ([0, 40, 70], [1, 1, 1], False),
                                   "prefill_context": ([20, 0], [5, 9], True)},
                            splits=(None, 1, 3))
    assert r.ok and r.counts["PASS"] == 4, r.lines
    gpu_check.check_big_cache(r, "cpu", "float32", 16, heads=(4, 2, 16), min_elements=5000,
                              context=40)
    assert r.ok and r.counts["PASS"] == 6, r.lines
    assert "x 2^31 elements" in r.lines[-1]


def test_decode_timing_prints_one_figure_per_batch():
    r = _report()
    gpu_check.time_decode(r, "cpu", batches=(1, 2), context=40, heads=(4, 2, 16),
                          dtype_name="float32", iters=1)
    assert len(r.lines) == 2 and r.ok
    assert "batch 2 x 40 keys" in r.lines[1] and "triton/16 splits=1" in r.lines[1]


def test_graph_check_runs_through_a_host_accelerator(tmp_path):
    path = gpu_check.build_checkpoint(tmp_path / "ckpt", dtype="float32", **TINY)
    r = _report()
    host = gpu_check.host_graphs_accelerator()
    gpu_check.check_graphs(r, path, host, batch_sizes=(1, 3, 4), max_len=40,
                           attention_backend="triton", max_model_len=600)
    assert r.ok and r.counts["PASS"] == 5, r.lines
    assert "graph 4" in r.lines[-2]  # batch 3 replayed the graph of 4, padded
    # 600-token tables: 38 blocks of 16, two shares of the keys in every captured graph.
    assert r.lines[-1].startswith("PASS graphs: split-K inside a captured graph: most splits 2")
    narrow = _report()
    gpu_check.check_graphs(narrow, path, host, batch_sizes=(1,), max_len=40,
                           attention_backend="triton", max_model_len=200)
    assert narrow.lines[-1].startswith("FAIL graphs: split-K inside a captured graph")


def test_start_e2e_and_tp_sections_run_on_a_tiny_model(tmp_path):
    path = gpu_check.build_checkpoint(tmp_path / "ckpt", dtype="float32", **TINY)
    r = _report()
    gpu_check.check_default_start(r, path, mem_get_info=lambda: (11 << 30, 100 << 30),
                                  max_model_len=64)
    assert r.ok and r.counts["PASS"] == 3, r.lines
    assert any("KV blocks" in l for l in r.lines)
    assert r.lines[-1].startswith("PASS start: a second engine in the process sizes like the first")
    rate = gpu_check.run_e2e(r, path, num_requests=3, max_model_len=64,
                             workload=dict(min_len=2, max_input=20, max_output=6, vocab=500))
    assert r.ok and rate > 0, r.lines
    assert "3 requests" in r.lines[-1] and "tok/s" in r.lines[-1]
    gpu_check.check_tp(r, path, gpus=1)
    assert r.lines[-1] == "SKIP tp: 1 GPU(s); TP=2 needs 2"


def test_tp_section_on_cpu_ranks(tmp_path):
    # Two CPU ranks (gloo) stand in for two GPUs: LLM TP=2 and torchrun TP=2 against TP=1.
    path = gpu_check.build_checkpoint(tmp_path / "ckpt", dtype="float32", **TINY)
    r = _report()
    gpu_check.check_tp(r, path, gpus=2, max_model_len=128)
    assert r.ok and r.counts["PASS"] == 2, r.lines


def test_without_a_gpu_the_driver_fails_cleanly():
    # No visible device, also on a machine that has one: the driver must say so and fail.
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py"),
                           "--sections", "kernels"], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 1
    assert "FAIL env: CUDA available: 0 device(s)" in proc.stdout
    assert proc.stdout.strip().splitlines()[-1].startswith("gpu_check: 0 PASS, 1 FAIL")


def test_shell_script_parses_and_fails_cleanly_without_cuda():
    subprocess.run(["bash", "-n", str(ROOT / "scripts" / "gpu_check.sh")], check=True)
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh")], capture_output=True,
                          text=True, timeout=120, env={"PATH": "/usr/bin:/bin", "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 1
    assert proc.stdout.startswith("FAIL env: no Python here imports torch with CUDA available")


def test_hf_section_compares_greedy_tokens_with_transformers(tmp_path, monkeypatch):
    path = gpu_check.build_checkpoint(tmp_path / "ckpt", dtype="float32", **TINY)
    r = _report()
    gpu_check.check_hf_greedy(r, path, "cpu", prompts=([5, 6, 7], list(range(30, 70))),
                              max_tokens=6, max_model_len=128)
    assert r.ok and r.counts["PASS"] == 2, r.lines
    assert "6 tokens equal" in r.lines[-1]
    # A reference that differs: a failure where its logits were clear, a pass at a near-tie.
    real = gpu_check.hf_greedy

    def shifted(model, prompt, n, device, gap):
        tokens, _ = real(model, prompt, n, device)
        return [tokens[0]] + [(t + 1) % TINY["vocab_size"] for t in tokens[1:]], [gap] * n

    for gap, verdict in ((0.5, "FAIL"), (1e-5, "PASS")):
        monkeypatch.setattr(gpu_check, "hf_greedy", lambda m, p, n, d, g=gap: shifted(m, p, n, d, g))
        r = _report()
        gpu_check.check_hf_greedy(r, path, "cpu", prompts=([5, 6, 7],), max_tokens=4,
                                  max_model_len=128)
        assert r.lines[-1].startswith(f"{verdict} hf greedy prompt 0"), r.lines
        assert "token 1" in r.lines[-1]


_HUNG = f"gpu-check-hung-stage-{os.getpid()}"


def _stage_wrapper(tmp_path) -> Path:
    """A Python for gpu_check.sh whose kernels stage hangs (ignoring SIGTERM, as a process
    stuck in the driver does) and whose graphs stage dies of SIGSEGV after one PASS line (a
    sticky device error); every other stage is the real one."""
    script = tmp_path / "python"
    script.write_text(f"""#!/bin/bash
case " $* " in
  *" --sections kernels "*) trap '' TERM; echo "PASS kernels: started"; exec -a {_HUNG} sleep 300 ;;
  *" --sections graphs "*) echo "PASS graphs: first check"; kill -SEGV $$ ;;
esac
exec {sys.executable} "$@"
""")
    script.chmod(0o755)
    return script


def test_shell_stages_run_isolated_with_their_own_timeouts_and_logs(tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, PYTHON=str(_stage_wrapper(tmp_path)))
    env.pop("OUT", None)
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--dry-run",
         "--sections", "kernels,graphs,env", "--out", str(out), "--timeout", "kernels=3",
         "--grace", "1", "--workdir", str(tmp_path / "work")],
        capture_output=True, text=True, timeout=180, env=env)
    logs = out / "gpu_check"
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert sorted(p.name for p in logs.iterdir()) == ["env.log", "graphs.log", "kernels.log",
                                                      "summary.txt"]
    kernels = (logs / "kernels.log").read_text()
    assert "PASS kernels: started" in kernels
    assert "FAIL kernels: timed out after 3 s (stopped with SIGKILL)" in kernels
    graphs = (logs / "graphs.log").read_text()
    assert "PASS graphs: first check" in graphs and "FAIL graphs: killed by signal 11" in graphs
    # The stage after a hang and a crash still ran, in its own process, and passed.
    env_log = (logs / "env.log").read_text()
    assert "PASS env: dry run on the CPU: Triton interpreted" in env_log
    assert "gpu_check: 1 PASS, 0 FAIL, 0 SKIP" in env_log
    summary = (logs / "summary.txt").read_text().splitlines()
    assert summary[-1].startswith("gpu_check: 3 PASS, 2 FAIL, 0 SKIP in ")
    assert summary[-1].endswith("stages: kernels=FAIL graphs=FAIL env=ok")
    assert proc.stdout.strip().splitlines()[-1] == summary[-1]
    assert sum(l.startswith("FAIL ") for l in summary) == 2
    stray = subprocess.run(["pgrep", "-f", _HUNG], capture_output=True, text=True)
    assert stray.stdout == ""  # the hung stage's whole process group was killed


def test_shell_skips_stages_past_its_budget_and_refuses_unknown_stages(tmp_path):
    script = str(ROOT / "scripts" / "gpu_check.sh")
    proc = subprocess.run(["bash", script, "--dry-run", "--sections", "env,kernels",
                           "--out", str(tmp_path), "--budget", "10"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert lines[-3].startswith("SKIP env: run budget spent")
    assert lines[-2].startswith("SKIP kernels: run budget spent")
    assert lines[-1].startswith("gpu_check: 0 PASS, 0 FAIL, 2 SKIP")
    bad = subprocess.run(["bash", script, "--dry-run", "--sections", "env,warp"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "unknown stage 'warp'" in bad.stderr
    bad = subprocess.run(["bash", script, "--timeout", "kernels"], capture_output=True, text=True,
                         timeout=60)
    assert bad.returncode == 2 and "--timeout: expected STAGE=SECONDS" in bad.stderr


def test_spec_section_runs_on_a_tiny_model(tmp_path):
    path = gpu_check.build_checkpoint(tmp_path / "ckpt", dtype="float32", **TINY)
    r = _report()
    gpu_check.check_spec(r, path, max_tokens=12, max_model_len=128)
    assert r.ok and r.counts["PASS"] == 5, r.lines
    assert r.lines[-1].startswith("PASS spec: drafts accepted: mean acceptance length")


def test_moe_section_runs_at_tiny_shapes(tmp_path):
    # The grouped-expert kernel (interpreted) against the reference, its timing figure, and a
    # small MoE model's greedy tokens against transformers'.
    r = _report()
    gpu_check.check_moe_kernel(r, "cpu", dtypes=("float32",), tokens=(1, 5), shape=gpu_check.DRY_RUN_EXPERTS)
    assert r.ok and r.counts["PASS"] == 3, r.lines
    assert r.lines[-1].startswith("PASS moe fused_experts bfloat16 expert shard 2..3")
    gpu_check.time_moe(r, "cpu", tokens=(1,), shape=gpu_check.DRY_RUN_EXPERTS, iters=1)
    assert "1 tokens" in r.lines[-1] and "GB/s of experts" in r.lines[-1]
    gpu_check.check_moe_model(r, tmp_path, "cpu", prompts=([5, 6, 7], list(range(30, 70))), max_tokens=6,
                              max_model_len=128)
    assert r.ok and r.counts["PASS"] == 5, r.lines
    assert r.lines[-1].startswith("PASS hf greedy prompt 1 (40 tokens): 6 tokens equal")
