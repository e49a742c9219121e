# The two commands a new user needs (see README.md):
#   make run   - set up, fetch the default model, and run mooncake on it
#   make test  - set up and run the whole test suite
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
PROMPT ?= What is the capital of France?

.PHONY: setup run test bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --disable-pip-version-check --upgrade pip
	$(BIN)/python -m pip install -q --disable-pip-version-check -e '.[test,convert]'
	touch $@

setup: $(VENV)/.installed

run: setup
	$(BIN)/mooncake model fetch
	$(BIN)/mooncake generate --chat --prompt "$(PROMPT)"

test: setup
	$(BIN)/python -m pytest

bench: setup
	$(BIN)/python scripts/bench_engine.py

clean:
	rm -rf $(VENV) build *.egg-info
