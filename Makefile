# Two commands matter: `make demo` and `make test`. Each creates .venv from this repository's own files.
#
# torch: TORCH_SPEC (default torch==2.13.0, a CPU wheel where one is available) is installed first, so
# the project's `torch>=2.4` requirement installs nothing more. On a GPU host that already has the torch
# it wants, `TORCH_SPEC=system make ...` builds the venv on top of the system site-packages instead.

PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
DEMO_ARGS ?=
PYTEST_ARGS ?=

BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint check clean

demo: $(STAMP)
	$(BIN)/deadpool demo $(DEMO_ARGS)

# -n 2: the tests that mostly wait run beside the others, which run one at a time (tests/conftest.py).
# The 15 slowest tests are listed at the end, and why any test was skipped (-rs); every test has a time
# limit (pyproject.toml).
test: $(STAMP)
	$(BIN)/python -m pytest -n 2 -rs --durations=15 $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy libs services examples bench tests

check: lint test

$(STAMP): pyproject.toml Makefile
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "Python 3.11 or newer is needed (set PYTHON=...)")'
ifeq ($(TORCH_SPEC),system)
	$(PYTHON) -m venv --system-site-packages $(VENV)
else
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet "$(TORCH_SPEC)"
endif
	$(BIN)/python -m pip install --quiet -e ".[trainer,plots,dev]"
	@touch $(STAMP)

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
