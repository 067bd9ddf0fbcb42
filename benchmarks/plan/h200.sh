#!/usr/bin/env bash
# Issue 12's plan runs on the GPU machine, as made for results/plan_h200 (after TensorFlow is
# staged there: ../shared/gpu/README.md). Results go to /tmp/plan (kept between runs on one
# machine) and are copied to $OUT.
#   bash benchmarks/plan/h200.sh estimates                   # EfficientNetV2S under 16 and 48 GiB
#   bash benchmarks/plan/h200.sh measure MODEL CAP FROM SECONDS [extra bench.py flags]
#   bash benchmarks/plan/h200.sh full MODEL CAP SECONDS [extra bench.py flags]   # estimate, measure, try all
set -u
source /tmp/tf-env.sh || exit 1
export PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=2
mkdir -p /tmp/plan
bench=benchmarks/plan/bench.py
# XLA keeps its autotuning results per fusion in a folder: a later compile of the same
# convolution at the same shape (the next configuration of the model) reuses them instead of
# timing every algorithm again. The estimates (two processes at once, not timed) and the
# measurements (one at a time) keep separate folders, so what is timed was tuned alone.
autotune() {
  mkdir -p "$1"
  export XLA_FLAGS="--xla_gpu_per_fusion_autotune_cache_dir=$1"
  python3 -c "import tensorflow as tf; tf.function(lambda x: x @ x, jit_compile=True)(tf.ones((8, 8)))" \
    >/dev/null 2>&1 || { echo "XLA_FLAGS not accepted: autotuning without a cache"; unset XLA_FLAGS; }
}
case "$1" in
  estimates)
    autotune /tmp/xla_autotune_estimates
    for cap in 16 48; do
      timeout -k 10 "${2:-520}" python3 $bench --child --model EfficientNetV2S --cap ${cap}GiB --batch-size 256 \
        --precision mixed_bfloat16 --estimate-only --out /tmp/plan/plan_efficientnetv2s_${cap}.json \
        > /tmp/plan/estimate_efficientnetv2s_${cap}.log 2>&1 &
    done
    wait
    ;;
  measure)
    autotune /tmp/xla_autotune
    model=$2 cap=$3 from=$4 seconds=$5
    shift 5
    name=$(basename "$from" .json)
    timeout -k 10 "${TIMEOUT:-575}" python3 $bench --child --model "$model" --cap "$cap" --batch-size 256 --precision mixed_bfloat16 \
      --steps 10 --try-all --estimate-from "$from" --budget-seconds "$seconds" --out "/tmp/plan/${name}_tryall.json" \
      "$@" 2>&1 | grep -v "UserWarning\|data_adapter" | tee "/tmp/plan/${name}_tryall.log"
    ;;
  full)
    autotune /tmp/xla_autotune
    model=$2 cap=$3 seconds=$4
    shift 4
    name=plan_$(echo "$model" | tr 'A-Z' 'a-z')_${cap%GiB}
    timeout -k 10 "${TIMEOUT:-585}" python3 $bench --child --model "$model" --cap "$cap" --batch-size 256 --precision mixed_bfloat16 \
      --steps 10 --try-all --budget-seconds "$seconds" --out "/tmp/plan/${name}.json" \
      "$@" 2>&1 | grep -v "UserWarning\|data_adapter" | tee "/tmp/plan/${name}.log"
    ;;
esac
cp /tmp/plan/*.json /tmp/plan/*.log "$OUT"/ 2>/dev/null
ls -la /tmp/plan
