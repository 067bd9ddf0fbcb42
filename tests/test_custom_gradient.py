"""kvram/_custom_gradient.py: custom gradients' variable search walks only the function's own ops."""

import numpy as np
import tensorflow as tf
from tensorflow.python.ops import custom_gradient, op_selector

import kvram  # noqa: F401  (installs the bounded walk)
from kvram import _custom_gradient


def _walked(monkeypatch, blocks: int) -> int:
    """Ops visited by custom gradients' variable searches while tracing a chain of checkpointed blocks."""
    visited = []
    walk = op_selector.get_backward_walk_ops

    def counting(*args, **kwargs):
        result = walk(*args, **kwargs)
        visited.append(len(result))
        return result

    monkeypatch.setattr(op_selector, "get_backward_walk_ops", counting)
    weights = [tf.Variable(tf.eye(4)) for _ in range(blocks)]

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            h = x
            for w in weights:
                h = tf.recompute_grad(lambda t, w=w: tf.tanh(tf.matmul(t, w)))(h)
            loss = tf.reduce_sum(h)
        return tape.gradient(loss, weights)

    step.get_concrete_function(tf.TensorSpec((2, 4)))
    monkeypatch.setattr(op_selector, "get_backward_walk_ops", walk)
    return sum(visited)


def test_installed_by_import():
    assert _custom_gradient.installed()


def test_variable_search_grows_linearly_with_depth_and_tensorflows_own_quadratically(monkeypatch):
    bounded = [_walked(monkeypatch, n) for n in (8, 24)]
    monkeypatch.setattr(custom_gradient, "_graph_mode_decorator", _custom_gradient._original_decorator)
    monkeypatch.setattr(custom_gradient, "_get_dependent_variables", _custom_gradient._original_dependent)
    own = [_walked(monkeypatch, n) for n in (8, 24)]
    assert own[1] / own[0] > 6, own  # the premise: TensorFlow's walk grows faster than the depth (3x)
    assert bounded[1] / bounded[0] <= 3.0, bounded  # 3x the blocks, 3x the ops visited
    assert bounded[1] < own[1] / 4, (bounded, own)


def test_gradients_through_checkpointed_blocks_are_unchanged():
    weights = [tf.Variable(np.random.default_rng(i).normal(size=(4, 4)).astype("float32")) for i in range(6)]
    x = tf.constant(np.random.default_rng(9).normal(size=(3, 4)).astype("float32"))

    def grads(recompute):
        @tf.function
        def step(x):
            with tf.GradientTape() as tape:
                h = x
                for w in weights:
                    f = lambda t, w=w: tf.tanh(tf.matmul(t, w))  # noqa: E731
                    h = tf.recompute_grad(f)(h) if recompute else f(h)
                loss = tf.reduce_sum(h * h)
            return tape.gradient(loss, weights)

        return step(x)

    for a, b in zip(grads(True), grads(False)):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-6, atol=1e-6)


def test_a_variable_read_inside_a_custom_gradient_is_still_found():
    v = tf.Variable(2.0)
    seen = []

    @tf.custom_gradient
    def scaled(x):
        def grad(dy, variables=None):
            seen.append([u.name for u in variables])
            return dy * v, [tf.reduce_sum(dy * x)]

        return x * v, grad

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = tf.reduce_sum(scaled(x))
        return tape.gradient(y, [x, v])

    dx, dv = step(tf.constant([1.0, 3.0]))
    assert seen and seen[0] == [v.name]
    np.testing.assert_allclose(dx.numpy(), [2.0, 2.0])
    assert float(dv) == 4.0
