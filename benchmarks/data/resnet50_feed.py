"""Issue 13: ResNet50 trained on the GPU from image shards (decoded uint8, and
JPEG bytes decoded in tf.data) against the same images from memory, one run.

    python benchmarks/data/resnet50_feed.py --images 20000 --out feed.json

The JPEGs are made (numpy + Pillow, `images.make_images`, nothing downloaded)
and written to shards once (`write_image_shards`, 224x224, shorter side
resized then centre-cropped; reused when `benchmarks/data/images.py` made them
in the same --dir). "Memory" holds the decoded shards' pixels in a host
variable and gathers shuffled batches from it inside tf.data (no file, no
decode: the fastest host feed we know). Every method feeds the same model,
compiled once: Keras ResNet50 (weights=None, 10 classes) behind a uint8 ->
[-1, 1] rescaling, mixed_bfloat16, XLA, SGD, batch 256. Methods run
round-robin, one epoch per `fit()` each round; img/s counts the steps after the
first --skip of each epoch (the loss is read at both ends, so the GPU has
finished), and the whole epoch's rate is reported too. Ratios are against
memory in the same round, and the best round of each method.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import keras

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))
sys.path.insert(0, HERE)


class EpochTimer(keras.callbacks.Callback):
    """Times one epoch of fit(): whole, and from the end of batch `skip`."""

    def __init__(self, skip):
        super().__init__()
        self.skip = skip

    def on_epoch_begin(self, epoch, logs=None):
        self.begin = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        self.batches = batch + 1
        if batch + 1 == self.skip:
            float(logs["loss"])  # waits for the GPU
            self.after_skip = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        float(logs["loss"])
        self.end = time.perf_counter()


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--images", type=int, default=20000)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--skip", type=int, default=5)
    parser.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--dir", default="/tmp/kvram-images-bench")
    parser.add_argument("--model", default="ResNet50")
    parser.add_argument("--out", default="resnet50_feed.json")
    args = parser.parse_args()

    import images  # benchmarks/data/images.py
    import tensorflow as tf

    from kvram import data

    source = os.path.join(args.dir, "jpeg")
    images.make_images(source, args.images)
    shards = {}
    for kind, encoded in (("jpeg", True), ("decoded", False)):
        out = os.path.join(args.dir, f"shards-{kind}")
        try:
            shards[kind] = data.ShardedDataset(out)
            if len(shards[kind]) != args.images:
                raise ValueError("another set")
        except (OSError, ValueError):
            shards[kind] = data.write_image_shards(source, out, size=args.size, workers=args.workers,
                                                   encoded=encoded, overwrite=True, verbose=0)
    every = shards["decoded"].read(0, len(shards["decoded"]))
    steps = len(shards["decoded"]) // args.batch

    gpus = tf.config.list_physical_devices("GPU")
    keras.mixed_precision.set_global_policy("mixed_bfloat16" if gpus else "float32")
    inputs = keras.Input((args.size, args.size, 3), dtype="uint8")
    scaled = keras.layers.Rescaling(1 / 127.5, offset=-1)(inputs)
    body = getattr(keras.applications, args.model)(weights=None, input_shape=(args.size, args.size, 3),
                                                    classes=10)
    model = keras.Model(inputs, body(scaled))
    model.compile(optimizer=keras.optimizers.SGD(0.01, momentum=0.9),
                  loss="sparse_categorical_crossentropy", jit_compile=bool(gpus))

    with tf.device("CPU:0"):
        held_x = tf.Variable(every["x"], trainable=False)
        held_y = tf.Variable(every["y"], trainable=False)

    def from_memory():
        order = tf.data.Dataset.range(len(every["y"])).shuffle(len(every["y"]))
        return (order.batch(args.batch, drop_remainder=True)
                .map(lambda i: (tf.gather(held_x, i), tf.gather(held_y, i)), num_parallel_calls=tf.data.AUTOTUNE)
                .prefetch(tf.data.AUTOTUNE))

    methods = {
        "memory": from_memory,
        "shards_decoded": lambda: shards["decoded"].to_tf_dataset(args.batch, shuffle=True,
                                                                  drop_remainder=True),
        "shards_jpeg": lambda: data.decode_jpeg(shards["jpeg"].to_tf_dataset(args.batch, shuffle=True,
                                                                             drop_remainder=True)),
    }
    sample = next(iter(methods["shards_jpeg"]()))
    print("element", [(t.shape, t.dtype) for t in (sample if isinstance(sample, tuple) else sample.values())])

    result = {"benchmark": "resnet50_feed", "issue": 13, "model": args.model, "images": args.images,
              "batch": args.batch, "size": args.size, "steps_per_epoch": steps, "skip": args.skip,
              "cpus": len(os.sched_getaffinity(0)), "policy": keras.mixed_precision.global_policy().name,
              "jit_compile": bool(gpus), "tensorflow": tf.__version__, "keras": keras.__version__,
              "python": sys.version.split()[0], "date": time.strftime("%Y-%m-%d"),
              "command": " ".join(sys.argv), "rounds": []}
    if gpus:
        result["gpu"] = tf.config.experimental.get_device_details(gpus[0]).get("device_name")
    timer = EpochTimer(args.skip)
    started = time.perf_counter()
    model.fit(methods["memory"]().take(args.skip + 1), verbose=0)  # compiles
    result["compile_seconds"] = time.perf_counter() - started
    for round_number in range(args.rounds):
        row = {}
        for name, make in methods.items():
            history = model.fit(make(), epochs=1, verbose=0, callbacks=[timer])
            assert timer.batches == steps, (name, timer.batches, steps)
            row[name] = {
                "steady_images_per_second": (steps - args.skip) * args.batch / (timer.end - timer.after_skip),
                "epoch_images_per_second": steps * args.batch / (timer.end - timer.begin),
                "loss": float(history.history["loss"][-1]),
            }
        for name in methods:
            for key in ("steady", "epoch"):
                row[name][f"{key}_vs_memory"] = (row[name][f"{key}_images_per_second"]
                                                 / row["memory"][f"{key}_images_per_second"])
        result["rounds"].append(row)
        print(f"round {round_number + 1}:", json.dumps({n: {k: round(v, 3) for k, v in r.items()}
                                                         for n, r in row.items()}), flush=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    best = {name: max(r[name]["steady_images_per_second"] for r in result["rounds"]) for name in methods}
    result["best_steady_images_per_second"] = best
    result["best_vs_memory"] = {name: best[name] / best["memory"] for name in methods}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps(result["best_vs_memory"]))


if __name__ == "__main__":
    main()
