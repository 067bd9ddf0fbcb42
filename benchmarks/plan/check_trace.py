"""How long `kvram plan`'s XLA check spends before XLA compiles: the trace of
its training step (`kvram.remat._check._training_step`, the step without
recomputation, jit-compiled) and that trace's conversion to HLO, timed apart
for a `keras.applications` model under `mixed_bfloat16`. Runs on any device
(the conversion is TensorFlow's, before XLA's device compiler):

    python benchmarks/plan/check_trace.py --model ConvNeXtSmall --rows 2 [--out trace.json]

Prints JSON: the seconds to build the model, to trace the step (`get_concrete_function`)
and to convert it (`experimental_get_compiler_ir(...)(stage="hlo")`, which traces
nothing again), with the HLO text's length.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="ConvNeXtSmall", help="a keras.applications name")
    parser.add_argument("--rows", type=int, default=2)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    import keras
    import tensorflow as tf

    from kvram.remat._check import _loss_function, _training_step

    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    start = time.perf_counter()
    model = getattr(keras.applications, args.model)(
        weights=None, input_shape=(args.size, args.size, 3), classes=1000)
    built = time.perf_counter() - start
    x = tf.random.uniform((args.rows, args.size, args.size, 3))
    y = tf.zeros((args.rows,), "int64")
    step = _training_step(model, x, y, _loss_function(model, "sparse_categorical_crossentropy"), True)
    start = time.perf_counter()
    step.get_concrete_function()
    traced = time.perf_counter() - start
    start = time.perf_counter()
    hlo = step.experimental_get_compiler_ir(x, y)(stage="hlo")
    converted = time.perf_counter() - start
    report = {
        "model": args.model, "rows": args.rows, "size": args.size, "policy": "mixed_bfloat16",
        "build_s": round(built, 2), "trace_s": round(traced, 2), "to_hlo_s": round(converted, 2),
        "hlo_chars": len(hlo), "tracing_count": step.experimental_get_tracing_count(),
        "tensorflow": tf.__version__, "keras": keras.__version__, "python": platform.python_version(),
        "cpus": os.cpu_count(), "date": time.strftime("%Y-%m-%d"),
    }
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
