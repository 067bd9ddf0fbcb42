"""`ShardedDataset`: a shard directory, validated when opened, read into
`tf.data` at the speed of the disk, each shard checked on its first read."""

from __future__ import annotations

import functools
import json
import math
import os
import warnings

import numpy as np
import tensorflow as tf

from kvram import _checks
from kvram.data import _shard, _verify, _view
from kvram.data._format import INDEX, ShardError


# `verify_chunks=None` checks chunks as they are read on machines of up to this many
# cores, and whole files on background threads on larger ones (a read that comes first
# checking its chunks instead of waiting). Measured first epochs (benchmarks/README.md at
# commit 14fd531, "data"): on 2 cores chunks cost 6.5-14% against 21-54% for whole files; on a 16-core
# GPU host chunks 17-29% against 8-12% for whole files waited for, and 6.6% or less in
# order, 10.5-10.6% shuffled, with the reads checking chunks until then. Between 2 and
# 16 cores it was not measured.
CHUNK_CHECKS_UP_TO_CORES = 4


def _cores() -> int:
    """The CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


class ShardedDataset:
    """A shard directory written by `write_shards`, validated at open time.

    Opening reads `index.json` and every shard's `.npy` header (not its data) and
    checks: the index's format and version, plain file names inside the
    directory, each file present, its dtype, per-sample shape and sample count
    as the index says, C order, and its size on disk (a truncated file fails
    here, not in the middle of an epoch). Errors are `ShardError`s naming the file.

    Reading checks the bytes against the checksums stored in the index the
    first time this process reads them (`verify_on_read=True`), so a flipped
    byte is an error naming the file and its samples, never data trained on.
    With `verify_chunks`, `to_tf_dataset` (its default `read="pread"`) checks
    each chunk of rows (up to 256 KiB, XXH3-64) as it reads it, while the
    bytes are in the CPU's cache, and hands out no row of a chunk before its
    check has passed. Otherwise, and for memory-mapped reads
    (`read="memmap"`, `"view"`, `read()`) and directories written before
    chunk digests, whole files are checked (XXH3-128, or SHA-256 for
    directories written without it) on background threads a few shards ahead
    of the reader, each before its first read; where the default chose whole
    files (more than 4 cores), a pread read that comes to a file before its
    whole check is done checks its chunks instead. Each chunk or file is hashed once per
    process (again only if it changed on disk); later epochs cost nothing.
    Measured cost: docs/guides/data.md (`results/data_io_cpu.json`). Files written with
    `checksum=False` have no checksum to compare and are read unchecked (a
    warning says so).

    Args:
        directory: the shard directory.
        verify_on_read: bool, check checksums on first read (default). False
            is the explicit opt-out: bytes are read as they are on disk.
        verify_threads: None (up to 4, half the CPU cores) or int >= 0, the
            background threads checking whole files ahead of the reader, where
            whole files are checked (see above; 0: each shard is checked by
            the read that first needs it: whole, or chunk by chunk where the
            default checks chunks until a file's whole check is done).
        verify_chunks: None (default: chunks where this process has at most
            4 CPU cores; on larger machines whole files on the background
            threads, which hash on idle cores at less cost, while the pread
            reads check the chunks of a file whose whole check has not
            finished instead of waiting for it; measured in
            `benchmarks/README.md` at commit 14fd531), True (chunks as they are read, where the
            index has them) or False (whole files on the background threads,
            each read waiting for its file's).

    Raises:
        ShardError: at open time, for an index or file that does not match.

    Example:
    ```python
    data = kvram.data.ShardedDataset("shards/")
    model.fit(data.to_tf_dataset(batch_size=256, shuffle=True), epochs=10)
    ```
    """

    def __init__(
        self, directory, verify_on_read: bool = True, verify_threads: int | None = None,
        verify_chunks: bool | None = None,
    ):
        self.verify_on_read = _checks.boolean("verify_on_read", verify_on_read)
        chosen = verify_chunks is None
        if chosen:
            verify_chunks = _cores() <= CHUNK_CHECKS_UP_TO_CORES
        elif not isinstance(verify_chunks, bool):
            raise TypeError(
                f"`verify_chunks` must be None, True or False. Received: verify_chunks={verify_chunks!r}"
            )
        self.verify_chunks = verify_chunks
        # Where the default checks whole files (larger machines), the reads check the chunks of a
        # file whose whole check has not finished yet instead of waiting for it (`Shard.read_into`).
        self._chunks_until_whole = chosen and not verify_chunks
        if verify_threads is None:
            verify_threads = max(1, min(4, _cores() // 2))
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
        self.fields = _shard.check_index(index, index_path)
        self._shards = _shard.check_shards(self.directory, self.fields, index, index_path)
        if not (self.verify_chunks or self._chunks_until_whole):
            for shard in self._shards:
                shard.chunks = {}  # whole files, checked on the background threads
        for shard in self._shards:
            shard.chunks_until_whole = self._chunks_until_whole
        self._starts = np.array([s.start for s in self._shards] + [len(self)], dtype=np.int64)
        self._chunked = all(len(s.chunks) == len(s.paths) for s in self._shards)
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

    # -- information
    def __len__(self) -> int:
        return int(self.index["samples"])

    @property
    def element_spec(self) -> dict:
        """{field: tf.TensorSpec} of one sample."""
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
        views without a copy (`_shard.BufferPool`)."""
        shard = self._shards[self._shard_number(start)]
        if stop > shard.start + shard.samples:
            return None
        arrays = shard.arrays()
        views = [arrays[n][start - shard.start:stop - shard.start] for n in names]
        if any(v.ctypes.data % _shard.BufferPool.ALIGN for v in views):
            return None
        return views

    def _read_into(self, start: int, stop: int, outs: dict, at: int) -> None:
        """Samples [start, stop) into rows at... of each array in `outs`
        ({field: array}), by `Shard.read_into` (the GIL released while the
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
                H200 host, 2.5 against 1.6 on 2 cores, `benchmarks/README.md`
                at commit 14fd531).
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
                as "memmap". Measured against the others: docs/guides/data.md.

        Returns:
            A dataset with known cardinality (`assert_cardinality`), so Keras
            counts steps exactly.
        """
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
            lists = _view.shard_tensor_lists(self, names)
            if lists is not None:
                dataset = _view.view_batches(
                    self, names, lists, batch_size, batches, block, shuffle, seed, repeat,
                    drop_remainder, num_parallel_reads,
                )
                return self._finish(dataset, batches, repeat, device, prefetch)

        buffers = _shard.BufferPool()

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
            if self._verifier is not None and (
                (read == "memmap" and not shuffle) or not self._chunked or self._chunks_until_whole
            ):
                # Whole files on the background threads (else files with chunk digests are only
                # checked as they are read, Shard.read_into).
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
            dataset = _view.epoch_seeds(seed, repeat).flat_map(
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
        if not repeat:
            dataset = dataset.apply(tf.data.experimental.assert_cardinality(batches))
        if device is not None:
            dataset = dataset.apply(tf.data.experimental.prefetch_to_device(device))
        elif prefetch:
            dataset = dataset.prefetch(prefetch)
        return dataset

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
