"""Datasets as uint8 tensors in memory, and augmentation on batches of tensors.

    ds = load_dataset("fashion_mnist", "train")       # ImageDataset: images (N, 1, 28, 28) uint8
    ds = load_dataset("folder", "val", root="photos/", image_size=64)

Names: fashion_mnist (the default), mnist, cifar10, pets, folder, digits. See each module for
where its files are looked for; `verify_dataset(name)` checks them and says what it checked.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable
from pathlib import Path

from vitscope.data.base import DataError, ImageDataset, cache_dir, cache_root, channel_stats, resize_images
from vitscope.data.cifar import load_cifar10, verify_cifar10
from vitscope.data.digits import load_digits
from vitscope.data.folder import load_folder, load_image, verify_folder
from vitscope.data.idx import load_idx, read_idx, verify_idx
from vitscope.data.mixing import cutmix, mix, mixup
from vitscope.data.pets import load_pets, verify_pets
from vitscope.data.transforms import TrainTransform, eval_transform, normalize

DEFAULT_DATASET = "fashion_mnist"


def _fashion_mnist(split, *, root=None, download=True, verify=True):
    return load_idx("fashion_mnist", split, root=root, download=download, verify=verify)


def _mnist(split, *, root=None, download=True, verify=True):
    return load_idx("mnist", split, root=root, download=download, verify=verify)


def _cifar10(split, *, root=None, verify=True):
    return load_cifar10(root, split, verify=verify)


def _pets(split, *, root=None, image_size=144, channels=3, on_error="skip", resize="crop", cache=True):
    return load_pets(
        root, split, image_size=image_size, channels=channels, on_error=on_error, resize=resize, cache=cache
    )


def _folder(
    split,
    *,
    root=None,
    image_size=None,
    channels=3,
    on_error="skip",
    val_fraction=0.1,
    seed=0,
    resize="crop",
    cache=True,
):
    return load_folder(
        root,
        split,
        image_size=image_size,
        channels=channels,
        on_error=on_error,
        val_fraction=val_fraction,
        seed=seed,
        resize=resize,
        cache=cache,
    )


def _digits(split, *, test_fraction=0.2, seed=0):
    return load_digits(split, test_fraction=test_fraction, seed=seed)


# name -> loader; loaders that take image_size decode at that size, the others are resized after.
_LOADERS: dict[str, Callable[..., ImageDataset]] = {
    "fashion_mnist": _fashion_mnist,
    "mnist": _mnist,
    "cifar10": _cifar10,
    "pets": _pets,
    "folder": _folder,
    "digits": _digits,
}


# name -> the channel counts its images can be read as: the files of a fixed layout have theirs, image files are
# decoded to what the model reads (grey or RGB)
CHANNELS: dict[str, tuple[int, ...]] = {"fashion_mnist": (1,), "mnist": (1,), "cifar10": (3,), "pets": (1, 3),
                                        "folder": (1, 3), "digits": (1,)}

_SAID: set[tuple[str, str]] = set()  # the ignored data folders already warned of, by dataset


def list_datasets() -> list[str]:
    return list(_LOADERS)


def dataset_options(name: str) -> set[str]:
    """The keyword arguments `load_dataset(name, ...)` takes for this dataset, e.g. {'channels', ...} for
    folder: a model's reader asks for its own channels where the files can give them."""
    return set(inspect.signature(_check_name(name)).parameters) - {"split"}


def _check_name(name: str) -> Callable[..., ImageDataset]:
    if name not in _LOADERS:
        import difflib

        close = difflib.get_close_matches(name, _LOADERS, n=2)
        hint = f" Did you mean {' or '.join(close)}?" if close else ""
        raise DataError(f"unknown dataset {name!r}.{hint} Known: {', '.join(_LOADERS)}")
    return _LOADERS[name]


def load_dataset(
    name: str = DEFAULT_DATASET,
    split: str = "train",
    *,
    root: str | Path | None = None,
    download: bool = True,
    image_size: int | None = None,
    **kwargs,
) -> ImageDataset:
    """Load one split of a named dataset as uint8 tensors.

    Extra keyword arguments go to the source: `verify` (fashion_mnist, mnist, cifar10),
    `channels`, `on_error`, `resize`, `cache` (folder, pets), `val_fraction`, `seed` (folder),
    `test_fraction`, `seed` (digits).
    """
    loader = _check_name(name)
    accepted = inspect.signature(loader).parameters
    unknown = sorted(set(kwargs) - set(accepted))
    if unknown:
        options = ", ".join(p for p in accepted if p not in ("split", "root", "download", "image_size"))
        raise DataError(
            f"dataset {name!r} does not take {', '.join(unknown)}; it takes: {options or 'nothing more'}"
        )
    if image_size is not None and image_size < 1:
        raise DataError(f"image_size must be a positive number of pixels, got {image_size}")
    if "root" in accepted:
        kwargs["root"] = root
    elif root is not None and (name, str(root)) not in _SAID:  # once, not for each split
        _SAID.add((name, str(root)))
        warnings.warn(f"dataset {name!r} reads no files of its own (it ships with its package): the data folder "
                      f"{root} is not used", stacklevel=2)
    if "download" in accepted:
        kwargs["download"] = download
    decodes_at_size = "image_size" in accepted
    if decodes_at_size and image_size is not None:
        kwargs["image_size"] = image_size
    dataset = loader(split, **kwargs)
    if image_size is not None and not decodes_at_size:
        dataset.images = resize_images(dataset.images, image_size)
    return dataset


def verify_dataset(name: str = DEFAULT_DATASET, root: str | Path | None = None) -> list[str]:
    """Check a dataset's files (counts, shapes, checksums where known) without training on them;
    returns one line per check, raises DataError on the first problem."""
    _check_name(name)
    if name in ("fashion_mnist", "mnist"):
        return verify_idx(name, root)
    if name == "cifar10":
        return verify_cifar10(root)
    if name == "pets":
        return verify_pets(root)
    if name == "digits":
        ds_train, ds_test = load_digits("train"), load_digits("test")
        return [f"digits (scikit-learn): {len(ds_train)} train + {len(ds_test)} test images of 1x8x8"]
    return verify_folder(root)


__all__ = [
    "DEFAULT_DATASET",
    "DataError",
    "ImageDataset",
    "TrainTransform",
    "cache_dir",
    "cache_root",
    "channel_stats",
    "cutmix",
    "eval_transform",
    "list_datasets",
    "load_dataset",
    "load_image",
    "mix",
    "mixup",
    "normalize",
    "read_idx",
    "verify_dataset",
]
