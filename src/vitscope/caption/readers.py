"""Readers for the caption files people have, into a `CaptionDataset`.

    load_coco("annotations/captions_val2014.json", "val2014/", image_size=224)
    load_karpathy("dataset_coco.json", "coco/", "train")         # 'restval' goes to train
    load_flickr8k("Flickr8k.token.txt", "Flicker8k_Dataset/", "test")

Formats:
  COCO      {"images": [{"id", "file_name"}], "annotations": [{"image_id", "caption"}]}; one file per split.
  Karpathy  {"images": [{"filename", "filepath"?, "split", "sentences": [{"tokens", "raw"}]}]};
            an image lives at root/filepath/filename; splits train, restval (read as train), val, test.
  Flickr8k  lines "name.jpg#k<TAB>caption"; the split lists Flickr_8k.{train,dev,test}Images.txt
            lie beside the token file ('val' reads the dev list).

Images decode through the image-folder source's `load_image` (modes, transparency, corrupt files,
decompression bombs), centre-cropped to `image_size`. Problems with the caption file itself are a
one-line `DataError` naming the file and what to do: images it names that are not there, an empty
caption, an unknown split, a file that is not the format. Unreadable image files are skipped with a
warning (`on_error="skip"`) or fatal (`on_error="raise"`).
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import numpy as np
import torch

from vitscope.caption.dataset import CaptionDataset
from vitscope.data import DataError, channel_stats, load_image

OnError = Literal["skip", "raise"]


def _read_json(path: Path, what: str) -> dict:
    if not path.is_file():
        raise DataError(f"{path}: no such {what} file; give the path to it")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"{path}: not valid JSON ({e}); is it the {what} file?") from e
    if not isinstance(data, dict) or not isinstance(data.get("images"), list):
        raise DataError(f"{path}: has no 'images' list, so it is not a {what} file")
    return data


def _check_caption(text, source: Path, where: str) -> str:
    if not isinstance(text, str) or not text.strip():
        raise DataError(f"{source}: {where} has an empty caption; remove it or write the caption")
    return text.strip()


def _check_present(files: Sequence[Path], source: Path, image_dir: Path) -> None:
    missing = [f for f in files if not f.is_file()]
    if missing:
        raise DataError(f"{source} names {len(missing)} image(s) missing from {image_dir} (first: "
                        f"{missing[0].name}); point the image folder at where they are, or remove them from the file")


def _decode(files: Sequence[Path], captions: list[list[str]], *, source: Path, name: str, image_size: int,
            channels: int, on_error: OnError) -> CaptionDataset:
    """Decode every image (all to image_size x image_size), skipping or refusing unreadable ones."""
    from tqdm import tqdm

    arrays, kept, problems = [], [], []
    for i, f in enumerate(tqdm(files, desc=f"decoding {name}", unit="img", disable=True if len(files) < 500 else None)):
        try:
            arrays.append(load_image(f, image_size=image_size, channels=channels))
            kept.append(i)
        except DataError as e:
            if on_error == "raise":
                raise DataError(f"{e} (pass on_error='skip' to leave unreadable images out)") from e
            problems.append(str(e))
    if problems:
        warnings.warn(f"{source}: skipped {len(problems)} unreadable image(s), first: {problems[0]}", stacklevel=3)
    if not arrays:
        raise DataError(f"{source}: none of its {len(files)} images could be read")
    images = torch.from_numpy(np.stack(arrays))  # (N, C, S, S) uint8
    mean, std = channel_stats(images)
    return CaptionDataset(images=images, captions=[captions[i] for i in kept], name=name, mean=mean, std=std,
                          names=[files[i].name for i in kept])


# -- COCO ------------------------------------------------------------------------------------------
def read_coco(captions_file: str | Path) -> tuple[list[str], list[list[str]]]:
    """(file names, captions per image) from a COCO captions_*.json, images in the file's order;
    images without any caption are left out."""
    path = Path(captions_file)
    data = _read_json(path, "COCO captions")
    if not isinstance(data.get("annotations"), list):
        raise DataError(f"{path}: has no 'annotations' list, so it is not a COCO captions file")
    try:
        names = {img["id"]: img["file_name"] for img in data["images"]}
        caps: dict = {i: [] for i in names}
        for k, ann in enumerate(data["annotations"]):
            if ann["image_id"] not in caps:
                raise DataError(f"{path}: annotation {k} is for image id {ann['image_id']}, which 'images' "
                                "does not list; the file is inconsistent")
            caps[ann["image_id"]].append(_check_caption(ann["caption"], path, f"annotation {k}"))
    except (KeyError, TypeError) as e:
        raise DataError(f"{path}: an image or annotation lacks the field {e}; not a COCO captions file") from e
    ids = [i for i in names if caps[i]]
    return [names[i] for i in ids], [caps[i] for i in ids]


def load_coco(captions_file: str | Path, image_dir: str | Path, *, image_size: int = 224, channels: int = 3,
              on_error: OnError = "skip") -> CaptionDataset:
    """One COCO split: captions_<split>.json and the folder holding its images."""
    path, image_dir = Path(captions_file), Path(image_dir)
    names, captions = read_coco(path)
    files = [image_dir / n for n in names]
    _check_present(files, path, image_dir)
    return _decode(files, captions, source=path, name=f"coco:{path.stem}", image_size=image_size,
                   channels=channels, on_error=on_error)


# -- Karpathy splits -------------------------------------------------------------------------------
KARPATHY_SPLITS = {"train": ("train", "restval"), "val": ("val",), "test": ("test",)}


def read_karpathy(split_file: str | Path, split: str) -> tuple[list[str], list[list[str]]]:
    """(relative image paths filepath/filename, captions per image) of one split. A sentence's
    'raw' text is used when there, else its 'tokens' joined."""
    path = Path(split_file)
    if split not in KARPATHY_SPLITS:
        raise DataError(f"{path}: unknown split {split!r}; Karpathy files have train (with restval), val and test")
    data = _read_json(path, "Karpathy split")
    rels, captions = [], []
    try:
        for img in data["images"]:
            if img["split"] not in KARPATHY_SPLITS[split]:
                continue
            rel = str(Path(img.get("filepath") or "") / img["filename"])
            caps = []
            for k, s in enumerate(img["sentences"]):
                text = s.get("raw") or " ".join(s.get("tokens") or [])
                caps.append(_check_caption(text, path, f"image {rel}, sentence {k},"))
            if not caps:
                raise DataError(f"{path}: image {rel} has no sentences; remove it or add its captions")
            rels.append(rel)
            captions.append(caps)
    except (KeyError, TypeError) as e:
        raise DataError(f"{path}: an image lacks the field {e}; not a Karpathy split file") from e
    if not rels:
        found = sorted({str(img.get("split")) for img in data["images"] if isinstance(img, dict)})
        raise DataError(f"{path}: no image is in split {split!r} (the file has: {', '.join(found) or 'none'})")
    return rels, captions


def load_karpathy(split_file: str | Path, image_root: str | Path, split: str = "train", *, image_size: int = 224,
                  channels: int = 3, on_error: OnError = "skip") -> CaptionDataset:
    """One split of dataset_coco.json / dataset_flickr8k.json; images at image_root/filepath/filename."""
    path, root = Path(split_file), Path(image_root)
    rels, captions = read_karpathy(path, split)
    files = [root / r for r in rels]
    _check_present(files, path, root)
    return _decode(files, captions, source=path, name=f"karpathy:{path.stem}:{split}", image_size=image_size,
                   channels=channels, on_error=on_error)


# -- Flickr8k --------------------------------------------------------------------------------------
FLICKR_SPLIT_FILES = {"train": "Flickr_8k.trainImages.txt", "val": "Flickr_8k.devImages.txt",
                      "dev": "Flickr_8k.devImages.txt", "test": "Flickr_8k.testImages.txt"}


def read_flickr8k(token_file: str | Path, split: str | None = None) -> tuple[list[str], list[list[str]]]:
    """(image names, captions per image) from Flickr8k.token.txt, in first-seen order; with `split`,
    only the images its list names (Flickr_8k.<split>Images.txt beside the token file)."""
    path = Path(token_file)
    if not path.is_file():
        raise DataError(f"{path}: no such Flickr8k token file; give the path to Flickr8k.token.txt")
    caps: dict[str, list[str]] = {}
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        key, tab, text = line.partition("\t")
        name, hash_, _ = key.partition("#")
        if not tab or not hash_ or not name:
            raise DataError(f"{path}:{n}: expected 'name.jpg#k<TAB>caption', got {line[:60]!r}")
        caps.setdefault(name.strip(), []).append(_check_caption(text, path, f"line {n}"))
    if split is None:
        return list(caps), list(caps.values())
    if split not in FLICKR_SPLIT_FILES:
        raise DataError(f"{path}: unknown split {split!r}; Flickr8k has train, val (dev) and test")
    list_file = path.parent / FLICKR_SPLIT_FILES[split]
    if not list_file.is_file():
        raise DataError(f"{list_file}: the {split} list is not beside {path.name}; put Flickr8k's split lists "
                        "there or read without a split")
    wanted = [w.strip() for w in list_file.read_text(encoding="utf-8").splitlines() if w.strip()]
    unknown = [w for w in wanted if w not in caps]
    if unknown:
        raise DataError(f"{list_file} names {len(unknown)} image(s) with no caption in {path.name} "
                        f"(first: {unknown[0]}); the two files do not belong together")
    return wanted, [caps[w] for w in wanted]


def load_flickr8k(token_file: str | Path, image_dir: str | Path, split: str | None = None, *,
                  image_size: int = 224, channels: int = 3, on_error: OnError = "skip") -> CaptionDataset:
    path, image_dir = Path(token_file), Path(image_dir)
    names, captions = read_flickr8k(path, split)
    files = [image_dir / n for n in names]
    _check_present(files, path, image_dir)
    return _decode(files, captions, source=path, name=f"flickr8k:{split or 'all'}", image_size=image_size,
                   channels=channels, on_error=on_error)
