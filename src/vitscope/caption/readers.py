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

Every entry is checked against its schema (`COCO_IMAGE`, `KARPATHY_SENTENCE`, ...: each field's JSON
type) before it is used. Problems with the caption file itself are a one-line `DataError` naming the
file, the entry and what to do: a field of the wrong type, images it names that are not there, an
image path that leads outside the image folder ('../', absolute, an image file linked out of its folder; the
folders inside the image folder may be links), an empty caption or
one past MAX_CAPTION_TOKENS, text that is not UTF-8, an unknown split, a file that is not the format.

Images decode through the image-folder source's `load_image` (modes, transparency, corrupt files,
decompression bombs), centre-cropped to `image_size`. Unreadable image files are skipped with a
warning (`on_error="skip"`) or fatal (`on_error="raise"`).
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import torch

from vitscope.caption.dataset import CaptionDataset
from vitscope.data import DataError, channel_stats, load_image
from vitscope.errors import ConfigError
from vitscope.sequence.vocab import tokenize

OnError = Literal["skip", "raise"]


# -- what each entry must hold, checked in one place -------------------------------------------------
# The readers check every entry against these before using it, so a file of the wrong shape fails in one
# line that names the file, the entry and the field, never as a TypeError from deep inside a reader.
@dataclass(frozen=True)
class Field:
    """One field of a JSON entry: the JSON types it may hold and, for the message, what it must be."""

    types: tuple[type, ...]
    must_be: str
    required: bool = True
    items: type | None = None  # a list field: the type of every item
    nonempty: bool = False  # a string field: not empty or only spaces

    def accepts(self, value) -> bool:
        if isinstance(value, bool) and bool not in self.types:  # JSON true/false is not a number
            return False
        if not isinstance(value, self.types):
            return False
        if self.nonempty and isinstance(value, str) and not value.strip():
            return False
        return self.items is None or all(isinstance(v, self.items) for v in value)


COCO_IMAGE = {"id": Field((int, str), "a whole number or a string (the image's id)"),
              "file_name": Field((str,), "a non-empty string (the image's file name in the image folder)",
                                 nonempty=True)}
COCO_ANNOTATION = {"image_id": Field((int, str), "the id of an image in 'images'"),
                   "caption": Field((str,), "a string (the caption's text)")}
KARPATHY_IMAGE = {"filename": Field((str,), "a non-empty string (the image's file name)", nonempty=True),
                  "filepath": Field((str, type(None)), "a string (the image's folder under the image root)",
                                    required=False),
                  "split": Field((str,), "a string (train, restval, val or test)"),
                  "sentences": Field((list,), "a list of sentences, each an object with 'raw' or 'tokens'")}
KARPATHY_SENTENCE = {"raw": Field((str, type(None)), "a string (the caption's text)", required=False),
                     "tokens": Field((list,), "a list of strings (the caption's words)", required=False, items=str)}

# A caption longer than this is no caption (COCO's average about 10 words); the cap keeps a broken
# file (a whole text in one field) from building a vocabulary and a batch of its length.
MAX_CAPTION_TOKENS = 1000


def describe(value) -> str:
    """A JSON value as a message names it: null, true, the number 42, the string 'x', a list (3 items)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return f"the number {value!r}"
    if isinstance(value, str):
        return f"the string {value[:40]!r}" + ("..." if len(value) > 40 else "")
    if isinstance(value, list):
        return f"a list ({len(value)} item{'s' * (len(value) != 1)})"
    return "an object" if isinstance(value, dict) else type(value).__name__


def check_entry(entry, fields: dict[str, Field], source: Path, where: str) -> dict:
    """`entry` if it is an object whose fields have the types `fields` asks for; else one DataError
    line naming `source`, the entry (`where`) and the field."""
    if not isinstance(entry, dict):
        raise DataError(f"{source}: {where} is {describe(entry)}, not an object with "
                        f"{', '.join(repr(n) for n in fields)}; fix that entry")
    for name, f in fields.items():
        if name not in entry:
            if f.required:
                raise DataError(f"{source}: {where} has no {name!r} field; it needs {f.must_be}")
        elif not f.accepts(entry[name]):
            value = entry[name]
            if f.items is not None and isinstance(value, list):
                bad = next(v for v in value if not isinstance(v, f.items))
                raise DataError(f"{source}: {where} has {name!r} holding {describe(bad)}; it must be {f.must_be}")
            raise DataError(f"{source}: {where} has {name!r} {describe(value)}; it must be {f.must_be}")
    return entry


def _read_text(path: Path, what: str) -> str:
    """A text file as UTF-8 (a byte-order mark allowed), or one line naming the file and the bad line."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise DataError(f"{path}:{line}: not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start}); "
                        f"save the {what} file as UTF-8") from e


def _read_json(path: Path, what: str) -> dict:
    if not path.is_file():
        raise DataError(f"{path}: no such {what} file; give the path to it")
    try:
        data = json.loads(_read_text(path, what))
    except (ValueError, RecursionError) as e:  # bad syntax, a number past Python's digit limit, deep nesting
        raise DataError(f"{path}: not valid JSON ({str(e) or type(e).__name__}); is it the {what} file?") from e
    if not isinstance(data, dict) or not isinstance(data.get("images"), list):
        raise DataError(f"{path}: has no 'images' list, so it is not a {what} file")
    return data


def _check_caption(text: str, source: Path, where: str) -> str:
    """A caption's text, stripped; empty or overlong captions are refused (types are checked before)."""
    text = text.strip()
    if not text:
        raise DataError(f"{source}: {where} has an empty caption; remove it or write the caption")
    # a caption of at most MAX_CAPTION_TOKENS characters cannot hold more tokens: most skip the tokeniser
    if len(text) > MAX_CAPTION_TOKENS and (n := len(tokenize(text))) > MAX_CAPTION_TOKENS:
        raise DataError(f"{source}: {where} has a caption of {n:,} words, more than the {MAX_CAPTION_TOKENS:,} "
                        "a caption may have; it is not one caption: split or remove it")
    return text


def _image_files(names: Sequence[str], image_dir: Path, source: Path) -> list[Path]:
    """image_dir/name for every name, each resolved (symlinks followed), so a caption file can read only the
    images in the folder it is given: a name that leads outside it ('../', an absolute path) is refused, and so is
    an image file that is a link out of its folder. The folders inside the image folder may be links (a Karpathy
    root whose train2014/ links to the one copy of the images): the user made them, not the caption file. Then
    every image must be there."""
    base = image_dir.resolve()
    files = []
    for name in names:
        try:
            real = (image_dir / name).resolve()
            # where the name's folder really is (its links followed); a name with '..' or an absolute one must
            # resolve inside the image folder itself
            folder = (image_dir / name).parent.resolve()
            plain = not Path(name).is_absolute() and ".." not in Path(name).parts
        except (OSError, RuntimeError, ValueError) as e:  # a symlink loop, a NUL in the name
            raise DataError(f"{source}: image {name!r} cannot be resolved ({e}); fix the entry or the link") from e
        if not (real.is_relative_to(base) or plain and real.is_relative_to(folder)):
            raise DataError(f"{source}: image {name!r} leads to {real}, outside the image folder {base}; images are "
                            "read only from inside it: move the image there or fix the entry")
        files.append(real)
    missing = [n for n, f in zip(names, files, strict=True) if not f.is_file()]
    if missing:
        raise DataError(f"{source} names {len(missing)} image(s) missing from {image_dir} (first: "
                        f"{missing[0]}); point the image folder at where they are, or remove them from the file")
    return files


def _decode(files: Sequence[Path], names: Sequence[str], captions: list[list[str]], *, source: Path, name: str,
            image_size: int, channels: int, on_error: OnError) -> CaptionDataset:
    """Decode every image (all to image_size x image_size), skipping or refusing unreadable ones."""
    from tqdm import tqdm

    if on_error not in ("skip", "raise"):
        raise ConfigError(f"on_error must be 'skip' or 'raise', got {on_error!r}")

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
        raise DataError(f"{source}: none of its {len(files)} images could be read"
                        + (f" (first: {problems[0]})" if problems else ""))
    images = torch.from_numpy(np.stack(arrays))  # (N, C, S, S) uint8
    mean, std = channel_stats(images)
    return CaptionDataset(images=images, captions=[captions[i] for i in kept], name=name, mean=mean, std=std,
                          names=[Path(names[i]).name for i in kept])


# -- COCO ------------------------------------------------------------------------------------------
def read_coco(captions_file: str | Path) -> tuple[list[str], list[list[str]]]:
    """(file names, captions per image) from a COCO captions_*.json, images in the file's order;
    images without any caption are left out."""
    path = Path(captions_file)
    data = _read_json(path, "COCO captions")
    if not isinstance(data.get("annotations"), list):
        raise DataError(f"{path}: has no 'annotations' list, so it is not a COCO captions file")
    names: dict = {}
    for k, img in enumerate(data["images"]):
        check_entry(img, COCO_IMAGE, path, f"'images' entry {k}")
        if img["id"] in names:
            raise DataError(f"{path}: 'images' entry {k} repeats the id {img['id']!r}; each image needs its own id")
        names[img["id"]] = img["file_name"]
    caps: dict = {i: [] for i in names}
    for k, ann in enumerate(data["annotations"]):
        check_entry(ann, COCO_ANNOTATION, path, f"'annotations' entry {k}")
        if ann["image_id"] not in caps:
            raise DataError(f"{path}: 'annotations' entry {k} is for image id {ann['image_id']!r}, which 'images' "
                            "does not list; the file is inconsistent")
        caps[ann["image_id"]].append(_check_caption(ann["caption"], path, f"'annotations' entry {k}"))
    ids = [i for i in names if caps[i]]
    if not ids:
        raise DataError(f"{path}: no image has a caption ({len(names)} images, {len(data['annotations'])} "
                        "annotations); give a captions_*.json file, whose annotations hold the captions")
    return [names[i] for i in ids], [caps[i] for i in ids]


def load_coco(captions_file: str | Path, image_dir: str | Path, *, image_size: int = 224, channels: int = 3,
              on_error: OnError = "skip") -> CaptionDataset:
    """One COCO split: captions_<split>.json and the folder holding its images."""
    path, image_dir = Path(captions_file), Path(image_dir)
    names, captions = read_coco(path)
    files = _image_files(names, image_dir, path)
    return _decode(files, names, captions, source=path, name=f"coco:{path.stem}", image_size=image_size,
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
    rels, captions, found = [], [], set()
    for k, img in enumerate(data["images"]):
        check_entry(img, KARPATHY_IMAGE, path, f"'images' entry {k}")
        found.add(img["split"])
        if img["split"] not in KARPATHY_SPLITS[split]:
            continue
        rel = str(Path(img.get("filepath") or "") / img["filename"])
        caps = []
        for j, s in enumerate(img["sentences"]):
            where = f"image {rel} ('images' entry {k}), sentence {j}"
            check_entry(s, KARPATHY_SENTENCE, path, where)
            if "raw" not in s and "tokens" not in s:
                raise DataError(f"{path}: {where} has neither 'raw' nor 'tokens'; give its caption in one of them")
            raw = s.get("raw")
            caps.append(_check_caption(raw if raw and raw.strip() else " ".join(s.get("tokens") or []), path, where))
        if not caps:
            raise DataError(f"{path}: image {rel} ('images' entry {k}) has no sentences; remove it or add its captions")
        rels.append(rel)
        captions.append(caps)
    if not rels:
        raise DataError(f"{path}: no image is in split {split!r} (the file has: {', '.join(sorted(found)) or 'none'})")
    return rels, captions


def load_karpathy(split_file: str | Path, image_root: str | Path, split: str = "train", *, image_size: int = 224,
                  channels: int = 3, on_error: OnError = "skip") -> CaptionDataset:
    """One split of dataset_coco.json / dataset_flickr8k.json; images at image_root/filepath/filename."""
    path, root = Path(split_file), Path(image_root)
    rels, captions = read_karpathy(path, split)
    files = _image_files(rels, root, path)
    return _decode(files, rels, captions, source=path, name=f"karpathy:{path.stem}:{split}", image_size=image_size,
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
    for n, line in enumerate(_read_text(path, "Flickr8k token").splitlines(), 1):
        if not line.strip():
            continue
        key, tab, text = line.partition("\t")
        name, hash_, _ = key.partition("#")
        if not tab or not hash_ or not name.strip():
            raise DataError(f"{path}:{n}: expected 'name.jpg#k<TAB>caption', got {line[:60]!r}")
        caps.setdefault(name.strip(), []).append(_check_caption(text, path, f"line {n}"))
    if not caps:
        raise DataError(f"{path}: holds no caption; give Flickr8k.token.txt, lines 'name.jpg#k<TAB>caption'")
    if split is None:
        return list(caps), list(caps.values())
    if split not in FLICKR_SPLIT_FILES:
        raise DataError(f"{path}: unknown split {split!r}; Flickr8k has train, val (dev) and test")
    list_file = path.parent / FLICKR_SPLIT_FILES[split]
    if not list_file.is_file():
        raise DataError(f"{list_file}: the {split} list is not beside {path.name}; put Flickr8k's split lists "
                        "there or read without a split")
    wanted = [w.strip() for w in _read_text(list_file, f"Flickr8k {split} list").splitlines() if w.strip()]
    if not wanted:
        raise DataError(f"{list_file}: names no image; give Flickr8k's {split} list, one image name a line")
    unknown = [w for w in wanted if w not in caps]
    if unknown:
        raise DataError(f"{list_file} names {len(unknown)} image(s) with no caption in {path.name} "
                        f"(first: {unknown[0]}); the two files do not belong together")
    return wanted, [caps[w] for w in wanted]


def load_flickr8k(token_file: str | Path, image_dir: str | Path, split: str | None = None, *,
                  image_size: int = 224, channels: int = 3, on_error: OnError = "skip") -> CaptionDataset:
    path, image_dir = Path(token_file), Path(image_dir)
    names, captions = read_flickr8k(path, split)
    files = _image_files(names, image_dir, path)
    return _decode(files, names, captions, source=path, name=f"flickr8k:{split or 'all'}", image_size=image_size,
                   channels=channels, on_error=on_error)
