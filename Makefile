VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: run test reproduce setup
run: $(VENV)/.installed      ## set up, then one fine-tune on the defaults (SmolLM2-135M, NF4, BBC News)
	$(PY) -m qft

test: $(VENV)/.installed     ## set up, then the test suite
	$(PY) -m pytest -q -n auto --maxprocesses 4 --durations=15 -m "not reproduce"

reproduce: $(VENV)/.installed  ## set up, then the study reproductions (size and seed checks, analyses re-run over committed records) and slow simulations
	$(PY) -m pytest -q -n auto --maxprocesses 4 -m reproduce -rA

setup: $(VENV)/.installed
$(VENV)/.installed: pyproject.toml scripts/setup.sh
	bash scripts/setup.sh $(VENV)
