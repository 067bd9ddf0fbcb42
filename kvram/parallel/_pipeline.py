"""Stage splitting across devices with GPipe-style micro-batch pipelining.

`PipelineModel(stages, devices, micro_batches)` puts each stage (a Keras layer or
model) on its own device: its variables are created there (variables live where a
layer is built), its forward pass and its backward pass run there (each stage's
backward is a separate `tape.gradient` under that stage's `tf.device`, since
gradients computed by one outer tape carry no device), and the optimizer's slots
for its variables, and their updates, are placed there too (Keras would create
them on the default device).

A batch is cut into `micro_batches` slices. All slices go forward through the
stages, then backward; the step is one TensorFlow graph, whose executor runs an
op as soon as its inputs are ready, so stage 1 computes slice i+1 while stage 2
computes slice i (the GPipe schedule). Gradients are summed per stage on the
stage's device, weighted by each slice's share of rows: the update equals the
single-device model's on the whole batch.

XLA: `tf.device` is ignored inside an XLA cluster, so a PipelineModel compiles
without XLA (`jit_compile=False`); asking for XLA is an error.
"""

from __future__ import annotations

import contextlib
import math

import keras
import numpy as np
import tensorflow as tf
from keras import tree
from keras.src.losses import loss as loss_module
from keras.src.trainers.data_adapters import data_adapter_utils

from kvram import _checks
from kvram.layers import Checkpoint
from kvram.parallel._deferred import DeferredKernels
from kvram.training import Model, _step


def _variable_device(variable) -> str:
    """The device of a Keras variable or of the tf.Variable behind it (the
    optimizer's update step receives the latter)."""
    if isinstance(variable, keras.Variable):
        variable = variable.value
    device = getattr(variable, "device", "")
    return device if isinstance(device, str) else ""


@keras.saving.register_keras_serializable(package="kvram")
class PipelineModel(Model):
    """A `kvram.Model` whose stages run on different devices, pipelined.

    Args:
        stages: list of Keras layers/models, applied in order. Stages already
            built elsewhere (called, trained, loaded) have their variables
            moved to their device, values kept (the same Keras variables).
        devices: one device name per stage ("GPU:0", "GPU:1", or logical CPUs).
        micro_batches: int >= 1, slices per batch (a batch of n rows is cut into
            slices of n // m or n // m + 1 rows; it needs n >= m).
        checkpoint: wrap every stage in `kvram.layers.Checkpoint`
            (recompute its activations in the backward pass).
        host_swapping: let TensorFlow's graph optimizer (Grappler's memory
            optimizer) copy activations to host memory and back during the
            training step when it predicts they will not fit. Default False:
            it is off for this model's step. With 8 micro-batches it predicted
            too much and swapped about 120 activations of 33.6 MB each way per
            step, 7% slower, where the step fit without (one H200 split in two
            28 GiB halves; `benchmarks/README.md` at commit 14fd531, "pipeline"). Use
            `checkpoint=True` to save activation memory instead.
        defer_weight_gradients: compute each `keras.layers.Dense` kernel's
            gradient once per step over all slices (one matrix product over the
            whole batch) after the slices' backward passes, instead of once per
            slice and summed (Zero Bubble's split of the backward into input
            gradients, B, and weight gradients, W: Qi et al. 2023). Each slice's
            backward then computes only the input gradient the previous stage
            waits for, and no per-slice weight gradient is written and added.
            The Dense layers' inputs and output gradients of every slice are
            kept until then. Default True; Dense layers inside a `Checkpoint`,
            with LoRA or quantized, or of a subclass with its own `call`, keep
            the per-slice gradient.
        **kwargs: `kvram.Model` arguments (`clip_global_norm`, `skip_nonfinite`,
            `name`). `micro_batch_size` and `accumulation_steps` do not apply.

    Example:
    ```python
    model = kvram.parallel.PipelineModel([encoder, head], ["GPU:0", "GPU:1"], micro_batches=8)
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    model.fit(data, epochs=3)
    ```
    """

    def __new__(cls, *args, **kwargs):
        # `stages, devices` would read as functional `inputs, outputs`.
        return keras.Model.__new__(cls)

    def __init__(self, stages, devices, micro_batches: int = 8, checkpoint: bool = False,
                 host_swapping: bool = False, defer_weight_gradients: bool = True, **kwargs):
        if kwargs.get("micro_batch_size") is not None or kwargs.get("accumulation_steps", 1) != 1:
            raise ValueError(
                "PipelineModel slices batches itself (micro_batches); micro_batch_size and "
                "accumulation_steps do not apply. Received: "
                f"micro_batch_size={kwargs.get('micro_batch_size')}, "
                f"accumulation_steps={kwargs.get('accumulation_steps', 1)}"
            )
        stages = list(stages) if isinstance(stages, (list, tuple)) else stages
        if not isinstance(stages, list) or not stages:
            raise TypeError(f"`stages` must be a non-empty list of Keras layers. Received: {stages!r}")
        for stage in stages:
            if not isinstance(stage, keras.layers.Layer):
                raise TypeError(f"Every stage must be a Keras layer or model. Received: {stage!r}")
        devices = list(devices) if isinstance(devices, (list, tuple)) else [devices]
        if len(stages) > len(devices):
            raise ValueError(
                f"{len(stages)} stages but only {len(devices)} devices: give one device per "
                f"stage. Received: devices={devices}"
            )
        if len(stages) < len(devices):
            raise ValueError(
                f"{len(devices)} devices for {len(stages)} stages: give one device per stage "
                f"(kvram.parallel.balance splits layers into as many stages as devices). "
                f"Received: devices={devices}"
            )
        self.device_names = [_checks.logical_device(d) for d in devices]
        self.micro_batches = _checks.positive_int("micro_batches", micro_batches)
        self.checkpoint = _checks.boolean("checkpoint", checkpoint)
        self.host_swapping = _checks.boolean("host_swapping", host_swapping)
        self.defer_weight_gradients = _checks.boolean("defer_weight_gradients", defer_weight_gradients)
        super().__init__(**kwargs)
        if checkpoint:
            stages = [s if isinstance(s, Checkpoint) else Checkpoint(s) for s in stages]
        self.stages = stages

    # -- building: each stage's variables on its device
    def build(self, input_shape):
        shape = input_shape
        for k, (stage, device) in enumerate(zip(self.stages, self.device_names)):
            with tf.device(device):
                if not stage.built:
                    stage.build(shape)
            _move_to(stage, k, device)
            shape = stage.compute_output_shape(shape)
        self.built = True

    def call(self, inputs, training=None):
        x = inputs
        for stage, device in zip(self.stages, self.device_names):
            with tf.device(device):
                x = stage(x, training=training)
        return x

    def compile(self, optimizer="rmsprop", *args, jit_compile="auto", **kwargs):
        if jit_compile is True:
            raise ValueError(
                "PipelineModel places its stages with tf.device, which XLA ignores inside a "
                "compiled cluster; compile with jit_compile=False (or leave it 'auto')."
            )
        super().compile(optimizer, *args, jit_compile=False, **kwargs)
        for candidate in (self.optimizer, getattr(self.optimizer, "inner_optimizer", None)):
            if candidate is not None:
                _place_optimizer_on_variable_devices(candidate)

    def fit(self, x=None, *args, **kwargs):
        if not self.built:
            # Build now, outside any tf.function, so each stage's variables are
            # created under its device.
            self.build(_input_shape(x))
        batch_size = kwargs.get("batch_size", args[1] if len(args) > 1 else None)
        _check_array_batches(x, batch_size, kwargs.get("validation_split", 0.0), self.micro_batches)
        try:
            return super().fit(x, *args, **kwargs)
        except tf.errors.InvalidArgumentError as error:
            if _SHORT_BATCH not in (error.message or ""):
                raise
            # the step's check (`train_step`), in one line: nothing of that batch was applied
            raise ValueError(_short_batch_message(self.micro_batches, "a batch of fewer rows")) from None

    def make_train_function(self, force=False):
        # kvram.Model refuses an overridden train_step only for its own slicing.
        keras.Model.make_train_function(self, force=force)
        function = self.train_function
        if self.host_swapping or getattr(function, "_kvram_without_host_swapping", False):
            return function

        def train_function(iterator):
            with _without_host_swapping():
                return function(iterator)

        train_function._kvram_without_host_swapping = True
        self.train_function = train_function
        return train_function

    def train_step(self, data):
        if not self.built:
            raise RuntimeError(
                "Build a PipelineModel before training it (model.build(input_shape), or "
                "fit(), which builds it), so that each stage's variables are created on "
                "its device."
            )
        x, y, sample_weight = data_adapter_utils.unpack_x_y_sample_weight(data)
        rows = tf.shape(tree.flatten(x)[0])[0]
        m = self.micro_batches
        # Every slice needs a row. Checked before anything of the batch runs: its
        # inputs wait for the check, so a short batch changes no weight, statistic
        # or metric (fit() says so in one line: `_short_batch_message`).
        check = tf.debugging.assert_greater_equal(rows, m, message=_SHORT_BATCH)
        with tf.control_dependencies([check]):
            x, y, sample_weight = tree.map_structure(
                lambda t: None if t is None else tf.identity(t), (x, y, sample_weight), none_is_leaf=True)
        base, extra = rows // m, rows % m
        sizes = [base + tf.cast(i < extra, rows.dtype) for i in range(m)]
        starts = [tf.add_n(sizes[:i]) if i else tf.constant(0, rows.dtype) for i in range(m)]
        total = tf.cast(rows, tf.float32)
        stage_vars = [list(s.trainable_weights) for s in self.stages]
        all_vars = [v for vs in stage_vars for v in vs]
        sums: list[list] = [[None] * len(vs) for vs in stage_vars]
        last = self.device_names[-1]

        deferred = DeferredKernels(self.stages, self.defer_weight_gradients)
        with deferred.deferring():
            records = self._forward(x, y, sample_weight, starts, sizes, total)
        sums = self._backward(records, stage_vars, all_vars, sums)
        for k, device in enumerate(self.device_names):
            with tf.name_scope(f"stage{k}_weight_gradients"), tf.device(device):
                for variable, gradient in deferred.gradients(k):
                    j = next(j for j, v in enumerate(stage_vars[k]) if v is variable)
                    sums[k][j] = gradient if sums[k][j] is None else sums[k][j] + gradient
        gradients_by_id = {
            id(v): g for vs, gs in zip(stage_vars, sums) for v, g in zip(vs, gs)
        }
        trainable = self.trainable_weights
        gradients = [gradients_by_id.get(id(v)) for v in trainable]
        if trainable:
            finite = _step.all_finite(gradients)
            # The batch is checked where its parts are used: x by the first
            # stage, y and the weights by the loss on the last.
            with tf.device(self.device_names[0]):
                bad_x = _step.bad_inputs(finite, x)
            with tf.device(last):
                bad_y = _step.bad_inputs(finite, (y, sample_weight))
            _step.apply_gradients(
                self, self._step_state, gradients, trainable, finite=finite,
                bad_inputs=tf.logical_or(bad_x, bad_y),
            )
        return _step.step_logs(self, self._step_state, self.get_metrics_result())

    def _forward(self, x, y, sample_weight, starts, sizes, total):
        """Every slice through every stage, each stage on its device: per
        slice, the stages' (tape, input, output), the loss's tape, loss and
        input."""
        m, last = self.micro_batches, self.device_names[-1]
        records = []
        for i in range(m):
            xs, ys, sws = tree.map_structure(lambda t: _cut(t, starts[i], sizes[i]), (x, y, sample_weight))
            h, tapes = xs, []
            for k, (stage, device) in enumerate(zip(self.stages, self.device_names)):
                with tf.name_scope(f"stage{k}_forward_mb{i}"), tf.device(device):
                    with tf.GradientTape() as tape:
                        tape.watch(h)
                        out = stage(h, training=True)
                tapes.append((tape, h, out))
                h = out
            with tf.name_scope(f"loss_mb{i}"), tf.device(last):
                with tf.GradientTape() as loss_tape:
                    loss_tape.watch(h)
                    loss = self._compute_loss(x=xs, y=ys, y_pred=h, sample_weight=sws, training=True)
                    self._loss_tracker.update_state(
                        loss_module.unscale_loss_for_distribution(loss), sample_weight=sizes[i]
                    )
                    if self.optimizer is not None:
                        loss = self.optimizer.scale_loss(loss)
                    loss = loss * tf.cast(tf.cast(sizes[i], tf.float32) / total, loss.dtype)
                self.compute_metrics(xs, ys, h, sample_weight=sws)
            records.append((tapes, loss_tape, loss, h))
        return records

    def _backward(self, records, stage_vars, all_vars, sums):
        """Each stage's gradients summed over the slices (`sums`, per stage,
        per variable; None where none reached it)."""
        last = self.device_names[-1]
        # Backward: slice by slice, last stage first, each stage under its device.
        # A stage starts a slice's backward only once it has added the previous
        # slice's gradients to its sums, so one slice's weight gradients are
        # alive per stage (the executor would otherwise run them all at once).
        done = [[] for _ in self.stages]
        for i, (tapes, loss_tape, loss, out) in enumerate(records):
            with tf.name_scope(f"loss_backward_mb{i}"), tf.device(last):
                grads = loss_tape.gradient(loss, [out] + all_vars)  # + regularisers
            dy, direct = grads[0], dict(zip((id(v) for v in all_vars), grads[1:]))
            for k in reversed(range(len(self.stages))):
                tape, h, stage_out = tapes[k]
                with tf.name_scope(f"stage{k}_backward_mb{i}"), tf.device(self.device_names[k]):
                    # (the first stage's input gradient is needed by nothing)
                    sources = ([h] if k else []) + stage_vars[k]
                    with tf.control_dependencies(done[k]):
                        local = tape.gradient(stage_out, sources, output_gradients=dy)
                    local = local if k else [None] + local
                    for j, (v, g) in enumerate(zip(stage_vars[k], local[1:])):
                        extra_g = direct.get(id(v))
                        if extra_g is not None:
                            g = extra_g if g is None else g + extra_g
                        if g is not None:
                            g = tf.convert_to_tensor(g)
                            sums[k][j] = g if sums[k][j] is None else sums[k][j] + g
                    done[k] = [t for t in sums[k] if t is not None]
                dy = local[0]
        return sums

    def get_config(self):
        return {
            "stages": [keras.saving.serialize_keras_object(s) for s in self.stages],
            "devices": self.device_names,
            "micro_batches": self.micro_batches,
            "checkpoint": False,  # stages are saved already wrapped
            "host_swapping": self.host_swapping,
            "defer_weight_gradients": self.defer_weight_gradients,
            "name": self.name,
        }

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        stages = []
        for stage, device in zip(config["stages"], config["devices"]):
            # A stage that builds itself while deserialising (a Sequential with
            # an Input) must create its variables on its own device.
            with tf.device(_checks.logical_device(device)):
                stages.append(keras.saving.deserialize_keras_object(stage))
        config["stages"] = stages
        return cls(**config)


# What a PipelineModel step's check of its batch says (`train_step`), found again by fit().
_SHORT_BATCH = "kvram PipelineModel: a batch has fewer rows than micro_batches"


def _short_batch_message(m: int, batch: str, kept: str = "nothing of that batch was applied") -> str:
    return (
        f"PipelineModel(micro_batches={m}) cuts every batch into {m} slices of at least one row, and was "
        f"given {batch} (a short last batch?); {kept}. Drop it (tf.data: "
        f"batch(..., drop_remainder=True)), choose a batch size that leaves at least {m} rows in the last "
        "batch, or pass fewer micro_batches."
    )


def _check_array_batches(x, batch_size, validation_split, m: int) -> None:
    """Refuses, before training, arrays whose batches (the last included) have
    fewer than `m` rows; other data is checked by the step itself."""
    if x is None or isinstance(x, tf.data.Dataset) or not all(
        isinstance(t, (np.ndarray, tf.Tensor)) for t in tree.flatten(x)
    ):
        return
    rows = int(np.shape(tree.flatten(x)[0])[0])
    if validation_split:  # Keras's split: the first rows train
        rows = int(math.floor(rows * (1.0 - validation_split)))
    batch_size = batch_size or 32  # Keras's default for arrays
    sizes = {min(batch_size, rows), rows % batch_size} - {0}
    short = min(sizes) if sizes else 0
    if 0 < short < m:
        raise ValueError(_short_batch_message(m, f"{rows} rows at batch_size={batch_size}, whose batch of "
                                                 f"{short} rows is fewer than {m}", "nothing was trained"))


def _cut(t, start, size):
    return None if t is None else t[start : start + size]


def _without_host_swapping():
    """Within, `tf.function`s called (and traced) on this thread are optimized
    with Grappler's memory optimizer off (`memory_optimization=NO_MEM_OPT`),
    so it cannot move activations to host memory and back. TensorFlow has no
    public switch for it (`tf.config.optimizer.set_experimental_options` has
    no such key): see `_call_options`."""
    from tensorflow.core.protobuf import rewriter_config_pb2

    return _call_options(memory_optimization=rewriter_config_pb2.RewriterConfig.NO_MEM_OPT)


@contextlib.contextmanager
def _call_options(executor_type=None, **rewrites):
    """Within, `tf.function`s called (and traced) on this thread run with the
    per-call options that eager function calls carry (their `config_proto`,
    which Grappler reads, and their executor) amended: `rewrites` set fields
    of Grappler's `RewriterConfig`; `executor_type` (e.g.
    "SINGLE_THREADED_EXECUTOR") replaces the executor when given. Restored
    after."""
    from tensorflow.core.protobuf import config_pb2
    from tensorflow.python.eager import context

    ctx = context.context()
    saved = ctx.function_call_options
    config = config_pb2.ConfigProto()
    if saved.config_proto_serialized:
        config.ParseFromString(saved.config_proto_serialized)
    for field, value in rewrites.items():
        setattr(config.graph_options.rewrite_options, field, value)
    ctx.function_call_options = context.FunctionCallOptions(
        executor_type=saved.executor_type if executor_type is None else executor_type, config_proto=config
    )
    try:
        yield
    finally:
        ctx.function_call_options = saved


def _on(variable, device: str) -> bool:
    placed = tf.DeviceSpec.from_string(_variable_device(variable) or "/device:CPU:0")
    wanted = tf.DeviceSpec.from_string(device)
    return (placed.device_type, placed.device_index) == (wanted.device_type, wanted.device_index)


def _move_to(stage, k: int, device: str) -> None:
    """Moves the variables of a stage built elsewhere (called, trained or
    loaded before PipelineModel placed it) onto its device, with their values:
    each Keras variable keeps its identity and gets a new `tf.Variable` made
    there (Keras's own `_initialize`). Functions traced before still hold the
    old ones. Refused where that cannot be done: a variable of a
    `tf.distribute` strategy, or one that is not a Keras TensorFlow variable."""
    misplaced = [v for v in stage.variables if not _on(v, device)]
    for variable in misplaced:
        value = getattr(variable, "_value", None)
        if isinstance(value, tf.distribute.DistributedValues) or not (
            isinstance(value, tf.Variable) and hasattr(variable, "_initialize")
        ):
            raise ValueError(
                f"Stage {k} ({stage.name}) was built before PipelineModel placed it, and its variable "
                f"{variable.path} on {_variable_device(variable)!r} cannot be moved to {device!r} "
                f"({type(value).__name__}: a tf.distribute or non-Keras variable). Pass stages that "
                "have not been called or built, or built outside any tf.distribute strategy."
            )
    with tf.init_scope(), tf.device(device):
        for variable in misplaced:
            variable._initialize(tf.identity(variable.value))


def _input_shape(x):
    """The input shape of `fit()`'s `x` (array, tensor, or dataset of (x, y, ...))."""
    if isinstance(x, tf.data.Dataset):
        spec = x.element_spec
        spec = spec[0] if isinstance(spec, tuple) else spec
        return (None,) + tuple(tree.flatten(spec)[0].shape[1:])
    first = tree.flatten(x)[0]
    return (None,) + tuple(np.shape(first)[1:])


def _place_optimizer_on_variable_devices(optimizer) -> None:
    """Slots (and their updates) next to the variable they belong to."""
    if getattr(optimizer, "_kvram_placed", False):
        return
    create = optimizer.add_variable_from_reference
    update = optimizer.update_step

    def add_variable_from_reference(reference_variable, *args, **kwargs):
        with tf.device(_variable_device(reference_variable) or None):
            return create(reference_variable, *args, **kwargs)

    def update_step(gradient, variable, *args, **kwargs):
        with tf.device(_variable_device(variable) or None):
            return update(gradient, variable, *args, **kwargs)

    optimizer.add_variable_from_reference = add_variable_from_reference
    optimizer.update_step = update_step
    optimizer._kvram_placed = True
