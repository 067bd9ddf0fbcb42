"""Keras's TensorFlow `einsum` for a tensor times a weight as one 2-D matmul.

`EinsumDense` (Keras's `MultiHeadAttention` projections, KerasHub's) calls
`keras.ops.einsum`, which on TensorFlow computes `btd,dnh->btnh` and the like as
`tf.matmul` of the (B, T, D) input with the weight reshaped to 2-D: a
`BatchMatMulV2` that broadcasts the weight over B. Its gradient for the weight
is a batched product of B (D, N) matrices, then summed over B
(`tensorflow/python/ops/math_grad.py`). XLA keeps both: ViT-B/16 at batch 256
on an H200 wrote and read 256 x 768 x 768 per projection, 48 a step, 10.1 ms of
its 85.7 (benchmarks/results/profile_vit_hlo_h200.json). Keras fixed the same
for `Dense` by `tf.tensordot` (keras-team/keras#22823, #22832); `einsum` kept
the batched path (Keras 3.15.1).

`install()` (`kvram.speed.tensordot_einsum`, done by `import kvram`) routes
such einsums through `tf.tensordot` instead: the input
reshaped to 2-D, one matmul, so the weight's gradient is one GEMM over B x T
rows. Values equal Keras's up to float summation order. Only two float operands
of one dtype, dense, whose first has rank >= 3, no index shared by both
operands and the output (no batch index), no index repeated, and no other
arguments take this path; everything else is Keras's own `einsum`.
"""

from __future__ import annotations

import tensorflow as tf
from keras.src.backend.tensorflow import numpy as tf_numpy

_keras_einsum = tf_numpy.einsum


def _layout(subscripts: str, x, w):
    """(x axes, w axes, permutation) contracting `x` with `w` as `subscripts`
    says, or None where this path does not apply."""
    if "..." in subscripts or "->" not in subscripts:
        return None
    inputs, out = subscripts.replace(" ", "").split("->")
    parts = inputs.split(",")
    if len(parts) != 2:
        return None
    xs, ws = parts
    if len(set(xs)) != len(xs) or len(set(ws)) != len(ws) or len(set(out)) != len(out):
        return None
    if len(xs) != x.shape.rank or len(ws) != w.shape.rank or len(xs) < 3:
        return None
    contracted = [c for c in xs if c in ws and c not in out]
    if any(c in ws and c in out for c in xs) or set(out) != (set(xs) | set(ws)) - set(contracted):
        return None
    produced = [c for c in xs if c not in contracted] + [c for c in ws if c not in contracted]
    return [xs.index(c) for c in contracted], [ws.index(c) for c in contracted], [produced.index(c) for c in out]


def einsum(subscripts, *operands, **kwargs):
    """`keras.src.backend.tensorflow.numpy.einsum`, with a tensor times a
    weight as `tf.tensordot` (module docstring)."""
    dense = not any(isinstance(o, (tf.SparseTensor, tf.RaggedTensor, tf.IndexedSlices)) for o in operands)
    if len(operands) == 2 and not kwargs and dense:
        x, w = (tf.convert_to_tensor(o) for o in operands)
        layout = _layout(subscripts, x, w) if x.dtype == w.dtype and x.dtype.is_floating else None
        if layout is not None:
            x_axes, w_axes, order = layout
            result = tf.tensordot(x, w, axes=[x_axes, w_axes])
            return result if order == sorted(order) else tf.transpose(result, order)
    return _keras_einsum(subscripts, *operands, **kwargs)


def install() -> bool:
    """Makes Keras's TensorFlow backend use `einsum` above; True where it was
    not already."""
    if tf_numpy.einsum is einsum:
        return False
    tf_numpy.einsum = einsum
    return True


def uninstall() -> bool:
    """Gives Keras its own `einsum` back; True where kvram's was installed."""
    if tf_numpy.einsum is not einsum:
        return False
    tf_numpy.einsum = _keras_einsum
    return True
