"""AdaptiveBatchSize on a model nobody here wrote: Keras EfficientNetV2S under a
16 GiB cap, against plain Keras at the largest fixed batch that fits.

The setup of issue 15: `keras.applications.EfficientNetV2S(weights=None)`
(384x384x3, 1000 classes), mixed_bfloat16, SGD(0.01, momentum 0.9), synthetic
data, `jit_compile=False`, one GPU split into a logical GPU with `--limit-gib`.
Each part runs in its own process (clean allocator, nothing compiled before)
and prints one JSON record:

- `by_hand`: the largest batch plain Keras trains (two `train_on_batch` steps per
  size), by bisection between `--lo` and `--hi` to `--precision` rows; no kvram code.
- `adaptive`: `kvram.Model` + `AdaptiveBatchSize(verbose=1)` fed `--steps` batches of
  `--batch` rows (which do not fit): wall time of the whole `fit()` (tracing,
  probes and autotuning included), OOMs, traces, every decision, peak memory.
- `fixed_steps`: plain Keras `fit()` of `--steps` steps at `--rows` (the by_hand
  maximum), wall time of the whole `fit()`.
- `fixed_images`: plain Keras `fit()` over the same `--steps * --batch` images at
  batch `--rows`, wall time of the whole `fit()`.

    python benchmarks/adaptive/efficientnet.py --part by_hand --lo 96 --hi 192 --out e.json
    python benchmarks/adaptive/efficientnet.py --part adaptive --part fixed_steps \\
        --part fixed_images --rows 136 --out e.json
    python benchmarks/adaptive/efficientnet.py --smoke --out smoke.json   # CPU check, 64x64
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from bench import (  # noqa: E402
    ROOT, _commit, bisect, compile_model, environment, fits_by_hand, run_part,
)

PARTS = ("by_hand", "adaptive", "fixed_steps", "fixed_images", "micro")


def setup(args):
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    import tensorflow as tf

    gpus = tf.config.list_physical_devices("GPU")
    if gpus and args.limit_gib:
        tf.config.set_logical_device_configuration(
            gpus[0], [tf.config.LogicalDeviceConfiguration(memory_limit=int(args.limit_gib * 1024))]
        )
    sys.path.insert(0, ROOT)
    import keras

    keras.config.set_dtype_policy(args.policy)
    shape = (64, 64, 3) if args.smoke else (384, 384, 3)
    classes = 10 if args.smoke else 1000
    return tf, keras, shape, classes


def build(keras, shape, classes, kvram_model):
    base = keras.applications.EfficientNetV2S(weights=None, input_shape=shape, classes=classes)
    if not kvram_model:
        return base
    import kvram

    return kvram.Model(base.inputs, base.outputs, name="efficientnetv2s_kvram")


def batch_of(tf, shape, classes, rows):
    x = tf.random.uniform((rows,) + shape, maxval=255.0, seed=1)
    y = tf.random.uniform((rows,), maxval=classes, dtype=tf.int32, seed=2)
    return x, y


def device(tf):
    return "GPU:0" if tf.config.list_logical_devices("GPU") else "CPU:0"


def timed_fit(tf, model, data, callbacks=()):
    """Wall seconds of a whole fit() (trace, compile, autotune, every step) and
    each step's end time; every step's loss is read back, so the clock stops
    after the device finished."""
    import keras

    ends = []

    class Clock(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            float(logs["loss"])
            ends.append(time.perf_counter())

    dev = device(tf)
    tf.config.experimental.reset_memory_stats(dev)
    started = time.perf_counter()
    history = model.fit(data, epochs=1, verbose=0, callbacks=[*callbacks, Clock()])
    seconds = time.perf_counter() - started
    return {
        "fit_seconds": seconds,
        "first_step_seconds": ends[0] - started if ends else None,
        "step_seconds_after_first": [b - a for a, b in zip(ends, ends[1:])],
        "steps": len(ends),
        "final_loss": float(history.history["loss"][-1]),
        "peak_bytes": int(tf.config.experimental.get_memory_info(dev)["peak"]),
    }


def part_by_hand(args):
    tf, keras, shape, classes = setup(args)
    model = build(keras, shape, classes, kvram_model=False)
    compile_model(keras, model)
    probes = []
    fits = fits_by_hand(tf, model, lambda rows: batch_of(tf, shape, classes, rows), probes)
    if not fits(args.lo):
        return {"true_max_rows": None, "note": f"--lo {args.lo} does not fit", "probes": probes}
    good, bad = bisect(fits, args.lo, args.hi, args.precision)
    return {"true_max_rows": good, "smallest_failing_rows": bad, "precision_rows": args.precision,
            "assumed_failing": args.hi, "probes": probes}


def time_phases(tf):
    """Where the first steps' time goes, from wrappers around kvram's training
    function: tracing the gradient pass, each run of it (probes included, by
    rows and micro-batch) and of the update. Runs read one value back, so a
    phase ends when the device has finished it. Only the first 24 are kept."""
    from kvram.training import _train_function as train_function

    phases, cls = [], train_function.TrainFunction
    origin = time.perf_counter()

    def timed(name, call, *args, sync=True):
        started = time.perf_counter()
        out = call(*args)
        if len(phases) < 24:
            values = [v for v in tf.nest.flatten(out) if isinstance(v, tf.Tensor)] if sync else []
            if values:
                float(tf.reduce_sum(tf.cast(values[-1], tf.float32)))
            phases.append({"phase": name, "seconds": time.perf_counter() - started,
                           "at": started - origin})
        return out

    gradients_function, apply_ = cls.gradients_function, cls._apply

    def gradients_function_timed(self, data):
        function = timed("trace gradient pass", gradients_function, self, data, sync=False)

        def run(part, size):
            rows = int(tf.shape(tf.nest.flatten(part)[0])[0])
            return timed(f"gradient pass {rows} rows at {int(size)}", function, part, size)

        return run

    def apply_timed(self):
        function = apply_(self)
        return lambda result: timed("update", function, result)

    cls.gradients_function, cls._apply = gradients_function_timed, apply_timed
    return phases


def part_adaptive(args):
    tf, keras, shape, classes = setup(args)
    import kvram

    model = build(keras, shape, classes, kvram_model=True)
    compile_model(keras, model)
    x, y = batch_of(tf, shape, classes, args.batch)
    data = tf.data.Dataset.from_tensors((x, y)).repeat(args.steps)
    controller = kvram.callbacks.AdaptiveBatchSize(verbose=1)
    phases = time_phases(tf)
    record = timed_fit(tf, model, data, [controller])
    record["phases"] = phases
    function = model.train_function
    gradient_traces = sum(  # the gradient pass: for any size, and one per size (static)
        f.experimental_get_tracing_count() for key, f in function._functions.items()
        if key != "apply"
    )
    events = [e.as_dict() for e in controller.events]
    ooms = [e for e in events if e["kind"] == "oom"]
    record.update(
        batch_rows=args.batch,
        micro_batch_final=model.micro_batch_size,
        oom_count=controller.oom_count,
        seconds_to_oom=[e["seconds_to_error"] for e in ooms],
        size_changes=sum(e["kind"] in ("grow", "shrink", "oom") for e in events),
        gradient_pass_traces=gradient_traces,
        traces_total=function.tracing_count(),
        events=events,
        optimizer_iterations=int(model.optimizer.iterations.numpy()),
        limit_bytes=kvram.memory.limit_bytes(device(tf)),
        images=args.batch * args.steps,
    )
    return record


def part_fixed(args, steps):
    tf, keras, shape, classes = setup(args)
    model = build(keras, shape, classes, kvram_model=False)
    compile_model(keras, model)
    rows = args.rows
    x, y = batch_of(tf, shape, classes, args.batch)
    images = steps * rows if steps else args.batch * args.steps
    # The same images as `adaptive` (its batch repeated), cut into batches of `rows`.
    xs = tf.data.Dataset.from_tensors((x, y)).repeat(args.steps).unbatch()
    data = xs.take(images).batch(rows)
    record = timed_fit(tf, model, data)
    steps = sorted(record["step_seconds_after_first"])
    record.update(batch_rows=rows, images=images, steady_img_per_s=rows / steps[len(steps) // 2])
    return record


def part_fixed_steps(args):
    return part_fixed(args, args.steps)


def part_fixed_images(args):
    return part_fixed(args, None)


def part_micro(args):
    """kvram.Model on `--steps` batches of `--rows` at a fixed micro-batch `--micro`
    (0: none): through the fixed-size step (static slice shapes when the size
    divides the batch), or with `--pinned`, through AdaptiveBatchSize held at
    that size (the size is a tensor: slice shapes unknown to the graph)."""
    tf, keras, shape, classes = setup(args)
    import kvram

    model = build(keras, shape, classes, kvram_model=True)
    callbacks = []
    if args.pinned:
        callbacks.append(kvram.callbacks.AdaptiveBatchSize(
            min_micro_batch=args.micro, max_micro_batch=args.micro, probe=False, verbose=0))
    else:
        model.micro_batch_size = args.micro or None
    compile_model(keras, model)
    x, y = batch_of(tf, shape, classes, args.rows)
    data = tf.data.Dataset.from_tensors((x, y)).repeat(args.steps)
    record = timed_fit(tf, model, data, callbacks)
    steps = sorted(record["step_seconds_after_first"])
    record.update(batch_rows=args.rows, micro_batch_size=args.micro or None, pinned=args.pinned,
                  steady_img_per_s=args.rows / steps[len(steps) // 2])
    return record


def summarize(parts: dict) -> dict:
    adaptive = parts.get("adaptive", {})
    summary = {}
    for key in ("fixed_steps", "fixed_images"):
        other = parts.get(key, {})
        if "fit_seconds" in adaptive and "fit_seconds" in other:
            summary[f"adaptive_over_{key}"] = adaptive["fit_seconds"] / other["fit_seconds"]
            summary[f"img_per_s_{key}"] = other["images"] / other["fit_seconds"]
    if "fit_seconds" in adaptive:
        summary["img_per_s_adaptive"] = adaptive["images"] / adaptive["fit_seconds"]
        summary["adaptive_ooms"] = adaptive["oom_count"]
        summary["adaptive_traces_after_first"] = adaptive["gradient_pass_traces"] - 1
    return summary


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=PARTS, action="append")
    parser.add_argument("--limit-gib", type=float, default=16.0)
    parser.add_argument("--policy", default="mixed_bfloat16")
    parser.add_argument("--batch", type=int, default=512, help="rows per batch fed to the adaptive fit")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rows", type=int, help="fixed parts: batch rows (default: by_hand's)")
    parser.add_argument("--lo", type=int, default=64, help="by_hand: a batch that fits")
    parser.add_argument("--hi", type=int, default=256, help="by_hand: a batch taken not to fit")
    parser.add_argument("--precision", type=int, default=8)
    parser.add_argument("--micro", type=int, default=0, help="micro part: micro-batch (0: none)")
    parser.add_argument("--pinned", action="store_true",
                        help="micro part: through AdaptiveBatchSize held at --micro")
    parser.add_argument("--smoke", action="store_true", help="64x64 images, for a CPU check")
    parser.add_argument("--timeout", type=int, default=560, help="seconds per part")
    parser.add_argument("--out", default="efficientnet.json")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.child:
        result = globals()[f"part_{args.child}"](args)
        print("RESULT " + json.dumps(result), flush=True)
        return

    report = {}
    if os.path.exists(args.out):
        with open(args.out) as handle:
            report = json.load(handle)
    parts = report.get("parts", {})
    for part in args.part or PARTS:
        command = [sys.executable, os.path.abspath(__file__), "--child", part,
                   "--limit-gib", str(args.limit_gib), "--policy", args.policy,
                   "--batch", str(args.batch), "--steps", str(args.steps),
                   "--lo", str(args.lo), "--hi", str(args.hi), "--precision", str(args.precision)]
        if args.smoke:
            command.append("--smoke")
        key = part
        if part == "micro":
            command += ["--rows", str(args.rows), "--micro", str(args.micro)]
            command += ["--pinned"] if args.pinned else []
            key = f"micro_{args.rows}_{args.micro or 'none'}" + ("_pinned" if args.pinned else "")
        if part.startswith("fixed"):
            rows = args.rows or parts.get("by_hand", {}).get("true_max_rows")
            if rows is None:
                print(f"{part}: needs --rows or a by_hand result first", flush=True)
                continue
            command += ["--rows", str(rows)]
        print(f"== {part}: {' '.join(command[2:])}", flush=True)
        record, seconds = run_part(command, f"{os.path.splitext(args.out)[0]}_{key}.log",
                                   args.timeout, ("AdaptiveBatchSize", "by_hand"))
        record["process_seconds"] = seconds
        record["commit"] = _commit()
        parts[key] = record
        print(json.dumps({k: v for k, v in record.items()
                          if k not in ("probes", "events", "step_seconds_after_first", "log_tail")}),
              flush=True)
        report = {"benchmark": "benchmarks/adaptive/efficientnet.py", "environment": environment(),
                  "limit_gib": args.limit_gib, "policy": args.policy,
                  "command": "python " + " ".join(sys.argv), "parts": parts,
                  "summary": summarize(parts)}
        with open(args.out, "w") as handle:
            json.dump(report, handle, indent=1)
    print("SUMMARY " + json.dumps(report.get("summary", {})), flush=True)


if __name__ == "__main__":
    main()
