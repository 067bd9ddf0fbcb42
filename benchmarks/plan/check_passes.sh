#!/usr/bin/env bash
# kvram plan's commands of benchmarks/plan/minute.sh with XLA's HLO passes logged and summed: where the
# XLA check's compile goes. XLA logs each pass with its time under TF_CPP_VMODULE=hlo_pass_pipeline=1
# (with gpu_compiler=1: RunHloPasses and RunBackend of each module), which needs TF_CPP_MIN_LOG_LEVEL=0
# and --verbose (kvram otherwise turns TensorFlow's C++ log off); benchmarks/plan/pass_times.py sums
# it. The estimate's child adds `kvram plan`'s own check flags (kvram._plan_process) as always. With
# FLAGS set, each command runs again with XLA_FLAGS=$FLAGS, tagged $NAME (default "flags"). Writes
# under $OUT: each run's table (.out), stage lines (.stages), pass summary (.passes.json), module
# compile times (.compiler.txt), and a summary of wall times. Run after TensorFlow is staged
# (../shared/gpu/README.md):
#   bash benchmarks/plan/check_passes.sh convnext_small [resnet50 vit_b16]
#   FLAGS=--xla_gpu_enable_priority_fusion=false NAME=no_priority_fusion bash benchmarks/plan/check_passes.sh convnext_small
#   EXTRA=--measure bash benchmarks/plan/check_passes.sh convnext_small   # files tagged _measure: the passes
#       of --measure's process (XLA's autotuned compile of the trained step) are logged and summed too
set -u
here=$(dirname "$0")
source "$here/issue_models.sh"
source /tmp/tf-env.sh || exit 1
out=${OUT:-/tmp/plan_passes}
mkdir -p "$out"
summary="$out/check_passes_summary.txt"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$summary"
variants=(default)
[ -n "${FLAGS:-}" ] && variants+=("${NAME:-flags}")
for name in "$@"; do
  plan_args "$name" || exit 2
  for variant in "${variants[@]}"; do
    flags=${XLA_FLAGS:-}
    [ "$variant" != default ] && flags=$FLAGS
    tag=${name}_$variant${EXTRA:+_measure}
    command=(python3 -m kvram plan "${args[@]}" --classes 1000 --limit-gpu --verbose ${EXTRA:-} --json "$out/$tag.json")
    start=$(date +%s.%N)
    XLA_FLAGS="$flags" TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=hlo_pass_pipeline=1,gpu_compiler=1 \
      timeout -k 10 "${TIMEOUT:-200}" "${command[@]}" > "$out/$tag.out" 2> "/tmp/$tag.err"
    rc=$?
    wall=$(python3 -c "import time; print(f'{time.time() - $start:.1f}')")
    grep -E '^\[ *[0-9.]+ s\]' "/tmp/$tag.err" > "$out/$tag.stages"
    python3 "$here/pass_times.py" "/tmp/$tag.err" --top 15 > "$out/$tag.passes.json"
    grep -oE "GpuCompiler::Run(HloPasses|Backend) for .* time: [0-9.]+ [a-z]+" "/tmp/$tag.err" > "$out/$tag.compiler.txt"
    # an XLA flag this TensorFlow does not know aborts the process: say so
    grep -m1 "Unknown flag in XLA_FLAGS" "/tmp/$tag.err" >> "$out/$tag.stages"
    echo "$tag: XLA_FLAGS=\"$flags\" ${command[*]} -> exit $rc, $wall s wall" | tee -a "$summary"
  done
done
exit 0
