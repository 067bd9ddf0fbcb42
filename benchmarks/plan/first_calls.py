"""Which layers of a model take long on their first call at a new batch size on a GPU
(the cut-by-cut measurement's first run of each probe batch): each layer's eager forward
call timed on the host at each batch size in turn, then again at the last one.

    python benchmarks/plan/first_calls.py --model ConvNeXtSmall --rows 16 32 --out first_calls.json
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from kvram import memory  # noqa: E402
from kvram.remat import _profile  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="ConvNeXtSmall")
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--rows", type=int, nargs="+", default=[16, 32])
    parser.add_argument("--policy", default="mixed_bfloat16")
    parser.add_argument("--out", default="first_calls.json")
    args = parser.parse_args(argv)
    keras.config.set_dtype_policy(args.policy)
    model = getattr(keras.applications, args.model)(weights=None, input_shape=(args.size, args.size, 3))
    times = collections.defaultdict(list)

    def timed(layer):
        call = layer.call

        def wrapped(*a, **k):
            t = time.perf_counter()
            out = call(*a, **k)
            times[layer.name].append(time.perf_counter() - t)
            return out

        return wrapped

    for layer in model.layers:
        layer.call = timed(layer)
    result = {"model": args.model, "rows": [], "tensorflow": tf.__version__,
              "TF_CUDNN_USE_AUTOTUNE": os.environ.get("TF_CUDNN_USE_AUTOTUNE")}
    device = memory._device_name(None)
    with _profile.shared_grouped_convolutions(device):
        run(model, args, times, result)
    with open(args.out, "w") as handle:
        json.dump(result, handle, indent=1)


def run(model, args, times, result):
    rng = np.random.default_rng(0)
    for rows in args.rows + [args.rows[-1]]:
        x = tf.constant(rng.random((rows, args.size, args.size, 3)).astype("float32"))
        times.clear()
        t = time.perf_counter()
        with tf.GradientTape() as tape:
            y = model(x, training=True)
            loss = tf.reduce_sum(tf.cast(y, "float32"))
        forward = time.perf_counter() - t
        grads = tape.gradient(loss, model.trainable_variables)
        float(tf.reduce_sum([tf.reduce_sum(tf.cast(g, "float32")) for g in grads]))
        total = time.perf_counter() - t
        by_class = collections.Counter()
        for layer in model.layers:
            by_class[type(layer).__name__] += sum(times.get(layer.name, []))
        slowest = sorted(((sum(v), k) for k, v in times.items()), reverse=True)[:8]
        entry = {"rows": rows, "forward_seconds": forward, "forward_and_gradient_seconds": total,
                 "forward_by_layer_class": dict(by_class.most_common()),
                 "slowest_layers": [[k, v] for v, k in slowest]}
        result["rows"].append(entry)
        print(json.dumps(entry), flush=True)


if __name__ == "__main__":
    main()
