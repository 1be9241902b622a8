# Everything a GPU session runs, in one call (see benchmarks/README.md, "On a GPU"):
#   bash benchmarks/device-run.sh OUTDIR [ROWS] [PROFILED_ROWS]
# installs the carried wheels and tierstore, runs the CUDA tests and the
# short-path tests, then the GPT step of benchmarks/gpu_step.py per row; each
# profiled row's two profiled steps are summarised by benchmarks/gpu_trace.py.
#
#   DRY_RUN=1 PYTHON=.venv/bin/python bash benchmarks/device-run.sh OUTDIR [ROWS] [PROFILED_ROWS]
# runs the same steps on the CPU before GPU minutes are spent on them: no
# install, no nvidia-smi, the same test selections (the CUDA tests skip; the
# short-path selection is collected, not run: make test runs it on the CPU),
# and gpu_step.py at a tiny shape with --device cpu.
set -u
out=${1:?OUTDIR}
rows=${2:-none,kept,budget=1.0,budget=0.84,budget=0.68,budget=0.52,budget=0.37,checkpoint-3,checkpoint-6,checkpoint-9,checkpoint-12}
profiled=${3:-}
dry=${DRY_RUN:-0}
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
shape=(--settle 8 --steps 8)
collect=()
if [ "$dry" = 1 ]; then
    collect=(--collect-only)
    shape=(--device cpu --layers 2 --d 64 --heads 4 --seq 64 --batch 2 --vocab 256
        --warmup 1 --settle 1 --steps 2)
    echo "dry run on the CPU: $py, gpu_step.py ${shape[*]}" | tee "$out/gpu.txt"
else
    source benchmarks/device-setup.sh
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
fi
timeout 200 "$py" -m pytest -q -p no:cacheprovider -m requires_cuda tests 2>&1 | tail -30 | tee "$out/pytest.txt"
timeout 100 "$py" -m pytest -q -p no:cacheprovider ${collect[@]+"${collect[@]}"} tests/autograd/test_fast_path.py tests/planning/test_runner.py tests/autograd/test_recompute.py \
    -k 'cuda or fast or natively or nests or device or graph' 2>&1 | tail -15 | tee -a "$out/pytest.txt"
timeout 420 "$py" benchmarks/gpu_step.py --rows "$rows" "${shape[@]}" --json "$out/gpu-step.json" \
    --profile "$profiled" --trace "$out/trace" >"$out/gpu-step.txt" 2>&1
tail -22 "$out/gpu-step.txt"
if [ -n "$profiled" ]; then
    "$py" benchmarks/gpu_trace.py "$out"/trace-*.json 2>&1 | tee "$out/trace.txt"
    gzip -f "$out"/trace-*.json
fi
