"""GELU and LayerNormalization that keep only their input for the backward pass.

Keras builds both from primitives, and automatic differentiation keeps what
the primitives' gradients read: for the exact GELU, the bf16 intermediates
of `0.5 * x * (1 + erf(x / sqrt(2)))` (886 MB a ViT-B block at batch 256 beside
its 328 MB input, 10.4 GiB over the 12 blocks at the peak of the XLA-compiled
step on an H200: benchmarks/results/vit_buffers_h200.json; the tanh
approximation's, 3.0 GiB over a GPT-2-medium-shaped decoder's 24 blocks at
batch 8: benchmarks/results/decoder_buffers_h200.json); for
LayerNormalization under mixed precision, float32 copies of its input and of
the normalised values (3.4 GiB there). These compute the same values (the
exact GELU of a 16-bit input in float32, as PyTorch does: `_exact_value`) and
keep the input (in its own dtype) and, for LayerNormalization, the per-row mean
and reciprocal deviation; the backward pass recomputes the rest, as PyTorch's
fused kernels do. The recomputation waits for the incoming gradient
(`_order.after`), or XLA would do it right after the forward pass and hold it.
"""

from __future__ import annotations

import math

import keras
import tensorflow as tf

from kvram._order import after
from kvram.layers._compiling import alone_in_xla


def _exact_value(x):
    """The exact GELU of a 16-bit `x` as PyTorch computes it, `x/2 (1 + erf(x/sqrt(2)))`
    in float32, rounded once. Keras's (`0.5 * x * erfc(-x / sqrt(2))`, its scalings in
    x's dtype) cost XLA 389 us a ViT-B block at batch 256 on an H200, `erfc` being
    evaluated by two rational approximations and a select
    (benchmarks/results/profile_vit_hlo_h200.json, `loop_multiply_fusion.12`)."""
    x32 = tf.cast(x, tf.float32)
    return tf.cast(0.5 * x32 * (1.0 + tf.math.erf(x32 * (1.0 / math.sqrt(2.0)))), x.dtype)


def _keeping_input(x, value, slope):
    """`value(x)`, keeping only `x`: the backward pass computes `slope(x)` in
    float32 when the gradient arrives."""
    x = tf.convert_to_tensor(x)

    @tf.custom_gradient
    def activation(x):
        def gradient(dy):
            x32 = tf.cast(x, tf.float32) + after(dy)
            return tf.cast(tf.cast(dy, tf.float32) * slope(x32), x.dtype)

        return value(x), gradient

    return activation(x)


def _gelu_value(x, approximate):
    """`keras.activations.gelu(x, approximate)`; the exact GELU of a 16-bit `x` as PyTorch computes it."""
    if not approximate and x.dtype.size == 2:
        return _exact_value(x)
    return keras.activations.gelu(x, approximate=approximate)


def _exact_slope(x):
    cdf = 0.5 * (1.0 + tf.math.erf(x * (1.0 / math.sqrt(2.0))))
    pdf = tf.exp(-0.5 * tf.square(x)) * (1.0 / math.sqrt(2.0 * math.pi))
    return cdf + x * pdf


def _tanh_slope(x):
    c = math.sqrt(2.0 / math.pi)
    tanh = tf.tanh(c * (x + 0.044715 * x * x * x))
    return 0.5 * (1.0 + tanh) + 0.5 * x * (1.0 - tanh * tanh) * c * (1.0 + 3 * 0.044715 * x * x)


@keras.saving.register_keras_serializable(package="kvram")
def lean_gelu(x):
    """The exact GELU, `keras.activations.gelu(x)`, keeping only `x` for the
    gradient."""
    return _keeping_input(x, lambda x: _gelu_value(x, False), _exact_slope)


@keras.saving.register_keras_serializable(package="kvram")
def lean_gelu_approximate(x):
    """The tanh approximation of GELU, `keras.activations.gelu(x,
    approximate=True)` (KerasHub's GPT-2 and others), keeping only `x` for the
    gradient."""
    return _keeping_input(x, lambda x: _gelu_value(x, True), _tanh_slope)


def lean_layer_norm(x, gamma, beta, epsilon):
    """LayerNormalization over the last axis (float32 statistics, output in
    `x`'s dtype), keeping `x`, the mean and the reciprocal deviation."""
    x = tf.convert_to_tensor(x)
    axes = list(range(x.shape.rank - 1))

    def forward(x, gamma, beta):
        x32 = tf.cast(x, tf.float32)
        mean = tf.reduce_mean(x32, axis=-1, keepdims=True)
        rstd = tf.math.rsqrt(tf.reduce_mean(tf.square(x32 - mean), axis=-1, keepdims=True) + epsilon)
        y = (x32 - mean) * rstd * tf.cast(gamma, tf.float32) + tf.cast(beta, tf.float32)
        return tf.cast(y, x.dtype), mean, rstd

    def backward(x, gamma, beta, mean, rstd, dy):
        dy32 = tf.cast(dy, tf.float32)
        xhat = (tf.cast(x, tf.float32) + after(dy) - mean) * rstd
        d_gamma = tf.reduce_sum(dy32 * xhat, axis=axes)
        d_beta = tf.reduce_sum(dy32, axis=axes)
        g = dy32 * tf.cast(gamma, tf.float32)
        dx = rstd * (g - tf.reduce_mean(g, -1, keepdims=True) - xhat * tf.reduce_mean(g * xhat, -1, keepdims=True))
        return tf.cast(dx, x.dtype), tf.cast(d_gamma, gamma.dtype), tf.cast(d_beta, beta.dtype)

    forward, backward = _fused_outside_xla(x, forward, backward)

    @tf.custom_gradient
    def normalise(x, gamma, beta):
        y, mean, rstd = forward(x, gamma, beta)
        return y, lambda dy: backward(x, gamma, beta, mean, rstd, dy)

    return normalise(x, gamma, beta)


def _fused_outside_xla(x, *functions):
    """`functions`, each compiled with XLA by itself where `x` is traced outside XLA in a step whose
    parts compile one by one (`kvram.Model(host_offload=True)`: a decoder's final norm runs between
    its compiled blocks and its head). As TensorFlow ops the norms make float32 copies of their
    input and gradient, 1 GiB each at Llama-3-8B's final norm over 32 rows of 2048 tokens, more
    than a 24 GiB GPU had free in one piece there (compiled, that run trains:
    benchmarks/results/optimizers_offload_8b_32rows_h100.json). Elsewhere, as they are."""
    if not alone_in_xla(x):
        return functions
    return tuple(tf.function(f, jit_compile=True, autograph=False) for f in functions)


@keras.saving.register_keras_serializable(package="kvram")
class LeanLayerNormalization(keras.layers.LayerNormalization):
    """`keras.layers.LayerNormalization` computed by `lean_layer_norm` where it
    normalises the last axis with a scale and a centre and no RMS scaling;
    otherwise Keras's own computation. Same weights and configuration."""

    def _lean(self, rank) -> bool:
        axes = [self.axis] if isinstance(self.axis, int) else list(self.axis)
        return (
            not self.rms_scaling and self.scale and self.center
            and [a % rank for a in axes] == [rank - 1]
        )

    def call(self, inputs):
        if inputs.shape.rank is None or not self._lean(inputs.shape.rank):
            return super().call(inputs)
        outputs = lean_layer_norm(
            tf.cast(inputs, self.compute_dtype), self.gamma.value, self.beta.value, self.epsilon
        )
        return tf.cast(outputs, self.compute_dtype)


def lean_rms_norm(x, scale, epsilon, dtype):
    """RMS normalisation over the last axis as KerasHub's `LlamaLayerNorm`
    computes it (`x * rsqrt(mean(x²) + epsilon) * scale` in float32, rounded
    once to `dtype`), keeping `x` in its own dtype and the per-row reciprocal
    root mean square (float32) for the backward pass."""
    x = tf.convert_to_tensor(x)
    axes = list(range(x.shape.rank - 1))

    def forward(x, scale):
        x32 = tf.cast(x, tf.float32)
        rms = tf.math.rsqrt(tf.reduce_mean(tf.square(x32), axis=-1, keepdims=True) + epsilon)
        return tf.cast(x32 * rms * tf.cast(scale, tf.float32), dtype), rms

    def backward(x, scale, rms, dy):
        dy32 = tf.cast(dy, tf.float32)
        xhat = (tf.cast(x, tf.float32) + after(dy)) * rms
        d_scale = tf.reduce_sum(dy32 * xhat, axis=axes)
        g = dy32 * tf.cast(scale, tf.float32)
        dx = rms * (g - xhat * tf.reduce_mean(g * xhat, -1, keepdims=True))
        return tf.cast(dx, x.dtype), tf.cast(d_scale, scale.dtype)

    forward, backward = _fused_outside_xla(x, forward, backward)

    @tf.custom_gradient
    def normalise(x, scale):
        y, rms = forward(x, scale)
        return y, lambda dy: backward(x, scale, rms, dy)

    return normalise(x, tf.convert_to_tensor(scale))


def make_lean_rms_norm(layer) -> None:
    """Makes a KerasHub `LlamaLayerNorm` compute `lean_rms_norm`, in place: its
    class, weights and saved configuration stay (a saved model loads as
    KerasHub's own, computing the same values)."""

    def call(x):
        return lean_rms_norm(x, layer.scale.value, layer.epsilon, layer.compute_dtype)

    layer.call = call


def _silu_slope(x):
    sigmoid = tf.sigmoid(x)
    return sigmoid * (1.0 + x * (1.0 - sigmoid))


@keras.saving.register_keras_serializable(package="kvram")
def lean_silu(x):
    """SiLU, `x * sigmoid(x)`, computed in float32 and rounded once to `x`'s
    dtype (as KerasHub's Llama feedforward and PyTorch's `F.silu` compute a
    16-bit input), keeping only `x` for the gradient."""

    def value(x):
        x32 = tf.cast(x, tf.float32)
        return tf.cast(x32 * tf.sigmoid(x32), x.dtype)

    return _keeping_input(x, value, _silu_slope)
