"""A folder of images (one sub-folder per class) to uint8 shards, on the shard
writer (`write_image_shards`, `kvram shards write-images`), and their JPEG bytes
decoded inside `tf.data` (`decode_jpeg`)."""

from __future__ import annotations

import collections
import concurrent.futures
import json
import os
import tempfile
import warnings

import numpy as np
import tensorflow as tf

from kvram import _checks
from kvram.data._writer import write_shards

RESIZE = "shorter side to `size` (bilinear, antialiased), then the centre `size` x `size` crop"


def _classes(source: str) -> tuple[list, list]:
    """Class names (sorted sub-folder names) and every file under them, as
    (path, label) sorted by class then path (hidden files included: a file
    that is not an image is reported, not ignored)."""
    if not os.path.isdir(source):
        raise FileNotFoundError(f"No such directory: {source!r} (expected one sub-folder per class)")
    names = sorted(e.name for e in os.scandir(source) if e.is_dir() and not e.name.startswith("."))
    if not names:
        raise ValueError(f"{source} has no class sub-folders: expected SRC/CLASS/IMAGE files, "
                         "as torchvision's ImageFolder and keras.utils.image_dataset_from_directory read them.")
    files = []
    for label, name in enumerate(names):
        for root, dirs, found in os.walk(os.path.join(source, name)):
            dirs.sort()
            files.extend((os.path.join(root, f), label) for f in sorted(found))
    return names, files


def _load(path: str, size: int, min_side: int, max_pixels: int, quality: int | None = None):
    """(pixels uint8 (size, size, 3) or None, action, reason): action is
    "ok", "converted" or "skipped". With `quality`: the pixels as JPEG bytes
    of that quality instead."""
    from PIL import Image, UnidentifiedImageError

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(path) as image:
                width, height = image.size
                if width * height > max_pixels:
                    return None, "skipped", f"too large: {width}x{height} is over {max_pixels} pixels"
                if min(width, height) < min_side:
                    return None, "skipped", f"too small: {width}x{height}, the shorter side is under {min_side}"
                mode, kind = image.mode, image.format
                if kind == "JPEG":
                    # decode at the smallest DCT scale still at least `size` on the shorter side
                    scale = min(width, height) / size
                    image.draft("RGB", (int(width / scale), int(height / scale)))
                image.load()
                reason = None
                if mode != "RGB":
                    reason = f"{mode} converted to RGB"
                    if mode in ("RGBA", "LA", "PA") or (mode == "P" and "transparency" in image.info):
                        # transparent pixels onto white, not onto whatever colour they hide
                        rgba = image.convert("RGBA")
                        image = Image.new("RGB", rgba.size, (255, 255, 255))
                        image.paste(rgba, mask=rgba.getchannel("A"))
                    else:
                        image = image.convert("RGB")
                pixels = _resize(image, size)
    except (UnidentifiedImageError, Image.DecompressionBombError, Image.DecompressionBombWarning) as error:
        return None, "skipped", f"not an image Pillow can read ({type(error).__name__}: {error})"
    except (OSError, SyntaxError, ValueError) as error:  # truncated or corrupt data
        return None, "skipped", f"corrupt ({type(error).__name__}: {error})"
    if quality is not None:
        pixels = _jpeg(pixels, quality)
    return pixels, ("ok" if reason is None else "converted"), reason


def _jpeg(pixels: np.ndarray, quality: int) -> bytes:
    import io

    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="JPEG", quality=quality)
    return out.getvalue()


def _resize(image, size: int) -> np.ndarray:
    from PIL import Image

    width, height = image.size
    scale = size / min(width, height)
    new = (max(size, round(width * scale)), max(size, round(height * scale)))
    if new != image.size:
        image = image.resize(new, Image.Resampling.BILINEAR, reducing_gap=None)
    left, top = (new[0] - size) // 2, (new[1] - size) // 2
    return np.asarray(image.crop((left, top, left + size, top + size)), dtype=np.uint8)


def write_image_shards(
    source,
    directory,
    size: int = 224,
    samples_per_shard: int = 4096,
    workers: int | None = None,
    min_side: int = 8,
    max_pixels: int | None = None,
    checksum: bool = True,
    overwrite: bool = False,
    verbose: int = 1,
    encoded: bool = False,
    quality: int = 90,
):
    """Decodes a folder of images, one sub-folder per class (the layout of
    torchvision's `ImageFolder` and `keras.utils.image_dataset_from_directory`),
    into uint8 shards: fields "x" (N, size, size, 3) and "y" (int64 labels, the
    classes' sorted order).

    Images are decoded with Pillow in `workers` threads (Pillow releases the
    GIL while it decodes and resizes), in order, and resized: the shorter side
    to `size` (bilinear, antialiased), then the centre `size` x `size` crop
    (torchvision's Resize(size) + CenterCrop(size)). A JPEG is decoded at the
    smallest DCT scale still at least `size` on its shorter side (Pillow's
    `draft`), which is most of the speed of a large JPEG.

    Files are converted or skipped, never fatal: grayscale, CMYK, palette and
    16-bit images are converted to RGB (transparency onto white); a file
    Pillow cannot identify (not an image), a corrupt or truncated image, one
    whose shorter side is under `min_side` and one of more than `max_pixels`
    are skipped. Each is listed with its reason in the index's "report" and
    in `report.json`, and counted in the summary printed at the end.

    The write is `write_shards`'s: atomic (nothing under `directory` until
    complete; an interrupted or killed run leaves no partial output under
    that name), with a progress bar of images decoded.

    Args:
        source: the folder of class sub-folders.
        directory: where to write, as for `write_shards`: a new path, an empty
            directory, or (with `overwrite=True`) a kvram shard directory;
            never anything else.
        size: int >= 1, the side of the square output.
        samples_per_shard: images per shard file.
        workers: decoding threads (default: the CPUs this process may use).
        min_side: shorter sides below this are skipped.
        max_pixels: larger images are skipped (default: Pillow's
            `Image.MAX_IMAGE_PIXELS`, its decompression-bomb limit).
        checksum: as for `write_shards`.
        overwrite: as for `write_shards`.
        verbose: 0 or 1: progress bar and summary.
        encoded: store each image, resized and cropped as above, as JPEG bytes
            of `quality` (field "jpeg", numpy fixed-width bytes as wide as the
            longest encoding, which JPEG's end marker lets trailing zero bytes
            pad), to be decoded while training by `decode_jpeg` (for data sets
            too large to store decoded: a 224x224 photo is 147 KiB decoded and
            typically 10-30 KiB as JPEG). The encodings are spooled to an
            unnamed temporary file next to `directory`, then written.
        quality: JPEG quality (1-95) with `encoded`.

    Returns:
        The `ShardedDataset`; its `index["classes"]` are the class names,
        `index["report"]` the files converted or skipped, with reasons.
    """
    from PIL import Image

    size = _checks.positive_int("size", size)
    min_side = _checks.positive_int("min_side", min_side)
    workers = _checks.positive_int("workers", workers, allow_none=True) or len(os.sched_getaffinity(0))
    max_pixels = (_checks.positive_int("max_pixels", max_pixels, allow_none=True)
                  or Image.MAX_IMAGE_PIXELS or 2**62)  # None: Pillow's check turned off
    if not (isinstance(quality, int) and 1 <= quality <= 95):
        raise ValueError(f"quality must be an int in [1, 95] (Pillow's JPEG range). Received: quality={quality!r}")
    source = os.path.abspath(os.fspath(source))
    names, files = _classes(source)
    if not files:
        raise ValueError(f"{source}: the class sub-folders {names} hold no files.")
    report, counts = [], collections.Counter()
    progress = None
    if verbose:
        from keras.utils import Progbar

        progress = Progbar(len(files), unit_name="image")

    def decoded():
        chunk = max(64, 8 * workers)
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            for start in range(0, len(files), chunk):
                part = files[start:start + chunk]
                results = pool.map(
                    lambda f: _load(f[0], size, min_side, max_pixels, quality if encoded else None), part)
                xs, ys = [], []
                for (path, label), (pixels, action, reason) in zip(part, results):
                    counts[action] += 1
                    if reason is not None:
                        report.append({"path": os.path.relpath(path, source), "action": action, "reason": reason})
                    if pixels is not None:
                        xs.append(pixels)
                        ys.append(label)
                if progress is not None:
                    progress.update(min(start + chunk, len(files)))
                if xs:
                    yield xs, np.asarray(ys, np.int64)

    def batches():
        if not encoded:
            for xs, ys in decoded():
                yield {"x": np.stack(xs), "y": ys}
            return
        # JPEG lengths vary and a field's rows have one width: spool, then pad to the longest
        with tempfile.TemporaryFile(dir=os.path.dirname(os.path.abspath(os.fspath(directory)))) as spool:
            parts = []
            for xs, ys in decoded():
                lengths = np.array([len(b) for b in xs], np.int64)
                spool.write(b"".join(xs))
                parts.append((lengths, ys))
            width = max(int(lengths.max()) for lengths, _ in parts)
            spool.seek(0)
            for lengths, ys in parts:
                blobs = [spool.read(int(n)) for n in lengths]
                yield {"jpeg": np.array(blobs, dtype=f"S{width}"), "y": ys}

    def metadata(staging):
        found = {"classes": names, "source": source, "size": size, "resize": RESIZE,
                 "encoding": f"JPEG quality {quality}" if encoded else None,
                 "counts": {k: counts[k] for k in ("ok", "converted", "skipped")}, "report": report}
        with open(os.path.join(staging, "report.json"), "w") as handle:
            json.dump({"counts": found["counts"], "files": report}, handle, indent=1)
        return found

    try:
        dataset = write_shards(
            batches(), directory, samples_per_shard=samples_per_shard, checksum=checksum,
            overwrite=overwrite, verbose=0, _metadata=metadata,
        )
    except ValueError as error:
        if counts["ok"] + counts["converted"]:
            raise
        reasons = collections.Counter(r["reason"].split(":")[0] for r in report)
        raise ValueError(f"{source}: every one of the {len(files)} files was skipped "
                         f"({dict(reasons)}); nothing was written.") from error
    if verbose:
        c = dataset.index["counts"]
        print(f"{len(files)} files in {len(names)} classes: {c['ok']} written as they were, "
              f"{c['converted']} converted, {c['skipped']} skipped; report: "
              f"{os.path.join(dataset.directory, 'report.json')}")
    return dataset


def decode_jpeg(dataset, crop: int | None = None, random_crop: bool = False, flip: bool = False,
                seed: int | None = None, field=0):
    """Decodes the JPEG bytes of a batched dataset (`ShardedDataset.to_tf_dataset`
    of shards from `write_image_shards(..., encoded=True)`) into uint8 images,
    in parallel, inside tf.data.

    Args:
        dataset: batches whose element `field` (index of a tuple, or key of a
            dict) is a string tensor of JPEG bytes.
        crop: None (the whole image) or the side of a square crop, taken from
            the centre, or anywhere with `random_crop`; only the crop's part of
            the image is decoded (`tf.image.decode_and_crop_jpeg`).
        random_crop: a new random crop position per image.
        flip: flip each image left-right with probability 1/2.
        seed: op-level seed of the random crop and flip (each iterator then
            gives the same sequence).

    Returns:
        The dataset with that element replaced by uint8 images (batch, h, w, 3).
    """
    if crop is not None and not (isinstance(crop, int) and crop >= 1):
        raise ValueError(f"crop must be None or an int >= 1. Received: crop={crop!r}")
    if random_crop and crop is None:
        raise ValueError("random_crop needs crop (the side of the crop).")

    def one(data):
        if crop is None:
            image = tf.io.decode_jpeg(data, channels=3)
        else:
            shape = tf.io.extract_jpeg_shape(data)
            room = shape[:2] - crop
            tf.debugging.assert_non_negative(room, message=f"an image is smaller than crop={crop}")
            if random_crop:
                corner = tf.cast(tf.random.uniform([2], seed=seed) * tf.cast(room + 1, tf.float32), tf.int32)
                corner = tf.minimum(corner, room)
            else:
                corner = room // 2
            image = tf.image.decode_and_crop_jpeg(data, tf.stack([corner[0], corner[1], crop, crop]), channels=3)
        if flip:
            image = tf.image.random_flip_left_right(image, seed=seed)
        return image

    def batch(*element):
        element = list(element) if len(element) > 1 else element[0]
        jpegs = element[field]
        images = tf.map_fn(one, jpegs, fn_output_signature=tf.TensorSpec((crop, crop, 3), tf.uint8),
                           parallel_iterations=16)
        element[field] = images
        return tuple(element) if isinstance(element, list) else element

    return dataset.map(batch, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
