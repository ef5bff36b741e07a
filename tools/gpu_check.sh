#!/usr/bin/env bash
# The whole CUDA path in one command, for whoever holds a GPU:
#   bash tools/gpu_check.sh [RESULTS_FILE]
# runs the GPU tier (tests/gpu and tests/test_torch_compat.py: attention and ring kernels vs
# references, the private torch APIs, bf16 vs float32, compile parity, the memory model vs
# the allocator, flash-attn when installed) and the GPU benchmark (python -m benchmarks.bench
# train --device cuda: megapipe eager and compiled vs transformers, tokens/s and MFU for the
# 124M, 350M and 1.3B presets in bf16), and writes
# everything, with the machine and the figures the tests print, to one results file
# (default gpu_check_<host>_<UTC time>.txt). Exit status: non-zero if the tests or the
# benchmark failed. PYTHON picks the interpreter (default .venv/bin/python).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
OUT=${1:-gpu_check_$(hostname -s)_$(date -u +%Y%m%dT%H%M%SZ).txt}
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=disabled TOKENIZERS_PARALLELISM=false

if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_check: no CUDA device visible to $PY" >&2
    exit 2
fi
# an uninstalled checkout (a bare device python): megapipe.models is the models/ folder only once
# installed (pyproject's package-dir), so install it in place, offline and without dependencies
"$PY" -c "import megapipe.models" 2>/dev/null ||
    "$PY" -m pip install -q --no-deps --no-build-isolation --no-index -e . ||
    { echo "gpu_check: cannot install megapipe with $PY" >&2; exit 2; }
LOG=$(mktemp)
BENCH_JSON=$(mktemp --suffix=.json)
trap 'rm -f "$LOG" "$BENCH_JSON"' EXIT

{
    echo "# megapipe GPU check, $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "commit: $(git rev-parse HEAD 2>/dev/null || echo unknown)$(git diff --quiet 2>/dev/null || echo ' (dirty)')"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null
    "$PY" - <<'EOF'
import importlib.util, torch, transformers
fa = importlib.util.find_spec("flash_attn") is not None
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), transformers "
      f"{transformers.__version__}, flash-attn {'installed' if fa else 'not installed'}, "
      f"device {torch.cuda.get_device_name()}")
EOF
} > "$OUT"

echo -e "\n## tests/gpu" >> "$OUT"
# the private torch APIs (megapipe/_torch_compat.py) on this torch, CUDA flash ops included
"$PY" -m pytest -q -rA -s tests/gpu tests/test_torch_compat.py -p no:cacheprovider > "$LOG" 2>&1
TESTS=$?
grep -v "^GPU-FIGURE" "$LOG" | tail -n 60 >> "$OUT"
echo -e "\n## figures (tests/gpu)" >> "$OUT"
grep -o "GPU-FIGURE.*" "$LOG" >> "$OUT"
echo "tests exit status: $TESTS" >> "$OUT"

echo -e "\n## benchmark: python -m benchmarks.bench train --device cuda" >> "$OUT"
"$PY" -m benchmarks.bench train --device cuda --json "$BENCH_JSON" > "$LOG" 2>&1
BENCH=$?
grep -v "^\[transformers\]\|profiler_st" "$LOG" >> "$OUT"
echo -e "\n## benchmark json" >> "$OUT"
cat "$BENCH_JSON" >> "$OUT" 2>/dev/null
echo "benchmark exit status: $BENCH" >> "$OUT"

echo "gpu_check: results in $OUT (tests $TESTS, benchmark $BENCH)"
[ "$TESTS" -eq 0 ] && [ "$BENCH" -eq 0 ]
