"""Shards from a real dataset: scikit-learn's bundled handwritten digits.

Writes the 1,797 8x8 digit images (shipped inside scikit-learn, nothing is
downloaded) as kvram shards, checks them, and trains a small kvram.Model fed
from the memmapped shards with a shuffled tf.data pipeline and micro-batching.
Shows: write_shards from arrays, ShardedDataset validation and verify(),
to_tf_dataset with per-epoch shuffling, and that the model learns (held-out
accuracy printed at the end). Runs in well under a minute on a CPU.

    python examples/digits_shards.py [--out DIR] [--epochs N]
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
from sklearn.datasets import load_digits  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(tempfile.mkdtemp(), "digits"))
    parser.add_argument("--epochs", type=int, default=40)
    args = parser.parse_args(argv)

    digits = load_digits()
    x = (digits.images / 16.0).astype("float32")[..., None]  # (1797, 8, 8, 1)
    y = digits.target.astype("int32")
    order = np.random.default_rng(0).permutation(len(y))
    train, test = order[:1500], order[1500:]

    shards = kvram.data.write_shards(
        {"image": x[train], "label": y[train]}, args.out, samples_per_shard=512, overwrite=True
    )
    shards.verify()
    print(shards)

    inputs = keras.Input((8, 8, 1))
    h = keras.layers.Conv2D(32, 3, activation="relu", padding="same")(inputs)
    h = kvram.layers.Checkpoint(keras.layers.Conv2D(32, 3, activation="relu", padding="same"))(h)
    h = keras.layers.GlobalAveragePooling2D()(h)
    outputs = keras.layers.Dense(10, activation="softmax")(h)
    model = kvram.Model(inputs, outputs, micro_batch_size=32)
    model.compile(optimizer=keras.optimizers.Adam(3e-3), loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"])
    data = shards.to_tf_dataset(batch_size=128, shuffle=True, seed=0, fields=("image", "label"))
    model.fit(data, epochs=args.epochs, verbose=2)
    _, accuracy = model.evaluate(x[test], y[test], verbose=0)
    print(f"held-out accuracy on {len(test)} digits: {accuracy:.3f}")
    return accuracy


if __name__ == "__main__":
    main()
