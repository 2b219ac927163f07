"""Fashion-MNIST scenes: a captioning dataset made from real images that every machine has.

Each image is a canvas of G x G cells of 28 x 28 pixels (G = 2: 56 x 56, G = 3: 84 x 84) holding
1 to 4 Fashion-MNIST items, each exactly filling its cell; empty cells are black, as the items'
own background is. Each image comes with 5 reference captions that name every item and its place,
in different phrasings and item orders:

    a sneaker at the top left and a bag at the bottom right
    top left: sneaker; bottom right: bag
    there is a bag in the bottom right and a sneaker in the top left
    at the bottom right there is a bag, and at the top left a sneaker
    two items: a sneaker (top left) and a bag (bottom right)

Cells are named top/middle/bottom x left/centre/right ("centre" alone for the 3 x 3 middle);
classes by their Fashion-MNIST names in lower case ("t-shirt" for T-shirt/top, "ankle boot").
Each scene records every item's cell, class and source image (`Scene`), so the attention of a word
that names an item can be checked against the right cell.

Generator (`make_scenes`): numpy's PCG64 seeded with (seed, split). Per scene: the number of items
uniform in [min_items, max_items], their cells a uniform sample without replacement, their images
drawn without replacement from a shuffled pass over the split's images (a new pass when one runs
out). Training scenes use only Fashion-MNIST's training images, test scenes only its test images.
Captions are drawn from the same generator: the first two phrasings list items in reading order,
the other three in a random order.

Sizes and content checksums (sha256 of images, captions and scene records; `scenes_checksum`) of
the default configurations, from Debian's dataset-fashion-mnist (the official release):
    ScenesConfig()         train 20,000 x 1x56x56  6cdc107d22a8e975...
                           test   2,000 x 1x56x56  78e1fd1c71df3bbb...
    ScenesConfig(cells=3)  train 20,000 x 1x84x84  265f27a20dd2088d...
                           test   2,000 x 1x84x84  f9b9e4018026bf2d...
    (full digests in CHECKSUMS; `load_scenes` verifies them and refuses a mismatch.) Generating a
    default split takes about a second; `python -m vitscope.caption.scenes` prints the checksums.

Use: `load_scenes("train")`, or `--dataset fmnist_scenes` once the CLI knows the name.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np
import torch
from torch import Tensor

from vitscope.caption.dataset import CaptionDataset
from vitscope.data import DataError, load_dataset
from vitscope.errors import ConfigError
from vitscope.sequence.vocab import tokenize

ITEM = 28  # Fashion-MNIST's side: one item per cell
CLASS_WORDS = ("t-shirt", "trouser", "pullover", "dress", "coat", "sandal", "shirt", "sneaker", "bag",
               "ankle boot")
NUMBER_WORDS = ("no", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
_ROWS = {2: ("top", "bottom"), 3: ("top", "middle", "bottom")}
_COLS = {2: ("left", "right"), 3: ("left", "centre", "right")}
_SEPARATORS = {",", ";", ".", "and"}


def cell_names(cells: int) -> list[str]:
    """Names of the cells in reading order: ['top left', 'top right', ...]."""
    if cells not in _ROWS:
        raise ConfigError(f"scenes have 2 x 2 or 3 x 3 cells, not {cells} x {cells}")
    names = [f"{r} {c}" for r in _ROWS[cells] for c in _COLS[cells]]
    return ["centre" if n == "middle centre" else n for n in names]


def _article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


@dataclass(frozen=True)
class Scene:
    """cells: the grid side G; items: (cell, class) per item in reading order, cell = row * G + col;
    sources: each item's index in its Fashion-MNIST split."""

    cells: int
    items: tuple[tuple[int, int], ...]
    sources: tuple[int, ...] = ()

    def to_dict(self) -> dict:
        return {"cells": self.cells, "items": [list(i) for i in self.items], "sources": list(self.sources)}


@dataclass(frozen=True)
class ScenesConfig:
    cells: int = 2
    min_items: int = 1
    max_items: int = 4
    captions_per_image: int = 5
    train_size: int = 20_000
    test_size: int = 2_000
    seed: int = 0

    def __post_init__(self):
        cell_names(self.cells)  # checks the grid
        if not 1 <= self.min_items <= self.max_items <= self.cells**2:
            raise ConfigError(f"need 1 <= min_items <= max_items <= {self.cells**2} cells, "
                             f"got {self.min_items}..{self.max_items}")
        if not 1 <= self.captions_per_image <= len(_PHRASINGS):
            raise ConfigError(f"captions_per_image must be 1..{len(_PHRASINGS)}, got {self.captions_per_image}")


# -- captions ----------------------------------------------------------------------------------------
def _listing(parts: Sequence[str]) -> str:
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]


def _p_at(items):  # a sneaker at the top left and a bag at the bottom right
    return _listing([f"{_article(w)} {w} at the {p}" for p, w in items])


def _p_colon(items):  # top left: sneaker; bottom right: bag
    return "; ".join(f"{p}: {w}" for p, w in items)


def _p_there_is(items):  # there is a bag in the bottom right and a sneaker in the top left
    return "there is " + _listing([f"{_article(w)} {w} in the {p}" for p, w in items])


def _p_at_the(items):  # at the bottom right there is a bag, and at the top left a sneaker
    first = f"at the {items[0][0]} there is {_article(items[0][1])} {items[0][1]}"
    rest = [f"at the {p} {_article(w)} {w}" for p, w in items[1:]]
    if not rest:
        return first
    return first + ", and " + rest[0] if len(rest) == 1 else first + ", " + _listing(rest)


def _p_count(items):  # two items: a sneaker (top left) and a bag (bottom right)
    n = len(items)
    head = f"{NUMBER_WORDS[n]} item{'s' if n > 1 else ''}"
    return head + ": " + _listing([f"{_article(w)} {w} ({p})" for p, w in items])


# (phrasing, whether it keeps reading order)
_PHRASINGS = ((_p_at, True), (_p_colon, True), (_p_there_is, False), (_p_at_the, False), (_p_count, False))


def scene_captions(scene: Scene, rng: np.random.Generator, count: int = 5) -> list[str]:
    names = cell_names(scene.cells)
    items = [(names[cell], CLASS_WORDS[cls]) for cell, cls in scene.items]
    out = []
    for phrase, reading_order in _PHRASINGS[:count]:
        order = items if reading_order else [items[i] for i in rng.permutation(len(items))]
        out.append(phrase(order))
    return out


# -- parsing captions back into items (for the grounded measures) --------------------------------------
def _phrases(cells: int) -> list[tuple[tuple[str, ...], str, int]]:
    """(words, kind, value) for every cell name and class name, longest first."""
    table = [(tuple(n.split()), "cell", i) for i, n in enumerate(cell_names(cells))]
    table += [(tuple(w.split()), "class", k) for k, w in enumerate(CLASS_WORDS)]
    return sorted(table, key=lambda t: -len(t[0]))


def _segments(words: Sequence[str], cells: int):
    """Per clause (split at , ; . and), the cells and classes it names, with the classes' word positions."""
    table = _phrases(cells)
    segments, cur = [], {"cell": [], "class": []}
    i = 0
    while i < len(words):
        if words[i] in _SEPARATORS:
            segments.append(cur)
            cur = {"cell": [], "class": []}
            i += 1
            continue
        for phrase, kind, value in table:
            if tuple(words[i:i + len(phrase)]) == phrase:
                cur[kind].append((value, list(range(i, i + len(phrase)))))
                i += len(phrase)
                break
        else:
            i += 1
    segments.append(cur)
    return segments


def parse_caption(words: Sequence[str] | str, cells: int) -> list[tuple[int, int]]:
    """'a sneaker at the top left and a bag at the bottom right' -> [(0, 7), (3, 8)].

    Each clause that names exactly one cell and one class gives one (cell, class) item; clauses
    that name none, or several of either, give nothing. Handles every phrasing `scene_captions` makes.
    """
    words = tokenize(words) if isinstance(words, str) else list(words)
    found = []
    for seg in _segments(words, cells):
        if len(seg["cell"]) == 1 and len(seg["class"]) == 1:
            found.append((seg["cell"][0][0], seg["class"][0][0]))
    return found


def item_word_targets(words: Sequence[str], scene: Scene) -> list[tuple[int, int]]:
    """(word position, cell) for every word of every class name in the caption whose item is known:
    the scene's item of that class in the clause's cell, else the scene's only item of that class.
    Words naming a class the scene does not hold, or ambiguously, are left out."""
    items = set(scene.items)
    out = []
    for seg in _segments(list(words), scene.cells):
        cell = seg["cell"][0][0] if len(seg["cell"]) == 1 else None
        for cls, positions in seg["class"]:
            if cell is not None and (cell, cls) in items:
                target = cell
            else:
                holders = [c for c, k in scene.items if k == cls]
                if len(holders) != 1:
                    continue
                target = holders[0]
            out += [(p, target) for p in positions]
    return out


def item_accuracy(captions: Sequence[Sequence[str]], scenes: Sequence[Scene]) -> float:
    """Share of all items named with their right class in their right cell."""
    hit = total = 0
    for words, scene in zip(captions, scenes):
        named = set(parse_caption(words, scene.cells))
        hit += sum(item in named for item in scene.items)
        total += len(scene.items)
    return hit / max(total, 1)


def exact_match(captions: Sequence[Sequence[str]], scenes: Sequence[Scene]) -> float:
    """Share of captions whose named (cell, class) items are exactly the scene's, nothing more."""
    ok = 0
    for words, scene in zip(captions, scenes):
        named = parse_caption(words, scene.cells)
        ok += len(named) == len(set(named)) and set(named) == set(scene.items)
    return ok / max(len(scenes), 1)


# -- the generator -----------------------------------------------------------------------------------
_SPLIT_KEYS = {"train": 0, "test": 1}


def make_scenes(images: Tensor, labels: Tensor, count: int, *, config: ScenesConfig = ScenesConfig(),
                split: str = "train") -> tuple[Tensor, list[Scene], list[list[str]]]:
    """`count` scenes from source items images (N, 1, 28, 28) uint8 and labels (N,).

    Returns canvases (count, 1, G·28, G·28) uint8, the scene records and 5 captions each.
    Deterministic in (config.seed, split).
    """
    if split not in _SPLIT_KEYS:
        raise ConfigError(f"scenes have splits 'train' and 'test', not {split!r}")
    if images.dtype != torch.uint8 or tuple(images.shape[1:]) != (1, ITEM, ITEM):
        raise ValueError(f"source items must be uint8 (N, 1, 28, 28), got {images.dtype} {tuple(images.shape)}")
    g = config.cells
    rng = np.random.Generator(np.random.PCG64([config.seed, _SPLIT_KEYS[split]]))
    n_src = images.shape[0]
    pool, pos = rng.permutation(n_src), 0
    src = images.numpy()[:, 0]  # (N, 28, 28)
    canvas = np.zeros((count, g * ITEM, g * ITEM), dtype=np.uint8)  # (count, G·28, G·28)
    scenes, captions = [], []
    for s in range(count):
        k = int(rng.integers(config.min_items, config.max_items + 1))
        cells = np.sort(rng.choice(g * g, size=k, replace=False))
        picks = []
        for _ in range(k):
            if pos == n_src:  # a new pass over the split's items
                pool, pos = rng.permutation(n_src), 0
            picks.append(int(pool[pos]))
            pos += 1
        for cell, i in zip(cells, picks):
            r, c = divmod(int(cell), g)
            canvas[s, r * ITEM:(r + 1) * ITEM, c * ITEM:(c + 1) * ITEM] = src[i]
        scene = Scene(g, tuple((int(cell), int(labels[i])) for cell, i in zip(cells, picks)), tuple(picks))
        scenes.append(scene)
        captions.append(scene_captions(scene, rng, config.captions_per_image))
    return torch.from_numpy(canvas).unsqueeze(1), scenes, captions


def scenes_checksum(images: Tensor, scenes: Sequence[Scene], captions: Sequence[Sequence[str]]) -> str:
    """sha256 over the canvases' bytes, the scene records and the captions (JSON)."""
    h = hashlib.sha256(images.contiguous().numpy().tobytes())
    h.update(json.dumps([[s.to_dict() for s in scenes], list(map(list, captions))]).encode())
    return h.hexdigest()


# Known content of the default configurations: {(cells, split): sha256}; filled from a run of
# `python -m vitscope.caption.scenes` on Debian's dataset-fashion-mnist.
CHECKSUMS: dict[tuple[int, str], str] = {
    (2, "train"): "6cdc107d22a8e97599ef45d24fd042fbe287d28859faad125f7ed93609e8ec06",  # 20000 x 1x56x56
    (2, "test"): "78e1fd1c71df3bbb99a82256f2b4a51b04c3b01a7e5688729c5884aeeaea85b6",  # 2000 x 1x56x56
    (3, "train"): "265f27a20dd2088d0166f4c9525903d962730c5afa38404de570b4947efd7599",  # 20000 x 1x84x84
    (3, "test"): "f9b9e4018026bf2d4a1e8c65e96de6205648efbd5f431ba3d67c410a5ad2a8f7",  # 2000 x 1x84x84
}


def load_scenes(split: str = "train", *, config: ScenesConfig = ScenesConfig(), root=None,
                verify: bool = True) -> CaptionDataset:
    """One split of Fashion-MNIST scenes, generated from vitscope's Fashion-MNIST files.

    With the default sizes and seed the content is checked against CHECKSUMS (a different numpy
    generator or source files would silently give other scenes otherwise).
    """
    if split not in _SPLIT_KEYS:
        raise DataError(f"fmnist_scenes has splits 'train' and 'test', not {split!r}")
    source = load_dataset("fashion_mnist", split, root=root)
    count = config.train_size if split == "train" else config.test_size
    images, scenes, captions = make_scenes(source.images, source.labels, count, config=config, split=split)
    default = ScenesConfig(cells=config.cells)
    known = CHECKSUMS.get((config.cells, split))
    if verify and config == default and known is not None:
        got = scenes_checksum(images, scenes, captions)
        if got != known:
            raise DataError(f"fmnist_scenes {split} ({config.cells}x{config.cells}) has checksum {got[:16]}..., "
                            f"expected {known[:16]}...: the Fashion-MNIST files or numpy's generator differ "
                            "from those it was made with; pass verify=False to use them anyway")
    return CaptionDataset(images=images, captions=captions, name=f"fmnist_scenes{config.cells}",
                          mean=source.mean, std=source.std, names=[f"{split}-{i:05d}" for i in range(count)],
                          scenes=scenes)


def _print_checksums() -> None:
    for cells in (2, 3):
        for split in ("train", "test"):
            ds = load_scenes(split, config=ScenesConfig(cells=cells), verify=False)
            print(f"({cells}, {split!r}): {scenes_checksum(ds.images, ds.scenes, ds.captions)!r},  "
                  f"# {len(ds)} x {'x'.join(map(str, ds.image_shape))}")
    print(json.dumps(asdict(ScenesConfig())))


if __name__ == "__main__":
    _print_checksums()
