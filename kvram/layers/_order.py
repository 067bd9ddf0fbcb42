"""Ordering a backward pass's recomputation after its gradient under XLA."""

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
