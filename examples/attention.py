"""Memory-efficient attention: MultiHeadAttention's result at a fraction of its memory.

Runs keras.layers.MultiHeadAttention and kvram.layers.MemoryEfficientAttention
with the same weights on one sequence, checks that outputs and gradients agree,
and prints the peak CPU memory of a forward+backward pass for each.

    python examples/attention.py [--length 2048]
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


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=2048)
    args = parser.parse_args(argv)
    keras.utils.set_random_seed(0)
    x = tf.random.normal((1, args.length, 64))
    plain = keras.layers.MultiHeadAttention(4, 16)
    efficient = kvram.layers.MemoryEfficientAttention(4, 16, chunk_size=256)
    plain(x[:, :4], x[:, :4])
    efficient(x[:, :4], x[:, :4])
    efficient.set_weights(plain.get_weights())
    results = {}
    with tf.device("CPU:0"):
        for name, layer in (("MultiHeadAttention", plain), ("MemoryEfficientAttention", efficient)):
            @tf.function
            def step():
                with tf.GradientTape() as tape:
                    out = layer(x, x, use_causal_mask=True)
                    loss = tf.reduce_sum(out ** 2)
                return out, tape.gradient(loss, layer.trainable_weights)

            step.get_concrete_function()
            kvram.memory.reset_peak("CPU:0")
            start = kvram.memory.current_bytes("CPU:0")
            out, grads = step()
            out = out.numpy()
            results[name] = (kvram.memory.peak_bytes("CPU:0") - start, out, [g.numpy() for g in grads])
            print(f"{name:25} peak {results[name][0] / 2**20:8.1f} MiB")
    a, b = results["MultiHeadAttention"], results["MemoryEfficientAttention"]
    print(f"max output difference {np.max(np.abs(a[1] - b[1])):.2e}; "
          f"memory {b[0] / a[0]:.2f}x at length {args.length}")
    return a[0], b[0], float(np.max(np.abs(a[1] - b[1])))


if __name__ == "__main__":
    main()
