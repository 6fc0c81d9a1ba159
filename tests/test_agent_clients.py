"""Real agent clients against a daemon: Codex CLI (OpenAI Responses API) and Claude Code
(Anthropic Messages API), installed from npm by scripts/peer_agents.sh into .peers/agents
(`make test-peers` runs it), each pointed at tpserve as docs/agents.md says, unchanged.

Their first request is large (Codex ~14k tokens, Claude Code ~28k with this tokenizer: their
system prompts and tool schemas), so the daemon serves a tiny model with a 64k context: one
layer, the bundled model's tokenizer and chat template (which renders tools). Its weights are
set so that the next token depends only on the current one (the layer adds nothing, the final
norm reads two features of the token's embedding): uniform over the vocabulary, except that the
end token (id 0, generation_config's eos_token_id) can follow only a visible token (one whose
text is not blank), and then about one time in a hundred. So an answer is about a hundred tokens,
never cut by the clients' large output limits (Claude Code's max_tokens 32000 is clamped to the
context's rest), and never empty or blank: the prompt ends in a blank token (the template's
newline), and the end needs a visible token before it (its odds anywhere else: e^-30 of a token's).
Each client must exit 0, print an answer, and show no protocol error; a second turn (the
conversation resumed, resent whole) must answer too, its shared history from the prefix cache."""
from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from model_factory import make_tiny_model
from test_http import BUNDLED, run_cli
from tpserve.client.addresses import read_ready
from tpserve.procs import descendants

ROOT = Path(__file__).resolve().parents[1]
AGENTS = Path(os.environ.get("TPSERVE_AGENTS_DIR") or ROOT / ".peers" / "agents") / "node_modules" / ".bin"
CODEX, CLAUDE = AGENTS / "codex", AGENTS / "claude"
# Drives npm-installed clients: in the marked set that `make test-peers` and CI run (setup.cfg).
pytestmark = pytest.mark.peers

MODEL = "tiny-agent"
API_KEY = "sk-tpserve-agents"
CONTEXT = 65536
BLOCK_SIZE = 16
VOCAB = 4096
EOS_ID = 0              # the tokenizer's <|endoftext|>
ANSWER_TOKENS = 100     # the end's odds after a visible token: 1 in this many
# What the clients print when the protocol fails them (their own words, 0.171 / 2.1).
PROTOCOL_ERRORS = re.compile(r"ERROR|unexpected status|stream (disconnected|closed)|API Error|"
                             r"issue with the selected model|Bad Request|invalid_request|not_found|"
                             r"Unexpected event|Failed to parse|error decoding", re.I)


def visible_tokens(tokenizer) -> list[int]:
    """The ids whose text has a character that is not blank (a whole UTF-8 character), the end
    token aside."""
    texts = [tokenizer.decode([i]) for i in range(VOCAB)]
    return [i for i, t in enumerate(texts) if i != EOS_ID and t.strip() and "\ufffd" not in t]


def build_model(root: Path) -> Path:
    """The tiny long-context model (see the module): one small layer that adds nothing, the
    bundled tokenizer and chat template; the next token uniform, the end only after a visible
    token (its embedding's feature 1; every other token has feature 0)."""
    from safetensors.torch import load_file, save_file

    from tpserve.tokenizer import load_tokenizer
    hidden = 64
    path = make_tiny_model(root, "qwen3", vocab_size=VOCAB, hidden_size=hidden, num_hidden_layers=1,
                           num_attention_heads=2, num_key_value_heads=1, head_dim=32, intermediate_size=128,
                           max_position_embeddings=CONTEXT, tie_word_embeddings=False,
                           generation_config={"eos_token_id": [EOS_ID]})
    for name in ("tokenizer.json", "special_tokens_map.json"):
        shutil.copy(BUNDLED / name, path / name)
    config = json.loads((BUNDLED / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "model_max_length": CONTEXT}))
    visible = visible_tokens(load_tokenizer(path))
    assert len(visible) > VOCAB // 2
    weights = load_file(path / "model.safetensors")
    for name, w in weights.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            w.zero_()  # the layer adds nothing: the last hidden state is the token's embedding
    embed, norm, head = (weights[k] for k in ("model.embed_tokens.weight", "model.norm.weight",
                                              "lm_head.weight"))
    embed.zero_()
    embed[:, 0] = 1.0           # feature 0: blank (or the end, or part of a character)
    embed[visible, 0] = 0.0
    embed[visible, 1] = 1.0     # feature 1: visible
    norm.zero_()
    norm[:2] = hidden ** -0.5   # the normed one-hot feature back to 1
    head.zero_()                # every other token's logit 0
    head[EOS_ID, 0] = -30.0
    head[EOS_ID, 1] = math.log((VOCAB - 1) / (ANSWER_TOKENS - 1))  # P(end | visible) = 1 / ANSWER_TOKENS
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return path


class AgentDaemon:
    """A daemon on the tiny model with its HTTP front behind an API key."""

    def __init__(self, model: Path, rd: Path):
        self.rd = rd
        env = dict(os.environ, TPSERVE_API_KEY=API_KEY)
        out = run_cli("start", "--runtime-dir", rd, "--model", model, "--served-model-name", MODEL,
                      "--max-model-len", CONTEXT, "--num-kv-blocks", CONTEXT // BLOCK_SIZE + 64,
                      "--block-size", BLOCK_SIZE, "--http-port", 0, "--startup-timeout", 300,
                      env=env, timeout=400)
        assert out.returncode == 0, out.stderr + out.stdout
        self.address, self.url = out.stdout.split()
        assert read_ready(rd)["http"] == self.url
        self.pid = int((rd / "tpserve.pid").read_text())
        self.tree = [self.pid] + descendants(self.pid)

    def metric(self, name: str) -> float:
        """A counter of /metrics (``tpserve:prompt_tokens_total``, ...)."""
        import httpx
        text = httpx.get(self.url + "/metrics", timeout=30).text
        return sum(float(line.split()[-1]) for line in text.splitlines()
                   if line and line.split("{")[0].split()[0] == name)

    def stop(self):
        out = run_cli("stop", "--runtime-dir", self.rd, "--timeout", 60)
        assert out.returncode == 0, out.stderr + out.stdout


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    for client in (CODEX, CLAUDE):
        assert client.exists(), f"no {client.name} at {client}: run scripts/peer_agents.sh " \
                                "(make test-peers does)"
    model = build_model(tmp_path_factory.mktemp("models"))
    d = AgentDaemon(model, tmp_path_factory.mktemp("rd"))
    yield d
    d.stop()


def client_env(home: Path, **extra) -> dict:
    """A clean environment: its own HOME (no user configuration is read), nothing inherited that
    would point a client elsewhere."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OPENAI_", "ANTHROPIC_", "CODEX_", "CLAUDE_", "TPSERVE_"))}
    home.mkdir(parents=True, exist_ok=True)
    return {**env, "HOME": str(home), "NO_COLOR": "1", **extra}


def codex_config(url: str) -> str:
    """$CODEX_HOME/config.toml: tpserve as a custom model provider (docs/agents.md)."""
    return (f'model = "{MODEL}"\n'
            'model_provider = "tpserve"\n\n'
            '[model_providers.tpserve]\n'
            'name = "tpserve"\n'
            f'base_url = "{url}/v1"\n'
            'env_key = "TPSERVE_API_KEY"\n'
            'wire_api = "responses"\n'
            'request_max_retries = 0\n'   # an error status is reported at once, not retried 5 times
            'stream_max_retries = 0\n')


def run(cmd: list, env: dict, cwd: Path, timeout: float = 400) -> tuple[int, str, str]:
    proc = subprocess.run([str(c) for c in cmd], env=env, cwd=cwd, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=timeout)
    return proc.returncode, proc.stdout, proc.stderr


def codex_turn(env: dict, work: Path, answer: Path, *args) -> str:
    """One ``codex exec`` turn: exit 0, its answer (``-o``) printed, no error; the answer."""
    rc, out, err = run([CODEX, "exec", "--skip-git-repo-check", "-s", "read-only", "-o", answer, *args],
                       env, work)
    transcript = out + err
    assert rc == 0, transcript[-6000:]
    assert answer.exists() and answer.read_text().strip(), transcript[-6000:]
    said = answer.read_text().strip()
    assert said in out  # the answer is what codex exec prints
    # the model's random words aside (they may spell "error"), nothing went wrong
    assert not PROTOCOL_ERRORS.search(transcript.replace(said, "")), transcript[-6000:]
    return said


def test_codex_exec_answers_through_the_responses_api(daemon, tmp_path):
    home, work = tmp_path / "home", tmp_path / "work"
    codex_home = home / ".codex"
    codex_home.mkdir(parents=True)
    work.mkdir()
    (codex_home / "config.toml").write_text(codex_config(daemon.url))
    env = client_env(home, CODEX_HOME=str(codex_home), TPSERVE_API_KEY=API_KEY)
    prompts = daemon.metric("tpserve:prompt_tokens_total")
    codex_turn(env, work, tmp_path / "answer1.txt", "say hi")
    assert daemon.metric("tpserve:prompt_tokens_total") - prompts > 10000  # its whole system prompt and tools
    hits = daemon.metric("tpserve:prefix_cache_hits_total")
    codex_turn(env, work, tmp_path / "answer2.txt", "resume", "--last", "and again")
    assert daemon.metric("tpserve:prefix_cache_hits_total") - hits > 10000  # the first turn, from the cache


def test_claude_code_answers_through_the_messages_api(daemon, tmp_path):
    home, work = tmp_path / "home", tmp_path / "work"
    work.mkdir()
    env = client_env(home, ANTHROPIC_BASE_URL=daemon.url, ANTHROPIC_API_KEY=API_KEY,
                     CLAUDE_CONFIG_DIR=str(home / ".claude"), DISABLE_TELEMETRY="1", DISABLE_AUTOUPDATER="1",
                     DISABLE_ERROR_REPORTING="1", CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1")
    before = daemon.metric("tpserve:prompt_tokens_total")
    rc, out, err = run([CLAUDE, "-p", "say hi", "--model", MODEL], env, work)  # as a user runs it
    assert rc == 0 and out.strip(), (out + err)[-6000:]
    assert not out.startswith("API Error") and not PROTOCOL_ERRORS.search(err), (out + err)[-6000:]
    assert daemon.metric("tpserve:prompt_tokens_total") - before > 20000
    # the conversation continued: its result and usage as JSON
    rc, out, err = run([CLAUDE, "-c", "-p", "and again", "--model", MODEL, "--output-format", "json"],
                       env, work)
    assert rc == 0, (out + err)[-6000:]
    result = json.loads(out.strip().splitlines()[-1])
    assert result["type"] == "result" and result["is_error"] is False, result
    assert result["subtype"] == "success" and result["result"].strip(), result
    assert not PROTOCOL_ERRORS.search(err), err[-6000:]
    assert result["usage"]["cache_read_input_tokens"] > 20000, result["usage"]  # the first turn, cached
