#!/usr/bin/env bash
# kvram plan's wall, one checkout against another on one machine: each command of
# benchmarks/plan/minute.sh run from BASE (a copy of the older commit, e.g.
# `git archive OLD | tar -x -C .gpu/base`), then from this checkout (tagged $NEW, default "new"),
# each in turn; ORDER=reverse runs this checkout first. Stage lines are printed; files under $OUT/ab.
#   BASE=.gpu/base TIMEOUT=150 bash benchmarks/plan/ab.sh resnet50 vit_b16
set -u
root=$(pwd)
base=$(cd "${BASE:?BASE: the older checkout}" && pwd)
res=$OUT/ab; mkdir -p "$res"
(cd "$base" && source /tmp/tf-env.sh && python3 -c "import kvram; print('base kvram at', kvram.__file__)")
new=${NEW:-new}
for m in "$@"; do
  if [ "${ORDER:-}" = reverse ]; then sides="$new base"; else sides="base $new"; fi
  for side in $sides; do
    if [ "$side" = base ]; then dir=$base; else dir=$root; fi
    (cd "$dir" && OUT=$res/$side TAG=$side TIMEOUT=${TIMEOUT:-150} bash "$root/benchmarks/plan/minute.sh" "$m")
    echo "== $m $side"; cat "$res/$side/plan_${m}_$side.err"
  done
done
cat "$res"/*/minute_summary.txt
