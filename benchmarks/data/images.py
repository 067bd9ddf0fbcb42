"""Issue 13: decode-and-batch img/s from a folder of JPEGs, same images, same
cores, one run: kvram's shards (JPEG bytes decoded in tf.data, and decoded
uint8), PyTorch's DataLoader over torchvision's ImageFolder, and
keras.utils.image_dataset_from_directory. Every image is made here (numpy +
Pillow, one random stream per image; data_images_cpu.json was
made with one stream for the whole set: the same sizes and statistics), nothing
is downloaded.

    python benchmarks/data/images.py --images 20000 --workers 2 \\
        --torch-python /tmp/torchenv/bin/python --out images_cpu.json

Each loader resizes the shorter side to --size (bilinear) and centre-crops a
square (torchvision Resize + CenterCrop; Keras's crop_to_aspect_ratio crops
first, then resizes, the same pixels up to rounding). kvram's shards hold the
images already resized (`kvram shards write-images`, timed separately: a cost
paid once), so its loaders decode a --size JPEG (or read uint8) where the
others decode the original file and resize it every epoch. Each method runs
--epochs epochs, round-robin; the best epoch is reported (the first also warms
the page cache). tf.data uses a private pool of --workers threads; PyTorch
--workers processes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

SHAPES = [(320, 240), (400, 300), (500, 375), (240, 320), (375, 500)]  # width, height


def _make_some(directory, numbers, classes):
    from PIL import Image

    for i in numbers:
        rng = np.random.default_rng([0, i])  # one stream per image: the same set whatever the workers
        width, height = SHAPES[i % len(SHAPES)]
        folder = os.path.join(directory, f"class_{i % classes:02d}")
        os.makedirs(folder, exist_ok=True)
        y, x = np.mgrid[0:height, 0:width]
        base = rng.integers(0, 160, 3)
        pixels = base + 0.2 * x[..., None] + 0.15 * y[..., None] + rng.normal(0, 12, (height, width, 3))
        Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(
            os.path.join(folder, f"{i:06d}.jpg"), quality=90)


def make_images(directory, count, classes=10, workers=None):
    """`count` JPEGs of 5 sizes (320x240 to 500x375) in `classes` sub-folders,
    made in `workers` processes (default: every core)."""
    from concurrent.futures import ProcessPoolExecutor

    done = os.path.join(directory, ".complete")
    if os.path.exists(done) and open(done).read() == str(count):
        return
    started = time.perf_counter()
    workers = workers or len(os.sched_getaffinity(0))
    with ProcessPoolExecutor(workers) as pool:
        list(pool.map(_make_some, [directory] * workers,
                      [range(w, count, workers) for w in range(workers)], [classes] * workers))
    with open(done, "w") as f:
        f.write(str(count))
    print(f"made {count} JPEGs in {time.perf_counter() - started:.0f} s ({workers} processes)", flush=True)


def torch_epoch(args):
    """One process: PyTorch DataLoader over ImageFolder; prints JSON."""
    import torch
    import torchvision
    from torchvision import transforms

    transform = transforms.Compose([
        transforms.Resize(args.size, interpolation=transforms.InterpolationMode.BILINEAR),
        transforms.CenterCrop(args.size), transforms.PILToTensor()])
    folder = torchvision.datasets.ImageFolder(args.source, transform=transform)
    loader = torch.utils.data.DataLoader(folder, batch_size=args.batch, shuffle=True,
                                         num_workers=args.workers)
    seconds = []
    for _ in range(args.epochs):
        started, count = time.perf_counter(), 0
        for x, y in loader:
            count += len(y)
        seconds.append(time.perf_counter() - started)
    print("RESULT " + json.dumps({"images": count, "seconds_each": seconds,
                                  "torch": torch.__version__, "torchvision": torchvision.__version__}))


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--images", type=int, default=20000)
    parser.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--dir", default="/tmp/kvram-images-bench")
    parser.add_argument("--torch-python", default=None, help="a Python with torch and torchvision")
    parser.add_argument("--out", default="images.json")
    parser.add_argument("--torch-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--source", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.torch_child:
        return torch_epoch(args)

    import keras
    import tensorflow as tf

    from kvram import data

    source = os.path.join(args.dir, "jpeg")
    make_images(source, args.images)
    result = {"benchmark": "images", "issue": 13, "images": args.images, "workers": args.workers,
              "batch": args.batch, "size": args.size, "cpus": os.cpu_count(),
              "tensorflow": tf.__version__, "keras": keras.__version__,
              "python": sys.version.split()[0], "date": time.strftime("%Y-%m-%d"),
              "command": " ".join(sys.argv), "write_images": {}, "methods": {}}

    def save():
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)

    shards = {}
    for kind, encoded in (("jpeg", True), ("decoded", False)):
        out = os.path.join(args.dir, f"shards-{kind}")
        started = time.perf_counter()
        shards[kind] = data.write_image_shards(source, out, size=args.size, workers=args.workers,
                                               encoded=encoded, overwrite=True, verbose=0)
        seconds = time.perf_counter() - started
        result["write_images"][kind] = {"seconds": seconds, "images_per_second": args.images / seconds,
                                        "bytes": shards[kind].nbytes}
        print(kind, json.dumps(result["write_images"][kind]), flush=True)
        save()

    options = tf.data.Options()
    options.threading.private_threadpool_size = args.workers

    def tf_epoch(make):
        dataset = make().with_options(options)
        started, count = time.perf_counter(), 0
        for batch in dataset:
            count += int(batch[1].shape[0])
        return count, [time.perf_counter() - started]

    methods = {
        "kvram_jpeg": lambda: data.decode_jpeg(shards["jpeg"].to_tf_dataset(args.batch, shuffle=True)),
        "kvram_decoded": lambda: shards["decoded"].to_tf_dataset(args.batch, shuffle=True),
        "keras_image_dataset_from_directory": lambda: keras.utils.image_dataset_from_directory(
            source, image_size=(args.size, args.size), batch_size=args.batch, shuffle=True,
            crop_to_aspect_ratio=True, interpolation="bilinear", verbose=False).prefetch(tf.data.AUTOTUNE),
    }
    runs = {name: [] for name in list(methods) + (["torch_imagefolder"] if args.torch_python else [])}
    for epoch in range(args.epochs):
        for name in runs:
            if name == "torch_imagefolder":
                command = [args.torch_python, __file__, "--torch-child", "--source", source, "--batch",
                           str(args.batch), "--workers", str(args.workers), "--size", str(args.size),
                           "--epochs", "1"]
                done = subprocess.run(command, capture_output=True, text=True, timeout=3600)
                lines = [l for l in done.stdout.splitlines() if l.startswith("RESULT ")]
                if not lines:
                    raise SystemExit(done.stderr[-3000:])
                child = json.loads(lines[-1][7:])
                count, seconds = child["images"], child["seconds_each"]
                result["torch"], result["torchvision"] = child["torch"], child["torchvision"]
            else:
                count, seconds = tf_epoch(methods[name])
            assert count == args.images, (name, count)
            runs[name] += seconds
            print(name, f"epoch {epoch + 1}: {count / seconds[-1]:.0f} img/s", flush=True)
    for name, seconds in runs.items():
        result["methods"][name] = {"seconds_each": seconds, "images_per_second": args.images / min(seconds)}
    for name in runs:
        for other in runs:
            if other != name:
                result["methods"][name][f"vs_{other}"] = (result["methods"][name]["images_per_second"]
                                                          / result["methods"][other]["images_per_second"])
    save()
    print(json.dumps(result["methods"], indent=1))


if __name__ == "__main__":
    main()
