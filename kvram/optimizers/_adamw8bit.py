"""AdamW with its two moments stored in 8 bits (block-wise dynamic quantization)."""

import keras
import numpy as np
import tensorflow as tf

from kvram._order import zero_from
from kvram.optimizers import _blockwise, _rounding


def _factors(shape) -> tuple:
    """The shapes of a factored second moment's row and column averages for a weight of `shape`:
    its means over the last axis and over the one before (leading axes kept, as Keras's
    Adafactor keeps them)."""
    shape = tuple(shape)
    return shape[:-1], shape[:-2] + shape[-1:]


def _after(first, rest):
    """`rest` with every variable read, each of its values plus a zero taken from `first`
    (`kvram._order.zero_from`): a data dependency that XLA's schedulers (the GPU's and the CPU's:
    an optimization barrier is removed before the CPU's schedules) and TensorFlow's executor all
    keep, so a computation that needs only them (a weight's float32 state, its rounding noise) is
    not run before the gradient it will be combined with, where it would hold every weight's copy
    at once."""
    flat = [tf.convert_to_tensor(t) for t in tf.nest.flatten(rest)]
    if not tf.executing_eagerly():
        zero = zero_from(first)
        flat = [t + tf.cast(zero, t.dtype) for t in flat]
    return tf.nest.pack_sequence_as(rest, flat)


@keras.saving.register_keras_serializable(package="kvram")
class AdamW8bit(keras.optimizers.AdamW):
    """Keras's `AdamW` whose first and second moments take one byte per value instead of eight.

    Each moment of a variable with at least `min_8bit_size` values is kept as int8 codes in blocks
    of `block_size` values, each block with one float32 scale (kvram/optimizers/_blockwise.py,
    after bitsandbytes' `AdamW8bit`): the first moment on a logarithmic map (4.6% at most from
    1e-5 of its block's largest value up), the second moment's root on bitsandbytes' dynamic map.
    2 bytes per parameter and 8 per block, against float32 AdamW's 8 per parameter (0.25x at the
    default block of 2048).
    Smaller variables (norms, biases) keep float32 moments, as bitsandbytes does. Every step
    dequantizes a variable's moments, updates them and the variable in float32 exactly as `AdamW`
    does, and stores them again: one variable's float32 moments exist at a time, inside the
    compiled step. Weight decay (Keras's own, before the update), XLA compilation,
    `LossScaleOptimizer`, saving (`model.save`, `keras.saving.load_model`) and TensorFlow
    checkpoints are tested (tests/test_optimizers.py); `amsgrad` is not supported. The other
    arguments are `keras.optimizers.AdamW`'s.

    bfloat16 weights (a model built under `keras.config.set_dtype_policy("bfloat16")`: no
    float32 copy of them anywhere) are updated in float32, weight decay included, and the result
    rounded back as `rounding` says (kvram/optimizers/_rounding.py): rounded to the nearest, an
    update under half a bfloat16 step (2**-8 of the weight) is lost, and training stalls.

    Args:
        block_size: values per quantization block (a positive multiple of 64; 2048 by default).
        min_8bit_size: variables with fewer values keep float32 moments (4096 by default).
        rounding: how updated bfloat16 weights are rounded: "stochastic" (the default; up or
            down at random, unbiased; no state), "kahan" (to the nearest, with a bfloat16
            buffer per weight that carries what rounding lost into the next update: 2 bytes
            per value) or "nearest" (as Keras does). float32 weights are unaffected; float16
            weights are refused unless "nearest".
        factored: keep the second moment of each 8-bit weight of two or more dimensions as
            Adafactor does (Shazeer & Stern 2018; `keras.optimizers.Adafactor`): float32 moving
            averages of the squared gradient's means over its last axis and over the one before,
            whose outer product over their mean stands for it. About 1 byte per parameter of
            optimizer state instead of 2 (the 8-bit first moment stays). False by default.
            Chunks of a weight (`ShardedState`) keep the 8-bit second moment.
    """

    def __init__(self, learning_rate=0.001, weight_decay=0.004, beta_1=0.9, beta_2=0.999, epsilon=1e-7,
                 block_size=2048, min_8bit_size=4096, rounding="stochastic", factored=False, name="adamw8bit",
                 **kwargs):
        if kwargs.get("amsgrad"):
            raise ValueError("AdamW8bit does not support amsgrad=True (its third moment would be float32); "
                             "use keras.optimizers.AdamW(amsgrad=True)")
        kwargs.pop("amsgrad", None)
        if not isinstance(block_size, (int, np.integer)) or block_size < 64 or block_size % 64:
            raise ValueError(f"block_size must be a positive multiple of 64, got {block_size!r}")
        if not isinstance(min_8bit_size, (int, np.integer)) or min_8bit_size < 0:
            raise ValueError(f"min_8bit_size must be a non-negative integer, got {min_8bit_size!r}")
        if rounding not in _rounding.ROUNDINGS:
            raise ValueError(f"rounding must be one of {', '.join(map(repr, _rounding.ROUNDINGS))}, got {rounding!r}")
        if not isinstance(factored, (bool, np.bool_)):
            raise ValueError(f"factored must be True or False, got {factored!r}")
        super().__init__(learning_rate=learning_rate, weight_decay=weight_decay, beta_1=beta_1, beta_2=beta_2,
                         epsilon=epsilon, name=name, **kwargs)
        self.block_size = int(block_size)
        self.min_8bit_size = int(min_8bit_size)
        self.rounding = rounding
        self.factored = bool(factored)

    def _quantized(self, variable) -> bool:
        # a chunk of a weight (ShardedState) is quantized as the whole weight is
        size = getattr(self, "_whole_sizes", {}).get(self._var_key(variable), int(np.prod(variable.shape)))
        return size >= self.min_8bit_size

    def _factored(self, variable) -> bool:
        """Whether `variable`'s second moment is factored (`factored`): 8-bit, two or more
        dimensions, and a whole weight (not a ShardedState chunk)."""
        return (self.factored and self._quantized(variable) and len(variable.shape) >= 2
                and self._var_key(variable) not in getattr(self, "_whole_sizes", {}))

    def state_bytes(self, shape, dtype="float32") -> int:
        """Bytes of state `build` creates for one weight of `shape` (its moments, and a Kahan
        buffer for a bfloat16 weight under rounding="kahan"); accumulation buffers included."""
        n = int(np.prod(shape))
        total = 2 * n if dtype == "bfloat16" and self.rounding == "kahan" else 0
        if n >= self.min_8bit_size:
            blocks = _blockwise.padded_size(n, self.block_size) // self.block_size
            moment = blocks * self.block_size + 4 * blocks
            if self.factored and len(shape) >= 2:
                rows, columns = _factors(shape)
                total += moment + 4 * (int(np.prod(rows)) + int(np.prod(columns)))
            else:
                total += 2 * moment
        else:
            total += 8 * n
        if (self.gradient_accumulation_steps or 1) > 1:
            total += 4 * n
        return total

    def working_bytes(self, shape, jit_compile=True) -> int:
        """Bytes one update of a weight of `shape` works in beyond the weight, its gradient, its
        state and its new value: the dequantized moments, their new values before quantization, the
        float32 weight. An upper bound, counted where `HostOffload` checks the host's memory. On a
        2-core CPU, updating four bfloat16 weights on the host took, per parameter: 30 bytes at 1M
        and 4M values and 14 at 16.8M as one XLA computation (XLA's CPU code differs with the size),
        counted as 32; 16 as TensorFlow ops, counted as 24; 14 factored (11 as ops), counted as 16.
        A smaller weight (float32 moments) is counted as 8. tests/test_host_offload.py checks the
        bound."""
        n = int(np.prod(shape))
        if n < self.min_8bit_size:
            return 8 * n
        if self.factored and len(shape) >= 2:
            return 16 * n
        return (32 if jit_compile else 24) * n

    def build(self, var_list):
        if self.built:
            return
        keras.optimizers.Optimizer.build(self, var_list)  # not Adam's: its float32 moments are what this replaces
        # per variable: (m, v) float32, ((m codes, m scales), (v codes, v scales)), or with `factored`
        # ((m codes, m scales), (v rows, v columns))
        self._moments = []
        # per variable: its Kahan compensation (bfloat16 weights under rounding="kahan"), else None
        self._compensations = []
        for variable in var_list:
            if variable.dtype == "float16" and self.rounding != "nearest" and variable.trainable:
                raise ValueError(
                    f"AdamW8bit(rounding={self.rounding!r}) rounds bfloat16 weights; {variable.path} is float16. "
                    "Allowed: float32 or bfloat16 weights, or rounding='nearest'.")
            self._compensations.append(
                self.add_variable(variable.shape, dtype="bfloat16", name=f"{variable.path.replace('/', '_')}_kahan",
                                  initializer="zeros")
                if self._rounded(variable) and self.rounding == "kahan" else None)
            if getattr(variable, "overwrite_with_gradient", False):
                self._moments.append(None)
                continue
            name = variable.path.replace("/", "_")
            if not self._quantized(variable):
                self._moments.append(tuple(
                    self.add_variable(variable.shape, dtype="float32", name=f"{name}_{kind}")
                    for kind in ("momentum", "velocity")))
                continue
            blocks = _blockwise.padded_size(int(np.prod(variable.shape)), self.block_size) // self.block_size
            factored = self._factored(variable)
            moments = tuple(
                (self.add_variable((blocks, self.block_size), dtype="int8", name=f"{name}_{kind}_codes"),
                 self.add_variable((blocks,), dtype="float32", name=f"{name}_{kind}_scales"))
                for kind in (("momentum",) if factored else ("momentum", "velocity")))
            if factored:  # the second moment: its row and column means
                moments += (tuple(self.add_variable(shape, dtype="float32", name=f"{name}_velocity_{kind}")
                                  for kind, shape in zip(("rows", "columns"), _factors(variable.shape))),)
            self._moments.append(moments)

    def shared_update(self, variable):
        """`(key, own)` for `variable`, or None. `own`: the variables of this optimizer that belong to
        `variable` alone (its moments: codes and scales where 8-bit; its Kahan buffer). `key`: what
        else decides its update (shape, dtypes, 8-bit, factored, weight decay). One traced update
        serves every weight of one `key` where weight and `own` are its arguments (`HostOffload`'s
        per-weight updates, `groups >= 2`): the lookups in `update_step` resolve to them. None where
        the update bakes in more of the weight (its index seeds the stochastic rounding of bfloat16
        weights) or it has no moments (`overwrite_with_gradient`)."""
        index = self._get_variable_index(variable)
        if self._rounded(variable) or self._moments[index] is None:
            return None
        own = tf.nest.flatten(self._moments[index]) + [c for c in self._compensations[index:index + 1] if c is not None]
        key = (tuple(variable.shape), variable.dtype, self._quantized(variable), self._factored(variable),
               bool(self.weight_decay is not None and self._use_weight_decay(variable)))
        return key, own

    def _rounded(self, variable) -> bool:
        """Whether `variable`'s updates are rounded as `rounding` says (here, not by Keras)."""
        return variable.dtype == "bfloat16" and self.rounding != "nearest"

    def _apply_weight_decay(self, variables):
        # the rounded ones decay in update_step, in float32: in bfloat16, Keras's
        # `variable * weight_decay * learning_rate` is under half a step and lost
        super()._apply_weight_decay([v for v in variables if not self._rounded(v)])

    def update_step(self, gradient, variable, learning_rate):
        dtype = variable.dtype
        lr = tf.cast(learning_rate, tf.float32)
        gradient = tf.cast(gradient, tf.float32)
        step = tf.cast(self.iterations + 1, tf.float32)
        beta_1, beta_2 = tf.cast(self.beta_1, tf.float32), tf.cast(self.beta_2, tf.float32)
        alpha = lr * tf.sqrt(1 - tf.pow(beta_2, step)) / (1 - tf.pow(beta_1, step))
        index = self._get_variable_index(variable)
        state = self._moments[index]
        quantized = isinstance(state[0], tuple)
        factored = self._factored(variable)
        gradient = tf.convert_to_tensor(gradient)
        # read after the gradient exists: nothing here depends on it, and a scheduler free to run
        # the reads early (XLA's, TensorFlow's executor) holds every weight's float32 state at once
        reads = {"state": tf.nest.flatten(state), "step": self.iterations}
        rounded = self._rounded(variable)
        if rounded:  # the weight itself is read only to round its update into it
            reads["weight"] = variable
        if self._compensations[index] is not None:
            reads["compensation"] = self._compensations[index]
        read = _after(gradient, reads)
        if quantized:
            m_codes, m_scales, *second = read["state"]
            m = _blockwise.dequantize(m_codes, m_scales, variable.shape, signed=True)
            if factored:
                rows, columns = second
            else:
                v = tf.square(_blockwise.dequantize(*second, variable.shape, signed=False))
        else:
            m, v = read["state"]
        m = m + (gradient - m) * (1 - beta_1)
        if factored:  # Adafactor's: the squared gradient's means over the last axis and the one before
            squared = tf.square(gradient)
            rows = rows + (tf.reduce_mean(squared, axis=-1) - rows) * (1 - beta_2)
            columns = columns + (tf.reduce_mean(squared, axis=-2) - columns) * (1 - beta_2)
            mean = tf.reduce_mean(rows, axis=-1, keepdims=True)
            v = (tf.expand_dims(tf.math.divide_no_nan(rows, mean), -1) * tf.expand_dims(columns, -2))
        else:
            v = v + (tf.square(gradient) - v) * (1 - beta_2)
        update = m * alpha / (tf.sqrt(v) + self.epsilon)
        if rounded:
            self._assign_rounded(variable, index, read, update, lr)
        else:
            self.assign_sub(variable, tf.cast(update, dtype))
        if quantized:
            # the second moment's root: half the decades of the second moment, so the map's finer ones
            stored = ((state[0], m, True),) + (() if factored else ((state[1], tf.sqrt(v), False),))
            for (codes, scales), value, signed in stored:
                new_codes, new_scales = _blockwise.quantize(value, self.block_size, signed=signed)
                self.assign(codes, new_codes)
                self.assign(scales, new_scales)
            if factored:
                self.assign(state[1][0], rows)
                self.assign(state[1][1], columns)
        else:
            self.assign(state[0], m)
            self.assign(state[1], v)

    def _assign_rounded(self, variable, index, read, update, lr):
        """variable - weight decay - update, computed in float32 and rounded to bfloat16.
        `read`: the variable ("weight"), the iteration count ("step") and the Kahan buffer
        ("compensation", under rounding="kahan"), read after the gradient (`_after`)."""
        value = read["weight"]
        weight = tf.cast(value, tf.float32)
        delta = -update
        if self.weight_decay is not None and self._use_weight_decay(variable):
            delta = delta - weight * tf.cast(self.weight_decay, tf.float32) * lr
        if self.rounding == "kahan":
            new, lost = _rounding.kahan_add(value, read["compensation"], delta)
            self.assign(self._compensations[index], lost)
        else:  # a new draw per step and per variable, drawn once the gradient exists
            seed = tf.stack([tf.cast(read["step"], tf.int32), tf.constant(index, tf.int32)])
            new = _rounding.stochastic_round(weight + delta, seed)
        self.assign(variable, new)

    def get_config(self):
        config = super().get_config()
        config.pop("amsgrad", None)
        config.update({"block_size": self.block_size, "min_8bit_size": self.min_8bit_size, "rounding": self.rounding,
                       "factored": self.factored})
        return config
