"""A real daemon with KV tiers (`tpserve serve --kv-offload-dir ...`): a prompt computed by one
daemon is served from disk by the next one started on the same directory, with the same tokens;
the HTTP usage counts the loaded tokens as cached, and `tpserve status` shows the tiers."""
from __future__ import annotations

import random
import signal
import subprocess
import sys
from pathlib import Path

import httpx

from model_factory import make_tiny_model, tiny_models_root  # noqa: F401
from tpserve.client.addresses import read_ready

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import soak  # noqa: E402

PROMPT = [random.Random(3).randrange(3, 380) for _ in range(40)]


def serve(model, directory):
    return soak.Daemon("--model", str(model), "--dtype", "float32", "--block-size", "4",
                       "--num-kv-blocks", "16", "--kv-offload-host-gb", "0.001",
                       "--kv-offload-dir", str(directory), "--http-port", "0",
                       "--startup-timeout", "200", startup_timeout=200)


def complete(d) -> dict:
    url = read_ready(Path(d.rd))["http"]
    r = httpx.post(url + "/v1/completions", timeout=60,
                   json={"model": Path(d.status()["model"]).name, "prompt": PROMPT, "max_tokens": 4,
                         "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


def stop(d) -> None:
    d.proc.send_signal(signal.SIGTERM)
    assert d.proc.wait(timeout=60) == 0
    assert d.leftovers() == (0, 0)


def test_a_restarted_daemon_serves_yesterdays_prompt_from_disk(tiny_models_root, tmp_path):  # noqa: F811
    model = make_tiny_model(tiny_models_root, arch="qwen3")
    d = serve(model, tmp_path)
    try:
        first = complete(d)
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    finally:
        stop(d)
    d = serve(model, tmp_path)
    try:
        again = complete(d)
        assert again["choices"][0]["text"] == first["choices"][0]["text"]
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 39
        stats = d.status()
        assert stats["kv_offload_disk_loads"] == 10 and stats["kv_offload_disk_corrupt"] == 0
        out = subprocess.run([sys.executable, "-m", "tpserve", "status", "--runtime-dir", d.rd],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert "KV disk tier" in out.stdout and "loads 10" in out.stdout
        assert "KV host tier" in out.stdout
    finally:
        stop(d)
