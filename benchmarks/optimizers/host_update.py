"""How fast the host's cores apply an optimizer update: `HostOffload`'s update as TensorFlow CPU ops
against one XLA computation on the CPU, for `AdamW`, `AdamW8bit` and `AdamW8bit(factored=True)`:
`--parameters` float32 parameters in 4 equal variables, `--updates` timed updates after 2 untimed
ones, on `--threads` of the host's cores (TensorFlow's intra-op threads; all by default); and the
memory one update works in beyond its variables, gradients and state (the CPU allocator's peak above
what was in use, over one more update). How to run it: README.md."""

from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))
from benchmarks.common import result_header, versions, write_result  # noqa: E402

OPTIMIZERS = ("adamw", "adamw8bit", "adamw8bit_factored")


def _optimizer(name: str):
    import keras

    import kvram

    return {"adamw": lambda: keras.optimizers.AdamW(1e-3, weight_decay=0.01),
            "adamw8bit": lambda: kvram.optimizers.AdamW8bit(1e-3, weight_decay=0.01),
            "adamw8bit_factored": lambda: kvram.optimizers.AdamW8bit(1e-3, weight_decay=0.01, factored=True),
            }[name]()


def working_bytes(name: str, jit: bool, parameters: int) -> int:
    """The CPU allocator's peak above what was in use over one update (after 2 untimed ones) of
    `parameters` float32 values in 4 variables, as `_host.update_rate` updates them: the memory the
    update works in beyond its variables, gradients and state."""
    import kvram  # first: CPU allocator statistics (TF_ENABLE_ONEDNN_OPTS)
    from kvram.optimizers import _host

    update, wait, _ = _host.sample_update(_optimizer(name), parameters, jit_compile=jit)
    kvram.memory.reset_peak("CPU:0")
    before = kvram.memory.current_bytes("CPU:0")
    update()
    wait()
    return kvram.memory.peak_bytes("CPU:0") - before


def measure(name: str, jit: bool, parameters: int, updates: int) -> dict:
    from kvram.optimizers import _host

    rate = _host.update_rate(_optimizer(name), parameters, updates, jit_compile=jit)
    working = working_bytes(name, jit, parameters)
    parameters = 4 * max(1, parameters // 4 // 1024) * 1024
    return {"optimizer": name, "jit_compile": jit, "parameters": parameters,
            "ms_per_update": 1e3 * parameters / rate, "parameters_per_s": rate,
            "working_bytes": working, "working_bytes_per_parameter": working / parameters}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--parameters", type=int, default=2**24)
    parser.add_argument("--updates", type=int, default=5)
    parser.add_argument("--optimizers", default="adamw,adamw8bit", help=f"comma-separated, of {', '.join(OPTIMIZERS)}")
    parser.add_argument("--jit", choices=("both", "xla", "ops"), default="both",
                        help="one XLA computation, TensorFlow ops, or both")
    parser.add_argument("--threads", type=int, default=None, help="TensorFlow's intra-op threads (default: all cores)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    names = args.optimizers.split(",")
    unknown = sorted(set(names) - set(OPTIMIZERS))
    if unknown:
        parser.error(f"--optimizers: unknown {', '.join(unknown)}. Allowed: {', '.join(OPTIMIZERS)}")
    if args.threads is not None:
        if args.threads < 1:
            parser.error(f"--threads must be a positive int. Received: {args.threads}")
        import tensorflow as tf

        tf.config.threading.set_intra_op_parallelism_threads(args.threads)
    jits = {"both": (False, True), "xla": (True,), "ops": (False,)}[args.jit]
    runs = []
    for name in names:
        for jit in jits:
            run = measure(name, jit, args.parameters, args.updates)
            runs.append(run)
            print(f"{name:18} jit_compile={str(jit):5} {run['ms_per_update']:8.1f} ms per update of "
                  f"{run['parameters'] / 1e6:.1f}M parameters ({run['parameters_per_s'] / 1e6:.0f}M/s), working in "
                  f"{run['working_bytes_per_parameter']:.1f} bytes per parameter", flush=True)
    write_result(args.out, {**result_header("optimizers-host-update", __file__), "cpu_cores": os.cpu_count(),
                            "threads": args.threads or os.cpu_count(), "settings": vars(args), "runs": runs,
                            "versions": versions()})


if __name__ == "__main__":
    main()
