"""The `kvram` command line: `kvram info`, `kvram demo`, `kvram plan`, `kvram shards write|inspect`,
`kvram launch`."""

from __future__ import annotations

import argparse
import json
import os
import sys

__all__ = ["main"]


def _info(args) -> int:
    import keras
    import tensorflow as tf

    import kvram
    from kvram import memory, precision

    report = {
        "kvram": kvram.__version__,
        "tensorflow": tf.__version__,
        "keras": keras.__version__,
        "python": sys.version.split()[0],
        "built_with_cuda": tf.test.is_built_with_cuda(),
        "devices": [d.name for d in tf.config.list_logical_devices()],
        "auto_policy": precision.auto_policy(),
        "gpus": [],
    }
    for i, gpu in enumerate(tf.config.list_physical_devices("GPU")):
        details = tf.config.experimental.get_device_details(gpu)
        snap = memory.MemoryMonitor(f"GPU:{i}")
        entry = {
            "name": details.get("device_name", gpu.name),
            "compute_capability": details.get("compute_capability"),
            **snap.snapshot(),
        }
        if snap.nvml_note:
            entry["nvml_note"] = snap.nvml_note
        report["gpus"].append(entry)
    if not report["gpus"]:
        report["nvml_note"] = "no GPU visible to TensorFlow; NVML not queried"
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    for key in ("kvram", "tensorflow", "keras", "python", "built_with_cuda", "auto_policy"):
        print(f"{key:16} {report[key]}")
    print(f"{'devices':16} {', '.join(report['devices'])}")
    gib = 2.0**30
    for i, g in enumerate(report["gpus"]):
        cc = g["compute_capability"]
        line = f"GPU:{i}            {g['name']} (compute capability {cc[0]}.{cc[1]})" if cc else g["name"]
        print(line)
        if g["nvml_total_bytes"] is not None:
            print(
                f"{'':16} {g['nvml_used_bytes'] / gib:.1f} GiB used, "
                f"{g['nvml_free_bytes'] / gib:.1f} GiB free of {g['nvml_total_bytes'] / gib:.1f} GiB"
            )
        else:
            print(f"{'':16} {g['nvml_note']}")
    if not report["gpus"]:
        print(f"{'nvml':16} {report['nvml_note']}")
    return 0


def _demo(args) -> int:
    from kvram.demo import run_demo

    run_demo(
        args.device,
        epochs=args.epochs,
        batch_size=args.batch_size,
        blocks=args.blocks,
        width=args.width,
        samples=args.samples,
        json_path=args.json,
    )
    return 0


def _shards_write(args) -> int:
    from kvram import data

    *sources, out = args.paths
    understood = f"Understood: SRC {' '.join(sources) or '(none)'}, OUT {out}"
    if not sources:
        raise SystemExit(f"kvram shards write: give one .npz or one or more .npy files, then OUT/. {understood}")
    if out.endswith((".npz", ".npy")):
        raise SystemExit(f"kvram shards write: OUT {out} is named like a source: the last path is the output "
                         f"directory, so nothing was written. {understood}. Give OUT last: "
                         "kvram shards write SRC.npz OUT/")
    for source in sources:
        if os.path.abspath(source) == os.path.abspath(out) or (
                os.path.exists(source) and os.path.exists(out) and os.path.samefile(source, out)):
            raise SystemExit(f"kvram shards write: OUT {out} is also a source; nothing was written. {understood}")
    if os.path.lexists(out) and not os.path.isdir(out):
        raise SystemExit(f"kvram shards write: OUT {out} is an existing file, not a directory; nothing was "
                         f"written. {understood}")
    arrays = {}
    for source in sources:
        arrays.update(_read_arrays(source))
    fields = args.fields.split(",") if args.fields else None
    dataset = data.write_shards(
        arrays, out, samples_per_shard=args.samples_per_shard, fields=fields,
        overwrite=args.overwrite, verbose=1,
    )
    print(dataset)
    return 0


def _read_arrays(source: str) -> dict:
    """{field: array} of a .npz (its arrays) or a .npy (one, named for the file), or a one-line error."""
    import zipfile

    import numpy as np

    if not source.endswith((".npz", ".npy")):
        raise SystemExit(f"kvram shards write: {source}: expected a .npz or .npy file")
    if not os.path.isfile(source):
        raise SystemExit(f"kvram shards write: {source}: no such file")
    with open(source, "rb") as handle:
        magic = handle.read(6)
    kind, expected = (".npy", b"\x93NUMPY") if source.endswith(".npy") else (".npz", b"PK")
    if not magic.startswith(expected):
        what = "a .npy array file" if kind == ".npy" else "a zip of .npy arrays, as numpy.savez writes"
        raise SystemExit(f"kvram shards write: {source}: not a {kind} file (expected {what})")
    try:
        if source.endswith(".npy"):
            return {os.path.splitext(os.path.basename(source))[0]: np.load(source, mmap_mode="r", allow_pickle=False)}
        with np.load(source, allow_pickle=False) as bundle:
            arrays = {name: bundle[name] for name in bundle.files}
    except (ValueError, OSError, EOFError, zipfile.BadZipFile) as error:
        raise SystemExit(f"kvram shards write: {source}: not an array file numpy can read without pickle "
                         f"({type(error).__name__}: {error})") from None
    if not arrays:
        raise SystemExit(f"kvram shards write: {source} holds no arrays: nothing to write")
    return arrays


def _shards_write_images(args) -> int:
    from kvram import data

    try:
        dataset = data.write_image_shards(
            args.source, args.out, size=args.size, samples_per_shard=args.samples_per_shard,
            workers=args.workers, overwrite=args.overwrite, verbose=1,
        )
    except ImportError as error:
        raise SystemExit(f"kvram shards write-images needs Pillow (pip install 'kvram[images]'): {error}") from None
    except (FileNotFoundError, FileExistsError, ValueError) as error:
        raise SystemExit(f"kvram shards write-images: {error}") from None
    print(dataset)
    return 0


def _shards_inspect(args) -> int:
    from kvram import data

    try:
        dataset = data.ShardedDataset(args.directory)
        if args.verify:
            dataset.verify(verbose=1)
    except data.ShardError as error:
        print(f"kvram shards inspect: {error}", file=sys.stderr)
        return 1
    report = {
        "directory": dataset.directory,
        "samples": len(dataset),
        "shards": len(dataset.index["shards"]),
        "bytes": dataset.nbytes,
        "fields": {n: {"dtype": d.str, "shape": list(s)} for n, (d, s) in dataset.fields.items()},
        "checksums": all(
            f.get("sha256") for e in dataset.index["shards"] for f in e["files"].values()
        ),
        "verified": bool(args.verify),
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"{dataset.directory}: {report['samples']} samples in {report['shards']} shards, "
          f"{report['bytes'] / 2**20:.1f} MiB")
    for name, field in report["fields"].items():
        print(f"  {name:16} {field['dtype']:6} per-sample shape {tuple(field['shape'])}")
    if args.verify:
        print("  checksums: all match" if report["checksums"] else "  checksums: none stored")
    return 0


def _model_builder(spec: str, input_shape, classes: int):
    """A no-argument function building the model `spec` names (never downloading weights)."""
    import importlib

    import keras

    if spec.endswith(".keras"):
        if not os.path.exists(spec):
            raise SystemExit(f"kvram plan: --model {spec}: no such file")
        return lambda: keras.models.load_model(spec, compile=False)
    if ":" in spec:
        module_name, _, function_name = spec.partition(":")
        try:
            function = getattr(importlib.import_module(module_name), function_name)
        except (ImportError, AttributeError) as error:
            raise SystemExit(f"kvram plan: --model {spec}: cannot import it ({error})") from None
        return function
    name = spec.removeprefix("keras.applications.")
    constructor = getattr(keras.applications, name, None)
    if constructor is None or not callable(constructor) or name[:1].islower():
        raise SystemExit(
            f"kvram plan: --model {spec}: not a keras.applications model. Allowed: a "
            "keras.applications name (ResNet50, keras.applications.ConvNeXtTiny, ...), a "
            "path to a .keras file, or module:function returning a model."
        )
    if input_shape is None:
        raise SystemExit("kvram plan: --input-shape is needed with a keras.applications model")
    return lambda: constructor(weights=None, input_shape=input_shape, classes=classes)


# How many times `kvram plan` starts its estimate's process again after it was
# killed by a signal, each time only if it had made a new check.
_PLAN_RESTARTS = 5


def _plan(args) -> int:
    from kvram import launch, plan

    try:
        memory_bytes = plan.parse_bytes(args.gpu_memory) if args.gpu_memory else None
    except ValueError as error:
        raise SystemExit(f"kvram plan: --gpu-memory: {error}") from None
    if args.limit_gpu and memory_bytes is None:
        raise SystemExit("kvram plan: --limit-gpu needs --gpu-memory (the size to limit the GPU to)")
    try:
        micro = None if args.micro_batch_sizes is None else [
            int(m) for m in args.micro_batch_sizes.split(",") if m.strip() != "none"]
    except ValueError:
        raise SystemExit(
            f"kvram plan: --micro-batch-sizes: {args.micro_batch_sizes!r}. Allowed: comma-separated "
            'row counts (e.g. 128,64), or "none" for whole batches only'
        ) from None
    if args.isolate == "always" or (args.isolate == "auto" and launch.visible_gpus()):
        return _plan_in_child(args)
    if args.limit_gpu:
        _limit_gpu(memory_bytes)
    shape = tuple(int(d) for d in args.input_shape.split(",")) if args.input_shape else None
    build = _model_builder(args.model, shape, args.classes)
    try:
        found = plan.estimate(
            build, args.batch_size, memory_bytes=memory_bytes, optimizer=args.optimizer,
            precisions=tuple(args.precision.split(",")), margin=args.margin, micro_batch_sizes=micro,
            micro_batch_overhead=args.micro_batch_overhead, checks_file=args.checks_file, verbose=True,
        )
    except ValueError as error:
        raise SystemExit(f"kvram plan: {error}") from None

    def save():
        if args.json:
            with open(args.json, "w") as f:
                json.dump(found.to_json(), f, indent=2)

    # the estimate printed and saved before --measure trains (a process that
    # dies training keeps it)
    print(found, flush=True)
    save()
    if args.measure and found.recommended is not None:
        found.measured = plan.measure(
            build, found.recommended, args.batch_size, optimizer=args.optimizer, steps=args.steps
        )
        print(found.measured_line())
        save()
    code = 0 if found.recommended is not None else 1
    if args.plan_child:
        # Done: said in the checks file, and the process ends here, before
        # TensorFlow's teardown (its GPU allocator aborted one at exit, after
        # the estimate was printed: benchmarks/results/plan_h200/README.md).
        plan._CheckStore(args.checks_file).finish(args.plan_child, code)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _limit_gpu(memory_bytes: int) -> None:
    """Makes the first GPU a logical device of `memory_bytes` (TensorFlow then
    allocates no more on it), before TensorFlow starts using it."""
    import tensorflow as tf

    gpus = tf.config.list_physical_devices("GPU")
    if not gpus:
        raise SystemExit("kvram plan: --limit-gpu: TensorFlow sees no GPU")
    try:
        tf.config.set_logical_device_configuration(
            gpus[0], [tf.config.LogicalDeviceConfiguration(memory_limit=memory_bytes // 2**20)])
    except RuntimeError as error:  # the GPU was initialized already
        raise SystemExit(f"kvram plan: --limit-gpu: {error}") from None


def _kept_checks(path: str):
    """The checks file at `path` as `kvram.plan` reads it; empty where there is
    none yet or it is not one (the child then refuses it and says why)."""
    from kvram import plan

    try:
        return plan._CheckStore(path)
    except ValueError:
        return plan._CheckStore(None)


def _plan_in_child(args) -> int:
    """Runs this `kvram plan` in a child process that keeps its checks in a
    file, and starts it again from them when a signal kills it: TensorFlow's
    GPU allocator can abort the process after a step that ran out of memory
    (`bfc_allocator.cc ... Check failed: h != kInvalidChunkHandle`, seen on an
    H200 limited to 8 GiB: benchmarks/results/plan_h200/README.md), and the
    checks made before are not made again (one that ran out of memory is
    kept as such)."""
    import shutil
    import subprocess
    import tempfile
    import uuid

    from kvram.launch import _describe

    own = args.checks_file is None
    path = args.checks_file or os.path.join(tempfile.mkdtemp(prefix="kvram-plan-"), "checks.json")
    run = uuid.uuid4().hex
    command = [sys.executable, "-m", "kvram", *args.argv, "--isolate", "never", "--checks-file", path,
               "--plan-child", run]
    for restart in range(_PLAN_RESTARTS + 1):
        before = len(_kept_checks(path).checks)
        code = subprocess.call(command)
        finished = _kept_checks(path).finished or {}
        if code < 0 and finished.get("run") == run:  # killed after it had finished
            print(f"kvram plan: the estimate's process {_describe(code)} after it finished", file=sys.stderr)
            code = finished["code"]
        if code >= 0:  # it ended by itself: the estimate done, or refused
            if own:
                shutil.rmtree(os.path.dirname(path), ignore_errors=True)
            return code
        made = len(_kept_checks(path).checks)
        if made == before or restart == _PLAN_RESTARTS:
            why = "with no new check since it started" if made == before else f"{restart + 1} times"
            print(f"kvram plan: the estimate's process {_describe(code)} {why}; stopped. Its {made} "
                  f"check(s) are kept in {path}: `kvram plan ... --checks-file {path}` goes on from them.",
                  file=sys.stderr, flush=True)
            return 1
        print(f"kvram plan: the estimate's process {_describe(code)} after {made - before} new check(s) "
              "(TensorFlow's GPU allocator can abort a process after a step that ran out of memory); "
              f"starting it again from the {made} check(s) kept in {path} "
              f"(restart {restart + 1} of at most {_PLAN_RESTARTS})", file=sys.stderr, flush=True)
    return 1


def _launch(args) -> int:
    from kvram import launch

    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        print("kvram launch: no command to run. Example: kvram launch --workers 2 -- python train.py",
              file=sys.stderr)
        return 2
    try:
        return launch.launch(command, args.workers, gpus=args.gpus, max_restarts=args.max_restarts,
                             grace_seconds=args.grace_seconds)
    except ValueError as error:
        print(f"kvram launch: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvram", description=__doc__,
        epilog="A mistake in the input ends a command with one line on stderr and exit code 1 "
               "(2 for a bad option); KVRAM_TRACEBACK=1 shows the traceback instead.")
    sub = parser.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", help="TF/Keras versions, devices, GPU memory, NVML status")
    info.add_argument("--json", action="store_true", help="print the report as JSON")
    info.set_defaults(func=_info)
    demo = sub.add_parser("demo", help="train a model plain vs kvram and compare")
    demo.add_argument("--device", default=None, help="CPU:0 or GPU:0 (default: GPU:0 if any)")
    demo.add_argument("--epochs", type=_positive, default=3)
    demo.add_argument("--batch-size", type=_positive, default=512)
    demo.add_argument("--blocks", type=_positive, default=12)
    demo.add_argument("--width", type=_positive, default=256)
    demo.add_argument("--samples", type=_positive, default=8192)
    demo.add_argument("--json", default=None, help="also write the results to this JSON file")
    demo.set_defaults(func=_demo)
    planner = sub.add_parser(
        "plan", help="will a model fit, and how: precision x checkpointing x micro-batch"
    )
    planner.add_argument(
        "--model", required=True,
        help="keras.applications name (ResNet50), a .keras file, or module:function",
    )
    planner.add_argument("--input-shape", default=None, help="e.g. 224,224,3 (keras.applications)")
    planner.add_argument("--classes", type=_positive, default=1000)
    planner.add_argument("--batch-size", type=_positive, required=True)
    planner.add_argument("--optimizer", default="adam")
    planner.add_argument("--gpu-memory", default=None, help="e.g. 48GB, 16GiB (default: the present GPU)")
    planner.add_argument(
        "--precision", default="mixed_bfloat16,mixed_float16,float32",
        help="dtype policies to try, preferred first (comma-separated)",
    )
    planner.add_argument("--margin", type=float, default=0.10, help="fraction of memory kept free")
    planner.add_argument("--micro-batch-overhead", type=float, default=0.05,
                         help="predicted step time added by each micro-batch beyond the first "
                              "(fraction of a whole-batch step)")
    planner.add_argument("--measure", action="store_true",
                         help="train the recommended configuration and plain Keras a few steps")
    planner.add_argument("--steps", type=_positive, default=5, help="steps timed by --measure")
    planner.add_argument("--json", default=None, help="also write the estimate to this JSON file")
    planner.add_argument("--micro-batch-sizes", default=None,
                         help='slice sizes to try besides whole batches, comma-separated, or "none" '
                              "(default: the batch halved and quartered)")
    planner.add_argument("--limit-gpu", action="store_true",
                         help="limit the GPU to --gpu-memory (a logical device of that size), so that "
                              "checks and --measure run out of memory where a GPU of that size would")
    planner.add_argument("--checks-file", default=None,
                         help="keep each check's result in this JSON file as it is made, and reuse "
                              "those already there (to go on after a run that was stopped)")
    planner.add_argument("--isolate", choices=("auto", "always", "never"), default="auto",
                         help="run the estimate in a child process, started again from its kept checks "
                              "if a signal kills it (TensorFlow can abort after a GPU step out of "
                              "memory); auto: when a GPU is present")
    planner.add_argument("--plan-child", default=None, help=argparse.SUPPRESS)  # set by --isolate's parent
    planner.set_defaults(func=_plan)
    shards = sub.add_parser("shards", help="write or inspect .npy shard directories")
    shards_sub = shards.add_subparsers(dest="shards_command", required=True)
    write = shards_sub.add_parser("write", help="SRC.npz | SRC.npy... OUT/: arrays to shards")
    write.add_argument("paths", nargs="+", help="sources, then the output directory")
    write.add_argument("--samples-per-shard", type=_positive, default=65536)
    write.add_argument("--fields", default=None, help="comma-separated fields to keep, in order")
    write.add_argument("--overwrite", action="store_true")
    write.set_defaults(func=_shards_write)
    images = shards_sub.add_parser(
        "write-images", help="SRC_DIR OUT_DIR: a folder of class sub-folders of images to uint8 shards")
    images.add_argument("source", help="SRC_DIR/CLASS/IMAGE files (ImageFolder's layout)")
    images.add_argument("out")
    images.add_argument("--size", type=_positive, default=224, help="side of the square output (default 224)")
    images.add_argument("--workers", type=_positive, default=None, help="decoding threads (default: every CPU)")
    images.add_argument("--samples-per-shard", type=_positive, default=4096)
    images.add_argument("--overwrite", action="store_true")
    images.set_defaults(func=_shards_write_images)
    inspect = shards_sub.add_parser("inspect", help="counts, dtypes, sizes; --verify checksums")
    inspect.add_argument("directory")
    inspect.add_argument("--verify", action="store_true", help="check every file's SHA-256")
    inspect.add_argument("--json", action="store_true")
    inspect.set_defaults(func=_shards_inspect)
    launcher = sub.add_parser(
        "launch", help="-- COMMAND...: N local MultiWorkerMirroredStrategy workers (TF_CONFIG, one GPU each)")
    launcher.add_argument("--workers", type=_positive, required=True)
    launcher.add_argument("--gpus", default="auto",
                          help="auto (one GPU per worker if GPUs are visible), none (CPU), or ids: 0,1")
    launcher.add_argument("--max-restarts", type=_non_negative, default=0,
                          help="start every worker again this many times after a failure "
                               "(with keras.callbacks.BackupAndRestore the job resumes)")
    launcher.add_argument("--grace-seconds", type=float, default=10.0,
                          help="after a failure, SIGTERM the others and SIGKILL after this")
    launcher.add_argument("command", nargs=argparse.REMAINDER, help="-- then the program and its arguments")
    launcher.set_defaults(func=_launch)
    for command in (info, demo, planner, write, images, inspect, launcher):
        command.set_defaults(prog=command.prog)  # "kvram shards write": what its errors begin with
    return parser


# A user's mistake (a bad path, a file that is not what it should be, a value
# out of range) ends a command with one line and exit code 1, not a traceback.
# KVRAM_TRACEBACK=1 shows the traceback instead.
_USER_ERRORS = (ValueError, TypeError, OSError)


def main(argv=None) -> int:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # for a command run again in a child
    try:
        return args.func(args)
    except _USER_ERRORS as error:
        if os.environ.get("KVRAM_TRACEBACK"):
            raise
        print(f"{args.prog}: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
