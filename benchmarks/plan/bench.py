"""`kvram plan --measure` on the GPU: predicted vs measured peak of the recommended
configuration, under logical memory caps, for keras.applications models at a
training batch. A child (`--child`) writes its result to `--out` after each
measurement, so a run cut short keeps what it measured. How to run it: README.md."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import cap_first_gpu, child_result, gpu_name, result_header, run_child, versions, write_result  # noqa: E402


def child(args) -> dict:
    from kvram import remat as plan  # before TensorFlow (CPU allocator statistics: kvram/__init__.py)

    cap = plan.parse_bytes(args.cap)
    cap_first_gpu(cap / 2**30)
    import keras

    constructor = getattr(keras.applications, args.model)

    def build():
        return constructor(weights=None, input_shape=(args.size, args.size, 3), classes=1000)

    began = time.perf_counter()
    result = {"model": args.model, "cap": args.cap, "cap_bytes": cap, "batch_size": args.batch_size}

    def save(**entries):
        result.update(entries)
        result["seconds"] = round(time.perf_counter() - began, 1)
        print(f"[{result['seconds']} s] {', '.join(entries)} saved", flush=True)
        write_result(args.out, result)

    micro = None if args.micro_batch_sizes is None else [
        int(m) for m in args.micro_batch_sizes.split(",") if m != "none"]
    found = plan.estimate(build, args.batch_size, memory_bytes=cap, precisions=tuple(args.precision.split(",")),
                          micro_batch_sizes=micro, verbose=True)
    print(found, flush=True)
    save(plan_seconds=round(time.perf_counter() - began, 1), estimate=found.to_json())
    if found.recommended is None:
        return result

    def timed(configuration, **kwargs):
        start = time.perf_counter()
        measured = plan.measure(build, configuration, args.batch_size, steps=args.steps, **kwargs)
        return measured | {"seconds": round(time.perf_counter() - start, 1)}  # build and compile included

    save(recommended=timed(found.recommended, plain=not args.no_plain))
    if args.try_all:
        tried = []
        # the configurations predicted to fit first, the fastest predicted first:
        # those predicted not to fit are tried too (they may run out of
        # memory), while time is left
        others = sorted((c for c in found.configurations
                         if c.precision == found.recommended.precision and c is not found.recommended),
                        key=lambda c: (not c.fits, c.relative_step_time))
        for c in others:
            entry = {"micro_batch_size": c.micro_batch_size, "remat": c.remat,
                     "predicted_peak_bytes": c.predicted_peak_bytes, "predicted_by": c.predicted_by,
                     "predicted_fits": c.fits, "runs": [list(r) for r in c.plan.runs] if c.plan else []}
            if time.perf_counter() - began > args.budget_seconds:
                entry["error"] = f"not tried: the run's {args.budget_seconds} s were spent"
            else:
                entry.update(timed(c, plain=False))
            tried.append(entry)
            save(tried=tried)
            print(json.dumps(entry), flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", action="append", required=True)
    parser.add_argument("--cap", action="append", required=True)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--precision", default="mixed_bfloat16,float32")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--micro-batch-sizes", default=None,
                        help='slice sizes the estimate tries besides whole batches, comma-separated; "none": '
                             "whole batches only (default: estimate's, the batch halved and quartered)")
    parser.add_argument("--try-all", action="store_true")
    parser.add_argument("--no-plain", action="store_true", help="do not train plain Keras beside the recommendation")
    parser.add_argument("--budget-seconds", type=int, default=420, help="stop trying configurations after this")
    parser.add_argument("--timeout", type=int, default=1800)
    parser.add_argument("--out", default="plan.json")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        args.model, args.cap = args.model[0], args.cap[0]
        child_result(child(args))
        return
    import keras  # noqa: F401  (versions() reports the imported ones)
    import tensorflow as tf  # noqa: F401

    runs = []
    for model in args.model:
        for cap in args.cap:
            command = [sys.executable, __file__, "--child", "--model", model, "--cap", cap,
                       "--batch-size", str(args.batch_size), "--size", str(args.size),
                       "--precision", args.precision, "--steps", str(args.steps),
                       "--budget-seconds", str(args.budget_seconds), "--out", ""]
            command += ["--try-all"] * args.try_all + ["--no-plain"] * args.no_plain
            command += ["--micro-batch-sizes", args.micro_batch_sizes] if args.micro_batch_sizes else []
            records, error, _ = run_child(command, args.timeout)
            entry = {"model": model, "cap": cap, "error": error} if error else records[-1]
            print(json.dumps(entry)[:2000], flush=True)
            runs.append(entry)
            write_result(args.out, {**result_header("plan", __file__), "gpu": gpu_name(), "versions": versions(),
                                    "runs": runs})


if __name__ == "__main__":
    main()
