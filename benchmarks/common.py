"""Helpers shared by the benchmarks: timing a Keras fit, running each
configuration in its own process, and describing the machine."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def gpu_name() -> str:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=30,
        )
        return out.stdout.strip()
    except OSError:
        return "unknown"


def versions() -> dict:
    found = {"python": platform.python_version()}
    for name in ("tensorflow", "keras", "torch", "torchvision"):
        module = sys.modules.get(name)
        if module is not None:
            found[name] = module.__version__
    return found


def timed_fit(model, data, steps: int, warmup: int, devices=("GPU:0",)) -> dict:
    """Runs `warmup` steps, then `steps` timed steps of `model.fit(data)`.

    Returns seconds for the timed steps (the clock stops after the last step's
    loss has been read, so queued GPU work is counted), that loss, and the peak
    bytes TensorFlow allocated on each of `devices` during them.
    """
    import keras
    import tensorflow as tf

    times = {}

    class Clock(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            times["start"] = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            times["loss"] = float(logs["loss"])  # waits for the last step
            times["end"] = time.perf_counter()

    model.fit(data, steps_per_epoch=warmup, epochs=1, verbose=0, callbacks=[Clock()])
    for device in devices:
        tf.config.experimental.reset_memory_stats(device)
    model.fit(data, steps_per_epoch=steps, epochs=1, verbose=0, callbacks=[Clock()])
    return {
        "seconds": times["end"] - times["start"],
        "loss": times["loss"],
        "peak_gib": {d: tf.config.experimental.get_memory_info(d)["peak"] / 2**30 for d in devices},
    }


def run_children(script: str, names, args, describe) -> dict:
    """Runs `script --child NAME ARGS...` for each name, one process each (clean
    allocator statistics), and collects the JSON each prints on a `RESULT` line.
    `describe(result)` formats a line of progress."""
    results = {}
    for name in names:
        started = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, script, "--child", name, *map(str, args)], capture_output=True, text=True
        )
        line = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
        if proc.returncode or not line:
            results[name] = {"error": (proc.stderr or proc.stdout)[-3000:]}
        else:
            results[name] = json.loads(line[-1][len("RESULT "):])
        results[name]["wall_s"] = time.perf_counter() - started
        r = results[name]
        text = f"FAILED: {r['error'][-400:]}" if "error" in r else describe(r)
        print(f"{name:26} {text}  ({r['wall_s']:.0f} s)", flush=True)
        print(f"  {name} RESULT {json.dumps(r)}", flush=True)  # kept in logs if a later one stalls
    return results


def child_result(result: dict) -> None:
    print("RESULT " + json.dumps(result), flush=True)
