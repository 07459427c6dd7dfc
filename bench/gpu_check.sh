#!/usr/bin/env bash
# The GPU checks as one prepared run of under 9 minutes, for a machine with a CUDA GPU. In order of
# what they tell, so that a run cut short keeps the most: bench/gpu.py on a model of SmolLM2's shape
# with random weights (parity, one stream, the workload, the kernel census), the CUDA tests (the
# Triton kernels compiled, the decode graphs, the census, the weight owner), the quantized and
# deterministic parts, Llama 3.2 1B's shape, then a deployment of three copies and a second model
# behind the HTTP gateway.
# No model files are needed. Everything goes to $OUT (default ./gpu-out) as it is made:
# versions.txt, gpu_bench.jsonl (the figures), gpu_bench.err, cuda_tests.txt (the whole pytest
# log, failures' tracebacks included).
#
#   PYTHON=python3 bash bench/gpu_check.sh
#
# It needs the project's packages beside torch with CUDA and triton (requirements/lock.txt).
set -u
cd "$(dirname "$0")/.."
out=${OUT:-gpu-out}
mkdir -p "$out"
py=${PYTHON:-python3}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
$py -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__,
'transformers', transformers.__version__, torch.cuda.get_device_name(0))" 2>&1 | tee "$out/versions.txt"
bench() {  # bench() SECONDS ARGS...: one bench/gpu.py run, its JSON lines appended
    local limit=$1
    shift
    timeout "$limit" $py bench/gpu.py --random-weights "$@" 2>>"$out/gpu_bench.err" | tee -a "$out/gpu_bench.jsonl"
}
bench 150 --repeats 2 --parts parity,single_stream,workload,census
# one process, no xdist: the CUDA tests and the Triton kernels' tests (compiled on the GPU there)
timeout 140 $py -m pytest -q -o addopts="" -p no:cacheprovider --tb=short -rfE tests/test_triton_kernels.py \
    tests/test_cuda_runner.py tests/test_census.py tests/test_compiled.py tests/test_scheduler.py \
    tests/test_sampling.py tests/test_weight_owner.py tests/test_int4pack.py tests/test_tile_choice.py \
    -k "cuda or kernel or triton or custom_op or census or tile" \
    >"$out/cuda_tests.txt" 2>&1
tail -12 "$out/cuda_tests.txt"
# the weight-only linears and the batch-invariant kernels against the 16-bit weights (each engine
# times its linears' shapes at load; the first compiles the candidates)
bench 90 --repeats 1 --parts quantized,deterministic
# a bigger shape, Llama 3.2 1B's: one stream in bf16, int8 and int4
bench 50 --model llama-3.2-1b --repeats 1 --parts quantized_stream
# three copies on one GPU sharing one weight owner and a copy of Llama 3.2 1B's shape, behind the
# HTTP gateway: in-process against one copy, one copy against three, each model beside the other
bench 100 --repeats 1 --parts deployment
tail -20 "$out/gpu_bench.err"
