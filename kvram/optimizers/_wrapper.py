"""What kvram's optimizer wrappers (`HostOffload`, `ShardedState`) share with Keras's
`LossScaleOptimizer`: an inner optimizer that computes the update, its learning rate, and a
configuration that saves the inner one."""

from __future__ import annotations

from keras.src.saving import serialization_lib


def settings_given(inner, off: dict) -> list:
    """`name=value` for each setting in `off` (name: its off value) that `inner` has on, and for
    its gradient accumulation, if any: what a wrapper that updates part of the weights at a time
    refuses."""
    given = [f"{name}={getattr(inner, name)!r}" for name, value in off.items() if getattr(inner, name) != value]
    if (inner.gradient_accumulation_steps or 1) > 1:
        given.append(f"gradient_accumulation_steps={inner.gradient_accumulation_steps} (kvram.Model's "
                     "accumulation_steps sets it)")
    return given


class Wrapper:
    """Mixed in before `keras.optimizers.Optimizer`: an optimizer around `inner_optimizer`; the
    class gives `apply` and `build`. (Not an optimizer itself: nothing to register or save.)"""

    def __init__(self, inner_optimizer, name):
        super().__init__(learning_rate=0.0, name=name)
        self.inner_optimizer = inner_optimizer

    def _copies(self) -> list:
        """Further optimizers that follow the inner one's learning rate (ShardedState's per replica)."""
        return []

    def _decay_as(self, copy, weights, stand_ins) -> None:
        """`copy` (an optimizer built on `stand_ins`: masters, chunks) decays each stand-in as the
        inner optimizer decides for its model weight, by weight or by name."""
        cache = copy.__dict__.setdefault("_exclude_from_weight_decay_cache", {})
        for weight, stand_in in zip(weights, stand_ins):
            cache[copy._var_key(stand_in)] = self.inner_optimizer._use_weight_decay(weight)

    def stateless_apply(self, optimizer_variables, grads, trainable_variables):
        raise NotImplementedError(f"{type(self).__name__} runs on the TensorFlow backend's stateful apply only.")

    @property
    def learning_rate(self):
        return self.inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, learning_rate):
        if hasattr(self, "inner_optimizer"):  # the base class sets its own first
            for optimizer in [self.inner_optimizer, *self._copies()]:
                optimizer.learning_rate = learning_rate

    def get_config(self):
        return {"name": self.name, "inner_optimizer": serialization_lib.serialize_keras_object(self.inner_optimizer)}

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        inner = serialization_lib.deserialize_keras_object(config.pop("inner_optimizer"), custom_objects=custom_objects)
        return cls(inner, **config)
