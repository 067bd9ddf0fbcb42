"""An optimizer whose state is split across the replicas of a `tf.distribute` strategy (ZeRO stage 1)."""

from __future__ import annotations

import types

import keras
import numpy as np
import tensorflow as tf
from keras.src.optimizers.base_optimizer import BaseOptimizer
from tensorflow.python.ops import resource_variable_ops

from kvram.optimizers._wrapper import Wrapper, settings_given


def _plain_variables_on(device):
    """A variable creator that makes an ordinary variable on `device`, inside a strategy's scope too
    (where variables are otherwise mirrored on every replica)."""
    def creator(next_creator, **kwargs):
        with tf.device(device):
            return resource_variable_ops.ResourceVariable(
                initial_value=kwargs["initial_value"], trainable=False, name=kwargs.get("name"),
                dtype=kwargs.get("dtype"), shape=kwargs.get("shape"))

    return creator


def _replicas() -> list:
    """The devices of the current strategy's replicas on this worker (one device without one)."""
    strategy = tf.distribute.get_strategy()
    try:
        return list(strategy.extended.worker_devices)
    except RuntimeError:  # the default strategy
        return [tf.config.list_logical_devices()[0].name]


def _refuse(inner) -> None:
    """What a replica's update of its chunks alone cannot do."""
    given = settings_given(inner, {"clipnorm": None, "clipvalue": None, "use_ema": False})
    if given:
        raise ValueError(f"ShardedState cannot shard an optimizer with {', '.join(given)}: each replica updates "
                         "its chunks alone. Allowed: global_clipnorm (the summed gradient is clipped whole), and "
                         "micro_batch_size to train a larger batch.")


@keras.saving.register_keras_serializable(package="kvram")
class ShardedState(Wrapper, keras.optimizers.Optimizer):
    """Splits `inner_optimizer`'s state, and a float32 master copy of the weights, across the N
    replicas of the `tf.distribute` strategy it is built under (MirroredStrategy: ZeRO stage 1).

    Each weight is flattened and cut into N equal chunks; replica i keeps the master values and the
    optimizer state of chunk i of every weight only, so each device holds 1/N of the state that a
    mirrored optimizer keeps whole on every one. A step sums the replicas' gradients
    (`ReplicaContext.all_reduce`) and each replica takes its chunks of the sum (TensorFlow's public
    replica API has no reduce-scatter: the sum crosses whole, as Keras's own update sends it), updates
    them with the inner optimizer's own `update_step` and weight decay, and gathers every replica's
    updated chunks into its copy of each weight, as a second `all_reduce` of zero-padded chunks
    (`ReplicaContext.all_gather` takes a `merge_call`, which a replica's step compiled alone by XLA,
    as on GPUs, may not). A step thus sends about twice what a mirrored optimizer's sends. The inner optimizer's
    `global_clipnorm` clips the summed gradient; `clipnorm`, `clipvalue`, `use_ema` and its own
    `gradient_accumulation_steps` are refused. Under one device it is the inner optimizer with
    float32 masters.

    Built from the strategy in scope at `build`; saved state (masters and moments per replica) loads
    under the same number of replicas only.

    Args:
        inner_optimizer: the `keras.optimizers.Optimizer` whose update and state are sharded.
    """

    def __init__(self, inner_optimizer, name=None):
        inner = keras.optimizers.get(inner_optimizer)
        from kvram.optimizers._host import HostOffload

        if isinstance(inner, (ShardedState, HostOffload, keras.optimizers.LossScaleOptimizer)):
            raise ValueError(f"ShardedState wraps the optimizer that computes the update, not a {type(inner).__name__}. "
                             "Allowed: ShardedState(keras.optimizers.AdamW(...)).")
        _refuse(inner)
        super().__init__(inner, name=name or "sharded_state")
        self._shards = []  # per replica: (its inner optimizer, its masters' chunks)

    @keras.src.utils.tracking.no_automatic_dependency_tracking
    def build(self, var_list):
        _refuse(self.inner_optimizer)  # again: kvram.Model(accumulation_steps=...) sets it after __init__
        devices = _replicas()
        count = len(devices)
        self._sizes = [int(np.prod(v.shape)) for v in var_list]
        # 8-bit state (AdamW8bit) is quantized in blocks: chunks of whole blocks group the values as
        # the whole weight's blocks do, so that sharding changes no result
        block = int(getattr(self.inner_optimizer, "block_size", 1))
        least = getattr(self.inner_optimizer, "min_8bit_size", 0)
        self._chunk = [-(-size // (count * (block if size >= least else 1))) * (block if size >= least else 1)
                       for size in self._sizes]
        self._shards = []
        for i, device in enumerate(devices):
            with tf.variable_creator_scope(_plain_variables_on(device)):
                inner = self.inner_optimizer.__class__.from_config(self.inner_optimizer.get_config())
                # its variables are this replica's own, made by the creator above: not colocated with
                # the reference by the strategy in scope (Keras's TensorFlow optimizer does), which
                # refuses a variable it did not make
                inner.add_variable_from_reference = types.MethodType(BaseOptimizer.add_variable_from_reference, inner)
                masters = []
                for variable, size, chunk in zip(var_list, self._sizes, self._chunk):
                    flat = tf.pad(tf.reshape(tf.cast(variable.value, tf.float32), [-1]), [[0, chunk * count - size]])
                    masters.append(keras.Variable(flat[i * chunk:(i + 1) * chunk], dtype="float32", trainable=False,
                                                  name=f"{variable.path.replace('/', '_')}_shard{i}"))
                inner._whole_sizes = {inner._var_key(m): size for m, size in zip(masters, self._sizes)}
                inner.build(masters)
            self._decay_as(inner, var_list, masters)
            self._shards.append((inner, masters))
        self._index = {self._var_key(v): k for k, v in enumerate(var_list)}
        super().build(var_list)

    @property
    def variables(self):
        return self._variables + [v for inner, masters in self._shards for v in masters + inner.variables]

    def shard_variables(self, replica: int) -> list:
        """The masters' chunks and the optimizer state that `replica` keeps."""
        inner, masters = self._shards[replica]
        return masters + [v for v in inner.variables if len(v.shape)]

    def apply(self, grads, trainable_variables=None):
        if not self.built:
            self.build(trainable_variables)
            self.built = True
        variables = list(trainable_variables) if trainable_variables is not None else self._trainable_variables
        context = tf.distribute.get_replica_context()
        if context is None:
            raise ValueError("ShardedState.apply runs in a replica context (strategy.run), as Keras's step calls it.")
        count = len(self._shards)
        replica = context._replica_id_in_sync_group if count > 1 else 0
        if not isinstance(replica, int):
            replica = tf.get_static_value(replica)
        pairs = [(g, self._index[self._var_key(v)], v) for g, v in zip(grads, variables) if g is not None]
        summed = [tf.cast(tf.convert_to_tensor(g), tf.float32) for g, _, _ in pairs]
        if count > 1:
            summed = context.all_reduce(tf.distribute.ReduceOp.SUM, summed)
        if self.inner_optimizer.global_clipnorm is not None:
            summed, _ = tf.clip_by_global_norm(summed, self.inner_optimizer.global_clipnorm)
        inner, masters = self._shards[replica]
        chosen = [masters[k] for _, k, _ in pairs]
        chunks = []
        for g, (_, k, _) in zip(summed, pairs):
            flat = tf.pad(tf.reshape(g, [-1]), [[0, self._chunk[k] * count - self._sizes[k]]])
            chunks.append(flat[replica * self._chunk[k]:(replica + 1) * self._chunk[k]])
        learning_rate = inner._get_current_learning_rate()
        BaseOptimizer._apply_weight_decay(inner, chosen)  # Keras's own, without its merge_call
        for chunk, master in zip(chunks, chosen):
            inner.update_step(chunk, master, learning_rate)
        inner._iterations.assign_add(1)
        # Gathered as a sum of zero-padded chunks: ReplicaContext.all_gather takes a merge_call,
        # which a replica's step compiled by itself with XLA (MirroredStrategy on GPUs) may not;
        # all_reduce runs as a collective there. Adding zeros is exact.
        placed = [tf.pad(master.value, [[replica * self._chunk[k], (count - 1 - replica) * self._chunk[k]]])
                  for (_, k, _), master in zip(pairs, chosen)]
        if count > 1:
            placed = context.all_reduce(tf.distribute.ReduceOp.SUM, placed)
        for (_, k, variable), whole in zip(pairs, placed):
            variable.assign(tf.cast(tf.reshape(whole[:self._sizes[k]], variable.shape), variable.dtype))

    def _copies(self) -> list:
        return [inner for inner, _ in getattr(self, "_shards", [])]

    @property
    def iterations(self):
        return self._shards[0][0].iterations if self._shards else self.inner_optimizer.iterations
