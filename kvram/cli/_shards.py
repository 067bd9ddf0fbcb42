"""`kvram shards write|write-images|inspect`."""

from __future__ import annotations

import json
import os
import sys
import zipfile

import numpy as np

from kvram import data
from kvram.data._writer import check_target


def _shards_write(args) -> int:
    *sources, out = args.paths
    understood = f"Understood: SRC {' '.join(sources) or '(none)'}, OUT {out}"
    if not sources:
        raise SystemExit(f"kvram shards write: give one .npz or one or more .npy files, then OUT/. {understood}")
    if out.endswith((".npz", ".npy")):
        raise SystemExit(f"kvram shards write: OUT {out} is named like a source: the last path is the output "
                         f"directory, so nothing was written. {understood}. Give OUT last: "
                         "kvram shards write SRC.npz OUT/")
    for source in sources:
        if os.path.abspath(source) == os.path.abspath(out) or (
                os.path.exists(source) and os.path.exists(out) and os.path.samefile(source, out)):
            raise SystemExit(f"kvram shards write: OUT {out} is also a source; nothing was written. {understood}")
    if os.path.lexists(out) and not os.path.isdir(out):
        raise SystemExit(f"kvram shards write: OUT {out} is an existing file, not a directory; nothing was "
                         f"written. {understood}")
    _check_out(out, args.overwrite)  # before reading the sources
    arrays = {}
    for source in sources:
        arrays.update(_read_arrays(source))
    fields = args.fields.split(",") if args.fields else None
    dataset = data.write_shards(
        arrays, out, samples_per_shard=args.samples_per_shard, fields=fields,
        overwrite=args.overwrite, verbose=1,
    )
    print(dataset)
    return 0


def _check_out(out: str, overwrite: bool) -> None:
    """The writer's refusal of `out` (`kvram.data` check_target), naming the command's flag."""
    try:
        check_target(out, overwrite, flag="--overwrite")
    except FileExistsError as error:
        raise SystemExit(f"kvram shards write: {error}") from None


def _read_arrays(source: str) -> dict:
    """{field: array} of a .npz (its arrays) or a .npy (one, named for the file), or a one-line error."""
    if not source.endswith((".npz", ".npy")):
        raise SystemExit(f"kvram shards write: {source}: expected a .npz or .npy file")
    if not os.path.isfile(source):
        raise SystemExit(f"kvram shards write: {source}: no such file")
    with open(source, "rb") as handle:
        magic = handle.read(6)
    kind, expected = (".npy", b"\x93NUMPY") if source.endswith(".npy") else (".npz", b"PK")
    if not magic.startswith(expected):
        what = "a .npy array file" if kind == ".npy" else "a zip of .npy arrays, as numpy.savez writes"
        raise SystemExit(f"kvram shards write: {source}: not a {kind} file (expected {what})")
    try:
        if source.endswith(".npy"):
            return {os.path.splitext(os.path.basename(source))[0]: np.load(source, mmap_mode="r", allow_pickle=False)}
        with np.load(source, allow_pickle=False) as bundle:
            arrays = {name: bundle[name] for name in bundle.files}
    except (ValueError, OSError, EOFError, zipfile.BadZipFile) as error:
        raise SystemExit(f"kvram shards write: {source}: not an array file numpy can read without pickle "
                         f"({type(error).__name__}: {error})") from None
    if not arrays:
        raise SystemExit(f"kvram shards write: {source} holds no arrays: nothing to write")
    return arrays


def _shards_write_images(args) -> int:
    try:
        check_target(args.out, args.overwrite, flag="--overwrite")
        dataset = data.write_image_shards(
            args.source, args.out, size=args.size, samples_per_shard=args.samples_per_shard,
            workers=args.workers, overwrite=args.overwrite, verbose=1,
        )
    except ImportError as error:
        raise SystemExit(f"kvram shards write-images needs Pillow (pip install 'kvram[images]'): {error}") from None
    except (FileNotFoundError, FileExistsError, ValueError) as error:
        raise SystemExit(f"kvram shards write-images: {error}") from None
    print(dataset)
    return 0


def _shards_inspect(args) -> int:
    try:
        dataset = data.ShardedDataset(args.directory)
        if args.verify:
            dataset.verify(verbose=1)
    except data.ShardError as error:
        print(f"kvram shards inspect: {error}", file=sys.stderr)
        return 1
    report = {
        "directory": dataset.directory,
        "samples": len(dataset),
        "shards": len(dataset.index["shards"]),
        "bytes": dataset.nbytes,
        "fields": {n: {"dtype": d.str, "shape": list(s)} for n, (d, s) in dataset.fields.items()},
        "checksums": all(
            f.get("sha256") for e in dataset.index["shards"] for f in e["files"].values()
        ),
        "verified": bool(args.verify),
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"{dataset.directory}: {report['samples']} samples in {report['shards']} shards, "
          f"{report['bytes'] / 2**20:.1f} MiB")
    for name, field in report["fields"].items():
        print(f"  {name:16} {field['dtype']:6} per-sample shape {tuple(field['shape'])}")
    if args.verify:
        print("  checksums: all match" if report["checksums"] else "  checksums: none stored")
    return 0
