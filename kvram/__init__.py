"""kvram: train TensorFlow/Keras models that would not otherwise fit in GPU memory."""

import os as _os

_os.environ.setdefault("KERAS_BACKEND", "tensorflow")

from kvram import callbacks, data, layers, memory, parallel, precision, remat, speed  # noqa: E402
from kvram.model import Model  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "Model",
    "callbacks",
    "data",
    "parallel",
    "layers",
    "memory",
    "precision",
    "remat",
    "speed",
    "__version__",
]
