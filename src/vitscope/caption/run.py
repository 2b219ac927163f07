"""A trained captioner as `vitscope eval | caption` open it, and the report a finished caption run writes.

    run = open_captioner("runs/caption_quick")         # a run directory: best.safetensors, else last
    run = open_captioner("runs/caption_quick/last.safetensors", vocab_file="vocab.json")
    run.model, run.vocab, run.mean, run.std, run.dataset

A caption checkpoint is a safetensors file like a classifier's: the weights, `config` (the captioner's
own config), `captioner` (its kind and config, `task.captioner_to_dict`), the vocabulary
(`task.VOCAB_KEY`), the normalising mean and std and the run's TrainConfig. A vocabulary given
separately must match the model's output layer (`task.check_vocab`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from vitscope.caption.builders import (
    VOCAB_KEY,
    Captioner,
    captioner_from_dict,
    check_vocab,
    load_vocab,
    vocab_from_metadata,
)
from vitscope.caption.dataset import CaptionDataset
from vitscope.caption.plots import caption_figure, write_caption_explorer
from vitscope.errors import InputError
from vitscope.inspect.probes import run_probes
from vitscope.kernels import apply
from vitscope.sequence.vocab import Vocabulary
from vitscope.weights.files import CAPTIONER_KEY, check_finite, load_checked
from vitscope.weights.model_io import checkpoint_metadata, find_checkpoint, read_metadata


@dataclass
class CaptionRun:
    model: Captioner  # eval mode
    vocab: Vocabulary
    mean: tuple[float, ...]
    std: tuple[float, ...]
    dataset: str | None  # the caption dataset the run trained on
    train_config: dict  # the run's TrainConfig, as saved
    source: Path  # the checkpoint file

    @property
    def image_size(self) -> tuple[int, int]:
        size = self.model.encoder.config.img_size
        return (size, size) if isinstance(size, int) else tuple(size)

    @property
    def channels(self) -> int:
        return self.model.encoder.config.in_chans


def is_caption_checkpoint(source: str | Path) -> bool:
    """Whether `source` (a run directory or a .safetensors file) holds a captioner."""
    meta = checkpoint_metadata(source)
    return meta is not None and (CAPTIONER_KEY in meta or VOCAB_KEY in meta)


def open_captioner(source: str | Path, *, vocab_file: str | Path | None = None, kernels: bool = False) -> CaptionRun:
    """The captioner `source` holds, in eval mode, with its vocabulary (or `vocab_file`'s, checked
    against the output layer); with `kernels`, vitscope's CPU kernels swapped in."""
    from safetensors.torch import load_file

    ckpt = find_checkpoint(source)
    meta = read_metadata(ckpt)
    if CAPTIONER_KEY not in meta:
        raise InputError(f"{ckpt} is not a captioner's checkpoint (no {CAPTIONER_KEY!r} in its metadata); "
                         f"train one with vitscope train --task caption")
    model = meta.build(CAPTIONER_KEY, captioner_from_dict)
    state = load_file(str(ckpt))
    load_checked(model, state, str(ckpt))
    check_finite(state, str(ckpt))
    if vocab_file is not None:
        try:
            vocab = load_vocab(vocab_file)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise InputError(f"{vocab_file} is not a vocabulary file (JSON: {e})") from None
        saved = meta.get(VOCAB_KEY)
        check_vocab(model, vocab)
        if saved is not None and vocab != vocab_from_metadata(meta):
            raise InputError(f"{vocab_file} is not the vocabulary {ckpt.name} was trained with (its words or their "
                             f"ids differ): drop --vocab to use the checkpoint's own")
    else:
        vocab = vocab_from_metadata(meta)
        check_vocab(model, vocab)
    config = meta.json("train_config", dict, {})
    c = model.encoder.config.in_chans
    mean, std = meta.numbers("mean", c, (0.5,) * c), meta.numbers("std", c, (0.5,) * c)
    if kernels:
        apply(model)
    return CaptionRun(model.eval(), vocab, mean, std, meta.get("dataset") or config.get("dataset"), config, ckpt)


# -- the report of a finished caption run ------------------------------------------------------------------
def write_caption_report(run_dir: Path, model: Captioner, vocab: Vocabulary, data: CaptionDataset, *,
                         mean: Sequence[float], std: Sequence[float], beam: int, images: int,
                         title: str) -> list[Path]:
    """caption_attention.png: one panel per generated word with where it looked, for the first test image
    with the most items (the lecture's figure); captions.html: the caption explorer over `images` test
    images. Returns the files written."""
    model.eval()
    written = []
    pick = 0
    if data.scenes is not None:  # a busy scene shows more words looking at more places
        pick = max(range(min(len(data), 50)), key=lambda i: (len(data.scenes[i].items), -i))
    fig = caption_figure(model, data.images[pick], vocab, mean, std, beam=beam,
                         references=data.captions[pick][:2], path=run_dir / "caption_attention.png")
    del fig
    written.append(run_dir / "caption_attention.png")
    if images:
        n = min(images, len(data))
        write_caption_explorer(model, data.images[:n], vocab, run_dir / "captions.html", mean=mean, std=std,
                               beam=beam, references=data.captions[:n],
                               names=data.names[:n] if data.names else None, title=title,
                               probes=run_probes(run_dir))
        written.append(run_dir / "captions.html")
    return written
