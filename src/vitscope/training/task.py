"""What the one training loop asks of a task, and what a training gives back.

A task is one kind of training (classify: training/classify.py; caption: training/caption.py). It owns its
data, its model, its loss, its evaluation, the metric the evaluation is judged by and the report of a
finished run. The loop owns everything else (order, optimizer, schedule, checkpoints, resume, DDP, signals,
the NaN stop, the run directory):
    task = ClassifyTask.build(cfg, resume=False)              # data loaded, model built (seeded by cfg.seed)
    order = epoch_order(task.train_size, seed, epoch)         # the loop's, for every task
    batch = task.batch(order[i * B : (i + 1) * B], gen)       # the whole global batch, on the CPU
    loss, stats = task.loss(net, batch, rows, device, bf16)   # this rank's rows; net wraps task.train_module
    ev = task.evaluate(ema or model, ...)                     # an Evaluation: ev.value is task.metric's
    task.report(run_dir, model, result, ev)                   # the pictures and summary.json
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch
from torch import Tensor, nn

from vitscope.errors import ConfigError
from vitscope.io import atomic_write
from vitscope.kernels import allocator
from vitscope.training import distributed
from vitscope.training.config import TrainConfig
from vitscope.training.options import IMAGE_TASKS, TASK_OPTIONS, field_defaults


@dataclass(frozen=True)
class Metric:
    """What a task's evaluation is judged by (best.safetensors follows it): its name, the metrics.jsonl field
    that holds it, and whether it reads as a percentage (a fraction in the files)."""

    name: str  # "accuracy", "item accuracy", "CIDEr-D"
    key: str  # the metrics row's field: "test_acc", "test_item_accuracy", "test_cider"
    percent: bool = True
    train_key: str | None = None  # the row field measuring the same on the training batches, if any

    def format(self, value: float | None) -> str:
        if value is None or math.isnan(value):
            return "not evaluated"
        return f"{100 * value:.2f}%" if self.percent else f"{value:.3f}"

    def axis(self) -> str:
        """A plot axis' label."""
        return f"{self.name} (%)" if self.percent else self.name

    def scale(self, value: float) -> float:
        """A stored value as a plot shows it."""
        return 100 * value if self.percent else value


@dataclass
class StepStats:
    """What a step adds to its epoch's running figures: loss_sum / count is the epoch's training loss and
    correct / count its accuracy (samples for a classifier, target tokens for a captioner); `samples` the
    images this rank read."""

    loss_sum: float
    correct: int
    count: int
    samples: int


@dataclass
class Evaluation:
    """One evaluation of a split: its loss, its metric's value, the metrics row's extra fields and what the
    task's report needs (a confusion matrix, captions)."""

    loss: float
    value: float
    row: dict = field(default_factory=dict)
    detail: dict = field(default_factory=dict)


@dataclass
class TrainResult:
    """What a training gives back. `value` is the final evaluation's metric, None when a signal stopped the
    run before it (the final evaluation is skipped then); `best` the best any evaluation reached."""

    run_dir: Path
    metric: Metric
    value: float | None
    best: float
    train_time_s: float
    items_per_s: float  # the task's samples (its `unit`) trained a second
    unit: str = "images"
    stopped: str = "finished"  # "finished" | "signal"

    def describe(self) -> str:
        """e.g. 'accuracy 91.20% (best 91.35%)' or 'CIDEr-D 0.812 (best 0.830)'."""
        return f"{self.metric.name} {self.metric.format(self.value)} (best {self.metric.format(self.best)})"


class Task(Protocol):
    kind: str
    label: str  # what is trained, for the progress bar
    cfg: TrainConfig
    model: nn.Module
    train_module: nn.Module  # what the loop wraps in DDP / torch.compile; its forward takes a batch's inputs
    train_size: int  # the samples an epoch goes through
    unit: str  # what a sample is, for throughputs: "images", "sentences"
    metric: Metric
    final_reevaluates: bool  # whether the final evaluation is not the last epoch's (it averages more views)

    def batch(self, idx: Tensor, gen: torch.Generator) -> tuple: ...
    def loss(self, net: nn.Module, batch: tuple, rows: slice, device: torch.device,
             bf16: bool) -> tuple[Tensor, StepStats]: ...
    def evaluate(self, model: nn.Module, *, device: torch.device, bf16: bool, info: distributed.DistInfo,
                 final: bool = False) -> Evaluation: ...
    def metadata(self) -> dict[str, str]: ...
    def report(self, run_dir: Path, model: nn.Module, result: TrainResult, final: Evaluation) -> None: ...


# -- what every task shares --------------------------------------------------------------------------------
class Losses(nn.Module):
    """A model's training forward, its inputs -> its loss terms (`model.losses(...)`), as one module, so DDP's hooks
    and torch.compile see the whole computation while the model itself stays whole for checkpoints."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, *inputs: Tensor) -> dict[str, Tensor]:
        return self.model.losses(*inputs)


def start_weights(cfg: TrainConfig, resume: bool) -> bool | str:
    """create_model's `pretrained`: timm's weights, a file's, or none; a resumed run has its own (so the
    file is looked for here, when a run starts, and not when a config is read)."""
    if resume:
        return False
    if cfg.image.init_weights is None:
        return cfg.image.pretrained
    if not os.path.isfile(cfg.image.init_weights):
        raise ConfigError(f"init_weights: no file {cfg.image.init_weights}; give a weights file, or none to start "
                          f"afresh")
    return cfg.image.init_weights


def check_channels(cfg: TrainConfig, dataset_channels: dict[str, tuple[int, ...]]) -> None:
    """Before the data is read: an `in_chans` (--set) that the dataset's images can be read as, so that an
    impossible one is one line, not every image skipped or a setting the data silently overrides."""
    given = cfg.image.model_args.get("in_chans")
    can = dataset_channels.get(cfg.dataset)
    if given is None or can is None or given in can:
        return
    said = " or ".join(map(str, can))
    fix = ("drop --set in_chans (the model takes the images' channels)" if len(can) == 1 else
           f"set --set in_chans={' or '.join(map(str, can))}, or drop it")
    raise ConfigError(f"--set in_chans={given}, but {cfg.dataset}'s images can be read as {said} "
                      f"channel{'s' if can != (1,) else ''} only: {fix}")


# A setting a task reads none of is refused before any work, not ignored in silence: another task's options
# (cfg.caption, cfg.translate) and, for a translation, the image options (cfg.image). Every task reads each of
# TrainConfig's own fields.
_FLAGS = {"model_args": "--set", "decoder_args": "--decoder-set"}


def _flags(names: list[str], values, defaults: dict) -> list[str]:
    """The flags that set each of `names` in `values` away from its default."""
    flags = []
    for name in names:
        value = getattr(values, name)
        if value == defaults[name]:
            continue
        if name == "augment":
            base = defaults[name]
            flags += [f"--aug-{f.name.replace('_', '-')}" for f in dataclasses.fields(value)
                      if getattr(value, f.name) != getattr(base, f.name)]
        elif name in _FLAGS:
            flags += [f"{_FLAGS[name]} {key}" for key in value]
        else:
            flags.append("--" + name.replace("_", "-"))
    return flags


def check_unused(cfg: TrainConfig) -> None:
    """Refuse a setting `cfg.task` would not read (another task's options, a translation's image options), naming
    its flag."""
    def set_in(options) -> list[str]:
        return _flags([f.name for f in dataclasses.fields(options)], options, field_defaults(type(options)))

    flags = set_in(cfg.image) if cfg.task not in IMAGE_TASKS and cfg.image is not None else []
    for key in TASK_OPTIONS:
        options = getattr(cfg, key)
        if key != cfg.task and options is not None:
            flags += [f for f in set_in(options) if f not in flags]
    if flags:
        what = {"classify": "a classifier", "caption": "a captioner", "translate": "a translator"}[cfg.task]
        why = " (it reads sentences, not images)" if cfg.task == "translate" else ""
        raise ConfigError(f"--task {cfg.task}: {', '.join(flags)} would be ignored: {what} reads no such "
                          f"setting{why}; drop {'it' if len(flags) == 1 else 'them'}")


def check_batch(cfg: TrainConfig, n: int, what: str) -> None:
    if n < cfg.batch_size:
        raise ConfigError(f"batch_size {cfg.batch_size} is larger than the training set ({n} {what})")


def run_facts(cfg: TrainConfig, model: nn.Module, result: TrainResult) -> dict:
    """The part of summary.json every task writes: how long, how fast, how big, and on what."""
    import numpy as np

    return {
        "train_time_s": round(result.train_time_s, 1), f"{result.unit}_per_s": round(result.items_per_s, 1),
        "parameters": sum(p.numel() for p in model.parameters()), "epochs": cfg.epochs, "seed": cfg.seed,
        "versions": {"torch": torch.__version__, "numpy": np.__version__, "python": platform.python_version()},
        "machine": {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
                    "malloc_mmap_threshold": allocator.applied()},
    }


def write_summary(run_dir: Path, summary: dict) -> None:
    atomic_write(run_dir / "summary.json", lambda tmp: Path(tmp).write_text(json.dumps(summary, indent=2)))
