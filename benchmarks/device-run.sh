# Everything a GPU session runs, in one call (see benchmarks/README.md, "On a GPU"):
#   bash benchmarks/device-run.sh OUTDIR [ROWS]
# installs the carried wheels and tierstore, runs the CUDA tests and the
# short-path tests, then the GPT step of benchmarks/gpu_step.py per row.
set -u
out=${1:?OUTDIR}
rows=${2:-none,kept,budget=1.0,budget=0.84,budget=0.68,budget=0.52,budget=0.37,checkpoint-3,checkpoint-6,checkpoint-9,checkpoint-12}
export PYTHONUNBUFFERED=1
source benchmarks/device-setup.sh
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py tests/test_fast_path.py tests/test_plans.py \
    2>&1 | tail -40 | tee "$out/pytest.txt"
timeout 400 python3 benchmarks/gpu_step.py --rows "$rows" --settle 8 --steps 8 --json "$out/gpu-step.json" \
    2>&1 | tee "$out/gpu-step.txt"
