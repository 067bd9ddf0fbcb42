"""Why first-epoch checks cost what they cost: on one shard directory (made by
`bench.py io`), the hashes' own speed on one idle thread, and a first epoch read
`to_tf_dataset(shuffle=False, read=..., num_parallel_reads=-1)` by one consumer
copying every batch, checked with 0, 1 (the default on 2 cores) or 2
background threads, and unchecked: wall time and the time reads spent waiting in
`ShardVerifier.ensure` (a shard's check, by a background thread or the read).

    python benchmarks/data/bench.py io --gib 4 --cached --methods raw_memmap_copy --dir /tmp/kvram-io
    python benchmarks/data/verify_waits.py --dir /tmp/kvram-io --out verify_waits.json
"""

from __future__ import annotations

import argparse
import glob
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


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", required=True)
    parser.add_argument("--read", default="view", choices=("view", "pread"))
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--out", default="verify_waits.json")
    args = parser.parse_args(argv)
    files = sorted(glob.glob(os.path.join(args.dir, "*.npy")))
    total = sum(os.path.getsize(f) for f in files)
    record = {"bytes": total, "read": args.read, "batch": args.batch, "repeat": args.repeat,
              "cpus": os.cpu_count(), "hash_gb_per_s_one_idle_thread": {}, "epochs": {}}
    for name, digest in (("xxh3_128", _verify.xxh3_128), ("sha256", _verify.sha256)):
        started = time.perf_counter()
        for path in files:
            digest(path)
        record["hash_gb_per_s_one_idle_thread"][name] = total / (time.perf_counter() - started) / 1e9
    print(json.dumps(record["hash_gb_per_s_one_idle_thread"]), flush=True)

    waits = []
    ensure = _verify.ShardVerifier.ensure

    def timed_ensure(self, number):
        started = time.perf_counter()
        try:
            return ensure(self, number)
        finally:
            waits.append(time.perf_counter() - started)

    _verify.ShardVerifier.ensure = timed_ensure
    data = ShardedDataset(args.dir, verify_on_read=False)
    width = data.fields[list(data.fields)[0]][1]
    buffer = np.empty((args.batch,) + width, data.fields[list(data.fields)[0]][0])
    cases = [("unchecked", False, None), ("checked, 0 threads", True, 0),
             ("checked, default threads", True, None), ("checked, 2 threads", True, 2)]
    runs = {name: [] for name, _, _ in cases}
    for _ in range(args.repeat):  # round-robin
        for name, verify, threads in cases:
            _verify.forget_checked()
            waits.clear()
            fresh = ShardedDataset(args.dir, verify_on_read=verify, verify_threads=threads)
            started = time.perf_counter()
            for item in fresh.to_tf_dataset(args.batch, shuffle=False, read=args.read):
                np.copyto(buffer[: len(item)], np.asarray(item))
            runs[name].append({"seconds": time.perf_counter() - started, "waiting_seconds": sum(waits)})
    for name, each in runs.items():
        seconds = float(np.median([r["seconds"] for r in each]))
        record["epochs"][name] = {"seconds": seconds, "gb_per_s": total / seconds / 1e9,
                                  "waiting_seconds": float(np.median([r["waiting_seconds"] for r in each])),
                                  "each": each}
        print(name, json.dumps({k: v for k, v in record["epochs"][name].items() if k != "each"}), flush=True)
    base = record["epochs"]["unchecked"]["seconds"]
    for name, entry in record["epochs"].items():
        entry["cost"] = entry["seconds"] / base - 1
    record.update(command=" ".join([os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:]),
                  python=platform.python_version(), date=time.strftime("%Y-%m-%d"))
    with open(args.out, "w") as handle:
        json.dump(record, handle, indent=1)


if __name__ == "__main__":
    main()
