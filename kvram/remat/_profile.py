"""Step 1 of planning (`_plan`'s docstring): one training step of the model as
it is, measured cut by cut by probes that read TensorFlow's allocator."""

from __future__ import annotations

import dataclasses
import math

import keras
import numpy as np
import tensorflow as tf

from kvram.remat._segments import _ordered_nodes


@dataclasses.dataclass(frozen=True)
class _Profile:
    """One measured training step of the unmodified model (bytes beyond what
    was allocated before the step; per segment, in chain order).

    kept: bytes the forward pass of each segment left allocated (its saved
        activations, and its output while the next segment runs).
    need: the highest allocation while the segment's forward or backward pass ran.
    recompute: the allocation a recomputation of runs ending at the segment
        starts from: held when the gradient reached the segment's output, plus
        the segment's forward transient (its forward peak above what it kept);
        None where no gradient reaches it.
    head: the highest allocation while the loss and its gradient ran.
    output: bytes of each segment's output tensor.
    input: bytes of the model's input batch.
    flops: forward FLOPs of each segment (derived from layer shapes).
    """

    kept: tuple
    need: tuple
    recompute: tuple
    transient: tuple
    head: int
    output: tuple
    input: int
    flops: tuple


def _probe_step(parts, x, y, loss_fn, variables, device):
    """The training step of `parts` chained, with allocator probes at each cut.

    Returns (a tf.function, the dict its probes write into). A probe is a
    `tf.py_function` ordered by control dependencies after the tensor it marks
    (forward: a segment's output; backward: the gradient reaching it); it
    records the allocator's current and peak bytes, then resets the peak, so
    each probe's peak covers the stretch since the previous one.
    """
    records = {}

    def reader(key):
        def read():
            info = tf.config.experimental.get_memory_info(device)
            records[key] = (int(info["current"]), int(info["peak"]))
            tf.config.experimental.reset_memory_stats(device)
            return np.int32(0)

        return read

    def mark(tensor, key):
        with tf.control_dependencies([tensor]):
            done = tf.py_function(reader(key), [], tf.int32)
        with tf.control_dependencies([done]):
            return tf.identity(tensor)

    def probe(tensor, index):
        @tf.custom_gradient
        def identity(t):
            return mark(t, ("forward", index)), lambda dy: mark(dy, ("backward", index))

        return identity(tensor)

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            h = x
            for index, part in enumerate(parts):
                h = probe(part(h, training=True), index)
            loss = loss_fn(y, h)
        gradients = [g for g in tape.gradient(loss, variables) if g is not None]
        with tf.control_dependencies(gradients):
            done = tf.py_function(reader(("end",)), [], tf.int32)
        # Returned, as a training step holds them until the optimizer applies them.
        return gradients, done

    return step, records


def _profile(model, chain, x, y, loss_fn, device):
    parts = [keras.Model(s.input, s.output, name=f"{model.name}_segment{s.index}") for s in chain]
    step, records = _probe_step(parts, x, y, loss_fn, model.trainable_variables, device)
    step()  # the first run also allocates what the runtime keeps (kernel caches)
    # The executor's order of independent ops, and so each stretch's peak, varies
    # from step to step: the peaks are the highest of several steps, as the
    # memory a training run needs is its highest step's.
    # What segments keep is steadier: its median is taken.
    runs = [_probe_run(step, records, device, len(chain)) for _ in range(_PROFILE_STEPS)]
    kept, need, recompute, transient, heads = (list(zip(*field)) for field in zip(*runs))
    kept = tuple(int(np.median(values)) for values in kept)
    need, transient = (tuple(max(values) for values in field) for field in (need, transient))
    recompute = tuple(None if None in values else max(values) for values in recompute)
    (head,) = (max(values) for values in heads)
    batch = int(x.shape[0])
    output = [batch * _elements(s.output) * np.dtype(s.output.dtype).itemsize for s in chain]
    return _Profile(
        kept=kept,
        need=need,
        recompute=recompute,
        transient=transient,
        head=head,
        output=tuple(output),
        input=int(np.prod(x.shape)) * x.dtype.size,
        flops=tuple(batch * _segment_flops(model, s) for s in chain),
    )


_PROFILE_STEPS = 3


def _probe_run(step, records, device, n):
    """One probed step: (kept, need, recompute, transient, head), see `_Profile`."""
    records.clear()
    tf.config.experimental.reset_memory_stats(device)
    base = int(tf.config.experimental.get_memory_info(device)["current"])
    step()
    current = [records[("forward", i)][0] - base for i in range(n)]
    kept = [current[0]] + [current[i] - current[i - 1] for i in range(1, n)]
    forward_peak = [records[("forward", i)][1] - base for i in range(n)]
    # The probe on the gradient reaching segment i's output closes the stretch
    # in which segment i + 1's backward ran; no probe fires where no gradient is
    # needed (a stem without weights), so a stretch may cover several segments.
    closing = [("end",)] + [("backward", i) for i in range(n - 1)]
    backward_peak = []
    for i in range(n):
        j = i
        while closing[j] not in records:
            j -= 1
        backward_peak.append(records[closing[j]][1] - base)
    held = [
        records[("backward", i)][0] - base if ("backward", i) in records else None for i in range(n)
    ]
    return (
        kept,
        [max(f, b) for f, b in zip(forward_peak, backward_peak)],
        held,
        [p - c for p, c in zip(forward_peak, current)],
        [records[("backward", n - 1)][1] - base],
    )


def _elements(tensor) -> int:
    return int(math.prod(d for d in tensor.shape[1:]))


def _segment_flops(model, segment) -> int:
    """Forward FLOPs of one sample through `segment`: 2 per multiply-add of the
    layers with kernels (convolutions, dense, depthwise: output elements times
    the kernel's inputs per output), one per output element for the rest."""
    called = set(segment.layers)
    flops = 0
    for node in _ordered_nodes(model):
        layer = node.operation
        if layer.name not in called:
            continue
        out = sum(_elements(t) for t in node.outputs)
        channels = int(node.outputs[0].shape[-1] or 1)
        kernel = getattr(layer, "kernel", None)
        if kernel is not None and len(kernel.shape) >= 2:
            macs = out * math.prod(kernel.shape) // channels
        else:
            inner = [
                v
                for v in getattr(layer, "trainable_weights", ())
                if v.name.endswith("kernel") and len(v.shape) >= 2
            ]
            macs = (out // channels) * sum(math.prod(v.shape) for v in inner)
        flops += 2 * macs + out
    return flops
