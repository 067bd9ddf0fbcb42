#!/usr/bin/env bash
# experiment: the probe's grouped convolutions as one shared XLA function per shape
set -u
source /tmp/tf-env.sh
mkdir -p $OUT/exp
flags=$(python3 -c 'from kvram._plan_process import checking_environment as c; print(c({})["XLA_FLAGS"])')
echo "flags: $flags"
for v in 0 1; do
  XLA_FLAGS="$flags" TF_CUDNN_USE_AUTOTUNE=0 KVRAM_SHARED_XLA_CONV=$v timeout 200 python3 benchmarks/plan/probe_times.py --model ConvNeXtSmall --rows 16 32 --out $OUT/exp/probe_convnext_shared$v.json 2>&1 | grep -v "^I0000\|^W0000\|^WARNING" | tail -4
done
for v in 0 1 1 0; do
  KVRAM_SHARED_XLA_CONV=$v OUT=$OUT/exp/minute TAG=shared${v}_$RANDOM TIMEOUT=110 bash benchmarks/plan/minute.sh convnext_small
done
for f in $OUT/exp/minute/*.err; do echo "== $f"; cat $f; done
tar -czf $OUT/exp.tgz -C $OUT exp
