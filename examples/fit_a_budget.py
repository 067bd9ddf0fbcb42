"""Fit a keras.applications model into a memory budget with `kvram.remat.plan`.

    python examples/fit_a_budget.py                      # MobileNetV3Small, 64x64, CPU or GPU
    python examples/fit_a_budget.py --model ResNet50 --size 224 --batch-size 256 --budget 12GiB

The model is built with `weights=None` (nothing is downloaded). `plan` measures
one training step of the model as it is, chooses the blocks to recompute so
that training (variables, optimizer state, batch and the step's peak) fits the
budget with the least recomputation, and `apply()` returns a `kvram.Model` on
the same variables. The example then trains it a few steps on random data and
prints the allocator's peak next to the budget.

On a GPU the step is compiled with XLA and the plan is checked under XLA; on
the CPU both run on TensorFlow's graph executor (see README, "Checkpointing any
model").
"""

from __future__ import annotations

import argparse

# kvram before TensorFlow: it turns on the CPU allocator's statistics (kvram/__init__.py)
import kvram

import keras
import numpy as np
import tensorflow as tf

from kvram import memory, remat
from kvram.remat import parse_bytes


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="MobileNetV3Small", help="a keras.applications name")
    parser.add_argument("--size", type=int, default=64, help="input height and width")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--budget", default=None,
                        help="memory for training, e.g. 12GiB (default: --fraction of the plain peak)")
    parser.add_argument("--fraction", type=float, default=0.7,
                        help="without --budget: this fraction of the way from the least to the plain peak")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args(argv)
    if not hasattr(keras.applications, args.model):
        parser.error(f"--model: {args.model!r} is not a keras.applications model")

    keras.utils.set_random_seed(0)
    before = memory.current_bytes()  # what this process held before: not training's
    model = getattr(keras.applications, args.model)(
        weights=None, input_shape=(args.size, args.size, 3), classes=args.classes
    )
    rng = np.random.default_rng(0)
    x = tf.constant(rng.random((args.batch_size, args.size, args.size, 3)).astype("float32"))
    y = tf.constant(rng.integers(0, args.classes, args.batch_size))
    jit = bool(tf.config.list_logical_devices("GPU"))  # what Keras compiles with here, and plan checks
    loss, optimizer = "sparse_categorical_crossentropy", "adam"

    # 1. Measure once; the least memory, and the plain peak, come with it.
    least = remat.plan(model, (x, y), loss=loss, optimizer=optimizer, jit_compile=jit)
    if args.budget is None:
        budget = int(least.minimum_peak_bytes
                     + args.fraction * (least.plain_peak_bytes - least.minimum_peak_bytes))
    else:
        budget = parse_bytes(args.budget)
    # 2. The least recomputation within the budget (a budget below the least possible is refused).
    chosen = least.with_budget(budget)
    print(chosen)

    # 3. Train the planned model: the same variables as `model`.
    trained = chosen.apply()
    trained.compile(optimizer=optimizer, loss=loss, jit_compile=jit)
    data = tf.data.Dataset.from_tensors((x, y))
    trained.fit(data, verbose=0)  # builds and compiles
    memory.reset_peak()
    history = trained.fit(data.repeat(args.steps), verbose=0)
    peak = memory.peak_bytes() - before
    print(f"budget {budget / 2**20:,.1f} MiB; predicted {chosen.predicted_peak_bytes / 2**20:,.1f} MiB; "
          f"measured while training {peak / 2**20:,.1f} MiB (all it allocated); "
          f"loss {history.history['loss'][-1]:.4f}")
    assert isinstance(trained, kvram.Model)
    return chosen, budget, peak


if __name__ == "__main__":
    main()
