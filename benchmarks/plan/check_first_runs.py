"""Where `kvram plan`'s XLA check of a step spends its time: the trace, the
first call (conversion to HLO, XLA's compile and the first run) and the calls
after it, of the check's training step (`kvram.remat._check._training_step`,
without recomputation, jit-compiled) for a `keras.applications` model under
`mixed_bfloat16`, timed apart, each call waited for. Run with the XLA flags the
estimate's process compiles its checks with (`kvram._plan_process`: the
user's XLA_FLAGS plus autotuning off and the quick-compile flags) unless
`--as-given`:

    source /tmp/tf-env.sh   # on the GPU machine (../shared/gpu/README.md)
    python3 benchmarks/plan/check_first_runs.py --model ResNet50 --rows 128 [--out runs.json]
    TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=gpu_compiler=1 python3 benchmarks/plan/check_first_runs.py ...

With the second form XLA logs RunHloPasses and RunBackend with their times:
the first call less those is the conversion and the first run. `--rows-before`
runs the step at other rows first (each a compile and a first run of its own),
as a check follows the probes' sizes.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "benchmarks"))
import common  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="ResNet50", help="a keras.applications name")
    parser.add_argument("--rows", type=int, default=128)
    parser.add_argument("--rows-before", type=int, nargs="*", default=[])
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--as-given", action="store_true", help="XLA_FLAGS as they are")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    if not args.as_given:
        from kvram import _plan_process

        os.environ.update(_plan_process.checking_environment())
    flags = os.environ.get("XLA_FLAGS", "")

    import tensorflow as tf

    from kvram import memory

    model, step, x, y = check_step(args.model, args.size, args.rows)
    device = memory._device_name(None)
    mark("trace")
    start = time.perf_counter()
    step.get_concrete_function()
    traced = time.perf_counter() - start

    def timed_calls(x, y, n):
        """[seconds], [peak bytes beyond the call's start] of n calls"""
        times, peaks = [], []
        for i in range(n):
            mark(f"call {i + 1} of {n} at {_rows(x)} rows")
            memory.collect_garbage()
            memory.reset_peak(device)
            at = memory.current_bytes(device)
            start = time.perf_counter()
            gradients = step(x, y)
            float(tf.reduce_sum(tf.cast(gradients[-1], "float32")))  # waits for the step
            peaks.append(memory.peak_bytes(device) - at)
            del gradients
            times.append(round(time.perf_counter() - start, 3))
        mark("calls done")
        return times, peaks

    before = {str(rows): timed_calls(*batch(rows, args.size), 2)[0] for rows in args.rows_before}
    calls, peaks = timed_calls(x, y, args.calls)
    report({
        "model": args.model, "rows": args.rows, "size": args.size, "policy": "mixed_bfloat16",
        "device": device, "xla_flags": flags, "trace_s": round(traced, 2),
        "calls_before_s": before, "calls_s": calls,
        # each call's peak beyond what was allocated before it, the first (compiling) one included
        "call_peaks_bytes": peaks, "peak_gib": round(max(peaks) / 2**30, 3),
    }, args.out)


def mark(what):
    """A line on stderr stamped like TensorFlow's log lines, for
    `log_gaps.py` to split the log by call."""
    print(f"{datetime.datetime.now():%Y-%m-%d %H:%M:%S.%f}: MARK {what}", file=sys.stderr, flush=True)


def _rows(x):
    return int(x.shape[0])


def batch(rows, size):
    """A batch of `rows` random images of size x size and their labels."""
    import tensorflow as tf

    return tf.random.uniform((rows, size, size, 3)), tf.zeros((rows,), "int64")


def check_step(name, size, rows):
    """(model, step, x, y): the `keras.applications` model `name` under
    `mixed_bfloat16`, the step `kvram plan`'s XLA check runs of it without
    recomputation (not yet traced), and a batch of `rows`."""
    import keras

    from kvram.remat._check import _loss_function, _training_step

    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    model = getattr(keras.applications, name)(weights=None, input_shape=(size, size, 3), classes=1000)
    x, y = batch(rows, size)
    return model, _training_step(model, x, y, _loss_function(model, "sparse_categorical_crossentropy"), True), x, y


def report(record, out):
    """Prints `record`, and writes it to `out` if given, with what
    `common.write_record` adds (the command, versions, CPUs, date)."""
    print(json.dumps(record, indent=1))
    if out:
        common.write_record(out, record)

if __name__ == "__main__":
    main()
