#!/usr/bin/env bash
# Kernel tests on the GPU, then the microbenchmark with the launch-configuration sweep.
# Writes benchmarks/results/kernels_<device>.json. Run from anywhere: bash benchmarks/gpu_kernels_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
python -c "import torch, triton; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name(), 'torch', torch.__version__, 'triton', triton.__version__)"
time python -m pytest tests/kernels -q
python -m benchmarks.kernels --sweep
