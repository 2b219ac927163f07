"""Before a run's first step: the device and precision chosen, the task and the optimizer built, and the
progress restored from a checkpoint (or started afresh)."""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from vitscope import kernels
from vitscope.errors import ConfigError
from vitscope.kernels import bf16
from vitscope.training import distributed
from vitscope.training.checkpointing import Checkpoint
from vitscope.training.config import TrainConfig
from vitscope.training.optim import build_optimizer
from vitscope.training.progress import Progress
from vitscope.training.resume import load_checkpoint, load_weights_alone
from vitscope.training.task import Task
from vitscope.training.tasks import build_task

# How a run's one seed spreads over its random streams. Each epoch's data order is drawn from
# seed * EPOCH_STRIDE + epoch, a prime stride, so the epochs of neighbouring seeds never share an order; each
# rank's dropout and drop-path from seed + RANK_STRIDE * (rank + 1) (+ the step, where a run restarts from
# weights alone), so ranks differ from each other and from the data order's seeds.
EPOCH_STRIDE = 1_000_003
RANK_STRIDE = 7919


def order_seed(seed: int, epoch: int) -> int:
    """The seed of an epoch's data order (and of the augmentation generator, where a run restarts from weights
    alone at that step)."""
    return seed * EPOCH_STRIDE + epoch


def rank_seed(seed: int, rank: int, step: int = 0) -> int:
    """torch's global seed on `rank`: its dropout and drop-path."""
    return seed + step + RANK_STRIDE * (rank + 1)


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise ConfigError(f"device {name!r} is not a device torch knows ({e}); use auto, cpu, cuda or cuda:N") from e
    if device.type == "cuda":
        if not torch.cuda.is_available():
            why = "this torch is a CPU build" if torch.version.cuda is None else "torch finds no CUDA GPU"
            raise ConfigError(f"device {name!r}: {why}; train with --device cpu (or auto)")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ConfigError(f"device {name!r}: there are {torch.cuda.device_count()} CUDA GPUs, numbered from 0")
    return device


def use_bf16(amp: str, device: torch.device) -> bool:
    if amp != "auto":
        return amp == "bf16"
    # GPUs with bf16 and AVX-512 CPUs run bf16 matmuls natively; elsewhere bf16 is emulated and slow.
    return bf16.native_matmul(device)


@dataclass
class Setup:
    """What a training needs besides its config: the task (its data and model), built before the run
    directory is touched."""

    task: Task
    model: nn.Module
    ema: nn.Module | None
    optimizer: torch.optim.Optimizer
    device: torch.device
    bf16: bool


def setup(cfg: TrainConfig, device: torch.device, *, resume: bool) -> Setup:
    task = build_task(cfg, resume=resume)
    model = task.model
    model.to(device)
    if cfg.kernels and device.type == "cpu":
        kernels.apply(model)
    ema = copy.deepcopy(model).eval() if cfg.ema_decay else None
    for p in ema.parameters() if ema else []:
        p.requires_grad_(False)
    opt = build_optimizer(cfg.optimizer, model, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=cfg.betas,
                          device=device)
    return Setup(task, model, ema, opt, device, use_bf16(cfg.amp, device))


def restore(cfg: TrainConfig, s: Setup, found: Checkpoint | None, gen: torch.Generator, run_dir: Path,
            info: distributed.DistInfo) -> Progress:
    """The run's progress after loading `found` into the model, optimizer and generators (a fresh start
    without it). Weights alone (a state-less checkpoint) restart the optimizer and the generators at its step."""
    if found is None:
        torch.manual_seed(rank_seed(cfg.seed, info.rank))
        return Progress()
    if found.state is not None:
        state = load_checkpoint(found, model=s.model, ema=s.ema, optimizer=s.optimizer, generator=gen)
        return Progress.from_state(state)
    load_weights_alone(found, model=s.model, ema=s.ema)
    gen.manual_seed(order_seed(cfg.seed, found.step))
    torch.manual_seed(rank_seed(cfg.seed, info.rank, found.step))
    rows = [r for r in read_rows(run_dir / "metrics.jsonl") if r.get("step", 0) <= found.step]
    key = s.task.metric.key
    return Progress(step=found.step, best_metric=max((r.get(key, 0.0) for r in rows), default=0.0),
                    train_time_s=rows[-1].get("train_time_s", 0.0) if rows else 0.0,
                    train_cpu_s=rows[-1].get("train_cpu_s", 0.0) if rows else 0.0,
                    seen=found.step * cfg.batch_size)


def read_rows(path: Path) -> list[dict]:
    rows = []
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            rows.append(json.loads(line))
        except ValueError:
            pass
    return [r for r in rows if isinstance(r, dict)]
