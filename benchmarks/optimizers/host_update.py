"""How fast the host's cores apply an optimizer update: `HostOffload`'s update as TensorFlow CPU ops
against one XLA computation on the CPU, for `AdamW` and `AdamW8bit`: `--parameters` float32
parameters in 4 equal variables, `--updates` timed updates after 2 untimed ones. How to run it: README.md."""

from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))
from benchmarks.common import result_header, versions, write_result  # noqa: E402


def measure(name: str, jit: bool, parameters: int, updates: int) -> dict:
    import keras

    import kvram
    from kvram.optimizers import _host

    optimizer = {"adamw": lambda: keras.optimizers.AdamW(1e-3, weight_decay=0.01),
                 "adamw8bit": lambda: kvram.optimizers.AdamW8bit(1e-3, weight_decay=0.01)}[name]()
    rate = _host.update_rate(optimizer, parameters, updates, jit_compile=jit)
    parameters = 4 * max(1, parameters // 4 // 1024) * 1024
    return {"optimizer": name, "jit_compile": jit, "parameters": parameters,
            "ms_per_update": 1e3 * parameters / rate, "parameters_per_s": rate}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--parameters", type=int, default=2**24)
    parser.add_argument("--updates", type=int, default=5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    runs = []
    for name in ("adamw", "adamw8bit"):
        for jit in (False, True):
            run = measure(name, jit, args.parameters, args.updates)
            runs.append(run)
            print(f"{name:10} jit_compile={str(jit):5} {run['ms_per_update']:8.1f} ms per update of "
                  f"{run['parameters'] / 1e6:.1f}M parameters ({run['parameters_per_s'] / 1e6:.0f}M/s)", flush=True)
    write_result(args.out, {**result_header("optimizers-host-update", __file__), "cpu_cores": os.cpu_count(),
                            "settings": vars(args), "runs": runs, "versions": versions()})


if __name__ == "__main__":
    main()
