#!/usr/bin/env bash
# The GPU checks of issue N item 7 (and issue I item 9 before it), as one script for a one-GPU machine with torch but
# none of our packages. Each part has its own timeout, appends to $OUT/device_check.log and writes its JSON as it
# goes; a part that fails or times out does not stop the next:
#   1. bench/gpu_ops.py        -> $OUT/ops.json       GEMM (BF16, FP8), attention, grouped GEMM, launch cost (~60 s)
#   2. bench/kernel_launches.py -> $OUT/launches.json  kernels per layer and pass (when the file exists)
#   3. bench/gpu_memory.py     -> $OUT/memory.json    predicted vs measured memory, 9 cases in one process, with
#      the runtime's allocator (expandable segments, cfp_megatron/base/cuda_env.py) unless PYTORCH_CUDA_ALLOC_CONF is set
#   4. a one-GPU `+cfp=auto` run (profiler's CUDA path, plan, train, plan_check) -> $OUT/outputs.tgz; off by default
#   5. the same run in FP8 (train.precision=fp8, FP8_RECIPE: Megatron-Core's fp8_recipe, default tensorwise): its
#      plan_check is predicted vs measured for an FP8 plan where Transformer Engine is installed; without it, the
#      refusal before any process group (one error naming train.precision); off by default (FP8_S=240 runs it)
# Wheels for Python 3.12 (megatron-core, hydra-core, omegaconf, antlr4) are expected under .whl/ (see
# docs/testing.md, "On a GPU"); results go under $OUT (default: ./gpu_out).
# Usage: bash tools/device_check.sh; each part's seconds (0 skips it) and the memory cases from the environment:
#   OPS_S=100 LAUNCHES_S=90 MEMORY_S=170 AUTO_S=0 RECOMPUTE="none selective full" MICRO="1 2 4" LAYERS=4
#   MODEL=llama3_8b SEQ=4096 CLUSTER=auto (the memory cases; CPU check: MODEL=gpt_tiny SEQ=64 CLUSTER=h200)
# At most about 6.5 minutes with these defaults (the sum of the timeouts plus the wheels' install). The auto run
# (AUTO_S=240) took about 100 s to profile on one H200 on 2026-11-26 and 2 s a step after: give it 200 s or more for
# its step-12 plan check to print. Results of the runs: docs/gpu-runs.md, docs/benchmarks.md ("On a GPU").
set -u
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
LOG=$OUT/device_check.log
OPS_S=${OPS_S:-100}
LAUNCHES_S=${LAUNCHES_S:-90}
MEMORY_S=${MEMORY_S:-170}
AUTO_S=${AUTO_S:-0}
FP8_S=${FP8_S:-0}
FP8_RECIPE=${FP8_RECIPE:-tensorwise}
RECOMPUTE=${RECOMPUTE:-none selective full}
MICRO=${MICRO:-1 2 4}
LAYERS=${LAYERS:-4}
MODEL=${MODEL:-llama3_8b}
SEQ=${SEQ:-4096}
CLUSTER=${CLUSTER:-auto}
# The wheels only where Megatron-Core is missing (the device; a machine with the project installed keeps its own).
if ls .whl/*.whl >/dev/null 2>&1 && ! python3 -c "import importlib.util as u, sys
sys.exit(not (u.find_spec('megatron') and u.find_spec('hydra')))"; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
  export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONUNBUFFERED=1 CFP_CACHE_DIR=$PWD/outputs/cache
{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
  python3 -c "import importlib.metadata as md, importlib.util as u, torch; print('torch', torch.__version__, 'cuda', \
torch.version.cuda, 'megatron-core', md.version('megatron-core'), 'te', u.find_spec('transformer_engine') is not None)"
} 2>&1 | tee "$LOG"

# part NAME SECONDS COMMAND...: run COMMAND under `timeout SECONDS` (0: skipped), its output appended to the log.
part() {
  local name=$1 seconds=$2 start rc
  shift 2
  if [ "$seconds" = 0 ]; then
    echo "== $name: skipped (0 s)" | tee -a "$LOG"
    return 0
  fi
  echo "== $name (timeout ${seconds} s): $*" | tee -a "$LOG"
  start=$(date +%s)
  timeout --kill-after=10 "$seconds" "$@" 2>&1 | tee -a "$LOG"
  rc=${PIPESTATUS[0]}
  echo "== $name: rc=$rc in $(( $(date +%s) - start )) s" | tee -a "$LOG"
}

part gpu_ops "$OPS_S" python3 bench/gpu_ops.py --out "$OUT/ops.json" --budget-s $(( OPS_S * 7 / 10 ))
if [ -f bench/kernel_launches.py ]; then
  part kernel_launches "$LAUNCHES_S" python3 bench/kernel_launches.py --out "$OUT/launches.json"
else
  echo "== kernel_launches: skipped (no bench/kernel_launches.py)" | tee -a "$LOG"
fi
# shellcheck disable=SC2086  # the case lists split into words on purpose
part gpu_memory "$MEMORY_S" python3 bench/gpu_memory.py --model "$MODEL" --seq "$SEQ" --layers "$LAYERS" \
  --cluster "$CLUSTER" --recompute $RECOMPUTE --micro-batches $MICRO --out "$OUT/memory.json"
AUTO=(model=llama3_8b model.num_layers=8 train.seq_length=4096 train.global_batch_size=8 train.steps=16
      cfp.profile_budget_s=100)
part auto "$AUTO_S" python3 -m torch.distributed.run --standalone --nproc_per_node=1 launch/train.py +cfp=auto \
  "${AUTO[@]}"
part auto_fp8 "$FP8_S" python3 -m torch.distributed.run --standalone --nproc_per_node=1 launch/train.py +cfp=auto \
  "${AUTO[@]}" train.precision=fp8 train.fp8_recipe="$FP8_RECIPE"
if [ "$AUTO_S" != 0 ] || [ "$FP8_S" != 0 ]; then
  tar czf "$OUT/outputs.tgz" outputs 2>/dev/null
fi
echo "== done $(date -u); files: $(find "$OUT" -maxdepth 1 -type f -printf '%f ')" | tee -a "$LOG"
