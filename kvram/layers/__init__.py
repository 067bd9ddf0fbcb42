"""kvram layers."""

from kvram.layers.attention import MemoryEfficientAttention
from kvram.layers.batch_norm import FusedBatchNormalization
from kvram.layers.checkpoint import Checkpoint

__all__ = [
    "Checkpoint",
    "FusedBatchNormalization",
    "MemoryEfficientAttention",
]
