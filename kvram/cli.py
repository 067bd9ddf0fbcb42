"""The `kvram` command line: `kvram info`, `kvram demo`."""

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


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvram", description=__doc__)
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
    return parser


def main(argv=None) -> int:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
