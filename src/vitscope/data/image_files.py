"""Image files a user names (PNG, JPEG, ... or folders of them) read as a model's input batch.

The decoding is the training data's (`folder.load_image`): the same decompression-bomb limit, transparency
over white, and a centre crop to the model's aspect before the resize, so a photo is not squashed.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor

from vitscope.data.base import DataError
from vitscope.data.folder import IMAGE_EXTENSIONS, load_image


def find_image_files(paths: Sequence[str | Path]) -> list[Path]:
    """The files named, and the image files under each folder named (sorted, by extension)."""
    files = []
    for p in map(Path, paths):
        if p.is_dir():
            files += sorted(f for f in p.rglob("*") if f.is_file() and f.suffix.lower() in IMAGE_EXTENSIONS
                             and not f.name.startswith("."))
        elif p.is_file():
            files.append(p)
        else:
            raise DataError(f"no image file or folder at {p}; check the path")
    if not files:
        raise DataError(f"no image files found in {', '.join(map(str, paths))}; give PNG or JPEG files or a "
                        f"folder holding them")
    return files


def load_image_files(paths: Sequence[str | Path], *, channels: int, size: tuple[int, int]) -> Tensor:
    """Decode image files to uint8 (B, C, H, W) of `size` = (H, W); the first that cannot be read is a
    DataError naming it."""
    if channels not in (1, 3):
        raise DataError(f"images can be read for 1- or 3-channel models, not {channels} channels")
    out = []
    for p in map(Path, paths):
        if not p.is_file():
            raise DataError(f"no image file at {p}; check the path")
        try:
            out.append(torch.from_numpy(load_image(p, image_size=tuple(size), channels=channels, resize="crop")))
        except DataError as e:
            raise DataError(f"cannot read {p} as an image: {str(e).removeprefix(f'{p}: ')}") from e
    return torch.stack(out)


def read_image_files(files: Sequence[Path], *, channels: int, size: tuple[int, int], named: set[Path] = frozenset()
                     ) -> tuple[Tensor | None, list[Path], list[str]]:
    """(uint8 (B, C, H, W) or None, the files it holds, why each other file was skipped). A file found in a
    folder that does not decode is skipped, so one bad file does not stop a folder; a file in `named` (one
    the user named) still raises."""
    try:
        return load_image_files(files, channels=channels, size=size), list(files), []
    except DataError:
        pass
    xs, kept, skipped = [], [], []
    for f in files:
        try:
            xs.append(load_image_files([f], channels=channels, size=size))
            kept.append(f)
        except DataError as e:
            if f in named:
                raise
            skipped.append(str(e))
    return (torch.cat(xs) if xs else None), kept, skipped
