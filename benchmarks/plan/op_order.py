"""Whether the op order explains the least-memory plan's peak in TensorFlow's
default executor: keras.applications.MobileNetV2 at 64x64, batch 16, on the
CPU without XLA (the case of the issue "kvram plan answers in a minute, and
planning never changes the user's model", item 3).

Each round builds the model, plans it with no budget (`kvram.remat.plan`, the
least memory), and measures the peak of a training step's gradients (a
`tf.function` returning them, as the planner's checks do) of the plain model
and of `plan.apply()`, three steps each on a new trace, on the default
executor and in one op order (`tests.helpers.one_op_order`: the
single-threaded executor, Grappler's dependency and memory optimizers off).
Peaks are bytes allocated on CPU:0 beyond what was allocated before the step
(`tests.helpers.run_with_peak`, as the tests measure steps).

    python benchmarks/plan/op_order.py --rounds 3 --out op_order_cpu.json
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# CPU allocator statistics need TF's oneDNN allocator, on by default only on CPUs with
# AVX-512 VNNI/AMX; set before TensorFlow is imported, as `import kvram` and tests/conftest.py do
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import common  # noqa: E402

from kvram import remat  # noqa: E402
from tests.helpers import one_op_order, run_with_peak  # noqa: E402


def step_peaks(model, x, y, ordered: bool, steps: int = 3) -> list:
    loss_fn = keras.losses.SparseCategoricalCrossentropy()
    peaks = []
    for _ in range(steps):
        with one_op_order() if ordered else contextlib.nullcontext():

            @tf.function
            def step(x, y):
                with tf.GradientTape() as tape:
                    loss = loss_fn(y, model(x, training=True))
                return tape.gradient(loss, model.trainable_variables)

            # traced and run once first: its one-time allocations stay out
            peaks.append(run_with_peak(step, x, y, warm=True)[1])
    return peaks


def one_round(rows, size):
    def make():
        keras.utils.set_random_seed(0)
        return keras.applications.MobileNetV2(weights=None, input_shape=(size, size, 3), classes=10)

    x = np.random.default_rng(0).random((rows, size, size, 3)).astype("float32")
    y = np.arange(rows) % 10
    least = remat.plan(make(), (x, y), loss="sparse_categorical_crossentropy", jit_compile=False)
    x, y = tf.constant(x), tf.constant(y)
    plain, planned = make(), least.apply()
    record = {"runs": [list(r) for r in least.runs], "resident_bytes": least.resident_bytes,
              "plan_plain_step_bytes": least.plain_peak_bytes - least.resident_bytes,
              "plan_least_step_bytes": least.predicted_peak_bytes - least.resident_bytes}
    for name, ordered in (("default_executor", False), ("one_op_order", True)):
        record[name] = {"plain_step_bytes": step_peaks(plain, x, y, ordered),
                        "least_step_bytes": step_peaks(planned, x, y, ordered)}
    return record


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--out", default="op_order_cpu.json")
    args = parser.parse_args(argv)
    rounds = []
    for i in range(args.rounds):
        rounds.append(one_round(args.rows, args.size))
        r = rounds[-1]
        mib = lambda values: "/".join(f"{v / 2**20:.1f}" for v in values)  # noqa: E731
        print(f"round {i + 1}: {len(r['runs'])} runs; "
              + "; ".join(f"{name}: plain {mib(r[name]['plain_step_bytes'])}, least {mib(r[name]['least_step_bytes'])} MiB"
                          for name in ("default_executor", "one_op_order")), flush=True)
    record = {"model": f"keras.applications.MobileNetV2 {args.size}x{args.size}, batch {args.rows}",
              "device": "CPU:0, jit_compile=False", "rounds": rounds}
    common.write_record(args.out, record)


if __name__ == "__main__":
    main()
