"""TrainConfig: a training run, resolved, and every check of it, made before any work starts.

Each field is checked for its type (a config file or `--set` can hold anything JSON holds) and for
the range it must lie in; the model fields (`model_args`, `--set`) for the ViTConfig field's type and
range, and the model and the image size against this machine's memory (training/model_check.py). A mistake is a
ValueError that names the field, the value and the range, so `vitscope train` can print it as one line.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field
from typing import Literal

from vitscope.caption.builders import CAPTION_DATASETS
from vitscope.errors import ConfigError
from vitscope.fields import check_types
from vitscope.training.model_check import check_model
from vitscope.training.optim import OptimizerName
from vitscope.training.options import (
    IMAGE_TASKS,
    TASK_OPTIONS,
    CaptionOptions,
    ImageOptions,
    TranslateOptions,
    nest_task_options,
)

# torch seeds are 64-bit and the data order seeds with seed * EPOCH_STRIDE + epoch (training/setup.py); 32 bits
# fit both.
MAX_SEED = 2**32 - 1
# OpenMP's thread count is a C int; past a few thousand no machine has the cores.
MAX_THREADS = 4096


@dataclass
class TrainConfig:
    """A training run, resolved. Saved as config.json in the run directory."""

    # Each field's help is its `vitscope train --help` line (HfArgumentParser reads the same metadata).
    # The image tasks' fields (training/options.py), None for a translation; their flags are flat (--model,
    # --image-size, --aug-*, ...), made from ImageOptions' fields.
    image: ImageOptions | None = field(default_factory=ImageOptions, metadata={
        "help": "--task classify / caption: the model, its starting weights and the images", "flags": "inline"})
    dataset: str = field(default="fashion_mnist", metadata={
        "help": "fashion_mnist, mnist, cifar10, pets, folder (an image folder: --data-dir) or digits"})
    eval_split: str = field(default="test", metadata={
        "help": "the split evaluated after each epoch (--task translate: test or train)"})
    epochs: int = field(default=10, metadata={"help": "passes over the training split"})
    batch_size: int = field(default=256, metadata={"help": "images a step, over all processes together"})
    eval_batch_size: int = field(default=1000, metadata={"help": "images a forward when evaluating"})
    optimizer: OptimizerName = field(default="adamw", metadata={
        "help": "adamw, or muon: Muon on the hidden matrices and AdamW on the rest (optim.py)"})
    lr: float = field(default=2e-3, metadata={"help": "the peak learning rate, reached at the warm-up's end"})
    min_lr: float = field(default=1e-5, metadata={"help": "the learning rate the cosine decay ends at"})
    weight_decay: float = field(default=0.05, metadata={"help": "decoupled weight decay, on weight matrices only"})
    warmup_epochs: float = field(default=1.0, metadata={"help": "epochs of linear warm-up from 0 to --lr"})
    label_smoothing: float = field(default=0.1, metadata={"help": "label smoothing of the targets, 0 for none"})
    clip_grad: float | None = field(default=1.0, metadata={
        "help": "clip the gradients' global norm to this; none: no clipping"})
    betas: tuple[float, float] = field(default=(0.9, 0.999), metadata={"help": "AdamW's betas"})
    amp: Literal["auto", "bf16", "fp32"] = field(default="auto", metadata={
        "help": "bf16: bfloat16 autocast; auto: bf16 where the device multiplies bfloat16 natively (CUDA GPUs "
                "with bfloat16, AVX-512 CPUs), fp32 elsewhere (vitscope.kernels.bf16)"})
    compile: bool = field(default=False, metadata={"help": "train through torch.compile"})
    ema_decay: float | None = field(default=None, metadata={
        "help": "evaluate a moving average of the weights with this decay, e.g. 0.999; none: off"})
    seed: int = field(default=0, metadata={"help": f"seeds the weights, the data order and every augmentation "
                                                   f"(0 to {MAX_SEED})"})
    device: str = field(default="auto", metadata={
        "help": "auto (cuda if there is one, else cpu), cpu, cuda, cuda:1, ..."})
    threads: int | None = field(default=None, metadata={"help": "CPU threads; none or 0: torch's default"})
    # CPU runs: freed tensors stay in the process for the next step (vitscope.kernels.allocator). Measured in
    # this loop: 2% more images/s and 3-5% less wall time, for 53% more peak memory (1.27 -> 1.95 GB,
    # plain 28x28 ViT); so off unless asked for. eval/predict/explain always keep it (1.5x there).
    keep_freed_memory: bool = field(default=False, metadata={
        "help": "CPU: keep freed memory in the process for the next step (2% faster, ~50% more memory)"})
    kernels: bool = field(default=True, metadata={
        "help": "CPU: run vitscope's kernels (vitscope.kernels.apply); false: PyTorch's ops alone"})
    explain_images: int = field(default=6, metadata={
        "help": "test images put in the attention explorer at the end (--task translate: test sentences in "
                "translations.html; 0: no explorer)"})
    task: Literal["classify", "caption", "translate"] = field(default="classify", metadata={
        "help": "classify: a ViT classifier; caption: a captioner whose encoder is --model, on a caption dataset "
                "(fmnist_scenes, fmnist_scenes3, coco, karpathy, flickr8k); translate: a translator on the "
                "synthetic language pair (dataset synthetic_pair)"})
    # Each sequence task's own fields (training/options.py), None for the other tasks; their flags are flat
    # (--max-len, --translator, ...), made from these dataclasses' fields.
    caption: CaptionOptions | None = field(default=None, metadata={
        "help": "--task caption: the captioner, its decoder and its data", "flags": "inline"})
    translate: TranslateOptions | None = field(default=None, metadata={
        "help": "--task translate: the translator, its decoder and its sentences", "flags": "inline"})
    eval_every_steps: int = field(default=0, metadata={
        "help": "also evaluate (and log a metrics row) every this many steps inside an epoch, for finer curves "
                "(0: only at each epoch's end); its time is not training time"})
    # Every epoch's end saves a checkpoint; long epochs on large data want them more often as well.
    checkpoint_every_steps: int = field(default=0, metadata={
        "help": "also save a checkpoint every this many steps (0: only at each epoch's end)"})
    checkpoint_every_minutes: float = field(default=0.0, metadata={
        "help": "also save a checkpoint when this many minutes of training passed since the last (0: off)"})

    def __post_init__(self):
        if isinstance(self.betas, list):
            self.betas = tuple(self.betas)
        if isinstance(self.image, dict):
            try:
                self.image = ImageOptions(**self.image)
            except TypeError as e:  # an unknown field
                known = ", ".join(ImageOptions.__dataclass_fields__)
                raise ConfigError(f"image: {e}; its fields are {known}") from None
        if self.image is None and self.task in IMAGE_TASKS:
            self.image = ImageOptions()
        elif self.task not in IMAGE_TASKS and self.image == ImageOptions():  # a translation's, at its defaults: unread
            self.image = None
        for key, cls in TASK_OPTIONS.items():
            given = getattr(self, key)
            if isinstance(given, dict):
                try:
                    given = cls(**given)
                except TypeError as e:  # an unknown field
                    raise ConfigError(f"{key}: {e}; its fields are {', '.join(cls.__dataclass_fields__)}") from None
            if given is None and key == self.task:
                given = cls()
            elif key != self.task and given == cls():  # another task's options, all at their defaults: unread
                given = None
            setattr(self, key, given)
        self.validate()

    def validate(self) -> None:
        """Raise a ValueError naming the first field that is not of its type or not in its range."""
        _check_types(self)
        if self.task in IMAGE_TASKS:  # a translation's are refused whole (training/task.check_unused)
            if self.image is None:
                raise ConfigError(f"--task {self.task} reads images: image holds their options (ImageOptions), "
                                  f"got none")
            self.image.validate()
        _check_ranges(self)
        if self.task in IMAGE_TASKS:
            check_model(self)

    def options(self) -> CaptionOptions | TranslateOptions | None:
        """The task's own options (`self.caption` or `self.translate`), None for a classifier."""
        return getattr(self, self.task, None) if self.task in TASK_OPTIONS else None

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> TrainConfig:
        """A config from its dict (a run's config.json); one written with the image or task options at its top
        level (before they had their own dataclasses) loads to the same config."""
        if not isinstance(d, dict):
            raise ConfigError(f"a training config is a JSON object of fields (like a run's config.json), "
                             f"got {type(d).__name__} {d!r:.60}")
        d = nest_task_options(d)
        unknown = set(d) - set(cls.__dataclass_fields__)
        if unknown:
            raise ConfigError(f"unknown training config fields: {sorted(unknown)}")
        return cls(**d)


# -- types --------------------------------------------------------------------------------------------
def _check_types(cfg: TrainConfig) -> None:
    if isinstance(cfg.betas, (tuple, list)) and len(cfg.betas) != 2:
        raise ConfigError(f"betas are AdamW's two, e.g. --betas 0.9 0.999; got {len(cfg.betas)}: {tuple(cfg.betas)}")
    check_types(cfg)
    cfg.betas = tuple(cfg.betas)


# -- ranges -------------------------------------------------------------------------------------------
def _finite(name: str, value: float, *, low: float, high: float = math.inf, low_open: bool = False,
            high_open: bool = False, unit: str = "") -> None:
    bad = (not math.isfinite(value) or value < low or (low_open and value == low) or value > high
           or (high_open and value == high))
    if bad:
        lo = f"{'(' if low_open else '['}{low:g}"
        hi = f"{high:g}{')' if high_open else ']'}" if math.isfinite(high) else "inf)"
        raise ConfigError(f"{name} must be a finite number in {lo}, {hi}{unit}, got {value}")


def _at_least(name: str, value: int, low: int, what: str = "") -> None:
    if value < low:
        raise ConfigError(f"{name} must be at least {low}{what}, got {value}")


def _check_ranges(cfg: TrainConfig) -> None:
    for name in ("epochs", "batch_size", "eval_batch_size"):
        _at_least(name, getattr(cfg, name), 1)
    _at_least("explain_images", cfg.explain_images, 0, " (0: no explorer)")
    if cfg.threads is not None and not 0 <= cfg.threads <= MAX_THREADS:
        raise ConfigError(f"threads is a number of CPU threads from 1 to {MAX_THREADS} (0 or none: torch's default), "
                          f"got {cfg.threads}")
    if cfg.optimizer not in ("adamw", "muon"):
        raise ConfigError(f"optimizer must be 'adamw' or 'muon', got {cfg.optimizer!r}")
    if cfg.amp not in ("auto", "bf16", "fp32"):
        raise ConfigError(f"amp must be 'auto', 'bf16' or 'fp32', got {cfg.amp!r}")
    _finite("lr", cfg.lr, low=0, low_open=True)
    _finite("min_lr", cfg.min_lr, low=0)
    _finite("weight_decay", cfg.weight_decay, low=0)
    _finite("warmup_epochs", cfg.warmup_epochs, low=0)
    _finite("label_smoothing", cfg.label_smoothing, low=0, high=1, high_open=True)
    if cfg.clip_grad is not None:
        _finite("clip_grad", cfg.clip_grad, low=0, low_open=True, unit="; none turns clipping off")
    for i, b in enumerate(cfg.betas):
        _finite(f"betas[{i}]", b, low=0, high=1, high_open=True)
    if cfg.ema_decay is not None:
        _finite("ema_decay", cfg.ema_decay, low=0, high=1, low_open=True, high_open=True, unit="; none: no EMA")
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", cfg.device):  # the devices the loop knows how to train on
        raise ConfigError(f"device must be auto, cpu, cuda or cuda:N, got {cfg.device!r}")
    if not 0 <= cfg.seed <= MAX_SEED:
        raise ConfigError(f"seed must be a whole number from 0 to {MAX_SEED}, got {cfg.seed}")
    _at_least("eval_every_steps", cfg.eval_every_steps, 0, " (0: only at each epoch's end)")
    _at_least("checkpoint_every_steps", cfg.checkpoint_every_steps, 0, " (0: only at each epoch's end)")
    _finite("checkpoint_every_minutes", cfg.checkpoint_every_minutes, low=0, unit=" (0: off)")
    # the dataset's name is the data layer's to check (load_dataset, before the run directory is touched): a
    # task may read other datasets than the classification ones
    if cfg.caption is not None and cfg.caption.captions_file is not None and cfg.task != "caption":
        raise ConfigError(f"captions_file is a caption dataset's file, for --task caption; a {cfg.task} run reads "
                          f"none (drop --captions-file)")  # else read by nothing, in silence
    if cfg.options() is not None:  # another task's options are refused whole (training/task.check_unused)
        cfg.options().validate()
    if cfg.task == "caption":
        _check_caption(cfg)
    elif cfg.task == "translate":
        _check_translate(cfg)
    else:
        if cfg.dataset in CAPTION_DATASETS:  # else the data layer's "unknown dataset", with no way forward
            raise ConfigError(f"{cfg.dataset!r} is a captioning dataset: train on it with --task caption "
                              f"(vitscope train --task caption --dataset {cfg.dataset} ...)")
        if cfg.dataset == TRANSLATION_DATASET:
            raise ConfigError(f"{cfg.dataset!r} is the translation task's language pair: train on it with --task "
                              f"translate (vitscope train --task translate --preset translate_rnn)")


def _check_caption(cfg: TrainConfig) -> None:
    """What a captioning run needs besides its own options: a caption dataset, and no augmentation that would
    move or mix what the captions name."""
    if cfg.dataset not in CAPTION_DATASETS:
        raise ConfigError(f"--task caption trains on a caption dataset ({', '.join(CAPTION_DATASETS)}), "
                         f"not {cfg.dataset!r}")
    a = cfg.image.augment
    mirror, crop, mixed = "a mirror image swaps left and right", "a random crop cuts out or moves what they name", (
        "a mixed image holds two images' items")
    moved = [(name, why) for name, on, why in (
        ("flip", a.flip, mirror), ("crop rrc", a.crop == "rrc", crop), ("mixup", a.mixup_alpha > 0, mixed),
        ("cutmix", a.cutmix_alpha > 0, mixed), ("eval_flip", cfg.image.eval_flip, mirror),
        ("final_eval_shift", cfg.image.final_eval_shift > 0, "a shifted image moves its items")) if on]
    if moved:
        whys = "; ".join(dict.fromkeys(why for _, why in moved))
        raise ConfigError(f"--task caption: {', '.join(n for n, _ in moved)} would move or mix what the captions "
                         f"name ({whys}); turn {'it' if len(moved) == 1 else 'them'} off "
                         f"(--aug-flip false, --aug-crop none or pad, ...)")


TRANSLATION_DATASET = "synthetic_pair"


def _check_translate(cfg: TrainConfig) -> None:
    """What a translation run needs besides its own options: the synthetic pair."""
    if cfg.dataset != TRANSLATION_DATASET:
        raise ConfigError(f"--task translate trains on the synthetic language pair (--dataset {TRANSLATION_DATASET}), "
                         f"not {cfg.dataset!r}")
