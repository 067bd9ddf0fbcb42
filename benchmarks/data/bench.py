"""Reading memmapped shards: kvram's tf.data pipeline vs raw numpy vs tf.data's own.

`io` evicts the files from the page cache (`posix_fadvise(DONTNEED)`) before each
method unless `--cached`, and its consumer copies every batch into one preallocated
buffer (`np.copyto`), so every byte is touched the same way by every method;
`verify_cost` is 1 - checked / unchecked bandwidth. `train` samples the GPU's
utilisation through NVML every 50 ms. The methods and how to run them: README.md."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)
from benchmarks.common import child_result, gpu_name, result_header, run_child, versions, write_result  # noqa: E402
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def evict(directory):
    os.sync()  # dirty pages cannot be dropped
    for name in os.listdir(directory):
        path = os.path.join(directory, name)
        with open(path, "rb") as handle:
            os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def make_shards(directory, gib, row_kib):
    from kvram.data import write_shards

    width = row_kib * 256  # float32
    rows = int(gib * 2**30) // (width * 4)

    def batches():
        for start in range(0, rows, 1024):
            n = min(1024, rows - start)
            yield np.full((n, width), start, np.float32)

    # With checksums, as write_shards writes by default: the readers below check them.
    return write_shards(batches(), directory, samples_per_shard=8192, overwrite=True, verbose=0)


def io(args):
    import tensorflow as tf

    from kvram.data import ShardedDataset, _verify

    directory = args.dir or os.path.join(tempfile.gettempdir(), "kvram-io-bench")
    index = os.path.join(directory, "index.json")
    if not os.path.exists(index) or '"sha256": null' in open(index).read() or '"chunks"' not in open(index).read():
        make_shards(directory, args.gib, args.row_kib)
    data = ShardedDataset(directory, verify_on_read=False)
    nbytes, batch = data.nbytes, args.batch
    field = list(data.fields)[0]
    rows = len(data)
    width = data.fields[field][1]
    buffer = np.empty((batch,) + width, np.float32)

    def consume(array):
        # np.asarray of a CPU tensor is its memory (EagerTensor.numpy() would copy it
        # first: a copy of the harness's, not the reader's): every method touches each
        # byte once, by this copy.
        np.copyto(buffer[: len(array)], np.asarray(array))

    def raw():
        for start in range(0, rows, batch):
            consume(data.read(start, min(start + batch, rows), [field])[field])

    def kvram_pipeline(shuffle, verify=True, read="pread"):
        """A fresh dataset and pipeline each round, checked and unchecked alike, so
        that `verify_cost` compares the same work but the check. With `verify`, every
        byte is checked on its first read (this process forgets earlier checks first):
        a first epoch, the check's worst case, as `verify_chunks=None` chooses for
        this machine's cores."""

        def run():
            _verify.forget_checked()
            fresh = ShardedDataset(directory, verify_on_read=verify)
            for item in fresh.to_tf_dataset(batch, shuffle=shuffle, seed=0, read=read):
                consume(item)
        return run

    def from_generator():
        def generate():
            for start in range(0, rows, batch):
                yield data.read(start, min(start + batch, rows), [field])[field]
        dataset = tf.data.Dataset.from_generator(
            generate, output_signature=tf.TensorSpec((None,) + width, tf.float32)
        ).prefetch(tf.data.AUTOTUNE)
        for item in dataset:
            consume(item)

    def tf_data_floor():
        """What any tf.data reader costs at the least in this harness: a dataset that reads
        nothing (one batch-sized tensor, 64-byte aligned, repeated) iterated by the same
        consumer loop. Its source stays in the CPU's cache, so this is an upper bound."""
        block = tf.constant(np.ones((batch,) + width, np.float32))
        for item in tf.data.Dataset.from_tensors(block).repeat(-(-rows // batch)):
            consume(item)

    loaded = {}

    def from_tensor_slices():
        started = time.perf_counter()
        array = np.concatenate([data.read(s.start, s.start + s.samples, [field])[field]
                                for s in data._shards])
        loaded["seconds"] = time.perf_counter() - started
        dataset = tf.data.Dataset.from_tensor_slices(array).batch(batch).prefetch(tf.data.AUTOTUNE)
        started = time.perf_counter()
        for item in dataset:
            consume(item)
        loaded["iterate_seconds"] = time.perf_counter() - started

    methods = {
        "raw_memmap_copy": raw,
        "kvram": kvram_pipeline(False),
        "kvram_unverified": kvram_pipeline(False, verify=False),
        "kvram_shuffled": kvram_pipeline(True),
        "kvram_shuffled_unverified": kvram_pipeline(True, verify=False),
        "kvram_view": kvram_pipeline(False, read="view"),
        "kvram_unverified_view": kvram_pipeline(False, verify=False, read="view"),
        "tf_data_floor": tf_data_floor,
        "from_generator": from_generator,
        "from_tensor_slices": from_tensor_slices,
    }
    results = {}
    names = args.methods or list(methods)
    runs = {name: [] for name in names}
    for round_ in range(args.repeat):  # round-robin, so drift hits every method alike
        for name in names:
            if not args.cached:
                evict(directory)
            started = time.perf_counter()
            methods[name]()
            runs[name].append(time.perf_counter() - started)
            print(name, f"round {round_ + 1}: {nbytes / runs[name][-1] / 1e9:.2f} GB/s", flush=True)
    for name in names:
        seconds = float(np.median(runs[name]))
        results[name] = {"seconds": seconds, "gb_per_s": nbytes / seconds / 1e9,
                         "seconds_each": runs[name]}
        if name == "from_tensor_slices":
            results[name].update(load_seconds=loaded["seconds"],
                                 iterate_gb_per_s=nbytes / loaded["iterate_seconds"] / 1e9)
        print(name, json.dumps(results[name]), flush=True)
    raw_rate = results.get("raw_memmap_copy", {}).get("gb_per_s")
    if raw_rate:
        for record in results.values():
            record["fraction_of_raw"] = record["gb_per_s"] / raw_rate
    for name in results:
        if not name.startswith("kvram") or "unverified" in name:
            continue
        base = "kvram_shuffled" if name.startswith("kvram_shuffled") else "kvram"
        unverified = base + "_unverified" + name[len(base):]  # kvram_view: kvram_unverified_view
        if unverified in results:
            results[name]["verify_cost"] = 1 - results[name]["gb_per_s"] / results[unverified]["gb_per_s"]
    return {"bytes": nbytes, "rows": rows, "repeat": args.repeat, "row_bytes": int(np.prod(width)) * 4, "batch": batch,
            "page_cache_evicted_before_each": not args.cached, "directory": directory,
            "results": results}


def train_child(args):
    import keras
    import tensorflow as tf

    import kvram

    kvram.precision.enable("mixed_bfloat16")
    with tf.device("GPU:0"):
        base = keras.applications.ResNet50(weights=None, input_shape=(224, 224, 3))
        inputs = keras.Input((224, 224, 3), dtype="uint8")
        x = keras.layers.Rescaling(1 / 255.0)(inputs)
        model = keras.Model(inputs, base(x))
        model.compile(optimizer=keras.optimizers.SGD(0.01, momentum=0.9),
                      loss="sparse_categorical_crossentropy", jit_compile=False)
    data = kvram.data.ShardedDataset(args.dir)
    if args.source == "shards":
        dataset = data.to_tf_dataset(args.batch, shuffle=True, seed=0, fields=("x", "y"),
                                     drop_remainder=True)
    else:
        arrays = data.read(0, len(data))
        dataset = tf.data.Dataset.from_tensor_slices((arrays["x"], arrays["y"]))
        dataset = dataset.shuffle(len(data), seed=0).batch(args.batch, drop_remainder=True)
        dataset = dataset.prefetch(tf.data.AUTOTUNE)
    model.fit(dataset, epochs=1, verbose=0)  # warm-up: tracing, autotuning
    if args.source == "shards":
        evict(args.dir)
    samples, stop = [], threading.Event()
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    except Exception:  # noqa: BLE001 - no NVML on CPU machines: no utilisation figures
        handle = None

    def sample():
        while handle is not None and not stop.is_set():
            samples.append(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)
            time.sleep(0.05)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    started = time.perf_counter()
    model.fit(dataset, epochs=args.epochs, verbose=0)
    seconds = time.perf_counter() - started
    stop.set()
    thread.join()
    steps = args.epochs * (len(data) // args.batch)
    return {"source": args.source, "img_per_s": steps * args.batch / seconds, "seconds": seconds,
            "epochs": args.epochs,
            "gpu_util_mean_percent": float(np.mean(samples)) if samples else None,
            "gpu_idle_share": 1 - float(np.mean(samples)) / 100 if samples else None,
            "util_samples": len(samples),
            "first_timed_epoch_from_disk": args.source == "shards"}


def train(args):
    from kvram.data import write_shards

    directory = args.dir or os.path.join(tempfile.gettempdir(), "kvram-train-bench")
    if not os.path.exists(os.path.join(directory, "index.json")):
        rng = np.random.default_rng(0)

        def batches():
            for start in range(0, args.images, 256):
                n = min(256, args.images - start)
                yield (rng.integers(0, 256, (n, 224, 224, 3), dtype=np.uint8),
                       rng.integers(0, 1000, n).astype(np.int32))

        write_shards(batches(), directory, samples_per_shard=1024, checksum=False, verbose=0)
    results = {}
    for source in ("memory", "shards"):
        command = [sys.executable, os.path.abspath(__file__), "train-child", "--dir", directory,
                   "--source", source, "--batch", str(args.batch), "--epochs", str(args.epochs)]
        records, error, _ = run_child(command, args.timeout)
        results[source] = {"error": error} if error else records[-1]
        print(source, json.dumps(results[source]), flush=True)
    if "img_per_s" in results.get("shards", {}) and "img_per_s" in results.get("memory", {}):
        results["img_per_s_ratio_shards_over_memory"] = (
            results["shards"]["img_per_s"] / results["memory"]["img_per_s"])
    return {"images": args.images, "batch": args.batch, "results": results}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p_io = sub.add_parser("io")
    p_io.add_argument("--gib", type=float, default=1.0)
    p_io.add_argument("--row-kib", type=int, default=64)
    p_io.add_argument("--batch", type=int, default=64)
    p_io.add_argument("--dir")
    p_io.add_argument("--out", default="io.json")
    p_io.add_argument("--cached", action="store_true", help="do not evict the page cache")
    p_io.add_argument("--methods", nargs="*")
    p_io.add_argument("--repeat", type=int, default=1,
                      help="passes per method, round-robin; the median is reported")
    p_train = sub.add_parser("train")
    p_train.add_argument("--images", type=int, default=4096)
    p_train.add_argument("--batch", type=int, default=256)
    p_train.add_argument("--epochs", type=int, default=2)
    p_train.add_argument("--dir")
    p_train.add_argument("--timeout", type=int, default=300)
    p_train.add_argument("--out", default="train.json")
    p_child = sub.add_parser("train-child")
    for flag in ("--dir", "--source"):
        p_child.add_argument(flag)
    p_child.add_argument("--batch", type=int)
    p_child.add_argument("--epochs", type=int)
    args = parser.parse_args(argv)
    if args.command == "train-child":
        child_result(train_child(args))
        return
    record = {**result_header(f"data-{args.command}", __file__), **{"io": io, "train": train}[args.command](args)}
    with open("/proc/cpuinfo") as cpuinfo:
        avx512 = " avx512f" in cpuinfo.read()
    record.update(versions=versions(), gpu=gpu_name(), cpu_cores=os.cpu_count(), avx512=avx512)
    write_result(args.out, record)


if __name__ == "__main__":
    main()
