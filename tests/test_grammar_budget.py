"""Grammar budgets (issue 42): nothing a request's grammar asks of the CPU runs on the serving
loop. GBNF conversion, JSON-schema parsing and a trial build run in the grammar process under a
time budget (``grammar_timeout``) and a size budget; a grammar over either, one that crashes
the grammar engine, or one no text satisfies is refused with an error naming its field, and
costs the other requests nothing. Offline engine here; the daemon over HTTP at the end."""
from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from tpserve import LLM, SamplingParams
from tpserve.errors import InvalidFieldError
from tpserve.fronts.http import structured_api, tool_calls
from tpserve.fronts.http.openai_api import OpenAIError
from tpserve.grammar import GrammarCompiler, worker
from tpserve.procs import descendants, pid_alive
from tpserve.sampling import StructuredOutputsParams as SO

BUNDLED = Path(__file__).resolve().parent.parent / "tpserve" / "assets" / "default-model"
PROMPT = "data:"
BUDGET = 4.0  # seconds: the engine's grammar_timeout here (a niced child on a busy machine)


def chain_gbnf(n: int) -> str:
    """The issue's repro: n chained GBNF rules (llguidance converts GBNF in Python, superlinearly)."""
    return ("root ::= r0\n" + "".join(f'r{i} ::= "x{i}" r{i + 1} | "y"\n' for i in range(n))
            + f'r{n} ::= "z"\n')


def chain_lark(n: int) -> str:
    """n chained Lark rules: no conversion, but the grammar builder recurses once per rule (a few
    thousand overflow an 8 MiB thread stack)."""
    return "start: r0\n" + "".join(f'r{i}: "x{i}" r{i + 1} | "y"\n' for i in range(n)) + f'r{n}: "z"\n'


@pytest.fixture(scope="module")
def llm():
    with LLM(str(BUNDLED), dtype="float32", num_kv_blocks=256, block_size=4, grammar_timeout=BUDGET) as llm:
        yield llm


def assert_clean(llm):
    e = llm.engine
    assert not e.families and not e.requests and not e.has_unfinished()
    e.scheduler.check_integrity()


def test_a_grammar_over_the_time_budget_is_refused_while_others_step(llm):
    """20,000 GBNF rules convert for minutes: refused at the budget naming the field, while a
    plain request beside it keeps stepping (the conversion holds no GIL of this process)."""
    e = llm.engine
    e.add_request("plain", PROMPT, SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True))
    e.add_request("big", PROMPT, SamplingParams(max_tokens=8, structured_outputs=SO(grammar=chain_gbnf(20_000))))
    start, last, worst, error, tokens = time.monotonic(), time.monotonic(), 0.0, None, 0
    while e.has_unfinished():
        for out in e.step():
            if out.request_id == "big":
                error = out.error
                refused_after = time.monotonic() - start
            else:
                tokens += len(out.new_token_ids)
                now = time.monotonic()
                worst, last = max(worst, now - last), now
    assert isinstance(error, InvalidFieldError) and error.field == "params.structured_outputs.grammar"
    assert "time budget" in error.reason, error.reason
    assert BUDGET <= refused_after < BUDGET + 30, refused_after
    assert tokens == 400 and worst < BUDGET, worst  # the plain stream never waited for the grammar
    assert_clean(llm)


def test_the_refusal_is_cached_and_a_usable_grammar_still_compiles(llm):
    e = llm.engine
    n = e._grammars.num_compiled
    t = time.monotonic()
    with pytest.raises(InvalidFieldError, match="time budget"):
        llm.generate(PROMPT, SamplingParams(max_tokens=4, structured_outputs=SO(grammar=chain_gbnf(20_000))),
                     use_tqdm=False)
    assert time.monotonic() - t < BUDGET  # the same text fails fast
    out, = llm.generate(PROMPT, SamplingParams(max_tokens=8, structured_outputs=SO(grammar=chain_gbnf(50))),
                        use_tqdm=False)
    assert out.outputs[0].text in ("y", "x0y", "x0x1y") or out.outputs[0].text.startswith("x0")
    assert e._grammars.num_compiled == n + 1
    assert_clean(llm)


def test_a_long_chain_that_overflows_a_thread_stack_compiles(llm):
    """3,000 chained Lark rules overflowed the compiler thread's 8 MiB stack (a segmentation
    fault of the serving process); the trial build and the real one run on larger stacks."""
    compiler = GrammarCompiler(llm.engine.tokenizer, llm.engine.vocab_size, [0], timeout_s=120)
    try:
        template = compiler.compile(SO(grammar=chain_lark(3_000)), "grammar").result(timeout=240)
    finally:
        compiler.shutdown()
    m = template.deep_copy()
    for piece in ("x0", "x1", "y"):
        for tok in llm.engine.tokenizer.encode(piece, add_special_tokens=False):
            assert m.consume_token(tok) and not m.is_error(), piece
    assert m.is_accepting()


def test_a_crash_of_the_grammar_process_is_a_refusal_and_the_next_grammar_compiles(llm):
    e = llm.engine
    llm.generate(PROMPT, SamplingParams(max_tokens=2, structured_outputs=SO(regex="[ab]+")), use_tqdm=False)
    pid = e._grammars.process_pid
    assert pid is not None and pid_alive(pid)
    e.add_request("crash", PROMPT, SamplingParams(max_tokens=4, structured_outputs=SO(grammar=chain_gbnf(3_001))))
    time.sleep(0.3)  # converting
    os.kill(pid, signal.SIGSEGV)
    error = None
    while e.has_unfinished():
        for out in e.step():
            error = out.error
    assert isinstance(error, InvalidFieldError) and error.field == "params.structured_outputs.grammar"
    assert "SIGSEGV" in error.reason, error.reason
    out, = llm.generate(PROMPT, SamplingParams(max_tokens=6, structured_outputs=SO(regex="[ab]{3}")),
                        use_tqdm=False)
    assert len(out.outputs[0].text) == 3 and set(out.outputs[0].text) <= {"a", "b"}
    assert e._grammars.process_pid not in (None, pid)
    assert_clean(llm)


def test_aborting_a_request_stops_its_compilation(llm):
    """The client went away: the grammar process stops converting (killed), and starts again
    for the next grammar."""
    e = llm.engine
    llm.generate(PROMPT, SamplingParams(max_tokens=2, structured_outputs=SO(regex="[cd]+")), use_tqdm=False)
    pid = e._grammars.process_pid
    e.add_request("gone", PROMPT, SamplingParams(max_tokens=4, structured_outputs=SO(grammar=chain_gbnf(4_002))))
    e.step()
    time.sleep(0.2)
    assert e.abort_request("gone")
    deadline = time.monotonic() + 5
    while pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not pid_alive(pid)
    assert not e.has_unfinished()
    out, = llm.generate(PROMPT, SamplingParams(max_tokens=3, structured_outputs=SO(choice=["ok"])), use_tqdm=False)
    assert out.outputs[0].text == "ok"
    assert_clean(llm)


def test_a_continuation_no_text_satisfies_ends_with_error_not_stop(llm):
    """'x' is allowed, nothing after it: the request ends "error" (its text does not match);
    a constraint with no first token at all is refused when compiled."""
    out, = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=8,
                                               structured_outputs=SO(grammar='start: "x" A\nA: /[a&&b]/\n')),
                        use_tqdm=False)
    assert out.outputs[0].finish_reason == "error" and out.outputs[0].text == "x"
    with pytest.raises(InvalidFieldError, match="no text satisfies") as e:
        llm.generate(PROMPT, SamplingParams(max_tokens=4, structured_outputs=SO(regex="[a&&b]")), use_tqdm=False)
    assert e.value.field == "params.structured_outputs.regex"
    assert_clean(llm)


def test_json_schema_text_is_parsed_off_the_loop_and_its_faults_name_the_field(llm):
    deep = '{"a": ' * 3000 + "1" + "}" * 3000
    assert SO(json=deep).json == deep  # not parsed where the request arrives
    for text, why in ((deep, "nested too deeply"), ("{not json}", "not JSON text")):
        with pytest.raises(InvalidFieldError, match=why) as e:
            llm.generate(PROMPT, SamplingParams(max_tokens=4, structured_outputs=SO(json=text)), use_tqdm=False)
        assert e.value.field == "params.structured_outputs.json"
    with pytest.raises(InvalidFieldError, match="nested too deeply"):  # a dict: json.dumps recurses
        nested: dict = {}
        for _ in range(5000):
            nested = {"a": nested}
        SO(json=nested)
    assert_clean(llm)


def test_the_size_budget_of_a_grammar_names_the_field(llm, monkeypatch):
    """The grammar text llguidance gets (GBNF once converted) and its symbol count (llguidance's
    max_grammar_size) are bounded in the grammar process; the budgets travel with each job."""
    monkeypatch.setattr(worker, "MAX_GRAMMAR_SYMBOLS", 100)
    with pytest.raises(InvalidFieldError, match="too big") as e:
        llm.generate(PROMPT, SamplingParams(max_tokens=4, structured_outputs=SO(grammar=chain_lark(60))),
                     use_tqdm=False)
    assert e.value.field == "params.structured_outputs.grammar"
    monkeypatch.setattr(worker, "MAX_GRAMMAR_TEXT_CHARS", 2000)
    with pytest.raises(InvalidFieldError, match="over the size budget of 2000") as e:
        llm.generate(PROMPT, SamplingParams(max_tokens=4, structured_outputs=SO(json={
            "type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(100)}})), use_tqdm=False)
    assert e.value.field == "params.structured_outputs.json"
    assert_clean(llm)


def test_tool_grammars_over_the_size_budget_are_a_400_naming_tools():
    props = {f"p{i}": {"type": "integer"} for i in range(300)}
    tools = [{"type": "function", "function": {"name": f"f{t}", "parameters": {"type": "object", "properties": props}}}
             for t in range(128)]
    plan = tool_calls.parse_tools({"tools": tools, "tool_choice": "required"})
    with pytest.raises(OpenAIError) as e:
        plan.grammar()
    assert e.value.status == 400 and e.value.param == "tools" and "over the limit" in str(e.value.body())
    assert len(json.dumps(tools, separators=(",", ":"))) < 1 << 20  # the body itself fits


def test_the_front_prepares_a_constraint_off_its_event_loop(monkeypatch):
    """A tool grammar or schema of up to a megabyte is written and checked on a thread (within
    the grammar time budget), not on the front's event loop; a plain body stays inline."""
    on_loop = []

    def build(job):
        on_loop.append(threading.current_thread() is threading.main_thread())
    job = SimpleNamespace(chat=False, sampling={}, names={})
    asyncio.run(structured_api.prepare(job, {"structured_outputs": {"regex": "a+"}}, build))
    assert on_loop == [False] and job.sampling["structured_outputs"] == {"regex": "a+"}
    asyncio.run(structured_api.prepare(SimpleNamespace(chat=False, sampling={}, names={}), {"prompt": "x"}, build))
    assert on_loop == [False, True]
    monkeypatch.setattr(structured_api, "DEFAULT_GRAMMAR_TIMEOUT", 0.2)
    with pytest.raises(OpenAIError) as e:
        asyncio.run(structured_api.prepare(SimpleNamespace(chat=False, sampling={}, names={}),
                                           {"structured_outputs": {"regex": "b+"}}, lambda job: time.sleep(1)))
    assert e.value.status == 400 and e.value.param == "structured_outputs" and "time budget" in str(e.value.body())


# ---- the daemon over HTTP ----------------------------------------------------------------------
class GrammarDaemon:
    """`tpserve start --http-port 0` on the bundled model with a 3 s grammar budget."""

    def __init__(self):
        self.rd = tempfile.mkdtemp(prefix="tpg-", dir="/tmp")
        out = subprocess.run([sys.executable, "-m", "tpserve", "start", "--runtime-dir", self.rd,
                              "--num-kv-blocks", "600", "--block-size", "4", "--http-port", "0",
                              "--grammar-timeout", "3", "--startup-timeout", "200"],
                             capture_output=True, text=True, timeout=240)
        if out.returncode != 0:
            shutil.rmtree(self.rd, ignore_errors=True)
        assert out.returncode == 0, out.stderr + out.stdout
        self.address, self.url = out.stdout.split()
        self.pid = int(Path(self.rd, "tpserve.pid").read_text())

    def stop(self):
        out = subprocess.run([sys.executable, "-m", "tpserve", "stop", "--runtime-dir", self.rd, "--timeout", "60"],
                             capture_output=True, text=True, timeout=120)
        shutil.rmtree(self.rd, ignore_errors=True)
        assert out.returncode == 0, out.stderr + out.stdout


@pytest.fixture(scope="module")
def gdaemon():
    d = GrammarDaemon()
    yield d
    tree = [d.pid] + descendants(d.pid)
    d.stop()
    assert not [p for p in tree if pid_alive(p)]  # the grammar process went with the daemon


def complete(daemon, body, timeout=60):
    return httpx.post(daemon.url + "/v1/completions", json={"model": "default-model", **body}, timeout=timeout)


def test_daemon_streams_and_answers_health_while_a_20000_rule_grammar_is_refused(gdaemon):
    """The issue's repro over HTTP: before, the daemon froze (every stream stalled for the
    conversion, /health 503, `tpserve stop` hung); now the grammar gets its 400 at the budget."""
    stop, chunks, health = threading.Event(), [], []

    def stream():
        body = {"model": "default-model", "prompt": "x", "max_tokens": 1000, "ignore_eos": True, "stream": True}
        with httpx.Client(timeout=60) as c:
            while not stop.is_set():
                times = []
                with c.stream("POST", gdaemon.url + "/v1/completions", json=body) as r:
                    for line in r.iter_lines():
                        if line.startswith("data: {"):
                            times.append(time.monotonic())
                        if stop.is_set():
                            break
                chunks.append(times)

    def probe():
        with httpx.Client(timeout=30) as c:
            while not stop.is_set():
                t = time.monotonic()
                status = c.get(gdaemon.url + "/health").status_code
                health.append((time.monotonic() - t, status))
                time.sleep(0.1)

    threads = [threading.Thread(target=stream, daemon=True), threading.Thread(target=probe, daemon=True)]
    for t in threads:
        t.start()
    time.sleep(1.0)  # the stream runs
    t0 = time.monotonic()
    r = complete(gdaemon, {"prompt": PROMPT, "max_tokens": 32,
                           "structured_outputs": {"grammar": chain_gbnf(20_000)}})
    refused_after = time.monotonic() - t0
    time.sleep(0.5)
    stop.set()
    for t in threads:
        t.join(60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "structured_outputs.grammar" and "time budget" in err["message"], err
    assert refused_after < 3 + 20, refused_after
    gaps = [b - a for times in chunks for a, b in zip(times, times[1:])]
    assert len(gaps) > 50 and max(gaps) < 0.5, (len(gaps), max(gaps, default=None))
    assert health and max(h[0] for h in health) < 1.0 and {h[1] for h in health} == {200}, health


def test_daemon_answers_tools_over_the_size_budget_and_unsatisfiable_constraints(gdaemon):
    props = {f"p{i}": {"type": "integer"} for i in range(300)}
    tools = [{"type": "function", "function": {"name": f"f{t}", "parameters": {"type": "object", "properties": props}}}
             for t in range(128)]
    r = httpx.post(gdaemon.url + "/v1/chat/completions", timeout=60, json={
        "model": "default-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
        "tools": tools, "tool_choice": "required"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text
    r = complete(gdaemon, {"prompt": PROMPT, "max_tokens": 8, "structured_outputs": {"regex": "[a&&b]"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "structured_outputs.regex", r.text
    assert "no text satisfies" in r.json()["error"]["message"]
    r = complete(gdaemon, {"prompt": PROMPT, "max_tokens": 8, "temperature": 0,
                           "structured_outputs": {"grammar": 'start: "x" A\nA: /[a&&b]/\n'}})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "error" and choice["text"] == "x", choice
    deep = '{"a": ' * 3000 + "1" + "}" * 3000
    r = complete(gdaemon, {"prompt": PROMPT, "max_tokens": 8, "structured_outputs": {"json": deep}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "structured_outputs.json", r.text
