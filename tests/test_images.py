"""Image folders to shards (issue 13): `kvram.data.write_image_shards` and
`kvram shards write-images`. Every image is made here with numpy and Pillow."""

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

PIL = pytest.importorskip("PIL")
from PIL import Image  # noqa: E402

from kvram import cli, data  # noqa: E402


def _pixels(seed, height, width):
    """Smooth pixels (JPEG keeps them close), distinct per seed."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = rng.integers(0, 100, 3)
    return np.clip(base + 0.5 * x[..., None] + 0.3 * y[..., None], 0, 255).astype(np.uint8)


@pytest.fixture
def folder(tmp_path):
    """cat/ (3 PNGs), dog/ (2 JPEGs) at 32x32: written as they are at size 32."""
    source = tmp_path / "images"
    made = {}
    for name, count, ext in (("cat", 3, "png"), ("dog", 2, "jpg")):
        (source / name).mkdir(parents=True)
        for i in range(count):
            pixels = _pixels(hash((name, i)) % 1000, 32, 32)
            path = source / name / f"{i}.{ext}"
            Image.fromarray(pixels).save(path, quality=95)
            made[f"{name}/{i}.{ext}"] = pixels
    return source, made


def test_round_trip_pixels_labels_and_class_names(folder, tmp_path):
    source, made = folder
    dataset = data.write_image_shards(source, tmp_path / "out", size=32, samples_per_shard=2, verbose=0)
    assert dataset.index["classes"] == ["cat", "dog"]
    assert dataset.index["counts"] == {"ok": 5, "converted": 0, "skipped": 0}
    assert dataset.fields["x"] == (np.dtype("uint8"), (32, 32, 3))
    assert len(dataset) == 5 and len(dataset.index["shards"]) == 3
    got = dataset.read(0, 5)
    np.testing.assert_array_equal(got["y"], [0, 0, 0, 1, 1])
    for i, key in enumerate(sorted(made)):  # classes in order, files sorted in each
        if key.endswith(".png"):
            np.testing.assert_array_equal(got["x"][i], made[key])  # PNG: exact
        else:
            # JPEG: Pillow's own decoding of the file, and within JPEG's
            # tolerance of the pixels encoded
            with Image.open(source / key) as image:
                np.testing.assert_array_equal(got["x"][i], np.asarray(image.convert("RGB")))
            error = np.abs(got["x"][i].astype(int) - made[key].astype(int))
            assert error.mean() < 3 and np.percentile(error, 99) < 16, (key, error.mean())
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report == {"counts": {"ok": 5, "converted": 0, "skipped": 0}, "files": []}


def test_resize_is_shorter_side_then_centre_crop(tmp_path):
    source = tmp_path / "src"
    (source / "a").mkdir(parents=True)
    # 64 wide, 32 high: left half black, right half white, a red centre column pair
    pixels = np.zeros((32, 64, 3), np.uint8)
    pixels[:, 32:] = 255
    Image.fromarray(pixels).save(source / "a" / "wide.png")
    dataset = data.write_image_shards(source, tmp_path / "out", size=16, verbose=0)
    x = dataset.read(0, 1)["x"][0]
    assert x.shape == (16, 16, 3)
    # 64x32 -> 32x16, centre 16 columns: 8 black then 8 white
    assert (x[:, :7] == 0).all() and (x[:, 9:] == 255).all(), x[0, :, 0]


def _bad_files(source):
    """One of each case issue 13 names, beside two good images."""
    good = source / "good"
    bad = source / "bad"
    good.mkdir(parents=True)
    bad.mkdir(parents=True)
    Image.fromarray(_pixels(1, 40, 40)).save(good / "a.png")
    Image.fromarray(_pixels(2, 40, 40)).save(good / "b.jpg")
    Image.fromarray(_pixels(3, 40, 40)).convert("CMYK").save(bad / "cmyk.jpg")
    Image.fromarray(_pixels(4, 40, 40)[..., 0]).save(bad / "gray.png")
    rgba = np.dstack([_pixels(5, 40, 40), np.full((40, 40), 128, np.uint8)])
    Image.fromarray(rgba, "RGBA").save(bad / "alpha.png")
    Image.fromarray(_pixels(6, 1, 1)).save(bad / "tiny.png")
    Image.fromarray(_pixels(7, 300, 300)).save(bad / "huge.png")
    whole = (good / "b.jpg").read_bytes()
    (bad / "corrupt.jpg").write_bytes(whole[: len(whole) // 3])
    (bad / "notes.txt").write_text("not an image\n")
    (bad / "fake.jpg").write_bytes(b"\xff\xd8\xff\xe0 garbage that is not a JPEG")


def test_every_bad_file_is_converted_or_skipped_and_reported(tmp_path, capsys):
    source = tmp_path / "src"
    _bad_files(source)
    dataset = data.write_image_shards(source, tmp_path / "out", size=32, max_pixels=200 * 200, verbose=1)
    report = {r["path"]: r for r in dataset.index["report"]}
    converted = {p: r["reason"] for p, r in report.items() if r["action"] == "converted"}
    skipped = {p: r["reason"] for p, r in report.items() if r["action"] == "skipped"}
    assert converted == {
        "bad/cmyk.jpg": "CMYK converted to RGB",
        "bad/gray.png": "L converted to RGB",
        "bad/alpha.png": "RGBA converted to RGB",
    }
    assert set(skipped) == {"bad/tiny.png", "bad/huge.png", "bad/corrupt.jpg", "bad/notes.txt", "bad/fake.jpg"}
    assert skipped["bad/tiny.png"].startswith("too small: 1x1")
    assert skipped["bad/huge.png"].startswith("too large: 300x300 is over 40000 pixels")
    assert skipped["bad/corrupt.jpg"].startswith("corrupt")
    assert skipped["bad/notes.txt"].startswith("not an image")
    assert skipped["bad/fake.jpg"].startswith(("not an image", "corrupt"))
    assert dataset.index["counts"] == {"ok": 2, "converted": 3, "skipped": 5}
    assert len(dataset) == 5
    # labels: bad (0) for the converted, good (1) for the two good ones
    np.testing.assert_array_equal(dataset.read(0, 5)["y"], [0, 0, 0, 1, 1])
    x = dataset.read(0, 5)["x"]
    gray = np.asarray(Image.open(source / "bad" / "gray.png").convert("RGB").resize((32, 32), Image.BILINEAR))
    # gray.png is the 4th file of bad/ in sorted order after alpha, cmyk: rows alpha, cmyk, gray
    assert (x[2][..., 0] == x[2][..., 1]).all() and (x[2][..., 1] == x[2][..., 2]).all()
    assert np.abs(x[2].astype(int) - gray.astype(int)).mean() < 2
    printed = capsys.readouterr().out
    assert "10 files in 2 classes: 2 written as they were, 3 converted, 5 skipped" in printed, printed
    saved = json.loads((tmp_path / "out" / "report.json").read_text())
    assert saved["counts"] == dataset.index["counts"] and len(saved["files"]) == 8


def test_bad_inputs_are_clear(tmp_path):
    with pytest.raises(FileNotFoundError, match="No such directory"):
        data.write_image_shards(tmp_path / "missing", tmp_path / "out", verbose=0)
    (tmp_path / "flat").mkdir()
    Image.fromarray(_pixels(0, 8, 8)).save(tmp_path / "flat" / "a.png")
    with pytest.raises(ValueError, match="no class sub-folders"):
        data.write_image_shards(tmp_path / "flat", tmp_path / "out", verbose=0)
    (tmp_path / "junk" / "c").mkdir(parents=True)
    (tmp_path / "junk" / "c" / "a.txt").write_text("x")
    with pytest.raises(ValueError, match=r"every one of the 1 files was skipped .*nothing was written"):
        data.write_image_shards(tmp_path / "junk", tmp_path / "out", verbose=0)
    assert not (tmp_path / "out").exists()
    with pytest.raises(ValueError, match=r"`size` must be an int >= 1. Received: size=0"):
        data.write_image_shards(tmp_path / "junk", tmp_path / "out", size=0, verbose=0)


@pytest.mark.slow
def test_a_killed_writer_leaves_no_final_directory(tmp_path):
    source = tmp_path / "src"
    (source / "a").mkdir(parents=True)
    for i in range(400):
        Image.fromarray(_pixels(i, 64, 64)).save(source / "a" / f"{i:04d}.png")
    out = tmp_path / "out"
    script = textwrap.dedent(f"""
        import os, signal, sys
        sys.path.insert(0, {os.getcwd()!r})
        from kvram import data
        from kvram.data import _images
        real = _images._load
        done = [0]
        def load(*args):
            done[0] += 1
            if done[0] == 300:  # mid-way: shards already written, the index not
                os.kill(os.getpid(), signal.SIGKILL)
            return real(*args)
        _images._load = load
        data.write_image_shards({str(source)!r}, {str(out)!r}, size=16, samples_per_shard=64,
                                workers=1, verbose=0)
    """)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert run.returncode == -9, run.stderr[-2000:]
    assert not out.exists()
    # what it left is a staging directory, removed by the next write
    left = [p.name for p in tmp_path.iterdir() if p.name.startswith(".out.partial-")]
    assert left, list(tmp_path.iterdir())
    dataset = data.write_image_shards(source, out, size=16, samples_per_shard=64, verbose=0)
    assert len(dataset) == 400


def test_cli_write_images(folder, tmp_path, capsys):
    source, _ = folder
    assert cli.main(["shards", "write-images", str(source), str(tmp_path / "out"), "--size", "24",
                     "--workers", "2"]) == 0
    printed = capsys.readouterr().out
    assert "5 files in 2 classes: 5 written as they were, 0 converted, 0 skipped" in printed, printed
    dataset = data.ShardedDataset(tmp_path / "out")
    assert dataset.fields["x"][1] == (24, 24, 3) and dataset.index["classes"] == ["cat", "dog"]
    with pytest.raises(SystemExit, match="kvram shards write-images: .* exists"):
        cli.main(["shards", "write-images", str(source), str(tmp_path / "out")])
    # image shards (their report.json too) are replaced with --overwrite
    assert cli.main(["shards", "write-images", str(source), str(tmp_path / "out"), "--size", "16",
                     "--overwrite"]) == 0
    assert data.ShardedDataset(tmp_path / "out").fields["x"][1] == (16, 16, 3)


def _files(root) -> dict:
    return {p: p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_write_images_never_replaces_the_source_or_a_users_directory(folder, tmp_path):
    source, _ = folder
    user = tmp_path / "userdir"
    user.mkdir()
    (user / "thesis.tex").write_text("keep")
    before = _files(tmp_path)
    for out, held in ((source, "cat/, dog/"), (user, "thesis.tex")):
        with pytest.raises(SystemExit, match=rf"^kvram shards write-images: {out} exists and is not a kvram "
                           rf"shard directory: it holds {held} and no kvram index.json\. kvram replaces only "
                           r"shard directories it wrote, with or without --overwrite; nothing was written"):
            cli.main(["shards", "write-images", str(source), str(out), "--overwrite"])
    assert _files(tmp_path) == before and sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [source.name, "userdir"])


def test_encoded_shards_decode_in_tf_data_to_the_stored_pixels(folder, tmp_path):
    source, _ = folder
    pixels = data.write_image_shards(source, tmp_path / "pixels", size=32, verbose=0)
    encoded = data.write_image_shards(source, tmp_path / "jpeg", size=32, encoded=True, quality=95,
                                      samples_per_shard=2, verbose=0)
    assert set(encoded.fields) == {"jpeg", "y"} and encoded.fields["jpeg"][0].kind == "S"
    assert encoded.index["encoding"] == "JPEG quality 95"
    expected = pixels.read(0, 5)["x"]
    images, labels = [], []
    for x, y in data.decode_jpeg(encoded.to_tf_dataset(2, shuffle=False)):
        images.append(x.numpy())
        labels.append(y.numpy())
    images, labels = np.concatenate(images), np.concatenate(labels)
    assert images.shape == (5, 32, 32, 3) and images.dtype == np.uint8
    np.testing.assert_array_equal(labels, [0, 0, 0, 1, 1])
    error = np.abs(images.astype(int) - expected.astype(int))
    assert error.mean() < 3, error.mean()
    # the centre crop is the centre of the whole image (only that part decoded)
    (centre, _), = data.decode_jpeg(encoded.to_tf_dataset(5, shuffle=False), crop=24)
    np.testing.assert_array_equal(centre.numpy(), images[:, 4:28, 4:28])
    # random crops (and flips) are windows of the whole image
    (crops, _), = data.decode_jpeg(encoded.to_tf_dataset(5, shuffle=False), crop=24, random_crop=True,
                                   flip=True, seed=1)
    corners = set()
    for image, whole in zip(crops.numpy(), images):
        found = [(i, j, f) for i in range(9) for j in range(9) for f in (False, True)
                 if np.array_equal(image[:, ::-1] if f else image, whole[i:i + 24, j:j + 24])]
        assert found, "a random crop is not a window of its image"
        corners.add(found[0][:2])
    assert len(corners) > 1  # not always the same place
    with pytest.raises(ValueError, match="random_crop needs crop"):
        data.decode_jpeg(encoded.to_tf_dataset(5), random_crop=True)
    with pytest.raises(ValueError, match=r"quality must be an int in \[1, 95\]"):
        data.write_image_shards(source, tmp_path / "q", encoded=True, quality=100, verbose=0)
