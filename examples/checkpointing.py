"""Gradient checkpointing: the same training, less activation memory.

Trains a 12-block residual MLP twice on the CPU, plain and with every block in
kvram.layers.Checkpoint, from the same initial weights, and prints the peak
memory of a training step (TF allocator statistics) and the final losses, which
match: checkpointing recomputes activations in the backward pass instead of
keeping them.

    python examples/checkpointing.py [--blocks 12] [--width 256] [--batch 1024]
"""

import argparse
import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

# kvram before TensorFlow: it turns on the CPU allocator's statistics (kvram/__init__.py)
import kvram  # noqa: E402

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402


def build(blocks, width, checkpoint):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((width,))
    x = inputs
    for _ in range(blocks):
        block = keras.Sequential([
            keras.layers.LayerNormalization(),
            keras.layers.Dense(4 * width, activation="gelu"),
            keras.layers.Dense(width),
        ])
        y = kvram.layers.Checkpoint(block)(x) if checkpoint else block(x)
        x = keras.layers.Add()([x, y])
    model = kvram.Model(inputs, keras.layers.Dense(1)(x))
    model.compile(optimizer=keras.optimizers.SGD(1e-4), loss="mse")
    return model


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=12)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--batch", type=int, default=1024)
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4 * args.batch, args.width)).astype("float32")
    y = rng.standard_normal((4 * args.batch, 1)).astype("float32")
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(args.batch)
    results = {}
    with tf.device("CPU:0"):
        for checkpoint in (False, True):
            model = build(args.blocks, args.width, checkpoint)
            model.fit(data.take(1), verbose=0)  # trace and build
            kvram.memory.reset_peak("CPU:0")
            start = kvram.memory.current_bytes("CPU:0")
            history = model.fit(data, epochs=2, verbose=0)
            peak = kvram.memory.peak_bytes("CPU:0") - start
            results[checkpoint] = (peak, history.history["loss"][-1])
            print(f"checkpoint={checkpoint!s:5}  step peak {peak / 2**20:7.1f} MiB  "
                  f"final loss {history.history['loss'][-1]:.6f}")
    print(f"checkpointing: {results[True][0] / results[False][0]:.2f}x the memory, same loss")
    return results


if __name__ == "__main__":
    main()
