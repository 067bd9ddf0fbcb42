"""`balance`: layers split into contiguous stages of near-equal cost (memory or
time), for `PipelineModel`."""

from __future__ import annotations

import dataclasses
import time

import keras
import numpy as np
import tensorflow as tf


@dataclasses.dataclass
class Balance:
    """What `balance` decided: `stages` (one `keras.Sequential` per device), the
    `devices`, each layer's measured `costs`, the `groups` of layer indices, and
    `report`, a text saying why."""

    stages: list
    devices: list
    costs: list
    groups: list
    by: str
    report: str


def balance(layers, devices, by: str = "memory", sample_batch=None, repeats: int = 3) -> Balance:
    """Splits a sequence of layers into one contiguous stage per device.

    Each layer's cost is measured on `sample_batch` (a batch of the first
    layer's input): `by="memory"` counts its parameter bytes (weights, gradients
    and two optimizer slots: 4x) plus its output activation bytes for that batch;
    `by="time"` times its forward and backward pass (median of `repeats`). The
    split minimises the largest stage's total (exact dynamic programme over the
    contiguous splits).

    Returns:
        A `Balance`; `PipelineModel(result.stages, result.devices)` uses it.
    """
    layers = list(layers)
    devices = list(devices)
    if by not in ("memory", "time"):
        raise ValueError(f"`by` must be 'memory' or 'time'. Received: by={by!r}")
    if not layers or not all(isinstance(layer, keras.layers.Layer) for layer in layers):
        raise TypeError("`layers` must be a non-empty list of Keras layers.")
    if len(devices) < 1 or len(devices) > len(layers):
        raise ValueError(
            f"Need between 1 and {len(layers)} devices for {len(layers)} layers. "
            f"Received: {len(devices)} devices"
        )
    if sample_batch is None:
        raise ValueError("`sample_batch` is needed to build the layers and measure them.")
    costs = []
    h = tf.convert_to_tensor(sample_batch)
    for original in layers:
        # Measure a copy: building the layer itself here would create its
        # variables on the default device, before PipelineModel places them.
        layer = original.__class__.from_config(original.get_config())
        with tf.GradientTape() as tape:
            tape.watch(h)
            out = layer(h, training=True)
        if by == "memory":
            params = sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize for v in layer.weights)
            activation = int(np.prod(out.shape)) * out.dtype.size
            costs.append(4 * params + activation)
        else:
            seconds = []
            for _ in range(max(1, repeats)):
                started = time.perf_counter()
                with tf.GradientTape() as tape:
                    tape.watch(h)
                    y = layer(h, training=True)
                grads = tape.gradient(y, [h] + layer.trainable_weights)
                _ = [np.asarray(g) for g in grads if g is not None]
                seconds.append(time.perf_counter() - started)
            costs.append(float(np.median(seconds)))
        h = out
    groups = _partition(costs, len(devices))
    stages = [keras.Sequential([layers[i] for i in group]) for group in groups]
    unit = "bytes" if by == "memory" else "s"
    totals = [sum(costs[i] for i in group) for group in groups]
    lines = [f"balance by {by}: {len(layers)} layers over {len(devices)} devices"]
    for group, total, device in zip(groups, totals, devices):
        names = ", ".join(layers[i].name for i in group)
        lines.append(f"  {device}: layers {group[0]}-{group[-1]} ({names}): {total:.4g} {unit}")
    lines.append(f"  largest stage {max(totals):.4g} {unit}, total {sum(totals):.4g} {unit}; "
                 "no other contiguous split has a smaller largest stage")
    return Balance(stages, devices, costs, groups, by, "\n".join(lines))


def _partition(costs, parts):
    """Contiguous split of `costs` into `parts` groups minimising the largest sum."""
    n = len(costs)
    prefix = np.concatenate([[0.0], np.cumsum(costs)])
    best = np.full((parts + 1, n + 1), np.inf)
    cut = np.zeros((parts + 1, n + 1), dtype=int)
    best[0, 0] = 0.0
    for p in range(1, parts + 1):
        for j in range(p, n + 1):
            for i in range(p - 1, j):
                value = max(best[p - 1, i], prefix[j] - prefix[i])
                if value < best[p, j]:
                    best[p, j], cut[p, j] = value, i
    groups, j = [], n
    for p in range(parts, 0, -1):
        i = cut[p, j]
        groups.append(list(range(i, j)))
        j = i
    return groups[::-1]
