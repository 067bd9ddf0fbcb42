"""Whether the compiling call of the XLA check's step peaks as the runs after
it do, under XLA on this machine's CPU: `keras.applications` models at 64x64,
each call's allocator peak beyond what was allocated before it (what
`kvram.remat._check._step_peak_or_raise` measures with one run where compiling
times no kernels). On a GPU, `check_first_runs.py` measures the same.

    python benchmarks/plan/compiling_call_peaks.py [--out peaks.json]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "benchmarks"))
import common  # noqa: E402

MODELS = (("MobileNetV3Small", 8), ("ResNet50", 4), ("ConvNeXtTiny", 4))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    from kvram import memory  # kvram before TensorFlow: the CPU allocator's statistics

    import keras
    import tensorflow as tf

    from kvram.remat._check import _loss_function, _training_step

    device = "CPU:0"
    peaks = {}
    for name, rows in MODELS:
        model = getattr(keras.applications, name)(weights=None, input_shape=(64, 64, 3), classes=10)
        x, y = tf.random.uniform((rows, 64, 64, 3)), tf.zeros((rows,), "int64")
        step = _training_step(model, x, y, _loss_function(model, "sparse_categorical_crossentropy"), True)
        peaks[name] = []
        for _ in range(args.calls):
            memory.collect_garbage()
            memory.reset_peak(device)
            start = memory.current_bytes(device)
            gradients = step(x, y)
            peaks[name].append(memory.peak_bytes(device) - start)
            del gradients
        print(name, rows, peaks[name], flush=True)
    record = {"device": device, "size": 64, "rows": dict(MODELS), "call_peaks_bytes": peaks,
              "first_equals_later": {n: len(set(p)) == 1 for n, p in peaks.items()}}
    if args.out:
        common.write_record(args.out, record)


if __name__ == "__main__":
    main()
