"""Datasets larger than RAM: `.npy` shards on disk, read through `numpy.memmap`
into `tf.data` at the speed of the disk.

Format (a directory):

- one `.npy` file per field per shard, named `{field}-{shard:05d}.npy`;
- `index.json`: `{"format": "kvram-shards", "version": 1, "samples": N,
  "fields": {name: {"dtype": "<f4", "shape": [...per-sample...]}},
  "shards": [{"samples": n, "files": {name: {"name": ..., "bytes": ...,
  "sha256": ... or null, "xxh3_128": ... (optional)}}}]}`. The SHA-256 is for
  `verify()` (a full, cryptographic check); the XXH3-128 for the check on first
  read, which it makes cheap.

No pickle anywhere (`allow_pickle=False`); file names in the index are plain
names inside the directory.
"""

from __future__ import annotations

import contextlib
import functools
import glob
import json
import math
import os
import shutil
import sys
import tempfile
import threading
import time
import warnings
from typing import Iterable, Mapping

import numpy as np

from kvram import _verify

__all__ = [
    "write_shards",
    "write_image_shards",
    "decode_jpeg",
    "ShardedDataset",
    "ShardError",
    "raise_shard_errors",
    "FORMAT",
    "VERSION",
]

FORMAT = "kvram-shards"
VERSION = 1
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
    import tensorflow as tf

    try:
        yield
    except tf.errors.OpError as error:
        found = shard_error_in(error)
        if found is None:
            raise
        raise found from error


# --------------------------------------------------------------------------- writing


def _as_fields(batch, names) -> dict:
    """A batch (array, tuple/list of arrays, or dict) as {field: array}."""
    if isinstance(batch, Mapping):
        fields = {str(k): np.asarray(v) for k, v in batch.items()}
        if names is not None:
            missing = [n for n in names if n not in fields]
            if missing:
                raise ValueError(
                    f"`fields` names {missing} that the source does not have. "
                    f"Received: fields={list(names)}, source fields={list(fields)}"
                )
            fields = {n: fields[n] for n in names}
        return fields
    if isinstance(batch, (tuple, list)):
        arrays = [np.asarray(v) for v in batch]
        default = ("x", "y", "sample_weight")[: len(arrays)] if len(arrays) <= 3 else None
        names = names or default or tuple(f"f{i}" for i in range(len(arrays)))
        if len(names) != len(arrays):
            raise ValueError(
                f"`fields` must name each of the source's {len(arrays)} arrays. "
                f"Received: fields={list(names)}"
            )
        return dict(zip(names, arrays))
    names = names or ("x",)
    if len(names) != 1:
        raise ValueError(f"A single array needs one field name. Received: fields={list(names)}")
    return {names[0]: np.asarray(batch)}


def _batches(source, names) -> tuple[Iterable[dict], int | None]:
    """(iterator of {field: array} batches, total samples or None)."""
    if isinstance(source, (np.ndarray, Mapping, tuple, list)):
        fields = _as_fields(source, names)
        return iter([fields]), _rows(fields)
    if hasattr(source, "__iter__"):
        return (_as_fields(b, names) for b in source), None
    raise TypeError(
        "`source` must be an array, a tuple or dict of arrays, or an iterable of such "
        f"batches. Received: {type(source).__name__}"
    )


def _rows(fields: dict) -> int:
    counts = {name: (a.shape[0] if a.ndim else None) for name, a in fields.items()}
    if any(c is None for c in counts.values()):
        raise ValueError(f"Every field needs a leading sample axis. Received shapes: "
                         f"{ {n: a.shape for n, a in fields.items()} }")
    if len(set(counts.values())) != 1:
        raise ValueError(f"All fields must hold the same number of samples. Received: {counts}")
    return next(iter(counts.values()))


def write_shards(
    source,
    directory,
    samples_per_shard: int = 65536,
    fields=None,
    checksum: bool = True,
    overwrite: bool = False,
    verbose: int = 1,
    _metadata=None,
) -> "ShardedDataset":
    """Writes `source` to `directory` as `.npy` shards plus `index.json`.

    Args:
        source: an array (one field, "x"), a tuple/list of arrays (fields "x",
            "y", "sample_weight" unless `fields` names them), a dict of arrays,
            or an iterable of such batches, so that a dataset larger than RAM is
            written in one pass with one shard in memory at a time.
        directory: where to write: a new path or an empty directory; an
            existing kvram shard directory only with `overwrite=True`.
            Anything else there (a file, a directory of other files) is
            never replaced: `FileExistsError` says what is there.
        samples_per_shard: int >= 1, samples per shard file (the last may hold fewer).
        fields: None or names for the source's arrays (for a dict: which keys, in order).
        checksum: store each file's SHA-256 (checked by `ShardedDataset.verify`)
            and XXH3-128 (checked when a `ShardedDataset` first reads the file).
        overwrite: replace an existing kvram shard directory, one that holds
            only the files its `index.json` lists (only once the new one is
            complete).
        verbose: 0 or 1, progress bar.

    The write is atomic: shards and index go to a temporary directory next to
    `directory`, which is renamed into place only when complete, so a crash
    leaves no index pointing at half-written shards. The writer holds a lock
    in its temporary directory: a second writer to the same `directory` is
    refused (`FileExistsError` naming the first), and a killed writer's
    temporary directory is removed by the next write.

    Returns:
        The `ShardedDataset` opened on `directory`.
    """
    from kvram import _checks

    samples_per_shard = _checks.positive_int("samples_per_shard", samples_per_shard)
    directory = os.path.abspath(os.fspath(directory))
    check_target(directory, overwrite)
    names = None if fields is None else tuple(str(f) for f in fields)
    batches, total = _batches(source, names)
    parent = os.path.dirname(directory)
    os.makedirs(parent, exist_ok=True)
    staging = _make_staging(parent, os.path.basename(directory))
    lock = None
    try:
        lock = _lock_staging(staging)
        _clean_up_after_other_writers(directory, staging)
        index = _write_into(staging, batches, total, samples_per_shard, checksum, verbose)
        if _metadata is not None:  # a function of the staging directory, called once the shards are written
            index.update(_metadata(staging))
        with open(os.path.join(staging, INDEX), "w") as handle:
            json.dump(index, handle, indent=1)
            handle.flush()
            os.fsync(handle.fileno())
        os.remove(os.path.join(staging, _LOCK))  # still held (by its open handle) until the end
        if os.path.lexists(directory):  # as checked at the start, or what another writer put there since
            check_target(directory, overwrite, while_writing=True)
            old = tempfile.mkdtemp(prefix=f".{os.path.basename(directory)}.old-", dir=parent)
            aside = os.path.join(old, "d")
            os.replace(directory, aside)
            if _not_ours(aside):  # it changed between the check and the move: put it back
                os.replace(aside, directory)
                os.rmdir(old)
                check_target(directory, overwrite, while_writing=True)
            os.replace(staging, directory)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(staging, directory)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    finally:
        if lock is not None:
            lock.close()  # releases the lock
    with warnings.catch_warnings():  # the caller chose checksum=False; no warning here
        warnings.filterwarnings("ignore", message=".*have no checksum in the index")
        return ShardedDataset(directory)


def check_target(directory: str, overwrite: bool, while_writing: bool = False) -> None:
    """Refuses to write shards to `directory` unless nothing would be lost:
    it does not exist, is an empty directory, or (with `overwrite`) is a
    kvram shard directory holding only what its index lists. Anything else
    (a file, a link, a directory of other files) is never replaced, whatever
    `overwrite` says: the error names what is there."""
    if not os.path.lexists(directory):
        return
    foreign = _not_ours(directory)
    if foreign == "":  # an empty directory: nothing in it to lose
        return
    if foreign is not None:
        raise FileExistsError(
            f"{directory} exists and is not a kvram shard directory: {foreign}. kvram replaces only "
            "shard directories it wrote, with or without overwrite=True; nothing was written. "
            f"Choose a new directory for the shards. Received: directory={directory!r}"
        )
    if not overwrite:
        first = "was written by another writer while this one wrote" if while_writing else "exists"
        raise FileExistsError(
            f"{directory} {first} (a kvram shard directory); pass overwrite=True to replace it. "
            f"Received: directory={directory!r}"
        )


def _not_ours(directory: str) -> str | None:
    """None when `directory` is a kvram shard directory holding only the files
    its index lists (and `report.json` of image shards); "" when it is an empty
    directory; else what is there, in words."""
    if os.path.islink(directory):
        return f"it is a symbolic link to {os.readlink(directory)!r}"
    if not os.path.isdir(directory):
        kind = "a file" if os.path.isfile(directory) else "not a directory"
        size = f" of {os.path.getsize(directory):,} bytes" if os.path.isfile(directory) else ""
        return f"it is {kind}{size}"
    try:
        entries = sorted(os.listdir(directory))
    except OSError as error:
        return f"it cannot be listed ({error.strerror or error})"
    if not entries:
        return ""

    def named(names):
        shown = [n + ("/" if os.path.isdir(os.path.join(directory, n)) else "") for n in names[:5]]
        more = f" and {len(names) - 5} more" if len(names) > 5 else ""
        return ", ".join(shown) + more

    try:
        with open(os.path.join(directory, INDEX)) as handle:
            index = json.load(handle)
        if not isinstance(index, dict) or index.get("format") != FORMAT:
            raise ValueError(index.get("format") if isinstance(index, dict) else None)
        listed = {INDEX} | {f["name"] for shard in index["shards"] for f in shard["files"].values()}
        if "report" in index:
            listed.add("report.json")
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return f"it holds {named(entries)} and no kvram {INDEX}"
    others = [e for e in entries if e not in listed or not os.path.isfile(os.path.join(directory, e))]
    if others:
        return f"besides its shards it holds {named(others)}, which its {INDEX} does not list"
    return None


def _make_staging(parent: str, name: str) -> str:
    """A new temporary directory beside the target, made by a plain `mkdir`
    (the umask's permissions, as the user's own directories get: `mkdtemp`'s
    0o700 would stay on the shard directory once it is renamed into place)."""
    for _ in range(100):
        path = os.path.join(parent, f".{name}.partial-{os.urandom(4).hex()}")
        try:
            os.mkdir(path)
            return path
        except FileExistsError:
            continue
    raise FileExistsError(f"No unused temporary directory name .{name}.partial-* in {parent}")


_LOCK = ".writing"
# A temporary directory this old without a lock file is a dead writer's.
_STALE_SECONDS = 60.0


def _lock_staging(staging):
    """Holds an exclusive lock on a file in the writer's temporary directory
    while it writes (released by the OS if the process dies), so that other
    writers can tell a live write from a killed one's leftovers."""
    handle = open(os.path.join(staging, _LOCK), "w")
    try:
        import fcntl
    except ImportError:  # no flock (Windows): leftovers are kept, not cleaned up
        return handle
    fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    handle.write(str(os.getpid()))
    handle.flush()
    return handle


def _is_live(staging: str) -> bool:
    """Whether a writer still holds `staging`'s lock (True when unsure)."""
    path = os.path.join(staging, _LOCK)
    try:
        import fcntl
    except ImportError:
        return True
    try:
        handle = open(path)
    except FileNotFoundError:  # being created now, or a dead writer's from before its lock
        try:
            return time.time() - os.path.getmtime(staging) < _STALE_SECONDS
        except OSError:
            return False
    except OSError:
        return True
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return True
        fcntl.flock(handle, fcntl.LOCK_UN)
        return False


def _clean_up_after_other_writers(directory: str, staging: str) -> None:
    """Removes the temporary directories of writers to `directory` that were
    killed; raises if another writer to `directory` is writing now."""
    parent, name = os.path.split(directory)
    for other in sorted(glob.glob(os.path.join(glob.escape(parent), f".{glob.escape(name)}.partial-*"))):
        if other == staging or not os.path.isdir(other):
            continue
        if not _is_live(other):
            shutil.rmtree(other, ignore_errors=True)  # a killed writer's shards
        else:  # two writers starting together may both stop here: nothing is lost
            pid = ""
            try:
                with open(os.path.join(other, _LOCK)) as handle:
                    pid = handle.read().strip()
            except OSError:
                pass
            raise FileExistsError(
                f"Another writer{f' (process {pid})' if pid else ''} is writing {directory} "
                f"now (its temporary directory: {other}). Two writers to one directory "
                "would replace each other's shards: wait for it to finish, or write to "
                f"another directory. Received: directory={directory!r}"
            )
    if os.path.isdir(directory):  # a killed overwrite's old copy, once the new one is in place
        for old in glob.glob(os.path.join(glob.escape(parent), f".{glob.escape(name)}.old-*")):
            if not _is_live(old):
                shutil.rmtree(old, ignore_errors=True)


def _write_into(staging, batches, total, samples_per_shard, checksum, verbose) -> dict:
    from keras.utils import Progbar

    progress = Progbar(total, unit_name="sample") if verbose else None
    spec: dict | None = None
    shards: list[dict] = []
    pending: list[dict] = []
    pending_rows = 0
    written = 0

    def flush(rows: int) -> None:
        nonlocal pending, pending_rows, written
        joined = {
            name: np.concatenate([p[name] for p in pending]) if len(pending) > 1 else pending[0][name]
            for name in spec
        }
        shard, rest = {n: a[:rows] for n, a in joined.items()}, {n: a[rows:] for n, a in joined.items()}
        files = {}
        for name, array in shard.items():
            file_name = f"{name}-{len(shards):05d}.npy"
            path = os.path.join(staging, file_name)
            np.save(path, np.ascontiguousarray(array), allow_pickle=False)
            files[name] = {"name": file_name, "bytes": os.path.getsize(path), "sha256": None}
            if checksum:
                files[name].update(_verify.file_digests(path))
        shards.append({"samples": rows, "files": files})
        written += rows
        pending = [rest] if len(next(iter(rest.values()))) else []
        pending_rows -= rows
        if progress is not None:
            progress.update(written)

    for batch in batches:
        rows = _rows(batch)
        if spec is None:
            spec = {
                name: {"dtype": _dtype_str(a.dtype), "shape": list(a.shape[1:])}
                for name, a in batch.items()
            }
        else:
            _check_batch(batch, spec)
        if rows == 0:
            continue
        pending.append(batch)
        pending_rows += rows
        while pending_rows >= samples_per_shard:
            flush(samples_per_shard)
    if spec is None:
        raise ValueError("`source` holds no batches: nothing to write.")
    if pending_rows:
        flush(pending_rows)
    if progress is not None and total is None:
        progress.target = written
        progress.update(written, finalize=True)
    return {
        "format": FORMAT,
        "version": VERSION,
        "samples": written,
        "fields": spec,
        "shards": shards,
    }


def _dtype_str(dtype) -> str:
    dtype = np.dtype(dtype)
    if dtype.hasobject or dtype.fields is not None or dtype.kind in "OV":
        raise TypeError(
            f"Shards hold plain numeric or boolean arrays. Received: dtype={dtype} "
            "(objects and structured dtypes would need pickle)"
        )
    return dtype.str


def _check_batch(batch: dict, spec: dict) -> None:
    if set(batch) != set(spec):
        raise ValueError(f"A batch has fields {sorted(batch)}, the first had {sorted(spec)}.")
    for name, array in batch.items():
        if _dtype_str(array.dtype) != spec[name]["dtype"] or list(array.shape[1:]) != spec[name]["shape"]:
            raise ValueError(
                f"Field {name!r} changed between batches: dtype {array.dtype}, per-sample shape "
                f"{list(array.shape[1:])}; the first batch had {spec[name]['dtype']}, "
                f"{spec[name]['shape']}."
            )


# --------------------------------------------------------------------------- reading


def _read_digest(info: dict) -> tuple:
    """(kind, hex digest or None): the checksum a first read checks a file with,
    XXH3-128 when the index has it and `xxhash` is installed, else SHA-256."""
    if info.get("xxh3_128") and _verify.have_xxhash():
        return "xxh3_128", info["xxh3_128"]
    return "sha256", info.get("sha256") or None


class _BufferPool:
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


class _Shard:
    def __init__(self, number: int, start: int, samples: int, paths: dict, digests: dict, offsets: dict | None = None):
        self.number, self.start, self.samples, self.paths = number, start, samples, paths
        self.offsets = offsets or {}  # {field: byte offset of the payload (after the .npy header)}
        self.files = [(paths[name], digests[name]) for name in paths]
        self.verifier: _verify.ShardVerifier | None = None
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
        no page of a memmap is faulted in."""
        if self.verifier is not None:
            self.verifier.ensure(self.number)
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

    def tensor(self, name: str):
        """Field `name` of this shard as a TF tensor over the memory-mapped file,
        without a copy (DLPack; a copy-on-write mapping, since DLPack cannot
        mark memory read-only: TF never writes it). The caller checks the shard
        first (`ShardVerifier.ensure`)."""
        import tensorflow as tf

        path = self.paths[name]
        try:
            array = np.load(path, mmap_mode="c", allow_pickle=False)
        except OSError as error:
            raise self._cannot_read(error, path) from None
        if array.ctypes.data % _BufferPool.ALIGN:
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


def _epoch_seeds(seed, repeat: bool):
    """A dataset of one random seed per epoch (one epoch unless `repeat`): a new
    draw every iteration over it, the same sequence for the same `seed`."""
    import tensorflow as tf

    seeds = tf.data.Dataset.random(seed=seed, rerandomize_each_iteration=True)
    return seeds if repeat else seeds.take(1)


class ShardedDataset:
    """A shard directory written by `write_shards`, validated at open time.

    Opening reads `index.json` and every shard's `.npy` header (not its data) and
    checks: the index's format and version, plain file names inside the
    directory, each file present, its dtype, per-sample shape and sample count
    as the index says, C order, and its size on disk (a truncated file fails
    here, not in the middle of an epoch). Errors are `ShardError`s naming the file.

    Reading checks each shard's files against the checksum stored in the index
    (XXH3-128, or SHA-256 for directories written without it) the first time
    this process reads that shard (`verify_on_read=True`), so a
    flipped byte is an error naming the file and its samples, never data
    trained on. Background threads check the shards the reader needs next, a
    few ahead of it, while it reads; a shard is never handed out before its
    check has passed. Each file is hashed once per process (again only if it
    changed on disk); later epochs cost nothing. Measured cost:
    `benchmarks/README.md` (data). Files written with `checksum=False` have
    no checksum to compare and are read unchecked (a warning says so).

    Args:
        directory: the shard directory.
        verify_on_read: bool, check checksums on first read (default). False
            is the explicit opt-out: bytes are read as they are on disk.
        verify_threads: None (up to 4, half the CPU cores) or int >= 0, the
            background threads checking shards ahead of the reader (0: each
            shard is checked by the read that first needs it).

    Raises:
        ShardError: at open time, for an index or file that does not match.

    Example:
    ```python
    data = kvram.data.ShardedDataset("shards/")
    model.fit(data.to_tf_dataset(batch_size=256, shuffle=True), epochs=10)
    ```
    """

    def __init__(self, directory, verify_on_read: bool = True, verify_threads: int | None = None):
        from kvram import _checks

        self.verify_on_read = _checks.boolean("verify_on_read", verify_on_read)
        if verify_threads is None:
            verify_threads = max(1, min(4, (os.cpu_count() or 2) // 2))
        elif isinstance(verify_threads, bool) or not isinstance(verify_threads, int) or verify_threads < 0:
            raise ValueError(
                f"`verify_threads` must be None or an int >= 0. Received: verify_threads={verify_threads!r}"
            )
        self.verify_threads = verify_threads
        self.directory = os.path.abspath(os.fspath(directory))
        index_path = os.path.join(self.directory, INDEX)
        if not os.path.isdir(self.directory):
            raise ShardError(self.directory, "no such shard directory")
        try:
            with open(index_path) as handle:
                index = json.load(handle)
        except FileNotFoundError:
            raise ShardError(index_path, "missing: not a kvram shard directory") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise ShardError(index_path, f"not valid JSON ({error})") from None
        self.index = index
        self.fields = self._check_index(index, index_path)
        self._shards = self._check_shards(index, index_path)
        self._starts = np.array([s.start for s in self._shards] + [len(self)], dtype=np.int64)
        self._verifier = None
        if self.verify_on_read:
            unchecked = sum(
                expected is None for shard in self._shards for _, (_, expected) in shard.files
            )
            if unchecked:
                warnings.warn(
                    f"{self.directory}: {unchecked} shard files have no checksum in the index "
                    "(written with checksum=False), so corruption in them cannot be detected "
                    "when they are read.",
                    stacklevel=2,
                )
            self._verifier = _verify.ShardVerifier(
                self._shards, ShardError, threads=self.verify_threads,
                lookahead=2 * max(1, self.verify_threads),
            )
            for shard in self._shards:
                shard.verifier = self._verifier

    # -- validation
    def _check_index(self, index, index_path) -> dict:
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

    def _check_shards(self, index, index_path) -> list:
        shards, start = [], 0
        for number, entry in enumerate(index["shards"]):
            try:
                samples = int(entry["samples"])
                files = entry["files"]
            except (KeyError, TypeError, ValueError):
                raise ShardError(index_path, f"shard {number}: needs 'samples' and 'files'") from None
            if set(files) != set(self.fields):
                raise ShardError(index_path, f"shard {number}: files for {sorted(files)}, fields are {sorted(self.fields)}")
            paths, offsets = {}, {}
            for name, info in files.items():
                paths[name], offsets[name] = self._check_file(index_path, number, name, info, samples)
            digests = {name: _read_digest(info) for name, info in files.items()}
            shards.append(_Shard(number, start, samples, paths, digests, offsets))
            start += samples
        if int(index.get("samples", -1)) != start:
            raise ShardError(index_path, f"'samples' says {index.get('samples')!r} but the shards hold {start}")
        return shards

    def _check_file(self, index_path, number, name, info, samples) -> str:
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
        path = os.path.join(self.directory, file_name)
        if os.path.islink(path):
            raise ShardError(
                path,
                f"a symbolic link (to {os.readlink(path)}); shards must be regular files "
                "inside the directory, so that what is checked is what is read: copy the "
                "file in, or write the shards again",
            )
        if not os.path.isfile(path):
            raise ShardError(path, "missing (listed in the index)" if not os.path.lexists(path) else "not a regular file")
        dtype, shape = self.fields[name]
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

    # -- information
    def __len__(self) -> int:
        return int(self.index["samples"])

    @property
    def element_spec(self) -> dict:
        """{field: tf.TensorSpec} of one sample."""
        import tensorflow as tf

        return {name: tf.TensorSpec(shape, tf.as_dtype(dtype)) for name, (dtype, shape) in self.fields.items()}

    @property
    def nbytes(self) -> int:
        """Bytes of sample data (headers excluded)."""
        return sum(len(self) * int(np.prod(s, dtype=np.int64)) * d.itemsize for d, s in self.fields.values())

    def verify(self, verbose: int = 1) -> None:
        """Checks every file's SHA-256 against the index; raises `ShardError` naming
        the first file that differs. Files written without checksums are skipped."""
        from keras.utils import Progbar

        jobs = []
        for number, entry in enumerate(self.index["shards"]):
            for name, info in entry["files"].items():
                if info.get("sha256"):
                    jobs.append((os.path.join(self.directory, info["name"]), info["sha256"]))
        total = sum(os.path.getsize(path) for path, _ in jobs)
        progress = Progbar(total, unit_name="byte") if verbose and total else None
        done = [0]

        def advance(count):
            done[0] += count
            if progress is not None:
                progress.update(done[0])

        for path, expected in jobs:
            actual = _verify.sha256(path, advance)
            if actual != expected:
                raise ShardError(path, f"checksum mismatch: SHA-256 {actual}, index.json says {expected}")

    def read(self, start: int, stop: int, fields=None) -> dict:
        """Samples [start, stop) as {field: array}; views into the memmaps when the
        range lies in one shard, else a concatenated copy."""
        names = list(self.fields) if fields is None else list(fields)
        if self._verifier is not None:
            self._start_verification(None)
        first = self._shard_number(start)
        pieces = {n: [] for n in names}
        position = start
        shard_number = first
        while position < stop:
            shard = self._shards[shard_number]
            local_start = position - shard.start
            local_stop = min(stop, shard.start + shard.samples) - shard.start
            arrays = shard.arrays()
            for n in names:
                pieces[n].append(arrays[n][local_start:local_stop])
            position = shard.start + local_stop
            shard_number += 1
        return {n: p[0] if len(p) == 1 else np.concatenate(p) for n, p in pieces.items()}

    def _shard_number(self, sample: int) -> int:
        """The number of the shard holding `sample`."""
        return int(np.searchsorted(self._starts, sample, side="right") - 1)

    def _views(self, start: int, stop: int, names) -> list | None:
        """Samples [start, stop) as views of the memmaps, when they lie in one
        shard and every view is 64-byte aligned (else None): TF takes such
        views without a copy (`_BufferPool`)."""
        shard = self._shards[self._shard_number(start)]
        if stop > shard.start + shard.samples:
            return None
        arrays = shard.arrays()
        views = [arrays[n][start - shard.start:stop - shard.start] for n in names]
        if any(v.ctypes.data % _BufferPool.ALIGN for v in views):
            return None
        return views

    def _read_into(self, start: int, stop: int, outs: dict, at: int) -> None:
        """Samples [start, stop) into rows at... of each array in `outs`
        ({field: array}), by `_Shard.read_into` (the GIL released while the
        bytes move)."""
        shard_number = self._shard_number(start)
        position = start
        while position < stop:
            shard = self._shards[shard_number]
            local_stop = min(stop, shard.start + shard.samples)
            rows = local_stop - position
            for name, out in outs.items():
                shard.read_into(name, position - shard.start, out[at:at + rows])
            at += rows
            position = local_stop
            shard_number += 1

    def _start_verification(self, block_starts) -> None:
        """Starts the background checks (once), in the order reads will need the
        shards: that of `block_starts` (the first sample of each block read, in
        reading order), or the index's order."""
        if self._verifier is None or self._verifier.started:
            return
        if block_starts is None:
            order = range(len(self._shards))
        else:
            shard_of = np.searchsorted(self._starts, block_starts, side="right") - 1
            _, first = np.unique(shard_of, return_index=True)
            order = shard_of[np.sort(first)]
        self._verifier.start(order)

    # -- tf.data
    def to_tf_dataset(
        self,
        batch_size: int,
        shuffle: bool = True,
        seed: int | None = None,
        drop_remainder: bool = False,
        repeat: bool = False,
        num_parallel_reads: int = -1,
        prefetch=-1,
        device: str | None = None,
        fields=None,
        block_size: int | None = None,
        read: str = "pread",
    ):
        """A `tf.data.Dataset` of batches read from the memmapped shards.

        Without shuffling each batch is one contiguous range of samples. With shuffling,
        samples are cut into contiguous blocks of `block_size` rows (default
        batch_size // 8, at least 1), the blocks are put in a new random order
        every epoch, across shards, and each batch takes consecutive blocks of
        that order: rows from about 8 random places, read in runs rather than
        row by row. Every sample appears exactly once per epoch; the same `seed`
        gives the same sequence of epochs.

        Args:
            batch_size: int >= 1.
            shuffle: new block order every epoch (every iteration over the dataset).
            seed: None or int, for reproducible orders.
            drop_remainder: drop the last, short batch.
            repeat: repeat forever (each epoch reshuffled).
            num_parallel_reads: batches read in parallel (default -1:
                tf.data.AUTOTUNE; the pread path releases the GIL while bytes
                move, so readers no longer contend: from the page cache,
                AUTOTUNE read 6.3 GB/s against one reader's 5.1 on a 16-core
                H200 host, 2.5 against 1.6 on 2 cores, `benchmarks/README.md`).
            prefetch: batches prefetched (-1: AUTOTUNE, 0: none).
            device: None or e.g. "GPU:0", to prefetch batches onto that device.
            fields: None (all fields, as a tuple in index order; a single field
                alone), a field name, or a list of names (a tuple in that order).
            block_size: None or int >= 1, rows per shuffled block.
            read: how bytes reach TF. "pread" (default): `os.preadv` from
                the file into 64-byte-aligned arrays reused from a pool, which
                TF takes without a copy; the kernel copies from the page cache
                with Python's GIL released, a shard truncated after opening is
                a `ShardError` naming it, and no page is mapped into the
                process. "memmap": an unshuffled batch that lies in one shard
                is handed to TF as a view of the memory-mapped shard, no copy
                at all (the consumer's first touch reads the page cache); other
                batches are assembled by pread as above. A file truncated
                under a mapped view kills the process with SIGBUS.
                "view": no Python per batch. Each shard is mapped once and
                handed to TF as a tensor over the mapping (DLPack, no copy);
                TF slices every batch from those tensors (a batch in one shard,
                in order: a slice sharing the mapping's memory when a row is a
                multiple of 64 bytes; several pieces: one copy, by TF, in
                parallel readers). Python runs once an epoch, to plan the
                block order, and per batch only until every shard is checked
                (the first epoch, with `verify_on_read`). SIGBUS on truncation,
                as "memmap". Measured against the others: `benchmarks/README.md`.

        Returns:
            A dataset with known cardinality (`assert_cardinality`), so Keras
            counts steps exactly.
        """
        import tensorflow as tf

        from kvram import _checks

        batch_size = _checks.positive_int("batch_size", batch_size)
        if read not in ("pread", "memmap", "view"):
            raise ValueError(f'read must be "pread", "memmap" or "view". Received: read={read!r}')
        block_size = _checks.positive_int("block_size", block_size, allow_none=True)
        names = self._field_names(fields)
        total = len(self)
        batches = total // batch_size if drop_remainder else math.ceil(total / batch_size)
        if batches == 0:
            raise ValueError(
                f"No batch to read: {total} samples, batch_size={batch_size}, "
                f"drop_remainder={drop_remainder}."
            )
        dtypes = [tf.as_dtype(self.fields[n][0]) for n in names]
        block = block_size or max(1, batch_size // 8)
        plan = functools.lru_cache(maxsize=4)(functools.partial(self._epoch_plan, block))

        if read == "view":
            lists = self._shard_tensor_lists(names)
            if lists is not None:
                dataset = self._view_batches(
                    names, lists, batch_size, batches, block, shuffle, seed, repeat,
                    drop_remainder, num_parallel_reads,
                )
                return self._finish(dataset, batches, repeat, device, prefetch)

        buffers = _BufferPool()

        def read_batch(epoch_seed, number):
            # Each batch is read into aligned arrays of the pool's, which TF takes
            # without a copy (a memmap view it would copy, holding the GIL).
            start = int(number) * batch_size
            stop = min(start + batch_size, total)
            if read == "memmap" and not shuffle:
                views = self._views(start, stop, names)
                if views is not None:
                    return views
            outs = {n: buffers.take((stop - start,) + self.fields[n][1], self.fields[n][0]) for n in names}
            if self._verifier is not None:
                self._start_verification(plan(int(epoch_seed))[0][:, 0] if shuffle else None)
            if not shuffle:
                self._read_into(start, stop, outs, 0)
                return [outs[n] for n in names]
            blocks, ends = plan(int(epoch_seed))
            first = int(np.searchsorted(ends, start, side="right"))
            last = int(np.searchsorted(ends, stop - 1, side="right"))
            at = 0
            for b in range(first, last + 1):
                block_start, block_stop = blocks[b]
                offset = ends[b] - (block_stop - block_start)  # position of the block in the order
                lo = block_start + max(0, start - offset)
                hi = block_start + min(block_stop - block_start, stop - offset)
                self._read_into(int(lo), int(hi), outs, at)
                at += int(hi - lo)
            return [outs[n] for n in names]

        def to_batch(epoch_seed, number):
            tensors = tf.numpy_function(read_batch, [epoch_seed, number], dtypes, stateful=False)
            rows = batch_size if drop_remainder else None
            out = []
            for tensor, name in zip(tensors, names):
                tensor.set_shape((rows,) + self.fields[name][1])
                out.append(tensor)
            return out[0] if len(out) == 1 else tuple(out)

        if shuffle:
            dataset = _epoch_seeds(seed, repeat).flat_map(
                lambda s: tf.data.Dataset.range(batches).map(lambda i: (s, i))
            )
        else:
            dataset = tf.data.Dataset.range(batches).map(lambda i: (tf.constant(0, tf.int64), i))
            if repeat:
                dataset = dataset.repeat()
        dataset = dataset.map(to_batch, num_parallel_calls=num_parallel_reads, deterministic=True)
        return self._finish(dataset, batches, repeat, device, prefetch)

    @staticmethod
    def _finish(dataset, batches, repeat, device, prefetch):
        import tensorflow as tf

        if not repeat:
            dataset = dataset.apply(tf.data.experimental.assert_cardinality(batches))
        if device is not None:
            dataset = dataset.apply(tf.data.experimental.prefetch_to_device(device))
        elif prefetch:
            dataset = dataset.prefetch(prefetch)
        return dataset

    # -- read="view": batches assembled by TensorFlow from tensors over the mapped shards
    def _shard_tensor_lists(self, names) -> dict | None:
        """{field: a TensorList of every shard's tensor over its mapped file}, or
        None when a payload is not 64-byte aligned (TF would copy it)."""
        import tensorflow as tf

        lists = {}
        for name in names:
            dtype, shape = tf.as_dtype(self.fields[name][0]), self.fields[name][1]
            handle = tf.raw_ops.EmptyTensorList(
                element_shape=tf.constant((-1,) + shape, tf.int32), max_num_elements=-1,
                element_dtype=dtype,
            )
            for shard in self._shards:
                tensor = shard.tensor(name)
                if tensor is None:
                    return None
                handle = tf.raw_ops.TensorListPushBack(input_handle=handle, tensor=tensor)
            lists[name] = handle
        return lists

    def _pieces(self, blocks, batch_size: int, batches: int, least_slots: int = 1):
        """The reading plan of an epoch whose rows come in `blocks` ([start, stop)
        rows, in reading order), cut into batches: (pieces [batches, most, 3] as
        (shard, first row in the shard, rows), pieces per batch [batches])."""
        starts, stops = blocks[:, 0], blocks[:, 1]
        lengths = stops - starts
        offsets = np.cumsum(lengths) - lengths  # of each block in the epoch's stream
        first = offsets // batch_size
        last = (offsets + lengths - 1) // batch_size
        repeats = last - first + 1
        block = np.repeat(np.arange(len(blocks)), repeats)
        batch = first[block] + np.arange(len(block)) - np.repeat(np.cumsum(repeats) - repeats, repeats)
        low = np.maximum(offsets[block], batch * batch_size) - offsets[block]
        high = np.minimum(offsets[block] + lengths[block], (batch + 1) * batch_size) - offsets[block]
        keep = batch < batches  # drop_remainder: the short last batch's pieces
        block, batch, low, high = block[keep], batch[keep], low[keep], high[keep]
        begin = starts[block] + low
        shard = np.searchsorted(self._starts, begin, side="right") - 1
        counts = np.bincount(batch, minlength=batches)
        slot = np.arange(len(batch)) - np.repeat(np.cumsum(counts) - counts, counts)
        table = np.zeros((batches, max(least_slots, int(counts.max())), 3), np.int64)
        table[batch, slot] = np.stack([shard, begin - self._starts[shard], high - low], axis=1)
        return table, counts.astype(np.int64)

    def _view_batches(self, names, lists, batch_size, batches, block, shuffle, seed, repeat,
                      drop_remainder, num_parallel_reads):
        import tensorflow as tf

        shard_blocks = np.stack([self._starts[:-1], self._starts[1:]], axis=1)
        # Pieces unrolled in the graph: in order, as many as a batch has at most
        # (the plan, computed once, is every epoch's); shuffled, those of a batch
        # of whole blocks, plus one, at most 32 (a loop reads a batch of more).
        if shuffle:
            slots = min(-(-batch_size // block) + 1, 32)
        else:
            in_order = self._pieces(shard_blocks, batch_size, batches)
            slots = in_order[0].shape[1]
        verify = self._verifier is not None and not all(self._verifier._done)

        def plan(epoch_seed):
            # Python once an epoch: the order of the blocks and where each batch's rows lie.
            blocks = self._epoch_plan(block, int(epoch_seed))[0] if shuffle else shard_blocks
            checked = self._verifier is None or all(self._verifier._done)
            if not checked:
                self._start_verification(blocks[:, 0])
            table, counts = self._pieces(blocks, batch_size, batches, slots) if shuffle else in_order
            return table, counts, np.full(batches, checked)

        def ensure(shards):
            for number in np.unique(shards):
                self._verifier.ensure(int(number))
            return np.bool_(True)

        def epoch(epoch_seed):
            table, counts, checked = tf.numpy_function(
                plan, [epoch_seed], (tf.int64, tf.int64, tf.bool), stateful=False
            )
            table.set_shape((batches, None, 3))
            counts.set_shape((batches,))
            checked.set_shape((batches,))
            return tf.data.Dataset.from_tensor_slices((table, counts, checked))

        def assemble(pieces, count, checked):
            ready = []
            if verify:
                # Until every shard is checked (the first epoch), a batch waits for its shards.
                ready = [tf.cond(
                    checked,
                    lambda: tf.constant(True),
                    lambda: tf.numpy_function(ensure, [pieces[:count, 0]], tf.bool, stateful=True),
                )]
            out = []
            with tf.control_dependencies(ready):
                for name in names:
                    dtype, shape = tf.as_dtype(self.fields[name][0]), self.fields[name][1]

                    def piece(j, name=name, dtype=dtype, shape=shape):
                        tensor = tf.raw_ops.TensorListGetItem(
                            input_handle=lists[name], index=tf.cast(pieces[j, 0], tf.int32),
                            element_shape=tf.constant((-1,) + shape, tf.int32), element_dtype=dtype,
                        )
                        return tensor[pieces[j, 1]:pieces[j, 1] + pieces[j, 2]]

                    def gathered(piece=piece, dtype=dtype, shape=shape):
                        size = tf.cast(count, tf.int32)
                        parts = tf.TensorArray(dtype, size=size, infer_shape=False, element_shape=(None,) + shape)
                        parts = tf.while_loop(
                            lambda j, parts: j < size,
                            lambda j, parts: (j + 1, parts.write(j, piece(j))),
                            (tf.constant(0), parts),
                        )[1]
                        return parts.concat()

                    def unrolled(piece=piece):
                        # Slots past `count` are empty slices (0 rows), which concat skips.
                        return tf.concat([piece(j) for j in range(slots)], axis=0)

                    # One piece: a slice of the mapped shard, no copy; several: one copy
                    # (a loop only for batches of more pieces than a shuffled batch's
                    # usual most: short blocks at the ends of shards).
                    if slots == 1:  # every batch lies in one shard
                        tensor = piece(0)
                    elif not shuffle:  # no batch has more than `slots` pieces
                        tensor = tf.cond(tf.equal(count, 1), lambda piece=piece: piece(0), unrolled)
                    else:
                        tensor = tf.case(
                            [(tf.equal(count, 1), lambda piece=piece: piece(0)),
                             (count <= slots, unrolled)],
                            default=gathered,
                        )
                    tensor.set_shape((batch_size if drop_remainder else None,) + shape)
                    out.append(tensor)
            return out[0] if len(out) == 1 else tuple(out)

        if shuffle:
            seeds = _epoch_seeds(seed, repeat)
        else:
            seeds = tf.data.Dataset.from_tensors(tf.constant(0, tf.int64))
            if repeat:
                seeds = seeds.repeat()
        dataset = seeds.flat_map(epoch)
        return dataset.map(assemble, num_parallel_calls=num_parallel_reads, deterministic=True)

    def _field_names(self, fields) -> list:
        if fields is None:
            return list(self.fields)
        names = [fields] if isinstance(fields, str) else list(fields)
        unknown = [n for n in names if n not in self.fields]
        if unknown or not names:
            raise ValueError(f"Unknown fields {unknown}; this dataset has {list(self.fields)}. Received: fields={fields!r}")
        return names

    def _epoch_plan(self, block: int, epoch_seed: int):
        """(blocks as [start, stop) rows in a random order, cumulative ends) for one epoch.

        Blocks never cross a shard boundary, so each is one memmap slice.
        """
        starts = [np.arange(s.start, s.start + s.samples, block, dtype=np.int64) for s in self._shards]
        starts = np.concatenate(starts) if starts else np.zeros(0, np.int64)
        shard_ends = self._starts[1:][np.searchsorted(self._starts, starts, side="right") - 1]
        stops = np.minimum(starts + block, shard_ends)
        order = np.random.default_rng(epoch_seed).permutation(len(starts))
        blocks = np.stack([starts[order], stops[order]], axis=1)
        ends = np.cumsum(blocks[:, 1] - blocks[:, 0])
        return blocks, ends

    def __repr__(self) -> str:
        return (f"ShardedDataset({self.directory!r}: {len(self)} samples in {len(self._shards)} "
                f"shards, fields {({n: (d.str, s) for n, (d, s) in self.fields.items()})})")


from kvram._images import decode_jpeg, write_image_shards  # noqa: E402  (they use write_shards)
