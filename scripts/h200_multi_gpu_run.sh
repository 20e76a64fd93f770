#!/usr/bin/env bash
# Multi-GPU benchmarks on one host with several GPUs: distributed training and the sharded cache stage.
#
#   bash scripts/h200_multi_gpu_run.sh OUT_DIR [NPROC]        # NPROC default: every visible GPU
#
# Runs (each under `timeout`; a failed one is reported and the next one runs):
#   1 bench_ddp_train.py --task dspark   DSpark draft training at Qwen3-4B shapes, global batch 8 of 2048 tokens,
#                                        on 1 and NPROC processes: step time, scaling efficiency, loss trajectory
#   2 bench_ddp_train.py --task dmtd     DMTD fine-tuning of a random Qwen3-4B (bidir_refresh, P28/S8, layer
#                                        recompute), global batch 4 of 2048 tokens, on 1 and NPROC processes
#   3 bench_train_step.py                one sample per GPU (weak scaling: an all-reduce per sample), 1 and NPROC
#   4 bench_cache_shard.py               the cache stage on 1 and NPROC processes into one zarr store, compared
#                                        bit for bit and verified against the target
# DSPARK_MG_PARTS (default "dspark dmtd train_step cache_shard") picks parts. On 2 H200s the
# first three take about 9 minutes (each first DSpark step compiles for ~70 s).
# Writes OUT_DIR/{ddp_train.json, ddp_*_w*.json, train_step_w*.json, cache_shard.json, run.log, gpus.txt}.
set -uo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
[ $# -ge 1 ] || { echo "usage: bash scripts/h200_multi_gpu_run.sh OUT_DIR [NPROC]" >&2; exit 2; }
mkdir -p "$1"
OUT="$(cd "$1" && pwd)"
PY="${PYTHON:-python3}"
NPROC="${2:-$("$PY" -c 'import torch; print(torch.cuda.device_count())')}"
# NVLink multicast stays off (the device README: it can take the host's GPUs out of service)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4 TQDM_MININTERVAL=10 PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
exec > >(tee -a "$OUT/run.log") 2>&1
T0=$(date +%s)
TRUN=("$PY" -m torch.distributed.run --standalone)
FAILED=()
run() {  # run NAME SECONDS COMMAND...
  local name=$1 limit=$2; shift 2
  echo "=== [$(( $(date +%s) - T0 )) s] $name: $*"
  local t=$(date +%s)
  if timeout "$limit" "$@"; then echo "=== $name done in $(( $(date +%s) - t )) s"
  else echo "!!! $name FAILED (exit $?) after $(( $(date +%s) - t )) s"; FAILED+=("$name"); fi
}
{ nvidia-smi --query-gpu=index,name,memory.total --format=csv; nvidia-smi topo -m; } > "$OUT/gpus.txt" 2>&1
cat "$OUT/gpus.txt"
echo "NPROC=$NPROC torch $("$PY" -c 'import torch; print(torch.__version__, torch.cuda.nccl.version())')"

B="$REPO/benchmarks"
PARTS=" ${DSPARK_MG_PARTS:-dspark dmtd train_step cache_shard} "
want() { [[ "$PARTS" == *" $1 "* ]]; }
D=(--length 2048 --global-batch 8 --micro 1 --warmup 3 --steps 8)
M=(--task dmtd --variant bidir_refresh --grad-checkpoint --length 2048 --global-batch 4 --micro 1 --warmup 2 --steps 5)
want dspark && for w in 1 "$NPROC"; do
  run "dspark_w$w" 150 "${TRUN[@]}" --nproc_per_node "$w" "$B/bench_ddp_train.py" --task dspark "${D[@]}" \
    --out "$OUT/ddp_dspark_w$w.json"
done
want dmtd && for w in 1 "$NPROC"; do
  run "dmtd_w$w" 200 "${TRUN[@]}" --nproc_per_node "$w" "$B/bench_ddp_train.py" "${M[@]}" --out "$OUT/ddp_dmtd_w$w.json"
done
compgen -G "$OUT/ddp_*_w*.json" > /dev/null && \
  run ddp_summary 30 "$PY" "$B/bench_ddp_train.py" --summary "$OUT"/ddp_*_w*.json --out "$OUT/ddp_train.json"
want train_step && run train_step_w1 90 "$PY" "$B/bench_train_step.py" --precision bf16 --out "$OUT/train_step_w1.json"
want train_step && run "train_step_w$NPROC" 90 "${TRUN[@]}" --nproc_per_node "$NPROC" "$B/bench_train_step.py" --precision bf16 \
  --baseline "$OUT/train_step_w1.json" --out "$OUT/train_step_w$NPROC.json"
want cache_shard && run cache_shard 150 "$PY" "$B/bench_cache_shard.py" --nprocs 1 "$NPROC" --out "$OUT/cache_shard.json"
echo "=== h200_multi_gpu_run: $(( $(date +%s) - T0 )) s; failed: ${FAILED[*]:-none}"
[ ${#FAILED[@]} -eq 0 ]
