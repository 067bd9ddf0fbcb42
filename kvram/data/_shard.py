"""One shard: its files checked against the index when a dataset opens, and read
(by `os.preadv` into aligned arrays, or memory-mapped)."""

from __future__ import annotations

import math
import os
import sys
import threading

import numpy as np
import tensorflow as tf

from kvram.data import _verify
from kvram.data._format import FORMAT, VERSION, ShardError, _dtype_str


def _chunk_check(info: dict, path: str, offset: int, row_bytes: int, samples: int, index_path: str, where: str):
    """The file's `ChunkCheck` when the index has chunk digests for it and
    `xxhash` is installed, else None (its whole file is checked instead)."""
    chunks = info.get("chunks")
    if chunks is None or not _verify.have_xxhash() or row_bytes <= 0:
        return None
    try:
        rows, encoded = int(chunks["rows"]), chunks["xxh3_64"]
        valid = rows >= 1 and isinstance(encoded, str) and len(encoded) == 4 * math.ceil(8 * math.ceil(samples / rows) / 3)
    except (KeyError, TypeError, ValueError):
        valid = False
    if not valid:
        raise ShardError(
            index_path,
            f"{where}: 'chunks' must be {{\"rows\": rows per chunk >= 1, \"xxh3_64\": base64 of "
            f"one little-endian uint64 per chunk of its {samples} rows}}. Received: {str(chunks)[:200]}",
        )
    return _verify.ChunkCheck(path, offset, row_bytes, samples, rows, encoded)


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
                 chunks: dict | None = None):
        self.number, self.start, self.samples, self.paths = number, start, samples, paths
        self.offsets = offsets or {}  # {field: byte offset of the payload (after the .npy header)}
        self.files = [(paths[name], digests[name]) for name in paths]
        self.chunks = chunks or {}  # {field: _verify.ChunkCheck}, for the fields whose index has chunk digests
        self.verifier: _verify.ShardVerifier | None = None
        # checked whole on background threads, the reads checking the chunks they read until then
        self.chunks_until_whole = False
        self._arrays: dict | None = None
        self._handles: dict = {}
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
        no page of a memmap is faulted in. A file with chunk digests is
        checked chunk by chunk as it is read (`_verify.ChunkCheck`), others
        whole before their first read (`ShardVerifier.ensure`). With
        `chunks_until_whole`, the chunks are checked as they are read only
        until a background thread has checked the shard's files whole: a read
        never waits for a whole file's hash."""
        chunks = self.chunks.get(name) if self.verifier is not None else None
        if self.verifier is not None:
            if chunks is None:
                self.verifier.ensure(self.number)
            elif self.chunks_until_whole and self.verifier.reached(self.number):
                chunks = None  # its files were checked whole
            else:
                self.verifier.raise_error()
        if out.nbytes == 0:  # rows of no bytes (a field of empty samples): nothing to read
            return
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
        fd = handle.fileno()

        def read(view, position):
            done = 0
            while done < len(view):
                try:
                    count = os.preadv(fd, [view[done:]], position + done)
                except OSError as error:
                    raise self._cannot_read(error, path) from None
                if count == 0:
                    raise ShardError(path, f"ended early: shard {self.number} was truncated after the dataset was opened")
                done += count

        view = memoryview(out).cast("B")
        if chunks is None:
            read(view, self.offsets[name] + first * (out.nbytes // max(len(out), 1)))
            return
        try:
            chunks.read(read, view, first)
        except _verify.ChunkMismatch as bad:
            raise self.verifier.fail(ShardError(
                path,
                f"checksum mismatch: XXH3-64 {bad.actual:016x} of its rows {bad.first} to {bad.stop - 1} "
                f"(bytes {chunks.offset + bad.first * chunks.row_bytes} to "
                f"{chunks.offset + bad.stop * chunks.row_bytes - 1}), index.json says {bad.expected:016x}. "
                f"Samples {self.start + bad.first} to {self.start + bad.stop - 1} (shard {self.number}) "
                "are corrupt and were not read. Restore the file or write the shards again.",
            )) from None

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
        paths, offsets, chunks = {}, {}, {}
        for name, info in files.items():
            paths[name], offsets[name] = check_file(directory, fields, index_path, number, name, info, samples)
            dtype, shape = fields[name]
            check = _chunk_check(info, paths[name], offsets[name], int(np.prod(shape, dtype=np.int64)) * dtype.itemsize,
                                 samples, index_path, f"shard {number}, field {name!r}")
            if check is not None:
                chunks[name] = check
        digests = {name: _read_digest(info) for name, info in files.items()}
        shards.append(Shard(number, start, samples, paths, digests, offsets, chunks))
        start += samples
    if int(index.get("samples", -1)) != start:
        raise ShardError(index_path, f"'samples' says {index.get('samples')!r} but the shards hold {start}")
    return shards


def check_file(directory, fields, index_path, number, name, info, samples) -> tuple:
    """(path, byte offset of the payload) of a shard file: a plain name inside
    `directory`, a regular file whose .npy header and size match the index."""
    file_name = info.get("name") if isinstance(info, dict) else None
    if (
        not isinstance(file_name, str)
        or not file_name
        or file_name in (".", "..")
        or os.path.basename(file_name) != file_name
        or "/" in file_name
        or "\\" in file_name
    ):
        raise ShardError(index_path, f"shard {number}, field {name!r}: file name {file_name!r} is not a plain name inside the directory")
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
