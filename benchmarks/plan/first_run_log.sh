#!/usr/bin/env bash
# The XLA check's step (benchmarks/plan/check_first_runs.py) with XLA's compile, executable,
# convolution and cuDNN modules logging, each variant in a fresh process; log_gaps.py then
# says where the first call's time went after the compile. Run after TensorFlow is staged
# (../shared/gpu/README.md); everything is packed in $OUT/first_run_log.tgz (a call brings
# back few files):
#   MODEL=ResNet50 ROWS=128 bash benchmarks/plan/first_run_log.sh
set -u
source /tmp/tf-env.sh || exit 1
out=/tmp/first_run_log; rm -rf "$out"; mkdir -p "$out"
model=${MODEL:-ResNet50}; rows=${ROWS:-128}
modules=gpu_compiler=1,gpu_executable=2,convolution_thunk=2,cuda_dnn=2,gpu_conv_runner=2,command_buffer_thunk=2
variant() {  # name, environment assignments ("" for none), then check_first_runs.py's extra arguments
  local name=$1 assigns=$2; shift 2
  echo "=== $name: $assigns $*"
  env TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=$modules $assigns \
    python3 benchmarks/plan/check_first_runs.py --model "$model" --rows "$rows" --out "$out/$name.json" "$@" \
    2> "$out/$name.log" | grep -E '"(calls_s|calls_before_s|trace_s|peak_gib)"' -A3 | tr -s ' \n' ' '; echo
  python3 benchmarks/plan/log_gaps.py "$out/$name.log" --top "${TOP:-8}" | tee "$out/$name.gaps.txt"
  gzip -f "$out/$name.log"
}
variant estimate_flags ""
variant command_buffers_off "XLA_FLAGS=--xla_gpu_enable_command_buffer="
variant autotuned "" --as-given
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$out/gpu.txt"
tar czf "$OUT/first_run_log.tgz" -C "$out" .
