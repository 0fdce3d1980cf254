#!/usr/bin/env bash
# The GPU checks of issue I item 9, as one script for a one-GPU machine with torch but none of our packages:
#   1. a one-GPU `+cfp=auto` run (profiler's CUDA path, plan, train, plan_check);
#   2. bench/gpu_memory.py (predicted vs measured peak memory).
# Wheels for Python 3.12 (megatron-core, hydra-core, omegaconf, antlr4) are expected under .whl/ (see
# docs/testing.md, "On a GPU"); logs and results go under $OUT (default: ./gpu_out).
# Usage: bash tools/device_check.sh [auto-seconds] [memory-seconds] [recompute choices] [micro-batches]
# (0 seconds skips a part). On one H200 (2026-11-26) the auto run took about 100 s to profile (its budget) and 2 s a
# step after: give it 200 s or more for its step-12 plan check to print (170 s stopped it at step 11); the memory
# bench took about 50 s a case. Results of that run: docs/gpu-runs.md.
set -u
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
  export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONUNBUFFERED=1 CFP_CACHE_DIR=$PWD/outputs/cache
{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
  python3 -c "import torch, megatron.core as m; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'megatron-core', m.__version__, 'te', __import__('importlib').util.find_spec('transformer_engine') is not None)"
} 2>&1 | tee "$OUT/env.log"

AUTO_S=${1:-240}
MEM_S=${2:-200}
AUTO=(model=llama3_8b model.num_layers=8 train.seq_length=4096 train.global_batch_size=8 train.steps=16
      cfp.profile_budget_s=100)
RECOMPUTE=${3:-none selective}
MICRO=${4:-1 2}
if [ "$AUTO_S" != 0 ]; then
  echo "== +cfp=auto ${AUTO[*]}" | tee "$OUT/auto.log"
  start=$(date +%s)
  timeout "$AUTO_S" python3 -m torch.distributed.run --standalone --nproc_per_node=1 launch/train.py +cfp=auto \
    "${AUTO[@]}" >>"$OUT/auto.log" 2>&1
  echo "rc=$? in $(( $(date +%s) - start )) s" | tee -a "$OUT/auto.log"
  tail -c 6000 "$OUT/auto.log"
fi
if [ "$MEM_S" != 0 ]; then
  echo "== bench/gpu_memory.py --recompute $RECOMPUTE" | tee "$OUT/gpu_memory.log"
  start=$(date +%s)
  # shellcheck disable=SC2086
  timeout "$MEM_S" python3 bench/gpu_memory.py --model llama3_8b --seq 4096 --fill 0.5 --recompute $RECOMPUTE \
    --micro-batches $MICRO >>"$OUT/gpu_memory.log" 2>&1
  echo "rc=$? in $(( $(date +%s) - start )) s" | tee -a "$OUT/gpu_memory.log"
  tail -c 3000 "$OUT/gpu_memory.log"
fi

tar czf "$OUT/outputs.tgz" outputs 2>/dev/null
