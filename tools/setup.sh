#!/usr/bin/env bash
# Create .venv (if missing) and install torch 2.13.0 first, then megapipe with its test extra.
# torch goes first so that no requirement can pull a different (CUDA) build from the registry.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q torch==2.13.0
.venv/bin/python -m pip install -q -e ".[test]"
.venv/bin/python -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"
