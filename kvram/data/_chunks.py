"""Checking chunks ahead of the reader (private; `ShardedDataset.to_tf_dataset`
uses it for shards with chunk digests).

A read checks the chunks (`_verify.CHUNK_BYTES`) it reads that no check has
passed yet, hashing what it has just read (`Shard._check_chunks`). So that the
reader seldom hashes at all, background threads check, in the order the epoch
will read them, the chunks of the next few batches: each thread takes the next
batch, reads its chunks from the file into a buffer of its own (`os.preadv`:
no page of a memory map faulted in) and hashes them, at most `lookahead`
batches (and about `_AHEAD_BYTES`) ahead of the furthest batch read. The
reader then finds its chunks checked, and their bytes in the CPU's cache.

A mismatch found by a thread is kept as the dataset's error: the next read
raises it (a chunk that failed is never marked checked, so its samples are
never handed out).
"""

from __future__ import annotations

import threading

import numpy as np

# How far ahead of the reader the threads check, in bytes of batches.
_AHEAD_BYTES = 64 * 2**20


class ChunkChecker:
    """Background checks of the chunks of batches 0, 1, ... (see module doc).

    Args:
        dataset: the `ShardedDataset`.
        names: the fields read.
        ranges: `ranges(k)`, the (first, stop) sample ranges batch k reads.
        batches: batches in the epoch.
        threads: background threads (0: none; reads check their own chunks).
    """

    def __init__(self, dataset, names, ranges, batches: int, threads: int):
        self._dataset, self._names, self._ranges, self._batches = dataset, list(names), ranges, batches
        self._threads = threads
        row_bytes = sum(int(np.prod(dataset.fields[n][1], dtype=np.int64)) * dataset.fields[n][0].itemsize
                        for n in self._names)
        batch_bytes = max(1, row_bytes * max(1, len(dataset) // max(batches, 1)))
        self._lookahead = max(2, _AHEAD_BYTES // batch_bytes)
        self._condition = threading.Condition()
        self._frontier = self._lookahead - 1
        self._next = 0

    def start(self) -> None:
        for _ in range(self._threads):
            threading.Thread(target=self._work, name="kvram-chunk-check", daemon=True).start()

    def reached(self, number: int) -> None:
        """The reader reads batch `number`: the threads may check up to
        `lookahead` batches past it."""
        if number + self._lookahead > self._frontier:
            with self._condition:
                if number + self._lookahead > self._frontier:
                    self._frontier = number + self._lookahead
                    self._condition.notify_all()

    def _work(self) -> None:
        scratch: dict = {}
        verifier = self._dataset._verifier
        while True:
            with self._condition:
                while self._next <= self._batches - 1 and self._next > self._frontier and verifier.error is None:
                    self._condition.wait()
                if self._next >= self._batches or verifier.error is not None:
                    return
                number = self._next
                self._next += 1
            try:
                for first, stop in self._ranges(number):
                    self._dataset._check_chunks_ahead(first, stop, self._names, scratch)
            except Exception as error:  # noqa: BLE001 - kept: the next read raises it
                if verifier.error is None:
                    verifier.error = error
                return
