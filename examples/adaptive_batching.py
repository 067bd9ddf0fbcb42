"""Adaptive micro-batching that survives out-of-memory errors.

A kvram.Model is fed batches of 256 rows with AdaptiveBatchSize and a
MemoryLogger. To show the recovery on a CPU (where TF does not raise OOM errors
quickly), one layer raises ResourceExhaustedError, as TF does on a GPU, whenever
it sees more than 48 rows at once: the callback shrinks the micro-batch, runs
the same batch again, and training completes with every sample used once per
epoch. Writes memory.csv, events.csv, TensorBoard events and memory.png.

    python examples/adaptive_batching.py [--logdir DIR]
"""

import argparse
import os
import tempfile

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

# kvram before TensorFlow: it turns on the CPU allocator's statistics (kvram/__init__.py)
import kvram  # noqa: E402

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402


class PretendGpuMemory(keras.layers.Layer):
    """Raises TF's out-of-memory error above `rows` rows (eager only)."""

    def __init__(self, rows, **kwargs):
        super().__init__(**kwargs)
        self.rows = rows

    def call(self, x):
        if tf.executing_eagerly() and x.shape[0] > self.rows:
            raise tf.errors.ResourceExhaustedError(None, None, f"OOM for {x.shape[0]} rows (simulated)")
        return x


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--logdir", default=os.path.join(tempfile.mkdtemp(), "logs"))
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args(argv)
    keras.utils.set_random_seed(0)
    inputs = keras.Input((32,))
    h = keras.layers.Dense(64, activation="relu")(inputs)
    h = PretendGpuMemory(48)(h)
    model = kvram.Model(inputs, keras.layers.Dense(1)(h))
    model.compile(optimizer="adam", loss="mse", run_eagerly=True)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1024, 32)).astype("float32")
    y = x[:, :1] * 2.0
    controller = kvram.callbacks.AdaptiveBatchSize()
    history = model.fit(x, y, batch_size=256, epochs=args.epochs, verbose=2,
                        callbacks=[controller, kvram.callbacks.MemoryLogger(args.logdir, device="CPU:0")])
    print(f"micro-batch settled at {model.micro_batch_size} after {controller.oom_count} OOM recoveries; "
          f"{int(model.optimizer.iterations.numpy())} updates; logs in {args.logdir}")
    return history.history["loss"], controller


if __name__ == "__main__":
    main()
