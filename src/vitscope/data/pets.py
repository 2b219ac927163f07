"""Oxford-IIIT Pet, the tutorials' dataset, in its published layout:

    root/images/Abyssinian_100.jpg ...
    root/annotations/trainval.txt     lines "Abyssinian_100 1 1 1": image, class id 1..37, species, breed id
    root/annotations/test.txt

Class names come from the image names (the name without its trailing number). The images go
through the folder decoder and its cache, resized to `image_size` (144 like the tutorials).
Get the two archives from https://www.robots.ox.ac.uk/~vgg/data/pets/ (images.tar.gz,
annotations.tar.gz) and unpack them into one folder.
"""

from __future__ import annotations

from pathlib import Path

from vitscope.data.base import DataError, ImageDataset, cache_dir
from vitscope.data.folder import OnError, Resize, decode_cached

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def read_annotations(path: Path) -> list[tuple[str, int]]:
    """(image name, class id 1..37) for every line of trainval.txt / test.txt."""
    entries = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        fields = line.split()
        try:
            entries.append((fields[0], int(fields[1])))
        except (IndexError, ValueError):
            raise DataError(
                f"{path}:{number}: expected 'NAME CLASS_ID SPECIES BREED_ID', got {line!r}"
            ) from None
    return entries


def class_names(entries: list[tuple[str, int]]) -> list[str]:
    names: dict[int, str] = {}
    for image, class_id in entries:
        names.setdefault(class_id, image.rsplit("_", 1)[0])
    ids = sorted(names)
    if ids != list(range(1, len(ids) + 1)):
        raise DataError(f"class ids must run 1..N without gaps, found {ids[:5]}...{ids[-5:]}")
    return [names[i] for i in ids]


def load_pets(
    root: str | Path | None = None,
    split: str = "train",
    *,
    image_size: int | None = 144,
    channels: int = 3,
    on_error: OnError = "skip",
    resize: Resize = "crop",
    cache: bool = True,
) -> ImageDataset:
    root = Path(root).expanduser() if root is not None else cache_dir("pets")
    files = {"train": "trainval.txt", "test": "test.txt"}
    if split not in files:
        raise DataError(f"pets has splits 'train' (the published trainval list) and 'test', not {split!r}")
    if image_size is None:
        raise DataError("pets images have different sizes: pass image_size=N (144 like the tutorials)")
    annotations = root / "annotations"
    if not (annotations / files[split]).is_file() or not (root / "images").is_dir():
        raise DataError(
            f"Oxford-IIIT Pet not found in {root} (need images/*.jpg and annotations/{files[split]}). "
            "Download images.tar.gz and annotations.tar.gz from https://www.robots.ox.ac.uk/~vgg/data/pets/, "
            f"unpack both into {root} or pass root=DIR (--data-dir DIR)"
        )
    # Class names come from both lists, so train and test agree on the label of every class.
    all_entries = [
        e for f in files.values() if (annotations / f).is_file() for e in read_annotations(annotations / f)
    ]
    classes = class_names(all_entries)
    entries = read_annotations(annotations / files[split])
    missing = [name for name, _ in entries if not (root / "images" / f"{name}.jpg").is_file()]
    if missing:
        raise DataError(
            f"{len(missing)} image(s) listed in {annotations / files[split]} "
            f"are missing from {root / 'images'}, "
            f"e.g. {missing[0]}.jpg; unpack images.tar.gz again"
        )
    items = [(root / "images" / f"{name}.jpg", class_id - 1) for name, class_id in entries]
    images, labels = decode_cached(
        items,
        image_size=image_size,
        channels=channels,
        on_error=on_error,
        resize=resize,
        cache=cache,
        desc=f"pets {split}",
    )
    mean, std = (IMAGENET_MEAN, IMAGENET_STD) if channels == 3 else ((0.449,), (0.226,))
    return ImageDataset(images=images, labels=labels, classes=classes, name="pets", mean=mean, std=std)


def verify_pets(root: str | Path | None = None) -> list[str]:
    root = Path(root).expanduser() if root is not None else cache_dir("pets")
    lines = []
    for f in ("trainval.txt", "test.txt"):
        path = root / "annotations" / f
        if not path.is_file():
            raise DataError(f"{path} not found; unpack annotations.tar.gz into {root}")
        entries = read_annotations(path)
        missing = [n for n, _ in entries if not (root / "images" / f"{n}.jpg").is_file()]
        if missing:
            raise DataError(f"{len(missing)} image(s) listed in {path} are missing, e.g. {missing[0]}.jpg")
        lines.append(
            f"{path}: {len(entries)} entries, {len(class_names(entries))} classes, all images present"
        )
    return lines
