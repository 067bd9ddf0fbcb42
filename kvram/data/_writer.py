"""`write_shards`: arrays, or an iterator of batches larger than RAM, to a shard
directory, atomically, replacing only what kvram wrote."""

from __future__ import annotations

import glob
import json
import os
import shutil
import tempfile
import time
import warnings
from typing import Iterable, Mapping

import numpy as np
from keras.utils import Progbar

from kvram import _checks
from kvram.data import _verify
from kvram.data._dataset import ShardedDataset
from kvram.data._format import FORMAT, INDEX, VERSION, _dtype_str


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
    if not fields:
        raise ValueError("No fields were given: pass an array, or a dict or tuple of arrays with one entry "
                         "per field. Received: {}")
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
        checksum: store each file's SHA-256 (checked by `ShardedDataset.verify`),
            XXH3-128, and the XXH3-64 of each chunk of its rows (up to 256 KiB):
            a `ShardedDataset` checks the chunks a read touches as it reads
            them (memory-mapped reads check the whole file first).
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


def check_target(directory: str, overwrite: bool, while_writing: bool = False,
                 flag: str = "overwrite=True") -> None:
    """Refuses to write shards to `directory` unless nothing would be lost:
    it does not exist, is an empty directory, or (with `overwrite`) is a
    kvram shard directory holding only what its index lists. Anything else
    (a file, a link, a directory of other files) is never replaced, whatever
    `overwrite` says: the error names what is there, and `flag` what the caller
    passes to replace a shard directory (the command line's `--overwrite`)."""
    if not os.path.lexists(directory):
        return
    foreign = _not_ours(directory)
    if foreign == "":  # an empty directory: nothing in it to lose
        return
    if foreign is not None:
        raise FileExistsError(
            f"{directory} exists and is not a kvram shard directory: {foreign}. kvram replaces only "
            f"shard directories it wrote, with or without {flag}; nothing was written. "
            f"Choose a new directory for the shards. Received: directory={directory!r}"
        )
    if not overwrite:
        first = "was written by another writer while this one wrote" if while_writing else "exists"
        raise FileExistsError(
            f"{directory} {first} (a kvram shard directory); pass {flag} to replace it. "
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
                row_bytes = array[:1].nbytes if len(array) else 0
                files[name].update(_verify.file_digests(path, files[name]["bytes"] - array.nbytes, row_bytes))
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
