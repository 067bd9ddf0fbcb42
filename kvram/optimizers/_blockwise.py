"""Block-wise dynamic 8-bit quantization of optimizer state (the scheme of bitsandbytes' 8-bit
optimizers, Dettmers et al. 2022, "8-bit Optimizers via Block-wise Quantization").

A tensor is flattened, padded to whole blocks of `block_size` values, and each block is stored
as one float32 scale (its largest magnitude) and one byte per value: the index of the value's
magnitude, relative to the scale, in a *dynamic* map whose codes are spread over seven decades
(1e-7 .. 1) with more codes in the higher decades (2**d bins in decade d, uniform within it),
so that small moments keep their relative precision. Signed tensors (first moments) spend one
code on the sign; non-negative ones (second moments) use all 256 for the magnitude.

Encoding is analytic (the decade from log10, the bin within it): a value's round trip errs by at
most half its bin's width, 0.45 * 10**(d - 6) / 2**d of the block's scale in decade d (d = 0 .. 6
for 1e-7 .. 1 of it), which is a relative error of at most 4.5 / 2**d: 7% in the top decade, the
coarse low decades being where the moments matter least. A non-negative map's bins are half as
wide. Everything is TF ops that XLA compiles into the optimizer's step.
"""

import numpy as np
import tensorflow as tf

DECADES = 7  # magnitudes from 1e-7 to 1 of the block's scale; smaller ones are stored as 0


def _bins(signed: bool) -> list[int]:
    """How many codes each decade has, the smallest decade first."""
    return [2 ** d if signed else 2 ** (d + 1) for d in range(DECADES)]


def magnitudes(signed: bool) -> np.ndarray:
    """The magnitude of each code, 1 .. 127 (signed) or 1 .. 254, ascending; code 0 is 0.

    Decade d holds the centres of 2**d (signed) or 2**(d+1) equal bins of [0.1, 1] * 10**(d-6).
    A non-negative map's last code, 255, is 1.0 exactly (the block's own largest value)."""
    values = [0.0]
    for d, n in enumerate(_bins(signed)):
        edges = np.linspace(0.1, 1.0, n + 1)
        values += list(10.0 ** (d - DECADES + 1) * (edges[:-1] + edges[1:]) / 2)
    if not signed:
        values.append(1.0)
    return np.asarray(values, np.float32)


def _table(signed: bool) -> np.ndarray:
    """The value of each stored int8 byte b, at index b + 128."""
    mags = magnitudes(signed)
    if signed:  # byte b: sign(b) * mags[|b|], b in -127 .. 127; -128 is unused (read as -mags[127])
        codes = np.arange(-128, 128)
        return (np.sign(codes) * mags[np.minimum(np.abs(codes), len(mags) - 1)]).astype(np.float32)
    return mags  # byte b: mags[b + 128], b in -128 .. 127


def padded_size(size: int, block_size: int) -> int:
    return -(-size // block_size) * block_size


def _encode_magnitude(a, signed: bool):
    """The code (1-based magnitude index, 0 for zero) of magnitudes `a` in [0, 1], as int32."""
    bins = _bins(signed)
    decade = tf.clip_by_value(tf.floor(tf.math.log(tf.maximum(a, 1e-30)) / np.log(10.0)) + DECADES, 0, DECADES - 1)
    n = tf.pow(2.0, decade + (0.0 if signed else 1.0))  # the decade's bins
    offset = n - (1.0 if signed else 2.0)  # the codes of the decades below: sum of 2**k (or 2**(k+1))
    within = a / tf.pow(10.0, decade - DECADES + 1)  # in [0.1, 1) for a inside the decade
    position = tf.clip_by_value(tf.floor((within - 0.1) / 0.9 * n), 0.0, n - 1.0)
    code = tf.cast(offset + position, tf.int32) + 1
    code = tf.where(a < 10.0 ** -DECADES, 0, code)
    if not signed:  # the block's largest value itself: exactly 1.0
        code = tf.where(a >= 1.0, sum(bins) + 1, code)
    return code


def quantize(x, block_size: int, signed: bool):
    """(bytes, scales) of float tensor `x`: int8 of shape [blocks, block_size], float32 [blocks]."""
    flat = tf.reshape(tf.cast(x, tf.float32), [-1])
    size = flat.shape[0]
    flat = tf.pad(flat, [[0, padded_size(size, block_size) - size]])
    blocks = tf.reshape(flat, [-1, block_size])
    scales = tf.reduce_max(tf.abs(blocks), axis=1)
    relative = blocks / tf.where(scales > 0, scales, 1.0)[:, None]
    code = _encode_magnitude(tf.abs(relative), signed)
    if signed:
        code = tf.where(relative < 0, -code, code)
    else:
        code = code - 128
    return tf.cast(code, tf.int8), scales


def dequantize(codes, scales, shape, signed: bool):
    """The float32 tensor of `shape` that `quantize` stored as (codes, scales)."""
    table = tf.constant(_table(signed))
    values = tf.gather(table, tf.cast(codes, tf.int32) + 128) * scales[:, None]
    size = int(np.prod(shape)) if len(shape) else 1
    return tf.reshape(tf.reshape(values, [-1])[:size], shape)
