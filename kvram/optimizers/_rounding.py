"""Updates of bfloat16 weights that small steps do not vanish in.

A bfloat16 weight near 1.0 moves only in steps of 2**-7: an update below half of that,
rounded to the nearest bfloat16, leaves the weight as it was, and training on bfloat16
weights without a float32 copy stalls. Two remedies (Zamirai et al. 2020, "Revisiting
BFloat16 Training"; torchao's and optimi's bf16 optimizers):

- "stochastic": the new float32 value is rounded up or down at random, with the
  probability that makes its expectation the float32 value (`stochastic_round`). No state.
- "kahan": compensated summation. A bfloat16 buffer per weight keeps what the last
  rounding lost, and the next update adds it back. 2 bytes per value.
"""

import tensorflow as tf

ROUNDINGS = ("stochastic", "kahan", "nearest")


def stochastic_round(x, seed):
    """float32 `x` as bfloat16, rounded up or down at random: each value goes to one of its
    two bfloat16 neighbours, the nearer the likelier, so that the expectation is `x`
    (a uniform 16-bit integer added to the low half of the float32's bits, which are then
    cut). `seed`: an int32 tensor of shape (2,); distinct seeds draw independent noise.
    Values that are not finite, and those whose rounding up would overflow, round to the nearest."""
    x = tf.convert_to_tensor(x, tf.float32)
    bits = tf.bitcast(x, tf.int32)
    noise = _uniform_16_bits(tf.shape(x), seed)
    rounded = tf.bitcast(tf.bitwise.bitwise_and(bits + noise, tf.constant(-(1 << 16), tf.int32)), tf.float32)
    keep = tf.math.is_finite(rounded) & tf.math.is_finite(x)
    return tf.where(keep, tf.cast(rounded, tf.bfloat16), tf.cast(x, tf.bfloat16))


def _uniform_16_bits(shape, seed):
    """Uniform int32 values in [0, 2**16) of `shape`: TensorFlow's Philox generator keyed by the
    64 bits of `seed` itself (int32, shape (2,)). `tf.random.stateless_uniform` first scrambles
    its seed into a key (`StatelessRandomGetKeyCounter`): about 270 of the 300 HLO instructions
    each draw compiles to, once per weight in a compiled optimizer step; this draw compiles to 22."""
    key = tf.reshape(tf.bitcast(tf.cast(seed, tf.int32), tf.uint64), [1])
    bits = tf.raw_ops.StatelessRandomUniformFullIntV2(shape=shape, key=key, counter=tf.zeros([2], tf.uint64),
                                                      alg=1, dtype=tf.uint32)  # alg 1: Philox
    return tf.cast(tf.bitwise.right_shift(bits, tf.constant(16, tf.uint32)), tf.int32)


def kahan_add(weight, compensation, delta):
    """(new bfloat16 weight, new bfloat16 compensation) for `weight + delta`: `delta`
    (float32) plus what the last rounding lost (`compensation`), rounded to the nearest,
    and what this rounding lost."""
    exact = tf.cast(weight, tf.float32) + (delta + tf.cast(compensation, tf.float32))
    new = tf.cast(exact, tf.bfloat16)
    return new, tf.cast(exact - tf.cast(new, tf.float32), tf.bfloat16)
