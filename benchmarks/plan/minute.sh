#!/usr/bin/env bash
# The kvram plan commands of the issue "kvram plan answers in a minute", each timed from its start
# to its end (wall clock, TensorFlow's start-up in both the command and its estimate's child
# included). Writes each command's table (.out), stderr with the stages and their seconds (.err),
# JSON report and a summary of wall times under $OUT. Run after TensorFlow is staged
# (../shared/gpu/README.md):
#   bash benchmarks/plan/minute.sh resnet50 vit_b16 convnext_small [--measure]
#   TAG=parallel XLA_FLAGS=... bash benchmarks/plan/minute.sh resnet50   # files named *_parallel
set -u
source "$(dirname "$0")/issue_models.sh"
source /tmp/tf-env.sh || exit 1
# as a user runs it: tf-env.sh sets TF_CPP_MIN_LOG_LEVEL, which kvram leaves to the user (kvram/_quiet.py)
unset TF_CPP_MIN_LOG_LEVEL
out=${OUT:-/tmp/plan_minute}
mkdir -p "$out"
summary="$out/minute_summary.txt"
[ -s "$summary" ] || nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$summary"
extra=()
names=()
for a in "$@"; do [ "${a#--}" != "$a" ] && extra+=("$a") || names+=("$a"); done
for name in "${names[@]}"; do
  plan_args "$name" || exit 2
  tag=$name${extra[*]:+_measure}${TAG:+_$TAG}  # TAG: a label for runs under other XLA_FLAGS
  command=(python3 -m kvram plan "${args[@]}" --classes 1000 --limit-gpu "${extra[@]}" --json "$out/plan_$tag.json")
  start=$(date +%s.%N)
  timeout -k 10 "${TIMEOUT:-280}" "${command[@]}" > "$out/plan_$tag.out" 2> "$out/plan_$tag.err"
  rc=$?
  wall=$(python3 -c "import time; print(f'{time.time() - $start:.1f}')")
  echo "$tag: ${command[*]} -> exit $rc, $wall s wall" | tee -a "$summary"
done
