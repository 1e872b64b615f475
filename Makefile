# Two entry points for a fresh clone: `make demo` (the main job) and `make test` (the test suite).
# Each creates .venv when it is missing.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: demo test test-fast lint clean

$(BIN)/gptlab: pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[dev]'
	touch $@

demo: $(BIN)/gptlab
	$(BIN)/gptlab lab

lint: $(BIN)/gptlab
	$(BIN)/ruff check src tests

test: lint
	$(BIN)/pytest

test-fast: lint
	$(BIN)/pytest -m "not slow"

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache .ruff_cache
