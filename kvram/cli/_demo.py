"""`kvram demo`: the same model trained plain and with kvram, side by side."""

from __future__ import annotations

import json
import statistics
import time

import keras
import numpy as np
import tensorflow as tf

from kvram import memory, precision
from kvram.layers import Checkpoint
from kvram.training import Model

__all__ = ["run_demo"]


def _residual_block(width: int, expansion: int, dropout: float, name: str) -> keras.Model:
    inputs = keras.Input((width,))
    h = keras.layers.LayerNormalization()(inputs)
    h = keras.layers.Dense(width * expansion, activation="gelu")(h)
    h = keras.layers.Dropout(dropout)(h)
    h = keras.layers.Dense(width)(h)
    return keras.Model(inputs, keras.layers.Add()([inputs, h]), name=name)


def build_model(checkpoint: bool, *, features: int, width: int, blocks: int, classes: int):
    """A residual MLP classifier; with `checkpoint`, each block is a kvram Checkpoint."""
    inputs = keras.Input((features,))
    x = keras.layers.Dense(width)(inputs)
    for i in range(blocks):
        block = _residual_block(width, 4, 0.1, name=f"block{i}")
        x = (Checkpoint(block) if checkpoint else block)(x)
    x = keras.layers.LayerNormalization()(x)
    outputs = keras.layers.Dense(classes, dtype="float32")(x)
    cls = Model if checkpoint else keras.Model
    return cls(inputs, outputs, name="kvram" if checkpoint else "plain")


def make_data(samples: int, features: int, classes: int, seed: int = 0):
    """Inputs and labels of a learnable task: labels from a fixed random teacher."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((samples, features)).astype("float32")
    teacher = rng.standard_normal((features, classes)).astype("float32")
    y = np.argmax(np.tanh(x @ teacher) + 0.1 * rng.standard_normal((samples, classes)), axis=1)
    return x, y.astype("int32")


class _StepClock(keras.callbacks.Callback):
    def __init__(self, bar: keras.utils.Progbar, label: str):
        super().__init__()
        self.bar, self.label, self.times, self.losses = bar, label, [], []

    def on_train_batch_begin(self, batch, logs=None):
        self._start = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        loss = float(logs["loss"])  # reading the loss waits for the step to finish
        self.times.append(time.perf_counter() - self._start)
        self.losses.append(loss)
        self.bar.add(1, values=[("loss", loss)])


def _train(checkpoint: bool, policy: str, device: str, data, args, bar) -> dict:
    keras.backend.clear_session()
    keras.config.set_dtype_policy(policy)
    keras.utils.set_random_seed(args["seed"])
    with tf.device(device):
        model = build_model(
            checkpoint,
            features=args["features"],
            width=args["width"],
            blocks=args["blocks"],
            classes=args["classes"],
        )
        model.compile(
            optimizer=keras.optimizers.Adam(1e-3),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            jit_compile=False,
        )
        clock = _StepClock(bar, "kvram" if checkpoint else "plain")
        x, y = data
        memory.reset_peak(device)
        start_bytes = memory.current_bytes(device)
        model.fit(
            x, y, batch_size=args["batch_size"], epochs=args["epochs"],
            shuffle=False, verbose=0, callbacks=[clock],
        )
        peak = memory.peak_bytes(device) - start_bytes
    steady = clock.times[2:] or clock.times
    return {
        "model": model.name,
        "policy": policy,
        "checkpointing": checkpoint,
        "peak_mib": peak / 2**20,
        "step_ms": 1000 * statistics.median(steady),
        "final_loss": float(np.mean(clock.losses[-args["steps_per_epoch"]:])),
        "params": int(model.count_params()),
    }


def run_demo(
    device: str | None = None,
    *,
    epochs: int = 3,
    batch_size: int = 512,
    blocks: int = 12,
    width: int = 256,
    samples: int = 8192,
    seed: int = 0,
    json_path: str | None = None,
    print_fn=print,
) -> dict:
    """Trains a residual MLP plain (float32, no checkpointing) and with kvram.

    The kvram run wraps every block in `kvram.layers.Checkpoint` and uses the
    precision policy that suits the device (`kvram.precision.auto_policy`). Prints a
    table of peak memory, median step time and final loss and returns the figures.
    """
    device = memory._device_name(device)
    policy = precision.auto_policy() if device.startswith("GPU") else "float32"
    args = dict(
        features=128, width=width, blocks=blocks, classes=10, batch_size=batch_size,
        epochs=epochs, seed=seed, steps_per_epoch=-(-samples // batch_size),
    )
    data = make_data(samples, args["features"], args["classes"], seed)
    print_fn(
        f"kvram demo on {device}: {blocks}-block residual MLP (width {width}), "
        f"{samples} samples, batch {batch_size}, {epochs} epochs, trained twice"
    )
    bar = keras.utils.Progbar(
        2 * epochs * args["steps_per_epoch"], unit_name="step", stateful_metrics=["loss"]
    )
    previous = precision.current_policy()
    try:
        plain = _train(False, "float32", device, data, args, bar)
        ours = _train(True, policy, device, data, args, bar)
    finally:
        keras.config.set_dtype_policy(previous)
    result = {
        "device": device,
        "tensorflow": tf.__version__,
        "keras": keras.__version__,
        "config": args,
        "plain": plain,
        "kvram": ours,
        "memory_ratio": ours["peak_mib"] / plain["peak_mib"],
        "time_ratio": ours["step_ms"] / plain["step_ms"],
    }
    print_fn(format_table(result))
    if json_path:
        with open(json_path, "w") as f:
            json.dump(result, f, indent=2)
    return result


def format_table(result: dict) -> str:
    rows = [("", "plain Keras", "kvram")]
    p, k = result["plain"], result["kvram"]
    rows.append(("policy", p["policy"], k["policy"]))
    rows.append(("checkpointing", "no", "every block"))
    rows.append(("peak memory (MiB)", f"{p['peak_mib']:.1f}", f"{k['peak_mib']:.1f}"))
    rows.append(("median step (ms)", f"{p['step_ms']:.1f}", f"{k['step_ms']:.1f}"))
    rows.append(("final loss", f"{p['final_loss']:.4f}", f"{k['final_loss']:.4f}"))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    lines.append(
        f"kvram uses {result['memory_ratio']:.2f}x the peak memory at "
        f"{result['time_ratio']:.2f}x the step time of plain Keras."
    )
    return "\n".join(lines)
