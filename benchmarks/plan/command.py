"""`kvram plan` as a user runs it: each command's wall time from start to end, its exit code,
its recommendation, and every line TensorFlow or absl wrote into its output (none is the goal).

    python benchmarks/plan/command.py --out benchmarks/results/plan_command_h200.json \\
        -- "--model ResNet50 --input-shape 224,224,3 --batch-size 256 --gpu-memory 8GB --limit-gpu"
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)
from benchmarks.common import gpu_name, result_header, write_result  # noqa: E402

# how TensorFlow's and absl's C++ lines begin
FOREIGN = ("WARNING: All log messages", "I0000", "W0000", "E0000")


def run(arguments: str, timeout: float) -> dict:
    command = [sys.executable, "-m", "kvram", "plan", *shlex.split(arguments)]
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    lines = (done.stdout + done.stderr).splitlines()
    return {
        "command": "kvram plan " + arguments,
        "exit_code": done.returncode,
        "wall_s": time.perf_counter() - started,
        "recommended": [line for line in done.stdout.splitlines() if "<- recommended" in line],
        "foreign_lines": [line for line in lines if line.startswith(FOREIGN)],
        "stages": [line for line in done.stderr.splitlines() if line.startswith("[")],
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--out", default=None)
    parser.add_argument("commands", nargs="+", help="each the arguments of one `kvram plan` command, quoted")
    args = parser.parse_args()
    runs = []
    for arguments in args.commands:
        runs.append(run(arguments, args.timeout))
        r = runs[-1]
        print(f"{r['command']}: exit {r['exit_code']}, {r['wall_s']:.1f} s, {len(r['foreign_lines'])} foreign lines",
              flush=True)
    write_result(args.out, {**result_header("kvram-plan-command", __file__), "gpu": gpu_name(), "runs": runs})


if __name__ == "__main__":
    main()
