"""What the one training loop trains: a task builds its data and model, turns a batch into a loss, evaluates a
split into metrics and says what a checkpoint carries. The loop owns everything else (order, optimizer,
schedule, checkpoints, resume, DDP, signals, the NaN stop, the run directory).

    task = build_task(cfg, resume=False, criterion=soft_cross_entropy, evaluator=evaluate)
    order = epoch_order(task.train_size, seed, epoch)       # the loop's, for every task
    batch = task.batch(order[i * B : (i + 1) * B], gen)     # the whole global batch, on the CPU
    loss, stats = task.loss(net, batch, rows, device, bf16)  # this rank's rows; net wraps task.train_module
    ev = task.evaluate(ema or model, ...)                    # {'loss', 'acc' (the metric best.safetensors
                                                             #  follows), ...}

ClassifyTask is what vitscope has always trained (its numbers are the loop's, bit for bit); CaptionTask
trains a captioner (vitscope.caption) on one reference caption per image per epoch, drawn from the loop's
generator, so a resumed run draws the same ones. Under DDP each rank's caption loss is the mean over its own
target tokens and DDP averages the ranks' gradients, so N processes match one process to within the ranks'
differing token counts (a classifier's rows weigh the same, so there they match exactly).
"""

from __future__ import annotations

import json
import os
import platform
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Protocol

import numpy as np
import torch
from torch import Tensor, nn

from vitscope.errors import ConfigError
from vitscope.training import distributed as D
from vitscope.training.config import TrainConfig


@dataclass
class StepStats:
    """What a step adds to its epoch's running figures: loss_sum / count is the epoch's training loss and
    correct / count its accuracy (samples for a classifier, target tokens for a captioner); `samples` the
    images this rank read."""

    loss_sum: float
    correct: int
    count: int
    samples: int


class Task(Protocol):
    kind: str
    model: nn.Module
    train_module: nn.Module  # what the loop wraps in DDP / torch.compile; its forward takes a batch's inputs
    train_size: int  # the samples an epoch goes through
    mean: tuple[float, ...]
    std: tuple[float, ...]
    metric_name: str  # what 'acc' measures, for the epoch's line

    def batch(self, idx: Tensor, gen: torch.Generator) -> tuple: ...
    def loss(self, net: nn.Module, batch: tuple, rows: slice, device: torch.device,
             bf16: bool) -> tuple[Tensor, StepStats]: ...
    def evaluate(self, model: nn.Module, *, device: torch.device, bf16: bool, info: D.DistInfo,
                 final: bool = False) -> dict: ...
    def final_differs(self) -> bool: ...
    def metadata(self) -> dict[str, str]: ...
    def row(self, ev: dict) -> dict: ...
    def report(self, run_dir: Path, cfg: TrainConfig, model: nn.Module, result, final: dict) -> None: ...


# -- classification --------------------------------------------------------------------------------------
@dataclass
class ClassifyTask:
    """A ViT classifier on an image dataset, with the training augmentation, mixing and label smoothing.

    `criterion` (logits, soft targets) -> loss and `evaluator` (the loop's `evaluate`) are given by the loop."""

    cfg: TrainConfig
    train_set: object  # ImageDataset
    eval_set: object
    transform: object  # TrainTransform
    model: nn.Module
    criterion: Callable[[Tensor, Tensor], Tensor]
    evaluator: Callable[..., dict]
    kind = "classify"
    metric_name = "acc"

    @classmethod
    def build(cls, cfg: TrainConfig, *, resume: bool, criterion, evaluator) -> ClassifyTask:
        from vitscope.data import load_dataset
        from vitscope.models import create_model
        from vitscope.weights import pretrained

        train_set = load_dataset(cfg.dataset, "train", root=cfg.data_dir, image_size=cfg.image_size)
        eval_set = load_dataset(cfg.dataset, cfg.eval_split, root=cfg.data_dir, image_size=cfg.image_size)
        c, h, w = train_set.images.shape[1:]
        transform = cfg.augment.for_dataset(train_set)
        if cfg.pretrained and cfg.augment.mean is None and cfg.augment.std is None:  # the weights' own scale
            transform = replace(transform, mean=(pretrained.MEAN,) * c, std=(pretrained.STD,) * c)
        _check_batch(cfg, len(train_set), "images")
        torch.manual_seed(cfg.seed)
        model = create_model(cfg.model, pretrained=start_weights(cfg, resume),
                             **{"num_classes": len(train_set.classes), "in_chans": c,
                                "img_size": (h, w) if h != w else h, **cfg.model_args})
        return cls(cfg, train_set, eval_set, transform, model, criterion, evaluator)

    @property
    def train_module(self) -> nn.Module:
        return self.model

    @property
    def train_size(self) -> int:
        return len(self.train_set)

    @property
    def mean(self):
        return self.transform.mean

    @property
    def std(self):
        return self.transform.std

    def batch(self, idx: Tensor, gen: torch.Generator) -> tuple:
        x = self.transform(self.train_set.images[idx], gen)  # (B, C, H, W) float, whole global batch
        y = self.train_set.labels[idx]
        x, target = self.transform.mix(x, y, len(self.train_set.classes), gen, smoothing=self.cfg.label_smoothing)
        return x, y, target

    def loss(self, net, batch, rows, device, bf16):
        x, y, target = (t[rows].to(device) for t in batch)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            logits = net(x)
        loss = self.criterion(logits, target)
        correct = int((logits.detach().argmax(1) == y).sum())
        return loss, StepStats(loss.item() * len(y), correct, len(y), len(y))

    def evaluate(self, model, *, device, bf16, info, final=False):
        shift = self.cfg.final_eval_shift if final else 0
        return self.evaluator(model, self.eval_set, self.transform.mean, self.transform.std,
                              batch_size=self.cfg.eval_batch_size, bf16=bf16, device=device, info=info,
                              flip=self.cfg.eval_flip, shift=shift)

    def final_differs(self) -> bool:
        """Whether the final evaluation is not the last epoch's (it averages shifted views too)."""
        return bool(self.cfg.final_eval_shift)

    def metadata(self) -> dict[str, str]:
        return {"classes": json.dumps(self.train_set.classes), "mean": json.dumps(list(self.transform.mean)),
                "std": json.dumps(list(self.transform.std)), "dataset": self.cfg.dataset}

    def row(self, ev: dict) -> dict:
        return {}

    def report(self, run_dir, cfg, model, result, final) -> None:
        from vitscope.training.evaluation import write_report

        write_report(run_dir, cfg, model, result, final, self.eval_set, self.transform)


def start_weights(cfg: TrainConfig, resume: bool) -> bool | str:
    """create_model's `pretrained`: timm's weights, a file's, or none; a resumed run has its own (so the
    file is looked for here, when a run starts, and not when a config is read)."""
    if resume:
        return False
    if cfg.init_weights is None:
        return cfg.pretrained
    if not os.path.isfile(cfg.init_weights):
        raise ConfigError(f"init_weights: no file {cfg.init_weights}; give a weights file, or none to start afresh")
    return cfg.init_weights


def _check_batch(cfg: TrainConfig, n: int, what: str) -> None:
    if n < cfg.batch_size:
        raise ConfigError(f"batch_size {cfg.batch_size} is larger than the training set ({n} {what})")


# -- captioning ------------------------------------------------------------------------------------------
class CaptionLosses(nn.Module):
    """The captioner's training forward, images and captions -> its loss terms, as one module, so DDP's
    hooks and torch.compile see the whole computation (the captioner itself stays whole for checkpoints)."""

    def __init__(self, captioner: nn.Module):
        super().__init__()
        self.captioner = captioner

    def forward(self, images: Tensor, tokens: Tensor) -> dict[str, Tensor]:
        return self.captioner.losses(images, tokens)


@dataclass
class CaptionTask:
    """A captioner (`cfg.captioner`: transformer or lstm) with a `cfg.model` ViT encoder, on a caption dataset.

    An epoch reads every training image once, with one of its reference captions drawn from the loop's
    generator. Each evaluation decodes the split (beam `cfg.eval_beam`); its 'acc' is the item accuracy
    on Fashion-MNIST scenes, CIDEr-D elsewhere."""

    cfg: TrainConfig
    train_set: object  # CaptionDataset
    eval_set: object
    transform: object  # TrainTransform (crops and policies; never a flip or mix: they would move the words' places)
    caption: object  # vitscope.caption.task.CaptionTask: vocabulary, captioner config
    model: nn.Module
    first_row: Tensor = field(repr=False)  # (N,) each image's first row in `tokens`
    counts: Tensor = field(repr=False)  # (N,) its reference captions
    tokens: Tensor = field(repr=False)  # (P, T) every reference, <bos> ... <eos> <pad>
    kind = "caption"

    @classmethod
    def build(cls, cfg: TrainConfig, *, resume: bool, **_) -> CaptionTask:
        from vitscope.caption.task import CaptionTask as Captioning
        from vitscope.caption.task import CaptionTaskConfig, load_caption_dataset
        from vitscope.caption.transformer import EncoderSpec

        channels = cfg.model_args.get("in_chans", 3)
        kw = dict(root=cfg.data_dir, image_size=cfg.image_size or 224, channels=channels,
                  captions_file=cfg.captions_file)
        train_set = load_caption_dataset(cfg.dataset, "train", **kw)
        eval_set = load_caption_dataset(cfg.dataset, cfg.eval_split, **kw)
        _check_batch(cfg, len(train_set), "images")
        vocab = train_set.build_vocab(min_count=cfg.vocab_min_count)
        c, h, w = train_set.image_shape
        decoder = {**cfg.decoder_args, "label_smoothing": cfg.label_smoothing}
        config = CaptionTaskConfig(kind=cfg.captioner, decoder=decoder, max_len=cfg.max_len,
                                   encoder=EncoderSpec(cfg.model, dict(cfg.model_args), start_weights(cfg, resume)))
        caption = Captioning(config, vocab)
        torch.manual_seed(cfg.seed)
        model = caption.build_model(in_chans=c, img_size=(h, w) if h != w else h)
        model.config.encoder.pretrained = False  # a checkpoint rebuilds it from its own weights
        index, tokens = caption.pairs(train_set)
        counts = torch.bincount(index, minlength=len(train_set))
        first_row = torch.cumsum(counts, 0) - counts
        return cls(cfg, train_set, eval_set, cfg.augment.for_dataset(train_set), caption, model, first_row, counts,
                   tokens)

    @property
    def train_module(self) -> nn.Module:
        return CaptionLosses(self.model)

    @property
    def train_size(self) -> int:
        return len(self.train_set)

    @property
    def mean(self):
        return self.transform.mean

    @property
    def std(self):
        return self.transform.std

    @property
    def metric_name(self) -> str:
        return "item accuracy" if self.train_set.scenes is not None else "CIDEr-D"

    def batch(self, idx: Tensor, gen: torch.Generator) -> tuple:
        x = self.transform(self.train_set.images[idx], gen)  # (B, C, H, W) float, whole global batch
        pick = (torch.rand(len(idx), generator=gen) * self.counts[idx]).long()  # one reference per image
        return x, self.tokens[self.first_row[idx] + pick]  # (B, T)

    def loss(self, net, batch, rows, device, bf16):
        from vitscope.caption.task import trim_padding

        x, tokens = batch[0][rows].to(device), trim_padding(batch[1][rows]).to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            terms = net(x, tokens)
        loss, targets = terms["loss"], int(terms["targets"])
        return loss, StepStats(float(terms["xent"].item()) * targets, int(terms["correct"]), targets, len(x))

    def evaluate(self, model, *, device, bf16, info, final=False):
        """Every rank decodes the whole split (the figures need every caption; the split is small)."""
        result = self.caption.evaluate(model, self.eval_set, mean=self.transform.mean, std=self.transform.std,
                                       beam=self.cfg.eval_beam, batch_size=min(self.cfg.eval_batch_size, 256),
                                       device=device, bf16=bf16)
        m = result.metrics
        primary = m["item_accuracy"] if "item_accuracy" in m else m["cider"]
        return {"loss": m["loss"], "acc": primary, "metrics": m, "captions": result.captions}

    def final_differs(self) -> bool:
        return False

    def metadata(self) -> dict[str, str]:
        from vitscope.caption.run import CAPTIONER_KEY
        from vitscope.caption.task import captioner_to_dict, vocab_metadata

        return {CAPTIONER_KEY: json.dumps(captioner_to_dict(self.model)), **vocab_metadata(self.caption.vocab),
                "mean": json.dumps(list(self.transform.mean)), "std": json.dumps(list(self.transform.std)),
                "dataset": self.cfg.dataset}

    def row(self, ev: dict) -> dict:
        m = ev["metrics"]
        keys = ("bleu1", "bleu4", "cider", "item_accuracy", "exact_match", "grounding", "grounding_per_layer")
        return {f"test_{k}": m[k] for k in keys if k in m}

    def report(self, run_dir, cfg, model, result, final) -> None:
        """curves.png, summary.json, caption_attention.png (the per-word figure) and captions.html."""
        from vitscope.caption.run import write_caption_report
        from vitscope.caption.vocab import detokenize
        from vitscope.io import atomic_write
        from vitscope.kernels import allocator
        from vitscope.training.curves import plot_curves, read_metrics

        rows = read_metrics(run_dir / "metrics.jsonl")
        plot_curves(rows, run_dir / "curves.png", title=f"{cfg.captioner} captioner ({cfg.model} encoder) on "
                                                        f"{cfg.dataset}: {self.metric_name}")
        summary = {
            "task": "caption", "captioner": cfg.captioner, "model": cfg.model, "dataset": cfg.dataset,
            "test_metric": self.metric_name, "test_acc": result.test_acc, "best_test_acc": result.best_acc,
            "test": dict(final["metrics"]), "examples": [detokenize(w) for w in final["captions"][:8]],
            "train_time_s": round(result.train_time_s, 1), "images_per_s": round(result.images_per_s, 1),
            "parameters": sum(p.numel() for p in model.parameters()), "vocabulary": len(self.caption.vocab),
            "epochs": cfg.epochs, "seed": cfg.seed,
            "versions": {"torch": torch.__version__, "numpy": np.__version__, "python": platform.python_version()},
            "machine": {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
                        "malloc_mmap_threshold": allocator.applied()},
        }
        atomic_write(run_dir / "summary.json", lambda tmp: Path(tmp).write_text(json.dumps(summary, indent=2)))
        write_caption_report(run_dir, model.eval(), self.caption.vocab, self.eval_set,
                             mean=self.transform.mean, std=self.transform.std, beam=max(self.cfg.eval_beam, 3),
                             images=cfg.explain_images, title=f"{cfg.captioner} captioner on {cfg.dataset}")


def build_task(cfg: TrainConfig, *, resume: bool, criterion, evaluator) -> Task:
    """The task `cfg.task` names, its data loaded and its model built (seeded by cfg.seed)."""
    if cfg.task == "caption":
        return CaptionTask.build(cfg, resume=resume)
    return ClassifyTask.build(cfg, resume=resume, criterion=criterion, evaluator=evaluator)
