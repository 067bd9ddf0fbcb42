"""Step 1 of planning (`_plan`'s docstring): one training step of the model as
it is, measured cut by cut by probes that read TensorFlow's allocator."""

from __future__ import annotations

import contextlib
import dataclasses
import math

import numpy as np
import tensorflow as tf
from keras import tree

from kvram import memory
from kvram.remat._segments import _main_input, _ordered_nodes, _part


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


def _probe_step(model, parts, x, y, loss_fn, variables, device):
    """The training step of `parts` ((segment, its model) pairs) chained, with
    allocator probes at each cut (on each segment's main output).

    Returns (a tf.function of (x, y), the dict its probes write into). It is
    traced once, for batches like `x` and `y` with any number of rows: the
    probe batches share it. A probe is a
    `tf.py_function` ordered by control dependencies after the tensor it marks
    (forward: a segment's output; backward: the gradient reaching it); it
    records the allocator's current and peak bytes, then resets the peak, so
    each probe's peak covers the stretch since the previous one.
    """
    records = {}
    model_inputs, model_outputs, outputs_struct = model.inputs, model.outputs, model._outputs_struct

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

    def step(x, y=None):
        with tf.GradientTape() as tape:
            tensors = {id(t): v for t, v in zip(model_inputs, tree.flatten(x))}
            for index, (segment, part) in enumerate(parts):
                if segment.side_inputs or segment.side_outputs:
                    results = tree.flatten(part([tensors[id(t)] for t in segment.inputs], training=True))
                    results = [probe(results[0], index), *results[1:]]
                    tensors.update((id(t), r) for t, r in zip(segment.outputs, results))
                else:
                    tensors[id(segment.output)] = probe(part(tensors[id(segment.input)], training=True), index)
            loss = loss_fn(y, tree.pack_sequence_as(outputs_struct, [tensors[id(t)] for t in model_outputs]))
        gradients = [g for g in tape.gradient(loss, variables) if g is not None]
        with tf.control_dependencies(gradients):
            done = tf.py_function(reader(("end",)), [], tf.int32)
        # Returned, as a training step holds them until the optimizer applies them.
        return gradients, done

    return traced_for_any_rows(step, x, y), records


def traced_for_any_rows(step, x, y, **options):
    """`step(x, y=None)` as a `tf.function` traced once for batches like `x`
    and `y` with any number of rows (`options`: tf.function's, e.g.
    jit_compile); where `y` is None, it is called with None."""

    def open_rows(t):
        return tf.TensorSpec((None, *t.shape[1:]), t.dtype)

    signature = [tree.map_structure(open_rows, t) for t in (x, y) if t is not None]
    return tf.function(step, input_signature=signature, **options)


def _profile(model, chain, x, y, loss_fn, device, log=None):
    return _profiles(model, chain, [(x, y)], loss_fn, device, log)[0]


def _profiles(model, chain, batches, loss_fn, device, log=None):
    """A `_Profile` for each (x, y) of `batches`, measured by one probed step
    traced once for them all (on an H200, each trace of it took 2.9-5.1 s:
    benchmarks/results/plan_minute_h200/8707064_probe_times/ at commit 1fb3fe3).
    Where that step runs out of the device's memory, the chain is measured in
    windows (`_windowed`); `log`, if given, is told so."""
    # the steps move BatchNormalization statistics and seeds
    with memory.state_kept(model), shared_grouped_convolutions(device), graph_optimizers_off(device):
        windows = 1
        while True:
            try:
                if windows == 1:
                    return _profile_steps(model, chain, batches, loss_fn, device)
                return _windowed(model, chain, batches, loss_fn, device, windows)
            except (tf.errors.ResourceExhaustedError, tf.errors.InternalError) as error:
                if not memory.is_out_of_memory(error) or windows >= len(chain):
                    raise
            memory.collect_garbage()
            windows = min(2 * windows, len(chain))
            if log is not None:
                log(f"the unmodified step ran out of memory; measuring it in {windows} windows of segments, "
                    "the others recomputed")


def _windowed(model, chain, batches, loss_fn, device, windows):
    """`_Profile`s of the unmodified step pieced together from `windows` probed
    steps, each with one window of consecutive segments as they are and every
    other segment a `Checkpoint` of its own, so that each holds about
    1/`windows` of the step's activations (a model whose step does not fit the
    device: a 2.5B-parameter LoRA Gemma under 16 GiB). A window's segments keep
    what they keep unmodified; what they need, the allocation their
    recomputation starts from and the head's are the measured ones plus what the
    recomputed segments before the window would have kept beyond their outputs
    (`_choice._saving`, the planner's own account of a recomputed run), from the
    windows that measured those."""
    n = len(chain)
    bounds = [round(k * n / windows) for k in range(windows + 1)]
    measured = [_profile_steps(model, chain, batches, loss_fn, device, plain=range(lo, hi))
                for lo, hi in zip(bounds, bounds[1:])]
    pieced = []
    for at_rows in zip(*measured):  # each batch's profile from every window
        kept, need, recompute, transient = [], [], [], []
        for (lo, hi), window in zip(zip(bounds, bounds[1:]), at_rows):
            saved = sum(kept[j] - window.output[j] for j in range(lo))
            kept += window.kept[lo:hi]
            transient += window.transient[lo:hi]
            need += [value + saved for value in window.need[lo:hi]]
            recompute += [None if value is None else value + saved for value in window.recompute[lo:hi]]
        last = at_rows[-1]  # the head ran after the last window, `saved` is what came before that window
        pieced.append(dataclasses.replace(
            last, kept=tuple(kept), need=tuple(need), recompute=tuple(recompute), transient=tuple(transient),
            head=last.head + saved))
    return pieced


@contextlib.contextmanager
def graph_optimizers_off(device):
    """Within, on a GPU, functions run without TensorFlow's graph optimizers
    (Grappler: `disable_meta_optimizer`), which optimize each probed step on
    its first run. On an H200 with `TF_CUDNN_USE_AUTOTUNE=0` (as `kvram plan`
    measures), the first runs of the probed steps took 14.0 and 11.4 s without
    them against 21.6 and 14.5 s with them (ConvNeXtSmall, 16 and 32 rows), 6.4
    and 2.1 s against 7.4 and 4.0 s (ResNet50, 32 and 64 rows), and measured
    the same within 1% (the highest stretch's peak, and what segments keep:
    benchmarks/results/plan_minute_h200/8707064_probe_times/ at commit 1fb3fe3). On the CPU,
    where the measurement is quick, nothing is changed."""
    if not device.startswith("GPU"):
        yield
        return
    before = tf.config.optimizer.get_experimental_options().get("disable_meta_optimizer", False)
    tf.config.optimizer.set_experimental_options({"disable_meta_optimizer": True})
    try:
        yield
    finally:
        tf.config.optimizer.set_experimental_options({"disable_meta_optimizer": before})


@contextlib.contextmanager
def shared_grouped_convolutions(device):
    """Within, on a GPU, functions traced run Keras's grouped convolutions
    (`Conv2D(groups > 1)`: ConvNeXt's depthwise 7x7, ResNeXt, RegNet) as calls
    of one jit-compiled function (`_grouped_convolution`), which XLA compiles
    once for each shape, whatever the number of convolutions of that shape.

    Keras's TensorFlow backend compiles every grouped convolution as an XLA
    function of its own on every device, a workaround for TensorFlow's CPU
    kernels (keras/src/backend/tensorflow/nn.py `conv`, "grouped convolutions
    are broken on CPU without XLA"; keras-team/keras#18180 asks to limit it
    to the CPU). In a graph-executor step, as the cut-by-cut measurement is,
    that is one XLA compile per convolution and per gradient: ConvNeXtSmall's
    measurement at 16 and 32 rows took 99.6-117.8 s on an H200. TensorFlow's
    own Conv2D op instead reached cuDNN, which built its plans for each new
    shape and batch size, even without autotuning: about 2.3 s a shape and
    batch, the probe's first runs 24.4 and 11.4 s (ConvNeXtSmall, 16 and 32
    rows). The shared function's first runs took 7.3 and 1.5 s, measured the
    same within 0.05%, and `kvram plan` for ConvNeXtSmall took 47.1-48.0 s
    against 67.2 s (benchmarks/results/plan_minute_h200/ at commit 1fb3fe3, 2026-11-28). Under
    a jit-compiled step (a GPU's training, the checks) the functions are
    inlined and nothing changes. On the CPU nothing is changed."""
    if not device.startswith("GPU"):
        yield
        return
    from keras.src.backend.tensorflow import nn
    from keras.src.utils.argument_validation import standardize_tuple

    keras_conv = nn.conv

    def conv(inputs, kernel, strides=1, padding="valid", data_format=None, dilation_rate=1):
        data_format = nn.backend.standardize_data_format(data_format)
        channels = inputs.shape[-1] if data_format == "channels_last" else inputs.shape[1]
        if channels == kernel.shape[-2] or (data_format == "channels_first" and len(inputs.shape) == 5):
            return keras_conv(inputs, kernel, strides, padding, data_format, dilation_rate)
        rank = len(inputs.shape) - 2
        # the kernel is a Keras variable: a tensor of it, as the function's argument
        return _grouped_convolution(inputs, tf.convert_to_tensor(kernel), standardize_tuple(strides, rank, "strides"),
                                    padding.upper(), nn._convert_data_format(data_format, len(inputs.shape)),
                                    standardize_tuple(dilation_rate, rank, "dilation_rate"))

    nn.conv = conv
    try:
        yield
    finally:
        nn.conv = keras_conv


@tf.function(jit_compile=True)
def _grouped_convolution(inputs, kernel, strides, padding, data_format, dilations):
    """One grouped convolution, for every one of `shared_grouped_convolutions`:
    traced once for each shape, dtype and options (the Python arguments)."""
    return tf.nn.convolution(inputs, kernel, strides, padding, data_format=data_format, dilations=dilations)


def _profile_steps(model, chain, batches, loss_fn, device, plain=None):
    """Profiles of the probed step; with `plain` (segment positions), every other segment a `Checkpoint`."""
    from kvram.layers import Checkpoint

    parts = [(s, _part([s], f"{model.name}_segment{s.index}")) for s in chain]
    if plain is not None:
        parts = [(s, part if i in plain else Checkpoint(part)) for i, (s, part) in enumerate(parts)]
    step, records = _probe_step(model, parts, *batches[0], loss_fn, model.trainable_variables, device)
    return [_profile_at(model, chain, step, records, x, y, device) for x, y in batches]


def _profile_at(model, chain, step, records, x, y, device):
    """The `_Profile` of the probed `step` run on (x, y)."""
    step(x, y)  # the first run also allocates what the runtime keeps (kernel caches)
    # The executor's order of independent ops, and so each stretch's peak, varies
    # from step to step: the peaks are the highest of several steps, as the
    # memory a training run needs is its highest step's.
    # What segments keep is steadier: its median is taken.
    runs = [_probe_run(lambda: step(x, y), records, device, len(chain)) for _ in range(peak_steps())]
    kept, need, recompute, transient, heads = (list(zip(*field)) for field in zip(*runs))
    kept = tuple(int(np.median(values)) for values in kept)
    need, transient = (tuple(max(values) for values in field) for field in (need, transient))
    recompute = tuple(None if None in values else max(values) for values in recompute)
    (head,) = (max(values) for values in heads)
    flat = [t for t in tree.flatten(x) if t is not None]
    batch = int(flat[0].shape[0])
    unknown = _unknown_size(model, flat)
    output = [batch * _elements(s.output, unknown) * np.dtype(s.output.dtype).itemsize for s in chain]
    return _Profile(
        kept=kept,
        need=need,
        recompute=recompute,
        transient=transient,
        head=head,
        output=tuple(output),
        input=_nbytes(_main_of(model, flat)),
        flops=tuple(batch * _segment_flops(model, s, unknown) for s in chain),
    )


_PROFILE_STEPS = 3


def peak_steps() -> int:
    """How many steps a peak is the highest of: _PROFILE_STEPS on TensorFlow's default executor,
    whose order of independent ops (and so the peak) varies from step to step; one where this
    thread's `tf.function`s run on the single-threaded executor (one op order: EfficientNetB0's
    and MobileNetV3Small's training steps on the CPU peaked at the same byte six steps in a row,
    227.42 and 127.21 MiB, where on the default executor they moved by up to 0.5 MiB)."""
    from tensorflow.python.eager import context

    executor = context.context().function_call_options.executor_type
    return 1 if executor == "SINGLE_THREADED_EXECUTOR" else _PROFILE_STEPS


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


def _nbytes(tensor) -> int:
    return int(np.prod(tensor.shape)) * tensor.dtype.size


def _main_of(model, flat):
    """The sample batch's tensor for the model's main input (`_segments._main_input`)."""
    main = _main_input(model, _ordered_nodes(model))
    return next(v for t, v in zip(model.inputs, flat) if t is main)


def _unknown_size(model, flat) -> int:
    """What a dimension the graph leaves open (None, past the batch's) stands for
    in the sample batch: its first open input dimension's size (a sequence's
    length), else 1."""
    for t, v in zip(model.inputs, flat):
        for d, size in zip(t.shape[1:], v.shape[1:]):
            if d is None:
                return int(size)
    return 1


def _elements(tensor, unknown: int = 1) -> int:
    """Elements of one sample of `tensor`, open dimensions taken as `unknown`."""
    return int(math.prod(unknown if d is None else d for d in tensor.shape[1:]))


def _segment_flops(model, segment, unknown: int = 1) -> int:
    """Forward FLOPs of one sample through `segment`: 2 per multiply-add of the
    layers with kernels (convolutions, dense, depthwise: output elements times
    the kernel's inputs per output), one per output element for the rest
    (open dimensions taken as `unknown`)."""
    called = set(segment.layers)
    flops = 0
    for node in _ordered_nodes(model):
        layer = node.operation
        if layer.name not in called:
            continue
        out = sum(_elements(t, unknown) for t in node.outputs)
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
