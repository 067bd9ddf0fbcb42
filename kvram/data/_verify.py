"""Checking shard files against the checksums in their index the first time a
process reads them (private; `kvram.data.ShardedDataset` uses it).

The check uses the file's XXH3-128 (`xxhash`, ~30 GB/s a core) when the index
has one, else its SHA-256 (~1.7 GB/s a core; directories written without
`xxhash` installed, or by kvram before it stored XXH3).

A reader asks `ShardVerifier.ensure(shard)` before it touches a shard's bytes:
the call returns at once when the shard's files were checked already (in this
process, unchanged on disk since), waits when a background thread is checking
them, and otherwise checks them itself. Background threads check the shards
that the reader will need next, in the order it will need them, at most
`lookahead` shards ahead of the furthest shard read so far: a sequential
reader then finds each shard checked, and its pages in the page cache, when it
gets there, and a dataset larger than RAM is not streamed through the page
cache ahead of its reader. Both hashes release the GIL while they hash, so the
threads run beside TensorFlow's own.

A mismatch is raised, as a `ShardError` naming the file and its samples, by the
read of that shard and by every later read of the dataset (the first error
found stops the reading early, not after an epoch of training).
"""

from __future__ import annotations

import functools
import hashlib
import mmap
import os
import threading

_CHUNK = 8 * 2**20
_NAMES = {"sha256": "SHA-256", "xxh3_128": "XXH3-128"}

# Files checked in this process: (device, inode, size, mtime_ns, sha256).
# A file rewritten since has another key, and is checked again.
_checked: set = set()
_checked_lock = threading.Lock()


def forget_checked() -> None:
    """Forgets which files this process has checked (for benchmarks and tests)."""
    with _checked_lock:
        _checked.clear()


def sha256(path: str, progress=None) -> str:
    """The SHA-256 of a file (hex)."""
    return _digest(path, [hashlib.sha256()], progress)[0]


def xxh3_128(path: str, progress=None) -> str:
    """The XXH3-128 of a file (hex): ~30 GB/s a core against SHA-256's ~1.7, so
    that checking shards as they are first read costs little."""
    import xxhash

    return _digest(path, [xxhash.xxh3_128()], progress)[0]


@functools.lru_cache(maxsize=1)
def have_xxhash() -> bool:
    try:
        import xxhash  # noqa: F401
    except ImportError:
        return False
    return True


def file_digests(path: str) -> dict:
    """{"sha256": ..., "xxh3_128": ...} of a file (xxh3_128 only with xxhash),
    from one read of it."""
    kinds = {"sha256": hashlib.sha256()}
    if have_xxhash():
        import xxhash

        kinds["xxh3_128"] = xxhash.xxh3_128()
    return dict(zip(kinds, _digest(path, list(kinds.values()))))


def _digest(path: str, digests: list, progress=None) -> list:
    """Feeds a file to each of `digests` through a read-only memory map, in
    chunks (no copy into Python buffers; hashlib and xxhash release the GIL
    meanwhile); their hex digests."""
    with open(path, "rb") as handle:
        size = os.fstat(handle.fileno()).st_size
        if size:
            with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
                with memoryview(mapped) as view:
                    for offset in range(0, size, _CHUNK):
                        with view[offset : offset + _CHUNK] as chunk:
                            for digest in digests:
                                digest.update(chunk)
                        if progress is not None:
                            progress(min(_CHUNK, size - offset))
    return [digest.hexdigest() for digest in digests]


def _key(path: str, expected: str):
    stat = os.stat(path)
    return (stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns, expected)


class ShardVerifier:
    """Checks each shard of one `ShardedDataset` once per process (see module doc).

    Args:
        shards: the dataset's `_Shard`s; each has `files` = [(path, (kind, digest
            or None))] with kind "xxh3_128" or "sha256", `start` and `samples`.
        error: `error(path, message)` builds the exception to raise (a `ShardError`).
        threads: background threads (0: the reader checks every shard itself).
        lookahead: shards the background threads may check ahead of the reader.
    """

    def __init__(self, shards, error, threads: int, lookahead: int):
        self._shards = list(shards)
        self._error_type = error
        self._threads = threads
        self._lookahead = lookahead
        self._condition = threading.Condition()
        self._locks = [threading.Lock() for _ in self._shards]
        self._done = [not any(expected for _, (_, expected) in s.files) for s in self._shards]
        self._order: list[int] = []
        self._position: dict[int, int] = {}
        self._frontier = -1
        self._next = 0
        self._started = False
        self.error: Exception | None = None

    def ensure(self, number: int) -> None:
        """Returns once shard `number` is checked; raises the first error found."""
        if self.error is not None:
            raise self.error
        if self._done[number]:
            return
        self._advance(number)
        with self._locks[number]:  # waits here while a background thread checks it
            if not self._done[number] and self.error is None:
                self._check(number)
        if self.error is not None:
            raise self.error

    @property
    def started(self) -> bool:
        return self._started

    def start(self, order) -> None:
        """Starts the background threads, which check shards in `order` (the
        order of their first read); a no-op after the first call."""
        with self._condition:
            if self._started:
                return
            self._started = True
            if self._threads == 0 or all(self._done):
                return
            self._order = [int(n) for n in order]
            self._position = {n: i for i, n in enumerate(self._order)}
        for _ in range(self._threads):
            threading.Thread(target=self._work, name="kvram-shard-check", daemon=True).start()

    # --------------------------------------------------------------------------
    def _advance(self, number: int) -> None:
        position = self._position.get(number)
        if position is None:
            return
        with self._condition:
            if position + self._lookahead > self._frontier:
                self._frontier = position + self._lookahead
                self._condition.notify_all()

    def _work(self) -> None:
        while True:
            with self._condition:
                while True:
                    if self.error is not None or self._next >= len(self._order):
                        return
                    if self._next <= self._frontier:
                        number = self._order[self._next]
                        self._next += 1
                        break
                    self._condition.wait()
            if self._done[number] or not self._locks[number].acquire(blocking=False):
                continue  # checked, or being checked by a reader
            try:
                if not self._done[number]:
                    self._check(number)
            finally:
                self._locks[number].release()

    def _check(self, number: int) -> None:
        """Checks one shard's files (the caller holds its lock)."""
        shard = self._shards[number]
        try:
            for path, (kind, expected) in shard.files:
                if not expected:
                    continue
                key = _key(path, expected)
                with _checked_lock:
                    if key in _checked:
                        continue
                actual = (xxh3_128 if kind == "xxh3_128" else sha256)(path)
                if actual != expected:
                    raise self._error_type(
                        path,
                        f"checksum mismatch: {_NAMES[kind]} {actual}, index.json says {expected}. "
                        f"Samples {shard.start} to {shard.start + shard.samples - 1} "
                        f"(shard {number}) are corrupt and were not read. Restore the "
                        "file or write the shards again.",
                    )
                with _checked_lock:
                    _checked.add(key)
        except OSError as error:
            self.error = self._error_type(
                _failing_path(shard, error),
                f"cannot be read ({error.strerror or error}); was it deleted or moved "
                f"after the dataset was opened? Samples {shard.start} to "
                f"{shard.start + shard.samples - 1} (shard {number}).",
            )
        except Exception as error:  # noqa: BLE001 - kept, raised by every later read
            self.error = error
        else:
            self._done[number] = True
        finally:
            if self.error is not None:
                with self._condition:
                    self._condition.notify_all()


def _failing_path(shard, error: OSError) -> str:
    return error.filename if isinstance(error.filename, str) else shard.files[0][0]
