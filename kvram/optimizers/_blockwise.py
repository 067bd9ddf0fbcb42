"""Block-wise 8-bit quantization of optimizer state (after bitsandbytes' 8-bit optimizers,
Dettmers et al. 2022, "8-bit Optimizers via Block-wise Quantization").

A tensor is flattened, padded to whole blocks of `block_size` values, and each block is stored
as one float32 scale (its largest magnitude) and one byte per value, the nearest of 256 codes
relative to the scale:

- **Signed tensors (first moments): a logarithmic map.** One code is the sign; the 127 magnitudes
  are spaced evenly in log10 over `SIGNED_DECADES` (5) decades below the scale, 1.0 the largest:
  every value from 1e-5 of its block's scale up errs by at most 4.6% of itself (half a step of
  10**(5/127)). Adam divides each first moment by its own second moment's root, so a small one
  matters as much as a large one: a map with coarse low decades (bitsandbytes' dynamic map) errs
  by up to 28% on values 1e-3 of the scale.
- **Non-negative tensors (the root of second moments): bitsandbytes' dynamic map.** 255 codes
  over seven decades (1e-7 .. 1), 2**(d+1) bins in decade d, uniform within it, and 1.0 exact: a
  value's round trip errs by at most half its bin, 0.45 * 10**(d - 6) / 2**(d+1) of the scale.

Values below a map's smallest code (half of it, for the logarithmic map) are stored as 0.
Everything is TF ops that XLA compiles into the optimizer's step.
"""

import numpy as np
import tensorflow as tf

DECADES = 7  # the dynamic (non-negative) map: magnitudes from 1e-7 to 1 of the block's scale
SIGNED_DECADES = 5  # the logarithmic (signed) map: from 10**(-5 + 5/127) to 1
SIGNED_CODES = 127


def _bins() -> list[int]:
    """How many codes each decade of the dynamic map has, the smallest decade first."""
    return [2 ** (d + 1) for d in range(DECADES)]


def magnitudes(signed: bool) -> np.ndarray:
    """The magnitude of each code, ascending; code 0 is 0.

    Signed: codes 1 .. 127 are 10**(5 * (k / 127 - 1)), the last 1.0. Non-negative: decade d holds
    the centres of 2**(d+1) equal bins of [0.1, 1] * 10**(d-6), codes 1 .. 254, and code 255 is
    1.0 exactly (the block's own largest value)."""
    if signed:
        k = np.arange(1, SIGNED_CODES + 1)
        return np.concatenate([[0.0], 10.0 ** (SIGNED_DECADES * (k / SIGNED_CODES - 1))]).astype(np.float32)
    values = [0.0]
    for d, n in enumerate(_bins()):
        edges = np.linspace(0.1, 1.0, n + 1)
        values += list(10.0 ** (d - DECADES + 1) * (edges[:-1] + edges[1:]) / 2)
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


def _decade_bounds() -> list:
    """The least float32 at or above 10**(d - DECADES), for d = 1 .. DECADES - 1: where the dynamic
    map's decades begin (float32(0.01) is 0.0099999998, under 0.01: still the decade below)."""
    bounds = []
    for d in range(1, DECADES):
        bound = np.float32(10.0 ** (d - DECADES))
        bounds.append(bound if float(bound) >= 10.0 ** (d - DECADES) else np.nextafter(bound, np.float32(1)))
    return bounds


def _encode_magnitude(a, signed: bool):
    """The code (1-based magnitude index, 0 for zero) of magnitudes `a` in [0, 1], as int32."""
    if signed:  # the nearest code in log10; below half the smallest code, 0
        position = (tf.math.log(tf.maximum(a, 1e-30)) / np.log(10.0) / SIGNED_DECADES + 1) * SIGNED_CODES
        code = tf.cast(tf.clip_by_value(tf.round(position), 1, SIGNED_CODES), tf.int32)
        return tf.where(a < 0.5 * float(magnitudes(True)[1]), 0, code)
    bins = _bins()
    # The decade by comparisons with its float32 bounds, and its bins and unit by selects: no log
    # (float32's log put values just under a bound, 0.009999997, in the decade above: a coarser
    # bin) and no gathers from 7-value tables: on 2 cores, AdamW8bit's XLA update of 16.8M
    # parameters on the host took 49.1 ms so, 57.7 ms with them, one run after the other
    # (benchmarks/optimizers/host_update.py). Not tf.pow either: XLA's pow of a float exponent
    # made quantizing 16.8M second moments take 95 ms of a 155 ms host update.
    decade = tf.zeros_like(a, tf.int32)  # NaN: decade 0, a valid index
    for bound in _decade_bounds():
        decade += tf.cast(a >= bound, tf.int32)
    n = tf.cast(tf.bitwise.left_shift(2, decade), tf.float32)  # the decade's bins, 2**(d+1)
    offset = n - 2.0  # the codes of the decades below: the sum of 2**(k+1)
    unit = tf.fill(tf.shape(a), np.float32(10.0 ** (1 - DECADES)))
    for d in range(1, DECADES):
        unit = tf.where(decade == d, np.float32(10.0 ** (d - DECADES + 1)), unit)
    position = tf.clip_by_value(tf.floor((a / unit - 0.1) / 0.9 * n), 0.0, n - 1.0)
    code = tf.cast(offset + position, tf.int32) + 1
    code = tf.where(a < 10.0 ** -DECADES, 0, code)
    return tf.where(a >= 1.0, sum(bins) + 1, code)  # the block's largest value itself: exactly 1.0


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
