"""The function Keras's fit loop calls for a `kvram.Model` that slices batches or
recovers from out-of-memory errors (private).

Keras compiles a training step into one `tf.function` and calls it with the data
iterator. An out-of-memory error raised inside it cannot be caught there: it ends
the call, and `fit()`, with the batch already taken from the iterator. kvram's
function takes the batch itself. Without a batch controller the step is one
compiled function (`Model.train_step`, slicing the batch when
`micro_batch_size` is set). With `AdaptiveBatchSize` it runs in two compiled parts:

1. gradients: forward and backward passes (over micro-batches, if set); this is
   where memory grows with the batch, and where an OOM is recovered from. It
   writes only non-trainable state (BatchNormalization statistics, random-seed
   states) and metrics; those, with the optimizer's scalar counters, are read
   before the call and written back after a failure, so a failed attempt leaves
   no trace. TensorFlow copies a variable on write while an older read of it is
   alive, so the reads cost no memory unless the step changes the variable.
2. update: `optimizer.apply` (loss-scale unscaling, accumulation, clipping,
   the non-finite guard) and the logs. Its memory does not depend on the batch.

On an OOM in part 1 the batch controller (`kvram.callbacks.AdaptiveBatchSize`)
picks a smaller micro-batch and the same batch runs again, so every sample is
trained on exactly once and `optimizer.iterations` counts real updates only.

Part 1 takes the micro-batch size as a tensor and is traced once, with the
batch dimension left open: changing the size, or a short last batch, costs no
retrace. Its slices' shapes are unknown to the graph, which on the GPU costs
~30% of a step against static slices (`_step.micro_batch_gradients`, used by
a fixed `micro_batch_size`); tracing a static graph per size instead was
measured slower for a short fit (benchmarks/README.md at commit 14fd531,
"adaptive"). Before
the first step the controller may probe: part 1 runs on a few rows of the
batch at small sizes, with every state it writes put back afterwards, so that
the controller can predict memory per row.
"""

from __future__ import annotations

import time

import keras
import tensorflow as tf
from keras import tree
from keras.src.backend.tensorflow.trainer import reduce_per_replica
from keras.src.trainers.data_adapters import data_adapter_utils

from kvram._state import mutable_state
from kvram.memory import collect_garbage, is_out_of_memory
from kvram.training import _step

__all__ = ["TrainFunction"]


def multi_worker(strategy) -> bool:
    """Whether `strategy` is a MultiWorkerMirroredStrategy over several workers."""
    return isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy) and (
        strategy.extended._in_multi_worker_mode())


def keras_step_fails(model) -> bool:
    """Whether Keras's train and test steps fail under `model`'s strategy: over
    several workers (keras-team/keras#20585), and under XLA over several local
    devices, where Keras compiles `strategy.run` whole (two H200s:
    benchmarks/results/distribute_2xh200_keras_step.json)."""
    strategy = getattr(model, "_distribute_strategy", None)
    if strategy is None:
        return False
    return multi_worker(strategy) or bool(model.jit_compile and _local_devices(strategy) > 1)


def reduce_logs(logs, strategy):
    """A step's logs averaged across replicas: Keras's `reduce_per_replica`,
    except over several workers, where Keras reduces with axis=0 and fails on
    scalars ("Invalid reduction dimension 0 for input with 0 dimensions";
    its fit() under MultiWorkerMirroredStrategy: keras-team/keras#20585).
    There each value is averaged elementwise (axis=None), as
    `reduce_per_replica`'s "mean" does on one worker."""
    if multi_worker(strategy):
        return tree.map_structure(lambda v: strategy.reduce("MEAN", v, axis=None), logs)
    return reduce_per_replica(logs, strategy, reduction="auto")


def distributed_test_function(model):
    """`model.test_function` where Keras's fails under a strategy:

    - over several workers, its `reduce_per_replica` fails in evaluate() and
      fit()'s validation as in its train step (keras-team/keras#20585):
      `reduce_logs` replaces it;
    - under XLA over several local devices (MirroredStrategy on GPUs), Keras
      compiles `strategy.run` whole, one XLA computation that is placed on the
      first GPU and cannot read the other replicas' variables (its train step
      failed so on two H200s: benchmarks/results/distribute_2xh200_keras_step.json):
      here each replica's `test_step` is compiled inside `strategy.run`, as
      Keras itself compiles its predict step and kvram its train step.
    """
    strategy = model.distribute_strategy
    per_replica = bool(model.jit_compile) and not model.run_eagerly and _local_devices(strategy) > 1
    test_step = model.test_step
    if per_replica:
        test_step = tf.function(test_step, reduce_retracing=True, jit_compile=True)

    def one_step(data):
        return reduce_logs(strategy.run(test_step, args=(_no_optionals(data),)), strategy)

    if not model.run_eagerly:
        one_step = tf.function(
            one_step, reduce_retracing=True, jit_compile=bool(model.jit_compile) and not per_replica
        )
    function = lambda iterator: run_steps(model, iterator, one_step)  # noqa: E731
    function.step = one_step
    return function


def run_steps(model, iterator, step):
    """What Keras calls once per `steps_per_execution` batches: `step` on each
    of the next batches; StopIteration when the iterator had none."""
    logs = None
    for _ in range(max(1, int(model.steps_per_execution))):
        try:
            data = next(iterator)
        except (StopIteration, tf.errors.OutOfRangeError):
            if logs is None:
                raise StopIteration from None
            break
        logs = step(data)
    return logs


def _no_optionals(data):
    """Keras's data adapters give absent parts as empty tf.experimental.Optional."""
    return tree.map_structure(lambda t: None if isinstance(t, tf.experimental.Optional) else t, data)


class TrainFunction:
    """`model.train_function` for micro-batching and OOM recovery."""

    def __init__(self, model, step_state, controller=None):
        self.model = model
        self.step_state = step_state  # the model's `_step.StepState`
        self.controller = controller  # an `AdaptiveBatchSize`, or None
        self._functions: dict = {}
        self._state: tuple = ()
        self._snapshot_function = None
        self._restore_function = None
        self._built = False

    def build(self, data) -> None:
        """Creates the model's, metrics' and optimizer's variables before any tracing.

        Keras does this inside its first compiled step; kvram's step traces a
        loop over slices, where no variable may be created.
        """
        if self._built:
            return
        model = self.model
        first = next(t for t in tree.flatten(data) if t is not None)
        if not isinstance(first, tf.distribute.DistributedValues):
            model._symbolic_build(data_batch=tree.map_structure(_symbolic, data))
        optimizer = getattr(model, "optimizer", None)
        if optimizer is not None and not optimizer.built and model.trainable_variables:
            with model.distribute_strategy.scope():
                optimizer.build(model.trainable_variables)
        self._built = True

    # Keras calls this with an iterator once per `steps_per_execution` batches.
    def __call__(self, iterator):
        return run_steps(self.model, iterator, self.step)

    def step(self, data):
        """One training step on `data`, run again at a smaller micro-batch after an OOM."""
        model = self.model
        data = _no_optionals(data)
        self.build(data)
        controller = self.controller
        if controller is None:
            return self._fused(model.micro_batch_size, data)(data)
        if getattr(model, "_distribute_strategy", None) is not None:
            raise NotImplementedError(
                "AdaptiveBatchSize under a tf.distribute strategy is not supported yet: "
                "set micro_batch_size on the model instead (find it with "
                "kvram.callbacks.find_max_batch_size on one device)."
            )
        rows = _local_rows(data)
        function = self.gradients_function(data)  # one trace, for every size and batch

        def probe(size: int, rows_used: int) -> bool:
            return self._probe(function, data, size, rows_used)

        micro_batch_size = controller.begin_step(model, rows, probe, _nbytes(data))
        while True:
            args = (data, tf.constant(micro_batch_size, tf.int32))
            saved = self._snapshot()
            started = time.perf_counter()
            try:
                result = function(*args)
                break
            except (tf.errors.ResourceExhaustedError, tf.errors.InternalError) as error:
                if not is_out_of_memory(error):
                    raise
                seconds = time.perf_counter() - started
                self._restore(saved)
                del saved
                collect_garbage()
                micro_batch_size = controller.recover(
                    model, error, micro_batch_size, rows, seconds
                )
        del saved
        return self._apply()(result)

    def _probe(self, function, data, size: int, rows_used: int) -> bool:
        """Runs part 1 on the first `rows_used` rows at micro-batch `size`, then
        puts back every state it wrote; False after an out-of-memory error."""
        part = tree.map_structure(
            lambda t: None if t is None else _head(t, rows_used), data
        )
        saved = self._snapshot()
        try:
            result = function(part, tf.constant(size, tf.int32))
            tree.flatten(result)[-1].numpy()  # wait for the device: the caller times it
            del result
            return True
        except (tf.errors.ResourceExhaustedError, tf.errors.InternalError) as error:
            if not is_out_of_memory(error):
                raise
            return False
        finally:
            self._restore(saved)
            del saved, part
            collect_garbage()

    def gradients_function(self, data):
        """Part 1 (see the module doc), `(data, micro_batch_size) -> (gradients,
        bad_inputs)`, traced once for any batch like `data` and any size."""
        function = self._gradients()
        _trace(function, data)
        return function

    def apply_function(self):
        """Part 2: `(gradients, bad_inputs) -> logs`."""
        return self._apply()

    def tracing_count(self) -> int:
        """Traces of the compiled step functions so far (0 when run eagerly)."""
        return sum(
            f.experimental_get_tracing_count()
            for f in self._functions.values()
            if hasattr(f, "experimental_get_tracing_count")
        )

    def _compiled(self, key, step, jit_compile=False, reduce_retracing=True):
        """`step` as a cached `tf.function` (as is when the model runs eagerly)."""
        function = self._functions.get(key)
        if function is None:
            function = step
            if not self.model.run_eagerly:
                function = tf.function(
                    step, reduce_retracing=reduce_retracing, jit_compile=jit_compile
                )
            self._functions[key] = function
        return function

    def _fused(self, micro_batch_size, data=None):
        """Gradients and update in one compiled step (no recovery needed).

        With `jit_compile`, the whole step (the loop over slices, the sums,
        the update) is one XLA computation, compiled once per batch shape, as
        Keras compiles its own step, instead of compiling only each slice's
        forward and backward and leaving the loop, the gradient sums and the
        optimizer to TensorFlow's graph executor. Measured on ResNet50 (H200,
        bf16, batches of 512, slices of 128, one run): 4247 img/s against 3583
        the other way, and 4569 unsliced (benchmarks/results/profile_resnet50_h200.json).
        """
        model = self.model
        strategy = model.distribute_strategy

        def on_replicas(replica_step):
            def step(data):
                return reduce_logs(strategy.run(replica_step, args=(data,)), strategy)

            return step

        step = on_replicas(model.train_step)
        if (
            model.jit_compile
            and getattr(model, "_kvram_xla_micro_step", True)
            and data is not None
            and _static_shapes(data)
        ):
            # One trace per batch shape: XLA needs static slice shapes.
            per_replica = getattr(model, "_kvram_xla_per_replica", None)
            if per_replica is None:
                per_replica = _local_devices(strategy) > 1
            if not per_replica:
                return self._compiled(
                    ("fused_xla", micro_batch_size), step, jit_compile=True, reduce_retracing=False
                )
            # Over several local devices (MirroredStrategy), each replica's step
            # is compiled inside `strategy.run`, as Keras compiles its own
            # (`one_step_on_data`): one XLA computation cannot span devices, and
            # MirroredStrategy then all-reduces with collectives, no merge_call
            # (see `updated_in_each_replica`). With one local device the whole
            # step stays one computation.
            replica_step = self._compiled(
                ("fused_xla_replica", micro_batch_size),
                model.train_step,
                jit_compile=True,
                reduce_retracing=False,
            )
            return self._compiled(
                ("fused_xla", micro_batch_size), on_replicas(replica_step), reduce_retracing=False
            )
        return self._compiled(("fused", micro_batch_size), step)

    def _replica_gradients(self, data, micro_batch_size):
        x, y, sample_weight = data_adapter_utils.unpack_x_y_sample_weight(data)
        gradients = _step.micro_batch_gradients(
            self.model, self.step_state, x, y, sample_weight, micro_batch_size
        )
        # The batch is checked for NaN/Inf only when its gradients are not finite.
        return gradients, _step.bad_inputs(
            _step.all_finite(gradients), (x, y, sample_weight), self.model
        )

    def _gradients(self):
        """Part 1, `(data, micro_batch_size) -> (gradients, bad_inputs)`, for any
        batch and micro-batch size (slice shapes unknown to the graph)."""
        strategy = self.model.distribute_strategy

        def gradients(data, micro_batch_size):
            return strategy.run(self._replica_gradients, args=(data, micro_batch_size))

        # Slices loop in TF's executor; each slice is XLA-compiled inside when the
        # model compiles with XLA (see _step.micro_batch_gradients).
        return self._compiled("gradients", gradients)

    def _apply(self):
        model = self.model
        strategy = model.distribute_strategy

        def replica_apply(gradients, inputs_bad):
            if model.trainable_weights:
                _step.apply_gradients(
                    model, self.step_state, list(gradients), model.trainable_weights, bad_inputs=inputs_bad
                )
            return _step.step_logs(model, self.step_state, model.get_metrics_result())

        def apply(result):
            logs = strategy.run(replica_apply, args=result)
            return reduce_logs(logs, strategy)

        return self._compiled("apply", apply, bool(model.jit_compile))

    # A failed gradient pass writes only these; they are restored after it.
    def _state_variables(self) -> tuple:
        model = self.model
        variables = mutable_state(model) + list(model.metrics_variables)  # not frozen weights: kvram/_state.py
        variables += self.step_state.counters()
        optimizer = getattr(model, "optimizer", None)
        if optimizer is not None:
            variables += [v for v in optimizer.variables if len(v.shape) == 0]
        return tuple(_step.unique(variables))

    def _snapshot(self):
        state = self._state_variables()
        if [id(v) for v in state] != [id(v) for v in self._state] or (
            self._snapshot_function is None
        ):
            self._state = state

            def snapshot():
                return [tf.identity(_value(v)) for v in state]

            def restore(values):
                for variable, value in zip(state, values):
                    variable.assign(value)

            if not self.model.run_eagerly:
                snapshot = tf.function(snapshot)
                restore = tf.function(restore)
            self._snapshot_function, self._restore_function = snapshot, restore
        return self._snapshot_function()

    def _restore(self, saved) -> None:
        self._restore_function(saved)


def _local_devices(strategy) -> int:
    """Devices of this worker's replicas (1 without a strategy)."""
    try:
        return len(strategy.extended.worker_devices)
    except RuntimeError:  # the default strategy has no worker devices
        return 1










def _trace(function, data) -> None:
    """Traces the gradient function for any batch of `data`'s structure and for
    any micro-batch size, ahead of the first call (no-op when eager)."""
    concrete = getattr(function, "get_concrete_function", None)
    if concrete is not None:
        concrete(tree.map_structure(_open_batch, data), tf.TensorSpec([], tf.int32))


def _open_batch(tensor):
    """A `TensorSpec` of `tensor` with its batch dimension left open."""
    if tensor is None:
        return None
    shape = tuple(tensor.shape)
    return tf.TensorSpec((None,) + shape[1:] if shape else shape, tensor.dtype)


def _nbytes(data) -> int:
    """Bytes of the tensors in `data`."""
    total = 0
    for tensor in tree.flatten(data):
        if tensor is not None:
            total += int(tf.size(tensor)) * tf.as_dtype(tensor.dtype).size
    return total


def _head(tensor, rows: int):
    """The first `rows` rows of `tensor`, sliced on the tensor's own device."""
    with tf.device(getattr(tensor, "device", None) or None):
        return tensor[:rows]


def _symbolic(tensor):
    """A stand-in for `tensor` with any batch size, for Keras's symbolic build."""
    if tensor is None:
        return None
    shape = tuple(tensor.shape)
    return keras.KerasTensor((None,) + shape[1:] if shape else shape, dtype=tensor.dtype)


def _value(variable):
    return variable.value if not callable(getattr(variable, "value", None)) else variable.value()


def _local_rows(data) -> int:
    """Rows of the batch on one replica (the batch's size without a strategy)."""
    first = next(t for t in tree.flatten(data) if t is not None)
    if hasattr(first, "values") and isinstance(getattr(first, "values"), tuple):
        first = first.values[0]  # a PerReplica value
    return int(first.shape[0]) if first.shape[0] is not None else int(tf.shape(first)[0])


def _static_shapes(data) -> bool:
    """Whether every tensor of a batch has a static shape. Under a tf.distribute
    strategy the batch arrives as distributed values (PerReplica), one tensor per
    local replica; each is checked."""
    for value in tree.flatten(data):
        if value is None:
            continue
        parts = value.values if isinstance(value, tf.distribute.DistributedValues) else (value,)
        if not all(part.shape.is_fully_defined() for part in parts):
            return False
    return True
