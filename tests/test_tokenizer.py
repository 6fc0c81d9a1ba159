"""The torch-free tokenizer loader: the same ids as transformers.AutoTokenizer, and no torch."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from model_factory import make_tiny_model, tiny_models_root  # noqa: F401
from test_daemon import FakeEngine, ServerThread
import tpserve
from tpserve.tokenizer import load_tokenizer, tokenizer_class

DEFAULT_MODEL = str(Path(tpserve.__file__).parent / "assets" / "default-model")
TEXTS = ["Hello world! Tensor parallel serving.", "  leading spaces\tand tabs\n\nnew lines",
         "ünïcödé — and emoji 🙂 and 中文", "def f(x):\n    return x * 2  # code", "<|endoftext|> special"]


def _same_as_auto(path) -> None:
    ours, auto = load_tokenizer(path), AutoTokenizer.from_pretrained(str(path))
    for text in TEXTS:
        ids = auto.encode(text, add_special_tokens=False)
        assert ours.encode(text, add_special_tokens=False) == ids, text
        assert ours.decode(ids, skip_special_tokens=True) == auto.decode(ids, skip_special_tokens=True)
    if auto.chat_template:
        messages = [{"role": "user", "content": TEXTS[0]}]
        assert ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
            auto.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def test_bundled_model_tokenizes_as_auto_tokenizer_does():
    _same_as_auto(DEFAULT_MODEL)


@pytest.mark.parametrize("arch", ["qwen3", "qwen2", "llama"])
def test_test_models_tokenize_as_auto_tokenizer_does(tiny_models_root, arch):  # noqa: F811
    _same_as_auto(make_tiny_model(tiny_models_root, arch=arch))


@pytest.mark.parametrize("declared,expected", [("Qwen2Tokenizer", "Qwen2Tokenizer"),
                                               ("LlamaTokenizerFast", "TokenizersBackend"),
                                               ("NoSuchTokenizer", "TokenizersBackend")])
def test_the_declared_class_is_loaded(tmp_path, declared, expected):
    """A declared class is used as declared, except LlamaTokenizer over a byte-level
    tokenizer.json and unknown names, which load tokenizer.json generically."""
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(f"{DEFAULT_MODEL}/{f}", tmp_path / f)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": declared}))
    assert tokenizer_class(tmp_path).__name__ == expected
    if declared != "NoSuchTokenizer":  # AutoTokenizer refuses an unknown class
        _same_as_auto(tmp_path)


def test_a_directory_without_tokenizer_files_has_none(tmp_path):
    assert load_tokenizer(tmp_path) is None


def test_the_http_front_imports_no_torch():
    """The front's process loads its app and tokenizer, tokenizes and templates, without torch."""
    code = textwrap.dedent(f"""
        import asyncio, sys
        import tpserve.fronts.http.front
        from tpserve.fronts.http.app import Front, create_app
        front = Front("ipc:///nonexistent/s.sock", {DEFAULT_MODEL!r}, "m", 1024)
        create_app(front)
        ids = asyncio.run(front.chat_prompt([{{"role": "user", "content": "hi"}}]))
        assert ids and front.token_text(ids[0])
        assert "torch" not in sys.modules, "torch was imported"
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


class _OnDisk(FakeEngine):
    """A daemon's engine whose tokenizer is the bundled model's (its long texts go to the
    daemon's tokenizer process; a short one is tokenized in the serving thread)."""

    def __init__(self):
        super().__init__(vocab=10**6)
        self._tokenizer = load_tokenizer(DEFAULT_MODEL)

    def tokenizer_path(self):
        return DEFAULT_MODEL

    def tokenize(self, prompt, add_special_tokens=False):
        return self._tokenizer.encode(prompt, add_special_tokens=add_special_tokens)


def test_the_http_front_has_the_daemon_tokenize_long_texts():
    """A long text is tokenized by the daemon's tokenizer process (whose core the engine lends
    meanwhile), with the ids the front's own tokenizer gives; a short one in the front."""
    import asyncio

    from tpserve.fronts.http.app import LONG_PROMPT_CHARS, Front
    engine = _OnDisk()
    with ServerThread(engine) as s:
        front = Front(s.address, DEFAULT_MODEL, "m", 1024)
        in_process = front.tokenizer.encode
        seen = []
        front.tokenizer.encode = lambda text, **kw: seen.append(len(text)) or in_process(text, **kw)
        long_text = " ".join(f"token{i % 89} text" for i in range(LONG_PROMPT_CHARS // 8))
        short_text = "a short prompt"

        async def all_three():
            try:
                return (await front.encode(long_text), await front.encode(short_text),
                        await front.encode(long_text, add_special_tokens=True))  # a completion prompt's default
            finally:
                await front.close()
        ids_long, ids_short, ids_special = asyncio.run(all_three())
        assert ids_long == in_process(long_text, add_special_tokens=False)
        assert ids_short == in_process(short_text, add_special_tokens=False)
        assert ids_special == in_process(long_text, add_special_tokens=True)
        assert seen == [len(short_text)]  # the long ones never ran in the front
        # lent while each long text (and the tokenizer's start) was tokenized, taken back after
        lent = engine.lent
        assert s.server._tokenizer_process.pid is not None and lent.count(1) >= 2
        assert lent == [1, 0] * (len(lent) // 2)
        assert s.stop() == 0


async def _long_text_held(front, engine):
    """The front's encode of a long text (a task), once the daemon's tokenizer holds it."""
    import asyncio

    from tpserve.fronts.http.app import LONG_PROMPT_CHARS
    wait = asyncio.ensure_future(front.encode("x " * LONG_PROMPT_CHARS + engine.hold_marker))
    while not engine.tokenize_started.is_set():
        await asyncio.sleep(0.01)
    return wait


def test_the_http_front_ends_a_long_texts_wait_when_its_upstream_is_lost():
    import asyncio

    from tpserve.fronts.http import openai_api as O
    from tpserve.fronts.http.app import Front
    from tpserve.fronts.upstream import UpstreamLost
    engine = FakeEngine()
    with ServerThread(engine) as s:
        front = Front(s.address, DEFAULT_MODEL, "m", 1024)

        async def lost():
            try:
                wait = await _long_text_held(front, engine)
                assert front.in_flight() == 1
                front.fail_requests(UpstreamLost("the daemon stopped answering"), asyncio.get_running_loop().time())
                with pytest.raises(O.OpenAIError) as e:
                    await asyncio.wait_for(wait, 30)
                return e.value, front.in_flight()
            finally:
                engine.release_tokenize.set()
                await front.close()
        error, left = asyncio.run(lost())
        assert (error.status, error.code, left) == (503, "upstream_lost", 0)
        assert s.stop() == 0


def test_the_tokenizer_process_is_restarted_after_dying_and_refuses_after_close():
    import os
    import signal

    from tpserve.procs import pid_alive
    from tpserve.tokenizer import TokenizerProcess, TokenizerProcessError
    in_process = load_tokenizer(DEFAULT_MODEL)
    proc = TokenizerProcess(DEFAULT_MODEL)
    try:
        assert proc.encode(TEXTS[2]) == in_process.encode(TEXTS[2], add_special_tokens=False)
        first = proc.pid
        os.kill(first, signal.SIGKILL)
        with pytest.raises(TokenizerProcessError, match="exited"):
            proc.encode(TEXTS[0])
        assert proc.encode(TEXTS[0]) == in_process.encode(TEXTS[0], add_special_tokens=False)
        second = proc.pid
        assert second != first and not pid_alive(first)
    finally:
        proc.close()
    assert not pid_alive(second)
    with pytest.raises(TokenizerProcessError, match="closed"):
        proc.encode("x")


def _long_text(chars: int) -> str:
    return " ".join(f"token{i % 89} text{i % 13}," for i in range(chars // 16))[:chars]


def _child_state(pid: int) -> str:
    """The process's state letter from /proc (T: stopped; "" once it is gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def test_the_tokenizer_process_answers_whole_though_stopped_and_continued():
    """A stop signal cuts a large pipe write short (SIGSTOP/SIGCONT: the duty cycle, an
    operator, a debugger); the child's reply still arrives whole, and the next one too."""
    import os
    import signal
    import threading
    import time

    from tpserve.tokenizer import TokenizerProcess
    text = _long_text(400_000)
    expected = load_tokenizer(DEFAULT_MODEL).encode(text, add_special_tokens=False)
    proc = TokenizerProcess(DEFAULT_MODEL)
    got, done = [], threading.Event()

    def encode_all():
        try:
            for _ in range(3):
                got.append(proc.encode(text) == expected)
        finally:
            done.set()
    try:
        proc.encode("x")
        child = proc.pid
        worker = threading.Thread(target=encode_all, daemon=True)
        worker.start()
        deadline = time.monotonic() + 60  # three encodes take a few seconds
        while not done.is_set() and time.monotonic() < deadline:
            os.kill(child, signal.SIGSTOP)
            done.wait(0.0006)
            os.kill(child, signal.SIGCONT)
            done.wait(0.0014)
        os.kill(child, signal.SIGCONT)
        worker.join(30)
        assert got == [True, True, True]
    finally:
        proc.close()  # a reply that never came: its encode fails, and the worker ends


def test_a_cpu_share_runs_the_child_on_a_duty_cycle_and_never_leaves_it_stopped():
    import threading

    from tpserve.tokenizer import TokenizerProcess
    text = _long_text(300_000)
    expected = load_tokenizer(DEFAULT_MODEL).encode(text, add_special_tokens=False)
    proc = TokenizerProcess(DEFAULT_MODEL)
    try:
        proc.encode("x")
        child = proc.pid
        for share in (0.5, 1.0):
            proc.cpu_share = share
            states, done = set(), threading.Event()

            def sample():
                while not done.is_set():
                    states.add(_child_state(child))
                    done.wait(0.001)
            sampler = threading.Thread(target=sample)
            sampler.start()
            try:
                assert proc.encode(text) == expected
            finally:
                done.set()
                sampler.join()
            assert ("T" in states) == (share < 1.0), (share, states)
            assert _child_state(child) in ("S", "R")  # running or waiting for the next text
    finally:
        proc.close()


def test_a_stopped_tokenizer_process_dies_with_its_parent():
    """Its parent may hold it stopped; however the parent dies, the child does not stay behind."""
    import os
    import signal

    from tpserve.procs import pid_alive, wait_gone
    code = textwrap.dedent(f"""
        import os, signal, sys, time
        from tpserve.tokenizer import TokenizerProcess
        proc = TokenizerProcess({DEFAULT_MODEL!r})
        proc.encode("x")
        os.kill(proc.pid, signal.SIGSTOP)
        os.waitpid(proc.pid, os.WUNTRACED)  # returns once it is stopped
        print(proc.pid, flush=True)
        time.sleep(600)
    """)
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        child = int(parent.stdout.readline())
        assert _child_state(child) == "T"
        parent.kill()
        parent.wait()
        assert wait_gone([child], 30), f"the tokenizer process {child} outlived its parent"
    finally:
        if parent.poll() is None:
            parent.kill()
    assert not pid_alive(child)


def test_the_daemon_holds_its_tokenizer_to_a_share_of_a_core_while_others_run():
    """While another request runs, the daemon's tokenizer process takes CONTENDED_CPU_SHARE of
    its core; once the long prompt is tokenized it has a whole core again."""
    import time

    from tpserve.client import protocol as P
    from tpserve.server.tokenizing import CONTENDED_CPU_SHARE
    from tpserve.tokenizer import TokenizerProcess
    from test_daemon import Raw, gen

    class Busy(_OnDisk):
        def __init__(self):
            super().__init__()
            self.step_delay = 0.005
    engine = Busy()
    seen = []

    def reply_to(r, rid):
        while True:
            m = r.recv(60)
            assert m is not None, f"no reply to {rid}"
            if m.id == rid:
                return m
    original = TokenizerProcess._await_reply

    def watched(self, proc):
        deadline = time.monotonic() + 30
        while self.cpu_share == 1.0 and time.monotonic() < deadline:  # the loop's next turn sets it
            time.sleep(0.005)
        seen.append(self.cpu_share)
        return original(self, proc)
    TokenizerProcess._await_reply = watched
    try:
        with ServerThread(engine) as s:
            r = Raw(s.address)
            try:
                r.send_msg(gen("running", [5, 6, 7], max_tokens=100_000))
                assert r.recv().id == "running"  # its first delta: it runs
                r.send_msg(P.TokenizeRequest("long", _long_text(200_000)))
                reply = reply_to(r, "long")
                assert list(reply.token_ids) == engine.tokenize(_long_text(200_000))
                assert seen[-1] == CONTENDED_CPU_SHARE < 1.0
                r.send_msg(P.PingRequest(id="p"))  # a turn after it: the share is whole again
                reply_to(r, "p")
                assert s.server._tokenizer_process.cpu_share == 1.0
            finally:
                r.close()
            assert s.stop() == 0
    finally:
        TokenizerProcess._await_reply = original


def test_the_tokenizer_process_yields_the_cpu_to_other_sessions_too():
    """Under autogroup scheduling a nice value only ranks a process within its session, and the
    HTTP front runs in a session of its own: the child takes a session of its own and lowers
    that group's share, so that it yields to the engine whatever session its parent is in."""
    import os
    from pathlib import Path

    from tpserve.tokenizer import TokenizerProcess
    proc = TokenizerProcess(DEFAULT_MODEL, niceness=7)
    try:
        proc.encode("x")
        child = proc.pid
        assert os.getsid(child) == child != os.getsid(0)
        assert os.getpriority(os.PRIO_PROCESS, child) == os.getpriority(os.PRIO_PROCESS, 0) + 7
        group = Path(f"/proc/{child}/autogroup")
        if Path("/proc/self/autogroup").exists():  # kernels built with autogroup scheduling
            theirs = group.read_text().split()  # "/autogroup-<id> nice <n>"
            assert theirs[-1] == "7"
            # a process still in the root group (never in a session of its own) reads it empty
            ours = Path("/proc/self/autogroup").read_text().split()
            assert theirs[0].startswith("/autogroup-") and theirs[:1] != ours[:1]
    finally:
        proc.close()


def test_a_short_prompt_is_not_queued_behind_a_long_one_in_the_http_front():
    """While the daemon tokenizes a long prompt (seconds), the front tokenizes another
    request's short prompt."""
    import asyncio

    from tpserve.fronts.http.app import LONG_PROMPT_CHARS, Front
    engine = FakeEngine()
    with ServerThread(engine) as s:
        front = Front(s.address, DEFAULT_MODEL, "m", 1024)

        async def both():
            try:
                long = await _long_text_held(front, engine)
                short = await asyncio.wait_for(front.encode("a short prompt"), 30)  # hangs if queued behind
                assert not long.done()
                engine.release_tokenize.set()
                return short, await long
            finally:
                engine.release_tokenize.set()
                await front.close()
        short, long = asyncio.run(both())
        assert short == front.tokenizer.encode("a short prompt", add_special_tokens=False)
        assert long == engine.tokenize("x " * LONG_PROMPT_CHARS + engine.hold_marker)
        assert s.stop() == 0
