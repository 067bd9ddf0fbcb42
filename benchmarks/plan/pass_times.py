"""XLA's HLO passes by the time they took, from a log that XLA wrote with
`TF_CPP_VMODULE=hlo_pass_pipeline=1` (each pass logs "HLO pass: NAME time: ...").

    source /tmp/tf-env.sh
    TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=hlo_pass_pipeline=1 python3 -m kvram plan --model ConvNeXtSmall \\
        --input-shape 224,224,3 --batch-size 128 --gpu-memory 12GB --classes 1000 --limit-gpu \\
        --precision mixed_bfloat16 --verbose 2> plan.err
    python benchmarks/plan/pass_times.py plan.err --top 12

Prints JSON: the seconds and calls of the slowest passes, the seconds of all
passes, and the seconds by thread (the compiling thread, and XLA's autotuning
threads compiling candidates). benchmarks/results/plan_minute_h200/7c8cfa0_compile/
check_compile_passes.json was made from such a log.
"""

from __future__ import annotations

import argparse
import collections
import json
import re

LINE = re.compile(r"(\d+) hlo_pass_pipeline\.cc:\d+\] HLO pass: (\S+) time: ([\d.]+) (us|ms|s|min)")
UNIT = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "min": 60.0}


def pass_times(lines) -> dict:
    seconds, calls, threads = collections.Counter(), collections.Counter(), collections.Counter()
    for line in lines:
        found = LINE.search(line)
        if not found:
            continue
        thread, name, value, unit = found.groups()
        spent = float(value) * UNIT[unit]
        seconds[name] += spent
        calls[name] += 1
        threads[thread] += spent
    return {"seconds": seconds, "calls": calls, "threads": threads}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("log")
    parser.add_argument("--top", type=int, default=12)
    args = parser.parse_args()
    with open(args.log, errors="replace") as f:
        times = pass_times(f)
    top = times["seconds"].most_common(args.top)
    print(json.dumps({
        "hlo_pass_seconds_top": {name: round(s, 2) for name, s in top},
        "hlo_pass_calls_top": {name: times["calls"][name] for name, _ in top},
        "hlo_pass_seconds_all": round(sum(times["seconds"].values()), 1),
        "seconds_by_thread_top": {t: round(s, 2) for t, s in times["threads"].most_common(5)},
    }, indent=1))


if __name__ == "__main__":
    main()
