"""kvram layers."""

from kvram.layers.attention import MemoryEfficientAttention
from kvram.layers.checkpoint import Checkpoint

__all__ = [
    "Checkpoint",
    "MemoryEfficientAttention",
]
