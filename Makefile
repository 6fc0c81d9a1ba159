# tpserve: the two commands a newcomer needs.
#   make run   - set everything up, start the daemon on the bundled model, stream a completion, stop
#   make test  - set everything up and run the test suite
PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python
STAMP   = $(VENV)/.installed
# The router peers (smg, vllm-router) in their own virtualenvs; tests/test_router_*.py run them.
SMG_VENV ?= $(or $(TPSERVE_SMG_VENV),/work/peers/smg)
VLLM_ROUTER_VENV ?= $(or $(TPSERVE_VLLM_ROUTER_VENV),/work/peers/vllm-router)

.PHONY: run test install bench clean peers

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

test: $(STAMP) peers
	TPSERVE_SMG_VENV=$(SMG_VENV) TPSERVE_VLLM_ROUTER_VENV=$(VLLM_ROUTER_VENV) $(PY) -m pytest -q

bench: $(STAMP)
	$(PY) scripts/bench_scheduler.py
	$(PY) scripts/bench_channel.py
	$(PY) scripts/bench_throughput.py

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .hypothesis
