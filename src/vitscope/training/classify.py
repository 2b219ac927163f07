"""Classification: a ViT classifier on an image dataset, with the training augmentation, mixing and label
smoothing; its loss is the cross-entropy against the (smoothed, mixed) soft targets, its metric accuracy.

What vitscope has always trained: its numbers are the loop's, bit for bit. Under DDP every rank's rows weigh
the same, so N processes match one process exactly.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vitscope.data import CHANNELS, dataset_options, load_dataset, normalize
from vitscope.errors import ConfigError
from vitscope.inspect.capture import capture_attention, token_layout
from vitscope.inspect.explorer import write_explorer
from vitscope.inspect.probes import run_probes
from vitscope.inspect.stats import head_stats
from vitscope.models import create_model
from vitscope.training.config import TrainConfig
from vitscope.training.curves import plot_confusion, plot_curves, read_metrics
from vitscope.training.evaluation import evaluate
from vitscope.training.probes import PROBES
from vitscope.training.task import (
    Evaluation,
    Metric,
    StepStats,
    TrainResult,
    check_batch,
    check_channels,
    run_facts,
    start_weights,
    write_summary,
)
from vitscope.weights import pretrained

ACCURACY = Metric("accuracy", "test_acc", train_key="train_acc")


def soft_cross_entropy(logits: Tensor, target: Tensor) -> Tensor:
    return torch.sum(-target * F.log_softmax(logits.float(), dim=-1), dim=-1).mean()


@dataclass
class ClassifyTask:
    cfg: TrainConfig
    train_set: object  # ImageDataset
    eval_set: object
    transform: object  # TrainTransform
    model: nn.Module
    kind = "classify"
    unit = "images"
    metric = ACCURACY

    @classmethod
    def build(cls, cfg: TrainConfig, *, resume: bool) -> ClassifyTask:
        check_channels(cfg, CHANNELS)
        image = cfg.image
        # image files are decoded to the channels asked for: the data gives what --set in_chans says
        extra = ({"channels": image.model_args["in_chans"]}
                 if "in_chans" in image.model_args and "channels" in dataset_options(cfg.dataset) else {})
        train_set = load_dataset(cfg.dataset, "train", root=image.data_dir, image_size=image.image_size, **extra)
        eval_set = load_dataset(cfg.dataset, cfg.eval_split, root=image.data_dir, image_size=image.image_size, **extra)
        c, h, w = train_set.images.shape[1:]
        if image.model_args.get("in_chans", c) != c:  # the model reads the data's channels: say so before any work
            raise ConfigError(f"--set in_chans={image.model_args['in_chans']}, but {cfg.dataset}'s images have {c} "
                              f"channel{'s' if c != 1 else ''}: drop --set in_chans (the model takes the images' "
                              f"channels)")
        n = len(train_set.classes)
        if image.model_args.get("num_classes", n) != n:  # the head has one output per class of the data
            raise ConfigError(f"--set num_classes={image.model_args['num_classes']}, but {cfg.dataset} has {n} "
                              f"classes: drop --set num_classes (the head takes the data's classes)")
        transform = image.augment.for_dataset(train_set)
        if image.pretrained and image.augment.mean is None and image.augment.std is None:  # the weights' own scale
            transform = replace(transform, mean=(pretrained.MEAN,) * c, std=(pretrained.STD,) * c)
        check_batch(cfg, len(train_set), "images")
        torch.manual_seed(cfg.seed)
        model = create_model(image.model, pretrained=start_weights(cfg, resume),
                             **{"num_classes": len(train_set.classes), "in_chans": c,
                                "img_size": (h, w) if h != w else h, **image.model_args})
        return cls(cfg, train_set, eval_set, transform, model)

    @property
    def label(self) -> str:
        return self.cfg.image.model

    @property
    def train_module(self) -> nn.Module:
        return self.model

    @property
    def train_size(self) -> int:
        return len(self.train_set)

    @property
    def final_reevaluates(self) -> bool:
        """The final evaluation averages shifted views too (--final-eval-shift)."""
        return bool(self.cfg.image.final_eval_shift)

    def batch(self, idx: Tensor, gen: torch.Generator) -> tuple:
        x = self.transform(self.train_set.images[idx], gen)  # (B, C, H, W) float, whole global batch
        y = self.train_set.labels[idx]
        x, target = self.transform.mix(x, y, len(self.train_set.classes), gen, smoothing=self.cfg.label_smoothing)
        return x, y, target

    def loss(self, net, batch, rows, device, bf16):
        x, y, target = (t[rows].to(device) for t in batch)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            logits = net(x)
        loss = soft_cross_entropy(logits, target)
        correct = int((logits.detach().argmax(1) == y).sum())
        return loss, StepStats(loss.item() * len(y), correct, len(y), len(y))

    def evaluate(self, model, *, device, bf16, info, final=False) -> Evaluation:
        shift = self.cfg.image.final_eval_shift if final else 0
        ev = evaluate(model, self.eval_set, self.transform.mean, self.transform.std,
                      batch_size=self.cfg.eval_batch_size, bf16=bf16, device=device, info=info,
                      flip=self.cfg.image.eval_flip, shift=shift)
        return Evaluation(ev["loss"], ev["acc"], detail=ev)

    # -- probes: attention over training (vitscope.inspect.probes) ---------------------------------------------
    @cached_property
    def probe_rows(self) -> list[int]:
        """The probed test images: the first of each of the first PROBES classes."""
        labels = self.eval_set.labels.tolist()
        return [labels.index(c) for c in range(len(self.eval_set.classes)) if c in labels][:PROBES]

    def probe_header(self) -> tuple[dict, Tensor]:
        rows = self.probe_rows
        images = self.eval_set.images[rows]
        layout = token_layout(self.model, images.float())
        labels = self.eval_set.labels[rows].tolist()
        header = {"kind": "classify", "inputs": [{"label": self.eval_set.classes[c]} for c in labels],
                  "grid": list(layout.grid), "num_prefix_tokens": layout.num_prefix_tokens}
        return header, images

    def probe(self, model, *, device, bf16) -> dict[str, Tensor]:
        """Each encoder layer's class-token attention over the patches (K, L, H, P), or where the model has no
        class token the mean attention each patch receives; and each head's mean attention distance (L, H)."""
        x = normalize(self.eval_set.images[self.probe_rows].to(device), self.transform.mean, self.transform.std)
        capture = capture_attention(model, x)
        stats = head_stats(capture)
        p = capture.layout.num_prefix_tokens
        rows = [capture[n][:, :, 0, p:] if p else capture[n].mean(2) for n in stats.names]  # L x (K, H, P)
        return {"attention": torch.stack(rows, 1), "distance": torch.from_numpy(stats.distance)}

    def metadata(self) -> dict[str, str]:
        return {"classes": json.dumps(self.train_set.classes), "mean": json.dumps(list(self.transform.mean)),
                "std": json.dumps(list(self.transform.std)), "dataset": self.cfg.dataset}

    def report(self, run_dir: Path, model: nn.Module, result: TrainResult, final: Evaluation) -> None:
        """curves.png, confusion.png, summary.json and explorer.html."""
        cfg, classes = self.cfg, self.eval_set.classes
        rows = read_metrics(run_dir / "metrics.jsonl")
        plot_curves(rows, run_dir / "curves.png", self.metric, title=f"{cfg.image.model} on {cfg.dataset}")
        conf = final.detail["confusion"]
        plot_confusion(conf, classes, run_dir / "confusion.png",
                       title=f"{cfg.image.model}: test accuracy {100 * final.value:.2f}%")
        write_summary(run_dir, {
            "model": cfg.image.model, "dataset": cfg.dataset, "test_acc": result.value, "best_test_acc": result.best,
            "per_class_acc": {c: float(conf[i, i] / max(conf[i].sum(), 1)) for i, c in enumerate(classes)},
            "test_views": final.detail["views"],
            "last_epoch_test_acc": next((r["test_acc"] for r in reversed(rows) if "test_acc" in r), None),
            **run_facts(cfg, model, result),
        })
        if cfg.explain_images:
            n = min(cfg.explain_images, len(self.eval_set))
            write_explorer(model.eval(), self.eval_set.images[:n], run_dir / "explorer.html",
                           labels=self.eval_set.labels[:n].tolist(), class_names=classes,
                           mean=self.transform.mean, std=self.transform.std, probes=run_probes(run_dir))
