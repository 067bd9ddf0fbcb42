"""Gradient checkpointing of one Keras layer or block."""

from __future__ import annotations

import logging

import keras
import tensorflow as tf
from keras import tree

__all__ = ["Checkpoint"]


class _IntegerWatchFilter(logging.Filter):
    """Drops TF's warning about watching integer tensors, which `Checkpoint` does on
    purpose: seed states travel as `tf.recompute_grad` arguments so that the
    recomputation can restore them; they get no gradient and need none."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "The dtype of the watched tensor must be floating" not in str(record.msg)


tf.get_logger().addFilter(_IntegerWatchFilter())


@keras.saving.register_keras_serializable(package="kvram")
class Checkpoint(keras.layers.Layer):
    """Recomputes a layer's activations in the backward pass instead of storing them.

    Without checkpointing, every intermediate tensor of `layer` stays alive from the
    forward pass until its gradient is computed. Wrapped in `Checkpoint`, only the
    layer's inputs are kept; the forward pass of `layer` runs a second time inside
    the backward pass (`tf.recompute_grad`) to rebuild what the gradient needs.
    Trade-off: activation memory of the block drops to its inputs, at the price of
    one more forward pass of the block (typically +20-35% step time when every
    block of a network is wrapped).

    The wrapped computation is the same function with the same gradients:

    - Random layers (`Dropout`, noise layers, anything drawing from a Keras
      `SeedGenerator`) replay the same random numbers in the recomputation: their
      seed state is restored to its value before the forward pass.
    - Layers with side effects in `call` would otherwise apply them twice. Every
      non-trainable variable of `layer` (BatchNormalization's moving mean and
      variance, seed states) is restored to its pre-forward value before the
      recomputation, so the recomputation writes exactly the values the forward
      pass wrote: the moving statistics are updated once, as without
      checkpointing. Side effects outside the layer's variables (Python state,
      `print`, `add_loss` from inside `call`) are not replayed and not undone:
      keep such layers outside `Checkpoint`.

    Keyword arguments of the call (`training`, `mask`, ...) are bound by closure and
    only tensors are passed positionally, which is what lets this run inside
    `tf.function` and `jit_compile=True` (keras#21207). With `training=False` or
    unset (inference, `evaluate`, `predict`), the layer is simply called.

    Args:
        layer: a `keras.layers.Layer` (a `keras.Sequential` or any model also
            works): the block to recompute.
        **kwargs: base `keras.layers.Layer` arguments (`name`, ...).

    Raises:
        TypeError: if `layer` is not a Keras layer.

    Example:
    ```python
    block = keras.Sequential([keras.layers.Dense(512, "gelu"), keras.layers.Dense(128)])
    y = kvram.layers.Checkpoint(block)(x, training=True)
    ```
    """

    def __init__(self, layer, **kwargs):
        if not isinstance(layer, keras.layers.Layer):
            raise TypeError(
                "`layer` must be a keras.layers.Layer (a Keras layer, Sequential or "
                f"Model). Received: layer={layer!r} of type {type(layer).__name__}"
            )
        if isinstance(layer, Checkpoint):
            raise ValueError(
                "`layer` is already a kvram.layers.Checkpoint; wrapping it twice would "
                f"recompute it twice. Received: layer={layer.name!r}"
            )
        kwargs.setdefault("dtype", layer.dtype_policy)
        super().__init__(**kwargs)
        self.layer = layer
        # Inputs go to the wrapped layer untouched: it casts them itself.
        self._convert_input_args = False
        self.supports_masking = getattr(layer, "supports_masking", False)

    def build(self, input_shape=None):
        if not self.layer.built:
            self.layer.build(input_shape)
        self.built = True

    def call(self, inputs, *args, training=None, **kwargs):
        if getattr(self.layer, "_call_has_training_arg", False):
            kwargs["training"] = training
        args = (inputs,) + args
        if not training:
            return self.layer(*args, **kwargs)

        flat_args = tree.flatten(args)
        tensor_positions = [i for i, a in enumerate(flat_args) if tf.is_tensor(a)]
        state = list(self.layer.non_trainable_variables)
        snapshot = [tf.identity(v.value) for v in state]
        n_in = len(tensor_positions)
        carries_logits = []

        def forward(*tensors):
            # Restore the wrapped layer's non-trainable state (seed generators,
            # moving statistics) to its pre-forward value: a no-op in the forward
            # pass, and in the recomputation the replay of the same random numbers
            # and the same state updates.
            for variable, value in zip(state, tensors[n_in:]):
                variable.assign(value)
            call_args = list(flat_args)
            for position, tensor in zip(tensor_positions, tensors[:n_in]):
                call_args[position] = tensor
            outputs = self.layer(*tree.pack_sequence_as(args, call_args), **kwargs)
            logits = getattr(outputs, "_keras_logits", None) if tf.is_tensor(outputs) else None
            if logits is None:
                return outputs
            carries_logits.append(True)
            # Logits first: the recomputation waits for the gradient of the
            # first output, and the loss reads the logits.
            return logits, outputs

        inputs = [flat_args[i] for i in tensor_positions]
        outputs = tf.recompute_grad(forward)(*inputs, *snapshot)
        if carries_logits:
            # Keras's softmax and sigmoid hang their logits on their output
            # (`_keras_logits`, graph tensors only), and its cross-entropies
            # then compute from the logits, unclipped. Carried out of the
            # recomputed function, so that a checkpointed classifier trains on
            # the same loss as the plain one (the probabilities' form clips at
            # epsilon: where a probability saturates its gradient differs).
            logits, outputs = outputs
            outputs._keras_logits = logits
        return outputs

    def compute_output_shape(self, *args, **kwargs):
        return self.layer.compute_output_shape(*args, **kwargs)

    def compute_output_spec(self, *args, **kwargs):
        kwargs.pop("training", None)
        return self.layer.compute_output_spec(*args, **kwargs)

    def compute_mask(self, *args, **kwargs):
        return self.layer.compute_mask(*args, **kwargs)

    def get_config(self):
        config = super().get_config()
        config["layer"] = keras.saving.serialize_keras_object(self.layer)
        return config

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        layer = keras.saving.deserialize_keras_object(
            config.pop("layer"), custom_objects=custom_objects
        )
        return cls(layer, **config)
