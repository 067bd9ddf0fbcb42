"""Two-stage pipeline on two GPUs: a model that does not fit one capped GPU, trained
split across two; GPipe micro-batching against the naive split (one slice).

The model is a stack of MLP blocks (Dense width->hidden, GELU, Dense hidden->width)
and a 1000-way classifier, trained with Adam. How to run it: README.md."""

from __future__ import annotations

import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)
from benchmarks.common import (  # noqa: E402
    child_result, gpu_name, result_header, run_child, timed_fit, versions, write_result,
)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cap-gib", type=float, default=24.0)
    parser.add_argument("--logical", action="store_true", help="one GPU split into two logical GPUs")
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=16384)
    parser.add_argument("--blocks", type=int, default=12)
    parser.add_argument("--batch", type=int, default=4096)
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--checkpoint", action="store_true", help="Checkpoint each stage")
    parser.add_argument("--skip-single", action="store_true")
    parser.add_argument("--cpu", action="store_true", help="two logical CPUs (smoke test)")
    parser.add_argument("--per-slice", action="store_true",
                        help="also time micro_batches=M with defer_weight_gradients=False (each "
                             "Dense kernel's gradient per slice, summed), in the same rounds")
    parser.add_argument("--out", default=None)
    parser.add_argument("--single-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    single = None
    if not args.skip_single and not args.single_child:
        records, error, _ = run_child([sys.executable, __file__, "--single-child", *sys.argv[1:]])
        single = {"error": error} if error else records[-1]
        print("whole model on one capped device:", single, flush=True)

    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    import numpy as np
    import tensorflow as tf

    cap = tf.config.LogicalDeviceConfiguration(memory_limit=int(args.cap_gib * 1024))
    if args.cpu:
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
        devices = ["CPU:0", "CPU:1"]
    else:
        gpus = tf.config.list_physical_devices("GPU")
        if args.logical:
            tf.config.set_logical_device_configuration(gpus[0], [cap, cap])
        else:
            if len(gpus) < 2:
                raise SystemExit(f"Needs two GPUs (or --logical). Found: {gpus}")
            for gpu in gpus[:2]:
                tf.config.set_logical_device_configuration(gpu, [cap])
        devices = ["GPU:0", "GPU:1"]
    import keras

    import kvram
    from kvram.memory import is_out_of_memory

    def layers():
        keras.utils.set_random_seed(0)
        out = []
        for i in range(args.blocks):
            out.append(keras.layers.Dense(args.hidden, activation="gelu", name=f"block{i}_up"))
            out.append(keras.layers.Dense(args.width, name=f"block{i}_down"))
        out.append(keras.layers.Dense(1000, name="classifier"))
        return out

    def compile_(model):
        model.compile(
            optimizer=keras.optimizers.Adam(1e-5),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )

    rng = np.random.default_rng(0)
    x = rng.standard_normal((args.batch, args.width), dtype=np.float32)
    y = rng.integers(0, 1000, args.batch)
    data = tf.data.Dataset.from_tensors((x, y)).repeat().prefetch(2)
    report = {
        **result_header("pipeline-two-stages", __file__),
        "gpu": gpu_name(),
        "versions": versions(),
        "mode": "cpu" if args.cpu else ("one GPU split into two logical GPUs" if args.logical else "two GPUs"),
        "devices": devices,
        "cap_gib_per_device": args.cap_gib,
        "model": {"width": args.width, "hidden": args.hidden, "blocks": args.blocks},
        "batch": args.batch,
        "single_device": single,
    }

    if args.single_child:
        # 1. The whole model on one capped device (its own process, so nothing
        # it leaves allocated can affect the split runs).
        started = time.perf_counter()
        with tf.device(devices[0]):
            inputs = keras.Input((args.width,))
            whole = kvram.Model(inputs, _apply(layers(), inputs))
            compile_(whole)
        result = {"parameters": whole.count_params()}
        try:
            whole.fit(data, steps_per_epoch=2, epochs=1, verbose=0)
            result.update(fits=True, peak_gib=tf.config.experimental.get_memory_info(devices[0])["peak"] / 2**30)
        except (tf.errors.ResourceExhaustedError, tf.errors.InternalError) as e:
            if not is_out_of_memory(e):
                raise
            result.update(fits=False, error=f"{type(e).__name__}: {str(e).splitlines()[0][:300]}")
        result["seconds"] = time.perf_counter() - started
        child_result(result)
        return

    # 2. Split over the two devices.
    plan = kvram.parallel.balance(layers(), devices, by="memory", sample_batch=x[:8])
    print(plan.report, flush=True)
    report["balance"] = plan.report
    model = kvram.parallel.PipelineModel(plan.stages, devices, micro_batches=1, checkpoint=args.checkpoint)
    compile_(model)
    model.build((None, args.width))
    report["parameters"] = model.count_params()
    # (micro_batches, defer_weight_gradients): M=1, M, and with --per-slice M without deferral
    configs = [(1, True), (args.micro_batches, True)] + ([(args.micro_batches, False)] if args.per_slice else [])
    key = lambda c: str(c[0]) if c[1] else f"{c[0]}_per_slice"  # noqa: E731
    runs = {key(c): [] for c in configs}
    peaks, losses, functions = {}, [], {}
    for round_ in range(args.rounds):
        for config in configs:
            # The step is traced once per config (both are read when tracing).
            model.micro_batches, model.defer_weight_gradients = config
            model.train_function = functions.get(config)
            timed = timed_fit(model, data, args.steps, args.warmup, devices)
            functions[config] = model.train_function
            runs[key(config)].append(args.batch * args.steps / timed["seconds"])
            peaks[key(config)] = timed["peak_gib"]
            losses.append(timed["loss"])
            print(f"round {round_} {key(config)}: {runs[key(config)][-1]:.0f} samples/s, "
                  f"peak {timed['peak_gib']}, loss {timed['loss']:.4f}", flush=True)
    medians = {name: float(np.median(values)) for name, values in runs.items()}
    naive, piped = medians["1"], medians[str(args.micro_batches)]
    k, m = 2, args.micro_batches
    report["pipeline"] = {
        "trains": True,
        "losses_in_order": losses,
        "samples_per_s": runs,
        "median_samples_per_s": medians,
        "peak_gib": {str(key): value for key, value in peaks.items()},
        "speedup": piped / naive,
        "speedup_per_slice": (medians[f"{args.micro_batches}_per_slice"] / naive
                              if args.per_slice else None),
        "gpipe_ideal": k * m / (m + k - 1),
    }
    print(f"naive {naive:.0f} samples/s, pipelined (M={m}) {piped:.0f}: {piped / naive:.2f}x "
          f"(GPipe ideal {k * m / (m + k - 1):.2f}x)", flush=True)
    write_result(args.out, report)


def _apply(layers, x):
    for layer in layers:
        x = layer(x)
    return x


if __name__ == "__main__":
    main()
