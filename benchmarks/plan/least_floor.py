"""What sets the least-memory plan's floor: `kvram.remat.plan` (no budget) of
keras.applications.MobileNetV2 at 64x64, batch 16, on the present device, and
each stretch of its predicted step peak (`kvram.remat._choice._predict`'s terms:
a segment's need, or a recomputed run's, less what earlier runs saved), highest
first, beside the plan's checked least and plain peaks.

    python benchmarks/plan/least_floor.py --out least_floor_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from kvram import remat  # noqa: E402
from kvram.remat._choice import _stretches  # noqa: E402

MiB = 2**20


def stretches(profile, runs):
    """[(name, MiB)] of every term of the predicted peak, in chain order
    (`kvram.remat._choice._stretches`)."""
    names = {"run": "recomputed run {}-{}", "segment": "segment {}", "head": "loss and its gradient"}
    return [(names[what[0]].format(*what[1:]), held / MiB) for what, held in _stretches(profile, runs)]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--out", default="least_floor_cpu.json")
    args = parser.parse_args(argv)
    keras.utils.set_random_seed(0)
    model = keras.applications.MobileNetV2(weights=None, input_shape=(args.size, args.size, 3), classes=10)
    x = np.random.default_rng(0).random((args.rows, args.size, args.size, 3)).astype("float32")
    y = np.arange(args.rows) % 10
    least = remat.plan(model, (x, y), loss="sparse_categorical_crossentropy", jit_compile=False)
    terms = stretches(least.profile, least.runs)
    top = sorted(terms, key=lambda t: -t[1])[:10]
    record = {
        "model": f"keras.applications.MobileNetV2 {args.size}x{args.size}, batch {args.rows}",
        "runs": [list(r) for r in least.runs],
        "segments": {i: list(s.layers) for i, s in enumerate(least.segments)},
        "resident_mib": least.resident_bytes / MiB,
        "checked_least_step_mib": (least.minimum_peak_bytes - least.resident_bytes) / MiB,
        "checked_plain_step_mib": (least.plain_peak_bytes - least.resident_bytes) / MiB,
        "predicted_stretches_highest_mib": top,
        "command": " ".join([os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:]),
        "python": platform.python_version(), "tensorflow": tf.__version__, "keras": keras.__version__,
        "cpus": os.cpu_count(), "date": time.strftime("%Y-%m-%d"),
    }
    with open(args.out, "w") as handle:
        json.dump(record, handle, indent=1)
    for name, mib in top:
        print(f"{mib:7.2f} MiB  {name}: {', '.join(least.segments[int(name.split()[-1].split('-')[0])].layers) if name[0] in 'rs' else ''}")
    print(f"checked: least {record['checked_least_step_mib']:.1f} MiB a step, plain {record['checked_plain_step_mib']:.1f}")


if __name__ == "__main__":
    main()
