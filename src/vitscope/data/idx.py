"""IDX files (the format of MNIST and Fashion-MNIST): a reader that checks everything it reads,
where to find the files, and how to download them.

Fashion-MNIST is looked for, in order, in the `root` given, in `/usr/share/datasets/fashion-mnist/`
(Debian's `dataset-fashion-mnist`), in the cache directory (`$VITSCOPE_DATA/fashion_mnist` or
`~/.cache/vitscope/fashion_mnist`), and is otherwise downloaded from its official source into the
cache (or into `root`, when one was given). MNIST goes the same way.

Checksums are of the *decompressed* content: Debian recompresses the .gz files, so their own
checksums differ from the official release while the content is identical.
"""

from __future__ import annotations

import gzip
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from vitscope.data.base import DataError, ImageDataset, cache_dir, download, sha256_hex

# type code (third byte of the magic number) -> big-endian dtype
IDX_DTYPES = {
    0x08: np.dtype(np.uint8),
    0x09: np.dtype(np.int8),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}


def parse_idx(data: bytes, *, source: str = "<bytes>") -> np.ndarray:
    """Decode raw (uncompressed) IDX bytes, checking the magic number and that the size matches."""
    if len(data) < 4:
        raise DataError(
            f"{source}: {len(data)} bytes is too short for an IDX file (need a 4-byte magic number)"
        )
    zero, code, ndim = int.from_bytes(data[:2], "big"), data[2], data[3]
    if zero != 0 or code not in IDX_DTYPES or not 1 <= ndim <= 4:
        raise DataError(
            f"{source}: bad IDX magic number 0x{data[:4].hex()} (expected 0x0000TTDD with type TT in "
            f"{{{', '.join(f'{c:02x}' for c in IDX_DTYPES)}}} and 1-4 dims DD); the file is not IDX "
            "or is damaged: delete it and download it again"
        )
    header = 4 + 4 * ndim
    if len(data) < header:
        raise DataError(
            f"{source}: truncated IDX header ({len(data)} bytes, need {header}); delete it and re-download"
        )
    dims = tuple(int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    dtype = IDX_DTYPES[code]
    expected = header + int(np.prod(dims)) * dtype.itemsize
    if len(data) != expected:
        what = "truncated" if len(data) < expected else "has trailing bytes"
        raise DataError(
            f"{source}: {what}: header says {'x'.join(map(str, dims))} {dtype.name} ({expected} bytes), "
            f"file has {len(data)} bytes; delete it and download it again"
        )
    return np.frombuffer(data, dtype=dtype, offset=header).reshape(dims).astype(dtype.newbyteorder("="))


def read_bytes(path: Path) -> bytes:
    """The file's content, gunzipped when it is gzip (recognised by its magic bytes, not its name)."""
    raw = path.read_bytes()
    if raw[:2] != b"\x1f\x8b":
        return raw
    try:
        return gzip.decompress(raw)
    except (OSError, EOFError, zlib.error) as e:
        raise DataError(f"{path}: damaged gzip file ({e}); delete it and download it again") from e


def read_idx(path: str | Path) -> np.ndarray:
    path = Path(path)
    return parse_idx(read_bytes(path), source=str(path))


# -- the two datasets ------------------------------------------------------------------------------
@dataclass(frozen=True)
class IdxSource:
    name: str
    classes: tuple[str, ...]
    urls: tuple[str, ...]  # mirrors; a file's URL is mirror + file name
    sha256: dict[str, str | None]  # decompressed content of each file; None: not known here
    mean: tuple[float, ...]
    std: tuple[float, ...]
    system_dirs: tuple[str, ...] = ()
    install_hint: str = ""
    counts: dict[str, int] = field(default_factory=lambda: {"train": 60000, "test": 10000})

    def files(self, split: str) -> tuple[str, str]:
        prefix = {"train": "train", "test": "t10k"}[split]
        return f"{prefix}-images-idx3-ubyte", f"{prefix}-labels-idx1-ubyte"


FASHION_MNIST = IdxSource(
    name="fashion_mnist",
    classes=(
        "T-shirt/top",
        "Trouser",
        "Pullover",
        "Dress",
        "Coat",
        "Sandal",
        "Shirt",
        "Sneaker",
        "Bag",
        "Ankle boot",
    ),
    urls=("http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/",),
    # sha256 of the decompressed files, computed from Debian's dataset-fashion-mnist (whose content
    # is the official release: the images and labels are identical, only the gzip wrapping differs).
    sha256={
        "train-images-idx3-ubyte": "c59f468a2f672dc815687fe0f83887768d799fd8a3f3276145d20f83aa44d888",
        "train-labels-idx1-ubyte": "bad3541b69d912435c50bb6ba87bec294ff4f6a2e1246121d8633921760443d9",
        "t10k-images-idx3-ubyte": "5b4141f0afbad91edebe8549f8fcffe087ea10ca49f1dbef5c9a5cd8815ce37b",
        "t10k-labels-idx1-ubyte": "0402a96d92fd2663957122ceb108a494c5af83dab82d92729df917d7dec38c34",
    },
    mean=(0.2860,),
    std=(0.3530,),
    system_dirs=("/usr/share/datasets/fashion-mnist",),
    install_hint="apt-get install dataset-fashion-mnist",
)

MNIST = IdxSource(
    name="mnist",
    classes=tuple(str(i) for i in range(10)),
    urls=(
        "https://ossci-datasets.s3.amazonaws.com/mnist/",
        "https://storage.googleapis.com/cvdf-datasets/mnist/",
        "http://yann.lecun.com/exdb/mnist/",
    ),
    # No copy of MNIST could be hashed where this was written, so its content checksums are not
    # pinned: MNIST is checked by magic number, shape, count and label range only.
    sha256={},
    mean=(0.1307,),
    std=(0.3081,),
)

SOURCES = {s.name: s for s in (FASHION_MNIST, MNIST)}


def _existing(directory: Path, stem: str) -> Path | None:
    for candidate in (directory / f"{stem}.gz", directory / stem):
        if candidate.is_file():
            return candidate
    return None


def _check_array(src: IdxSource, stem: str, array: np.ndarray, *, official: bool, where: str) -> None:
    is_images = "images" in stem
    if is_images and (array.ndim != 3 or array.dtype != np.uint8):
        raise DataError(f"{where}: expected uint8 images (N, H, W), got {array.dtype} {array.shape}")
    if not is_images and (array.ndim != 1 or array.dtype != np.uint8):
        raise DataError(f"{where}: expected uint8 labels (N,), got {array.dtype} {array.shape}")
    if is_images and array.shape[1:] != (28, 28):
        raise DataError(
            f"{where}: {src.name} images are 28x28, this file holds {array.shape[1]}x{array.shape[2]}"
        )
    if not is_images and array.size and int(array.max()) >= len(src.classes):
        raise DataError(f"{where}: label {int(array.max())} is out of range 0..{len(src.classes) - 1}")
    if official:
        split = "train" if stem.startswith("train") else "test"
        if array.shape[0] != src.counts[split]:
            raise DataError(
                f"{where}: {array.shape[0]} records, the official {split} split has {src.counts[split]}; "
                "delete the file and download it again (or pass verify=False for a file made on purpose)"
            )


def _verify_bytes(
    src: IdxSource, stem: str, data: bytes, *, official: bool, where: str
) -> tuple[np.ndarray, str]:
    """Parse and check one decompressed file; returns the array and a line saying what was checked."""
    expected = src.sha256.get(stem)
    if official and expected is not None:
        actual = sha256_hex(data)
        if actual != expected:
            raise DataError(
                f"{where}: sha256 of the decompressed content is {actual}, "
                f"the official file's is {expected}; "
                "the file is damaged or not the official release: delete it and download it again "
                "(or pass verify=False for a file made on purpose)"
            )
    array = parse_idx(data, source=where)
    _check_array(src, stem, array, official=official, where=where)
    shape = "x".join(map(str, array.shape))
    checked = (
        "content sha256 matches the official release"
        if official and expected
        else (
            "content checksum not known here, checked magic/shape/count"
            if official
            else "not checked against the release"
        )
    )
    return array, f"{where}: IDX {shape} uint8, {checked}"


def locate(src: IdxSource, split: str, root: str | Path | None, *, download_ok: bool) -> dict[str, Path]:
    """Find (or download) the two files of `split`; returns {stem: path}."""
    stems = src.files(split)
    candidates = (
        [Path(root).expanduser()] if root is not None else [*map(Path, src.system_dirs), cache_dir(src.name)]
    )
    for directory in candidates:
        found = {stem: _existing(directory, stem) for stem in stems}
        if all(found.values()):
            return found  # type: ignore[return-value]
    target = candidates[-1]
    if not download_ok:
        raise DataError(
            _missing_message(src, stems, candidates, "downloading is switched off (download=False)")
        )
    paths = {}
    for stem in stems:
        dest = _existing(target, stem) or target / f"{stem}.gz"
        if not dest.exists():

            def check(raw: bytes, stem=stem) -> None:
                try:
                    data = gzip.decompress(raw)
                except (OSError, EOFError, zlib.error) as e:
                    raise DataError(f"not a valid gzip file ({e})") from e
                _verify_bytes(src, stem, data, official=True, where=f"{stem}.gz")

            try:
                download([u + f"{stem}.gz" for u in src.urls], dest, check=check)
            except DataError as e:
                raise DataError(_missing_message(src, stems, candidates, str(e))) from e
        paths[stem] = dest
    return paths


def _missing_message(src: IdxSource, stems: tuple[str, ...], searched: list[Path], why: str) -> str:
    where = ", ".join(str(d) for d in searched)
    install = f"install it (`{src.install_hint}`), or " if src.install_hint else ""
    return (
        f"{src.name}: {' and '.join(s + '.gz' for s in stems)} not found in {where}, and {why}. "
        f"To fix: {install}put the files (gzipped or not) in {searched[-1]} or pass root=DIR "
        f"(--data-dir DIR) pointing at a folder that holds them."
    )


def load_idx(
    name: str,
    split: str = "train",
    *,
    root: str | Path | None = None,
    download: bool = True,
    verify: bool = True,
) -> ImageDataset:
    """Load MNIST or Fashion-MNIST. `verify=False` skips the official count and checksum checks,
    for IDX files made by hand; magic number, shape and label range are always checked."""
    src = SOURCES[name]
    if split not in ("train", "test"):
        raise DataError(f"{name} has splits 'train' and 'test', not {split!r}")
    paths = locate(src, split, root, download_ok=download)
    images_stem, labels_stem = src.files(split)
    images, _ = _verify_bytes(
        src, images_stem, read_bytes(paths[images_stem]), official=verify, where=str(paths[images_stem])
    )
    labels, _ = _verify_bytes(
        src, labels_stem, read_bytes(paths[labels_stem]), official=verify, where=str(paths[labels_stem])
    )
    if images.shape[0] != labels.shape[0]:
        raise DataError(
            f"{paths[images_stem]} holds {images.shape[0]} images but {paths[labels_stem]} holds "
            f"{labels.shape[0]} labels; the two files do not belong together"
        )
    return ImageDataset(
        images=torch.from_numpy(images.copy()).unsqueeze(1),  # (N, 1, 28, 28)
        labels=torch.from_numpy(labels.astype(np.int64)),
        classes=list(src.classes),
        name=name,
        mean=src.mean,
        std=src.std,
    )


def verify_idx(name: str, root: str | Path | None = None, *, download: bool = False) -> list[str]:
    src = SOURCES[name]
    lines = []
    for split in ("train", "test"):
        paths = locate(src, split, root, download_ok=download)
        counts = []
        for stem, path in paths.items():
            array, line = _verify_bytes(src, stem, read_bytes(path), official=True, where=str(path))
            counts.append(array.shape[0])
            lines.append(line)
        if counts[0] != counts[1]:
            raise DataError(f"{name} {split}: {counts[0]} images but {counts[1]} labels")
    return lines
