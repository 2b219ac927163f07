"""Tensor data sources: IDX (MNIST, Fashion-MNIST) with its download path, CIFAR-10 binaries,
digits, and the `load_dataset` front door. Every file is made here, except the real Fashion-MNIST
when Debian's package is installed."""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from vitscope.data import DataError, ImageDataset, list_datasets, load_dataset, read_idx, verify_dataset
from vitscope.data import idx as idx_module

SYSTEM_FMNIST = Path("/usr/share/datasets/fashion-mnist")


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("VITSCOPE_DATA", str(tmp_path / "cache"))


def idx_bytes(array: np.ndarray) -> bytes:
    code = {np.dtype(np.uint8): 0x08, np.dtype(">i4"): 0x0C}[array.dtype]
    header = bytes([0, 0, code, array.ndim]) + b"".join(d.to_bytes(4, "big") for d in array.shape)
    return header + array.tobytes()


def write_idx(path: Path, array: np.ndarray, *, gz: bool) -> Path:
    data = idx_bytes(array)
    path.write_bytes(gzip.compress(data) if gz else data)
    return path


def tiny_split(directory: Path, prefix: str, n: int, *, gz: bool = True, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    suffix = ".gz" if gz else ""
    write_idx(
        directory / f"{prefix}-images-idx3-ubyte{suffix}", rng.integers(0, 256, (n, 28, 28), np.uint8), gz=gz
    )
    write_idx(directory / f"{prefix}-labels-idx1-ubyte{suffix}", rng.integers(0, 10, (n,), np.uint8), gz=gz)


# -- the IDX reader --------------------------------------------------------------------------------
@pytest.mark.parametrize("gz", [False, True])
def test_read_idx_round_trips(tmp_path, gz):
    array = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    assert np.array_equal(read_idx(write_idx(tmp_path / "a", array, gz=gz)), array)
    wide = np.array([1, -2, 70000], dtype=">i4")
    assert read_idx(write_idx(tmp_path / "b", wide, gz=gz)).tolist() == [1, -2, 70000]


def test_read_idx_rejects_bad_files(tmp_path):
    good = idx_bytes(np.zeros((3, 28, 28), np.uint8))
    (tmp_path / "magic").write_bytes(b"\x08\x03" + good[2:])
    with pytest.raises(DataError, match="bad IDX magic number 0x0803"):
        read_idx(tmp_path / "magic")
    (tmp_path / "short").write_bytes(gzip.compress(good[:-5]))
    with pytest.raises(DataError, match="truncated"):
        read_idx(tmp_path / "short")
    (tmp_path / "long").write_bytes(good + b"\0")
    with pytest.raises(DataError, match="trailing bytes"):
        read_idx(tmp_path / "long")
    (tmp_path / "torn.gz").write_bytes(gzip.compress(good)[:-20])
    with pytest.raises(DataError, match="damaged gzip"):
        read_idx(tmp_path / "torn.gz")


def test_idx_files_made_by_hand_load_with_verify_off(tmp_path):
    tiny_split(tmp_path, "train", 5, gz=False)
    ds = load_dataset("mnist", root=tmp_path, verify=False, download=False)
    assert isinstance(ds, ImageDataset) and len(ds) == 5
    assert ds.images.shape == (5, 1, 28, 28) and ds.images.dtype == torch.uint8 and ds.images.is_contiguous()
    assert ds.labels.dtype == torch.int64 and ds.classes == [str(i) for i in range(10)]
    with pytest.raises(DataError, match="official train split has 60000"):
        load_dataset("mnist", root=tmp_path, download=False)
    assert load_dataset("mnist", root=tmp_path, verify=False, image_size=14).images.shape == (5, 1, 14, 14)


def test_idx_count_mismatch_and_wrong_shape(tmp_path):
    write_idx(tmp_path / "train-images-idx3-ubyte.gz", np.zeros((4, 28, 28), np.uint8), gz=True)
    write_idx(tmp_path / "train-labels-idx1-ubyte.gz", np.zeros((3,), np.uint8), gz=True)
    with pytest.raises(DataError, match="4 images but .* 3 labels"):
        load_dataset("mnist", root=tmp_path, verify=False, download=False)
    write_idx(tmp_path / "train-images-idx3-ubyte.gz", np.zeros((3, 32, 32), np.uint8), gz=True)
    with pytest.raises(DataError, match="images are 28x28, this file holds 32x32"):
        load_dataset("mnist", root=tmp_path, verify=False, download=False)


def test_missing_files_without_download_say_what_to_install(tmp_path, monkeypatch):
    source = dataclasses.replace(idx_module.FASHION_MNIST, system_dirs=(str(tmp_path / "nowhere"),))
    monkeypatch.setitem(idx_module.SOURCES, "fashion_mnist", source)
    with pytest.raises(DataError, match="apt-get install dataset-fashion-mnist"):
        load_dataset("fashion_mnist", download=False)


@pytest.mark.skipif(
    not (SYSTEM_FMNIST / "train-images-idx3-ubyte.gz").exists(), reason="dataset-fashion-mnist absent"
)
def test_real_fashion_mnist_loads_and_verifies():
    train, test = load_dataset("fashion_mnist", "train"), load_dataset("fashion_mnist", "test")
    assert (len(train), len(test)) == (60000, 10000)
    assert train.images.shape == (60000, 1, 28, 28) and train.classes[0] == "T-shirt/top"
    assert torch.bincount(test.labels).tolist() == [1000] * 10
    lines = verify_dataset("fashion_mnist")
    assert len(lines) == 4 and all("sha256 matches the official release" in line for line in lines)


# -- downloading -----------------------------------------------------------------------------------
def served_source(tmp_path: Path, *, corrupt: str | None = None) -> idx_module.IdxSource:
    """A Fashion-MNIST look-alike whose 'official' files are tiny ones served from a file:// URL."""
    server = tmp_path / "server"
    server.mkdir()
    tiny_split(server, "train", 6)
    tiny_split(server, "t10k", 4, seed=1)
    hashes = {
        p.name[:-3]: hashlib.sha256(gzip.decompress(p.read_bytes())).hexdigest() for p in server.iterdir()
    }
    if corrupt:
        tiny_split(server, corrupt, 6 if corrupt == "train" else 4, seed=7)  # same shape, other content
    return dataclasses.replace(
        idx_module.FASHION_MNIST,
        urls=(f"file://{tmp_path}/no-such-mirror/", server.as_uri() + "/"),
        sha256=hashes,
        system_dirs=(),
        counts={"train": 6, "test": 4},
    )


def test_download_verifies_and_writes_into_the_cache(tmp_path, monkeypatch):
    monkeypatch.setitem(idx_module.SOURCES, "fashion_mnist", served_source(tmp_path))
    ds = load_dataset("fashion_mnist", "train")
    assert len(ds) == 6
    cached = tmp_path / "cache" / "fashion_mnist"
    assert sorted(p.name for p in cached.iterdir()) == [
        "train-images-idx3-ubyte.gz",
        "train-labels-idx1-ubyte.gz",
    ]
    assert len(load_dataset("fashion_mnist", "test")) == 4
    assert len(verify_dataset("fashion_mnist")) == 4


def test_download_with_wrong_checksum_leaves_no_file(tmp_path, monkeypatch):
    monkeypatch.setitem(idx_module.SOURCES, "fashion_mnist", served_source(tmp_path, corrupt="train"))
    with pytest.raises(DataError, match="sha256 of the decompressed content") as err:
        load_dataset("fashion_mnist", "train")
    assert "no-such-mirror" in str(err.value)  # every mirror tried is named
    cached = tmp_path / "cache" / "fashion_mnist"
    assert not cached.exists() or list(cached.iterdir()) == []


def test_download_through_a_patched_opener(tmp_path, monkeypatch):
    source = served_source(tmp_path)
    served = {p.name: p.read_bytes() for p in (tmp_path / "server").iterdir()}
    calls = []

    class Response:
        def __init__(self, data):
            self.data = data

        def read(self):
            return self.data

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    def fake_urlopen(url, timeout):
        calls.append(url)
        if not url.startswith("https://mirror.example/"):
            raise OSError("connection refused")
        return Response(served[url.rsplit("/", 1)[1]])

    monkeypatch.setattr("urllib.request.urlopen", fake_urlopen)
    monkeypatch.setitem(
        idx_module.SOURCES,
        "fashion_mnist",
        dataclasses.replace(source, urls=("https://down.example/", "https://mirror.example/")),
    )
    root = tmp_path / "explicit"
    assert len(load_dataset("fashion_mnist", "test", root=root)) == 4
    assert (root / "t10k-images-idx3-ubyte.gz").is_file() and len(calls) == 4


# -- CIFAR-10 --------------------------------------------------------------------------------------
def cifar_records(labels: list[int]) -> bytes:
    out = bytearray()
    for i, label in enumerate(labels):
        planes = [np.full(1024, v, np.uint8) for v in (i, 100 + i, 200 + i)]  # R, G, B
        out += bytes([label]) + b"".join(p.tobytes() for p in planes)
    return bytes(out)


def make_cifar(root: Path) -> Path:
    folder = root / "cifar-10-batches-bin"
    folder.mkdir(parents=True)
    for k in range(1, 6):
        (folder / f"data_batch_{k}.bin").write_bytes(cifar_records([k, 9]))
    (folder / "test_batch.bin").write_bytes(cifar_records([0, 1, 2]))
    (folder / "batches.meta.txt").write_text("\n".join(["plane", "car", *"abcdefgh"]) + "\n\n")
    return folder


def test_cifar10_binaries(tmp_path):
    folder = make_cifar(tmp_path)
    train = load_dataset("cifar10", "train", root=tmp_path, verify=False)
    assert train.images.shape == (10, 3, 32, 32) and train.labels.tolist() == [1, 9, 2, 9, 3, 9, 4, 9, 5, 9]
    assert train.images[1, :, 5, 7].tolist() == [1, 101, 201]  # channel planes decoded in R, G, B order
    assert train.classes[:2] == ["plane", "car"]
    assert len(load_dataset("cifar10", "test", root=folder, verify=False)) == 3
    with pytest.raises(DataError, match="official CIFAR-10 file has 10000"):
        load_dataset("cifar10", "test", root=tmp_path)
    (folder / "test_batch.bin").write_bytes(cifar_records([0, 1])[:-10])
    with pytest.raises(DataError, match="not a whole number of 3073-byte records"):
        load_dataset("cifar10", "test", root=tmp_path, verify=False)
    (folder / "test_batch.bin").write_bytes(cifar_records([0, 12]))
    with pytest.raises(DataError, match="record 1 has label 12"):
        load_dataset("cifar10", "test", root=tmp_path, verify=False)
    with pytest.raises(DataError, match="cifar-10-binary.tar.gz"):
        load_dataset("cifar10", root=tmp_path / "empty")


# -- digits and the front door ---------------------------------------------------------------------
def test_digits_smoke_dataset():
    pytest.importorskip("sklearn")
    train, test = load_dataset("digits", "train"), load_dataset("digits", "test")
    assert len(train) + len(test) == 1797 and train.images.shape[1:] == (1, 8, 8)
    assert int(train.images.max()) == 255 and train.images.dtype == torch.uint8
    assert torch.equal(load_dataset("digits", "test").images, test.images)  # fixed split
    assert load_dataset("digits", image_size=16).images.shape[1:] == (1, 16, 16)


def test_digits_without_scikit_learn_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "sklearn.datasets", None)
    with pytest.raises(DataError, match="pip install scikit-learn"):
        load_dataset("digits")


def test_front_door_errors():
    assert list_datasets()[0] == "fashion_mnist" and {"mnist", "cifar10", "pets", "folder", "digits"} <= set(
        list_datasets()
    )
    with pytest.raises(DataError, match="Did you mean fashion_mnist"):
        load_dataset("fashion-mnist")
    with pytest.raises(DataError, match="does not take channels"):
        load_dataset("mnist", channels=3)
    with pytest.raises(DataError, match="splits 'train' and 'test'"):
        load_dataset("mnist", "val")


def test_channel_stats_of_a_single_colour_dataset_normalise_to_finite_values():
    """A channel that never varies must not divide by zero (a NaN loss at step 0, blamed on the learning rate)."""
    from vitscope.data.base import channel_stats

    images = torch.full((4, 3, 8, 8), 200, dtype=torch.uint8)
    images[:, 1] = torch.randint(0, 256, (4, 8, 8), generator=torch.Generator().manual_seed(0))
    mean, std = channel_stats(images)
    assert mean[0] == round(200 / 255, 4) and std[0] == round(1 / 255, 4)  # held at one grey level
    assert abs(std[1] - (images[:, 1].double() / 255).std(unbiased=False).item()) < 1e-4  # a varying one as it is
    x = (images.float() / 255 - torch.tensor(mean)[:, None, None]) / torch.tensor(std)[:, None, None]
    assert torch.isfinite(x).all()
