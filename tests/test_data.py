import json
import os
import subprocess
import sys
import textwrap
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import kvram
from kvram.data import ShardedDataset, ShardError, write_shards

N = 1000


def arrays(n=N):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, 3, 2)).astype("float32")
    y = np.arange(n, dtype="int64")  # the sample's id
    w = rng.random(n).astype("float16")
    return x, y, w


@pytest.fixture
def shards(tmp_path):
    x, y, w = arrays()
    return write_shards({"x": x, "y": y, "w": w}, tmp_path / "s", samples_per_shard=300, verbose=0)


def epoch(dataset):
    batches = list(dataset)
    return [np.concatenate([b[i].numpy() for b in batches]) for i in range(len(batches[0]))]


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("batch", [64, 1, 1000, 300, 7])
def test_round_trip_every_sample_once_bit_identical(shards, shuffle, batch):
    x, y, w = arrays()
    dataset = shards.to_tf_dataset(batch, shuffle=shuffle, seed=3)
    assert int(dataset.cardinality()) == -(-N // batch)
    ex, ey, ew = epoch(dataset)
    assert sorted(ey.tolist()) == list(range(N))  # exactly once
    np.testing.assert_array_equal(ex, x[ey])  # bit-identical rows, whatever the order
    np.testing.assert_array_equal(ew, w[ey])
    assert ex.dtype == np.float32 and ew.dtype == np.float16
    if not shuffle:
        np.testing.assert_array_equal(ey, np.arange(N))
    sizes = [b[1].shape[0] for b in dataset]
    assert all(s == batch for s in sizes[:-1]) and sizes[-1] == N - batch * (len(sizes) - 1)


def test_shuffling_changes_every_epoch_and_follows_the_seed(shards):
    a = shards.to_tf_dataset(50, shuffle=True, seed=11)
    b = shards.to_tf_dataset(50, shuffle=True, seed=11)
    c = shards.to_tf_dataset(50, shuffle=True, seed=12)
    a1, a2, a3 = (epoch(a)[1] for _ in range(3))
    b1, b2, _ = (epoch(b)[1] for _ in range(3))
    assert not np.array_equal(a1, a2) and not np.array_equal(a2, a3)
    np.testing.assert_array_equal(a1, b1)  # same seed, same sequence of epochs
    np.testing.assert_array_equal(a2, b2)
    assert not np.array_equal(a1, epoch(c)[1])
    # Mixed across shards: the first batch draws from more than one shard.
    first = next(iter(a))[1].numpy()
    assert len(set(first // 300)) > 1


def test_repeat_drop_remainder_and_field_selection(shards):
    dataset = shards.to_tf_dataset(128, shuffle=True, seed=0, repeat=True, drop_remainder=True,
                                   fields=("x", "y"))
    assert dataset.element_spec[0].shape.as_list() == [128, 3, 2]
    ids = np.concatenate([b[1].numpy() for b in dataset.take(2 * (N // 128))])
    first, second = ids[: 7 * 128], ids[7 * 128 :]
    assert len(set(first)) == len(first) and len(set(second)) == len(second)
    labels = shards.to_tf_dataset(100, shuffle=False, fields="y")
    assert labels.element_spec.shape.as_list() == [None]
    with pytest.raises(ValueError, match=r"Unknown fields \['z'\]"):
        shards.to_tf_dataset(10, fields=["z"])


def test_writing_no_fields_says_so(tmp_path):
    with pytest.raises(ValueError, match=r"^No fields were given: pass an array, or a dict or tuple of arrays with "
                                         r"one entry per field. Received: \{\}$"):
        write_shards({}, tmp_path / "out", verbose=0)
    assert not (tmp_path / "out").exists()


def test_write_from_an_iterator_of_batches_larger_than_a_shard(tmp_path):
    x, y, _ = arrays()
    batches = ((x[i : i + 137], y[i : i + 137]) for i in range(0, N, 137))
    dataset = write_shards(batches, tmp_path / "it", samples_per_shard=256, verbose=0)
    assert len(dataset) == N and [s["samples"] for s in dataset.index["shards"]] == [256] * 3 + [232]
    ex, ey = epoch(dataset.to_tf_dataset(100, shuffle=False))
    np.testing.assert_array_equal(ex, x)
    np.testing.assert_array_equal(ey, y)
    assert dataset.element_spec["x"].shape.as_list() == [3, 2]


def test_index_contents_and_no_pickle(shards):
    index = json.load(open(os.path.join(shards.directory, "index.json")))
    assert index["format"] == "kvram-shards" and index["version"] == 1 and index["samples"] == N
    assert index["fields"]["w"] == {"dtype": "<f2", "shape": []}
    entry = index["shards"][0]["files"]["x"]
    assert entry["name"] == "x-00000.npy" and len(entry["sha256"]) == 64
    with pytest.raises(TypeError, match="pickle"):
        write_shards(np.array([{"a": 1}], dtype=object), shards.directory + "-obj", verbose=0)


def test_write_is_atomic(tmp_path):
    x, y, _ = arrays()

    def failing():
        yield x[:500], y[:500]
        raise RuntimeError("source broke")

    target = tmp_path / "atomic"
    with pytest.raises(RuntimeError, match="source broke"):
        write_shards(failing(), target, samples_per_shard=100, verbose=0)
    assert not target.exists() and os.listdir(tmp_path) == []
    write_shards((x, y), target, verbose=0)
    with pytest.raises(FileExistsError, match="overwrite=True"):
        write_shards((x, y), target, verbose=0)
    with pytest.raises(RuntimeError):
        write_shards(failing(), target, overwrite=True, verbose=0)
    assert len(ShardedDataset(target)) == N  # the old one is intact
    write_shards((x[:10], y[:10]), target, overwrite=True, verbose=0)
    assert len(ShardedDataset(target)) == 10 and os.listdir(tmp_path) == ["atomic"]


WRITER = """
import sys, time
import numpy as np
from kvram.data import write_shards

def batches():
    yield np.zeros((100, 4), "float32")
    open(sys.argv[2], "w").close()  # the first shard is written: tell the test
    time.sleep(600)
    yield np.zeros((100, 4), "float32")

write_shards(batches(), sys.argv[1], samples_per_shard=50, verbose=0)
"""


def start_writer(tmp_path, target):
    """A writer process stopped in the middle of its write (two shards written)."""
    marker = tmp_path / "started"
    process = subprocess.Popen([sys.executable, "-c", WRITER, str(target), str(marker)])
    for _ in range(1200):
        if marker.exists() or process.poll() is not None:
            break
        import time

        time.sleep(0.1)
    assert marker.exists(), "the writer process did not start writing"
    marker.unlink()
    return process


@pytest.mark.slow
def test_two_writers_and_a_killed_writer(tmp_path):
    """A second writer to a directory being written is refused with a clear
    error; a writer killed mid-write leaves nothing under the final name, and
    the next write removes its temporary directory."""
    target = tmp_path / "data"
    process = start_writer(tmp_path, target)
    try:
        (partial,) = [p for p in os.listdir(tmp_path) if p.startswith(".data.partial-")]
        with pytest.raises(FileExistsError) as error:
            write_shards(np.ones((10, 4), "float32"), target, verbose=0)
        assert str(error.value) == (
            f"Another writer (process {process.pid}) is writing {target} now (its temporary "
            f"directory: {tmp_path / partial}). Two writers to one directory would replace "
            "each other's shards: wait for it to finish, or write to another directory. "
            f"Received: directory={str(target)!r}"
        )
        assert sorted(os.listdir(tmp_path / partial)) == [".writing", "x-00000.npy", "x-00001.npy"]
    finally:
        process.kill()
        process.wait()
    assert not target.exists()  # killed mid-write: no directory under the final name
    assert os.listdir(tmp_path) == [partial]  # its shards are left until the next write
    write_shards(np.ones((10, 4), "float32"), target, verbose=0)
    assert os.listdir(tmp_path) == ["data"] and len(ShardedDataset(target)) == 10
    assert sorted(os.listdir(target)) == ["index.json", "x-00000.npy"]


def test_a_dead_writers_directory_without_a_lock_is_removed_once_stale(tmp_path):
    target = tmp_path / "data"
    leftover = tmp_path / ".data.partial-dead"
    leftover.mkdir()
    (leftover / "x-00000.npy").write_bytes(b"half")
    os.utime(leftover, (0, 0))  # older than a minute, no lock file: dead
    write_shards(np.ones((10, 4), "float32"), target, verbose=0)
    assert os.listdir(tmp_path) == ["data"]


# Bad input: every error names the offending file, at open (or verify) time.


def _index(directory):
    return json.load(open(os.path.join(directory, "index.json")))


def _save_index(directory, index):
    with open(os.path.join(directory, "index.json"), "w") as handle:
        json.dump(index, handle)


def test_truncated_shard(shards):
    path = os.path.join(shards.directory, "x-00002.npy")
    with open(path, "r+b") as handle:
        handle.truncate(os.path.getsize(path) - 8)
    with pytest.raises(ShardError) as error:
        ShardedDataset(shards.directory)
    assert error.value.path == path
    size = os.path.getsize(path)
    assert str(error.value) == f"{path}: {size} bytes on disk, {size + 8} expected: truncated or padded"


@pytest.mark.parametrize(
    "replacement, text",
    [
        (np.zeros((300, 3, 2), "float64"), "dtype <f8, the index says <f4"),
        (np.zeros((300, 2, 3), "float32"), r"per-sample shape \(2, 3\), the index says \(3, 2\)"),
        (np.zeros((299, 3, 2), "float32"), "holds 299 samples, the index says 300"),
        (np.asfortranarray(np.zeros((300, 3, 2), "float32")), "Fortran order"),
    ],
)
def test_shard_of_wrong_dtype_shape_or_count(shards, replacement, text):
    path = os.path.join(shards.directory, "x-00001.npy")
    np.save(path, replacement)
    with pytest.raises(ShardError, match=text) as error:
        ShardedDataset(shards.directory)
    assert error.value.path == path


def test_symlinked_shard(shards, tmp_path):
    path = os.path.join(shards.directory, "x-00001.npy")
    elsewhere = str(tmp_path / "elsewhere.npy")
    os.replace(path, elsewhere)
    os.symlink(elsewhere, path)
    with pytest.raises(ShardError) as error:
        ShardedDataset(shards.directory)
    assert str(error.value) == (
        f"{path}: a symbolic link (to {elsewhere}); shards must be regular files inside "
        "the directory, so that what is checked is what is read: copy the file in, or "
        "write the shards again"
    )
    os.remove(path)
    os.symlink(str(tmp_path / "nowhere.npy"), path)  # dangling
    with pytest.raises(ShardError, match="a symbolic link"):
        ShardedDataset(shards.directory)


def test_missing_shard(shards):
    path = os.path.join(shards.directory, "y-00003.npy")
    os.remove(path)
    with pytest.raises(ShardError, match="missing") as error:
        ShardedDataset(shards.directory)
    assert error.value.path == path


@pytest.mark.parametrize("name", ["../outside.npy", "/etc/passwd", "sub/x.npy", "..", ""])
def test_index_with_a_path_outside_the_directory(shards, name):
    index = _index(shards.directory)
    index["shards"][1]["files"]["x"]["name"] = name
    _save_index(shards.directory, index)
    with pytest.raises(ShardError, match="not a plain name inside the directory") as error:
        ShardedDataset(shards.directory)
    assert error.value.path.endswith("index.json") and repr(name) in str(error.value)


@pytest.mark.parametrize("where", ["total", "shard"])
def test_index_counts_that_disagree_with_the_files(shards, where):
    index = _index(shards.directory)
    if where == "total":
        index["samples"] = N + 5
        text, path = "the shards hold 1000", os.path.join(shards.directory, "index.json")
    else:
        index["shards"][0]["samples"] = 310
        text, path = "holds 300 samples, the index says 310", None
    _save_index(shards.directory, index)
    with pytest.raises(ShardError, match=text) as error:
        ShardedDataset(shards.directory)
    if path:
        assert error.value.path == path
    else:
        assert os.path.basename(error.value.path) == "x-00000.npy"


@pytest.mark.parametrize("content", ["{not json", "", '{"format": "other"}', '{"format": "kvram-shards", "version": 9}'])
def test_corrupted_index(shards, content):
    path = os.path.join(shards.directory, "index.json")
    with open(path, "w") as handle:
        handle.write(content)
    with pytest.raises(ShardError) as error:
        ShardedDataset(shards.directory)
    assert error.value.path == path


def test_checksum_mismatch_on_verify(shards):
    path = os.path.join(shards.directory, "w-00001.npy")
    with open(path, "r+b") as handle:
        handle.seek(-3, os.SEEK_END)
        handle.write(b"\x01\x02\x03")  # same size, different bytes
    dataset = ShardedDataset(shards.directory)  # sizes and headers still agree
    with pytest.raises(ShardError, match="checksum mismatch") as error:
        dataset.verify(verbose=0)
    assert error.value.path == path


def _flip_a_byte(path, offset_from_end=1000):
    with open(path, "r+b") as handle:
        handle.seek(-offset_from_end, os.SEEK_END)
        byte = handle.read(1)
        handle.seek(-offset_from_end, os.SEEK_END)
        handle.write(bytes([byte[0] ^ 0x40]))


def _without_chunk_digests(directory):
    """The index as kvram wrote it before chunk digests: each file is checked whole."""
    index = _index(directory)
    for shard in index["shards"]:
        for info in shard["files"].values():
            del info["chunks"]
    _save_index(directory, index)


@pytest.mark.parametrize("threads", [0, 2])
@pytest.mark.parametrize("shuffle", [False, True])
def test_a_flipped_byte_is_an_error_before_any_of_its_samples_is_read(shards, threads, shuffle):
    """Indexes without chunk digests: the whole file is checked before its first read."""
    _without_chunk_digests(shards.directory)
    path = os.path.join(shards.directory, "x-00002.npy")  # samples 600 to 899
    _flip_a_byte(path)
    kvram.data._verify.forget_checked()
    dataset = ShardedDataset(shards.directory, verify_threads=threads)
    seen = []
    with pytest.raises(Exception, match="checksum mismatch") as error:
        for _, y, _ in dataset.to_tf_dataset(50, shuffle=shuffle, seed=1):
            seen.extend(y.numpy().tolist())
    text = str(error.value)
    assert "ShardError" in text and path in text and "Samples 600 to 899 (shard 2)" in text
    assert "checksum mismatch: XXH3-128 " in text
    assert not any(600 <= i < 900 for i in seen), "a sample of the corrupt shard was handed out"
    # Every read after the first error fails too, also of intact shards.
    with pytest.raises(ShardError, match="checksum mismatch") as again:
        dataset.read(0, 10)
    assert again.value.path == path


def test_a_flipped_byte_stops_fit(shards, tmp_path):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((400, 4)).astype("float32")
    data = write_shards((x, x[:, :1]), tmp_path / "fit", samples_per_shard=100, verbose=0)
    _flip_a_byte(os.path.join(data.directory, "x-00003.npy"), offset_from_end=3)
    kvram.data._verify.forget_checked()
    inputs = keras.Input((4,))
    model = kvram.Model(inputs, keras.layers.Dense(1)(inputs))
    model.compile(optimizer="sgd", loss="mse")
    with pytest.raises(ShardError, match=r"x-00003.npy: checksum mismatch.*Samples 300 to 399"):
        model.fit(ShardedDataset(data.directory).to_tf_dataset(100, shuffle=False), verbose=0)


def test_the_opt_out_reads_the_bytes_as_they_are(shards):
    x, _, _ = arrays()
    path = os.path.join(shards.directory, "x-00002.npy")
    _flip_a_byte(path, offset_from_end=4)  # the last float of sample 899
    kvram.data._verify.forget_checked()
    unchecked = ShardedDataset(shards.directory, verify_on_read=False)
    ex, ey, _ = epoch(unchecked.to_tf_dataset(100, shuffle=False))
    assert ex[899, -1, -1] != x[899, -1, -1]
    np.testing.assert_array_equal(ex[:899], x[:899])
    with pytest.raises(ShardError, match="checksum mismatch"):
        ShardedDataset(shards.directory).read(850, 900)


def test_each_file_is_hashed_once_per_process(shards, monkeypatch):
    """Indexes without chunk digests (for those with them, see
    test_each_chunk_is_hashed_once_as_it_is_read_and_no_file_whole)."""
    _without_chunk_digests(shards.directory)
    kvram.data._verify.forget_checked()
    calls = []
    real = kvram.data._verify.xxh3_128
    monkeypatch.setattr(kvram.data._verify, "xxh3_128", lambda path, *a: calls.append(path) or real(path, *a))
    for _ in range(2):  # two epochs of one dataset, then a second dataset on the same files
        epoch(shards.to_tf_dataset(64, shuffle=True, seed=0))
    epoch(ShardedDataset(shards.directory).to_tf_dataset(64, shuffle=False))
    files = sorted(os.path.join(shards.directory, n) for n in os.listdir(shards.directory) if n.endswith(".npy"))
    assert sorted(calls) == files  # 4 shards x 3 fields, each once
    # A file written since is checked again.
    x, _, _ = arrays()
    np.save(files[0], np.load(files[0]))
    calls.clear()
    ShardedDataset(shards.directory).read(0, 1)
    assert calls == [files[0]]


WIDE_ROW = 16384  # float32: 64 KiB a row, so 4 rows a chunk (256 KiB)


@pytest.fixture
def wide(tmp_path):
    """64 rows of 64 KiB in shards of 32: 8 chunk digests a file. Each row is its id."""
    x = np.repeat(np.arange(64, dtype="float32")[:, None], WIDE_ROW, axis=1)
    return write_shards({"x": x}, tmp_path / "wide", samples_per_shard=32, verbose=0)


def test_index_holds_chunk_digests_of_whole_rows(wide):
    import base64

    import xxhash

    assert kvram.data._verify.chunk_rows(WIDE_ROW * 4) == 4
    assert kvram.data._verify.chunk_rows(24) == 8192 and kvram.data._verify.chunk_rows(300 * 2**10) == 1
    entry = _index(wide.directory)["shards"][1]["files"]["x"]
    data = open(os.path.join(wide.directory, entry["name"]), "rb").read()
    payload = data[len(data) - 32 * WIDE_ROW * 4:]
    step = 4 * WIDE_ROW * 4
    expected = [xxhash.xxh3_64_intdigest(payload[i:i + step]) for i in range(0, len(payload), step)]
    assert entry["chunks"]["rows"] == 4 and len(expected) == 8
    assert np.frombuffer(base64.b64decode(entry["chunks"]["xxh3_64"]), "<u8").tolist() == expected


@pytest.mark.parametrize("shuffle", [False, True])
def test_a_flipped_byte_fails_its_chunk_before_any_of_its_rows_is_read(wide, shuffle):
    path = os.path.join(wide.directory, "x-00001.npy")
    _flip_a_byte(path, offset_from_end=(32 - 13) * WIDE_ROW * 4 - 8)  # row 13 of shard 1: sample 45
    kvram.data._verify.forget_checked()
    dataset = ShardedDataset(wide.directory, verify_chunks=True)
    seen = []
    # In order, one read at a time: with parallel reads the corrupt chunk's read may end before
    # those of the chunks before it, and every read after a dataset's first error fails too
    # (kvram/data/_verify.py), so fewer rows come out before the error (a clean-clone CI run on 2
    # cores: 36 of 44). Shuffled, the parallel reads are what is checked.
    reads = -1 if shuffle else 1
    with pytest.raises(Exception, match="checksum mismatch") as error:
        for x in dataset.to_tf_dataset(4, shuffle=shuffle, seed=3, block_size=4, num_parallel_reads=reads):
            seen.extend(x.numpy()[:, 0].astype(int).tolist())
    text = str(error.value)
    assert "ShardError" in text and path in text, text
    assert "checksum mismatch: XXH3-64 " in text and "of its rows 12 to 15 " in text, text
    assert "Samples 44 to 47 (shard 1)" in text, text
    assert not any(44 <= i < 48 for i in seen), "a row of the corrupt chunk was handed out"
    if not shuffle:
        assert seen == list(range(44)), "the chunks before it were read, each once"
    # Every read after the first error fails too, also of intact shards.
    with pytest.raises(ShardError, match="checksum mismatch") as again:
        dataset.read(0, 1)
    assert again.value.path == path


def test_each_chunk_is_hashed_once_as_it_is_read_and_no_file_whole(wide, monkeypatch):
    import xxhash

    kvram.data._verify.forget_checked()
    chunks, wholes = [], []
    real = xxhash.xxh3_64_intdigest
    monkeypatch.setattr(xxhash, "xxh3_64_intdigest", lambda data: chunks.append(len(data)) or real(data))
    monkeypatch.setattr(kvram.data._verify, "xxh3_128", lambda path, *a: wholes.append(path))
    dataset = ShardedDataset(wide.directory, verify_chunks=True)
    for _ in range(2):  # batches of 7 rows: most chunks are read in two parts, by two batches
        x = np.concatenate([b.numpy() for b in dataset.to_tf_dataset(7, shuffle=True, seed=0, block_size=3)])
        assert sorted(x[:, 0].astype(int).tolist()) == list(range(64))
        assert chunks == [4 * WIDE_ROW * 4] * 16, "each of the 16 chunks once, in the first epoch only"
    assert wholes == []
    list(ShardedDataset(wide.directory, verify_chunks=True).to_tf_dataset(8, shuffle=False))  # a second dataset
    assert len(chunks) == 16


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("batch,block", [(7, 3), (3, None), (64, 5), (1, None)])
def test_reads_across_chunk_borders_are_bit_identical(wide, shuffle, batch, block):
    kvram.data._verify.forget_checked()
    dataset = ShardedDataset(wide.directory, verify_chunks=True).to_tf_dataset(
        batch, shuffle=shuffle, seed=2, block_size=block
    )
    x = np.concatenate([b.numpy() for b in dataset])
    ids = x[:, 0].astype(int)
    assert sorted(ids.tolist()) == list(range(64))
    np.testing.assert_array_equal(x, np.repeat(ids[:, None].astype("float32"), WIDE_ROW, axis=1))


def test_a_field_of_empty_samples_has_no_chunks_and_reads(tmp_path):
    x = np.arange(40, dtype="float32").reshape(20, 2)
    data = write_shards({"x": x, "e": np.zeros((20, 0), "float32")}, tmp_path / "e", samples_per_shard=8, verbose=0)
    files = _index(data.directory)["shards"][0]["files"]
    assert "chunks" in files["x"] and "chunks" not in files["e"] and files["e"]["xxh3_128"]
    ex, ee = epoch(ShardedDataset(data.directory, verify_chunks=True).to_tf_dataset(6, shuffle=False, fields=["x", "e"]))
    np.testing.assert_array_equal(ex, x)
    assert ee.shape == (20, 0)


def test_verify_chunks_false_checks_whole_files_of_a_chunked_index(wide, monkeypatch):
    import xxhash

    kvram.data._verify.forget_checked()
    chunks, wholes = [], []
    real_chunk, real_whole = xxhash.xxh3_64_intdigest, kvram.data._verify.xxh3_128
    monkeypatch.setattr(xxhash, "xxh3_64_intdigest", lambda data: chunks.append(len(data)) or real_chunk(data))
    monkeypatch.setattr(kvram.data._verify, "xxh3_128", lambda path, *a: wholes.append(path) or real_whole(path, *a))
    dataset = ShardedDataset(wide.directory, verify_chunks=False)
    assert dataset.verify_chunks is False
    x = np.concatenate([b.numpy() for b in dataset.to_tf_dataset(7, shuffle=True, seed=0)])
    assert sorted(x[:, 0].astype(int).tolist()) == list(range(64))
    assert chunks == [] and sorted(map(os.path.basename, wholes)) == ["x-00000.npy", "x-00001.npy"]


def test_verify_chunks_false_still_fails_a_flipped_byte(wide):
    path = os.path.join(wide.directory, "x-00001.npy")
    _flip_a_byte(path, offset_from_end=(32 - 13) * WIDE_ROW * 4 - 8)
    kvram.data._verify.forget_checked()
    with pytest.raises(Exception, match="checksum mismatch") as error:
        epoch(ShardedDataset(wide.directory, verify_chunks=False).to_tf_dataset(4, shuffle=False))
    assert path in str(error.value) and "XXH3-64" not in str(error.value)


@pytest.mark.parametrize("cores,chunked", [(1, True), (2, True), (4, True), (8, False), (16, False)])
def test_verify_chunks_by_default_follows_the_cores(wide, monkeypatch, cores, chunked):
    monkeypatch.setattr(kvram.data._dataset, "_cores", lambda: cores)
    dataset = ShardedDataset(wide.directory)
    # larger machines check whole files, and keep the chunk digests for reads that come first
    assert dataset.verify_chunks is chunked and dataset._chunked
    assert dataset._chunks_until_whole is not chunked
    for explicit in (True, False):
        assert not ShardedDataset(wide.directory, verify_chunks=explicit)._chunks_until_whole


class _HeldWholeChecks:
    """Whole-file checks (`_verify.xxh3_128`) that wait until `release()`, counted."""

    def __init__(self, monkeypatch):
        import threading

        self.files, self._go, real = [], threading.Event(), kvram.data._verify.xxh3_128
        monkeypatch.setattr(kvram.data._verify, "xxh3_128",
                            lambda path, *a: self._go.wait(60) and (self.files.append(path) or real(path, *a)))

    def release(self):
        self._go.set()


@pytest.mark.parametrize("shuffle", [False, True])
def test_on_larger_machines_reads_check_chunks_until_their_file_is_checked_whole(wide, monkeypatch, shuffle):
    import time

    import xxhash

    monkeypatch.setattr(kvram.data._dataset, "_cores", lambda: 16)
    kvram.data._verify.forget_checked()
    chunks, real = [], xxhash.xxh3_64_intdigest
    monkeypatch.setattr(xxhash, "xxh3_64_intdigest", lambda data: chunks.append(len(data)) or real(data))
    held = _HeldWholeChecks(monkeypatch)
    dataset = ShardedDataset(wide.directory)
    # While the background threads hash whole files (held here), the reads wait for none: they check
    # the chunks they read, and the epoch is whole and bit-identical.
    x = np.concatenate([b.numpy() for b in dataset.to_tf_dataset(7, shuffle=shuffle, seed=0, block_size=3)])
    ids = x[:, 0].astype(int)
    assert sorted(ids.tolist()) == list(range(64))
    np.testing.assert_array_equal(x, np.repeat(ids[:, None].astype("float32"), WIDE_ROW, axis=1))
    assert len(chunks) == 16 and held.files == []
    # Once the files are checked whole, reads check no chunk, not even those this process has not
    # checked (the bitmaps cleared here); the whole checks ran once per file.
    held.release()
    deadline = time.monotonic() + 30
    while not all(dataset._verifier._done):
        assert time.monotonic() < deadline, "the background threads did not check the files"
        time.sleep(0.01)
    assert sorted(map(os.path.basename, held.files)) == ["x-00000.npy", "x-00001.npy"]
    for check in (c for s in dataset._shards for c in s.chunks.values()):
        check.checked[:] = bytes(check.count)
    chunks.clear()
    x = np.concatenate([b.numpy() for b in dataset.to_tf_dataset(7, shuffle=shuffle, seed=1, block_size=3)])
    assert sorted(x[:, 0].astype(int).tolist()) == list(range(64)) and chunks == []


@pytest.mark.parametrize("held", [True, False])  # the reads find the flip, or the whole check may first
def test_on_larger_machines_a_flipped_byte_fails_before_any_row_of_its_chunk_is_read(wide, monkeypatch, held):
    monkeypatch.setattr(kvram.data._dataset, "_cores", lambda: 16)
    path = os.path.join(wide.directory, "x-00001.npy")
    _flip_a_byte(path, offset_from_end=(32 - 13) * WIDE_ROW * 4 - 8)  # row 13 of shard 1: sample 45
    kvram.data._verify.forget_checked()
    whole = _HeldWholeChecks(monkeypatch)
    if not held:
        whole.release()
    seen = []
    with pytest.raises(Exception, match="checksum mismatch") as error:
        for x in ShardedDataset(wide.directory).to_tf_dataset(4, shuffle=False, num_parallel_reads=1):
            seen.extend(x.numpy()[:, 0].astype(int).tolist())
    whole.release()
    assert path in str(error.value)
    assert not any(44 <= i < 48 for i in seen), "a row of the corrupt chunk was handed out"
    if held:
        assert "XXH3-64" in str(error.value) and seen == list(range(44)), "the reads checked the chunks"


def test_verify_chunks_refuses_what_is_not_a_bool_or_none(wide):
    with pytest.raises(TypeError, match=r"`verify_chunks` must be None, True or False. Received: verify_chunks='yes'"):
        ShardedDataset(wide.directory, verify_chunks="yes")


@pytest.mark.parametrize("chunks", [{"rows": 0, "xxh3_64": ""}, {"rows": 4, "xxh3_64": "AAAA"}, {"rows": 4}, "x"])
def test_malformed_chunk_digests_are_an_error_at_open(wide, chunks):
    index = _index(wide.directory)
    index["shards"][1]["files"]["x"]["chunks"] = chunks
    _save_index(wide.directory, index)
    with pytest.raises(ShardError, match=r"shard 1, field 'x': 'chunks' must be"):
        ShardedDataset(wide.directory)


def test_index_holds_both_digests_and_old_indexes_are_checked_by_sha256(shards, monkeypatch):
    import hashlib

    import xxhash

    index = _index(shards.directory)
    entry = index["shards"][2]["files"]["x"]
    data = open(os.path.join(shards.directory, entry["name"]), "rb").read()
    assert entry["sha256"] == hashlib.sha256(data).hexdigest()
    assert entry["xxh3_128"] == xxhash.xxh3_128(data).hexdigest()
    # An index written before XXH3 (or without xxhash) is checked by SHA-256.
    for shard in index["shards"]:
        for info in shard["files"].values():
            del info["xxh3_128"]
    _save_index(shards.directory, index)
    _flip_a_byte(os.path.join(shards.directory, entry["name"]))
    kvram.data._verify.forget_checked()
    with pytest.raises(ShardError, match="checksum mismatch: SHA-256 [0-9a-f]{64}, index.json says"):
        ShardedDataset(shards.directory).read(600, 610)


def test_without_xxhash_the_sha256_is_checked(shards, monkeypatch):
    monkeypatch.setattr(kvram.data._verify, "have_xxhash", lambda: False)
    _flip_a_byte(os.path.join(shards.directory, "y-00001.npy"))
    kvram.data._verify.forget_checked()
    with pytest.raises(ShardError, match="checksum mismatch: SHA-256"):
        ShardedDataset(shards.directory).read(300, 310)


def test_batches_are_read_by_pread_into_arrays_of_their_own(shards, monkeypatch):
    """to_tf_dataset reads with os.preadv into new arrays (TF takes those
    without a copy), not through memmaps: np.load is never called."""
    x, y, w = arrays()
    dataset = ShardedDataset(shards.directory, verify_on_read=False)

    def no_memmap(*args, **kwargs):
        raise AssertionError("to_tf_dataset memory-mapped a shard")

    monkeypatch.setattr(np, "load", no_memmap)
    for shuffle in (False, True):
        ex, ey, ew = epoch(dataset.to_tf_dataset(96, shuffle=shuffle, seed=5, num_parallel_reads=-1))
        assert sorted(ey.tolist()) == list(range(N))
        np.testing.assert_array_equal(ex, x[ey])
        np.testing.assert_array_equal(ew, w[ey])


def test_memmap_and_pread_batches_are_equal(shards):
    dataset = ShardedDataset(shards.directory, verify_on_read=False)
    for shuffle in (False, True):
        by_pread = epoch(dataset.to_tf_dataset(96, shuffle=shuffle, seed=5))
        by_memmap = epoch(dataset.to_tf_dataset(96, shuffle=shuffle, seed=5, read="memmap"))
        for a, b in zip(by_pread, by_memmap):
            np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match=r'read must be "pread", "memmap" or "view". Received: read=\'mmap\''):
        dataset.to_tf_dataset(96, read="mmap")


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize(
    "batch,block,drop_remainder",
    [(100, None, False), (96, None, True), (7, 3, False), (40, 1, False), (1000, None, True)],
)
def test_view_batches_equal_pread_batches(shards, shuffle, batch, block, drop_remainder):
    """read="view" assembles the same batches as pread, in TensorFlow: one piece
    of a shard (in order, 100 of 300-row shards), several pieces (across shards,
    shuffled blocks), and more pieces than the graph unrolls (shuffled, 40
    blocks of 1 row; in order, batch 1000 over 4 shards)."""
    dataset = ShardedDataset(shards.directory, verify_on_read=False)
    options = dict(shuffle=shuffle, seed=5, block_size=block, drop_remainder=drop_remainder)
    by_pread = list(dataset.to_tf_dataset(batch, **options))
    view = dataset.to_tf_dataset(batch, read="view", **options)
    assert int(view.cardinality()) == len(by_pread)
    by_view = list(view)
    assert len(by_view) == len(by_pread)
    for a, b in zip(by_pread, by_view):
        for u, v in zip(a, b):
            np.testing.assert_array_equal(u.numpy(), v.numpy())
    if drop_remainder:
        assert view.element_spec[0].shape[0] == batch


def test_view_reads_every_sample_once_a_new_order_each_epoch(shards):
    x, y, w = arrays()
    dataset = ShardedDataset(shards.directory, verify_on_read=False)
    iterator = iter(dataset.to_tf_dataset(64, shuffle=True, seed=2, repeat=True, read="view"))
    orders = []
    for _ in range(2):
        batches = [next(iterator) for _ in range(-(-N // 64))]
        ex, ey, ew = (np.concatenate([b[i].numpy() for b in batches]) for i in range(3))
        assert sorted(ey.tolist()) == list(range(N))
        np.testing.assert_array_equal(ex, x[ey])
        np.testing.assert_array_equal(ew, w[ey])
        orders.append(ey)
    assert not np.array_equal(orders[0], orders[1])


def test_view_batches_in_one_shard_are_the_mapped_file(tmp_path):
    """In order, a batch that lies in one shard is a slice of the tensor over the
    memory-mapped file (DLPack): its memory is in the file's mapping, no copy.
    (TensorFlow's slice shares memory when a row is a multiple of 64 bytes,
    here 16 float32; otherwise it copies the slice.)"""
    x = np.arange(1000 * 16, dtype=np.float32).reshape(1000, 16)
    dataset = write_shards({"x": x}, tmp_path / "s", samples_per_shard=300, verbose=0)
    first = next(iter(dataset.to_tf_dataset(100, shuffle=False, read="view")))
    np.testing.assert_array_equal(first.numpy(), x[:100])
    mapped = []
    with open("/proc/self/maps") as handle:
        for line in handle:
            parts = line.split()
            if len(parts) >= 6 and parts[5] == str(tmp_path / "s" / "x-00000.npy"):
                low, high = parts[0].split("-")
                mapped.append((int(low, 16), int(high, 16)))
    address = np.asarray(first).ctypes.data
    assert mapped and any(low <= address < high for low, high in mapped), "the batch was copied"


@pytest.mark.parametrize("shuffle", [False, True])
def test_view_checks_a_shard_before_any_of_its_samples(shards, shuffle):
    path = os.path.join(shards.directory, "x-00002.npy")  # samples 600 to 899
    _flip_a_byte(path)
    kvram.data._verify.forget_checked()
    dataset = ShardedDataset(shards.directory, verify_threads=2)
    seen = []
    with pytest.raises(Exception, match="checksum mismatch") as error:
        for _, y, _ in dataset.to_tf_dataset(50, shuffle=shuffle, seed=1, read="view"):
            seen.extend(y.numpy().tolist())
    assert path in str(error.value) and "Samples 600 to 899 (shard 2)" in str(error.value)
    assert not any(600 <= i < 900 for i in seen), "a sample of the corrupt shard was handed out"


def test_view_of_checked_shards_reads_without_python(shards, monkeypatch):
    """Once every shard is checked, an epoch runs Python once (its plan), not per batch."""
    dataset = ShardedDataset(shards.directory)
    dataset.verify(verbose=0)
    calls = []
    plan = kvram.data._view.plan_pieces
    monkeypatch.setattr(kvram.data._view, "plan_pieces", lambda *a: calls.append(1) or plan(*a))
    stream = dataset.to_tf_dataset(10, shuffle=True, seed=0, read="view")
    calls.clear()
    assert len(list(stream)) == N // 10
    assert len(calls) == 1


def test_batch_arrays_are_reused_only_when_nothing_holds_them(shards):
    """TF takes the pool's aligned arrays without a copy; a batch dropped by
    the consumer gives its array back, a batch held keeps its contents."""
    x, y, w = arrays()
    dataset = ShardedDataset(shards.directory, verify_on_read=False)
    # dropped as they come: the same few arrays serve the whole epoch (one
    # reader, no prefetch: AUTOTUNE's readers keep more in flight). tf.data also
    # adds a prefetch of its own (inject_prefetch) whose buffer autotuning grows
    # when the machine is busy: 8-25 arrays over 6 epochs on the 2-core VM beside
    # the test suite (it failed the bound below once in a suite run), 3 in every
    # epoch without it; so it is off here.
    options = tf.data.Options()
    options.experimental_optimization.inject_prefetch = False
    addresses, rows = set(), 0
    batches = dataset.to_tf_dataset(10, shuffle=True, seed=3, prefetch=0, num_parallel_reads=1)
    for bx, by, bw in batches.with_options(options):
        addresses.add(np.asarray(bx).ctypes.data)
        rows += len(by)
    # 100 batches; without reuse, 100 arrays. tf.data's own buffers decide how
    # many are alive at once
    assert rows == N and len(addresses) < 25, (rows, len(addresses))
    # all held: every batch in memory of its own, none overwritten by a later one
    held = list(dataset.to_tf_dataset(10, shuffle=True, seed=3, prefetch=0))
    assert len({np.asarray(bx).ctypes.data for bx, _, _ in held}) == len(held)
    for bx, by, bw in held:
        np.testing.assert_array_equal(np.asarray(bx), x[np.asarray(by)])
        np.testing.assert_array_equal(np.asarray(bw), w[np.asarray(by)])


def test_a_shard_truncated_after_open_is_an_error_naming_it(shards):
    path = os.path.join(shards.directory, "x-00002.npy")
    dataset = ShardedDataset(shards.directory, verify_on_read=False)
    with open(path, "r+b") as handle:
        handle.truncate(os.path.getsize(path) - 24)
    with pytest.raises(Exception, match=r"x-00002.npy: ended early: shard 2 was truncated after the dataset was opened"):
        epoch(dataset.to_tf_dataset(100, shuffle=False))


def test_a_shard_deleted_after_open(shards):
    path = os.path.join(shards.directory, "y-00001.npy")
    for verify in (True, False):
        kvram.data._verify.forget_checked()
        dataset = ShardedDataset(shards.directory, verify_on_read=verify, verify_threads=0)
        dataset.read(0, 10)  # shard 0 read (and memmapped) before the deletion
        os.rename(path, path + ".away")
        with pytest.raises(ShardError, match=r"cannot be read \(No such file or directory\); was it "
                           r"deleted or moved after the dataset was opened\? Samples 300 to 599") as error:
            dataset.read(300, 310)
        assert error.value.path == path
        os.rename(path + ".away", path)
    # A shard already being read keeps its data when its files are deleted (POSIX).
    kvram.data._verify.forget_checked()
    dataset = ShardedDataset(shards.directory)
    first = epoch(dataset.to_tf_dataset(100, shuffle=False))
    for name in os.listdir(shards.directory):
        os.remove(os.path.join(shards.directory, name))
    second = epoch(dataset.to_tf_dataset(100, shuffle=False))
    for a, b in zip(first, second):
        np.testing.assert_array_equal(a, b)


def test_shards_without_checksums_warn_that_they_cannot_be_checked(tmp_path):
    x, y, _ = arrays(20)
    data = write_shards((x, y), tmp_path / "nosum", checksum=False, verbose=0)
    with pytest.warns(UserWarning, match="2 shard files have no checksum"):
        ShardedDataset(data.directory)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ShardedDataset(data.directory, verify_on_read=False)


@pytest.mark.parametrize(
    "kwargs, error, text",
    [
        ({"verify_on_read": 1}, TypeError, "verify_on_read=1"),
        ({"verify_threads": -1}, ValueError, "verify_threads=-1"),
        ({"verify_threads": 1.5}, ValueError, "verify_threads=1.5"),
    ],
)
def test_sharded_dataset_bad_arguments(shards, kwargs, error, text):
    with pytest.raises(error, match=text):
        ShardedDataset(shards.directory, **kwargs)


def test_not_a_shard_directory(tmp_path):
    with pytest.raises(ShardError, match="no such shard directory"):
        ShardedDataset(tmp_path / "nope")
    with pytest.raises(ShardError, match="missing: not a kvram shard directory"):
        ShardedDataset(tmp_path)


# Training


def test_fit_with_micro_batching_on_shards(tmp_path):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((256, 8)).astype("float32")
    y = rng.standard_normal((256, 1)).astype("float32")
    dataset = write_shards((x, y), tmp_path / "fit", samples_per_shard=100, verbose=0)
    inputs = keras.Input((8,))
    model = kvram.Model(inputs, keras.layers.Dense(1)(inputs), micro_batch_size=16)
    model.compile(optimizer="sgd", loss="mse")
    history = model.fit(dataset.to_tf_dataset(64, seed=0), epochs=2, verbose=0)
    assert len(history.history["loss"]) == 2
    assert int(model.optimizer.iterations.numpy()) == 2 * 4  # cardinality known: no extra step


def test_under_mirrored_strategy(tmp_path, mirrored):
    rng = np.random.default_rng(2)
    x = rng.standard_normal((128, 4)).astype("float32")
    y = rng.standard_normal((128, 1)).astype("float32")
    dataset = write_shards((x, y), tmp_path / "dist", samples_per_shard=50, verbose=0)
    with mirrored.scope():
        inputs = keras.Input((4,))
        model = keras.Model(inputs, keras.layers.Dense(1)(inputs))
        model.compile(optimizer="sgd", loss="mse")
    model.fit(dataset.to_tf_dataset(32, shuffle=True, seed=0), epochs=1, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 4


@pytest.mark.slow
def test_reading_much_more_than_memory_keeps_anonymous_memory_flat(tmp_path):
    """256 MiB of shards read end to end, every byte touched, in a fresh process:
    its RssAnon (heap, TF tensors) must grow by less than a quarter of that."""
    script = textwrap.dedent(
        f"""
        import os, sys, numpy as np
        os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
        sys.path.insert(0, {os.getcwd()!r})
        import kvram

        def rss_anon():
            for line in open("/proc/self/status"):
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024

        rows, width = 8192, 8192  # float32: 32 KiB a row, 256 MiB in all
        def batches():
            for i in range(0, rows, 512):
                yield np.full((512, width), i, np.float32)
        data = kvram.data.write_shards(batches(), {str(tmp_path / 'big')!r},
                                       samples_per_shard=1024, checksum=False, verbose=0)
        # a fixed prefetch: AUTOTUNE's buffer is tf.data's to size (up to its RAM
        # budget), and on a slow 2-core AMD EPYC it took 20-30 MiB more than 2 batches
        dataset = data.to_tf_dataset(256, shuffle=True, seed=0, prefetch=2)
        it = iter(dataset)
        total = float(next(it).numpy().sum())  # warm up tf.data and TF
        before = rss_anon()
        peak = before
        for batch in it:
            total += float(batch.numpy().sum())
            peak = max(peak, rss_anon())
        print(data.nbytes, before, peak)
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    nbytes, before, peak = map(int, out.stdout.split()[-3:])
    assert nbytes == 2**28
    print(f"RssAnon {before / 2**20:.0f} MiB -> peak {peak / 2**20:.0f} MiB reading {nbytes / 2**20:.0f} MiB")
    assert peak - before < nbytes / 4, (before / 2**20, peak / 2**20)


# Command line


def test_cli_write_and_inspect(tmp_path, capsys):
    from kvram.cli import main

    x, y, _ = arrays(50)
    np.savez(tmp_path / "d.npz", image=x, label=y)
    np.save(tmp_path / "extra.npy", y * 2)
    assert main(["shards", "write", str(tmp_path / "d.npz"), str(tmp_path / "out"),
                 "--samples-per-shard", "20"]) == 0
    dataset = ShardedDataset(tmp_path / "out")
    assert list(dataset.fields) == ["image", "label"] and len(dataset) == 50
    assert main(["shards", "write", str(tmp_path / "extra.npy"), str(tmp_path / "out2")]) == 0
    assert list(ShardedDataset(tmp_path / "out2").fields) == ["extra"]
    capsys.readouterr()
    assert main(["shards", "inspect", str(tmp_path / "out"), "--verify"]) == 0
    assert "checksums: all match" in capsys.readouterr().out
    assert main(["shards", "inspect", str(tmp_path / "out"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["samples"] == 50 and report["shards"] == 3 and report["checksums"]
    os.remove(tmp_path / "out" / "label-00001.npy")
    assert main(["shards", "inspect", str(tmp_path / "out")]) == 1
    assert "label-00001.npy: missing" in capsys.readouterr().err


# Nothing lost: what `overwrite` may replace


def _tree(root) -> dict:
    """{relative path: bytes, or None for a directory} of everything under `root`."""
    found = {}
    for folder, dirs, files in os.walk(root):
        for d in dirs:
            found[os.path.relpath(os.path.join(folder, d), root)] = None
        for f in files:
            with open(os.path.join(folder, f), "rb") as handle:
                found[os.path.relpath(os.path.join(folder, f), root)] = handle.read()
    return found


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_users_directory_is_never_replaced(tmp_path, overwrite):
    user = tmp_path / "userdir"
    (user / "chapters").mkdir(parents=True)
    (user / "thesis.tex").write_text("\\chapter{Four years}")
    (user / "chapters" / "one.tex").write_bytes(b"\x00\x01data")
    before = _tree(tmp_path)
    x, y, _ = arrays(20)
    with pytest.raises(FileExistsError, match=r"userdir exists and is not a kvram shard directory: it "
                       r"holds chapters/, thesis.tex and no kvram index.json\. kvram replaces only shard "
                       r"directories it wrote, with or without overwrite=True; nothing was written"):
        write_shards((x, y), user, overwrite=overwrite, verbose=0)
    assert _tree(tmp_path) == before


@pytest.mark.parametrize("overwrite", [False, True])
def test_an_existing_file_is_never_replaced(tmp_path, overwrite):
    target = tmp_path / "notes.txt"
    target.write_text("keep me")
    x, y, _ = arrays(20)
    with pytest.raises(FileExistsError, match=r"notes.txt exists and is not a kvram shard directory: it is "
                       r"a file of 7 bytes\."):
        write_shards((x, y), target, overwrite=overwrite, verbose=0)
    assert _tree(tmp_path) == {"notes.txt": b"keep me"}


def test_a_shard_directory_with_a_users_file_in_it_is_not_replaced(tmp_path):
    x, y, _ = arrays(20)
    data = write_shards((x, y), tmp_path / "s", samples_per_shard=10, verbose=0)
    with open(os.path.join(data.directory, "README.txt"), "w") as handle:
        handle.write("what these shards are")
    before = _tree(tmp_path)
    with pytest.raises(FileExistsError, match=r"besides its shards it holds README.txt, which its "
                       r"index.json does not list"):
        write_shards((x[:5], y[:5]), data.directory, overwrite=True, verbose=0)
    assert _tree(tmp_path) == before


def test_a_directory_with_another_programs_index_is_not_replaced(tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    (other / "index.json").write_text('{"format": "something-else", "shards": []}')
    x, y, _ = arrays(20)
    with pytest.raises(FileExistsError, match="it holds index.json and no kvram index.json"):
        write_shards((x, y), other, overwrite=True, verbose=0)
    assert (other / "index.json").read_text() == '{"format": "something-else", "shards": []}'


def test_a_link_is_not_replaced(tmp_path):
    x, y, _ = arrays(20)
    data = write_shards((x, y), tmp_path / "s", verbose=0)
    os.symlink(data.directory, tmp_path / "link")
    with pytest.raises(FileExistsError, match=r"it is a symbolic link to '.*s'"):
        write_shards((x, y), tmp_path / "link", overwrite=True, verbose=0)
    assert os.path.islink(tmp_path / "link") and len(ShardedDataset(data.directory)) == 20


def test_overwrite_replaces_a_shard_directory_and_an_empty_one_is_used(tmp_path):
    x, y, _ = arrays(20)
    (tmp_path / "empty").mkdir()
    assert len(write_shards((x, y), tmp_path / "empty", verbose=0)) == 20
    data = write_shards((x, y), tmp_path / "s", samples_per_shard=3, verbose=0)
    with pytest.raises(FileExistsError, match=r"s exists \(a kvram shard directory\); pass overwrite=True"):
        write_shards((x[:5], y[:5]), data.directory, verbose=0)
    os.remove(os.path.join(data.directory, "x-00002.npy"))  # a listed file gone: still kvram's own
    assert len(write_shards((x[:5], y[:5]), data.directory, overwrite=True, verbose=0)) == 5
    assert sorted(os.listdir(tmp_path)) == ["empty", "s"]


def test_shard_directories_get_a_plain_mkdirs_permissions(tmp_path):
    x, y, _ = arrays(20)
    old = os.umask(0o022)
    try:
        data = write_shards((x, y), tmp_path / "s", verbose=0)
        (tmp_path / "plain").mkdir()
    finally:
        os.umask(old)
    mode = os.stat(data.directory).st_mode & 0o777
    assert mode == 0o755 == os.stat(tmp_path / "plain").st_mode & 0o777
    for name in os.listdir(data.directory):
        assert os.stat(os.path.join(data.directory, name)).st_mode & 0o777 == 0o644


# Errors a user can catch


def test_a_shard_error_while_iterating_is_caught_as_shard_error(shards):
    _flip_a_byte(os.path.join(shards.directory, "x-00001.npy"), offset_from_end=5)
    kvram.data._verify.forget_checked()
    dataset = ShardedDataset(shards.directory).to_tf_dataset(100, shuffle=False)
    with pytest.raises(tf.errors.InvalidArgumentError):  # what tf.data raises, wrapping it
        epoch(dataset)
    with pytest.raises(ShardError, match=r"x-00001.npy: checksum mismatch") as caught:
        with kvram.data.raise_shard_errors():
            epoch(dataset)
    assert caught.value.path == os.path.join(shards.directory, "x-00001.npy")
    assert isinstance(caught.value.__cause__, tf.errors.InvalidArgumentError)
    with pytest.raises(ZeroDivisionError):  # other errors pass unchanged
        with kvram.data.raise_shard_errors():
            1 / 0


def test_a_shard_deleted_mid_read_is_caught_as_shard_error_from_fit(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((400, 4)).astype("float32")
    data = write_shards((x, x[:, :1]), tmp_path / "fit", samples_per_shard=100, verbose=0)
    dataset = ShardedDataset(data.directory, verify_on_read=False)
    os.remove(os.path.join(data.directory, "x-00002.npy"))
    inputs = keras.Input((4,))
    model = kvram.Model(inputs, keras.layers.Dense(1)(inputs))
    model.compile(optimizer="sgd", loss="mse")
    with pytest.raises(ShardError, match=r"x-00002.npy: cannot be read \(No such file or directory\)"):
        model.fit(dataset.to_tf_dataset(100, shuffle=False), verbose=0)
    with pytest.raises(ShardError, match=r"x-00002.npy: cannot be read"):
        model.evaluate(dataset.to_tf_dataset(100, shuffle=False), verbose=0)
    plain = keras.Model(inputs, model.outputs)  # plain Keras: inside raise_shard_errors
    plain.compile(optimizer="sgd", loss="mse")
    with pytest.raises(ShardError, match=r"x-00002.npy: cannot be read"):
        with kvram.data.raise_shard_errors():
            plain.fit(dataset.to_tf_dataset(100, shuffle=False), verbose=0)
