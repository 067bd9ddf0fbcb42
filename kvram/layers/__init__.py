"""kvram layers."""

from kvram.layers.checkpoint import Checkpoint

__all__ = [
    "Checkpoint",
]
