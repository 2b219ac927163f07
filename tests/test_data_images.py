"""Image folders and Oxford-IIIT Pet, on tiny image files made here."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from vitscope.data import DataError, load_dataset, verify_dataset
from vitscope.data import folder as folder_module


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("VITSCOPE_DATA", str(tmp_path / "cache"))


@pytest.fixture
def count_decodes(monkeypatch):
    calls = []
    real = folder_module.load_image

    def counting(path, **kwargs):
        calls.append(Path(path).name)
        return real(path, **kwargs)

    monkeypatch.setattr(folder_module, "load_image", counting)
    return calls


def save(path: Path, img: Image.Image) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    img.save(path)
    return path


def make_folder(root: Path, per_class: int = 5, size: int = 8) -> Path:
    for c, colour in enumerate([(255, 0, 0), (0, 0, 255)]):
        for i in range(per_class):
            save(root / f"class_{c}" / f"{i}.png", Image.new("RGB", (size, size), colour))
    return root


def test_folder_loads_with_a_fixed_made_split(tmp_path):
    root = make_folder(tmp_path / "imgs")
    train = load_dataset("folder", "train", root=root, val_fraction=0.4)
    val = load_dataset("folder", "val", root=root, val_fraction=0.4)
    assert (len(train), len(val)) == (6, 4) and train.classes == ["class_0", "class_1"]
    assert train.images.shape == (6, 3, 8, 8) and train.images.dtype == torch.uint8
    assert torch.bincount(val.labels).tolist() == [2, 2]  # stratified
    assert train.images[train.labels == 1][:, 2].eq(255).all()  # class_1 is blue
    again = load_dataset("folder", "val", root=root, val_fraction=0.4, cache=False)
    assert torch.equal(again.images, val.images) and torch.equal(again.labels, val.labels)
    other = load_dataset("folder", "val", root=root, val_fraction=0.4, seed=1, cache=False)
    assert len(other) == 4
    with pytest.raises(DataError, match="no train/val/test sub-folders"):
        load_dataset("folder", "test", root=root)


def test_folder_with_given_split_folders(tmp_path):
    make_folder(tmp_path / "train", per_class=3)
    make_folder(tmp_path / "val", per_class=1)
    assert len(load_dataset("folder", "val", root=tmp_path)) == 2
    with pytest.raises(DataError, match="no 'test' folder"):
        load_dataset("folder", "test", root=tmp_path)
    save(tmp_path / "val" / "class_9" / "x.png", Image.new("RGB", (8, 8)))
    with pytest.raises(DataError, match="classes not in .*class_9"):
        load_dataset("folder", "val", root=tmp_path)


def test_a_class_folder_without_images_is_named(tmp_path):
    root = make_folder(tmp_path / "made")
    (root / "class_2").mkdir()
    (root / "class_2" / "notes.txt").write_text("no images here")
    with pytest.raises(DataError, match="class folders with no image files in them: class_2"):
        load_dataset("folder", "train", root=root)
    assert "  no images in class folder: class_2 (training refuses it; add images or remove it)" in (
        verify_dataset("folder", root=root))
    given = tmp_path / "given"
    make_folder(given / "train", per_class=2)
    make_folder(given / "test", per_class=1)
    (given / "train" / "class_2").mkdir()
    for split in ("train", "test"):  # the test split is refused too: the model would have an unlearned label
        with pytest.raises(DataError, match="no image files in them: class_2"):
            load_dataset("folder", split, root=given)
    save(given / "train" / "class_2" / "0.png", Image.new("RGB", (8, 8)))
    assert len(load_dataset("folder", "test", root=given)) == 2  # a test split may lack a class


def test_modes_are_converted(tmp_path):
    rgba = Image.new("RGBA", (4, 4), (10, 20, 30, 255))
    rgba.putpixel((0, 0), (0, 0, 0, 0))  # transparent -> white background
    palette = Image.new("P", (4, 4))
    palette.putpalette([0, 0, 0, 200, 100, 50] + [0] * 762)
    palette.paste(1, (0, 0, 4, 4))
    gray = Image.new("L", (4, 4), 77)
    for name, img in [("rgba.png", rgba), ("palette.png", palette), ("gray.png", gray)]:
        save(tmp_path / "data" / "k" / name, img)
    rgb = load_dataset("folder", root=tmp_path / "data", val_fraction=0.0)
    by_name = dict(zip(["gray", "palette", "rgba"], rgb.images))  # files load in sorted order
    assert by_name["gray"][:, 1, 1].tolist() == [77, 77, 77]
    assert by_name["palette"][:, 1, 1].tolist() == [200, 100, 50]
    assert (
        by_name["rgba"][:, 1, 1].tolist() == [10, 20, 30] and by_name["rgba"][:, 0, 0].tolist() == [255] * 3
    )
    one = load_dataset("folder", root=tmp_path / "data", val_fraction=0.0, channels=1)
    assert one.images.shape == (3, 1, 4, 4) and one.images[0, 0, 0, 0] == 77 and len(one.mean) == 1


def test_corrupt_files_skipped_or_fatal(tmp_path):
    root = make_folder(tmp_path / "imgs", per_class=2)
    (root / "class_0" / "garbage.png").write_bytes(b"not an image at all")
    good = (root / "class_1" / "0.png").read_bytes()
    (root / "class_1" / "torn.png").write_bytes(good[: len(good) // 2])
    with pytest.warns(UserWarning, match=r"skipped 2 unreadable(.|\n)*garbage\.png(.|\n)*torn\.png"):
        ds = load_dataset("folder", root=root, val_fraction=0.0)
    assert len(ds) == 4
    with pytest.warns(UserWarning, match="garbage.png"):  # a cache hit reports them again
        load_dataset("folder", root=root, val_fraction=0.0)
    with pytest.raises(DataError, match=r"garbage\.png.*on_error='skip'"):
        load_dataset("folder", root=root, val_fraction=0.0, on_error="raise", cache=False)
    lines = verify_dataset("folder", root)
    assert "4 images" not in lines[0] and "2 unreadable" in lines[0]


@pytest.mark.parametrize("limit", [50, 20])  # over the limit: PIL warns; over twice the limit: PIL raises
def test_decompression_bombs_are_refused(tmp_path, monkeypatch, limit):
    save(tmp_path / "a" / "big.png", Image.new("L", (8, 8)))
    save(tmp_path / "a" / "small.png", Image.new("L", (4, 4)))
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", limit)
    with pytest.raises(DataError, match="big.png: refused as a decompression bomb"):
        load_dataset("folder", root=tmp_path, val_fraction=0.0, on_error="raise", image_size=4)
    with pytest.warns(UserWarning, match="decompression bomb"):
        ds = load_dataset("folder", root=tmp_path, val_fraction=0.0, image_size=4, cache=False)
    assert len(ds) == 1


def test_mixed_sizes_need_image_size(tmp_path):
    save(tmp_path / "a" / "1.png", Image.new("RGB", (8, 8)))
    save(tmp_path / "a" / "2.png", Image.new("RGB", (12, 6)))
    with pytest.raises(DataError, match="different sizes.*pass image_size"):
        load_dataset("folder", root=tmp_path, val_fraction=0.0)
    assert load_dataset("folder", root=tmp_path, val_fraction=0.0, image_size=5).images.shape == (2, 3, 5, 5)


def test_second_load_hits_the_decode_cache(tmp_path, count_decodes):
    root = make_folder(tmp_path / "imgs", per_class=3)
    first = load_dataset("folder", root=root, val_fraction=0.0, image_size=4)
    assert len(count_decodes) == 6
    second = load_dataset("folder", root=root, val_fraction=0.0, image_size=4)
    assert len(count_decodes) == 6 and torch.equal(first.images, second.images)
    load_dataset("folder", root=root, val_fraction=0.0, image_size=6)  # another size: decoded again
    assert len(count_decodes) == 12
    path = root / "class_0" / "0.png"
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))  # a file changed
    load_dataset("folder", root=root, val_fraction=0.0, image_size=4)
    assert len(count_decodes) == 18
    assert list((tmp_path / "cache" / "decoded").glob("*.tmp")) == []


# -- Oxford-IIIT Pet ----------------------------------------------------------------------------------
def make_pets(root: Path) -> Path:
    rng = np.random.default_rng(0)
    names = {"Abyssinian": 1, "american_bulldog": 2, "Bengal": 3}
    trainval, test = [], []
    for breed, class_id in names.items():
        for i in range(1, 4):
            pixels = rng.integers(0, 256, (20 + i, 24, 3), np.uint8)  # sizes differ, as in the real set
            save(root / "images" / f"{breed}_{i}.jpg", Image.fromarray(pixels))
            species = 1 if breed[0].isupper() else 2
            (test if i == 3 else trainval).append(f"{breed}_{i} {class_id} {species} {i}")
    (root / "annotations").mkdir()
    (root / "annotations" / "trainval.txt").write_text("\n".join(trainval) + "\n")
    (root / "annotations" / "test.txt").write_text("\n".join(test) + "\n")
    return root


def test_pets_published_layout(tmp_path, count_decodes):
    root = make_pets(tmp_path / "pets")
    train = load_dataset("pets", "train", root=root, image_size=16)
    test = load_dataset("pets", "test", root=root, image_size=16)
    assert train.classes == ["Abyssinian", "american_bulldog", "Bengal"] == test.classes
    assert train.images.shape == (6, 3, 16, 16) and train.labels.tolist() == [0, 0, 1, 1, 2, 2]
    assert test.labels.tolist() == [0, 1, 2] and len(count_decodes) == 9
    load_dataset("pets", "test", root=root, image_size=16)
    assert len(count_decodes) == 9  # cached
    assert len(verify_dataset("pets", root)) == 2
    (root / "images" / "Bengal_3.jpg").unlink()
    with pytest.raises(DataError, match="missing .*Bengal_3.jpg"):
        load_dataset("pets", "test", root=root, image_size=16)
    with pytest.raises(DataError, match="images.tar.gz and annotations.tar.gz"):
        load_dataset("pets", root=tmp_path / "nothing")


def test_predict_and_explain_decode_a_file_as_training_did(tmp_path):
    """A wide photo is centre-cropped, not squashed, and transparency is white: the same pixels the image
    folder loader gave the model in training."""
    from vitscope.data.image_files import load_image_files

    wide = np.zeros((20, 60, 4), dtype=np.uint8)
    wide[:, :20, :3] = 255  # white left third, which a centre crop leaves out
    wide[:, 20:40, 1] = 200
    wide[:, :, 3] = 255
    wide[:5, 25:35, 3] = 0  # a transparent patch: white in both
    path = save(tmp_path / "wide.png", Image.fromarray(wide, "RGBA"))
    for channels in (1, 3):
        got = load_image_files([path], channels=channels, size=(8, 8))[0]
        want = torch.from_numpy(folder_module.load_image(path, image_size=8, channels=channels).copy())
        assert torch.equal(got, want)
    rgb = load_image_files([path], channels=3, size=(8, 8))[0].float()
    assert rgb[0, :, 0].mean() < 64  # the left column is the green middle's edge, not the white left third
    assert rgb[0, 0, 3:5].mean() > 200  # the transparent patch shows white
