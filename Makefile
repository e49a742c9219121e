# The two commands a new user needs (see README.md):
#   make run   - set up, fetch the default model, and serve it (mooncake dev: conductor, prefill,
#                decode and cache processes; the OpenAI API on http://127.0.0.1:8000/v1)
#   make test  - set up and run the whole test suite
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
PROMPT ?= What is the capital of France?
PORT   ?= 8000

.PHONY: setup run test test-all bench clean mooncake-te

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --disable-pip-version-check --upgrade pip
	$(BIN)/python -m pip install -q --disable-pip-version-check -e '.[test,convert]'
	touch $@

setup: $(VENV)/.installed

run: setup
	$(BIN)/mooncake model fetch
	$(BIN)/mooncake dev --port $(PORT) --ask "$(PROMPT)"

# make test: everything but the tests marked slow (long studies, faults and benchmark runs), within 10 minutes
# on 2 cores; make test-all: every test, as .ci/run does.
test: setup mooncake-te
	$(BIN)/python -m pytest -m "not slow"

test-all: setup mooncake-te
	$(BIN)/python -m pytest

bench: setup
	$(BIN)/python scripts/bench_engine.py

clean:
	rm -rf $(VENV) build *.egg-info

# Mooncake's Transfer Engine for the `mooncake` transport. Its wheel's top-level package is also named
# `mooncake`, so it is unpacked into its own directory instead of site-packages (see
# backends/transports/mooncake_te.py). Needs the Debian packages libibverbs1 and ibverbs-providers.
MOONCAKE_TE := mooncake-transfer-engine-non-cuda==0.3.13.post1
# The sha256 of its wheels on PyPI (x86_64; CPython 3.11, 3.12, 3.13): pip installs no other file, and never
# builds one from source.
MOONCAKE_TE_SHA256 := ca9f668a04ffe648b250fda28b97d0a7da149cb110dec5cf3d166a9e68afc940 \
                      892fd0ee77d736fc8d625981c485a43282dbdbc0926b95f05c1cadd8b0debe51 \
                      0f97a95a3af7ac7532affe5badc4128c71d7bff8740118fea9a8bbbbc65dd578
# The engine's library needs libibverbs.so.1: as root with apt-get, `make` installs the two packages;
# elsewhere (or with DEB_INSTALL=no) the `mooncake` transport's tests are skipped, naming the install line.
DEB_PACKAGES := libibverbs1 ibverbs-providers
DEB_INSTALL  ?= auto
$(VENV)/mooncake-te/.installed: $(VENV)/.installed
	@if ! ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1'; then \
	  if [ "$(DEB_INSTALL)" != no ] && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "installing $(DEB_PACKAGES) for Mooncake's Transfer Engine"; \
	    (apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q $(DEB_PACKAGES)) >/dev/null \
	      || echo "note: apt-get could not install $(DEB_PACKAGES); the mooncake transport's tests will be skipped"; \
	  else \
	    echo "note: libibverbs.so.1 is missing, so the mooncake transport's tests will be skipped;" \
	         "to run them: sudo apt-get install $(DEB_PACKAGES)"; \
	  fi; \
	fi
	printf '%s' '$(MOONCAKE_TE)' $(foreach h,$(MOONCAKE_TE_SHA256), ' --hash=sha256:$(h)') > $(VENV)/mooncake-te.txt
	$(BIN)/python -m pip install -q --disable-pip-version-check --no-deps --only-binary=:all: --require-hashes \
	  --target $(VENV)/mooncake-te -r $(VENV)/mooncake-te.txt
	touch $@

mooncake-te: $(VENV)/mooncake-te/.installed
