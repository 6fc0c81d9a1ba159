"""Every script under scripts/ runs: a stale script is broken code.

Each script has an entry in SCRIPTS (a script without one fails test_every_script_has_an_entry):

* Smoke: run in a subprocess, two at a time, at its smallest size (the benchmark models' ``tiny``
  shape or the bundled model, a few requests, steps or messages, sub-second windows; a ``--smoke``
  flag where the sizes are not all options), exit status 0 and its result lines checked, including the
  results that must hold whatever the machine (nothing lost, leaked or left open). Scripts that
  compare tpserve with a peer run tpserve's side alone where they have such a mode;
* Parse: a script that needs a peer that is not installed, a GPU, or a training run (some have
  tests of their own, named in the entry): its module is imported, its real argument parser
  reads a small argument list (the parser is stopped right after parsing, before any work), and
  ``--help`` prints its usage;
* Library: a module other scripts import, imported.

Every script, smoke-run or not, goes through the import-and-parse pass, all in one interpreter.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

SCRIPTS_DIR = Path(__file__).resolve().parent.parent / "scripts"


@dataclass(frozen=True)
class Smoke:
    args: tuple
    expect: str  # a regular expression the output must match
    exit_codes: tuple = (0,)  # the statuses that are results, not failures


@dataclass(frozen=True)
class Parse:
    args: tuple
    why: str  # why the script is not smoke-run here


LIBRARY = "library"

NOT_INSTALLED = "/nonexistent/peer/bin/python"

SCRIPTS = {
    "bench_channel.py": Smoke(("--messages", "50", "--warmup", "5", "--readers", "1"),
                              r"channel readers=1 shm median=\S+us"),
    "bench_scheduler.py": Smoke(("--seqs", "64", "--steps", "20", "--rounds", "1", "--block-sizes", "16"),
                                r"bench_scheduler mixed\(\+256-token chunk\) block_size=16 seqs=64 steps=20: "
                                r"tpserve"),
    "bench_sampler.py": Smoke(("--rows", "4", "--vocab", "1000", "--repeat", "1"),
                              r"bench_sampler device=cpu .* rows=4 vocab=1000 race_ms"),
    "determinism.py": Smoke(("--smoke",), r"default  : alone again\s+max\|dlogit\| 0, steps differing 0/4"
                                          r"(.|\n)*invariant: speculated .* max\|dlogit\| 0, steps differing 0/4"),
    "bench_embed.py": Smoke(("--shape", "tiny", "--texts", "12", "--max-tokens", "48", "--skip-vllm"),
                            r"bench_embed shape=tiny \S+ \S+ texts=12 tokens=\d+ embeddings/s tpserve=[\d.]+ "
                            r"transformers=[\d.]+ ratio-transformers=[\d.]+x least-cosine=(0\.99\d*|1\.0*)"),
    "bench_throughput.py": Smoke(("--shape", "tiny", "--skip-hf", "--skip-controls"),
                                 r"tpserve LLM.generate\s+[\d.]+ output tok/s(.|\n)*batch-invariant shape=tiny "
                                 r".* streams=8: invariant=[\d.]+ default=[\d.]+ tok/s ratio=[\d.]+x; streams=1"),
    "bench_spec.py": Smoke(("--shape", "tiny", "--quick", "--skip-throughput", "--repeats", "1"),
                           r"spec shape=tiny .* batch=1: plain=[\d.]+ spec=[\d.]+ decode tok/s"),
    "bench_verify_cost.py": Smoke(("--shape", "tiny-moe", "--quick", "--sweep"),
                                  r"(?s)verify-cost shape=tiny-moe \S+ batch=1 k=4: plain=[\d.]+ ms "
                                  r"verify=[\d.]+ ms ratio=[\d.]+x .* experts/layer plain=[\d.]+ "
                                  r"verify=[\d.]+ .*"
                                  r"sweep shape=tiny-moe \S+ batch=2: plain=[\d.]+ spec=[\d.]+ decode tok/s"),
    "profile_step.py": Smoke(("--shape", "tiny", "--batch", "2", "--steps", "1", "--prompt-len", "16",
                              "--top", "3"), r"Self CPU time total"),
    "quickstart.py": Smoke(("--max-tokens", "16"), r"stopped tpserve daemon \(pid \d+\)"),
    "import_cycles.py": Smoke(("--package", "tpserve"),
                              r"import_cycles package=tpserve modules=\d+ edges=\d+ cycles=0"),
    "bench_models.py": LIBRARY,
    "bench_window_kv.py": LIBRARY,  # bench_throughput.py --shape gemma3-1b
    "bench_daemon_run.py": LIBRARY,
    "bench_daemon.py": Smoke(("--model", "tpserve/assets/default-model", "--clients", "2",
                              "--requests-per-client", "2", "--max-tokens", "4", "--latency-trials", "2",
                              "--kv-cache-memory-gb", "0.05"),
                             r"bench_daemon model=default-model tp=1 requests=4 clients=2 max_tokens=4 "
                             r"offline_tok_s=[\d.]+ daemon_tok_s=[\d.]+ ratio=[\d.]+ engine_ttft_ms=[\d.]+ "
                             r"client_ttft_ms=[\d.]+ added_latency_ms=-?[\d.]+"),
    "bench_fairness.py": Smoke(("--flood", "20", "--vanish", "2", "--vanish-tokens", "8"),
                               r"bench_fairness model=default-model .* flood=20 other_client_wait_s=[\d.]+ "
                               r"vanished=2x8"),
    "bench_agent.py": Smoke(
        ("--shape", "tiny", "--sessions", "3", "--system-tokens", "64", "--turns", "2", "--user-tokens", "16",
         "--reply-tokens", "4", "--pool-sessions", "1"),
        r"bench_agent shape=tiny isa=\S+ dtype=\S+ sessions=3 .*\n"
        r"bench_agent tiers=off requests=6 ttft_p50_ms=[\d.]+ ttft_p99_ms=[\d.]+ "
        r"prefill_tokens_computed=\d+\n"
        r"bench_agent tiers=on requests=6 .* host_loads=[1-9]\d* .*\n"
        r"bench_agent ratio prefill_computed=[\d.]+ .*\n"
        r"bench_agent restart first_turn_ttft_ms=[\d.]+ cold_start_ttft_ms=[\d.]+ ratio=[\d.]+ .* "
        r"disk_loads=[1-9]\d* disk_corrupt=0"),
    "bench_agent_turns.py": Smoke(
        ("--shape", "tiny", "--context-tokens", "400", "--sessions", "1", "--pairs", "2"),
        r"bench_agent_turns shape=tiny sessions=1 turn1_prompt=\d+ turn2_prompt=\d+ ttft1_ms=[\d.]+ "
        r"ttft2_ms=[\d.]+ ttft_ratio=[\d.]+ turn2_cache_read_input_tokens=[1-9]\d*\n"
        r"bench_agent_turns translation pairs=2 max_tokens=1 e2e messages_ms=[\d.]+ chat_ms=[\d.]+ "
        r"difference_ms=-?[\d.]+ same_prompt=yes .* overhead_ms=-?[\d.]+"),
    "bench_http.py": Smoke(("--streams", "1", "--max-tokens", "2", "--rounds", "1"),
                           r"bench_http model=default-model .* streams=1 max_tokens=2 zmq_tok_s=[\d.]+ "
                           r"http_tok_s=[\d.]+"),
    "bench_gguf.py": Smoke(("--smoke",),
                           r"gguf isa=\S+ threads=\d+ .*\n"
                           r"tpserve smollm2 +dtype=Q4_1 \(repacked\) +tok/s: +batch +1 +[\d.]+ +batch +2 +[\d.]+ "
                           r"+load rss [\d.]+ GiB"),
    "bench_int4.py": Smoke(("--shape", "tiny", "--runs", "1", "--tokens", "8"),
                           r"int4 shape=tiny isa=\S+ path=\S+ threads=\d+ .*\n"
                           r"tpserve int8 +dtype=int8 w/ int8 act +tok/s +[\d.]+ .*rss MB +[\d.]+\n"
                           r"tpserve int4-g32 +dtype=int4-g32 w/ int8 act per group +tok/s +[\d.]+ .*\n"
                           r"ratio int4-g32 / int8: tok/s [\d.]+x .*linear bytes [\d.]+ .*\n"
                           r"load average"),
    "bench_w4a8_kernels.py": Smoke(("--shape", "tiny", "--head", "--repeats", "1", "--threads", "1"),
                                   r"w4a8-kernels shape=tiny layers=2 head=yes rows=1 isa=\S+ path=\S+ .*\n"
                                   r"threads=1 q4_0 ms +[\d.]+ GB/s +[\d.]+ +q4_1 ms +[\d.]+ GB/s +[\d.]+ +"
                                   r"int8 ms +[\d.]+ GB/s +[\d.]+ +ratio int8/q4_0 [\d.]+x"),
    "bench_latency.py": Smoke(("--shape", "tiny", "--runs", "1"),  # tpserve's engines only, no llama-server
                              r"latency shape=tiny isa=\S+ threads=\d+ prompt=64 .*\n"
                              r"tpserve bf16 +dtype=bf16 +tok/s: batch  1 +[\d.]+  batch  8 +[\d.]+\n"
                              r"tpserve int8 +dtype=int8 w/ int8 act tok/s: batch  1 +[\d.]+  "
                              r"batch  8 +[\d.]+\n"
                              r"ratio tpserve int8 / tpserve bf16: batch  1 +[\d.]+x  batch  8 +[\d.]+x"),
    "bench_moe.py": Smoke(("--smoke",),  # the tiny MoE shape, tpserve's engines only, no peers
                          r"moe shape=tiny isa=\S+ threads=\d+ params=\S+ experts=8 top-k=2 .*\n"
                          r"tpserve bf16 +dtype=bf16 +tok/s: batch  1 +[\d.]+  batch  4 +[\d.]+\n"
                          r"tpserve int8 +dtype=int8 w/ int8 act tok/s: batch  1 +[\d.]+  batch  4 +[\d.]+\n"
                          r"ratio tpserve int8 / tpserve bf16: .*\n"
                          r"weight bytes per decode token bf16: batch  1 .*\n"
                          r"weight bytes per decode token int8: batch  1 .*\n"
                          r"memory tpserve bf16: rss [\d.]+ GiB, weights [\d.]+ GiB \+ kv pool [\d.]+ GiB"),
    "bench_router.py": Parse(("--policies", "round_robin", "--scenarios", "skewed", "--smg", NOT_INSTALLED),
                             "smg or vllm-router (scripts/peer_smg.sh, peer_vllm_router.sh); "
                             "tests/test_bench_router.py checks its scenarios"),
    "bench_serving.py": Smoke(("--model", "tpserve/assets/default-model", "--requests", "4", "--rates", "4",
                               "--prompt-scale", "0.02", "--output-scale", "0.1", "--scenario-prompt", "200",
                               "--scenario-streams", "2", "--max-num-seqs", "8",
                               "--kv-cache-memory-gb", "0.05"),
                              r"(?s)bench_serving engine=tpserve-mixed rate=4/s done=4/4 ttft_ms p50=\d+ "
                              r"p99=\d+ itl_ms p50=[\d.]+ p99=[\d.]+ e2e_s p50=[\d.]+ p99=[\d.]+ "
                              r"out_tok_s=[\d.]+\n"
                              r"bench_serving scenario engine=tpserve-mixed streams=2 prompt=200 "
                              r"median_gap_ms=[\d.]+ longest_gap_ms=[\d.]+\n"
                              r"bench_serving engine=tpserve-prefill-first rate=4/s done=4/4 .*"
                              r"bench_serving scenario engine=tpserve-prefill-first streams=2 .*"
                              r"bench_serving scenario longest gap mixed/prefill-first=[\d.]+"),
    "bench_slow_reader.py": Smoke(("--requests", "2", "--tokens", "2", "--interval", "0.1",
                                   "--slow-for", "0.3", "--quiet", "0.2"),
                                  r"bench_slow_reader .* finals=2/2 complete=2/2 dropped=no"),
    "bench_structured.py": Smoke(("--smoke",),
                                 r"bench_structured: shape=tiny isa=\S+ dtype=\S+ requests=4 rounds=1 "
                                 r"constrained=\d+ tok/s unconstrained=\d+ tok/s ratio=[\d.]+ .* "
                                 r"grammars_finished=\d+/4 \| ttft 20-prop schema cold=[\d.]+ ms "
                                 r"cached=[\d.]+ ms added=-?[\d.]+ ms \| other streams' longest gap during a "
                                 r"cold compile=[\d.]+ ms"),
    "bench_tokenize_stall.py": Smoke(("--chars", "10000", "--rounds", "1", "--baseline-s", "0.3"),
                                     r"bench_tokenize_stall model=default-model isa=\S+ dtype=auto "
                                     r"chars=10000 rounds=1 zmq_baseline_gap_s=[\d.]+ "
                                     r"zmq_huge_prompt_gap_s=[\d.]+ "
                                     r"zmq_ratio=[\d.]+ .*zmq_answer=admission http_baseline_gap_s=[\d.]+ "
                                     r"http_huge_prompt_gap_s=[\d.]+ http_ratio=[\d.]+ .*http_answer=400"),
    "bench_kv_int8.py": Smoke(("--shape", "tiny", "--streams", "2", "--context", "64", "--steps", "1",
                               "--prompts", "2", "--kv-gb", "0.01"),
                              r"kv_int8 pool shape=tiny kv_gb=0.01: bf16 \d+ tokens, "
                              r"int8 \d+ tokens \([\d.]+x\)"
                              r"(.|\n)*kv_int8 decode shape=tiny streams=2 context=64: bf16 KV [\d.]+ tok/s, "
                              r"int8 KV [\d.]+ tok/s(.|\n)*kv_int8 accuracy shape=tiny: greedy agreement"),
    "bench_tp.py": Smoke(("--shape", "tiny", "--requests", "4", "--tp", "2"),
                         r"bench_tp shape=tiny requests=4 tp1=[\d.]+ tok/s tp2=[\d.]+ tok/s "
                         r"ratio tp2/tp1=[\d.]+x"),
    "eval_harness.py": Parse(("--lm-eval", NOT_INSTALLED), "lm-evaluation-harness (scripts/peer_lm_eval.sh)"),
    "gpu_check.py": Parse(("--sections", "env", "--dry-run"),
                          "a GPU (its --dry-run: tests/test_gpu_check.py)"),
    "parity_vllm.py": Parse(("--peer-vllm", NOT_INSTALLED, "--prompts", "2"),
                            "vLLM (scripts/peer_vllm_cpu.sh)"),
    "probe_http_idle.py": Smoke(("--conns", "5", "--partial", "--hold", "0.1", "--window", "0.5"),
                                r"probe_http_idle conns=5 partial=1 hold_s=0.1 health_before=200 \(\d+ ms\) "
                                r"health=200 \(\d+ ms\) front_alive=1 front_fds=\d+ closed_by_front=\d+ "
                                r"log_lines_per_s=\d+ tracebacks_per_s=0 "),
    "probe_http_stall.py": Smoke(("--streams", "2", "--whole", "1", "--max-tokens", "200", "--stop-s", "2",
                                  "--upstream-timeout", "1", "--wait-s", "30"),
                                 r"probe_http_stall streams=2 stop_s=2 upstream_timeout_s=1 "
                                 r"daemon_dropped_front=\d streams_finished=\d streams_error_then_done=\d "
                                 r"streams_cut_without_done=0 "
                                 r"streams_open=0 daemon_in_flight=0 whole=\d{3}:1"),
    "quality_int8.py": Smoke(("--smoke",),
                             r"(?s)quality bundled model, int8 against bf16: greedy agreement "
                             r"free-running [\d.]+%, same-prefix [\d.]+%; "
                             r"mean KL\(bf16\|\|int8\) [\d.]+ nats \(2 prompts x 8 tokens\)"
                             r".*quality bundled model held-out loss \(512 tokens\): bf16 [\d.]+, "
                             r"int8 [\d.]+ "
                             r".*quality tiny random-weight model, fp32 against bf16: greedy agreement "
                             r".*quality tiny random-weight model, simulated in fp32 against fp32: "
                             r"Q8_0-like: int8 weights and activations in blocks of 32: same-prefix [\d.]+%"),
    "soak.py": Smoke(("--clients", "2", "--requests", "6", "--edge-inputs"),
                     r"(?s)soak phase 1 \(TP 1, 2 clients x 6 requests\): requests completed \d+, "
                     r".*requests lost 0, blocks leaked 0, leftover processes 0, shm segments 0, "
                     r"daemon exit 0, .*"
                     r"soak phase 2 \(TP 2, worker SIGKILL while idle\): daemon exit 1 .*"
                     r"soak phase 3 \(TP 2, worker SIGKILL with 4 streams in flight\): errors answered 4, .*"
                     r"soak: PASS"),
    "tp_cycles.py": Smoke(("--cycles", "1"),
                          r"cycle 1: rank0=0 workers=\[0\] ok \([\d.]+ s\)\ntp_cycles cycles=1 failed=0"),
    "train_default_model.py": Parse(("--quick", "--out", "/nonexistent/out"),
                                    "training a model (its --quick run: tests/test_default_model.py)"),
}

# Runs in a fresh interpreter: imports each script as a module, asks its parser for --help, then
# has it parse the entry's arguments, stopping it right after parse_args (before any work).
PARSE_PASS = textwrap.dedent("""
    import argparse, contextlib, importlib.util, io, json, sys, traceback

    class Parsed(Exception):
        pass

    real_parse_args = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        raise Parsed(vars(real_parse_args(self, args, namespace)))

    argparse.ArgumentParser.parse_args = parse_then_stop
    results = {}
    for path, args, library in json.loads(sys.argv[1]):
        result = results[path] = {}
        try:
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                spec = importlib.util.spec_from_file_location("script_" + path.rsplit("/", 1)[-1][:-3], path)
                module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(module)
            result["imported"] = True
            if library:
                continue
            for argv, key in ((["--help"], "help"), (args, "parsed")):
                sys.argv = [path, *argv]
                out = io.StringIO()
                try:
                    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
                        module.main()
                    result[key] = "main() returned without parsing its arguments"
                except Parsed as p:
                    result[key] = sorted(p.args[0])
                except SystemExit as e:
                    result[key] = {"exit": e.code, "output": out.getvalue()[:3000]}
        except BaseException:
            result["error"] = traceback.format_exc()[-3000:]
    print(json.dumps(results))
""")


def test_every_script_has_an_entry():
    found = sorted(p.name for p in SCRIPTS_DIR.glob("*.py"))
    assert found == sorted(SCRIPTS), (set(found) ^ set(SCRIPTS))


def test_every_script_imports_and_parses_its_arguments():
    todo = [(str(SCRIPTS_DIR / name), list(entry.args) if entry != LIBRARY else [], entry == LIBRARY)
            for name, entry in sorted(SCRIPTS.items())]
    proc = subprocess.run([sys.executable, "-c", PARSE_PASS, json.dumps(todo)], capture_output=True,
                          text=True, timeout=240, cwd=SCRIPTS_DIR.parent)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    for name, entry in sorted(SCRIPTS.items()):
        result = results[str(SCRIPTS_DIR / name)]
        assert "error" not in result, f"{name}:\n{result['error']}"
        assert result.get("imported"), name
        if entry == LIBRARY:
            continue
        help_ = result["help"]
        assert isinstance(help_, dict) and help_["exit"] == 0 and "usage:" in help_["output"], (name, help_)
        parsed = result["parsed"]
        assert isinstance(parsed, list) and parsed, (name, parsed)
        for option in (a for a in entry.args if a.startswith("--")):
            assert option[2:].replace("-", "_") in parsed, (name, option, parsed)


SMOKE = sorted(name for name, entry in SCRIPTS.items() if isinstance(entry, Smoke))


# Smoke runs go two at a time: at their smallest sizes the scripts mostly wait (interpreter and
# model start-up, daemons and sockets), so on two cores two at a time nearly halve the module's
# time and slow each run little; more at once only slowed them. Each script's run is its own
# test, and a test waits for its own script only.
SMOKE_AT_ONCE = 2


def _run_smoke(name: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    env.pop("TPSERVE_ADDRESS", None)
    env.pop("TPSERVE_RUNTIME_DIR", None)
    return subprocess.run([sys.executable, str(SCRIPTS_DIR / name), *SCRIPTS[name].args], capture_output=True,
                          text=True, timeout=240, cwd=SCRIPTS_DIR.parent, env=env)


@pytest.fixture(scope="module")
def smoke_runs(request):
    """The selected smoke runs, started together on a pool: name -> Future of its process."""
    selected = [item.callspec.params["name"] for item in request.session.items
                if getattr(item, "function", None) is test_script_runs_at_its_smallest_size]
    pool = ThreadPoolExecutor(SMOKE_AT_ONCE)
    runs = {name: pool.submit(_run_smoke, name) for name in selected}
    yield runs
    pool.shutdown(wait=True, cancel_futures=True)


@pytest.mark.parametrize("name", SMOKE)
def test_script_runs_at_its_smallest_size(name, smoke_runs):
    entry = SCRIPTS[name]
    proc = smoke_runs[name].result()
    output = proc.stdout + proc.stderr
    assert proc.returncode in entry.exit_codes, output[-4000:]
    assert re.search(entry.expect, output), output[-4000:]
