"""Shared test helpers."""

import numpy as np
import tensorflow as tf


def max_rel_diff(a, b) -> float:
    """max |a-b| / max |a| over matching lists of tensors (0 when equal)."""
    worst = 0.0
    for x, y in zip(a, b):
        x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
        scale = max(np.max(np.abs(x)), 1e-12)
        worst = max(worst, float(np.max(np.abs(x - y)) / scale))
    return worst


def values(variables):
    return [np.array(tf.convert_to_tensor(v)) for v in variables]
