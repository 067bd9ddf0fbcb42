"""Callbacks for `fit()`: memory-aware micro-batching that survives out-of-memory
errors, a search for the largest micro-batch, and a per-step memory log."""

from kvram.callbacks._adaptive import AdaptiveBatchSize, BatchEvent, rungs  # noqa: F401 (records, the ladder)
from kvram.callbacks._finder import BatchSizeSearch, find_max_batch_size
from kvram.callbacks._memory_logger import MemoryLogger

__all__ = ["AdaptiveBatchSize", "MemoryLogger", "find_max_batch_size", "BatchSizeSearch"]
