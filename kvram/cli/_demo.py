"""`kvram demo`: the same model trained plain and with kvram, side by side."""

from __future__ import annotations

import json
import statistics
import time

import keras
import numpy as np
import tensorflow as tf

from kvram import _quiet, memory, precision
from kvram.cli._plan import limit_gpu
from kvram.layers import Checkpoint
from kvram.training import Model

__all__ = ["run_demo"]


# GPT-2's initialisation (normal, std 0.02; each block's output projection scaled by
# 1/sqrt(2 blocks)) and a classifier that starts at zero: with Keras's Glorot defaults the
# GPU demo's 12 blocks of width 1024 under Adam(1e-3) sent the loss from 3.1 to 11 within five
# steps before it fell; from these it falls from the first step.
def _normal(std: float):
    return keras.initializers.RandomNormal(stddev=std)


def _residual_block(width: int, expansion: int, dropout: float, name: str, blocks: int) -> keras.Model:
    inputs = keras.Input((width,))
    h = keras.layers.LayerNormalization()(inputs)
    h = keras.layers.Dense(width * expansion, activation="gelu", kernel_initializer=_normal(0.02))(h)
    h = keras.layers.Dropout(dropout)(h)
    h = keras.layers.Dense(width, kernel_initializer=_normal(0.02 / (2 * blocks) ** 0.5))(h)
    return keras.Model(inputs, keras.layers.Add()([inputs, h]), name=name)


def build_model(checkpoint: bool, *, features: int, width: int, blocks: int, classes: int):
    """A residual MLP classifier; with `checkpoint`, each block is a kvram Checkpoint."""
    inputs = keras.Input((features,))
    x = keras.layers.Dense(width, kernel_initializer=_normal(0.02))(inputs)
    for i in range(blocks):
        block = _residual_block(width, 4, 0.1, name=f"block{i}", blocks=blocks)
        x = (Checkpoint(block) if checkpoint else block)(x)
    x = keras.layers.LayerNormalization()(x)
    outputs = keras.layers.Dense(classes, dtype="float32", kernel_initializer="zeros")(x)
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
    def __init__(self, bar: keras.utils.Progbar):
        super().__init__()
        self.bar, self.times, self.losses = bar, [], []

    def on_train_batch_begin(self, batch, logs=None):
        self._start = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        loss = float(logs["loss"])  # reading the loss waits for the step to finish
        self.times.append(time.perf_counter() - self._start)
        self.losses.append(loss)
        self.bar.add(1, values=[("loss", loss)])


LEARNING_RATE = 3e-4

# A GPU's defaults: a model and batch whose plain step needs far more memory than the
# checkpointed one, and a limit between the two (`kvram demo --gpu-memory`).
GPU_DEFAULTS = dict(width=1024, batch_size=16384, samples=8 * 16384, epochs=2, gpu_memory=4 * 2**30)
CPU_DEFAULTS = dict(width=256, batch_size=512, samples=8192, epochs=3, gpu_memory=None)


def _train(checkpoint: bool, policy: str, device: str, data, args, print_fn) -> dict:
    label = "kvram, every block checkpointed" if checkpoint else "plain Keras"
    print_fn(f"{label} ({policy}):")
    bar = keras.utils.Progbar(args["epochs"] * args["steps_per_epoch"], unit_name="step",
                              stateful_metrics=["loss"])
    keras.backend.clear_session()
    keras.config.set_dtype_policy(policy)
    keras.utils.set_random_seed(args["seed"])
    result = {"model": "kvram" if checkpoint else "plain", "policy": policy, "checkpointing": checkpoint}
    with tf.device(device):
        model = build_model(
            checkpoint, features=args["features"], width=args["width"], blocks=args["blocks"],
            classes=args["classes"],
        )
        model.compile(  # Keras's defaults on both sides: XLA on a GPU, not on the CPU
            optimizer=keras.optimizers.Adam(LEARNING_RATE),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
        clock = _StepClock(bar)
        x, y = data
        memory.reset_peak(device)
        start_bytes = memory.current_bytes(device)
        try:
            model.fit(x, y, batch_size=args["batch_size"], epochs=args["epochs"], shuffle=False, verbose=0,
                      callbacks=[clock])
        except tf.errors.ResourceExhaustedError:
            print_fn(f"  out of memory at step {len(clock.times) + 1}")
            return {**result, "out_of_memory": True, "params": int(model.count_params())}
        peak = memory.peak_bytes(device) - start_bytes
    steady = clock.times[2:] or clock.times
    return {
        **result,
        "out_of_memory": False,
        "peak_mib": peak / 2**20,
        "step_ms": 1000 * statistics.median(steady),
        "final_loss": float(np.mean(clock.losses[-args["steps_per_epoch"]:])),
        "losses": [round(loss, 4) for loss in clock.losses],  # each epoch's running mean, as the bar shows it
        "params": int(model.count_params()),
    }


def run_demo(
    device: str | None = None,
    *,
    epochs: int | None = None,
    batch_size: int | None = None,
    blocks: int = 12,
    width: int | None = None,
    samples: int | None = None,
    gpu_memory: int | None = None,
    seed: int = 0,
    json_path: str | None = None,
    print_fn=print,
) -> dict:
    """Trains a residual MLP plain and with kvram (every block under `kvram.layers.Checkpoint`), at the
    same precision (`kvram.precision.auto_policy` on a GPU, float32 on the CPU).

    On a GPU, the GPU is first limited to `gpu_memory` bytes (4 GiB by default; a logical device), and
    the defaults make a batch whose plain step needs more than that: plain Keras runs out of memory
    where kvram trains. On the CPU, where memory is not limited, both train and the summary says how
    much less kvram needed. Each run has its own labelled progress bar. Returns the figures (and
    writes them to `json_path`).
    """
    # Physical devices only until the limit is set: listing logical ones starts the runtime.
    if device is None:
        on_gpu = bool(tf.config.list_physical_devices("GPU"))
    else:
        on_gpu = memory._device_name(device).startswith("GPU")
    defaults = GPU_DEFAULTS if on_gpu else CPU_DEFAULTS
    epochs = epochs or defaults["epochs"]
    batch_size = batch_size or defaults["batch_size"]
    width = width or defaults["width"]
    samples = samples or max(defaults["samples"], 4 * batch_size)
    gpu_memory = gpu_memory or defaults["gpu_memory"]
    limited = False
    if on_gpu and gpu_memory:
        try:
            limited = limit_gpu(gpu_memory)
        except RuntimeError as error:  # TensorFlow's runtime has started: the GPU would run unlimited
            raise RuntimeError(
                f"kvram demo could not limit the GPU to {gpu_memory / 2**30:.1f} GiB: TensorFlow's runtime had "
                f"started ({error}). Allowed: the `kvram demo` command, or run_demo() before TensorFlow runs its "
                "first operation in this process."
            ) from None
    _quiet.devices_set()
    device = memory._device_name(device)
    policy = precision.auto_policy() if on_gpu else "float32"
    args = dict(
        features=128, width=width, blocks=blocks, classes=10, batch_size=batch_size,
        epochs=epochs, seed=seed, steps_per_epoch=-(-samples // batch_size),
    )
    data = make_data(samples, args["features"], args["classes"], seed)
    limit = f", GPU limited to {gpu_memory / 2**30:.1f} GiB" if limited else ""
    print_fn(
        f"kvram demo on {device}{limit}: a {blocks}-block residual MLP (width {width}), {samples} samples, "
        f"batch {batch_size}, {epochs} epochs, {policy}, trained plain and with kvram"
    )
    previous = precision.current_policy()
    try:
        plain = _train(False, policy, device, data, args, print_fn)
        ours = _train(True, policy, device, data, args, print_fn)
    finally:
        keras.config.set_dtype_policy(previous)
    result = {
        "device": device,
        "gpu_memory_limit_bytes": gpu_memory if limited else None,
        "tensorflow": tf.__version__,
        "keras": keras.__version__,
        "config": args,
        "plain": plain,
        "kvram": ours,
    }
    if not plain["out_of_memory"] and not ours["out_of_memory"]:
        result["memory_ratio"] = ours["peak_mib"] / plain["peak_mib"]
        result["time_ratio"] = ours["step_ms"] / plain["step_ms"]
    result["summary"] = summary(result)
    print_fn(format_table(result))
    if json_path:
        with open(json_path, "w") as f:
            json.dump(result, f, indent=2)
    return result


def summary(result: dict) -> str:
    """What kvram bought, in a sentence."""
    p, k = result["plain"], result["kvram"]
    limit = result.get("gpu_memory_limit_bytes")
    where = f"a {limit / 2**30:.1f} GiB GPU" if limit else result["device"]
    batch = result["config"]["batch_size"]
    if p["out_of_memory"] and not k["out_of_memory"]:
        return (f"On {where}, plain Keras ran out of memory at batch {batch}; kvram trained it in "
                f"{k['peak_mib']:.0f} MiB at the same precision ({k['policy']}), recomputing every block.")
    if k["out_of_memory"]:
        return (f"On {where}, kvram ran out of memory too at batch {batch}: try a smaller --batch-size "
                f"or a larger --gpu-memory.")
    text = (f"kvram trained the same model (final loss {k['final_loss']:.4f}, plain {p['final_loss']:.4f}) in "
            f"{result['memory_ratio']:.2f}x the peak memory of plain Keras ({k['peak_mib']:.1f} vs "
            f"{p['peak_mib']:.1f} MiB) at {result['time_ratio']:.2f}x its step time: ")
    if result["memory_ratio"] >= 1:
        return text + ("checkpointing every block lowered no peak at this shape (the stored activations are "
                       "not what sets it): a larger --batch-size makes them the larger part.")
    if limit:
        return text + "plain Keras fit within the limit too; raise --batch-size to see it run out."
    return text + ("under a memory limit between the two, only kvram trains (a GPU shows it: kvram demo "
                   "limits the GPU and runs plain Keras out of memory).")


def format_table(result: dict) -> str:
    def cell(run, key, fmt):
        return "out of memory" if run["out_of_memory"] else format(run[key], fmt)

    p, k = result["plain"], result["kvram"]
    rows = [("", "plain Keras", "kvram")]
    rows.append(("policy", p["policy"], k["policy"]))
    rows.append(("checkpointing", "no", "every block"))
    rows.append(("peak memory (MiB)", cell(p, "peak_mib", ".1f"), cell(k, "peak_mib", ".1f")))
    rows.append(("median step (ms)", cell(p, "step_ms", ".1f"), cell(k, "step_ms", ".1f")))
    rows.append(("final loss", cell(p, "final_loss", ".4f"), cell(k, "final_loss", ".4f")))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    lines.append(result["summary"])
    return "\n".join(lines)
