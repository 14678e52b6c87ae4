# The README's two commands: `make demo` and `make test` (`make test-fast` while you work).
# Each creates the virtual environment when it is missing and installs what it needs.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PIP := $(BIN)/python -m pip

.PHONY: demo test test-fast lint typecheck docs unit clean

$(BIN)/python:
	$(PYTHON) -c 'import sys; sys.exit("trainperf needs Python >= 3.10, found " + sys.version.split()[0]) if sys.version_info < (3, 10) else None'
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip

# Stamps record which extras are installed; they are redone when pyproject.toml changes.
$(VENV)/.demo-installed: pyproject.toml | $(BIN)/python
	$(PIP) install --quiet -e '.[vision,plot]'
	touch $@

$(VENV)/.test-installed: pyproject.toml | $(BIN)/python
	$(PIP) install --quiet -e '.[vision,dali,safetensors,plot,dev]'
	touch $@ $(VENV)/.demo-installed

demo: $(VENV)/.demo-installed
	$(BIN)/python examples/quickstart.py

lint: $(VENV)/.test-installed
	$(BIN)/ruff check src tests examples benchmarks tools conftest.py
	$(BIN)/ruff format --check src tests examples benchmarks tools conftest.py

typecheck: $(VENV)/.test-installed
	$(BIN)/mypy

docs: $(VENV)/.test-installed
	$(BIN)/mkdocs build --strict --site-dir site

unit: $(VENV)/.test-installed
	$(BIN)/python -m pytest

test: lint typecheck docs unit

# What to run while you work: every test not marked slow (under a minute on 2 cores).
test-fast: $(VENV)/.test-installed
	$(BIN)/python -m pytest -m "not slow" -q

clean:
	rm -rf $(VENV) site build dist src/*.egg-info .pytest_cache .mypy_cache .ruff_cache
