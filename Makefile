# tpserve: the two commands a newcomer needs.
#   make run   - set everything up, start the daemon on the bundled model, stream a completion, stop
#   make test  - set everything up and run the test suite
PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python
STAMP   = $(VENV)/.installed
# The router peer (smg) in its own virtualenv; tests/test_router_smg.py runs it.
SMG_VENV ?= $(or $(TPSERVE_SMG_VENV),/work/peers/smg)

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

test: $(STAMP) peers
	TPSERVE_SMG_VENV=$(SMG_VENV) $(PY) -m pytest -q

bench: $(STAMP)
	$(PY) scripts/bench_scheduler.py
	$(PY) scripts/bench_channel.py
	$(PY) scripts/bench_throughput.py

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .hypothesis
