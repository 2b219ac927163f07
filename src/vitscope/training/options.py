"""The training options only some tasks read: `TrainConfig.image` (ImageOptions) for the tasks that read images
(classify and caption: the model, its starting weights, the images' size and augmentation), None for
`--task translate`; `TrainConfig.caption` (CaptionOptions) for `--task caption`, `TrainConfig.translate`
(TranslateOptions) for `--task translate`, None for any other task.

Each options dataclass checks its own fields, and checks the decoder settings (`decoder_args`,
`--decoder-set`) by building the decoder's own config (its fields, types and ranges are that config's to
say) and the decoder itself on the meta device (its parameters, counted without allocating them, must fit
in this machine's memory). The flags stay flat (`--model`, `--image-size`, `--max-len`, `--translator`,
...): `vitscope train` makes one flag per field of these dataclasses (cli/common.add_dataclass_flags).

A config.json written before the options had their own dataclasses holds these fields at its top level;
`nest_task_options` moves them to where they live now.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Literal

import torch

from vitscope.caption.show_attend_tell import ShowAttendTell, ShowAttendTellConfig
from vitscope.caption.transformer import TransformerCaptioner, TransformerCaptionerConfig
from vitscope.data.transforms import TrainTransform
from vitscope.errors import ConfigError
from vitscope.fields import check_types
from vitscope.training.model_check import check_params_memory
from vitscope.translate.builders import TRANSLATORS

# A decoder's size check builds it for a vocabulary of this many words: the real one is known only once the
# data is read, and a vocabulary's embeddings are a small part of any decoder too large to train.
_CHECK_VOCAB = 64


def _decoder_args_field():
    return field(default_factory=dict, metadata={
        "help": "--task caption / translate: the captioner's or translator's own fields, e.g. {'dim': 128, "
                "'depth': 2} (--decoder-set)"})


def _eval_beam_field():
    return field(default=1, metadata={
        "help": "--task caption / translate: the beam size of each evaluation (1: greedy decoding)"})


def _at_least(name: str, value: int, low: int, what: str = "") -> None:
    if value < low:
        raise ConfigError(f"{name} must be at least {low}{what}, got {value}")


def _check_decoder(kind: str, config_cls, model_cls, given: dict, *, sizes: dict, training: set[str],
                   note: str) -> None:
    """`given` (decoder_args) as fields of `config_cls`: the config built with them (its own types and ranges
    checked), then its model on the meta device, whose parameters must fit in this machine's memory. `sizes`
    fill the fields the data or the options decide; `training` are the fields the training sets, not the
    decoder's."""
    own = {f.name for f in dataclasses.fields(config_cls)} - set(sizes) - training
    unknown = sorted(set(given) - own)
    if unknown:
        raise ConfigError(f"decoder_args: {', '.join(unknown)} not a field of the {kind}; choose from "
                          f"{', '.join(sorted(own))} ({note})")
    try:
        config = config_cls(**sizes, **given)
    except ConfigError as e:
        raise ConfigError(f"decoder field {e}") from None
    with torch.device("meta"):  # counted, not allocated
        model = model_cls(config)
    params = sum(p.numel() for n, p in model.named_parameters() if not n.startswith("encoder."))
    check_params_memory("the decoder", params, "decoder fields (--decoder-set)")


@dataclass
class ImageOptions:
    """The image tasks' fields (`--task classify` and `--task caption`; a translation reads sentences): the ViT
    (a captioner's encoder), the weights it starts from, the images and their augmentation. The test-time views
    (`eval_flip`, `final_eval_shift`) are a classifier's: a captioner refuses them, as it refuses a flip in
    training, since a moved image no longer shows what its caption says."""

    model: str = field(default="vit_fmnist_quick", metadata={"help": "a model preset (`vitscope models` lists them)"})
    model_args: dict = field(default_factory=dict, metadata={"help": "ViTConfig overrides, e.g. {'depth': 8}"})
    pretrained: bool = field(default=False, metadata={
        "help": "start from timm's ImageNet weights for the model (the *_patch16_224 presets; downloaded "
                "once, adapted to the data's classes, channels and size; vitscope.weights.pretrained)"})
    init_weights: str | None = field(default=None, metadata={
        "help": "start the model (--task caption: its encoder) from this weights file: a vitscope run's "
                "best.safetensors or a timm checkpoint (a head of another size is left out, the position table "
                "resized)"})
    data_dir: str | None = field(default=None, metadata={
        "help": "where the dataset's files are; none: its usual places, downloading what is missing"})
    image_size: int | None = field(default=None, metadata={
        "help": "resize to this many pixels a side (image folders, Pets); none: the dataset's own size"})
    augment: TrainTransform = field(default_factory=TrainTransform, metadata={
        "help": "the training augmentation (the --aug-* flags)"})
    eval_flip: bool = field(default=False, metadata={
        "help": "--task classify: evaluate each test image and its mirror image, logits averaged"})
    final_eval_shift: int = field(default=0, metadata={
        "help": "--task classify: the final evaluation also averages each image moved this many pixels left, "
                "right, up and down (with --eval-flip: 10 views); epochs stay cheap"})

    def __post_init__(self):
        if isinstance(self.augment, dict):  # as a config.json holds it
            try:
                self.augment = TrainTransform(**{k: tuple(v) if isinstance(v, list) else v
                                                 for k, v in self.augment.items()})
            except TypeError as e:  # an unknown or missing augmentation field
                known = ", ".join(TrainTransform.__dataclass_fields__)
                raise ConfigError(f"augment: {e}; its fields are {known}") from None

    def validate(self) -> None:
        """The fields on their own; the model against the run's memory is training/model_check's."""
        if isinstance(self.data_dir, os.PathLike):  # a Path given in Python is saved as its text
            self.data_dir = os.fspath(self.data_dir)
        check_types(self)
        if self.image_size is not None:
            _at_least("image_size", self.image_size, 1, " pixel")
        if self.final_eval_shift < 0:
            raise ConfigError(f"final_eval_shift is a number of pixels, at least 0, got {self.final_eval_shift}")
        if self.init_weights is not None and self.pretrained:
            raise ConfigError("pretrained and init_weights both choose the starting weights; give one")


@dataclass
class CaptionOptions:
    """`--task caption`'s own fields: the captioner, its decoder and its data."""

    captioner: Literal["transformer", "lstm"] = field(default="transformer", metadata={
        "help": "--task caption: a transformer decoder, or the LSTM with additive attention (Show, Attend and Tell)"})
    decoder_args: dict = _decoder_args_field()
    max_len: int = field(default=32, metadata={
        "help": "--task caption: the decoder's positions, <bos> and <eos> included: the longest caption it learns"})
    vocab_min_count: int = field(default=1, metadata={
        "help": "--task caption: words seen fewer times in the training captions become <unk>"})
    eval_beam: int = _eval_beam_field()
    captions_file: str | None = field(default=None, metadata={
        "help": "--task caption: the caption file for coco, karpathy or flickr8k (else found under --data-dir)"})

    def validate(self) -> None:
        check_types(self)
        _at_least("max_len", self.max_len, 3, " (<bos>, a word and <eos>)")
        _at_least("vocab_min_count", self.vocab_min_count, 1)
        _at_least("eval_beam", self.eval_beam, 1, " (1: greedy decoding)")
        if self.captioner == "transformer":
            config_cls, model_cls = TransformerCaptionerConfig, TransformerCaptioner
        else:
            config_cls, model_cls = ShowAttendTellConfig, ShowAttendTell
        _check_decoder(f"{self.captioner} captioner", config_cls, model_cls, self.decoder_args,
                       sizes={"vocab_size": _CHECK_VOCAB, "max_len": self.max_len},
                       training={"encoder", "max_len", "label_smoothing"},
                       note="max_len and label_smoothing are training fields")


@dataclass
class TranslateOptions:
    """`--task translate`'s own fields: the translator, its decoder and the synthetic pair's sentences."""

    translator: Literal["rnn", "transformer"] = field(default="rnn", metadata={"help": "--task translate: a GRU "
        "encoder-decoder with additive attention (--decoder-set attention=false: one context vector) or a transformer"})
    decoder_args: dict = _decoder_args_field()
    eval_beam: int = _eval_beam_field()
    train_sentences: int = field(default=20_000, metadata={
        "help": "--task translate: sentence pairs drawn for training (with --seed)"})
    test_sentences: int = field(default=1_000, metadata={
        "help": "--task translate: sentence pairs drawn for testing, none of them a training sentence"})
    max_words: int = field(default=20, metadata={
        "help": "--task translate: the longest source sentence drawn, in words (3 to 60)"})

    def validate(self) -> None:
        check_types(self)
        _at_least("eval_beam", self.eval_beam, 1, " (1: greedy decoding)")
        for name in ("train_sentences", "test_sentences"):
            _at_least(name, getattr(self, name), 1)
        if not 3 <= self.max_words <= 60:
            raise ConfigError(f"max_words must be from 3 (subject, verb, object) to 60, got {self.max_words}")
        model_cls, config_cls = TRANSLATORS[self.translator]
        _check_decoder(f"{self.translator} translator", config_cls, model_cls, self.decoder_args,
                       sizes={"src_vocab_size": _CHECK_VOCAB, "tgt_vocab_size": _CHECK_VOCAB,
                              "max_src_len": self.max_words},
                       training={"max_len", "max_src_len", "label_smoothing"},
                       note="label_smoothing is a training field")


# Each task's options: the TrainConfig field that holds them, and their dataclass.
TASK_OPTIONS = {"caption": CaptionOptions, "translate": TranslateOptions}
# The tasks that read images, and so `TrainConfig.image`.
IMAGE_TASKS = ("classify", "caption")


def field_defaults(cls) -> dict:
    """`cls`'s fields and their default values."""
    return {f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()
            for f in dataclasses.fields(cls)}


def _defaults(cls) -> dict:
    """`cls`'s field defaults as a config.json holds them (a TrainTransform as a dict, tuples as lists)."""
    return json.loads(json.dumps(field_defaults(cls), default=dataclasses.asdict))


def nest_task_options(d: dict) -> dict:
    """A config dict with the options at its top level (a config.json written before they had their own
    dataclasses: the task options before one version, the image options before the next) -> one with them
    under `image` / `caption` / `translate`; a dict already nested comes back as it was. The run's own task
    gets its fields; another task's go along only where they differ from the default, so that the settings a
    task never reads are refused as before (training/task.check_unused)."""
    if not isinstance(d, dict):
        return d
    task = d.get("task", "classify")
    out = _nest_image(d, task)
    flat = {name for cls in TASK_OPTIONS.values() for name in cls.__dataclass_fields__}
    if not flat & out.keys():
        return out
    out = {k: v for k, v in out.items() if k not in flat}
    placed = set()  # a field two tasks share (eval_beam, decoder_args) goes to one of them
    for key in sorted(TASK_OPTIONS, key=lambda k: k != task):  # the run's own task first
        fields = _defaults(TASK_OPTIONS[key])
        mine = {k: d[k] for k in fields if k in d and (key == task or k not in placed and d[k] != fields[k])}
        placed |= mine.keys()
        if key == task or mine:
            out[key] = {**(out.get(key) or {}), **mine}
    return out


def _nest_image(d: dict, task: str) -> dict:
    """The image options at the top of `d` moved under `image`: all of them for an image task, for a translation
    those away from their defaults (refused, as before they moved)."""
    defaults = _defaults(ImageOptions)
    flat = defaults.keys() & d.keys()
    if not flat:
        return d
    mine = {k: d[k] for k in flat if task in IMAGE_TASKS or d[k] != defaults[k]}
    out = {k: v for k, v in d.items() if k not in flat}
    if mine or task in IMAGE_TASKS:
        given = out.get("image")
        out["image"] = {**mine, **(given if isinstance(given, dict) else {})}
    return out
