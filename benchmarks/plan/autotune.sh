#!/usr/bin/env bash
# kvram plan's XLA checks with and without XLA's GPU autotuning (issue: "kvram plan answers in a
# minute"). The same command twice on one GPU machine, each with a new per-fusion autotune cache
# folder: (a) XLA's default autotuning, (b) --xla_gpu_autotune_level=0 (no algorithm timed: the
# check is about memory). Writes each run's printed table, stderr (the stages with their times)
# and JSON report, and a summary of wall times, under $OUT. Run after TensorFlow is staged
# (../shared/gpu/README.md):
#   bash benchmarks/plan/autotune.sh [MODEL] [BATCH] [MEMORY]
set -u
source /tmp/tf-env.sh || exit 1
model=${1:-ResNet50} batch=${2:-256} memory=${3:-8GB}
out=${OUT:-/tmp/plan_autotune}
mkdir -p "$out"
summary="$out/autotune_${model}_summary.txt"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$summary"
for variant in default level0; do
  rm -rf "/tmp/xla_at_$variant" && mkdir -p "/tmp/xla_at_$variant"
  flags="--xla_gpu_per_fusion_autotune_cache_dir=/tmp/xla_at_$variant"
  [ "$variant" = level0 ] && flags="$flags --xla_gpu_autotune_level=0"
  command="python3 -m kvram plan --model $model --input-shape 224,224,3 --batch-size $batch --gpu-memory $memory --limit-gpu --precision mixed_bfloat16 --json $out/plan_${model}_${variant}.json"
  start=$(date +%s)
  XLA_FLAGS="$flags" timeout -k 10 "${TIMEOUT:-280}" $command \
    > "$out/plan_${model}_${variant}.out" 2> "$out/plan_${model}_${variant}.err"
  rc=$?
  echo "$variant: XLA_FLAGS=\"$flags\" $command -> exit $rc, $(( $(date +%s) - start )) s wall" | tee -a "$summary"
done
