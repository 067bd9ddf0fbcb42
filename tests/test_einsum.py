"""kvram.speed.tensordot_einsum (kvram/_einsum.py): Keras's einsum of a tensor times a
weight as one 2-D matmul, the weight's gradient one GEMM instead of a batched
product summed over the batch (keras-team/keras#22823's bug, left in `einsum`)."""

import os
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import kvram
from helpers import max_rel_diff, run_with_peak
from kvram import _einsum

# (equation, input shape, output shape, bias axes): Keras's MultiHeadAttention
# projections in and out, a KerasHub feedforward, one with its output axes reordered
EQUATIONS = [
    ("btd,dnh->btnh", (6, 10, 16), (None, 4, 8), "nh"),
    ("btnh,nhd->btd", (6, 10, 4, 8), (None, 16), "d"),
    ("btd,df->btf", (6, 10, 16), (None, 24), "f"),
    ("btd,dnh->bnth", (6, 10, 16), (4, None, 8), None),
]


def _step(layer, x):
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = layer(x)
        loss = tf.reduce_sum(y * tf.cos(y))
    return [y, *tape.gradient(loss, [x, *layer.trainable_weights])]


def _under_keras_einsum(compute):
    """`compute()` with Keras's own einsum; kvram's is installed again after."""
    assert kvram.speed.tensordot_einsum(enable=False)
    try:
        return compute()
    finally:
        assert kvram.speed.tensordot_einsum()


def test_import_kvram_installs_it():
    from keras.src.backend.tensorflow import numpy as tf_numpy

    assert tf_numpy.einsum is _einsum.einsum
    assert not kvram.speed.tensordot_einsum()  # already there


@pytest.mark.parametrize("equation, shape, output_shape, bias", EQUATIONS)
def test_values_and_gradients_equal_keras(equation, shape, output_shape, bias):
    layer = keras.layers.EinsumDense(equation, output_shape=output_shape, bias_axes=bias)
    x = tf.random.normal(shape, seed=1)
    ours = _step(layer, x)
    theirs = _under_keras_einsum(lambda: _step(layer, x))
    assert ours[0].shape == theirs[0].shape
    assert max_rel_diff(theirs[:1], ours[:1]) < 1e-6
    assert max_rel_diff(theirs[1:], ours[1:], per_tensor=False) < 1e-6


def _gradient_ops(layer, x):
    graph = tf.function(lambda: _step(layer, x)).get_concrete_function().graph
    return {op.type for op in graph.get_operations()}


def test_the_weight_gradient_is_a_matmul_not_a_batched_product():
    layer = keras.layers.EinsumDense("btd,dnh->btnh", output_shape=(None, 4, 8))
    x = tf.random.normal((6, 10, 16))
    assert "BatchMatMulV2" not in _gradient_ops(layer, x)
    assert "BatchMatMulV2" in _under_keras_einsum(lambda: _gradient_ops(layer, x))  # Keras 3.15's broadcasts


def _peak(layer, x):
    return run_with_peak(tf.function(lambda: _step(layer, x)), warm=True)[1]


def test_the_step_no_longer_holds_a_weight_gradient_per_row():
    # batch 64 of (8, 256) through a 256 x 256 projection: Keras's gradient holds
    # 64 x 256 x 256 float32 (16 MiB) before summing them; the input is 0.5 MiB
    layer = keras.layers.EinsumDense("btd,dnh->btnh", output_shape=(None, 8, 32))
    x = tf.random.normal((64, 8, 256))
    ours = _peak(layer, x)
    theirs = _under_keras_einsum(lambda: _peak(layer, x))
    print(f"EinsumDense step peak: Keras's einsum {theirs / 2**20:.1f} MiB, tensordot {ours / 2**20:.1f} MiB")
    assert theirs >= 16 * 2**20 and ours < 4 * 2**20, (theirs, ours)


@pytest.mark.parametrize("equation, operands", [
    ("abc,acd->abd", [(2, 3, 4), (2, 4, 5)]),  # an index in both operands and the output: batched
    ("ab,bc->ac", [(3, 4), (4, 5)]),  # a 2-D input: Keras's matmul has no broadcast
    ("aab,bc->ac", [(3, 3, 4), (4, 5)]),  # a repeated index
    ("...b,bc->...c", [(2, 3, 4), (4, 5)]),
    ("abc,cd,de->abe", [(2, 3, 4), (4, 5), (5, 6)]),
])
def test_other_einsums_are_keras_own(equation, operands):
    tensors = [tf.random.normal(shape, seed=i) for i, shape in enumerate(operands)]
    if len(tensors) == 2 and "..." not in equation:
        assert _einsum._layout(equation, *tensors) is None
    expected = _einsum._keras_einsum(equation, *tensors)
    np.testing.assert_array_equal(keras.ops.einsum(equation, *tensors), expected)


def test_sparse_operands_are_keras_own(monkeypatch):
    x = tf.sparse.from_dense(tf.eye(4, batch_shape=[2]))  # (2, 4, 4)
    w = tf.ones((4, 3))
    seen = []
    monkeypatch.setattr(_einsum, "_keras_einsum", lambda *args, **kwargs: seen.append(args) or "keras's")
    assert _einsum.einsum("abc,cd->abd", x, w) == "keras's" and seen[0][1] is x


def test_integer_operands_are_keras_own():
    x, w = tf.ones((2, 3, 4), tf.int8), tf.ones((4, 5), tf.int8)
    result = keras.ops.einsum("abc,cd->abd", x, w)
    assert result.dtype == tf.int32  # Keras's int8 x int8 -> int32
    np.testing.assert_array_equal(result, np.full((2, 3, 5), 4))


@pytest.mark.slow  # a child process
def test_the_environment_variable_leaves_keras_einsum():
    code = ("import kvram\nfrom keras.src.backend.tensorflow import numpy as t\n"
            "print(t.einsum is kvram._einsum.einsum)")
    for value, expected in (("0", "False"), ("1", "True")):
        env = {**os.environ, kvram.speed.TENSORDOT_ENV: value, "TF_CPP_MIN_LOG_LEVEL": "3"}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip().splitlines()[-1] == expected
