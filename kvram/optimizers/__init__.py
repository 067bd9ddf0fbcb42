"""Optimizers whose state takes less memory than Keras's own.

`AdamW8bit`: Keras's `AdamW` with its moments stored in 8 bits per value (block-wise dynamic
quantization): 0.25x the optimizer state of `AdamW`.
`HostOffload`: any optimizer run on the host, its state and float32 master weights in host memory.
`ShardedState`: any optimizer's state split across the replicas of a `tf.distribute` strategy.
"""

from kvram.optimizers._adamw8bit import AdamW8bit
from kvram.optimizers._host import HostOffload
from kvram.optimizers._sharded import ShardedState

__all__ = ["AdamW8bit", "HostOffload", "ShardedState"]
