#!/usr/bin/env bash
# kvram plan's wall time with XLA's parallel LLVM compilation, against without, one after the other
# on one machine. XLA's GPU compiler splits a module's LLVM IR over a thread pool only with
# --xla_gpu_enable_llvm_module_compilation_parallelism (default off) and a pool: TensorFlow's JIT
# passes none (tensorflow/compiler/jit/device_compiler_client.cc, GetExecutableBuildOptions), so
# --xla_gpu_force_compilation_parallelism=N gives it one (xla/service/gpu/gpu_compiler.cc,
# CompileToTargetBinary). Both flags are accepted by TensorFlow 2.21's XLA. Each run is
# benchmarks/plan/minute.sh (same commands, same outputs) under $OUT/default and $OUT/parallelN:
#   bash benchmarks/plan/compile_parallel.sh convnext_small [resnet50 vit_b16] [--measure]
# THREADS (default: the host's cores) sets N.
set -u
here=$(dirname "$0")
out=${OUT:-/tmp/plan_minute}
threads=${THREADS:-$(nproc)}
flags="--xla_gpu_enable_llvm_module_compilation_parallelism=true --xla_gpu_force_compilation_parallelism=$threads"
OUT=$out/default bash "$here/minute.sh" "$@"
XLA_FLAGS="${XLA_FLAGS:+$XLA_FLAGS }$flags" OUT=$out/parallel$threads bash "$here/minute.sh" "$@"
