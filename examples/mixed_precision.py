"""Mixed precision: the same ViT trained in float32, mixed_bfloat16 and mixed_float16.

Trains the small ViT of models/vit.py (Checkpoint blocks, MemoryEfficientAttention)
on a synthetic task (which quadrant of the image is brightest) under each policy,
from the same initial weights, and prints the peak memory of a forward and backward pass,
the final loss and accuracy, and under float16 the loss scale and the steps kvram
skipped. The peak is that of one forward and backward pass on 256 images (the
activations; float32 weights and Adam's slots are the same in every policy).
Variables stay float32 in every policy; activations are 16-bit in the
mixed ones, which is where the memory goes. Under mixed_float16 Keras wraps the
optimizer in a LossScaleOptimizer (dynamic loss scaling); bfloat16 needs none.

    python examples/mixed_precision.py [--samples 1024] [--batch 32] [--epochs 3] [--size 32] [--depth 4]
"""

import argparse
import os
import sys

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# kvram before TensorFlow: it turns on the CPU allocator's statistics (kvram/__init__.py)
import kvram  # noqa: E402

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from models.vit import vit_tiny  # noqa: E402

POLICIES = ("float32", "mixed_bfloat16", "mixed_float16")


def quadrant_images(n, size=32, seed=0):
    """Noise images with one brighter quadrant; the label is that quadrant."""
    rng = np.random.default_rng(seed)
    x = rng.uniform(0.0, 0.5, (n, size, size, 3)).astype("float32")
    y = rng.integers(0, 4, n)
    h = size // 2
    for i, q in enumerate(y):
        r, c = divmod(int(q), 2)
        x[i, r * h:(r + 1) * h, c * h:(c + 1) * h] += 1.0
    return x, y


def gradient_peak(model, x, y, calls=3):
    """Peak bytes allocated on CPU:0 by a forward and backward pass (the
    activations a training step holds; weights and optimizer state excluded):
    the lowest of `calls` passes, as the order TensorFlow's executor runs
    independent ops in, and so the peak, moves from call to call (float16's
    share of float32's peak measured 0.72-0.88x from one pass each)."""
    x, y = tf.constant(x), tf.constant(y)

    @tf.function
    def gradients():
        with tf.GradientTape() as tape:
            logits = model(x, training=True)
            loss = keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True)
        return tape.gradient(loss, model.trainable_weights)

    gradients.get_concrete_function()
    peaks = []
    for _ in range(calls):
        kvram.memory.reset_peak("CPU:0")
        start = kvram.memory.current_bytes("CPU:0")
        [g.numpy() for g in gradients()]
        peaks.append(kvram.memory.peak_bytes("CPU:0") - start)
    return min(peaks)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--size", type=int, default=32, help="image side in pixels (a multiple of 8)")
    parser.add_argument("--depth", type=int, default=4, help="the ViT's blocks")
    args = parser.parse_args(argv)
    x, y = quadrant_images(args.samples, args.size)
    x_test, y_test = quadrant_images(256, args.size, seed=1)
    results = {}
    initial = None
    for policy in POLICIES:
        kvram.precision.enable(policy)
        keras.utils.set_random_seed(0)
        with tf.device("CPU:0"):
            model = vit_tiny(image_size=args.size, classes=4, depth=args.depth)
            if initial is None:
                initial = model.get_weights()
            model.set_weights(initial)
            model.compile(
                optimizer=keras.optimizers.Adam(1e-3),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                metrics=["accuracy"],
            )
            history = model.fit(x, y, batch_size=args.batch, epochs=args.epochs, verbose=0)
            _, accuracy = model.evaluate(x_test, y_test, verbose=0)
            peak = gradient_peak(model, x[:256], y[:256])
        results[policy] = {
            "peak_mib": peak / 2**20,
            "loss": history.history["loss"][-1],
            "accuracy": accuracy,
            "loss_scale": kvram.precision.loss_scale(model),
            "skipped_steps": int(model.skipped_steps),
        }
        r = results[policy]
        scale = f"  loss scale {r['loss_scale']:.0f}" if r["loss_scale"] else ""
        print(f"{policy:15} fwd+bwd peak {r['peak_mib']:6.1f} MiB  loss {r['loss']:.4f}  "
              f"test accuracy {r['accuracy']:.3f}  skipped {r['skipped_steps']}{scale}")
    kvram.precision.enable("float32")
    for policy in POLICIES[1:]:
        print(f"{policy}: {results[policy]['peak_mib'] / results['float32']['peak_mib']:.2f}x "
              "the memory of float32")
    return results


if __name__ == "__main__":
    main()
