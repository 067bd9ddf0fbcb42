#!/usr/bin/env bash
# Where kvram plan's wall time goes on the GPU machine: the command's stderr lines stamped with the
# seconds since its start, and every 2 s the command's processes (parent, estimate child) with their
# state and CPU use. Run after TensorFlow is staged (../shared/gpu/README.md):
#   bash benchmarks/plan/trace_cli.sh [kvram plan arguments]
set -u
source /tmp/tf-env.sh || exit 1
out=${OUT:-/tmp/plan_trace}
mkdir -p "$out"
start=$(date +%s.%N)
stamp() { while IFS= read -r line; do printf '%7.1f %s\n' "$(python3 -c "import time; print(time.time() - $start)")" "$line"; done; }
( python3 -m kvram plan "$@" 2>&1 1>"$out/trace_stdout.txt" | stamp > "$out/trace_stderr.txt" ) &
runner=$!
while kill -0 $runner 2>/dev/null; do
  now=$(python3 -c "import time; print(f'{time.time() - $start:.1f}')")
  echo "$now $(ps -eo pid,ppid,stat,pcpu,rss,args | grep '[k]vram plan' | cut -c1-150 | tr '\n' '|')"
  sleep 2
done > "$out/trace_processes.txt"
echo "wall $(python3 -c "import time; print(f'{time.time() - $start:.1f}')") s" | tee -a "$out/trace_stderr.txt"
