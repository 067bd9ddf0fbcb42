"""Whether XLA's buffer assignment, read without running the step, gives the
peak that the XLA check measures by running it: for `keras.applications`
models, the check's step (`kvram.remat._check._training_step`, jit-compiled,
as `kvram plan`'s estimate checks it) is compiled without a run
(`experimental_get_compiler_ir(...)(stage="optimized_hlo_proto_serialized")`:
an `HloProto` with its buffer assignment, in the process, nothing dumped; the
same bytes by kind as XLA's `--xla_dump_to` buffer-assignment file, which
5a28a2a's version of this script read, on MobileNetV3Small on the CPU), then
called once (a compile of its own, and its run) and measured by the check's
own `_step_peak_or_raise` run as the CPU's check runs it (the compiling
call's run is the one measured; kvram's check on an untuned GPU reads the
assignment instead, `_check._reads_assignment`, switched off here). Prints
and records, per model, the bytes of the assignment by kind
(`kvram.remat._check._assignment`: the preallocated temporary buffer,
outputs, parameters) beside the measured peak. A check that reads the assignment
skips the step's run (on a GPU with autotuning off, 9.4 s of untuned
convolutions for ResNet50 at 128 rows, `plan_minute_h200/4909fb3_first_runs/`).

    python benchmarks/plan/buffer_assignment_peaks.py [--models ResNet50:128 ...] [--size 224] [--out peaks.json]

On a GPU, run with the estimate's flags added to XLA_FLAGS
(`--xla_gpu_autotune_level=0`, `kvram._plan_process.QUICK_COMPILE`) to
compile as the check does.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from unittest import mock

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "benchmarks"))
import common  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="*", default=["MobileNetV3Small:8", "ResNet50:4"],
                        help="keras.applications name:rows")
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--out", default=None)
    parser.add_argument("--compile-only", action="store_true",
                        help="compile and read the assignment only (no run: for the compile's time under XLA_FLAGS)")
    args = parser.parse_args()

    from kvram import memory  # kvram before TensorFlow: the CPU allocator's statistics

    import keras
    import tensorflow as tf

    from kvram.remat import _check
    from kvram.remat._check import _loss_function, _training_step

    device = memory._device_name(None)
    results = {}
    for spec in args.models:
        name, rows = spec.split(":")[0], int(spec.split(":")[1])
        keras.config.set_dtype_policy("mixed_bfloat16" if device.startswith("GPU") else "float32")
        model = getattr(keras.applications, name)(weights=None, input_shape=(args.size, args.size, 3), classes=10)
        x, y = tf.random.uniform((rows, args.size, args.size, 3)), tf.zeros((rows,), "int64")
        step = _training_step(model, x, y, _loss_function(model, "sparse_categorical_crossentropy"), True)
        start = time.perf_counter()
        assigned = _check._assignment(step, x, y)
        compiled = time.perf_counter() - start
        if args.compile_only:
            results[name] = {"rows": rows, "compile_only_s": round(compiled, 2), "assignment_bytes": assigned}
            print(name, results[name], flush=True)
            continue
        start = time.perf_counter()
        # the check's measurement by a run, also where kvram's check reads the assignment instead
        # (an untuned GPU, `_check._reads_assignment`)
        with mock.patch.object(_check, "_reads_assignment", return_value=False):
            peak = _check._step_peak_or_raise(model, step, x, y, device, True)
        tf.test.experimental.sync_devices()  # the run done, not only launched
        called = time.perf_counter() - start
        results[name] = {
            "rows": rows, "compile_only_s": round(compiled, 2), "call_s": round(called, 2),
            "assignment_bytes": assigned, "measured_peak_bytes": peak,
            "temp_and_outputs_over_measured": round((assigned["temp"] + assigned["outputs"]) / peak, 4),
        }
        print(name, results[name], flush=True)
    record = {"device": device, "size": args.size, "xla_flags": os.environ.get("XLA_FLAGS", ""), "models": results}
    if args.out:
        common.write_record(args.out, record)


if __name__ == "__main__":
    main()
