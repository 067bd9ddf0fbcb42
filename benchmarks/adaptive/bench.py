"""AdaptiveBatchSize on a memory-capped GPU: Keras ResNet50 started at a batch that does not fit.

Parts `by_hand`, `adaptive`, `find` and `fixed`, each in its own process; float32,
SGD(momentum=0.9), synthetic data, `jit_compile=False` on both sides of the img/s
comparison (an XLA recompile per micro-batch size costs ~1 min for ResNet50).
What each part measures, how to run it, where the result goes: README.md."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)
from benchmarks.common import cap_first_gpu, commit, gpu_name, result_header, run_child, write_result  # noqa: E402
PARTS = ("by_hand", "adaptive", "fixed", "find")


def setup(limit_gib, smoke):
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    import tensorflow as tf

    if limit_gib:
        cap_first_gpu(limit_gib)
    import keras

    shape = (32, 32, 3) if smoke else (224, 224, 3)
    classes = 10 if smoke else 1000
    return tf, keras, shape, classes


def resnet(keras, shape, classes, kvram_model):
    base = keras.applications.ResNet50(weights=None, input_shape=shape, classes=classes)
    if not kvram_model:
        return base
    import kvram

    return kvram.Model(base.inputs, base.outputs, name="resnet50_kvram")


def compile_model(keras, model):
    model.compile(
        optimizer=keras.optimizers.SGD(0.01, momentum=0.9),
        loss="sparse_categorical_crossentropy",
        jit_compile=False,
    )


def batch_of(tf, shape, classes, rows):
    x = tf.random.uniform((rows,) + shape, seed=1)
    y = tf.random.uniform((rows,), maxval=classes, dtype=tf.int32, seed=2)
    return x, y


def fits_by_hand(tf, model, batch, probes):
    """`rows -> bool`: whether two plain `train_on_batch` steps of `batch(rows)`
    fit (the second has the optimizer state too); every try goes to `probes`."""
    from kvram.memory import is_out_of_memory

    def fits(rows):
        started = time.perf_counter()
        x, y = batch(rows)
        try:
            for _ in range(2):
                float(model.train_on_batch(x, y))
            ok, error = True, None
        except (tf.errors.ResourceExhaustedError, tf.errors.InternalError) as exc:
            if not is_out_of_memory(exc):
                raise
            ok, error = False, str(exc).strip().splitlines()[0][:160]
        del x, y
        probes.append({"rows": rows, "fits": ok, "seconds": time.perf_counter() - started,
                       "error": error})
        print(f"by_hand: {rows} {'fits' if ok else 'OOM'} ({probes[-1]['seconds']:.1f} s)", flush=True)
        return ok

    return fits


def bisect(fits, good, bad, precision):
    """(largest size that fits, smallest that does not), `bad - good <= precision`."""
    while bad - good > precision:
        middle = (good + bad) // 2
        if fits(middle):
            good = middle
        else:
            bad = middle
    return good, bad


class StepClock:
    """Per-step end times; each step's loss is read back, so the step is done."""

    def __init__(self, keras):
        times = self.times = []

        class Clock(keras.callbacks.Callback):
            def on_train_batch_end(self, batch, logs=None):
                float(logs["loss"])
                times.append(time.perf_counter())

        self.callback = Clock()

    def rate(self, rows, first):
        """Rows per second over the steps after step index `first`."""
        if len(self.times) - 1 <= first:
            return None
        span = self.times[-1] - self.times[first]
        return rows * (len(self.times) - 1 - first) / span


def part_by_hand(args):
    tf, keras, shape, classes = setup(args.limit_gib, args.smoke)
    model = resnet(keras, shape, classes, kvram_model=False)
    compile_model(keras, model)
    probes = []
    fits = fits_by_hand(tf, model, lambda rows: batch_of(tf, shape, classes, rows), probes)

    good, bad = args.low, None
    size = args.low
    while bad is None:
        if size > 4 * args.batch:
            return {"true_max_rows": None, "note": f"{good} rows fit; stopped looking", "probes": probes}
        if fits(size):
            good, size = size, size * 2
        else:
            bad = size
    good, bad = bisect(fits, good, bad, args.precision)
    return {"true_max_rows": good, "smallest_failing_rows": bad, "precision_rows": args.precision,
            "probes": probes}


def part_adaptive(args):
    tf, keras, shape, classes = setup(args.limit_gib, args.smoke)
    import kvram

    model = resnet(keras, shape, classes, kvram_model=True)
    compile_model(keras, model)
    x, y = batch_of(tf, shape, classes, args.batch)
    data = tf.data.Dataset.from_tensors((x, y)).repeat(args.steps)
    controller = kvram.callbacks.AdaptiveBatchSize()
    clock = StepClock(keras)
    started = time.perf_counter()
    model.fit(data, epochs=1, verbose=0, callbacks=[controller, clock.callback])
    total = time.perf_counter() - started
    events = [e.as_dict() for e in controller.events]
    last_change = max([e["step"] for e in events] + [0])
    first_timed = last_change + 2  # one step after the last change re-traces
    ooms = [e for e in events if e["kind"] == "oom"]
    return {
        "batch_rows": args.batch,
        "steps": args.steps,
        "micro_batch_found": model.micro_batch_size,
        "oom_count": controller.oom_count,
        "changes": len(events) - 1,
        "probes": len(events) - 1,
        "seconds_to_oom": [e["seconds_to_error"] for e in ooms],
        "seconds_to_recover": [e["seconds_to_recover"] for e in ooms],
        "events": events,
        "img_per_s_after_last_change": clock.rate(args.batch, first_timed),
        "timed_steps": max(0, len(clock.times) - 1 - first_timed),
        "fit_seconds": total,
        "optimizer_iterations": int(model.optimizer.iterations.numpy()),
        "limit_bytes": kvram.memory.limit_bytes("GPU:0") if tf.config.list_logical_devices("GPU") else None,
    }


def part_find(args):
    tf, keras, shape, classes = setup(args.limit_gib, args.smoke)
    import kvram

    model = resnet(keras, shape, classes, kvram_model=True)
    compile_model(keras, model)
    sample = batch_of(tf, shape, classes, 8)
    started = time.perf_counter()
    size, probes = kvram.callbacks.find_max_batch_size(
        model, sample, low=args.low, high=args.batch, margin=0.1
    )
    return {"size": size, "probes": probes, "probe_count": len(probes), "low": args.low,
            "high": args.batch, "margin": 0.1, "seconds": time.perf_counter() - started}


def part_fixed(args):
    tf, keras, shape, classes = setup(args.limit_gib, args.smoke)
    model = resnet(keras, shape, classes, kvram_model=False)
    compile_model(keras, model)
    rows = args.rows
    x, y = batch_of(tf, shape, classes, rows)
    data = tf.data.Dataset.from_tensors((x, y)).repeat(args.steps)
    clock = StepClock(keras)
    model.fit(data, epochs=1, verbose=0, callbacks=[clock.callback])
    return {"batch_rows": rows, "steps": args.steps, "img_per_s": clock.rate(rows, 3),
            "timed_steps": args.steps - 4}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=PARTS, action="append")
    parser.add_argument("--limit-gib", type=float, default=16.0)
    parser.add_argument("--batch", type=int, default=512, help="rows per batch fed to fit")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--low", type=int, default=16)
    parser.add_argument("--precision", type=int, default=8)
    parser.add_argument("--rows", type=int, help="fixed part: batch rows (default: by_hand's)")
    parser.add_argument("--smoke", action="store_true", help="32x32 images, for a CPU check")
    parser.add_argument("--timeout", type=int, default=560, help="seconds per part")
    parser.add_argument("--out", default="adaptive.json")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.child:
        result = globals()[f"part_{args.child}"](args)
        print("RESULT " + json.dumps(result), flush=True)
        return

    results = {}
    if os.path.exists(args.out):
        with open(args.out) as handle:
            results = json.load(handle).get("parts", {})
    for part in args.part or PARTS:
        command = [sys.executable, os.path.abspath(__file__), "--child", part,
                   "--limit-gib", str(args.limit_gib), "--batch", str(args.batch),
                   "--steps", str(args.steps), "--low", str(args.low),
                   "--precision", str(args.precision)]
        if args.smoke:
            command.append("--smoke")
        if part == "fixed":
            rows = args.rows or results.get("by_hand", {}).get("true_max_rows")
            if rows is None:
                print("fixed: needs --rows or a by_hand result first", flush=True)
                continue
            command += ["--rows", str(rows)]
        print(f"== {part}: {' '.join(command[1:])}", flush=True)
        started = time.perf_counter()
        records, error, _ = run_child(command, args.timeout)
        record = results[part] = {"error": error} if error else records[-1]
        record.update(wall_seconds=time.perf_counter() - started, commit=commit())
        print(json.dumps({k: v for k, v in record.items() if k not in ("probes", "events")}),
              flush=True)
        write_result(args.out, {**result_header("adaptive", __file__), "gpu": gpu_name(),
                                "limit_gib": args.limit_gib, "parts": results})


if __name__ == "__main__":
    main()
