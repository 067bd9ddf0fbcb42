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

Chunk digests. `write_shards` also stores, for each file, the XXH3-64 of every
chunk of its payload: `chunk_rows(row_bytes)` rows, a power of two of at most
256 KiB (one row where a row is larger). The pread reader (`ChunkCheck.read`)
then checks only the chunks a read touches, as it reads them: it reads a piece
of at most 1 MiB, hashes its chunks while they are in the CPU's cache (~110-130
GB/s a core on the 2-core VM, against ~33 from memory; xxhash 4 releases the GIL
for inputs over 64 KiB, xxhash 3 did not for these one-shot calls)
and hands out nothing of a chunk that failed. A chunk that a read covers only
in part has its other rows read too, once (a bitmap per file remembers the
chunks this process checked), so reads in whole chunks cost no extra bytes:
batches and shuffled blocks whose rows are multiples of `chunk_rows` (powers
of two are). The background threads then have nothing to do for such files,
and the data is not read twice from the page cache on its first epoch. The
`.npy` header is not in any chunk: opening checks it (dtype, shape, order,
size). Memory-mapped reads (`read="memmap"`, `"view"`, `ShardedDataset.read`)
and indexes without chunk digests use the whole-file check above.

Both at once, where a dataset checks whole files on the background threads but
keeps the chunk digests for its pread reads (`ShardedDataset`'s default on
machines of more than 4 cores): a read asks `ShardVerifier.reached(shard)`,
which says without waiting whether the shard was checked whole; until it was,
the read checks the chunks it reads.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import math
import mmap
import os
import threading

import numpy as np

_CHUNK = 8 * 2**20  # bytes per read of a whole-file hash
CHUNK_BYTES = 256 * 2**10  # the most bytes of a chunk digest's rows (see the module doc)
_PIECE = 2**20  # the most bytes ChunkCheck.read reads in one call before hashing them
_NAMES = {"sha256": "SHA-256", "xxh3_128": "XXH3-128"}

# Files checked in this process: (device, inode, size, mtime_ns, digest).
# A file rewritten since has another key, and is checked again.
_checked: set = set()
# Chunks checked in this process: {(device, inode, size, mtime_ns, digests' SHA-256): bytearray, 1 a chunk checked}.
_checked_chunks: dict = {}
_checked_lock = threading.Lock()


def forget_checked() -> None:
    """Forgets which files and chunks this process has checked (for benchmarks
    and tests); datasets opened before keep what they knew."""
    with _checked_lock:
        _checked.clear()
        _checked_chunks.clear()


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


def file_digests(path: str, offset: int = 0, row_bytes: int = 0) -> dict:
    """{"sha256": ..., "xxh3_128": ..., "chunks": ...} of a file, from one read
    of it: xxh3_128 only with xxhash; "chunks" (`{"rows": rows per chunk,
    "xxh3_64": base64 of the chunks' XXH3-64s as little-endian uint64}`) only
    with xxhash and `row_bytes` > 0, for a payload of rows of `row_bytes`
    starting at byte `offset`. Each chunk is hashed right after the whole-file
    digests read it, while it is in the CPU's cache."""
    kinds = {"sha256": hashlib.sha256()}
    step = None
    if have_xxhash():
        import xxhash

        kinds["xxh3_128"] = xxhash.xxh3_128()
        if row_bytes > 0:
            step = chunk_rows(row_bytes) * row_bytes
    if step is None:
        return dict(zip(kinds, _digest(path, list(kinds.values()))))
    hexes, chunks = _digest(path, list(kinds.values()), chunks=(offset, step))
    found = dict(zip(kinds, hexes))
    found["chunks"] = {"rows": step // row_bytes, "xxh3_64": base64.b64encode(chunks.tobytes()).decode("ascii")}
    return found


def _digest(path: str, digests: list, progress=None, chunks=None):
    """Feeds a file to each of `digests` through a read-only memory map, in
    pieces (no copy into Python buffers; hashlib and xxhash release the GIL
    meanwhile); their hex digests. With `chunks` = (offset, step), the pieces
    are the bytes before `offset` and then `step` bytes at a time, and it
    returns (hex digests, the XXH3-64 of each piece from `offset` on, as
    little-endian uint64)."""
    with open(path, "rb") as handle:
        size = os.fstat(handle.fileno()).st_size
        if chunks is None:
            starts = range(0, size, _CHUNK)
        else:
            import xxhash

            offset, step = chunks
            starts = ([0] if offset else []) + list(range(offset, size, step))
            hashed = np.zeros(math.ceil((size - offset) / step), "<u8")
        if size:
            with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
                with memoryview(mapped) as view:
                    for start, stop in zip(starts, [*starts[1:], size]):
                        with view[start:stop] as piece:
                            for digest in digests:
                                digest.update(piece)
                            if chunks is not None and start >= offset:
                                hashed[(start - offset) // step] = xxhash.xxh3_64_intdigest(piece)
                        if progress is not None:
                            progress(stop - start)
    hexes = [digest.hexdigest() for digest in digests]
    return hexes if chunks is None else (hexes, hashed)


def chunk_rows(row_bytes: int) -> int:
    """Rows per chunk digest for rows of `row_bytes`: the largest power of two
    whose rows fit in CHUNK_BYTES, at least 1."""
    rows = 1
    while 2 * rows * row_bytes <= CHUNK_BYTES:
        rows *= 2
    return rows


class ChunkMismatch(Exception):
    """Raised by `ChunkCheck.read`: rows [first, stop) of the file are corrupt."""

    def __init__(self, first: int, stop: int, actual: int, expected: int):
        super().__init__(first, stop)
        self.first, self.stop, self.actual, self.expected = first, stop, actual, expected


class ChunkCheck:
    """One file's chunk digests, and which of its chunks this process has
    checked (shared by every dataset of the process opened on the file
    unchanged; see the module doc).

    Args:
        path: the file. offset: the byte its rows start at. row_bytes, samples:
            the rows' size and count. rows: rows per chunk. encoded: the index's
            base64 digests (decoded on the first read that needs them).
    """

    def __init__(self, path: str, offset: int, row_bytes: int, samples: int, rows: int, encoded: str):
        self.path, self.offset, self.row_bytes, self.samples, self.rows = path, offset, row_bytes, samples, rows
        self.count = math.ceil(samples / rows)
        self._encoded = encoded
        self._expected: list | None = None
        key = _key(path, hashlib.sha256(encoded.encode("ascii")).hexdigest())
        with _checked_lock:  # a byte per chunk, 1 once checked
            self.checked = _checked_chunks.setdefault(key, bytearray(self.count))
        # A chunk that two reads share (each reads part of it) is checked under
        # lock n % 8, so that it is hashed once; a chunk within one read is the
        # only read's of it in an epoch, and needs none.
        self._locks = [threading.Lock() for _ in range(8)]

    def expected(self) -> list:
        if self._expected is None:
            self._expected = np.frombuffer(base64.b64decode(self._encoded), "<u8").tolist()
        return self._expected

    def read(self, read, out, first: int) -> None:
        """Fills `out` (a byte memoryview of whole rows) with rows `first`... of
        the file by `read(view, position)`, checking every chunk they touch that
        was not checked yet; raises `ChunkMismatch` for the first that fails,
        before the call returns any of its rows. Reads at most _PIECE bytes at
        a time, and hashes them while they are in the CPU's cache."""
        import xxhash

        row_bytes, rows, checked = self.row_bytes, self.rows, self.checked
        stop = first + len(out) // row_bytes
        low, high = first // rows, (stop - 1) // rows
        if stop <= first or checked.find(0, low, high + 1) < 0:
            read(out, self.offset + first * row_bytes)
            return
        digest, expected = xxhash.xxh3_64_intdigest, self.expected()
        chunk_bytes = rows * row_bytes
        per_piece = max(1, _PIECE // chunk_bytes)
        for piece in range(low, high + 1, per_piece):
            last = min(high, piece + per_piece - 1)
            lo, hi = max(first, piece * rows), min(stop, (last + 1) * rows)
            read(out[(lo - first) * row_bytes : (hi - first) * row_bytes], self.offset + lo * row_bytes)
            for number in range(piece, last + 1):
                if checked[number]:
                    continue
                chunk_lo = number * rows
                if chunk_lo >= first and min(chunk_lo + rows, self.samples) <= stop:  # all in `out`
                    at = (chunk_lo - first) * row_bytes
                    actual = digest(out[at : at + chunk_bytes])
                    if actual != expected[number]:
                        raise ChunkMismatch(chunk_lo, min(chunk_lo + rows, self.samples), actual, expected[number])
                    checked[number] = 1
                    continue
                with self._locks[number % len(self._locks)]:
                    if not checked[number]:
                        self._check_shared(read, out, first, lo, hi, number, digest, expected[number])

    def _check_shared(self, read, out, first, lo, hi, number, digest, expected) -> None:
        """Checks chunk `number`, of which rows [lo, hi) are read into `out`
        (from row `first`); its other rows are read here, once."""
        row_bytes = self.row_bytes
        chunk_lo, chunk_hi = number * self.rows, min((number + 1) * self.rows, self.samples)
        a, b = max(lo, chunk_lo), min(hi, chunk_hi)
        whole = memoryview(bytearray((chunk_hi - chunk_lo) * row_bytes))
        whole[(a - chunk_lo) * row_bytes : (b - chunk_lo) * row_bytes] = out[(a - first) * row_bytes : (b - first) * row_bytes]
        if a > chunk_lo:
            read(whole[: (a - chunk_lo) * row_bytes], self.offset + chunk_lo * row_bytes)
        if b < chunk_hi:
            read(whole[(b - chunk_lo) * row_bytes :], self.offset + b * row_bytes)
        actual = digest(whole)
        if actual != expected:
            raise ChunkMismatch(chunk_lo, chunk_hi, actual, expected)
        self.checked[number] = 1


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
        if self.reached(number):
            return
        with self._locks[number]:  # waits here while a background thread checks it
            if not self._done[number] and self.error is None:
                self._check(number)
        self.raise_error()

    def reached(self, number: int) -> bool:
        """Whether shard `number` is checked whole (raises the first error
        found, if any); if not, lets the background threads check up to
        `lookahead` shards beyond it, without waiting (`ensure` then waits)."""
        self.raise_error()
        if self._done[number]:
            return True
        self._advance(number)
        return False

    def raise_error(self) -> None:
        """Raises the first error found, if any (reads of chunk-checked files
        ask this alone, without `ensure`'s whole-file check)."""
        if self.error is not None:
            raise self.error

    def fail(self, error: Exception) -> Exception:
        """Records `error` (a chunk's mismatch) as the dataset's first error,
        unless one was recorded already; returns the one recorded."""
        with self._condition:
            if self.error is None:
                self.error = error
            self._condition.notify_all()
        return self.error

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
