"""Which recomputation choices lower an XLA-compiled step's peak on the CPU.

Checks (as `kvram.remat.plan` does under `jit_compile=True`: one XLA-compiled
training step after the compiling one, the CPU allocator's peak) the test
suite's residual model (tests/helpers.py, 9 segments) at a few rows with every
single run of segments and every pair of runs starting at the first segment,
and writes each peak as JSON.

    python benchmarks/plan/xla_cpu_choices.py --rows 8 --out xla_cpu_choices.json
"""

import argparse
import json
import os
import platform
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    import keras
    import numpy as np
    import tensorflow as tf

    from kvram import remat
    from tests.helpers import residual_model

    model = remat._segments._functional(residual_model())
    chain = remat.segments(model)
    rng = np.random.default_rng(0)
    x = tf.constant(rng.random((args.rows, 32, 32, 3)).astype("float32"))
    y = tf.constant(np.arange(args.rows) % 10)
    check = remat._check._step_check(model, chain, x, y, remat._check._loss_function(model, None), "CPU:0", True)
    n = len(chain)
    choices = [()] + [((a, b),) for a in range(n) for b in range(a, n)]
    choices += [((0, j), (j + 1, k)) for j in range(n - 1) for k in range(j + 1, n)]
    peaks = []
    for i, runs in enumerate(choices):
        peaks.append({"runs": [list(r) for r in runs], "peak_bytes": int(check(runs))})
        print(f"[{i + 1}/{len(choices)}] {runs}: {peaks[-1]['peak_bytes'] / 2**20:.2f} MiB", flush=True)
    plain = peaks[0]["peak_bytes"]
    lower = [p for p in peaks if p["peak_bytes"] < plain]
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    report = {
        "command": " ".join(["python"] + sys.argv),
        "kvram_commit": commit, "tensorflow": tf.__version__, "keras": keras.__version__,
        "python": platform.python_version(), "machine": platform.processor() or platform.machine(),
        "segments": [list(s.layers) for s in chain], "rows": args.rows,
        "plain_peak_bytes": plain, "choices_checked": len(peaks) - 1,
        "choices_below_plain": lower, "peaks": peaks,
    }
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"{len(lower)} of {len(peaks) - 1} choices peak below the plain step's {plain / 2**20:.2f} MiB")


if __name__ == "__main__":
    main()
