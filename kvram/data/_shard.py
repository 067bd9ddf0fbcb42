"""One shard: its files checked against the index when a dataset opens, and read
(by `os.preadv` into aligned arrays, or memory-mapped)."""

from __future__ import annotations

import os
import sys
import threading

import numpy as np
import tensorflow as tf

from kvram.data import _verify
from kvram.data._format import FORMAT, VERSION, ShardError, _dtype_str


def _read_digest(info: dict) -> tuple:
    """(kind, hex digest or None): the checksum a first read checks a file with,
    XXH3-128 when the index has it and `xxhash` is installed, else SHA-256."""
    if info.get("xxh3_128") and _verify.have_xxhash():
        return "xxh3_128", info["xxh3_128"]
    return "sha256", info.get("sha256") or None


class BufferPool:
    """Arrays for batches, 64-byte aligned, reused once nothing holds them.

    TensorFlow takes an array returned by `tf.numpy_function` without a copy
    only when its data is aligned to Eigen's EIGEN_MAX_ALIGN_BYTES (64 bytes
    covers every build; tensorflow/tensorflow#9690, #43925). numpy places a
    large array 16 bytes into a page, so TF copies it, into fresh pages: on a
    2-core VM that copy cost 2.1 ms for a 4 MiB batch, against 0.3 ms for
    everything else tf.data does for it. While a tensor made from an array
    lives, TF holds a reference to the array; once the last such tensor is
    gone (TF lets go of it when its next Python function runs: a decref
    cache) the array's reference count is the pool's alone again, and the
    array is handed out anew: its pages are written again, not faulted in.
    At most `keep_bytes` (and at least 4 arrays) are kept of each shape;
    past that, arrays are made fresh and left to the garbage collector.
    """

    ALIGN = 64

    def __init__(self, keep_bytes: int = 256 << 20):
        self.keep_bytes = keep_bytes
        self._pools: dict = {}
        self._lock = threading.Lock()

    @classmethod
    def aligned(cls, shape, dtype) -> np.ndarray:
        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape)) * dtype.itemsize
        raw = np.empty(nbytes + cls.ALIGN, np.uint8)
        skip = -raw.ctypes.data % cls.ALIGN
        return raw[skip:skip + nbytes].view(dtype).reshape(shape)

    def take(self, shape, dtype) -> np.ndarray:
        key = (tuple(shape), np.dtype(dtype).str)
        with self._lock:
            arrays = self._pools.setdefault(key, [])
            for i in range(len(arrays)):
                # references: the pool's list and getrefcount's argument, none else
                if sys.getrefcount(arrays[i]) == 2:
                    return arrays[i]
            array = self.aligned(shape, dtype)
            if len(arrays) < max(4, self.keep_bytes // max(array.nbytes, 1)):
                arrays.append(array)
            return array


class Shard:
    def __init__(self, number: int, start: int, samples: int, paths: dict, digests: dict, offsets: dict | None = None,
                 chunks: dict | None = None, fields: dict | None = None):
        self.number, self.start, self.samples, self.paths = number, start, samples, paths
        self.fields = fields or {}  # {field: (dtype, per-sample shape)}
        self.offsets = offsets or {}  # {field: byte offset of the payload (after the .npy header)}
        self.files = [(paths[name], digests[name]) for name in paths]
        # {field: (path of its chunk digests, rows per chunk, their file's XXH3-128)}: every
        # field's, or none (an index written before chunk digests)
        self.chunks = chunks or {}
        self.verifier: _verify.ShardVerifier | None = None
        self._arrays: dict | None = None
        self._handles: dict = {}
        self._tables: dict = {}
        self._lock = threading.Lock()

    def _cannot_read(self, error, path):
        return ShardError(
            error.filename if isinstance(error.filename, str) else path,
            f"cannot be read ({error.strerror or error}); was it deleted or "
            f"moved after the dataset was opened? Samples {self.start} to "
            f"{self.start + self.samples - 1} (shard {self.number}).",
        )

    def read_into(self, name: str, first: int, out: np.ndarray) -> None:
        """Fills `out` (C-contiguous, len(out) rows) with this shard's rows
        `first`... of field `name`, by `os.preadv` from the file: the kernel
        copies from the page cache into `out` with Python's GIL released, and
        no page of a memmap is faulted in."""
        chunked = self.verifier is not None and name in self.chunks
        if self.verifier is not None:
            if self.verifier.error is not None:
                raise self.verifier.error
            if not chunked:
                self.verifier.ensure(self.number)
        self._pread(name, first, out)
        if chunked:
            self._check_chunks(name, first, out)

    def _pread(self, name: str, first: int, out: np.ndarray) -> None:
        path = self.paths[name]
        handle = self._handles.get(name)
        if handle is None:
            with self._lock:
                handle = self._handles.get(name)
                if handle is None:
                    try:
                        handle = self._handles[name] = open(path, "rb", buffering=0)
                    except OSError as error:
                        raise self._cannot_read(error, path) from None
        view = memoryview(out).cast("B")
        position = self.offsets[name] + first * (out.nbytes // max(len(out), 1))
        done = 0
        while done < len(view):
            try:
                count = os.preadv(handle.fileno(), [view[done:]], position + done)
            except OSError as error:
                raise self._cannot_read(error, path) from None
            if count == 0:
                raise ShardError(path, f"ended early: shard {self.number} was truncated after the dataset was opened")
            done += count

    def _chunk_table(self, name: str):
        """(digests, checked flags, rows per chunk) of field `name`, the digests
        read on first use and checked against the index first."""
        table = self._tables.get(name)
        if table is None:
            with self._lock:
                table = self._tables.get(name)
                if table is None:
                    path, rows, expected = self.chunks[name]
                    try:
                        actual = _verify.xxh3_128(path)
                        digests = np.load(path, allow_pickle=False) if actual == expected else None
                    except (OSError, ValueError) as error:
                        raise ShardError(path, f"cannot be read as chunk digests ({error}); samples "
                                         f"{self.start} to {self.start + self.samples - 1} (shard "
                                         f"{self.number}) cannot be checked") from None
                    if digests is None:
                        raise ShardError(
                            path, f"checksum mismatch: XXH3-128 {actual}, index.json says {expected}: the "
                            f"chunk digests of samples {self.start} to {self.start + self.samples - 1} "
                            f"(shard {self.number}) are corrupt. Restore the file or write the shards again.")
                    count = -(-self.samples // rows)
                    if digests.dtype != np.dtype("<u8") or digests.shape != (count,):
                        raise ShardError(path, f"holds {digests.dtype} digests of shape {digests.shape}; "
                                         f"{count} uint64 expected ({self.samples} samples, {rows} a chunk)")
                    flags = _verify.checked_chunks(self.paths[name], expected, count)
                    table = self._tables[name] = (digests, flags, rows)
        return table

    def _check_chunks(self, name: str, first: int, out: np.ndarray) -> None:
        """Checks the chunks of field `name` that rows `first`... (just read into
        `out`) lie in and no check has passed yet: a chunk the read covers from
        what was read (in the CPU's cache), one it covers in part from the file."""
        digests, flags, rows = self._chunk_table(name)
        count = len(out)
        if not count:
            return
        low, high = first // rows, (first + count - 1) // rows + 1
        todo = np.flatnonzero(~flags[low:high])
        if not todo.size:
            return
        row_bytes = out.nbytes // count
        with memoryview(out).cast("B") as view:
            for i in todo:
                chunk = low + int(i)
                lo, hi = chunk * rows, min(chunk * rows + rows, self.samples)
                if lo >= first and hi <= first + count:
                    self._check_chunk(name, chunk, view[(lo - first) * row_bytes:(hi - first) * row_bytes])
                else:
                    self._check_chunk(name, chunk, self._read_chunk(name, chunk, row_bytes))

    def check_chunks_ahead(self, name: str, first: int, count: int, scratch: dict) -> None:
        """Checks, from the file, the chunks of field `name` that rows
        `first`...`first + count - 1` lie in and no check has passed yet (a
        background thread's, ahead of the reader): their rows read in one
        pread into `scratch` (the thread's buffers), each chunk hashed there."""
        digests, flags, rows = self._chunk_table(name)
        low, high = first // rows, (first + count - 1) // rows + 1
        todo = np.flatnonzero(~flags[low:high])
        if not todo.size:
            return
        dtype, shape = self.fields[name]
        row_bytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        lo, hi = (low + int(todo[0])) * rows, min((low + int(todo[-1]) + 1) * rows, self.samples)
        buffer = scratch.get(name)
        if buffer is None or len(buffer) < (hi - lo) * row_bytes:
            buffer = scratch[name] = np.empty((hi - lo) * row_bytes, np.uint8)
        self._pread(name, lo, buffer[:(hi - lo) * row_bytes].reshape(hi - lo, row_bytes))
        with memoryview(buffer).cast("B") as view:
            for i in todo:
                chunk = low + int(i)
                a, b = (chunk * rows - lo) * row_bytes, (min(chunk * rows + rows, self.samples) - lo) * row_bytes
                self._check_chunk(name, chunk, view[a:b])

    def _read_chunk(self, name, chunk, row_bytes):
        rows = self.chunks[name][1]
        lo, hi = chunk * rows, min(chunk * rows + rows, self.samples)
        part = np.empty((hi - lo) * row_bytes, np.uint8)
        self._pread(name, lo, part.reshape(hi - lo, row_bytes))
        return part

    def _check_chunk(self, name: str, chunk: int, data) -> None:
        """Compares the XXH3-64 of `data` with chunk `chunk`'s digest: marks it
        checked, or raises (and keeps, for every later read) the `ShardError`."""
        import xxhash

        digests, flags, rows = self._tables[name]
        actual = xxhash.xxh3_64_intdigest(data)
        if actual == int(digests[chunk]):
            flags[chunk] = True
            return
        lo, hi = chunk * rows, min(chunk * rows + rows, self.samples)
        error = ShardError(
            self.paths[name],
            f"checksum mismatch: XXH3-64 {actual:016x} of samples {self.start + lo} to "
            f"{self.start + hi - 1} (chunk {chunk} of shard {self.number}), "
            f"{os.path.basename(self.chunks[name][0])} says {int(digests[chunk]):016x}. "
            "Those samples are corrupt and were not read. Restore the file or write the "
            "shards again.",
        )
        if self.verifier.error is None:
            self.verifier.error = error
        raise error

    def tensor(self, name: str):
        """Field `name` of this shard as a TF tensor over the memory-mapped file,
        without a copy (DLPack; a copy-on-write mapping, since DLPack cannot
        mark memory read-only: TF never writes it). The caller checks the shard
        first (`ShardVerifier.ensure`)."""
        path = self.paths[name]
        try:
            array = np.load(path, mmap_mode="c", allow_pickle=False)
        except OSError as error:
            raise self._cannot_read(error, path) from None
        if array.ctypes.data % BufferPool.ALIGN:
            return None
        return tf.experimental.dlpack.from_dlpack(array.__dlpack__())

    def arrays(self) -> dict:
        if self.verifier is not None:
            self.verifier.ensure(self.number)
        if self._arrays is None:
            with self._lock:
                if self._arrays is None:
                    try:
                        self._arrays = {
                            name: np.load(path, mmap_mode="r", allow_pickle=False)
                            for name, path in self.paths.items()
                        }
                    except OSError as error:
                        raise self._cannot_read(error, self.files[0][0]) from None
        return self._arrays


# -- validation
def check_index(index, index_path) -> dict:
    """{field: (dtype, per-sample shape)} of a valid index, or a `ShardError`."""
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise ShardError(index_path, f"not a {FORMAT!r} index (format={index.get('format') if isinstance(index, dict) else None!r})")
    if index.get("version") != VERSION:
        raise ShardError(index_path, f"format version {index.get('version')!r}; this kvram reads {VERSION}")
    fields = index.get("fields")
    if not isinstance(fields, dict) or not fields:
        raise ShardError(index_path, "'fields' must map field names to dtype and shape")
    spec = {}
    for name, entry in fields.items():
        try:
            dtype = np.dtype(entry["dtype"])
            shape = tuple(int(d) for d in entry["shape"])
            _dtype_str(dtype)
        except (KeyError, TypeError, ValueError) as error:
            raise ShardError(index_path, f"field {name!r}: bad dtype/shape ({error})") from None
        spec[name] = (dtype, shape)
    if not isinstance(index.get("shards"), list):
        raise ShardError(index_path, "'shards' must be a list")
    return spec


def check_shards(directory, fields, index, index_path) -> list:
    """The index's shards (`Shard`s), each file checked against it (`check_file`)."""
    shards, start = [], 0
    for number, entry in enumerate(index["shards"]):
        try:
            samples = int(entry["samples"])
            files = entry["files"]
        except (KeyError, TypeError, ValueError):
            raise ShardError(index_path, f"shard {number}: needs 'samples' and 'files'") from None
        if set(files) != set(fields):
            raise ShardError(index_path, f"shard {number}: files for {sorted(files)}, fields are {sorted(fields)}")
        paths, offsets = {}, {}
        for name, info in files.items():
            paths[name], offsets[name] = check_file(directory, fields, index_path, number, name, info, samples)
        digests = {name: _read_digest(info) for name, info in files.items()}
        chunks = {name: check_chunks(directory, index_path, number, name, info) for name, info in files.items()}
        chunks = chunks if all(chunks.values()) and _verify.have_xxhash() else {}
        shards.append(Shard(number, start, samples, paths, digests, offsets, chunks, fields))
        start += samples
    if int(index.get("samples", -1)) != start:
        raise ShardError(index_path, f"'samples' says {index.get('samples')!r} but the shards hold {start}")
    return shards


def check_chunks(directory, index_path, number, name, info):
    """(path, rows per chunk, XXH3-128) of a shard file's chunk digests, as the
    index lists them (None where it lists none); the file must exist."""
    chunks = info.get("chunks") if isinstance(info, dict) else None
    if chunks is None:
        return None
    try:
        file_name, rows, digest = chunks["name"], int(chunks["rows"]), str(chunks["xxh3_128"])
    except (KeyError, TypeError, ValueError):
        raise ShardError(index_path, f"shard {number}, field {name!r}: 'chunks' needs 'name', 'rows' and "
                         "'xxh3_128'") from None
    _check_plain_name(index_path, number, name, file_name)
    path = os.path.join(directory, file_name)
    if rows < 1:
        raise ShardError(index_path, f"shard {number}, field {name!r}: {rows} rows a chunk; >= 1 allowed")
    if os.path.islink(path) or not os.path.isfile(path):
        raise ShardError(path, "missing (listed in the index as chunk digests)" if not os.path.lexists(path)
                         else "not a regular file (listed in the index as chunk digests)")
    return path, rows, digest


def _check_plain_name(index_path, number, name, file_name) -> None:
    if (
        not isinstance(file_name, str)
        or not file_name
        or file_name in (".", "..")
        or os.path.basename(file_name) != file_name
        or "/" in file_name
        or "\\" in file_name
    ):
        raise ShardError(index_path, f"shard {number}, field {name!r}: file name {file_name!r} is not a plain name inside the directory")


def check_file(directory, fields, index_path, number, name, info, samples) -> tuple:
    """(path, byte offset of the payload) of a shard file: a plain name inside
    `directory`, a regular file whose .npy header and size match the index."""
    file_name = info.get("name") if isinstance(info, dict) else None
    _check_plain_name(index_path, number, name, file_name)
    path = os.path.join(directory, file_name)
    if os.path.islink(path):
        raise ShardError(
            path,
            f"a symbolic link (to {os.readlink(path)}); shards must be regular files "
            "inside the directory, so that what is checked is what is read: copy the "
            "file in, or write the shards again",
        )
    if not os.path.isfile(path):
        raise ShardError(path, "missing (listed in the index)" if not os.path.lexists(path) else "not a regular file")
    dtype, shape = fields[name]
    try:
        with open(path, "rb") as handle:
            version = np.lib.format.read_magic(handle)
            if version == (1, 0):
                header = np.lib.format.read_array_header_1_0(handle)
            elif version == (2, 0):
                header = np.lib.format.read_array_header_2_0(handle)
            else:
                raise ValueError(f"unsupported .npy version {version}")
            offset = handle.tell()
    except (ValueError, OSError) as error:
        raise ShardError(path, f"not a valid .npy file ({error})") from None
    file_shape, fortran, file_dtype = header
    if fortran:
        raise ShardError(path, "stored in Fortran order; shards are C order")
    if file_dtype != dtype:
        raise ShardError(path, f"dtype {file_dtype.str}, the index says {dtype.str} for field {name!r}")
    if tuple(file_shape[1:]) != shape:
        raise ShardError(path, f"per-sample shape {tuple(file_shape[1:])}, the index says {shape} for field {name!r}")
    if not file_shape or file_shape[0] != samples:
        raise ShardError(path, f"holds {file_shape[0] if file_shape else 0} samples, the index says {samples}")
    expected = offset + samples * int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    actual = os.path.getsize(path)
    if actual != expected:
        raise ShardError(path, f"{actual} bytes on disk, {expected} expected: truncated or padded")
    if info.get("bytes") is not None and int(info["bytes"]) != actual:
        raise ShardError(path, f"{actual} bytes on disk, the index says {info['bytes']}")
    return path, offset
