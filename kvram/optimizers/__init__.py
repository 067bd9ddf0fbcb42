"""Optimizers whose state takes less memory than Keras's own.

`AdamW8bit`: Keras's `AdamW` with its moments stored in 8 bits per value (block-wise dynamic
quantization): 0.25x the optimizer state of `AdamW`.
"""

from kvram.optimizers._adamw8bit import AdamW8bit

__all__ = ["AdamW8bit"]
