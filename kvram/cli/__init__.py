"""The `kvram` command line: `kvram info`, `kvram demo`, `kvram plan`, `kvram shards write|write-images|inspect`,
`kvram launch`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import keras
import tensorflow as tf

from kvram import _quiet, _version, memory, precision
from kvram.cli._demo import run_demo
from kvram.cli._plan import _plan
from kvram.cli._shards import _shards_inspect, _shards_write, _shards_write_images
from kvram.parallel import _launch as launching
from kvram.remat import parse_bytes


__all__ = ["main"]


def _info(args) -> int:
    report = {
        "kvram": _version.__version__,
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
    result = run_demo(
        args.device,
        epochs=args.epochs,
        batch_size=args.batch_size,
        blocks=args.blocks,
        width=args.width,
        samples=args.samples,
        gpu_memory=parse_bytes(args.gpu_memory) if args.gpu_memory else None,
        json_path=args.json,
    )
    ran_out = result["plain"]["out_of_memory"] or result["kvram"]["out_of_memory"]
    if ran_out and result["device"].startswith("GPU") and args.is_command:
        # Done (printed and saved). TensorFlow's GPU allocator can abort at interpreter exit
        # after an out-of-memory error (bfc_allocator.cc:711 Check failed, seen on an H200 after
        # this demo and after kvram plan's checks: benchmarks/results/plan_h200/README.md at commit 1fb3fe3):
        # the command ends here, before that teardown.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0


def _launch(args) -> int:
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        print("kvram launch: no command to run. Example: kvram launch --workers 2 -- python train.py",
              file=sys.stderr)
        return 2
    try:
        return launching.launch(command, args.workers, gpus=args.gpus, max_restarts=args.max_restarts,
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


def _verbose(parser: argparse.ArgumentParser, default=False) -> None:
    # Read from sys.argv when kvram is imported, before TensorFlow is (kvram/_quiet.py):
    # here so that --help shows it and the parser accepts it before or after the command.
    parser.add_argument(_quiet.VERBOSE_FLAG, action="store_true", default=default,
                        help="show TensorFlow's own log lines (hidden by default)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvram", description=__doc__,
        epilog="A mistake in the input ends a command with one line on stderr and exit code 1 "
               "(2 for a bad option); KVRAM_TRACEBACK=1 shows the traceback instead.")
    _verbose(parser)
    sub = parser.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", help="TF/Keras versions, devices, GPU memory, NVML status")
    info.add_argument("--json", action="store_true", help="print the report as JSON")
    info.set_defaults(func=_info)
    demo = sub.add_parser("demo", help="train a model plain vs kvram and compare")
    demo.add_argument("--device", default=None, help="CPU:0 or GPU:0 (default: GPU:0 if any)")
    demo.add_argument("--epochs", type=_positive, default=None, help="default: 3 on the CPU, 2 on a GPU")
    demo.add_argument("--batch-size", type=_positive, default=None, help="default: 512 on the CPU, 16384 on a GPU")
    demo.add_argument("--blocks", type=_positive, default=12)
    demo.add_argument("--width", type=_positive, default=None, help="default: 256 on the CPU, 1024 on a GPU")
    demo.add_argument("--samples", type=_positive, default=None, help="default: 8192 on the CPU, 8 batches on a GPU")
    demo.add_argument("--gpu-memory", default=None,
                      help="on a GPU, the memory it is limited to (default 4GiB): plain Keras runs out of it")
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
    planner.add_argument("--optimizer", default="adam",
                         help="a Keras optimizer name, or adamw8bit (kvram.optimizers.AdamW8bit)")
    planner.add_argument("--gpu-memory", default=None, help="e.g. 48GB, 16GiB (default: the present GPU)")
    planner.add_argument(
        "--precision", default="mixed_bfloat16,mixed_float16,float32",
        help="dtype policies to try, preferred first (comma-separated); one is measured only "
             "when none before it fits",
    )
    planner.add_argument("--every-precision", action="store_true",
                         help="measure every --precision for the table, also those after the one "
                              "that fits (each takes as long as the first)")
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
                              "memory), its checks compiled without XLA's autotuning "
                              "(--xla_gpu_autotune_level=0 unless XLA_FLAGS sets a level), without LLVM's "
                              "expensive passes, Triton GEMMs and Triton normalization fusions (unless "
                              "XLA_FLAGS names those flags), and "
                              "--measure in a second child, compiled as training will be; auto: "
                              "when a GPU is present")
    planner.add_argument("--plan-child", default=None, help=argparse.SUPPRESS)  # set by --isolate's parent
    # set by --isolate's parent with --measure: the estimate's child writes the estimate
    # there, and a second child trains its recommendation (compiled as training will be)
    planner.add_argument("--estimate-file", default=None, help=argparse.SUPPRESS)
    planner.add_argument("--measure-from", default=None, help=argparse.SUPPRESS)
    # and with it, the file the parent writes once the estimate's process has ended
    planner.add_argument("--measure-when", default=None, help=argparse.SUPPRESS)
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
        _verbose(command, default=argparse.SUPPRESS)
    return parser


# A user's mistake (a bad path, a file that is not what it should be, a value
# out of range) ends a command with one line and exit code 1, not a traceback.
# KVRAM_TRACEBACK=1 shows the traceback instead.
_USER_ERRORS = (ValueError, TypeError, OSError)


def main(argv=None) -> int:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # for a command run again in a child
    args.is_command = argv is None  # the process is the command (not a caller of main())
    try:
        return args.func(args)
    except _USER_ERRORS as error:
        if os.environ.get("KVRAM_TRACEBACK"):
            raise
        print(f"{args.prog}: {error}", file=sys.stderr)
        return 1
