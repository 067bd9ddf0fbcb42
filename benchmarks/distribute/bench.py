"""Data parallel on GPUs: kvram's ResNet50 on one GPU, under MirroredStrategy and as two
MultiWorkerMirroredStrategy workers (`kvram launch`); synthetic data, SGD.

`keras_mirrored` (not run by default) is plain Keras's `keras.applications.ResNet50`
under MirroredStrategy with XLA, as a baseline (mixed_bfloat16: no LossScaleOptimizer,
whose cond fails there: keras-team/keras#17187); in `mwms` worker 0's timing is kept.
`--cpu --jit` stops at XLA's missing CPU collectives (b/194942685), after everything
kvram does before them. How to run it: README.md."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)
from benchmarks.common import (  # noqa: E402
    gpu_name, result_header, run_child, timed_fit, versions, without_options, write_result,
)


def child(args):
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    import tensorflow as tf

    if args.config == "mwms":
        # before anything starts TensorFlow's context: collectives are configured then
        implementation = getattr(tf.distribute.experimental.CommunicationImplementation,
                                 "AUTO" if args.cpu else "NCCL")
        strategy = tf.distribute.MultiWorkerMirroredStrategy(
            communication_options=tf.distribute.experimental.CommunicationOptions(implementation=implementation))
    elif args.cpu and args.config in ("mirrored", "keras_mirrored"):
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    import keras

    import kvram
    from models.resnet50 import resnet50

    kind = "CPU" if args.cpu else "GPU"
    devices = [f"{kind}:{i}" for i in range(len(tf.config.list_logical_devices(kind)))]
    if args.config == "single":
        strategy = tf.distribute.get_strategy()
        replicas = 1
    elif args.config in ("mirrored", "keras_mirrored"):
        strategy = tf.distribute.MirroredStrategy(devices)
        replicas = strategy.num_replicas_in_sync
    else:
        replicas = strategy.num_replicas_in_sync
    kvram.precision.enable("mixed_bfloat16")
    shape = (args.image_size, args.image_size, 3)
    started = time.perf_counter()
    with strategy.scope():
        if args.config == "keras_mirrored":  # plain Keras, for keras-team/keras#17187
            model = keras.applications.ResNet50(weights=None, input_shape=shape)
        else:
            model = resnet50(shape, checkpoint=True)
        optimizer = keras.optimizers.SGD(0.01, momentum=0.9)
        loss = "sparse_categorical_crossentropy"
        if args.config != "keras_mirrored":
            model.micro_batch_size = args.micro_batch_size
        model.compile(optimizer=optimizer, loss=loss, jit_compile=args.jit or not args.cpu)
    batch = args.batch * replicas  # the global batch: each replica gets args.batch
    x = tf.random.uniform((batch, *shape), seed=0)
    y = tf.random.uniform((batch,), maxval=1000, dtype=tf.int32, seed=1)
    options = tf.data.Options()
    # Every worker holds the same synthetic batch; the strategy splits each global batch
    # into one part per replica (DATA: worker i takes the i-th part).
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    data = tf.data.Dataset.from_tensors((x, y)).repeat().with_options(options)
    if args.input == "per-replica" and args.config != "single":
        # Each replica's own batch from its own dataset (no split of the global
        # batch on the host): the input's share of the step, measured apart.
        per = args.batch

        def replica_data(context):
            return tf.data.Dataset.from_tensors((x[:per], y[:per])).repeat()

        data = strategy.distribute_datasets_from_function(replica_data)
    local = [f"{kind}:{i}" for i in range(replicas if args.config != "mwms" else 1)]
    timed = timed_fit(model, data, args.steps, args.warmup, local)
    result = {
        "config": args.config,
        "replicas": replicas,
        "global_batch": batch,
        "img_per_s": batch * timed["steps"] / timed["seconds"],
        "timed_steps": timed["steps"],
        "seconds": timed["seconds"],
        "final_loss": timed["loss"],
        "peak_gib": timed["peak_gib"],
        "jit_compile": getattr(model, "jit_compile", None),
        "process_seconds": time.perf_counter() - started,
    }
    if args.config == "mwms":
        result["worker"] = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    print("RESULT " + json.dumps(result), flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=256, help="images per GPU")
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--configs", default="single,mirrored,mwms")
    parser.add_argument("--seconds-each", type=int, default=600, help="time limit of each configuration")
    parser.add_argument("--cpu", action="store_true", help="logical CPUs instead of GPUs (smoke run)")
    parser.add_argument("--jit", action="store_true", help="jit_compile=True on the CPU too")
    parser.add_argument("--micro-batch-size", type=int, default=None,
                        help="kvram's micro_batch_size (its own fused step) for the kvram configurations")
    parser.add_argument("--input", choices=("global", "per-replica"), default="global",
                        help="global: one dataset of global batches, split by the strategy on the "
                             "host; per-replica: each replica's batch from its own dataset "
                             "(distribute_datasets_from_function)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.config:
        return child(args)

    passed = without_options(sys.argv[1:], ("--out",))
    report = {
        **result_header("data-parallel-resnet50", __file__),
        "gpu": gpu_name(),
        "versions": versions(),
        "batch_per_replica": args.batch,
        "input": args.input,
        "image_size": args.image_size,
        "model": "models.resnet50.resnet50(checkpoint=True), mixed_bfloat16, SGD(0.01, momentum=0.9), "
                 + ("no XLA (CPU)" if args.cpu else "jit_compile=True"),
        "results": {},
    }
    me = os.path.abspath(__file__)
    for config in args.configs.split(","):
        command = [sys.executable, me, "--config", config, *passed]
        env = dict(os.environ)
        if config == "single" and not args.cpu:
            visible = env.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0] or "0"
            env["CUDA_VISIBLE_DEVICES"] = visible
        if config == "mwms":
            command = [sys.executable, "-m", "kvram", "launch", "--workers", "2",
                       "--gpus", "none" if args.cpu else "auto", "--", *command]
        started = time.perf_counter()
        results, error, _ = run_child(command, args.seconds_each, env, ROOT)
        results.sort(key=lambda r: r.get("worker", 0))  # mwms: worker 0's timing, and each worker's img/s
        entry = {"error": error} if error else dict(results[0])
        if config == "mwms" and not error:
            entry["workers_img_per_s"] = [r["img_per_s"] for r in results]
        entry["wall_seconds"] = time.perf_counter() - started
        report["results"][config] = entry
        rates = {k: r.get("img_per_s") for k, r in report["results"].items()}
        for name, record in report["results"].items():
            if rates.get("single") and rates[name]:
                record["scaling"] = rates[name] / rates["single"]
        if rates.get("mirrored") and rates.get("mwms"):
            report["mwms_over_mirrored"] = rates["mwms"] / rates["mirrored"]
        print(config, json.dumps(entry), flush=True)
        write_result(args.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
