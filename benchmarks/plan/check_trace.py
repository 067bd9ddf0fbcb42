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
import importlib
import time

from check_first_runs import check_step, report  # this folder, the script's own


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="ConvNeXtSmall", help="a keras.applications name")
    parser.add_argument("--rows", type=int, default=2)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    importlib.import_module("keras")  # imported before the build's clock starts

    start = time.perf_counter()
    model, step, x, y = check_step(args.model, args.size, args.rows)
    built = time.perf_counter() - start
    start = time.perf_counter()
    step.get_concrete_function()
    traced = time.perf_counter() - start
    start = time.perf_counter()
    hlo = step.experimental_get_compiler_ir(x, y)(stage="hlo")
    converted = time.perf_counter() - start
    report({
        "model": args.model, "rows": args.rows, "size": args.size, "policy": "mixed_bfloat16",
        "build_s": round(built, 2), "trace_s": round(traced, 2), "to_hlo_s": round(converted, 2),
        "hlo_chars": len(hlo), "tracing_count": step.experimental_get_tracing_count(),
    }, args.out)


if __name__ == "__main__":
    main()
