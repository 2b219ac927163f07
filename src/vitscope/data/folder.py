"""Image folders: one sub-folder per class, decoded once with PIL and cached.

Layouts:
    root/train/<class>/*.png, root/val/<class>/..., root/test/<class>/...   a given split
    root/<class>/*.png                                                       split made here
For the second, a fixed `seed` and `val_fraction` pick the validation images of every class, so
the split is the same on every run and machine.

Decoding is the slow part, so the decoded tensors are cached under the cache directory, keyed by
the file list (paths, sizes, modification times), the image size and the mode: a second run reads
one .npz file. Unreadable files are reported by name and skipped (`on_error="skip"`) or fatal
(`on_error="raise"`). Decompression bombs (more pixels than `PIL.Image.MAX_IMAGE_PIXELS`) are
refused either way.
"""

from __future__ import annotations

import hashlib
import io
import json
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from PIL import Image, ImageOps, UnidentifiedImageError

from vitscope.data.base import DataError, ImageDataset, cache_dir, channel_stats
from vitscope.io import atomic_write_bytes

IMAGE_EXTENSIONS = {".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff", ".ppm", ".pgm", ".pbm"}
OnError = Literal["skip", "raise"]
Resize = Literal["crop", "squash"]
_CACHE_VERSION = 1


def _is_image(path: Path) -> bool:
    return path.is_file() and path.suffix.lower() in IMAGE_EXTENSIONS and not path.name.startswith(".")


def list_classes(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.is_dir() and not p.name.startswith("."))


def scan(directory: Path, classes: Sequence[str]) -> list[tuple[Path, int]]:
    """Every image file under directory/<class>/ with its label, in a fixed (sorted) order."""
    items = []
    for label, name in enumerate(classes):
        class_dir = directory / name
        if class_dir.is_dir():
            items += [(p, label) for p in sorted(class_dir.rglob("*")) if _is_image(p)]
    return items


# -- decoding --------------------------------------------------------------------------------------
def load_image(
    path: str | Path,
    *,
    image_size: int | tuple[int, int] | None = None,
    channels: int = 3,
    resize: Resize = "crop",
) -> np.ndarray:
    """Decode one image file to uint8 (C, H, W). Raises DataError saying why it could not.

    The one decoder of image files in vitscope: training, eval, predict, explain and captioning all
    read through it, so every command has the same decompression-bomb limit (`max_image_pixels`).
    `image_size` is a side, or (height, width). Grayscale, RGBA and palette images are converted to RGB
    (channels=3) or L (channels=1); transparency is composited onto white, as an image viewer shows it.
    """
    path = Path(path)
    if channels not in (1, 3):
        raise DataError(f"images can be read as 1 (grayscale) or 3 (RGB) channels, not {channels}")
    mode = {1: "L", 3: "RGB"}[channels]
    size = None if image_size is None else (
        (image_size, image_size) if isinstance(image_size, int) else (int(image_size[0]), int(image_size[1])))
    try:
        with warnings.catch_warnings():
            # PIL only warns between MAX_IMAGE_PIXELS and twice that; refuse those too.
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(path) as img:
                if size is not None:
                    img.draft(mode, (size[1], size[0]))  # JPEG: decode at a reduced scale
                img = convert_mode(img, mode)
                if size is not None:
                    wh = (size[1], size[0])
                    img = (
                        ImageOps.fit(img, wh, Image.Resampling.BICUBIC)
                        if resize == "crop"
                        else img.resize(wh, Image.Resampling.BICUBIC)
                    )
                array = np.array(img, dtype=np.uint8)  # a writable copy, as torch.from_numpy wants
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise DataError(
            f"{path}: refused as a decompression bomb ({e}); vitscope decodes at most {max_image_pixels():,} "
            "pixels an image. If the image is genuine, shrink it, or raise PIL.Image.MAX_IMAGE_PIXELS before loading"
        ) from e
    except UnidentifiedImageError as e:
        raise DataError(f"{path}: not an image PIL can read ({e})") from e
    except IsADirectoryError as e:
        raise DataError(f"{path}: a folder, not an image file") from e
    except FileNotFoundError as e:
        raise DataError(f"{path}: no such image file") from e
    except (OSError, SyntaxError, ValueError) as e:  # truncated or corrupt data
        raise DataError(f"{path}: cannot decode ({type(e).__name__}: {e})") from e
    if array.ndim == 2:
        array = array[None]  # (1, H, W)
    else:
        array = array.transpose(2, 0, 1)  # (H, W, C) -> (C, H, W)
    return np.ascontiguousarray(array)


def max_image_pixels() -> int:
    """The most pixels an image file may hold: PIL's own limit (PIL.Image.MAX_IMAGE_PIXELS), enforced as a
    hard limit where PIL only warns up to twice it."""
    return int(Image.MAX_IMAGE_PIXELS or 0)


def convert_mode(img: Image.Image, mode: str) -> Image.Image:
    """`img` as PIL mode "L" or "RGB", transparency composited onto white and 16-bit grey scaled to 8."""
    if img.mode == "P":
        img = img.convert("RGBA")  # a palette may carry transparency
    if img.mode in ("RGBA", "LA", "PA") or "transparency" in img.info:
        img = img.convert("RGBA")
        background = Image.new("RGBA", img.size, (255, 255, 255, 255))
        img = Image.alpha_composite(background, img)
    if img.mode in ("I;16", "I;16B", "I;16L", "I"):
        img = img.point(lambda v: v / 256).convert("L")
    return img.convert(mode)


def decode_files(
    paths: Sequence[Path],
    *,
    image_size: int | None,
    channels: int,
    on_error: OnError,
    resize: Resize = "crop",
    desc: str = "decoding",
) -> tuple[np.ndarray, list[int], list[str]]:
    """Decode `paths` into one uint8 array (N, C, H, W); returns it, the indices kept and the
    problems ("path: why") of the files skipped."""
    from tqdm import tqdm

    arrays, kept, problems = [], [], []
    first_shape: tuple[Path, tuple[int, ...]] | None = None
    for i, path in enumerate(tqdm(paths, desc=desc, unit="img", disable=True if len(paths) < 500 else None)):
        try:
            array = load_image(path, image_size=image_size, channels=channels, resize=resize)
        except DataError as e:
            if on_error == "raise":
                raise DataError(f"{e} (pass on_error='skip' to skip unreadable files)") from e
            problems.append(str(e))
            continue
        if first_shape is None:
            first_shape = (path, array.shape)
        elif array.shape != first_shape[1]:
            (p0, s0) = first_shape
            raise DataError(
                f"images have different sizes ({p0} is {s0[2]}x{s0[1]}, {path} is {array.shape[2]}x"
                f"{array.shape[1]}); pass image_size=N (--image-size N) to resize them all to NxN"
            )
        arrays.append(array)
        kept.append(i)
    if not arrays:
        raise DataError(
            f"no readable images among {len(paths)} files" + (f": {problems[0]}" if problems else "")
        )
    return np.stack(arrays), kept, problems


def _cache_key(paths: Sequence[Path], extra: dict) -> str:
    h = hashlib.sha256(json.dumps({**extra, "version": _CACHE_VERSION}, sort_keys=True).encode())
    for p in paths:
        st = p.stat()
        h.update(f"{p.resolve()}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:32]


def decode_cached(
    items: Sequence[tuple[Path, int]],
    *,
    image_size: int | None,
    channels: int,
    on_error: OnError,
    resize: Resize = "crop",
    cache: bool = True,
    desc: str = "decoding",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode (path, label) items into uint8 images and int64 labels, through the decode cache."""
    paths = [p for p, _ in items]
    labels = np.array([label for _, label in items], dtype=np.int64)
    key = _cache_key(paths, {"image_size": image_size, "channels": channels, "resize": resize})
    cache_file = cache_dir("decoded") / f"{key}.npz"
    problems: list[str] = []
    if cache and cache_file.is_file():
        try:
            with np.load(cache_file, allow_pickle=False) as z:
                images, kept, problems = z["images"], z["kept"], [str(s) for s in z["problems"]]
        except (OSError, ValueError, KeyError):
            cache_file.unlink(missing_ok=True)  # a damaged cache entry is just decoded again
            return decode_cached(
                items,
                image_size=image_size,
                channels=channels,
                on_error=on_error,
                resize=resize,
                cache=cache,
                desc=desc,
            )
        if problems and on_error == "raise":
            raise DataError(f"{problems[0]} (pass on_error='skip' to skip unreadable files)")
    else:
        images, kept_list, problems = decode_files(
            paths, image_size=image_size, channels=channels, on_error=on_error, resize=resize, desc=desc
        )
        kept = np.array(kept_list, dtype=np.int64)
        if cache:
            buffer = io.BytesIO()
            np.savez(buffer, images=images, kept=kept, problems=np.array(problems, dtype=str))
            atomic_write_bytes(cache_file, buffer.getvalue())
    if problems:
        shown = "\n  ".join(problems[:10]) + (
            f"\n  ... and {len(problems) - 10} more" if len(problems) > 10 else ""
        )
        warnings.warn(f"skipped {len(problems)} unreadable image file(s):\n  {shown}", stacklevel=3)
    return torch.from_numpy(images), torch.from_numpy(labels[kept])


# -- the dataset -----------------------------------------------------------------------------------
def _made_split(
    items: list[tuple[Path, int]], num_classes: int, split: str, val_fraction: float, seed: int
) -> list[tuple[Path, int]]:
    rng = np.random.default_rng(seed)
    chosen = []
    for label in range(num_classes):
        members = [it for it in items if it[1] == label]
        order = rng.permutation(len(members))
        n_val = int(round(len(members) * val_fraction))
        if len(members) > 1:
            n_val = min(max(n_val, 1 if val_fraction > 0 else 0), len(members) - 1)
        picked = order[:n_val] if split == "val" else order[n_val:]
        chosen += [members[i] for i in sorted(picked)]
    return chosen


def _empty_classes(items: list[tuple[Path, int]], classes: list[str]) -> list[str]:
    found = {label for _, label in items}
    return [c for i, c in enumerate(classes) if i not in found]


def _refuse_empty_classes(items: list[tuple[Path, int]], classes: list[str], where: Path) -> None:
    """Each class sub-folder is an output of the model, so one without images is a mistake (as in
    torchvision's ImageFolder)."""
    empty = _empty_classes(items, classes)
    if empty and len(empty) < len(classes):  # none at all is reported below, with the file types looked for
        raise DataError(f"{where} has class folders with no image files in them: {', '.join(empty)}; "
                        f"add images or remove them (each class folder is a label the model learns)")


def load_folder(
    root: str | Path,
    split: str = "train",
    *,
    image_size: int | None = None,
    channels: int = 3,
    on_error: OnError = "skip",
    val_fraction: float = 0.1,
    seed: int = 0,
    resize: Resize = "crop",
    cache: bool = True,
    name: str = "folder",
) -> ImageDataset:
    """An image folder as a dataset; see the module docstring for the layouts."""
    if root is None:
        raise DataError(
            "the folder dataset needs root=DIR (--data-dir DIR): a folder with one sub-folder per class"
        )
    root = Path(root).expanduser()
    if not root.is_dir():
        raise DataError(f"{root} is not a folder; pass root=DIR with one sub-folder per class")
    if channels not in (1, 3):
        raise DataError(f"channels must be 1 (grayscale) or 3 (RGB), got {channels}")
    if on_error not in ("skip", "raise"):
        raise DataError(f"on_error must be 'skip' or 'raise', got {on_error!r}")
    if split not in ("train", "val", "test"):
        raise DataError(f"split must be 'train', 'val' or 'test', got {split!r}")
    if (root / "train").is_dir():
        classes = list_classes(root / "train")
        split_dir = root / split
        if not split_dir.is_dir():
            present = ", ".join(s for s in ("train", "val", "test") if (root / s).is_dir())
            raise DataError(f"{root} has split folders ({present}) but no {split!r} folder; use one of those")
        unknown = sorted(set(list_classes(split_dir)) - set(classes))
        if unknown:
            raise DataError(f"{split_dir} has classes not in {root / 'train'}: {', '.join(unknown)}")
        items = scan(split_dir, classes)
        _refuse_empty_classes(items if split == "train" else scan(root / "train", classes), classes, root / "train")
    else:
        classes = list_classes(root)
        if split == "test":
            raise DataError(
                f"{root} has no train/val/test sub-folders, so vitscope holds out {val_fraction:.0%} of each "
                "class as its 'val' split: evaluate on that (split='val'; `vitscope train --eval-split val`, "
                "`vitscope eval --split val`), or lay the images out as root/train/<class>/ and root/test/<class>/"
            )
        if not 0.0 <= val_fraction < 1.0:
            raise DataError(f"val_fraction must be in [0, 1), got {val_fraction}")
        everything = scan(root, classes)
        _refuse_empty_classes(everything, classes, root)
        items = _made_split(everything, len(classes), split, val_fraction, seed)
    if not classes:
        raise DataError(f"{root} has no class sub-folders; expected {root}/<class name>/<image files>")
    if not items:
        raise DataError(
            f"no image files ({', '.join(sorted(IMAGE_EXTENSIONS))}) found for split {split!r} under {root}"
        )
    images, labels = decode_cached(
        items,
        image_size=image_size,
        channels=channels,
        on_error=on_error,
        resize=resize,
        cache=cache,
        desc=f"{name} {split}",
    )
    mean, std = channel_stats(images)
    return ImageDataset(images=images, labels=labels, classes=classes, name=name, mean=mean, std=std)


def verify_folder(root: str | Path) -> list[str]:
    """Open every image of every split; one line per split, plus one per unreadable file."""
    if root is None:
        raise DataError("verifying a folder dataset needs root=DIR (--data-dir DIR)")
    root = Path(root).expanduser()
    if not root.is_dir():
        raise DataError(f"{root} is not a folder")
    given = (root / "train").is_dir()
    splits = [s for s in ("train", "val", "test") if (root / s).is_dir()] if given else [""]
    classes = list_classes(root / "train" if given else root)
    lines = []
    for split in splits:
        items = scan(root / split, classes)
        sizes, problems = set(), []
        for path, _ in items:
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("error", Image.DecompressionBombWarning)
                    with Image.open(path) as img:
                        img.load()
                        sizes.add(img.size)
            except Exception as e:  # noqa: BLE001 - every failure is reported by name
                problems.append(f"{path}: {type(e).__name__}: {e}")
        size_text = (
            "x".join(map(str, next(iter(sizes)))) if len(sizes) == 1 else f"{len(sizes)} different sizes"
        )
        lines.append(
            f"{root / split}: {len(items)} images in {len(classes)} classes, {size_text}, "
            f"{len(problems)} unreadable"
        )
        lines += [f"  unreadable: {p}" for p in problems]
        if split in ("", "train"):  # each class folder is a label; one without images cannot be trained
            lines += [f"  no images in class folder: {c} (training refuses it; add images or remove it)"
                      for c in _empty_classes(items, classes)]
    return lines
