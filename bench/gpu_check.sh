#!/usr/bin/env bash
# The GPU checks as one prepared run of under 8 minutes, for a machine with a CUDA GPU: the CUDA
# tests (the Triton kernels compiled, the decode graphs, the kernel census, the weight owner), then
# bench/gpu.py on models of SmolLM2's and Llama 3.2 1B's shapes with random weights (no model
# files needed). Everything it prints goes
# to $OUT (default ./gpu-out): versions.txt, cuda_tests.txt, gpu_bench.jsonl.
#
#   PYTHON=python3 bash bench/gpu_check.sh
#
# It needs the project's packages beside torch with CUDA and triton (requirements/lock.txt).
set -u
cd "$(dirname "$0")/.."
out=${OUT:-gpu-out}
mkdir -p "$out"
py=${PYTHON:-python3}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
$py -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__,
'transformers', transformers.__version__, torch.cuda.get_device_name(0))" 2>&1 | tee "$out/versions.txt"
# one process, no xdist: the CUDA tests and the Triton kernels' tests (compiled on the GPU there)
timeout 150 $py -m pytest -q -o addopts="" -p no:cacheprovider tests/test_triton_kernels.py tests/test_cuda_runner.py \
    tests/test_census.py tests/test_compiled.py tests/test_scheduler.py tests/test_sampling.py \
    tests/test_weight_owner.py -k "cuda or kernel or triton or custom_op or census" 2>&1 | tail -60 \
    | tee "$out/cuda_tests.txt"
timeout 200 $py bench/gpu.py --random-weights --repeats 2 --parts parity,workload,single_stream,census,deployment \
    2>"$out/gpu_bench.err" | tee "$out/gpu_bench.jsonl"
# the weight-only linears and the batch-invariant kernels against the 16-bit weights
timeout 90 $py bench/gpu.py --random-weights --repeats 1 --parts quantized,deterministic \
    2>>"$out/gpu_bench.err" | tee -a "$out/gpu_bench.jsonl"
# a bigger shape, Llama 3.2 1B's: one stream in bf16, int8 and int4
timeout 60 $py bench/gpu.py --random-weights --model llama-3.2-1b --repeats 1 --parts quantized_stream \
    2>>"$out/gpu_bench.err" | tee -a "$out/gpu_bench.jsonl"
tail -20 "$out/gpu_bench.err"
