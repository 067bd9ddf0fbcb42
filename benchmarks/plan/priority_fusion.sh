#!/usr/bin/env bash
# kvram plan's XLA check with XLA's priority fusion (its default fusion pass) against the older
# instruction fusion (--xla_gpu_enable_priority_fusion=false), one after the other on one machine.
# The check's compile is what keeps ConvNeXtSmall's command over a minute; priority fusion was 30 s
# of an autotuned check's HLO passes (benchmarks/results/plan_minute_h200/7c8cfa0_compile/). Each
# ConvNeXtSmall run logs XLA's HLO passes with their times (TF_CPP_VMODULE=hlo_pass_pipeline=1, which
# needs TF_CPP_MIN_LOG_LEVEL=0 and --verbose: kvram otherwise turns TensorFlow's C++ log off), summed
# by benchmarks/plan/pass_times.py; then ResNet50 and ViT-B/16 run without the log through
# benchmarks/plan/minute.sh with the flag, for their checked peaks. The estimate's child adds
# `kvram plan`'s own check flags to either (autotuning off, cheap LLVM passes, no Triton GEMMs).
# Writes under $OUT: each run's table (.out), stage lines (.stages), pass summary (.passes.json).
# Run after TensorFlow is staged (../shared/gpu/README.md):
#   bash benchmarks/plan/priority_fusion.sh [resnet50 vit_b16]
set -u
here=$(dirname "$0")
source /tmp/tf-env.sh || exit 1
out=${OUT:-/tmp/plan_priority_fusion}
mkdir -p "$out"
summary="$out/priority_fusion_summary.txt"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$summary"
off=--xla_gpu_enable_priority_fusion=false
for variant in default no_priority_fusion; do
  flags=""
  [ "$variant" = no_priority_fusion ] && flags=$off
  command=(python3 -m kvram plan --model ConvNeXtSmall --input-shape 224,224,3 --batch-size 128
           --gpu-memory 12GB --classes 1000 --limit-gpu --verbose --json "$out/convnext_small_$variant.json")
  start=$(date +%s.%N)
  XLA_FLAGS="$flags" TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=hlo_pass_pipeline=1 \
    timeout -k 10 "${TIMEOUT:-200}" "${command[@]}" > "$out/convnext_small_$variant.out" 2> /tmp/pf_$variant.err
  rc=$?
  wall=$(python3 -c "import time; print(f'{time.time() - $start:.1f}')")
  grep -E '^\[ *[0-9.]+ s\]' /tmp/pf_$variant.err > "$out/convnext_small_$variant.stages"
  python3 "$here/pass_times.py" /tmp/pf_$variant.err --top 15 > "$out/convnext_small_$variant.passes.json"
  echo "convnext_small $variant: XLA_FLAGS=\"$flags\" ${command[*]} -> exit $rc, $wall s wall" | tee -a "$summary"
done
# the other two models with the flag, as a user runs them (no pass log)
[ $# -gt 0 ] && XLA_FLAGS=$off TAG=no_priority_fusion OUT=$out bash "$here/minute.sh" "$@"
exit 0
