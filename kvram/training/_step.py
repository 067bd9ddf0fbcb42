"""The training step's parts, as functions of the model they train: a slice's
forward and backward pass, the sum over micro-batches, and the guarded update
(non-finite check across replicas, clipping across replicas, kvram's skip
counters). `Model.train_step`, `TrainFunction` and `PipelineModel` share them."""

from __future__ import annotations

import contextlib
import functools
import threading

import keras
import tensorflow as tf
from keras import tree
from keras.src.losses import loss as loss_module

from kvram.layers import _compiling, _in_backward, checkpoint
from kvram.training import _batch_statistics


# Loss reductions that are a mean over the batch's rows, so that the slices'
# losses weighted by their share of rows add up to the batch's loss.
MEAN_REDUCTIONS = ("sum_over_batch_size", "mean")


def rows_of(x) -> tf.Tensor:
    """The number of rows (batch size) of the first tensor in `x`."""
    return tf.shape(next(i for i in tree.flatten(x) if i is not None))[0]


def dense(gradient):
    if isinstance(gradient, tf.IndexedSlices):
        return tf.convert_to_tensor(gradient)
    return gradient


def check_mean_reductions(loss) -> None:
    for item in tree.flatten(loss) if loss is not None else []:
        reduction = getattr(item, "reduction", "sum_over_batch_size")
        if isinstance(item, keras.losses.Loss) and reduction not in MEAN_REDUCTIONS:
            raise ValueError(
                "micro_batch_size needs losses that average over the batch "
                f"(reduction in {MEAN_REDUCTIONS}), so that slices can be weighted by "
                f"their rows. Received: loss {item.name!r} with reduction={reduction!r}"
            )


def watches_skips(model) -> bool:
    """Whether anything reads the step's skip counters: the guard
    (`skip_nonfinite`) or the callback that stops a run of skipped steps
    (`max_consecutive_skips`)."""
    return bool(model.skip_nonfinite) or model.max_consecutive_skips is not None


def bad_inputs(finite, data, model=None) -> tf.Tensor:
    """A boolean scalar: the batch's floating-point tensors hold NaN/Inf.

    Checked only when `finite` (the step's gradients are all finite) is False,
    so healthy steps pay no read of the batch for it. It is a `tf.cond`, which
    XLA's GPU runtime runs by copying the predicate to the host and waiting for
    it: with a `model` whose skips nothing reads (`watches_skips`), no check
    and no conditional are made (constant False).
    """
    tensors = [t for t in tree.flatten(data) if isinstance(t, tf.Tensor) and t.dtype.is_floating]
    if not tensors or (model is not None and not watches_skips(model)):
        return tf.constant(False)
    return tf.cond(
        finite, lambda: tf.constant(False), lambda: tf.logical_not(all_finite(tensors))
    )


def all_finite(gradients) -> tf.Tensor:
    """A boolean scalar: True when every gradient entry is finite (None ignored)."""
    checks = []
    for g in gradients:
        if g is None:
            continue
        values = g.values if isinstance(g, tf.IndexedSlices) else g
        # Checked where the gradient lives (a pipeline stage's device), so only
        # the boolean travels.
        with tf.device(values.device) if values.device else contextlib.nullcontext():
            checks.append(tf.reduce_all(tf.math.is_finite(values)))
    return tf.reduce_all(tf.stack(checks)) if checks else tf.constant(True)


class StepState(tf.Module):
    """What kvram's training step keeps beside the model's own variables: its
    counters (steps skipped in all; the current run of skipped steps, and how
    many of that run's batches held NaN/Inf: 0 again after an applied step),
    the slice-size warnings already given, and the XLA-compiled slice function.
    A `tf.Module`, so that its counters are tracked with the model."""

    def __init__(self):
        super().__init__(name="kvram_step")
        with tf.init_scope():

            def counter(name):
                return tf.Variable(
                    0,
                    dtype=tf.int64,
                    trainable=False,
                    name=name,
                    synchronization=tf.VariableSynchronization.ON_WRITE,
                    aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,
                )

            self.skipped = counter("kvram_skipped_steps")
            self.skip_run = counter("kvram_skip_run")
            self.skip_run_bad_inputs = counter("kvram_skip_run_bad_inputs")
        self.slice_warnings: set = set()
        self.jit_slice_gradients = None

    def counters(self) -> list:
        """The step's counters (restored with the step after an OOM)."""
        return [self.skipped, self.skip_run, self.skip_run_bad_inputs]


def slice_gradients(model, x, y, sample_weight, scale=None):
    """Forward and backward over one slice: (gradients, y_pred).

    `scale` (the slice's share of the batch's rows) multiplies the loss, so
    that the slices' gradients add up to the batch's.
    """
    with tf.GradientTape() as tape:
        loss, y_pred = _forward(model, x, y, sample_weight)
        if scale is not None:
            loss = loss * tf.cast(scale, loss.dtype)
    if not model.trainable_weights:
        return [], y_pred
    return tape.gradient(loss, model.trainable_weights), y_pred


def _forward(model, x, y, sample_weight):
    """(the loss, scaled as the optimizer scales it, and y_pred) of a training
    forward pass, the loss tracked."""
    head = getattr(model, "_kvram_fused_head", None)  # kvram.speed.fused_cross_entropy
    if head is not None:
        y_pred = None
        loss = head.loss(x, y, sample_weight)
    else:
        if model._call_has_training_arg:
            y_pred = model(x, training=True)
        else:
            y_pred = model(x)
        loss = model._compute_loss(
            x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True
        )
    model._loss_tracker.update_state(
        loss_module.unscale_loss_for_distribution(loss),
        sample_weight=rows_of(x),
    )
    if model.optimizer is not None:
        loss = model.optimizer.scale_loss(loss)
    return loss, y_pred


def check_update_in_backward(model) -> None:
    """Refuses what needs every gradient before any update (`update_in_backward`)."""
    given = [f"{name}={value!r}" for name, value, off in (
        ("accumulation_steps", model.accumulation_steps, 1),
        ("micro_batch_size", model._micro_batch_size, None),
        ("clip_global_norm", model.clip_global_norm, None)) if value != off]
    if given:
        raise ValueError(
            "update_in_backward=True applies each gradient as soon as it is made, so it cannot run with what "
            f"needs every gradient first. Received: {', '.join(given)}. Allowed: accumulation_steps=1, "
            "micro_batch_size=None and clip_global_norm=None with it, or update_in_backward=False.")


def update_in_backward(model, state, x, y, sample_weight):
    """One training step whose updates take each gradient as it is made, so
    that no point of the step holds every gradient (XLA frees each once its
    update has read it). With `skip_nonfinite`, a first backward pass only
    decides the skip (its gradients reduced to one flag as they are made), and
    the applied branch runs the backward pass again from the same forward pass
    (a persistent tape: the same gradients). Returns y_pred."""
    context = tf.distribute.get_replica_context()
    if context is not None and context.num_replicas_in_sync > 1:
        raise ValueError(
            f"update_in_backward=True cannot run over {context.num_replicas_in_sync} replicas: their gradients "
            "are summed before any update. Allowed: one device, or update_in_backward=False.")
    weights = model.trainable_weights
    optimizer = model.optimizer
    if not optimizer.built:
        optimizer.build(weights)
    # kvram.layers.Checkpoint blocks apply their own weights' updates in their backward pass
    # (kvram/layers/_in_backward.py); the rest are applied after it
    counted = watches_skips(model) and not model.skip_nonfinite  # the blocks' finiteness, counted below
    updates = (_in_backward.Updates(optimizer, weights, finite=all_finite if counted else None)
               if _in_backward.supported(optimizer) else None)
    with _in_backward.watching(updates), tf.GradientTape(persistent=model.skip_nonfinite) as tape:
        loss, y_pred = _forward(model, x, y, sample_weight)
    if not model.skip_nonfinite:
        with _in_backward.applying(updates) if updates else contextlib.nullcontext():
            gradients = tape.gradient(loss, weights)
        gradients, rest = _left_after_the_blocks(updates, gradients, weights)
        if watches_skips(model):  # counted (max_consecutive_skips), not skipped
            finite = tf.reduce_all([all_finite(gradients), *(updates.finite if updates else [])])
            _count_skip(state, finite, bad_inputs(finite, (x, y, sample_weight), model))
        _apply(optimizer, gradients, rest)
        return y_pred
    finite = all_finite(tape.gradient(loss, weights))
    _count_skip(state, finite, bad_inputs(finite, (x, y, sample_weight), model))
    # No tf.cond around the update: inside an XLA conditional every gradient was held
    # again (32.3 MiB against 8.4 without, the test's MLP of 32 MiB of gradients). Each
    # assignment selects its old value instead where the step is skipped; the second
    # backward pass starts from the flag itself (1 where applied), so it follows the first.
    with _gated(optimizer, finite):
        with _in_backward.applying(updates) if updates else contextlib.nullcontext():
            gradients = tape.gradient(loss, weights, output_gradients=tf.cast(finite, loss.dtype))
        _apply(optimizer, *_left_after_the_blocks(updates, gradients, weights))
    return y_pred


def _left_after_the_blocks(updates, gradients, weights):
    """(gradients, weights) that the blocks' backward passes did not apply. A weight updated in
    its block that also has a gradient from outside every block is refused: its update ran on
    part of its gradient."""
    if not updates or not updates.applied:
        return gradients, weights
    applied = {id(w) for w in updates.applied}
    also_outside = [w.path for g, w in zip(gradients, weights) if id(w) in applied and g is not None]
    if also_outside:
        raise ValueError(
            f"update_in_backward=True updates each kvram.layers.Checkpoint block's weights in its backward pass, "
            f"but {', '.join(also_outside)} is also read outside the block, so its gradient is only whole after "
            "the pass. Allowed: each weight read inside one Checkpoint block or outside every block (share a "
            "weight between blocks or between a block and the rest of the model by keeping it out of the blocks).")
    kept = [(g, w) for g, w in zip(gradients, weights) if id(w) not in applied]
    return [g for g, _ in kept], [w for _, w in kept]


def _apply(optimizer, gradients, weights):
    """`optimizer.apply`, which also counts the step where every weight was updated in the backward pass."""
    if weights:
        optimizer.apply(gradients, weights)
    else:
        optimizer.iterations.assign_add(1)


@contextlib.contextmanager
def _gated(optimizer, finite):
    """Within, `optimizer`'s assignments (its `assign`, `assign_add`,
    `assign_sub`: every update of Keras's optimizers and kvram's) keep each
    variable as it was where `finite` is False, its weight decay is 0 there, and
    its iteration count does not advance."""
    if optimizer.use_ema:
        raise ValueError("update_in_backward=True with skip_nonfinite cannot gate an optimizer's moving average "
                         "(use_ema=True). Allowed: use_ema=False, or skip_nonfinite=False.")

    def kept(variable, value):
        if isinstance(value, tf.IndexedSlices):
            old = tf.gather(tf.convert_to_tensor(variable), value.indices)
            return tf.IndexedSlices(tf.where(finite, tf.cast(value.values, old.dtype), old), value.indices,
                                    value.dense_shape)
        return tf.where(finite, tf.cast(value, variable.dtype), tf.convert_to_tensor(variable))

    def zero_where_skipped(value):
        if isinstance(value, tf.IndexedSlices):
            values = tf.convert_to_tensor(value.values)
            return tf.IndexedSlices(tf.where(finite, values, tf.zeros_like(values)), value.indices, value.dense_shape)
        value = tf.convert_to_tensor(value)
        return tf.where(finite, value, tf.zeros_like(value))

    assign, assign_add, assign_sub = optimizer.assign, optimizer.assign_add, optimizer.assign_sub
    decay = optimizer.weight_decay
    optimizer.assign = lambda variable, value: assign(variable, kept(variable, value))
    optimizer.assign_add = lambda variable, value: assign_add(variable, zero_where_skipped(value))
    optimizer.assign_sub = lambda variable, value: assign_sub(variable, zero_where_skipped(value))
    if decay is not None:
        optimizer.weight_decay = decay * tf.cast(finite, tf.float32)
    try:
        yield
    finally:
        del optimizer.assign, optimizer.assign_add, optimizer.assign_sub
        optimizer.weight_decay = decay
    optimizer.iterations.assign_sub(1 - tf.cast(finite, optimizer.iterations.dtype))


def micro_batch_gradients(model, state, x, y, sample_weight, micro_batch_size):
    """The batch's gradients, summed over slices of `micro_batch_size` rows.

    Two ways, the same sums:

    - `micro_batch_size` an int and the batch's size known to the graph:
      every slice has a static shape (full slices cut by a reshape and run
      in a `tf.while_loop`, a shorter last slice after it). TF's GPU graph
      optimisations need the shapes: measured on EfficientNetV2S (H200,
      bf16), static slices train 1.44x faster than the same slices with
      unknown shapes. The model is traced once for the loop and once more
      for a shorter last slice, if there is one.
    - otherwise (`micro_batch_size` a tensor, or an unknown batch size):
      one traced graph serves every size and batch (`AdaptiveBatchSize`'s
      probes, short batches), with slice shapes unknown to the graph.

    Slices run one at a time (`parallel_iterations=1`) in TF's graph
    executor, not XLA; with `jit_compile`, each slice's forward and backward
    is one XLA computation, compiled once per slice shape. The sums start
    at zero.
    """
    slice_fn = slice_function(model, state)
    rows = rows_of(x)
    total = tf.cast(rows, tf.float32)
    weights = model.trainable_weights
    present = [True] * len(weights)  # set while a slice is traced
    data = (x, y, sample_weight)

    def add_slice(sums, part, size):
        xs, ys, sws = part
        gradients, y_pred = slice_fn(xs, ys, sws, tf.cast(size, tf.float32) / total)
        if y_pred is not None:
            model.compute_metrics(xs, ys, y_pred, sample_weight=sws)
        present[:] = [g is not None for g in gradients]
        return [s if g is None else s + dense(g) for s, g in zip(sums, gradients)]

    def loop(count, take):
        """Sums over `count` slices; `take(i)` is (slice i, its rows)."""
        zeros = [tf.zeros(tuple(w.shape), dtype=w.dtype) for w in weights]
        if isinstance(count, int) and count == 0:
            return zeros
        _, sums = tf.while_loop(
            lambda i, _: i < count,
            lambda i, sums: (i + 1, add_slice(sums, *take(i))),
            (tf.constant(0), zeros),
            parallel_iterations=1,  # one slice in memory at a time
        )
        return sums

    static_rows = next(t for t in tree.flatten(x) if t is not None).shape[0]
    if isinstance(micro_batch_size, int) and static_rows is not None:
        m = micro_batch_size
        full, rest = divmod(static_rows, m)

        def fold(t):
            return None if t is None else tf.reshape(t[: full * m], [full, m] + t.shape[1:].as_list())

        folded = tree.map_structure(fold, data)
        sums = loop(full, lambda i: (tree.map_structure(lambda t: None if t is None else t[i], folded), m))
        if rest:
            last = tree.map_structure(lambda t: None if t is None else t[full * m :], data)
            sums = add_slice(sums, last, rest)
    else:
        m = tf.cast(micro_batch_size, rows.dtype)

        def take(i):
            start = tf.cast(i, rows.dtype) * m
            size = tf.minimum(m, rows - start)
            return tree.map_structure(lambda t: None if t is None else t[start : start + size], data), size

        sums = loop(tf.cast((rows + m - 1) // m, tf.int32), take)
    if isinstance(micro_batch_size, int):  # traced: the layers are built now
        _batch_statistics.check_slices(model, micro_batch_size, static_rows, said=state.slice_warnings)
    return [s if p else None for s, p in zip(sums, present)]

def slice_function(model, state):
    """`_slice_gradients`, as an XLA computation when the model compiles with XLA
    (`jit_compile`, or the one it was compiled with under host_offload, whose step is not XLA's)."""
    jit = model.jit_compile or getattr(model, "_kvram_slice_jit", None)
    if not jit or model.run_eagerly or tf.executing_eagerly():
        return functools.partial(slice_gradients, model)
    function = state.jit_slice_gradients
    if function is None:
        function = tf.function(
            functools.partial(slice_gradients, model), jit_compile=True, reduce_retracing=True
        )
        state.jit_slice_gradients = function
    return function


def offload_of(optimizer):
    """The `HostOffload` in `optimizer`'s chain of wrappers, or None."""
    from kvram.optimizers import HostOffload

    while optimizer is not None:
        if isinstance(optimizer, HostOffload):
            return optimizer
        optimizer = getattr(optimizer, "inner_optimizer", None)
    return None


def offloaded_gradients(model, state, x, y, sample_weight):
    """`slice_gradients` for a step that leaves XLA (host_offload). A model with `Checkpoint`
    blocks compiles each block by itself, so that each block's gradients are made, and can leave
    the device, while the next block's backward pass runs; without blocks the forward and backward
    pass is one XLA computation. As `jit_compile` said at `compile()`."""
    if any(isinstance(layer, checkpoint.Checkpoint) for layer in model._flatten_layers()) and not (
            model.run_eagerly or tf.executing_eagerly()):
        offload = offload_of(model.optimizer)
        host = offload.host if offload is not None and offload.block_inputs == "host" else None
        with _compiling.compiled_blocks(inputs_host=host) as blocks:
            result = slice_gradients(model, x, y, sample_weight)
        if offload is not None:
            offload.kept_block_inputs, offload.kept_block_input_bytes = blocks.kept_inputs, blocks.kept_bytes
        return result
    return slice_function(model, state)(x, y, sample_weight)


def apply_gradients(model, state, gradients, trainable_weights, finite=None, bad_inputs=None):
    """Applies `gradients` unless they are not all finite.

    `finite` (this replica's gradients are all finite) is computed when not
    given; `bad_inputs` (a boolean: this replica's batch held NaN/Inf, see
    `bad_inputs()`) feeds the diagnosis of a run of skipped steps.
    """
    if finite is None:
        finite = all_finite(gradients)
    if bad_inputs is None:
        bad_inputs = tf.constant(False)
    context = tf.distribute.get_replica_context()
    replicated = context is not None and context.num_replicas_in_sync > 1
    if replicated:
        # One decision for all replicas: skip when any replica's gradients
        # are not finite (they are summed into one update).
        bad = context.all_reduce(
            tf.distribute.ReduceOp.SUM,
            tf.cast(tf.stack([tf.logical_not(finite), bad_inputs]), tf.int32),
        )
        finite, bad_inputs = tf.equal(bad[0], 0), tf.greater(bad[1], 0)
        if model.clip_global_norm is not None:
            gradients = _clip_across_replicas(model, context, gradients)
    if replicated and tf.__internal__.distribute.strategy_supports_no_merge_call():
        # Each replica's step is XLA-compiled (MirroredStrategy on GPUs):
        # a merge_call is refused there (keras-team/keras#17187).
        with updated_in_each_replica(
            step_state_variables(model, state)
        ):
            _count_and_apply(model, state, gradients, trainable_weights, finite, bad_inputs, context)
        return
    _count_and_apply(model, state, gradients, trainable_weights, finite, bad_inputs, context)

def _count_skip(state, finite, bad_inputs) -> None:
    """The step's counters, for a step skipped where `finite` is False."""
    skipped = tf.cast(tf.logical_not(finite), tf.int64)
    state.skipped.assign_add(skipped)
    state.skip_run.assign((state.skip_run + 1) * skipped)
    state.skip_run_bad_inputs.assign(
        (state.skip_run_bad_inputs + tf.cast(bad_inputs, tf.int64)) * skipped
    )


def _count_and_apply(model, state, gradients, trainable_weights, finite, bad_inputs, context):
    _count_skip(state, finite, bad_inputs)
    if isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer) or not (
        model.skip_nonfinite
    ):
        # LossScaleOptimizer checks finiteness itself, skips and lowers the scale.
        model.optimizer.apply(gradients, trainable_weights)
        return
    if not model.optimizer.built:
        model.optimizer.build(trainable_weights)
    if tf.distribute.has_strategy() and not (
        tf.__internal__.distribute.strategy_supports_no_merge_call()
    ):
        # The optimizer's update is a synchronisation point (merge_call), which
        # may not sit in a cond in replica context: decide in cross-replica
        # context, as Keras's LossScaleOptimizer does.
        def cross_replica(distribution, gradients, finite):
            decision = distribution.experimental_local_results(finite)[0]

            def apply():
                distribution.extended.call_for_each_replica(
                    lambda g: model.optimizer.apply(list(g), trainable_weights),
                    args=(gradients,),
                )

            tf.cond(decision, apply, lambda: None)

        context.merge_call(cross_replica, args=(list(gradients), finite))
        return
    tf.cond(
        finite,
        lambda: model.optimizer.apply(gradients, trainable_weights),
        lambda: None,
    )

def _clip_across_replicas(model, context, gradients):
    """Clips the replicas' summed gradient to `clip_global_norm`.

    The optimizer's own `global_clipnorm` acts on each replica's share before
    they are summed, which is not the global norm of the update. Here the
    shares are summed first, clipped, and divided by the number of replicas,
    so that the optimizer's own sum gives the clipped gradient back (its own
    clipping then finds nothing to do). Costs one more all-reduce per step.
    """
    present = [i for i, g in enumerate(gradients) if g is not None]
    summed = context.all_reduce(
        tf.distribute.ReduceOp.SUM, [dense(gradients[i]) for i in present]
    )
    limit = tf.constant(model.clip_global_norm, tf.float32)
    if isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer):
        limit = limit * tf.cast(model.optimizer.dynamic_scale, tf.float32)  # still scaled
    clipped, _ = tf.clip_by_global_norm(summed, limit)
    share = 1.0 / context.num_replicas_in_sync
    result = list(gradients)
    for i, g in zip(present, clipped):
        result[i] = g * tf.cast(share, g.dtype)
    return result

def step_logs(model, state, logs):
    """A step's logs with kvram's: skipped_steps (and loss_scale under a LossScaleOptimizer)."""
    logs = dict(logs)
    logs["skipped_steps"] = state.skipped.value()
    if isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer):
        logs["loss_scale"] = model.optimizer.dynamic_scale.value
    return logs


def step_state_variables(model, state) -> list:
    """The distributed variables of kvram's counters (`state`) and the
    optimizer's state, among them those a training step updates to the same
    value on every replica (aggregation ONLY_FIRST_REPLICA: the step counts)."""
    variables = list(state.counters())
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None:
        variables += list(optimizer.variables)
    # A Keras variable's `value` is its tf.Variable; kvram's counters are
    # tf.Variables already (whose `value` is a method).
    return [
        v for v in (v.value if isinstance(v, keras.Variable) else v for v in variables)
        if isinstance(v, tf.distribute.DistributedValues)
    ]


_aggregation_lock = threading.Lock()


_held_aggregations: dict = {}  # id -> [variable, saved aggregation, holders]


@contextlib.contextmanager
def updated_in_each_replica(variables):
    """Within, a replica updates its own copy of those of `variables` whose
    aggregation is ONLY_FIRST_REPLICA (as if NONE) instead of broadcasting
    the first replica's value.
    For a step in which every replica computes the same update (the step
    count plus one), so that the copies stay equal.

    Works around keras-team/keras#17187 (open): under MirroredStrategy with
    `jit_compile=True` on GPUs each replica's step is its own XLA function, and
    TensorFlow updates an ONLY_FIRST_REPLICA variable in replica context by a
    `merge_call`, which may not happen there ("merge_call called while
    defining a new graph or a tf.function": on two H200s at kvram's own
    counters, at the top of the step; traced on logical CPUs, inside a `cond`:
    the optimizer's `iterations.assign_add(1)` in kvram's skip of a non-finite
    step, or in Keras's LossScaleOptimizer's own cond). The aggregation is read while the step is
    traced and restored after the last replica's trace leaves (a count per
    variable: replicas trace in threads)."""
    with _aggregation_lock:
        held_here = []
        for v in variables:
            held = _held_aggregations.get(id(v))
            if held is None:
                if v._aggregation != tf.VariableAggregation.ONLY_FIRST_REPLICA:
                    continue
                held = _held_aggregations[id(v)] = [v, v._aggregation, 0]
            held[2] += 1
            held_here.append(v)
            v._aggregation = tf.VariableAggregation.NONE
    try:
        yield
    finally:
        with _aggregation_lock:
            for v in held_here:
                held = _held_aggregations[id(v)]
                held[2] -= 1
                if held[2] == 0:
                    v._aggregation = held[1]
                    del _held_aggregations[id(v)]


def unique(variables) -> list:
    """`variables` without repeats (by identity), in order."""
    seen, result = set(), []
    for variable in variables:
        if id(variable) not in seen:
            seen.add(id(variable))
            result.append(variable)
    return result
