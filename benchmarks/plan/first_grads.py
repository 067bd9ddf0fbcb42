"""How long one depthwise 7x7 convolution's three ops (forward, the input's gradient, the
filter's gradient) take on their first call at each new batch size on a GPU: host time of
each eager call until its result is read, for ConvNeXt's first two stage shapes (56x56x96,
28x28x192). One route and dtype a process: TensorFlow's DepthwiseConv2dNative ops, or its
Conv2D ops with one input channel a group (what `kvram.remat._profile` measures with).

    TF_CUDNN_USE_AUTOTUNE=0 python benchmarks/plan/first_grads.py --route grouped --out fg.json
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402

ONE = (1, 1, 1, 1)
SHAPES = ((56, 96), (28, 192))


def ops(route, x, dy, dtype):
    channels = x.shape[-1]
    if route == "depthwise":
        k = tf.random.normal((7, 7, channels, 1), dtype=dtype)
        return {
            "forward": lambda: tf.nn.depthwise_conv2d(x, k, ONE, "SAME"),
            "input_grad": lambda: tf.raw_ops.DepthwiseConv2dNativeBackpropInput(
                input_sizes=tf.shape(x), filter=k, out_backprop=dy, strides=ONE, padding="SAME"),
            "filter_grad": lambda: tf.raw_ops.DepthwiseConv2dNativeBackpropFilter(
                input=x, filter_sizes=tf.shape(k), out_backprop=dy, strides=ONE, padding="SAME"),
        }
    k = tf.random.normal((7, 7, 1, channels), dtype=dtype)
    return {
        "forward": lambda: tf.raw_ops.Conv2D(input=x, filter=k, strides=ONE, padding="SAME"),
        "input_grad": lambda: tf.raw_ops.Conv2DBackpropInput(
            input_sizes=tf.shape(x), filter=k, out_backprop=dy, strides=ONE, padding="SAME"),
        "filter_grad": lambda: tf.raw_ops.Conv2DBackpropFilter(
            input=x, filter_sizes=tf.shape(k), out_backprop=dy, strides=ONE, padding="SAME"),
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--route", choices=["depthwise", "grouped"], default="depthwise")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--rows", type=int, nargs="+", default=[16, 32, 48, 32])
    parser.add_argument("--out", default="first_grads.json")
    args = parser.parse_args(argv)
    record = {"route": args.route, "dtype": args.dtype, "rows": args.rows,
              "TF_CUDNN_USE_AUTOTUNE": os.environ.get("TF_CUDNN_USE_AUTOTUNE"),
              "TF_CUDNN_USE_FRONTEND": os.environ.get("TF_CUDNN_USE_FRONTEND"),
              "calls": [], "columns": ["op", "height", "rows", "seconds"]}
    tf.matmul(tf.ones((8, 8)), tf.ones((8, 8))).numpy()  # the GPU's start, not timed
    for rows in args.rows:
        for size, channels in SHAPES:
            x = tf.random.normal((rows, size, size, channels), dtype=args.dtype)
            dy = tf.random.normal((rows, size, size, channels), dtype=args.dtype)
            for name, op in ops(args.route, x, dy, args.dtype).items():
                started = time.perf_counter()
                float(tf.reduce_sum(tf.cast(op(), "float32")))
                record["calls"].append([name, size, rows, time.perf_counter() - started])
    print(args.route, args.dtype, " ".join(f"{n[0]}{h}@{r}:{s:.2f}" for n, h, r, s in record["calls"]))
    record.update(tensorflow=tf.__version__, date=time.strftime("%Y-%m-%d"))
    with open(args.out, "w") as handle:
        json.dump(record, handle, indent=1)


if __name__ == "__main__":
    main()
