"""The training loop: a function with explicit inputs (a TrainConfig, a run directory) and outputs.

One process or many under torchrun (DistributedDataParallel). Every epoch's data order comes from
(seed, epoch) and every augmentation from one saved torch.Generator, so a run resumed from any
checkpoint ends with bit-identical weights to one that never stopped. In DDP every rank augments
the whole global batch with the same generator and trains on its slice, so N processes compute
exactly what one process does with the same global batch.
"""

from __future__ import annotations

import copy
import json
import math
import signal
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from tqdm.auto import tqdm

from vitscope import kernels
from vitscope.data import ImageDataset, load_dataset
from vitscope.data.transforms import TrainTransform, eval_transform, tta_views
from vitscope.kernels import allocator, bf16
from vitscope.models import create_model
from vitscope.training import distributed as D
from vitscope.training.optim import OptimizerName, build_optimizer
from vitscope.weights import pretrained
from vitscope.weights.checkpoints import (
    atomic_write,
    load_training_state,
    load_weights,
    save_model,
    save_training_state,
)


@dataclass
class TrainConfig:
    """A training run, resolved. Saved as config.json in the run directory."""

    # Each field's help is its `vitscope train --help` line (HfArgumentParser reads the same metadata).
    model: str = field(default="vit_fmnist_quick", metadata={"help": "a model preset (`vitscope models` lists them)"})
    model_args: dict = field(default_factory=dict, metadata={"help": "ViTConfig overrides, e.g. {'depth': 8}"})
    pretrained: bool = field(default=False, metadata={
        "help": "start from timm's ImageNet weights for the model (the *_patch16_224 presets; downloaded "
                "once, adapted to the data's classes, channels and size; vitscope.weights.pretrained)"})
    dataset: str = field(default="fashion_mnist", metadata={
        "help": "fashion_mnist, mnist, cifar10, pets, folder (an image folder: --data-dir) or digits"})
    data_dir: str | None = field(default=None, metadata={
        "help": "where the dataset's files are; none: its usual places, downloading what is missing"})
    image_size: int | None = field(default=None, metadata={
        "help": "resize to this many pixels a side (image folders, Pets); none: the dataset's own size"})
    eval_split: str = field(default="test", metadata={"help": "the split evaluated after each epoch"})
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
    eval_flip: bool = field(default=False, metadata={
        "help": "evaluate each test image and its mirror image, logits averaged"})
    final_eval_shift: int = field(default=0, metadata={
        "help": "the final evaluation also averages each image moved this many pixels left, right, up and "
                "down (with --eval-flip: 10 views); epochs stay cheap"})
    augment: TrainTransform = field(default_factory=TrainTransform, metadata={
        "help": "the training augmentation (the --aug-* flags)"})
    seed: int = field(default=0, metadata={"help": "seeds the weights, the data order and every augmentation"})
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
        "help": "test images put in the attention explorer at the end (0: no explorer)"})

    def __post_init__(self):
        if isinstance(self.augment, dict):
            self.augment = TrainTransform(**_tuples(self.augment))
        self.betas = tuple(self.betas)
        if self.amp not in ("auto", "bf16", "fp32"):
            raise ValueError(f"amp must be 'auto', 'bf16' or 'fp32', got {self.amp!r}")
        for name in ("epochs", "batch_size", "eval_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.final_eval_shift < 0:
            raise ValueError(f"final_eval_shift is a number of pixels, at least 0, got {self.final_eval_shift}")
        if self.optimizer not in ("adamw", "muon"):
            raise ValueError(f"optimizer must be 'adamw' or 'muon', got {self.optimizer!r}")
        if self.lr <= 0:
            raise ValueError(f"lr must be positive, got {self.lr}")
        if len(self.betas) != 2:
            raise ValueError(f"betas are AdamW's two, e.g. --betas 0.9 0.999; got {len(self.betas)}: {self.betas}")
        if self.threads is not None and self.threads < 0:
            raise ValueError(f"threads is a number of CPU threads (0 or none: torch's default), got {self.threads}")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> TrainConfig:
        unknown = set(d) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown training config fields: {sorted(unknown)}")
        return cls(**d)


def _tuples(d: dict) -> dict:
    return {k: tuple(v) if isinstance(v, list) else v for k, v in d.items()}


class NonFiniteLoss(RuntimeError):
    pass


@dataclass
class TrainResult:
    run_dir: Path
    test_acc: float
    best_acc: float
    train_time_s: float
    images_per_s: float
    stopped: str = "finished"  # "finished" | "signal"


# -- pieces -----------------------------------------------------------------------------------------
def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise ValueError(f"device {name!r} is not a device torch knows ({e}); use auto, cpu, cuda or cuda:N") from e
    if device.type == "cuda":
        if not torch.cuda.is_available():
            why = "this torch is a CPU build" if torch.version.cuda is None else "torch finds no CUDA GPU"
            raise ValueError(f"device {name!r}: {why}; train with --device cpu (or auto)")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"device {name!r}: there are {torch.cuda.device_count()} CUDA GPUs, numbered from 0")
    return device


def compile_options(device: torch.device) -> dict:
    """Inductor options for `--compile`. On a GPU, its coalesce tiling analysis off: torch 2.11's raised an
    AssertionError in it for ViT-S/16's training step (for timm-style ViTs generally, vit-pytorch's too);
    off, the step compiled and ran at 5,845 images/s against 3,042 eager on an H200 (benchmarks/RESULTS.md)."""
    import torch._inductor.config as inductor_config

    if device.type == "cuda" and hasattr(inductor_config.triton, "coalesce_tiling_analysis"):
        return {"triton.coalesce_tiling_analysis": False}
    return {}


def use_bf16(amp: str, device: torch.device) -> bool:
    if amp != "auto":
        return amp == "bf16"
    # GPUs with bf16 and AVX-512 CPUs run bf16 matmuls natively; elsewhere bf16 is emulated and slow.
    return bf16.native_matmul(device)


def lr_at(step: int, total: int, warmup: int, cfg: TrainConfig) -> float:
    """Linear warm-up to cfg.lr, then cosine decay to cfg.min_lr."""
    if step < warmup:
        return cfg.lr * (step + 1) / warmup
    t = (step - warmup) / max(1, total - warmup)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * min(t, 1.0)))


def soft_cross_entropy(logits: Tensor, target: Tensor) -> Tensor:
    return torch.sum(-target * F.log_softmax(logits.float(), dim=-1), dim=-1).mean()


def epoch_order(n: int, seed: int, epoch: int) -> Tensor:
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(n, generator=g)


@torch.no_grad()
def evaluate(model: nn.Module, data: ImageDataset, mean, std, *, batch_size: int = 1000, bf16: bool = False,
             device: torch.device | None = None, info: D.DistInfo | None = None, flip: bool = False,
             shift: int = 0) -> dict:
    """Loss, accuracy and confusion matrix over `data` (sharded over ranks, summed).

    Test-time augmentation, the logits of the views averaged (data.transforms.tta_views): `flip` adds
    each image's mirror image, `shift` the image moved that many pixels each way along each axis.
    """
    device = device or torch.device("cpu")
    info = info or D.DistInfo()
    model.eval()
    k = len(data.classes)
    conf = torch.zeros(k, k, dtype=torch.int64)
    loss_sum = torch.zeros(1, dtype=torch.float64)
    views = []
    idx = torch.arange(info.rank, len(data), info.world_size)
    for s in range(0, len(idx), batch_size):
        b = idx[s : s + batch_size]
        x = eval_transform(data.images[b], mean, std).to(device)
        y = data.labels[b]
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            views = [model(v).float() for v in tta_views(x, flip=flip, shift_px=shift)]
            logits = torch.stack(views).mean(0)
        logits = logits.cpu()
        loss_sum += F.cross_entropy(logits, y, reduction="sum").double()
        conf += torch.bincount(y * k + logits.argmax(1), minlength=k * k).view(k, k)
    D.all_reduce_sum(conf, info)
    D.all_reduce_sum(loss_sum, info)
    n = int(conf.sum())
    return {"loss": float(loss_sum) / n, "acc": float(conf.diag().sum()) / n, "confusion": conf.numpy(),
            "views": len(views)}


class _Stopper:
    """SIGINT/SIGTERM raise a flag; the loop saves a checkpoint at the next step and exits."""

    def __init__(self):
        self.flag = False
        self._old = {}

    def __enter__(self):
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self._old[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread
                pass
        return self

    def _handle(self, signum, frame):
        self.flag = True

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)


def _ema_update(ema: nn.Module, model: nn.Module, decay: float) -> None:
    with torch.no_grad():
        e = [p for p in ema.state_dict().values() if p.dtype.is_floating_point]
        m = [p for p in model.state_dict().values() if p.dtype.is_floating_point]
        torch._foreach_lerp_(e, m, 1 - decay)


# -- the loop ---------------------------------------------------------------------------------------
def train(cfg: TrainConfig, run_dir: str | Path, *, resume: bool = False, progress: bool = True,
          max_steps: int | None = None) -> TrainResult:
    """Train `cfg` into `run_dir`; with `resume`, continue from run_dir's last checkpoint.

    `max_steps` stops after that many optimizer steps in total (tests use it to interrupt a run).
    """
    run_dir = Path(run_dir)
    device = pick_device(cfg.device)
    info = D.setup(device)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    if device.type == "cpu" and cfg.keep_freed_memory:
        allocator.keep_freed_memory()

    train_set = load_dataset(cfg.dataset, "train", root=cfg.data_dir, image_size=cfg.image_size)
    eval_set = load_dataset(cfg.dataset, cfg.eval_split, root=cfg.data_dir, image_size=cfg.image_size)
    c, h, w = train_set.images.shape[1:]
    transform = cfg.augment.for_dataset(train_set)
    if cfg.pretrained and cfg.augment.mean is None and cfg.augment.std is None:  # the weights' own scale
        transform = replace(transform, mean=(pretrained.MEAN,) * c, std=(pretrained.STD,) * c)
    num_classes = len(train_set.classes)

    torch.manual_seed(cfg.seed)
    model = create_model(cfg.model, pretrained=cfg.pretrained and not resume,  # resumed: the run's own weights
                         **{"num_classes": num_classes, "in_chans": c, "img_size": (h, w) if h != w else h,
                            **cfg.model_args})
    model.to(device)
    if cfg.kernels and device.type == "cpu":
        kernels.apply(model)
    bf16 = use_bf16(cfg.amp, device)
    ema = copy.deepcopy(model).eval() if cfg.ema_decay else None
    for p in ema.parameters() if ema else []:
        p.requires_grad_(False)
    opt = build_optimizer(cfg.optimizer, model, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=cfg.betas,
                          device=device)

    steps_per_epoch = len(train_set) // cfg.batch_size
    if steps_per_epoch == 0:
        raise ValueError(f"batch_size {cfg.batch_size} is larger than the training set ({len(train_set)} images)")
    if cfg.batch_size % info.world_size:
        raise ValueError(f"batch_size {cfg.batch_size} must divide evenly over {info.world_size} processes")
    total = steps_per_epoch * cfg.epochs
    warmup = max(1, int(cfg.warmup_epochs * steps_per_epoch))
    local = cfg.batch_size // info.world_size

    gen = torch.Generator().manual_seed(cfg.seed)
    step, best_acc, train_time, seen = 0, 0.0, 0.0, 0
    if resume:
        try:
            state = load_training_state(run_dir / "last.state.pt")
            load_weights(model, run_dir / "last.safetensors")
            opt.load_state_dict(state["optimizer"])
            gen.set_state(state["generator"])
            torch.set_rng_state(state["torch_rng"])
            step, best_acc, train_time, seen = state["step"], state["best_acc"], state["train_time_s"], state["seen"]
            if ema is not None:
                load_weights(ema, run_dir / "last.ema.safetensors")
        except (OSError, ValueError, KeyError) as e:
            what = f"{e.args[0]!r} is missing from its state" if isinstance(e, KeyError) else str(e)
            raise ValueError(f"cannot resume {run_dir}: {what}. Its config can train again from the start: "
                             f"vitscope train --config {run_dir / 'config.json'} --out NEW_DIR") from e
    else:
        torch.manual_seed(cfg.seed + 7919 * (info.rank + 1))  # dropout and drop-path differ per rank

    net = model
    if info.enabled:
        net = nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    if cfg.compile:
        net = torch.compile(net, options=compile_options(device))

    def save(tag: str = "last") -> None:
        if not info.is_main:
            return
        meta = {"train_config": json.dumps(cfg.to_dict()), "classes": json.dumps(train_set.classes),
                "mean": json.dumps(list(transform.mean)), "std": json.dumps(list(transform.std)),
                "dataset": cfg.dataset, "step": str(step)}
        save_model(model, run_dir / f"{tag}.safetensors", metadata=meta)
        if tag == "last":
            if ema is not None:
                save_model(ema, run_dir / "last.ema.safetensors", metadata=meta)
            save_training_state(run_dir / "last.state.pt", {
                "optimizer": opt.state_dict(), "generator": gen.get_state(), "torch_rng": torch.get_rng_state(),
                "step": step, "best_acc": best_acc, "train_time_s": train_time, "seen": seen})

    if info.is_main and not resume:  # made only now that the data and the model are there: a failed start leaves none
        run_dir.mkdir(parents=True, exist_ok=True)
        atomic_write(run_dir / "config.json", lambda tmp: Path(tmp).write_text(json.dumps(cfg.to_dict(), indent=2)))
        (run_dir / "metrics.jsonl").unlink(missing_ok=True)

    def log(row: dict) -> None:
        if info.is_main:
            with open(run_dir / "metrics.jsonl", "a") as f:
                f.write(json.dumps(row) + "\n")

    stopped = "finished"
    end = total if max_steps is None else min(total, max_steps)
    bar = tqdm(total=total, initial=step, disable=not (progress and info.is_main), unit="step",
               dynamic_ncols=True, desc=f"train {cfg.model}")
    ev, ev_step = None, -1  # the latest evaluation and the step it was made at
    with _Stopper() as stopper:
        while step < end:
            epoch, first = divmod(step, steps_per_epoch)
            order = epoch_order(len(train_set), cfg.seed, epoch)
            model.train()
            loss_sum, correct, count = 0.0, 0, 0
            t0 = time.perf_counter()
            for s in range(first, steps_per_epoch):
                if step >= end:
                    break
                idx = order[s * cfg.batch_size : (s + 1) * cfg.batch_size]
                x = transform(train_set.images[idx], gen)  # (B, C, H, W) float, whole global batch
                y = train_set.labels[idx]
                x, target = transform.mix(x, y, num_classes, gen, smoothing=cfg.label_smoothing)
                sl = slice(info.rank * local, (info.rank + 1) * local)
                x, y, target = x[sl].to(device), y[sl].to(device), target[sl].to(device)
                for g in opt.param_groups:
                    g["lr"] = lr_at(step, total, warmup, cfg)
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                    logits = net(x)
                loss = soft_cross_entropy(logits, target)
                if not torch.isfinite(loss):
                    bar.close()
                    raise NonFiniteLoss(
                        f"loss became {loss.item()} at step {step} (epoch {epoch}); the run stopped and "
                        f"{run_dir / 'last.safetensors'} keeps the last good checkpoint. Lower --lr "
                        f"(now {cfg.lr}), set --clip-grad, or try --amp fp32.")
                opt.zero_grad(set_to_none=True)
                loss.backward()
                if cfg.clip_grad:
                    nn.utils.clip_grad_norm_(model.parameters(), cfg.clip_grad)
                opt.step()
                if ema is not None:
                    _ema_update(ema, model, cfg.ema_decay)
                step += 1
                loss_sum += loss.item() * len(y)
                correct += int((logits.argmax(1) == y).sum())
                count += len(y)
                seen += len(y) * info.world_size
                if s % 10 == 0 or s == steps_per_epoch - 1:
                    el = train_time + time.perf_counter() - t0
                    bar.set_postfix(epoch=epoch + 1, loss=f"{loss_sum / count:.3f}", acc=f"{correct / count:.3f}",
                                    img_s=f"{seen / max(el, 1e-9):.0f}", refresh=False)
                bar.update(1)
                if D.any_flag(stopper.flag, info):
                    stopped = "signal"
                    break
            train_time += time.perf_counter() - t0
            epoch_done = step % steps_per_epoch == 0
            if stopped == "signal" or not epoch_done:
                save("last")
                break
            ev = evaluate(ema or model, eval_set, transform.mean, transform.std, batch_size=cfg.eval_batch_size,
                          bf16=bf16, device=device, info=info, flip=cfg.eval_flip)
            # The evaluation is not a step: without this the bar's first rate after it counted its seconds as
            # one step's (the quick preset's time left read 6 hours for a while); its clock shows training time.
            bar.unpause()
            ev_step = step
            row = {"epoch": epoch + 1, "step": step, "lr": lr_at(step - 1, total, warmup, cfg),
                   "train_loss": loss_sum / max(count, 1), "train_acc": correct / max(count, 1),
                   "test_loss": ev["loss"], "test_acc": ev["acc"], "train_time_s": round(train_time, 2),
                   "images_per_s": round(seen / max(train_time, 1e-9), 1) if seen else None}
            log(row)
            if info.is_main:
                bar.write(f"epoch {epoch + 1}/{cfg.epochs}  train loss {row['train_loss']:.4f}  "
                          f"{cfg.eval_split} acc {100 * ev['acc']:.2f}%  ({train_time / 60:.1f} min)")
            if ev["acc"] > best_acc:
                best_acc = ev["acc"]
                save("best")
            save("last")
    bar.close()

    shift = cfg.final_eval_shift if stopped == "finished" else 0  # a stopped run leaves quickly
    final = ev if ev_step == step and not shift else evaluate(
        ema or model, eval_set, transform.mean, transform.std, batch_size=cfg.eval_batch_size, bf16=bf16,
        device=device, info=info, flip=cfg.eval_flip, shift=shift)
    result = TrainResult(run_dir, final["acc"], max(best_acc, final["acc"]), train_time,
                         seen / max(train_time, 1e-9) if seen else 0.0, stopped)
    if info.is_main and stopped == "finished" and step >= total:
        _finish(run_dir, cfg, model, result, final, train_set, eval_set, transform)
    D.teardown(info)
    return result


def _finish(run_dir: Path, cfg: TrainConfig, model: nn.Module, result: TrainResult, final: dict,
            train_set: ImageDataset, eval_set: ImageDataset, transform: TrainTransform) -> None:
    """Pictures and the summary of a finished run."""
    import platform

    from vitscope.training.curves import plot_confusion, plot_curves, read_metrics

    rows = read_metrics(run_dir / "metrics.jsonl")
    plot_curves(rows, run_dir / "curves.png", title=f"{cfg.model} on {cfg.dataset}")
    plot_confusion(final["confusion"], eval_set.classes, run_dir / "confusion.png",
                   title=f"{cfg.model}: test accuracy {100 * final['acc']:.2f}%")
    conf = final["confusion"]
    per_class = {c: float(conf[i, i] / max(conf[i].sum(), 1)) for i, c in enumerate(eval_set.classes)}
    summary = {
        "model": cfg.model, "dataset": cfg.dataset, "test_acc": result.test_acc, "best_test_acc": result.best_acc,
        "per_class_acc": per_class, "train_time_s": round(result.train_time_s, 1),
        "images_per_s": round(result.images_per_s, 1), "parameters": model.num_params(),
        "epochs": cfg.epochs, "seed": cfg.seed,
        "test_views": final["views"],
        "last_epoch_test_acc": next((r["test_acc"] for r in reversed(rows) if "test_acc" in r), None),
        "versions": {"torch": torch.__version__, "numpy": np.__version__, "python": platform.python_version()},
        "machine": {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
                    "malloc_mmap_threshold": allocator.applied()},
    }
    atomic_write(run_dir / "summary.json", lambda tmp: Path(tmp).write_text(json.dumps(summary, indent=2)))
    if cfg.explain_images:
        try:
            from vitscope.inspect.explorer import write_explorer
        except ImportError:
            return
        n = min(cfg.explain_images, len(eval_set))
        images = eval_set.images[:n]
        write_explorer(model.eval(), images, run_dir / "explorer.html", labels=eval_set.labels[:n].tolist(),
                       class_names=eval_set.classes, mean=transform.mean, std=transform.std)
