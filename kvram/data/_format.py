"""The shard format's names, and `ShardError`: a leaf the writer, the reader and
the verifier all import (it imports nothing of kvram's).

Format (a directory):

- one `.npy` file per field per shard, named `{field}-{shard:05d}.npy`;
- `index.json`: `{"format": "kvram-shards", "version": 1, "samples": N,
  "fields": {name: {"dtype": "<f4", "shape": [...per-sample...]}},
  "shards": [{"samples": n, "files": {name: {"name": ..., "bytes": ...,
  "sha256": ... or null, "xxh3_128": ... (optional), "chunks": {"rows": R,
  "xxh3_64": base64 of one little-endian uint64 per R rows of the payload}
  (optional)}}}]}`. The SHA-256 is for `verify()` (a full, cryptographic
  check); the chunks' XXH3-64 for the check of each read as it reads
  (`_verify.ChunkCheck`), the XXH3-128 for the check of memory-mapped reads
  and where an index has no chunks. Readers of version 1 ignore keys they do
  not know, so directories with chunks still open in kvram before them.

No pickle anywhere (`allow_pickle=False`); file names in the index are plain
names inside the directory.
"""

from __future__ import annotations

import contextlib
import threading

import numpy as np
import tensorflow as tf


FORMAT = "kvram-shards"
"""The `format` field of a shard directory's index.json: what marks a directory as kvram's."""


VERSION = 1
"""The `version` field of the index.json kvram writes; kvram reads this version only."""


INDEX = "index.json"


class ShardError(ValueError):
    """A shard directory that does not match its index. `path` names the file.

    Raised as it is by `ShardedDataset` itself (opening, `read`, `verify`) and
    by `kvram.Model`'s `fit`, `evaluate` and `predict`. A batch read inside
    `tf.data` reaches the loop that iterates it as TensorFlow's
    `InvalidArgumentError` wrapping this error; `raise_shard_errors()` turns it
    back into the `ShardError` (for plain Keras models and your own loops).
    """

    def __init__(self, path: str, message: str):
        super().__init__(f"{path}: {message}")
        self.path = path
        self.reason = message
        with _RAISED_LOCK:
            _RAISED[str(self)] = (path, message)
            while len(_RAISED) > 64:
                _RAISED.pop(next(iter(_RAISED)))


# The shard errors made in this process, by message: what a TensorFlow error's
# message is searched for (tf.data keeps only the text of an error raised in a
# numpy_function).
_RAISED: dict = {}


_RAISED_LOCK = threading.Lock()


def shard_error_in(error: BaseException) -> "ShardError | None":
    """The `ShardError` behind a TensorFlow error raised while reading shards
    inside `tf.data`, or None when it has none."""
    text = str(error)
    with _RAISED_LOCK:
        found = [value for message, value in _RAISED.items() if message in text]
    if not found:
        return None
    path, message = found[-1]
    return ShardError(path, message)


@contextlib.contextmanager
def raise_shard_errors():
    """Inside it, a TensorFlow error that a shard's failed check caused while
    `tf.data` read a batch is raised as that `ShardError` (the TensorFlow
    error as its `__cause__`); other errors pass unchanged. `kvram.Model`'s
    `fit`, `evaluate` and `predict` run inside it already.

    Example:
        with kvram.data.raise_shard_errors():
            for x, y in dataset.to_tf_dataset(256):
                ...
    """
    try:
        yield
    except tf.errors.OpError as error:
        found = shard_error_in(error)
        if found is None:
            raise
        raise found from error


def _dtype_str(dtype) -> str:
    dtype = np.dtype(dtype)
    if dtype.hasobject or dtype.fields is not None or dtype.kind in "OV":
        raise TypeError(
            f"Shards hold plain numeric or boolean arrays. Received: dtype={dtype} "
            "(objects and structured dtypes would need pickle)"
        )
    return dtype.str
