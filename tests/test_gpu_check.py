"""scripts/gpu_check.py's CPU-runnable parts: arguments, reporting, the workload, checkpoint
building, and the kernel and graph checks themselves at tiny shapes (Triton interpreted, a fake
accelerator for the graphs), so the GPU script is exercised code, not dead code."""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tpserve.workers.device import Accelerator

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import gpu_check  # noqa: E402

TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, intermediate_size=128, vocab_size=512, max_position_embeddings=256,
            bos_token_id=1, eos_token_id=2)


class HostGraphs(Accelerator):
    """Tensors on the CPU, but the accelerator path (graphs captured through the seam)."""

    is_accelerator = True


def _report():
    return gpu_check.Report(out=io.StringIO())


def test_arguments():
    args = gpu_check.parse_args([])
    assert args.sections == list(gpu_check.SECTIONS) and args.requests == 256
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
    gpu_check.check_graphs(r, path, HostGraphs(), batch_sizes=(1, 3, 4), max_len=40,
                           attention_backend="triton")
    assert r.ok and r.counts["PASS"] == 4, r.lines
    assert "graph 4" in r.lines[-1]  # batch 3 replayed the graph of 4, padded


def test_start_e2e_and_tp_sections_run_on_a_tiny_model(tmp_path):
    path = gpu_check.build_checkpoint(tmp_path / "ckpt", dtype="float32", **TINY)
    r = _report()
    gpu_check.check_default_start(r, path, mem_get_info=lambda: (11 << 30, 100 << 30),
                                  max_model_len=64)
    assert r.ok and r.counts["PASS"] == 2, r.lines
    assert any("KV blocks" in l for l in r.lines)
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
