"""Updates applied inside the backward pass, block by block (`update_in_backward`).

With `kvram.Model(update_in_backward=True)`, each `kvram.layers.Checkpoint` block's backward pass
applies its own weights' updates as soon as their gradients exist, and the gradient it passes on
to the blocks before it carries a zero taken from every value those updates stored. The blocks
before it therefore cannot run their backward pass before the update is done, whatever XLA's
schedule prefers, and each block's weight gradients die with its update. Without that data
dependency XLA's GPU schedule ran some updates only at the step's end (each update first
allocates its float32 state, more than the gradient it frees): on an H100, 2.64 GB of a
32-block Llama's weight gradients were held to the end
(benchmarks/results/optimizers_capacity_factored_depths_h100.json).

A weight is updated in its block when that block is the only `Checkpoint` call that reads it;
weights outside the blocks, and weights read by several, are updated after the backward pass as
before. A weight read in a block and also outside every block is refused (its gradient is only
whole at the end). Optimizers whose update needs every gradient (`global_clipnorm`,
`use_ema`, gradient accumulation, `LossScaleOptimizer`) keep the one update after the pass.
"""

from __future__ import annotations

import collections
import contextlib
import threading

import keras
import tensorflow as tf

from kvram._order import zero_from

_current = threading.local()


def supported(optimizer) -> bool:
    """Whether `optimizer`'s update of some weights can run apart from the others'."""
    return not (isinstance(optimizer, keras.optimizers.LossScaleOptimizer) or optimizer.global_clipnorm
                or optimizer.use_ema or (optimizer.gradient_accumulation_steps or 1) > 1)


class Updates:
    """One step's updates in the backward pass: the blocks' weights (counted while the forward
    pass runs, under `watching`) and the updates applied (under `applying`). `finite`, if given,
    reduces a block's applied gradients to whether they are all finite (`self.finite`, a flag a block)."""

    def __init__(self, optimizer, weights, finite=None):
        self.optimizer = optimizer
        self._weights = {id(handle(w)): w for w in weights}
        self._reads = collections.Counter()  # per weight: the Checkpoint calls that read it
        self._all_finite = finite
        self.applying = False
        self.applied = []  # the weights updated in a block
        self.finite = []  # per block: whether its gradients were all finite (with `finite`)

    def read_by_block(self, layer) -> None:
        self._reads.update({id(handle(w)) for w in layer.trainable_weights})

    def apply(self, variables, gradients):
        """Applies the gradients of the weights that only this block reads; returns the gradients
        left for the tape (None for those applied) and a float32 zero computed from every value
        the updates stored (None if nothing was applied)."""
        owned = [i for i, (v, g) in enumerate(zip(variables, gradients))
                 if g is not None and id(v) in self._weights and self._reads[id(v)] == 1
                 and not getattr(self._weights[id(v)], "overwrite_with_gradient", False)]
        if not self.applying or not owned:
            return gradients, None
        weights = [self._weights[id(variables[i])] for i in owned]
        grads = [gradients[i] for i in owned]
        if self._all_finite is not None:
            self.finite.append(self._all_finite(grads))
        stored = []
        optimizer = self.optimizer
        assign, assign_add, assign_sub = optimizer.assign, optimizer.assign_add, optimizer.assign_sub

        def recording(method):
            def assigned(variable, value):
                method(variable, value)
                stored.append(variable)
            return assigned

        names = ("assign", "assign_add", "assign_sub")
        own = {name: vars(optimizer)[name] for name in names if name in vars(optimizer)}  # _gated's, if any
        optimizer.assign, optimizer.assign_add, optimizer.assign_sub = map(recording, (assign, assign_add, assign_sub))
        try:  # what Keras's `apply` does for these weights, all but counting the iteration
            with tf.name_scope("update_in_backward"):
                scale = optimizer.loss_scale_factor
                if scale is not None:
                    grads = [g / scale for g in grads]
                optimizer._backend_apply_gradients(grads, weights)
                for weight in weights:
                    if weight.constraint is not None:
                        weight.assign(weight.constraint(weight))
        finally:
            for name in names:
                if name in own:
                    setattr(optimizer, name, own[name])
                else:
                    delattr(optimizer, name)
        self.applied.extend(weights)
        zero = tf.add_n([zero_from(tf.convert_to_tensor(v)) for v in weights + stored])
        left = list(gradients)
        for i in owned:
            left[i] = None
        return left, zero


def handle(weight):
    """The tf.Variable behind a Keras variable (what a custom gradient's `variables` holds)."""
    return getattr(weight, "_value", weight)


def current():
    return getattr(_current, "updates", None)


@contextlib.contextmanager
def watching(updates):
    """Within, `kvram.layers.Checkpoint` calls count the weights they read into `updates`, and their
    backward passes offer `updates` their gradients."""
    _current.updates = updates
    try:
        yield updates
    finally:
        _current.updates = None


@contextlib.contextmanager
def applying(updates):
    """Within, the backward passes traced apply their blocks' updates (`Updates.apply`)."""
    updates.applying = True
    try:
        yield updates
    finally:
        updates.applying = False


def recompute_grad(f, updates):
    """`tf.recompute_grad(f)` (graph mode), whose backward pass hands its variables' gradients to
    `updates` and orders the input gradients after what `updates` applied."""
    from tensorflow.python.eager import record

    @tf.custom_gradient
    def recomputed(*args):
        with record.stop_recording():
            result = f(*args)

        def gradient(*dresult, variables=None):
            variables = list(variables or [])
            with tf.GradientTape() as tape:
                # recomputed once the gradient arrives, as tf.recompute_grad orders it
                zero = zero_from(dresult[0])
                inputs = [tf.identity(a) + tf.cast(zero, a.dtype) if a.dtype.is_floating or a.dtype.is_integer
                          else tf.identity(a) for a in args]
                tape.watch(inputs)
                tape.watch(variables)
                again = f(*inputs)
            grads = tape.gradient(again, inputs + variables, output_gradients=dresult,
                                  unconnected_gradients=tf.UnconnectedGradients.ZERO)
            input_grads, variable_grads = grads[:len(inputs)], grads[len(inputs):]
            variable_grads, done = updates.apply(variables, variable_grads)
            if done is not None:
                input_grads = [g if g is None else g + tf.cast(done, g.dtype) for g in input_grads]
            return input_grads, variable_grads

        return result, gradient

    return recomputed
