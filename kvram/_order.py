"""Ordering under XLA, which ignores control dependencies: a backward pass's recomputation after
its gradient, and what is computed from weights or state after a value it must follow; and
whether a trace is XLA's (`in_xla`)."""

from __future__ import annotations

import tensorflow as tf


def after(gradient):
    """A float32 zero that XLA must compute from `gradient` (one element of
    it). Added to what a custom gradient recomputes from, it makes the
    recomputation wait until the gradient arrives. Nothing else orders it
    (XLA ignores control dependencies): XLA's schedule otherwise recomputes
    as soon as the forward pass ends and holds every layer's result at the
    step's peak (MemoryEfficientAttention's probabilities in a ViT's
    compiled step). `tf.recompute_grad` orders its recomputation the same
    way. min(|g|, 0) is 0 for every g but NaN (a NaN gradient stays NaN), and
    XLA does not fold it away."""
    first = tf.reduce_max(tf.reshape(tf.cast(gradient, tf.float32), [-1])[:1])
    return tf.minimum(tf.abs(first), 0.0)


def zero_from(value):
    """A float32 0.0 that XLA must compute from `value` (its first element), 0 also where that
    element is not finite: a data dependency that orders what it is added to after `value`."""
    head = tf.cast(tf.reshape(value, [-1])[:1], tf.float32)
    return tf.reduce_sum(tf.where(tf.math.is_finite(head), head * 0.0, 0.0))


def in_xla(x) -> bool:
    """Whether `x` is being traced into an XLA-compiled function."""
    from tensorflow.python.framework import ops
    from tensorflow.python.ops import control_flow_util

    return not tf.executing_eagerly() and control_flow_util.GraphOrParentsInXlaContext(ops.get_default_graph())
