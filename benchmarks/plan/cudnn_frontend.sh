#!/usr/bin/env bash
# Where the first run of kvram plan's probed step at a new batch size goes on a GPU, and whether
# TensorFlow's legacy cuDNN convolution API (TF_CUDNN_USE_FRONTEND=0) shortens it: with
# TF_CUDNN_USE_AUTOTUNE=0 (as kvram's estimate measures), TensorFlow still builds a cuDNN frontend
# plan for every heuristic engine of each new convolution shape before it runs the first
# (tensorflow/core/kernels/conv_ops_gpu.cc, AutotuneUnfusedConv -> GetConvolveRunners).
# Writes under $OUT/frontend: first_grads_*.json (one depthwise 7x7 convolution's three ops at new
# batch sizes, benchmarks/plan/first_grads.py) and probe_*.json (benchmarks/plan/probe_times.py),
# each in a fresh process, default and TF_CUDNN_USE_FRONTEND=0 in turn.
set -u
source /tmp/tf-env.sh || exit 1
export TF_CUDNN_USE_AUTOTUNE=0
here=$(dirname "$0")
out=${OUT:-/tmp}/frontend
mkdir -p "$out"
frontend_as() {  # 0: TensorFlow's legacy cuDNN API; default: its own choice
  if [ "$1" = 0 ]; then export TF_CUDNN_USE_FRONTEND=0; else unset TF_CUDNN_USE_FRONTEND; fi
}
for frontend in default 0; do
  frontend_as "$frontend"
  for route in depthwise grouped; do
    python3 "$here/first_grads.py" --route "$route" --dtype bfloat16 --out "$out/first_grads_${route}_$frontend.json" 2> "$out/first_grads_${route}_$frontend.err" | cut -c1-400
  done
done
for frontend in 0 default; do
  frontend_as "$frontend"
  python3 "$here/probe_times.py" --model ConvNeXtSmall --rows 16 32 --out "$out/probe_convnext_$frontend.json" 2> "$out/probe_convnext_$frontend.err" | cut -c1-200
  python3 "$here/probe_times.py" --model ResNet50 --rows 32 64 --out "$out/probe_resnet50_$frontend.json" 2> "$out/probe_resnet50_$frontend.err" | cut -c1-200
done
