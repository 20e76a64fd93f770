#!/usr/bin/env bash
# The GPU tests: every test marked `gpu` (tests/conftest.py GPU_FILES: Triton kernels, CUDA graphs, the static
# engine, draft trees, the target runner, every draft variant trained and decoded in bf16 on CUDA), on a machine
# with a CUDA device. Run it at the end of any change to dspark_core/kernels, decoding/ or draft/.
#
#   bash scripts/gpu_tests.sh                 # -> pytest -m gpu tests/
#   bash scripts/gpu_tests.sh tests/test_tree.py -x   # arguments replace tests/ (files, pytest options)
#   DSPARK_WHL_DIR=.whl bash scripts/gpu_tests.sh   # a machine without a package index: install the wheels in that folder first
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
WHL_DIR="${DSPARK_WHL_DIR:-}"
SITE="${DSPARK_SITE:-/tmp/site}"
if [ -n "$WHL_DIR" ] && compgen -G "$WHL_DIR/*.whl" > /dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$WHL_DIR"/*.whl
  export PYTHONPATH="$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
"$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 'gpu_tests.sh: no CUDA device here')"
[ $# -gt 0 ] || set -- tests/
exec "$PY" -m pytest -q -m gpu -p no:cacheprovider -rfE "$@"
