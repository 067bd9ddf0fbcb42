"""Longest sequence that trains, and time per step: keras.layers.MultiHeadAttention
vs kvram.layers.MemoryEfficientAttention under one logical-GPU memory cap.
The model, the search and how to run it: README.md."""

from __future__ import annotations

import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)
from benchmarks.common import (  # noqa: E402
    cap_first_gpu, child_result, gpu_name, result_header, run_children, versions, without_options, write_result,
)

WIDTH, HEADS, KEY_DIM = 512, 8, 64


def child(kind, args):
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    import numpy as np
    import tensorflow as tf

    device = args.device
    if device.startswith("GPU"):
        cap_first_gpu(args.cap_gib)
    import keras

    import kvram
    from kvram.memory import is_out_of_memory

    def model_for(kind):
        keras.utils.set_random_seed(0)
        inputs = keras.Input((None, WIDTH))
        if kind == "mha":
            attention = keras.layers.MultiHeadAttention(HEADS, KEY_DIM)
        else:
            attention = kvram.layers.MemoryEfficientAttention(HEADS, KEY_DIM, chunk_size=args.chunk_size)
        x = attention(inputs, inputs, use_causal_mask=args.causal)
        outputs = keras.layers.Dense(WIDTH)(x)
        model = keras.Model(inputs, outputs)
        model.compile(keras.optimizers.Adam(1e-4), "mse", jit_compile=args.jit)
        return model

    with tf.device(device):
        model = model_for(kind)

    def batch(rows, length):
        with tf.device(device):
            x = tf.random.normal((rows, length, WIDTH))
        return x, tf.zeros_like(x)

    probes = []

    def trains(length):
        x, y = batch(1, length)
        tf.config.experimental.reset_memory_stats(device)
        started = time.perf_counter()
        try:
            for _ in range(2):
                model.train_on_batch(x, y)
            ok, error = True, None
        except (tf.errors.ResourceExhaustedError, tf.errors.InternalError) as e:
            if not is_out_of_memory(e):
                raise
            ok, error = False, f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        peak = tf.config.experimental.get_memory_info(device)["peak"] / 2**30
        probes.append({"length": length, "trains": ok, "peak_gib": peak if ok else None,
                       "seconds": time.perf_counter() - started, "error": error})
        print(f"{kind} length {length}: " + (f"trains ({peak:.2f} GiB peak)" if ok else "fails"), flush=True)
        del x, y
        return ok

    # Time per step first, while nothing has failed in this process.
    timing = {}
    for length in args.time_lengths:
        rows = max(1, args.tokens // length)
        x, y = batch(rows, length)
        try:
            for _ in range(3):
                model.train_on_batch(x, y)
            seconds = []
            for _ in range(args.repeats):
                started = time.perf_counter()
                model.train_on_batch(x, y)  # returns the loss as numpy: waits for the step
                seconds.append(time.perf_counter() - started)
            timing[str(length)] = {"rows": rows, "median_s": float(np.median(seconds)),
                                   "min_s": float(np.min(seconds))}
        except (tf.errors.ResourceExhaustedError, tf.errors.InternalError) as e:
            if not is_out_of_memory(e):
                raise
            timing[str(length)] = {"rows": rows, "error": type(e).__name__}
        print(f"{kind} time at {length}x{rows}: {timing[str(length)]}", flush=True)
        del x, y

    low, high = None, None
    length = args.start
    while length <= args.max_length:
        if trains(length):
            low, length = length, length * 2
        else:
            high = length
            break
    if low is not None and high is not None:
        while high / low > 1.125:
            middle = int(round((low * high) ** 0.5 / 256)) * 256
            if middle in (low, high):
                break
            if trains(middle):
                low = middle
            else:
                high = middle
    return {
        "versions": versions(),
        "kind": kind,
        "longest_that_trains": low,
        "shortest_that_fails": high,
        "probes": probes,
        "time_per_step": timing,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cap-gib", type=float, default=16.0)
    parser.add_argument("--chunk-size", type=int, default=512)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--jit", action="store_true", help="compile both with XLA")
    parser.add_argument("--start", type=int, default=1024)
    parser.add_argument("--max-length", type=int, default=1 << 20)
    parser.add_argument("--time-lengths", type=int, nargs="*", default=[1024, 2048, 4096])
    parser.add_argument("--tokens", type=int, default=16384, help="tokens per batch when timing")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--device", default="GPU:0")
    parser.add_argument("--only", choices=["mha", "mea"], action="append")
    parser.add_argument("--out", default=None)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child_result(child(args.child, args))
        return
    results = run_children(
        __file__, args.only or ["mha", "mea"], without_options(sys.argv[1:], ("--out",)),
        lambda r: f"longest that trains {r['longest_that_trains']}, fails at {r['shortest_that_fails']}",
    )
    report = {
        **result_header("attention-longest-sequence", __file__),
        "gpu": gpu_name(),
        "cap_gib": args.cap_gib,
        "model": f"self-attention {HEADS}x{KEY_DIM} on width {WIDTH} + Dense, Adam, mse, batch 1",
        "chunk_size": args.chunk_size,
        "causal": args.causal,
        "jit_compile": args.jit,
        "results": results,
    }
    mha, mea = results.get("mha", {}), results.get("mea", {})
    if mha.get("longest_that_trains") and mea.get("longest_that_trains"):
        report["length_ratio"] = mea["longest_that_trains"] / mha["longest_that_trains"]
        report["time_ratio"] = {
            length: mea["time_per_step"][length]["median_s"] / t["median_s"]
            for length, t in mha["time_per_step"].items()
            if "median_s" in t and "median_s" in mea["time_per_step"].get(length, {})
        }
        print("length ratio", report["length_ratio"], "time ratio", report["time_ratio"], flush=True)
    write_result(args.out, report)


if __name__ == "__main__":
    main()
