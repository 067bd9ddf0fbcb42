"""What the chunk check costs the reader itself, without tf.data: one thread
reads every row of a shard directory (the one `bench.py io` writes) through
`ShardedDataset._read_into`, as `to_tf_dataset`'s pread path does, in order
(batches of `--batch` rows) and shuffled (its blocks of batch // 8 rows, in
one epoch's order), unchecked and with every chunk checked as it is read (a
fresh dataset, nothing checked yet, each round). Also the hash alone: XXH3-64
of one 256 KiB buffer (in the CPU's cache) and of a 1 GiB one (from memory).
Medians of `--repeat` rounds.

    python benchmarks/data/read_cost.py --dir /tmp/kvram-io-cpu --out read_cost_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

from kvram.data import ShardedDataset, _verify  # noqa: E402


def epoch_seconds(directory, verify, shuffle, batch) -> float:
    _verify.forget_checked()
    data = ShardedDataset(directory, verify_on_read=verify, verify_chunks=True)
    name = list(data.fields)[0]
    dtype, shape = data.fields[name]
    out = np.empty((batch,) + shape, dtype)
    if shuffle:
        blocks, _ = data._epoch_plan(max(1, batch // 8), 0)
        ranges = [(int(a), int(b)) for a, b in blocks]
    else:
        ranges = [(s, min(s + batch, len(data))) for s in range(0, len(data), batch)]
    started = time.perf_counter()
    for start, stop in ranges:
        data._read_into(start, stop, {name: out[: stop - start]}, 0)
    return time.perf_counter() - started


def hash_gb_per_s(nbytes, total=4 * 2**30) -> float:
    import xxhash

    buffer = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    started = time.perf_counter()
    for _ in range(max(1, total // nbytes)):
        xxhash.xxh3_64_intdigest(buffer)
    return max(1, total // nbytes) * nbytes / (time.perf_counter() - started) / 1e9


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", required=True)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--out", default="read_cost_cpu.json")
    args = parser.parse_args(argv)
    data = ShardedDataset(args.dir, verify_on_read=False)
    runs = {}
    for _ in range(args.repeat):  # round-robin
        for shuffle in (False, True):
            for verify in (False, True):
                key = ("shuffled" if shuffle else "in_order") + ("_chunks_checked" if verify else "_unchecked")
                runs.setdefault(key, []).append(epoch_seconds(args.dir, verify, shuffle, args.batch))
    results = {k: {"seconds": float(np.median(v)), "seconds_each": v} for k, v in runs.items()}
    for order in ("in_order", "shuffled"):
        results[order + "_chunks_checked"]["extra_seconds"] = (
            results[order + "_chunks_checked"]["seconds"] - results[order + "_unchecked"]["seconds"])
    record = {
        "bytes": data.nbytes, "batch": args.batch, "repeat": args.repeat, "results": results,
        "xxh3_64_gb_per_s": {"256KiB_in_cache": hash_gb_per_s(256 * 2**10), "1GiB_from_memory": hash_gb_per_s(2**30)},
        "command": " ".join(sys.argv), "python": platform.python_version(), "cpus": os.cpu_count(),
        "date": time.strftime("%Y-%m-%d"),
    }
    print(json.dumps({k: round(v["seconds"], 3) for k, v in results.items()}), record["xxh3_64_gb_per_s"])
    with open(args.out, "w") as handle:
        json.dump(record, handle, indent=1)


if __name__ == "__main__":
    main()
